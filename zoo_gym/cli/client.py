"""`gym-client`: contribute to a zoo-gym network."""

from __future__ import annotations

import json
import sys
import warnings
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from zoo_gym.cli.common import console, friendly, setup_logging

if TYPE_CHECKING:
    from rich.table import Table

    from zoo_gym.client.config import ClientConfig
    from zoo_gym.client.privacy import PrivacyBudget
    from zoo_gym.client.report import Statement, Verification
    from zoo_gym.client.state import LocalState

app = typer.Typer(
    help="Contribute to a zoo-gym network.", no_args_is_help=True, add_completion=False
)

CONFIG = "client.toml"


@app.command()
@friendly
def init(
    home: Annotated[
        Path, typer.Option(help="directory for your key, config and local state")
    ] = Path("contributor"),
    name: Annotated[str, typer.Option(help="name shown to the operator")] = "contributor",
) -> None:
    """Create an Ed25519 identity and a config file."""
    from zoo_gym.core.identity import Identity

    home.mkdir(parents=True, exist_ok=True)
    if (home / "client.key").exists():
        raise FileExistsError(f"{home / 'client.key'} exists; your identity is already set up")
    identity = Identity.generate()
    identity.save(home / "client.key")
    (home / CONFIG).write_text(f'name = "{name}"\nkey = "client.key"\n')
    console.print(f"contributor {identity.contributor_id} ready in {home}")


# `join`'s options as Annotated aliases, so the command's signature stays readable
CoordinatorArgument = Annotated[
    str | None,
    typer.Argument(help="HOST:PORT of the coordinator (default: coordinator in client.toml)"),
]
HomeOption = Annotated[Path, typer.Option(help="directory made by `gym-client init`")]
DataOption = Annotated[Path | None, typer.Option(help="your training data (Alpaca/ShareGPT JSONL)")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        help="config file (default: HOME/client.toml); every option below overrides its key"
    ),
]
MethodOption = Annotated[
    str | None,
    typer.Option(
        help="objective you accept: sft, grpo, gspo or any (the coordinator's task decides)"
    ),
]
CaCertOption = Annotated[Path | None, typer.Option(help="CA certificate for a TLS coordinator")]
InviteOption = Annotated[
    str | None,
    typer.Option(metavar="CODE", help="invitation code from the operator, sent when registering"),
]
MaxRoundsOption = Annotated[int | None, typer.Option(help="leave after this many submissions")]
DeviceOption = Annotated[
    str | None, typer.Option(help="auto (CUDA when present, else the CPU), cpu, cuda, cuda:1 ...")
]
BudgetEpsilonOption = Annotated[
    float | None,
    typer.Option(help="refuse any round that would take your records' total epsilon past this"),
]
BudgetDeltaOption = Annotated[
    float | None,
    typer.Option(help="delta at which the budget is checked (default: each task's dp_delta)"),
]
AppOption = Annotated[
    str | None,
    typer.Option(
        metavar="MODULE:APP",
        help="your own Flower ClientApp (package.module:app) trains each round instead of "
        "zoo-gym's trainers; --data is then not needed",
    ),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v")]
ByzantineOption = Annotated[
    str | None,
    typer.Option(
        hidden=True,
        help="attack the federation on purpose: label_flip, random_completion, sign_flip, scaling, ipm, gaussian",
    ),
]


@app.command()
@friendly
def join(
    coordinator: CoordinatorArgument = None,
    data: DataOption = None,
    home: HomeOption = Path("contributor"),
    config: ConfigOption = None,
    method: MethodOption = None,
    ca_cert: CaCertOption = None,
    invite: InviteOption = None,
    max_rounds: MaxRoundsOption = None,
    device: DeviceOption = None,
    privacy_budget_epsilon: BudgetEpsilonOption = None,
    privacy_budget_delta: BudgetDeltaOption = None,
    app: AppOption = None,
    verbose: VerboseOption = False,
    byzantine: ByzantineOption = None,
) -> None:
    """Register, then train and submit an update every round until stopped (Ctrl-C).

    Settings come from client.toml; options given here override them for this run.

    With a privacy budget set, the client stops (exit 0) before training a round that would exceed it.
    """
    setup_logging(verbose)
    if not verbose:
        # Opacus's hooks on a frozen-input model: expected with LoRA, not news to a contributor
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
    from zoo_gym.cli.progress import JoinDisplay
    from zoo_gym.client.errors import RoundRefusal
    from zoo_gym.client.session import join as run_join

    cfg = _join_config(
        config or home / CONFIG,
        coordinator=coordinator,
        data=data and data.resolve(),
        ca_cert=ca_cert and ca_cert.resolve(),
        invite=invite,
        method=method,
        max_rounds=max_rounds,
        device=device,
        byzantine=byzantine,
        privacy_budget_epsilon=privacy_budget_epsilon,
        privacy_budget_delta=privacy_budget_delta,
        app=app,
    )
    with JoinDisplay(console) as display:
        try:
            made = run_join(cfg, on_event=display.event, say=display.say)
        except RoundRefusal as refusal:
            display.say(f"stopped: {refusal}")
            return
    console.print(f"left after {made} submission(s)")


def _join_config(path: Path, **overrides: object) -> ClientConfig:
    """The config file at `path` with the options given (not None) over it, validated like the
    file; a bad option is one line naming it."""
    from pydantic import ValidationError

    from zoo_gym.client.config import ClientConfig, ClientConfigError, load_client_config

    cfg = load_client_config(path)
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ClientConfig.model_validate({**cfg.model_dump(), **given})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]).replace("_", "-")
        raise ClientConfigError(
            f"--{where}: {first['msg'].removeprefix('Value error, ')}"
        ) from None


class StatusFormat(StrEnum):
    table = "table"
    json = "json"


@app.command()
@friendly
def status(
    home: HomeOption = Path("contributor"),
    format: Annotated[
        StatusFormat, typer.Option("--format", help="table for people, json for programs")
    ] = (StatusFormat.table),
) -> None:
    """Show local state: identity, coordinator, contributions, and privacy spent against your budget."""
    from zoo_gym.client.config import load_client_config
    from zoo_gym.client.state import LocalState

    state = LocalState.load(home / "state" / "state.json")
    budget = (
        load_client_config(home / CONFIG).privacy_budget() if (home / CONFIG).exists() else None
    )
    body = status_body(state, budget, feedback_path=home / "state" / "feedback.safetensors")
    if format is StatusFormat.json:
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
        sys.stdout.flush()
        return
    console.print(status_table(body))
    console.print(privacy_line(body["privacy"]), markup=False, soft_wrap=True)
    console.print(feedback_line(body["feedback"]), markup=False, soft_wrap=True)


def status_body(
    state: LocalState, budget: PrivacyBudget | None, *, feedback_path: Path | None = None
) -> dict[str, Any]:
    """What `gym-client status --format json` prints (format 1; ``feedback`` is null when no
    error-feedback residual is kept)."""
    from dataclasses import asdict

    from zoo_gym.client.feedback import summary

    spent = {r.round: r for r in state.privacy.rounds}
    rows = []
    for c in sorted(state.contributions.values(), key=lambda c: c.round):
        row = asdict(c)
        r = spent.get(c.round)
        row["epsilon"] = r.epsilon if r else None
        row["epsilon_total"] = r.epsilon_total if r else None
        rows.append(row)
    last = state.privacy.rounds[-1] if state.privacy.rounds else None
    delta = (
        budget.delta
        if budget is not None and budget.delta is not None
        else (last.delta if last else 1e-5)
    )
    accountant = last.accountant if last else "rdp"
    privacy = {
        "rounds": len(state.privacy.rounds),
        "delta": delta,
        "accountant": accountant,
        "epsilon_total": state.privacy.total(delta, accountant) if last else 0.0,
        "user_epsilon_total": state.privacy.user_total(delta, accountant) if last else 0.0,
        "naive_epsilon_sum": state.privacy.naive_epsilon_sum,
        "budget_epsilon": budget.epsilon if budget is not None else None,
        "per_round": [asdict(r) for r in state.privacy.rounds],
    }
    saved = summary(feedback_path) if feedback_path is not None else None
    return {
        "format": 1,
        "contributor_id": state.contributor_id,
        "coordinator": state.coordinator,
        "contributions": rows,
        "privacy": privacy,
        "feedback": None if saved is None else asdict(saved),
    }


def status_table(body: dict[str, Any]) -> Table:
    from rich.table import Table

    who = str(body["contributor_id"])[:16] or "(not joined yet)"
    table = Table(title=f"contributor {who} @ {body['coordinator'] or '-'}")
    for col in (
        "round",
        "base",
        "decision",
        "reason",
        "upload bytes",
        "train loss",
        "reward",
        "epsilon",
        "total",
    ):
        table.add_column(col)
    for r in body["contributions"]:
        table.add_row(
            str(r["round"]),
            r["base_version"],
            r["decision"],
            r["reason"],
            str(r["payload_bytes"]),
            f"{r['train_loss']:.4f}",
            f"{r['reward']:g}",
            _eps(r["epsilon"]),
            _eps(r["epsilon_total"]),
        )
    return table


def privacy_line(p: dict[str, Any]) -> str:
    """``privacy: epsilon 3.2 of 8 spent over 4 round(s) at delta 1e-05 (rdp); ...``"""
    if not p["rounds"]:
        return "privacy: nothing spent yet" + (
            f" (budget epsilon {p['budget_epsilon']:g})" if p["budget_epsilon"] else ""
        )
    of = f" of {p['budget_epsilon']:g}" if p["budget_epsilon"] is not None else " (no budget set)"
    return (
        f"privacy: epsilon {_eps(p['epsilon_total'])}{of} spent over {p['rounds']} round(s) at delta "
        f"{p['delta']:g} ({p['accountant']}); user-level {_eps(p['user_epsilon_total'])}; "
        f"sum of round epsilons {p['naive_epsilon_sum']:.3g}"
    )


def feedback_line(f: dict[str, Any] | None) -> str:
    """``error feedback: residual 32768 B kept for a 32768 B float32 update; A seed 123 since
    round 5 (last round 7)``"""
    if f is None:
        return "error feedback: no residual kept"
    seed = f"A seed {f['a_seed']} since round {f['a_since']}" if f["a_seed"] is not None else "no A"
    return (
        f"error feedback: residual {f['residual_bytes']} B kept for a {f['update_bytes']} B "
        f"float32 update; {seed} (last round {f['round']})"
    )


def _eps(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.3g}"


class RewardsFormat(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    html = "html"


def _statement(
    home: Path, cfg: ClientConfig, url: str, *, verify: bool
) -> tuple[Statement, Verification | None]:
    """The reward statement and, with `verify`, its check against the signed log; a checkpoint
    that verified (signature, consistency with the one kept before) is kept for next time."""
    from zoo_gym.client import report
    from zoo_gym.core.identity import Identity

    identity = Identity.load(cfg.path(cfg.key))
    state_path = home / "state" / "state.json"
    pinned = report.pinned_coordinator_key(state_path) if verify else b""
    kept = report.kept_checkpoint(state_path, pinned) if verify else None
    with report.connect(url, ca_cert=cfg.ca_cert and cfg.path(cfg.ca_cert)) as http:
        session = report.ReportApi(http, identity)
        statement = report.fetch_statement(session)
        checked = (
            report.verify_statement(session, statement, coordinator_key=pinned, kept=kept)
            if verify
            else None
        )
    if checked is not None and checked.checkpoint is not None:
        report.keep_checkpoint(state_path, pinned, checked.checkpoint)
    return statement, checked


@app.command()
@friendly
def rewards(
    home: HomeOption = Path("contributor"),
    api: Annotated[
        str | None,
        typer.Option(
            help="the coordinator's REST address, e.g. http://coordinator.example.org:8080 (default: api_url in client.toml)",
        ),
    ] = None,
    format: Annotated[
        RewardsFormat,
        typer.Option(
            "--format",
            help="table for people, json or csv for programs, html for a page with a plot",
        ),
    ] = RewardsFormat.table,
    out: Annotated[
        Path | None, typer.Option(help="write to this file (html: default rewards.html)")
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="check every reward against the ledger's checkpoint signed by the coordinator key pinned at join, and that the log only grew since the checkpoint verified last time",
        ),
    ] = False,
) -> None:
    """Your reward statement: per round the decision and why, quality, reward, reputation and privacy spent."""
    from zoo_gym.cli.common import err_console
    from zoo_gym.client import report
    from zoo_gym.client.config import load_client_config

    cfg = load_client_config(home / CONFIG)
    url = report.api_base(api or cfg.api_url)
    statement, checked = _statement(home, cfg, url, verify=verify)
    _write_statement(statement, checked, format=format, out=out, source=url)
    if checked is not None and not checked.ok:
        raise report.RewardsError(f"verification failed: {checked.problem}")
    if checked is not None:
        (console if format is RewardsFormat.table else err_console).print(
            checked.summary(), markup=False, soft_wrap=True
        )


def _write_statement(
    statement: Statement,
    checked: Verification | None,
    *,
    format: RewardsFormat,
    out: Path | None,
    source: str,
) -> None:
    """Print the statement in `format`, or write it to `out` (html: to rewards.html by default)."""
    from rich.console import Console

    from zoo_gym.client import report

    if format is RewardsFormat.html:
        target = out or Path("rewards.html")
        target.write_text(report.to_html(statement, checked, source=source), encoding="utf-8")
        console.print(f"wrote {target} ({len(statement.rounds)} round(s))", markup=False)
    elif format is RewardsFormat.table:
        if out is None:
            console.print(report.render_table(statement, checked))
        else:
            with out.open("w", encoding="utf-8") as fh:
                Console(file=fh, width=160, emoji=False).print(
                    report.render_table(statement, checked)
                )
    else:
        text = (report.to_json if format is RewardsFormat.json else report.to_csv)(
            statement, checked
        )
        if out is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            out.write_text(text, encoding="utf-8")


# --- chat: talk to a `gym-serve` server ---------------------------------------------------------

CHAT_KEY_VARIABLE = "ZOO_SERVE_API_KEY"


class ChatError(Exception):
    """The server refused a request or could not be reached (one line says why)."""


def _server_error(response: Any) -> ChatError:
    """The one line of an OpenAI-shaped error body (or the status when the body is not one)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.reason_phrase or "no reason given"
    return ChatError(f"the server answered {response.status_code}: {message}")


def sse_events(lines: Any) -> Any:
    """The JSON payloads of a server-sent event stream's `data:` lines, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, other fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ChatError(f"the server failed mid-answer: {event['error'].get('message')}")
        yield event


def _chat_model(http: Any, model: str | None) -> str:
    if model is not None:
        return model
    response = http.get("/v1/models")
    if response.status_code != 200:
        raise _server_error(response)
    served = [m["id"] for m in response.json()["data"]]
    if not served:
        raise ChatError("the server serves no model")
    return str(sorted(served)[-1])  # the newest version


def _reply(http: Any, body: dict[str, Any], write: Any) -> str:
    """Stream one reply, writing its text as it arrives; returns the whole text."""
    parts: list[str] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise _server_error(response)
        for event in sse_events(response.iter_lines()):
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                parts.append(text)
                write(text)
    write("\n")
    return "".join(parts)


@app.command()
@friendly
def chat(
    url: Annotated[str, typer.Argument(help="the gym-serve address, e.g. http://127.0.0.1:8000")],
    model: Annotated[
        str | None, typer.Option(help="model id (default: the newest the server lists)")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help=f"the server's API key (default: ${CHAT_KEY_VARIABLE})"),
    ] = None,
    system: Annotated[str | None, typer.Option(help="a system message to start with")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="longest reply in tokens", min=1)] = None,
    temperature: Annotated[float, typer.Option(help="0 for greedy replies", min=0.0)] = 0.7,
) -> None:
    """Talk to a model a gym-serve server serves: type a line, read the reply; /exit leaves."""
    import os

    import httpx

    from zoo_gym.cli.common import err_console

    key = api_key or os.environ.get(CHAT_KEY_VARIABLE)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    settings: dict[str, Any] = {"temperature": temperature, "stream": True}
    if max_tokens is not None:
        settings["max_tokens"] = max_tokens
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=300) as http:
            chosen = _chat_model(http, model)
            console.print(f"chatting with {chosen} at {url} (/exit leaves)", markup=False)
            _chat_loop(http, {"model": chosen, **settings}, system)
    except (ChatError, httpx.HTTPError) as exc:
        if isinstance(exc, httpx.HTTPError):
            exc = ChatError(f"cannot reach {url} ({exc}); is gym-serve running there?")
        err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _chat_loop(http: Any, settings: dict[str, Any], system: str | None) -> None:
    """Read lines from stdin until /exit or its end; each gets the conversation's next reply."""

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for line in sys.stdin:
        text = line.strip()
        if text == "/exit":
            return
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        reply = _reply(http, {**settings, "messages": messages}, write)
        messages.append({"role": "assistant", "content": reply})


def main() -> None:
    app()


if __name__ == "__main__":
    main()
