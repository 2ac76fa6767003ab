"""`gym-coordinator admin`: drive a coordinator's REST API over HTTP.

Every command calls one route (`--url`, `--token` or the environment's ZOO_GYM_URL and
ZOO_GYM_TOKEN) and prints the answer as a table or, with `--format json`, as JSON. What a user
can get wrong (an unreachable URL, a missing or refused token, a bad value) prints one line.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.table import Table

from zoo_gym.cli.common import console, err_console
from zoo_gym.transport.rest import RestClient, RestError, RestRefused

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_URL = "http://127.0.0.1:8080"
HEADERS = {
    "base_version": "base",
    "new_version": "new",
    "contributor_id": "contributor",
    "round_number": "round",
    "reputation_after": "reputation",
    "status_reason": "reason",
    "size_bytes": "bytes",
    "published_at": "published",
    "created_at": "created",
    "closed_at": "closed",
    "round_status": "status",
}
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")

app = typer.Typer(
    help="Operate a running coordinator through its REST API.",
    no_args_is_help=True,
    add_completion=False,
)
rounds_app = typer.Typer(help="Rounds: history and control.", no_args_is_help=True)
contributors_app = typer.Typer(
    help="Contributors: list, approve, ban, invite.", no_args_is_help=True
)
policy_app = typer.Typer(help="Policy for the next round.", no_args_is_help=True)
models_app = typer.Typer(help="Published base models.", no_args_is_help=True)
ledger_app = typer.Typer(help="The Merkle log: entries, checkpoints, proofs.", no_args_is_help=True)
app.add_typer(rounds_app, name="rounds")
app.add_typer(contributors_app, name="contributors")
app.add_typer(policy_app, name="policy")
app.add_typer(models_app, name="models")
app.add_typer(ledger_app, name="ledger")


class Format(StrEnum):
    table = "table"
    json = "json"


FormatOpt = Annotated[
    Format, typer.Option("--format", "-f", help="table for people, json for programs")
]
ReasonOpt = Annotated[str, typer.Option("--reason", "-r", help="why (goes into the audit log)")]


class AdminError(Exception):
    """A request the user can fix: the message is the whole story."""


@dataclass
class Api:
    """The REST client, made on first use (so a bad `--url` or `--ca-cert` is a command's
    one-line error); refusals are phrased for an operator."""

    url: str
    token: str | None
    timeout: float
    ca_cert: Path | None = None
    _rest: RestClient | None = None

    def _client(self) -> RestClient:
        if self._rest is None:
            try:
                self._rest = RestClient(
                    self.url,
                    token=self.token,
                    ca_cert=self.ca_cert,
                    timeout_s=self.timeout,
                    unreachable="check --url and that `gym-coordinator serve` is running",
                )
            except RestError as exc:
                raise AdminError(str(exc)) from None
        return self._rest

    def call(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        """One request; the decoded JSON answer."""
        try:
            return self._client().call(method, path, params=params, body=body)
        except RestRefused as exc:
            raise AdminError(_refused(exc)) from None
        except RestError as exc:
            raise AdminError(str(exc)) from None

    def download(self, path: str, target: Path, *, sha256: str) -> None:
        """Stream `path` into `target`, checking its SHA-256 against `sha256`."""
        try:
            self._client().download(path, target, sha256=sha256)
        except RestRefused as exc:
            raise AdminError(_refused(exc)) from None
        except RestError as exc:
            raise AdminError(str(exc)) from None


def _refused(exc: RestRefused) -> str:
    if exc.status_code == 401:
        return f"not authenticated: {exc.detail}; pass --token or set ZOO_GYM_TOKEN"
    if exc.status_code == 403:
        return f"not allowed: {exc.detail}"
    return f"{exc.detail} (HTTP {exc.status_code})"


def command(fn: Callable[P, R]) -> Callable[P, R]:
    """User errors print `error: <one line>` and exit 1; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except AdminError as exc:
            err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("stopped.")
            raise typer.Exit(130) from None

    return wrapper


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option(envvar="ZOO_GYM_URL", help="the coordinator's REST address")
    ] = DEFAULT_URL,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="ZOO_GYM_TOKEN",
            show_default=False,
            help="API key (gym-coordinator apikey create)",
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for an answer")] = 30.0,
    ca_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="ZOO_GYM_CA_CERT",
            help="CA certificate of a TLS coordinator (gym-coordinator init --tls)",
        ),
    ] = None,
) -> None:
    """Operate a running coordinator through its REST API."""
    ctx.obj = Api(url.rstrip("/"), token, timeout, ca_cert)


def _api(ctx: typer.Context) -> Api:
    api = ctx.find_object(Api)
    if api is None:  # only when a command is invoked without the group
        api = Api(DEFAULT_URL, None, 30.0)
    return api


# --- output -------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and ISO_TIME.match(value):
        return value[:16].replace("T", " ")
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _short(value: Any) -> str:
    text = _cell(value)
    return text[:12] if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else text


def table(
    rows: Iterable[dict[str, Any]],
    columns: list[str],
    *,
    title: str | None = None,
    short: Iterable[str] = (),
) -> Table:
    shorten = set(short)
    out = Table(title=title)
    for name in columns:
        out.add_column(HEADERS.get(name, name), overflow="fold")
    for row in rows:
        out.add_row(*[(_short if c in shorten else _cell)(row.get(c)) for c in columns])
    return out


def fields(data: dict[str, Any], *, title: str | None = None, skip: Iterable[str] = ()) -> Table:
    out = Table(title=title, show_header=False)
    out.add_column("field", style="bold")
    out.add_column("value", overflow="fold")
    for key, value in data.items():
        if key not in set(skip):
            out.add_row(key, _cell(value))
    return out


def emit(data: Any, fmt: Format, *tables: Table) -> None:
    if fmt is Format.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    for t in tables:
        console.print(t)


# --- rounds -------------------------------------------------------------------------------------

ROUND_COLUMNS = ["number", "status", "base_version", "new_version", "aggregator", "closed_at"]
SUBMISSION_COLUMNS = [
    "id",
    "contributor_id",
    "decision",
    "reason",
    "selected",
    "weight",
    "score",
    "reward",
]


def _control(data: dict[str, Any], fmt: Format) -> None:
    summary = {
        "paused": data["paused"],
        "paused by": (data["pause"] or {}).get("by"),
        "start requested": data["start"] is not None,
        "abort requested": ", ".join(str(n) for n in data["aborts"]) or None,
        "current round": data["current_round"],
        "policy change pending": data["policy_pending"],
    }
    emit(data, fmt, fields(summary, title="round control"))


@rounds_app.command("list")
@command
def rounds_list(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Every round, oldest first."""
    data = _api(ctx).call("GET", "/rounds")
    emit(data, format, table(data, ROUND_COLUMNS, title="rounds"))


@rounds_app.command("show")
@command
def rounds_show(ctx: typer.Context, number: int, format: FormatOpt = Format.table) -> None:
    """One round with its submissions and the decisions about them."""
    data = _api(ctx).call("GET", f"/rounds/{number}")
    emit(
        data,
        format,
        fields(data, title=f"round {number}", skip=("submissions", "rewards")),
        table(
            data["submissions"], SUBMISSION_COLUMNS, title="submissions", short=["contributor_id"]
        ),
    )


@rounds_app.command("summary")
@command
def rounds_summary(ctx: typer.Context, number: int, format: FormatOpt = Format.table) -> None:
    """Counts of one round: received, accepted, rejected by reason, rewards."""
    data = _api(ctx).call("GET", f"/rounds/{number}/summary")
    emit(data, format, fields(data, title=f"round {number}"))


@rounds_app.command("status")
@command
def rounds_status(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Pause, start and abort requests the round loop has not acted on yet."""
    _control(_api(ctx).call("GET", "/rounds/control"), format)


@rounds_app.command("pause")
@command
def rounds_pause(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Start no new round until resumed (a round under way finishes)."""
    _control(_api(ctx).call("POST", "/rounds/pause", body={"reason": reason}), format)


@rounds_app.command("resume")
@command
def rounds_resume(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Lift a pause."""
    _control(_api(ctx).call("POST", "/rounds/resume", body={"reason": reason}), format)


@rounds_app.command("start")
@command
def rounds_start(
    ctx: typer.Context, reason: ReasonOpt = "", format: FormatOpt = Format.table
) -> None:
    """Run the next round now, even while paused."""
    _control(_api(ctx).call("POST", "/rounds/start", body={"reason": reason}), format)


@rounds_app.command("abort")
@command
def rounds_abort(
    ctx: typer.Context,
    number: int,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why")],
    format: FormatOpt = Format.table,
) -> None:
    """Abort an open round: nothing is aggregated or published."""
    _control(_api(ctx).call("POST", f"/rounds/{number}/abort", body={"reason": reason}), format)


# --- contributors -------------------------------------------------------------------------------

CONTRIBUTOR_COLUMNS = [
    "contributor_id",
    "name",
    "status",
    "status_reason",
    "reputation",
    "created_at",
]


def _contributor(data: dict[str, Any], fmt: Format) -> None:
    emit(data, fmt, fields(data, title=f"contributor {data['contributor_id']}"))


@contributors_app.command("list")
@command
def contributors_list(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option(help="active, pending or banned")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Registered contributors."""
    data = _api(ctx).call("GET", "/contributors", params={"status": status})
    emit(data, format, table(data, CONTRIBUTOR_COLUMNS, title="contributors"))


@contributors_app.command("show")
@command
def contributors_show(
    ctx: typer.Context, contributor_id: str, format: FormatOpt = Format.table
) -> None:
    """One contributor."""
    _contributor(_api(ctx).call("GET", f"/contributors/{contributor_id}"), format)


@contributors_app.command("approve")
@command
def contributors_approve(
    ctx: typer.Context,
    contributor_id: str,
    reason: ReasonOpt = "",
    format: FormatOpt = Format.table,
) -> None:
    """Let a pending contributor take part."""
    body = {"reason": reason}
    _contributor(
        _api(ctx).call("POST", f"/contributors/{contributor_id}/approve", body=body), format
    )


@contributors_app.command("ban")
@command
def contributors_ban(
    ctx: typer.Context,
    contributor_id: str,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (shown to the contributor)")],
    format: FormatOpt = Format.table,
) -> None:
    """Refuse a contributor's requests and submissions."""
    body = {"reason": reason}
    _contributor(_api(ctx).call("POST", f"/contributors/{contributor_id}/ban", body=body), format)


@contributors_app.command("unban")
@command
def contributors_unban(
    ctx: typer.Context,
    contributor_id: str,
    reason: ReasonOpt = "",
    format: FormatOpt = Format.table,
) -> None:
    """Lift a ban."""
    body = {"reason": reason}
    _contributor(_api(ctx).call("POST", f"/contributors/{contributor_id}/unban", body=body), format)


INVITE_COLUMNS = ["prefix", "note", "uses", "max_uses", "expires_at", "revoked_at", "created_by"]


@contributors_app.command("invite")
@command
def contributors_invite(
    ctx: typer.Context,
    note: Annotated[str, typer.Option(help="whom the code is for (shown in the list)")] = "",
    uses: Annotated[int, typer.Option(min=1, help="new keys the code may admit")] = 1,
    valid_for_hours: Annotated[
        float, typer.Option(min=1 / 60, help="hours until the code expires")
    ] = 72.0,
    format: FormatOpt = Format.table,
) -> None:
    """Issue an invitation code (admission = "invite"); it is shown this once."""
    body = {"note": note, "uses": uses, "valid_for_hours": valid_for_hours}
    data = _api(ctx).call("POST", "/contributors/invites", body=body)
    emit(data, format, fields(data, title="invitation: give the code to its contributor"))


@contributors_app.command("invites")
@command
def contributors_invites(
    ctx: typer.Context,
    usable: Annotated[bool, typer.Option(help="only codes that still admit")] = False,
    format: FormatOpt = Format.table,
) -> None:
    """Invitations issued (never their codes)."""
    data = _api(ctx).call("GET", "/contributors/invites", params={"usable": usable or None})
    emit(data, format, table(data, INVITE_COLUMNS, title="invitations"))


@contributors_app.command("revoke-invite")
@command
def contributors_revoke_invite(
    ctx: typer.Context, prefix: str, format: FormatOpt = Format.table
) -> None:
    """Revoke an invitation by its prefix; its unused admissions lapse."""
    data = _api(ctx).call("POST", f"/contributors/invites/{prefix}/revoke")
    emit(data, format, fields(data, title=f"invitation {prefix} revoked"))


# --- policy -------------------------------------------------------------------------------------


def _flat(values: dict[str, Any], settable: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in settable:
        node: Any = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def _policy(data: dict[str, Any], fmt: Format) -> None:
    current = _flat(data["current"], data["settable"])
    pending = _flat(data["pending"], data["settable"]) if data["pending"] else {}
    rows = [
        {
            "setting": k,
            "current": v,
            "next round": pending.get(k, v) if k in data["pending_changes"] else "",
        }
        for k, v in current.items()
    ]
    title = f"policy (changes apply from round {data['next_round']})"
    emit(data, fmt, table(rows, ["setting", "current", "next round"], title=title))


def parse_setting(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as JSON when it parses (numbers, true, {...}), else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise AdminError(f"{text!r}: write settings as KEY=VALUE, e.g. aggregator=krum")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


@policy_app.command("show")
@command
def policy_show(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """The policy rounds run with now, and a change staged for the next round."""
    _policy(_api(ctx).call("GET", "/policy"), format)


@policy_app.command("set")
@command
def policy_set(
    ctx: typer.Context,
    settings: Annotated[
        list[str], typer.Argument(help="KEY=VALUE ..., e.g. aggregator=krum training.clip_norm=1.0")
    ],
    format: FormatOpt = Format.table,
) -> None:
    """Change settings from the next round on (validated like coordinator.toml)."""
    patch = dict(parse_setting(s) for s in settings)
    _policy(_api(ctx).call("PATCH", "/policy", body=patch), format)


# --- models -------------------------------------------------------------------------------------

MODEL_COLUMNS = [
    "version",
    "parent",
    "round",
    "aggregator",
    "contributors",
    "files",
    "size_bytes",
    "published_at",
]


@models_app.command("list")
@command
def models_list(ctx: typer.Context, format: FormatOpt = Format.table) -> None:
    """Published base versions."""
    data = _api(ctx).call("GET", "/models")
    emit(data, format, table(data, MODEL_COLUMNS, title="models"))


@models_app.command("show")
@command
def models_show(ctx: typer.Context, version: str, format: FormatOpt = Format.table) -> None:
    """The signed manifest of a version."""
    data = _api(ctx).call("GET", f"/models/{version}/manifest")
    files = [{"file": n, **f} for n, f in sorted(data["manifest"]["files"].items())]
    emit(data, format, table(files, ["file", "size", "sha256"], title=f"{version} files"))


@models_app.command("download")
@command
def models_download(
    ctx: typer.Context,
    version: str,
    out: Annotated[Path, typer.Option(help="directory to write VERSION/ into")] = Path("."),
) -> None:
    """Download every file of a version, checking each SHA-256 against the manifest."""
    api = _api(ctx)
    manifest = api.call("GET", f"/models/{version}/manifest")["manifest"]
    target = out / version
    target.mkdir(parents=True, exist_ok=True)
    for name, entry in sorted(manifest["files"].items()):
        if Path(name).name != name:
            raise AdminError(f"the manifest names a file outside the version directory: {name!r}")
        api.download(f"/models/{version}/files/{name}", target / name, sha256=entry["sha256"])
    console.print(f"{version}: {len(manifest['files'])} files in {target}, SHA-256 checked")


# --- ledger -------------------------------------------------------------------------------------


@ledger_app.command("entries")
@command
def ledger_entries(
    ctx: typer.Context,
    start: Annotated[int, typer.Option(help="first index")] = 0,
    limit: Annotated[int, typer.Option(help="at most this many")] = 100,
    format: FormatOpt = Format.table,
) -> None:
    """Log entries (canonical JSON records)."""
    data = _api(ctx).call("GET", "/ledger/entries", params={"start": start, "limit": limit})
    rows = [{**e, "record": e["record"][:100]} for e in data["entries"]]
    title = f"log entries {start}.. of {data['size']}"
    emit(data, format, table(rows, ["index", "kind", "leaf_hash", "record"], title=title))


@ledger_app.command("checkpoint")
@command
def ledger_checkpoint(
    ctx: typer.Context,
    create: Annotated[
        bool, typer.Option("--create", help="sign a new checkpoint now (admin)")
    ] = False,
    format: FormatOpt = Format.table,
) -> None:
    """The latest signed checkpoint (tree size and root)."""
    data = _api(ctx).call("POST" if create else "GET", "/ledger/checkpoint")
    emit(data, format, fields(data, title="checkpoint"))


@ledger_app.command("proof")
@command
def ledger_proof(
    ctx: typer.Context,
    index: Annotated[int, typer.Argument(help="log entry index")],
    tree_size: Annotated[
        int | None, typer.Option(help="default: the latest checkpoint's size")
    ] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Inclusion proof of an entry, verified here against the root it names."""
    from zoo_gym.core import merkle

    data = _api(ctx).call(
        "GET", "/ledger/proofs/inclusion", params={"index": index, "tree_size": tree_size}
    )
    data["verified"] = merkle.verify_inclusion(
        data["index"],
        data["tree_size"],
        bytes.fromhex(data["leaf_hash"]),
        [bytes.fromhex(p) for p in data["path"]],
        bytes.fromhex(data["root"]),
    )
    emit(data, format, fields(data, title=f"inclusion of entry {index}"))
    if not data["verified"]:
        raise AdminError("the inclusion proof does NOT verify against its root")


@ledger_app.command("consistency")
@command
def ledger_consistency(
    ctx: typer.Context,
    old_size: int,
    new_size: Annotated[
        int | None, typer.Argument(help="default: the latest checkpoint's size")
    ] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Consistency proof between two tree sizes, verified here."""
    from zoo_gym.core import merkle

    params = {"old_size": old_size, "new_size": new_size}
    data = _api(ctx).call("GET", "/ledger/proofs/consistency", params=params)
    data["verified"] = merkle.verify_consistency(
        data["old_size"],
        data["new_size"],
        bytes.fromhex(data["old_root"]),
        bytes.fromhex(data["new_root"]),
        [bytes.fromhex(p) for p in data["path"]],
    )
    emit(data, format, fields(data, title=f"consistency {old_size} -> {data['new_size']}"))
    if not data["verified"]:
        raise AdminError("the consistency proof does NOT verify")


# --- rewards, reports, audit --------------------------------------------------------------------

REWARD_COLUMNS = [
    "round_number",
    "contributor_id",
    "quality",
    "amount",
    "reputation_after",
    "recorded_at",
]
REPORT_COLUMNS = [
    "round",
    "round_status",
    "decision",
    "reason",
    "selected",
    "score",
    "quality",
    "reward",
]


@app.command("rewards")
@command
def rewards(
    ctx: typer.Context,
    round_number: Annotated[int | None, typer.Option("--round", help="only this round")] = None,
    contributor: Annotated[str | None, typer.Option(help="only this contributor id")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Rewards paid, per round and contributor."""
    params = {"round": round_number, "contributor_id": contributor}
    data = _api(ctx).call("GET", "/rewards", params=params)
    emit(data, format, table(data, REWARD_COLUMNS, title="rewards", short=["contributor_id"]))


@app.command("report")
@command
def report(
    ctx: typer.Context,
    contributor_id: str,
    round_number: Annotated[int | None, typer.Option("--round", help="only this round")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """A contributor's report: per round the decision, why, score and reward; totals."""
    data = _api(ctx).call(
        "GET", f"/contributors/{contributor_id}/report", params={"round": round_number}
    )
    title = f"{data['name']} ({contributor_id[:12]}, {data['status']})"
    emit(
        data,
        format,
        table(data["rounds"], REPORT_COLUMNS, title=title),
        fields(data["totals"], title="totals"),
    )


@app.command("audit")
@command
def audit(
    ctx: typer.Context,
    target: Annotated[str | None, typer.Option(help="only events about this target")] = None,
    format: FormatOpt = Format.table,
) -> None:
    """Operator actions: who changed what, and when."""
    data = _api(ctx).call("GET", "/audit", params={"target": target})
    emit(
        data,
        format,
        table(data, ["id", "at", "actor", "action", "target", "detail"], title="audit"),
    )


@app.command("openapi")
@command
def openapi(
    ctx: typer.Context,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="write the description to FILE instead of stdout"),
    ] = None,
) -> None:
    """The API's OpenAPI description (JSON); a viewer key is enough."""
    text = json.dumps(_api(ctx).call("GET", "/openapi.json"), indent=2, sort_keys=True) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise AdminError(f"cannot write {output}: {exc.strerror}") from None
    err_console.print(f"wrote {output}", markup=False)
