"""`gym-coordinator`: set up and run a coordinator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from zoo_gym.cli.admin import app as admin_app
from zoo_gym.cli.common import console, err_console, friendly, setup_logging

if TYPE_CHECKING:
    from zoo_gym.coordinator.config import CoordinatorConfig
    from zoo_gym.ledger import Engine, VerifyReport

CONFIG = "coordinator.toml"  # zoo_gym.coordinator.setup.CONFIG, not imported: it loads torch

app = typer.Typer(help="Run a zoo-gym coordinator.", no_args_is_help=True, add_completion=False)
apikey_app = typer.Typer(
    help="Operators' REST API keys (the ledger keeps only their hashes).", no_args_is_help=True
)
ledger_app = typer.Typer(help="The coordinator's ledger.", no_args_is_help=True)
tls_app = typer.Typer(help="The coordinator's TLS certificate.", no_args_is_help=True)
app.add_typer(admin_app, name="admin")
app.add_typer(apikey_app, name="apikey")
app.add_typer(ledger_app, name="ledger")
app.add_typer(tls_app, name="tls")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="coordinator.toml")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="table or json")]


@app.command()
@friendly
def init(
    home: Annotated[
        Path, typer.Option(help="directory for config, keys, models and the ledger")
    ] = Path("coordinator"),
    tiny: Annotated[
        bool, typer.Option(help="create a tiny demo model, task and validation split")
    ] = False,
    base_model: Annotated[
        Path | None, typer.Option(help="Hugging Face model directory to start from")
    ] = None,
    validation: Annotated[
        Path | None, typer.Option(help="validation JSONL (Alpaca/ShareGPT)")
    ] = None,
    listen: Annotated[str, typer.Option(help="gRPC address for contributors")] = "127.0.0.1:7443",
    rest_listen: Annotated[str, typer.Option(help="REST address for operators")] = "127.0.0.1:8080",
    seed: int = 0,
    tls: Annotated[
        bool, typer.Option(help="create a CA and a server certificate (gRPC and REST over TLS)")
    ] = False,
    host: Annotated[
        list[str] | None,
        typer.Option(help="with --tls: a DNS name or IP address contributors dial (repeatable)"),
    ] = None,
) -> None:
    """Write a config, an Ed25519 signing key and the first model version (v0000)."""
    from zoo_gym.coordinator.setup import init_home

    if not tiny and (base_model is None or validation is None):
        raise typer.BadParameter("pass --tiny, or both --base-model and --validation")
    hosts = host or []
    if hosts and not tls:
        _fail("--host names the hosts of the TLS certificate; add --tls")
    if tls and not hosts:
        _fail("--tls needs at least one --host: the DNS name or IP address contributors dial")
    config, signer, published = init_home(
        home,
        tiny=tiny,
        base_model=base_model,
        validation=validation,
        listen=listen,
        rest_listen=rest_listen,
        seed=seed,
        tls_hosts=hosts,
    )
    console.print(f"coordinator home {home}: config {config}, base {published.version}")
    console.print(f"coordinator key (contributors pin it): {signer.public_key.hex()}")
    if tls:
        _print_tls_handout(home / "tls", hosts, listen=listen, rest_listen=rest_listen)


def _print_tls_handout(directory: Path, hosts: list[str], *, listen: str, rest_listen: str) -> None:
    """What contributors need to join this coordinator over TLS."""
    from zoo_gym.coordinator.tls import fingerprint, load_certificate
    from zoo_gym.transport.client import is_loopback, is_loopback_host

    ca = load_certificate(directory / "ca.pem")
    server = load_certificate(directory / "server.pem")
    port, rest_port = listen.rsplit(":", 1)[1], rest_listen.rsplit(":", 1)[1]
    out = console.print
    out(
        f"TLS: server certificate {directory / 'server.pem'} for {', '.join(hosts)}, "
        f"valid until {server.not_valid_after_utc:%Y-%m-%d}",
        soft_wrap=True,
    )
    out(
        f"TLS: CA key {directory / 'ca.key'}: keep it offline; it signs server certificates",
        soft_wrap=True,
    )
    out("Hand contributors:", soft_wrap=True)
    out(f"  CA certificate: {directory / 'ca.pem'}", soft_wrap=True)
    out(f"  its SHA-256 fingerprint: {fingerprint(ca)}", soft_wrap=True)
    out(
        f"  address: {hosts[0]}:{port} (gRPC), https://{hosts[0]}:{rest_port} (REST)",
        soft_wrap=True,
    )
    out(f"  join: gym-client join {hosts[0]}:{port} --ca-cert ca.pem", soft_wrap=True)
    if is_loopback(listen) and not all(is_loopback_host(h) for h in hosts):
        out(
            f"note: listen = {listen} accepts only local connections; set listen = "
            f'"0.0.0.0:{port}" in coordinator.toml for contributors elsewhere',
            soft_wrap=True,
        )


@app.command()
@friendly
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="coordinator.toml")] = Path(
        "coordinator"
    )
    / CONFIG,
    rounds: Annotated[
        int | None, typer.Option(help="override: rounds to run (0 = until stopped)")
    ] = None,
    min_clients: Annotated[
        int | None, typer.Option(help="override: clients needed to start a round")
    ] = None,
    aggregator: Annotated[str | None, typer.Option(help="override: aggregation rule")] = None,
    listen: Annotated[str | None, typer.Option(help="override: gRPC address")] = None,
    rest_listen: Annotated[str | None, typer.Option(help="override: REST address")] = None,
    stay: Annotated[
        bool, typer.Option(help="keep serving after the last round until stopped")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Serve contributors (gRPC) and operators (REST) and run rounds."""
    setup_logging(verbose)
    from zoo_gym.coordinator.config import CoordinatorConfig, load_config
    from zoo_gym.coordinator.serve import serve as serve_coordinator
    from zoo_gym.coordinator.service import Coordinator

    cfg = load_config(config)
    overrides = {
        k: v
        for k, v in {
            "rounds": rounds,
            "min_clients": min_clients,
            "aggregator": aggregator,
            "listen": listen,
            "rest_listen": rest_listen,
        }.items()
        if v is not None
    }
    if overrides:
        cfg = CoordinatorConfig.model_validate({**cfg.model_dump(), **overrides})
    ended = serve_coordinator(Coordinator(cfg), stay=stay)
    if ended.state in ("stopped", "crashed", "stuck"):
        _fail(ended.reason)


@app.command()
@friendly
def variant(
    version: Annotated[str, typer.Argument(help="published version, e.g. v0003")],
    config: ConfigOpt = Path("coordinator") / CONFIG,
    distill: Annotated[
        bool, typer.Option(help="fit the scales to the version's logits on the validation prompts")
    ] = False,
    steps: Annotated[int, typer.Option(help="Adam steps of the scale distillation")] = 100,
) -> None:
    """Write the BitDelta variant of VERSION (its full-weight delta to the parent version)."""
    from zoo_gym.coordinator.config import load_config
    from zoo_gym.coordinator.registry import ModelRegistry
    from zoo_gym.coordinator.variants import VariantError, calibration_ids, write_variant
    from zoo_gym.core.identity import Identity

    cfg = load_config(config)
    registry = ModelRegistry(cfg.path("models"), Identity.load(cfg.path(cfg.signing_key)))
    try:
        parent_dir = registry.root / (registry.get(version).manifest.parent or version)
        ids = calibration_ids(parent_dir, cfg.path(cfg.validation_data)) if distill else None
        record = write_variant(registry, version, calibration=ids, steps=steps)
    except KeyError:
        _fail(f"no published version {version}; see `gym-coordinator admin models`")
    except VariantError as exc:
        _fail(str(exc))
    console.print(
        f"variant {record.version} from {record.parent}: {record.size} bytes, "
        f"sha256 {record.sha256}{' (distilled)' if record.distilled else ''}"
    )


@tls_app.command("renew")
@friendly
def tls_renew(
    config: ConfigOpt = Path("coordinator") / CONFIG,
    host: Annotated[
        list[str] | None,
        typer.Option(
            help="names the new certificate covers (repeatable; default: the current ones)"
        ),
    ] = None,
    days: Annotated[int, typer.Option(min=1, max=825, help="validity in days")] = 825,
    ca_cert: Annotated[
        Path | None, typer.Option(help="the CA certificate (default: ca.pem beside tls_cert)")
    ] = None,
    ca_key: Annotated[
        Path | None, typer.Option(help="the CA's key (default: ca.key beside tls_cert)")
    ] = None,
) -> None:
    """Issue a new server certificate from the coordinator's CA (contributors change nothing)."""
    from zoo_gym.coordinator.config import load_config
    from zoo_gym.coordinator.tls import renew_server_certificate

    cfg = load_config(config)
    if cfg.tls_cert is None or cfg.tls_key is None:
        _fail(f"{config} sets no tls_cert/tls_key; create TLS material with `init --tls`")
    cert, key = cfg.path(cfg.tls_cert), cfg.path(cfg.tls_key)
    files = renew_server_certificate(  # a TlsError is one line through @friendly
        ca_cert=ca_cert or cert.with_name("ca.pem"),
        ca_key=ca_key or cert.with_name("ca.key"),
        server_cert=cert,
        server_key=key,
        hosts=host or (),
        days=days,
    )
    out = console.print
    out(
        f"TLS: new server certificate {files.server_cert} for {', '.join(files.hosts)}, "
        f"valid until {files.not_after:%Y-%m-%d}; the previous pair is kept as *.old",
        soft_wrap=True,
    )
    out(
        f"TLS: CA unchanged (SHA-256 {files.fingerprint}); contributors change nothing",
        soft_wrap=True,
    )
    if cfg.tls_reload_s > 0:
        out(
            f"a running `gym-coordinator serve` switches to it within {cfg.tls_reload_s:g} s "
            "(tls_reload_s); connections already open keep the old one",
            soft_wrap=True,
        )
    else:
        out("tls_reload_s = 0: restart `gym-coordinator serve` to load it", soft_wrap=True)


def _fail(message: str) -> NoReturn:
    err_console.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(1)


def _open_ledger(config: Path, *, migrate: bool = True) -> tuple[CoordinatorConfig, Engine]:
    """The coordinator's config and its ledger engine (`migrate`: bring the schema to head)."""
    from zoo_gym import ledger
    from zoo_gym.coordinator.config import load_config
    from zoo_gym.ledger.db import DatabaseError, create_ledger_engine, printable_url, sqlite_file

    cfg = load_config(config)
    database = sqlite_file(cfg.ledger_url)
    if database is not None and not database.exists():
        _fail(f"no ledger at {database}; has this coordinator run (`gym-coordinator serve`)?")
    try:
        return cfg, (
            ledger.open_database(cfg.ledger_url)
            if migrate
            else create_ledger_engine(cfg.ledger_url)
        )
    except DatabaseError as exc:
        _fail(f"cannot open the ledger at {printable_url(cfg.ledger_url)}: {exc.args[0]}")


def _actor() -> str:
    import getpass
    import socket

    return f"cli:{getpass.getuser()}@{socket.gethostname()}"


@apikey_app.command("create")
@friendly
def apikey_create(
    name: Annotated[str, typer.Option(help="who or what uses the key, e.g. alice or prometheus")],
    role: Annotated[str, typer.Option(help="admin (everything) or viewer (read only)")] = "viewer",
    config: ConfigOpt = Path("coordinator") / CONFIG,
    format: FormatOpt = "table",
) -> None:
    """Issue an API key; its token is printed once and only its hash is stored."""
    from zoo_gym import ledger

    if role not in ledger.API_ROLES:
        _fail(f"--role must be admin or viewer, not {role!r}")
    _, engine = _open_ledger(config)
    with ledger.Session(engine) as session:
        try:
            issued = ledger.create_api_key(session, name=name, role=role, actor=_actor())
        except ledger.LedgerError as exc:
            _fail(str(exc))
    if format == "json":
        typer.echo(
            json.dumps(
                {
                    **ledger.ApiKeyPublic.model_validate(issued.key).model_dump(mode="json"),
                    "token": issued.token,
                },
                indent=2,
            )
        )
        return
    console.print(
        f"{role} key {issued.key.prefix} ({issued.key.name}) created. Its token, shown only now:"
    )
    typer.echo(issued.token)
    console.print("Pass it as --token or ZOO_GYM_TOKEN (Authorization: Bearer <token>).")


@apikey_app.command("list")
@friendly
def apikey_list(
    config: ConfigOpt = Path("coordinator") / CONFIG, format: FormatOpt = "table"
) -> None:
    """Every API key (never the tokens)."""
    from rich.table import Table

    from zoo_gym import ledger

    _, engine = _open_ledger(config)
    with ledger.Session(engine) as session:
        keys = [
            ledger.ApiKeyPublic.model_validate(k).model_dump(mode="json")
            for k in ledger.list_api_keys(session)
        ]
    if format == "json":
        typer.echo(json.dumps(keys, indent=2))
        return
    table = Table(title="API keys")
    for col in ("prefix", "name", "role", "created_at", "revoked_at"):
        table.add_column(col)
    for k in keys:
        table.add_row(k["prefix"], k["name"], k["role"], k["created_at"], k["revoked_at"] or "-")
    console.print(table)


@apikey_app.command("revoke")
@friendly
def apikey_revoke(
    key: Annotated[str, typer.Argument(help="the key's prefix (see `apikey list`) or its name")],
    config: ConfigOpt = Path("coordinator") / CONFIG,
) -> None:
    """Revoke a key: its token stops working at once."""
    from zoo_gym import ledger

    _, engine = _open_ledger(config)
    with ledger.Session(engine) as session:
        try:
            row = ledger.revoke_api_key(session, key=key, actor=_actor())
        except ledger.LedgerError as exc:
            _fail(str(exc))
    console.print(f"revoked {row.role} key {row.prefix} ({row.name})")


@ledger_app.command("verify")
@friendly
def ledger_verify(
    config: ConfigOpt = Path("coordinator") / CONFIG,
    public_key: Annotated[
        str | None,
        typer.Option(
            help="hex Ed25519 key the checkpoints must be signed with (default: this coordinator's key)",
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="a checkpoint kept outside the database (JSON, or JSON lines such as the checkpoint_copy file); the log must be consistent with each",
        ),
    ] = None,
    format: FormatOpt = "table",
) -> None:
    """Recompute the Merkle log, every row it describes and every checkpoint; exit 1 on tampering."""
    from zoo_gym import ledger
    from zoo_gym.core import merkle
    from zoo_gym.ledger.log import leaf_hashes

    kept: list[ledger.SignedCheckpoint] = []
    if checkpoint is not None:
        try:
            kept = ledger.read_checkpoints(checkpoint)
        except ledger.CheckpointFileError as exc:
            _fail(
                f"{exc}; pass a file written by checkpoint_copy or `ledger checkpoint --format json`"
            )
    cfg, engine = _open_ledger(config, migrate=False)
    key = _verifying_key(cfg, public_key)
    with ledger.Session(engine) as session:
        report = ledger.verify_ledger(session, public_key=key, kept=kept)
        root = merkle.root(leaf_hashes(session, size=report.size)).hex()
    if format == "json":
        _print_report_json(report, root)
    elif report.ok:
        _print_verified(report, root)
    else:
        err_console.print(f"TAMPERED: {report.first}", markup=False, soft_wrap=True)
        more = len(report.problems) - 1
        if more:
            err_console.print(
                f"({more} more problem{'s' if more > 1 else ''}; --format json lists them)"
            )
    if not report.ok:
        raise typer.Exit(1)


def _verifying_key(cfg: CoordinatorConfig, public_key: str | None) -> bytes:
    """`--public-key` when given, else the public half of the coordinator's signing key."""
    from zoo_gym.core.identity import Identity

    if public_key is None:
        return Identity.load(cfg.path(cfg.signing_key)).public_key
    try:
        return bytes.fromhex(public_key)
    except ValueError:
        _fail("--public-key must be 64 hex digits")


def _print_report_json(report: VerifyReport, root: str) -> None:
    body = {
        "ok": report.ok,
        "size": report.size,
        "checkpoints": report.checkpoints,
        "covered": report.covered,
        "kept": report.kept,
        "root": root,
        "problems": [str(p) for p in report.problems],
    }
    typer.echo(json.dumps(body, indent=2))


def _print_verified(report: VerifyReport, root: str) -> None:
    text = f"OK: {report.size} entries, {report.checkpoints} checkpoints, root {root}"
    if report.kept:
        text += f"; consistent with {report.kept} checkpoint(s) kept outside the database"
    console.print(text, soft_wrap=True)
    if report.uncovered:
        console.print(
            f"entries {report.covered}..{report.size - 1} were recorded after the newest "
            "checkpoint and are not signed yet (a checkpoint is signed at each round's end)",
            soft_wrap=True,
        )


@ledger_app.command("checkpoint")
@friendly
def ledger_checkpoint(
    config: ConfigOpt = Path("coordinator") / CONFIG,
    new: Annotated[
        bool,
        typer.Option(
            "--new", help="sign the log's current tree head first (appended to checkpoint_copy)"
        ),
    ] = False,
    format: FormatOpt = "table",
) -> None:
    """The newest signed checkpoint; --format json prints one line to keep outside the database."""
    from zoo_gym import ledger
    from zoo_gym.core.identity import Identity

    cfg, engine = _open_ledger(config, migrate=new)
    signer = Identity.load(cfg.path(cfg.signing_key))
    with ledger.Session(engine) as session:
        head = (
            ledger.checkpoint(session, signer=signer) if new else ledger.latest_checkpoint(session)
        )
    if head is None:
        _fail("no checkpoint is signed yet; one is signed at each round's end, or pass --new")
    signed = ledger.SignedCheckpoint.of(head, signer.public_key)
    if new and cfg.checkpoint_copy is not None:
        try:
            ledger.append_checkpoint(cfg.path(cfg.checkpoint_copy), signed)
        except OSError as exc:
            _fail(
                f"signed {signed.describe()} but cannot append it to checkpoint_copy "
                f"{cfg.path(cfg.checkpoint_copy)} ({exc.strerror or exc})"
            )
    if format == "json":
        typer.echo(signed.line())
    else:
        console.print(
            f"{signed.describe()}\nroot {signed.root}\nkey {signed.public_key}", soft_wrap=True
        )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
