"""`gym-coordinator admin`: drive a coordinator's REST API over HTTP.

Every command calls one route (`--url`, `--token` or the environment's ZOO_GYM_URL and
ZOO_GYM_TOKEN) and prints the answer as a table or, with `--format json`, as JSON. What a user
can get wrong (an unreachable URL, a missing or refused token, a bad value) prints one line.

One module per command or command group; `common` holds what they share (the client, the
one-line errors, the table and JSON output).
"""

from __future__ import annotations

import typer

from zoo_gym.cli.admin import (
    audit,
    contributors,
    ledger,
    models,
    openapi,
    policy,
    report,
    rewards,
    rounds,
)
from zoo_gym.cli.admin.common import main

app = typer.Typer(
    help="Operate a running coordinator through its REST API.",
    no_args_is_help=True,
    add_completion=False,
)
app.callback()(main)
app.add_typer(rounds.app, name="rounds")
app.add_typer(contributors.app, name="contributors")
app.add_typer(policy.app, name="policy")
app.add_typer(models.app, name="models")
app.add_typer(ledger.app, name="ledger")
app.command("rewards")(rewards.rewards)
app.command("report")(report.report)
app.command("audit")(audit.audit)
app.command("openapi")(openapi.openapi)

__all__ = ["app"]
