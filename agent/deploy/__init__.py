"""Deploying a model version to this device (issue 37; docs/DESIGN.md "Deployments").

The flow, one module per step:

    document   the deployment document (JSON: `cmd/deploy` payload or a file): strict model, canonical form,
               digest
    signing    ed25519 keys and signatures over the canonical form; trusted keys by key id (config `deploy`)
    download   artifacts fetched (https, resumable, size cap, streamed sha256) into the staging area
               (transport: one GET; oci_ref + oci_source: an oci://...@sha256: artifact of a registry)
    staging    the deployment folder's names, staging area and crash-safe writes
    verify     the ONNX and labels against the document and the model format's adapter
    versions   the installed versions of a model, the one serving, rollback and pruning
               (version_files: a version folder's files, record and check, effective_model;
               version_engines: the engines of a pruned version, deleted through the engine store)
    errors     DeployError (one line safe to publish) and its kinds
    gate       agreement of the candidate with the serving model on live frames (by label name)
    shadow     both models on live frames, nothing published: latency p95 and detections ratios
    watch      after promotion: the rollback rules over camera health (judge) and their loop
    state      the stages and the retained `deployments/{model}` state; a journal line per change
    host       DeployHost: what the orchestrator needs from the running agent
    manager    Deployer: documents in, one worker per model, supersede, rollback, start/resume
               (job: a deployment in flight and its record; flow: the stages of one deployment)

A document is parsed and its signature verified before anything is fetched; then download -> verify ->
build and gate -> shadow -> promote -> watch, each stage published on `deployments/{model}`; the model
that serves keeps serving until the new version is promoted, and takes over again on a rollback.

Nothing is imported here: `agent.config` imports `agent.deploy.signing` (trusted keys are checked at load),
so this package must load without the config.
"""
