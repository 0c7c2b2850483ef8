"""``python -m agent.telemetry``: README's "Telemetry fields" table, from the declarations."""

from agent.telemetry.fields import FIELDS
from agent.telemetry.spec import readme_table

print(readme_table(FIELDS), end="")
