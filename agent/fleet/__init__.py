"""The fleet side of the agent (issue 38): build claims, engine acquisition, rollouts (docs/DESIGN.md
"Fleet: engine cache, build claims, rollouts")."""
