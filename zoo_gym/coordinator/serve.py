"""`gym-coordinator serve`: the composition root that puts a `Coordinator` on the network.

It serves gRPC (contributors) and REST (operators) and runs the round loop over the gRPC Grid
until the configured rounds are done or it is stopped.

Stopping: the round loop runs in a thread of its own and the main thread handles SIGINT and
SIGTERM. The first signal ends `serve` within `STOP_WITHIN_S` in any state: the Grid's wait for
replies wakes (`Mailbox.close`), the open round is recorded aborted ("coordinator stopping"), the
gRPC and REST servers stop and the ledger gets a signed checkpoint. A second signal ends the
process at once.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from flwr.serverapp import Grid
from uvicorn.config import create_ssl_context

from zoo_gym import ledger
from zoo_gym.coordinator.api.app import RestServer
from zoo_gym.coordinator.api.deps import ApiServices
from zoo_gym.coordinator.liveness import LoopStatus
from zoo_gym.coordinator.rounds import run_server_app
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.coordinator.tls import (
    CertificateWatcher,
    ServedPair,
    expiry_warning,
    follow_in_ssl_context,
)
from zoo_gym.ledger import Session
from zoo_gym.transport.grid import GrpcGrid
from zoo_gym.transport.limits import RateLimits
from zoo_gym.transport.mailbox import Mailbox
from zoo_gym.transport.server import ServerHandle, start_server

log = logging.getLogger(__name__)
STOP_WITHIN_S = 30.0
"""A signal ends `serve` within this many seconds (deploy/ gives it 45 before killing it)."""
LOOP_STOP_S = 20.0
"""Of that, how long `serve` waits for the round loop to close its open round."""


def clear_spool(spool: Path) -> int:
    """Remove the `*.part` files in `spool`: uploads (or intake's copies of them) a stopped or
    killed coordinator never finished (nothing reads them again). Returns how many there were."""
    removed = 0
    for part in spool.glob("*.part"):
        part.unlink(missing_ok=True)
        removed += 1
    if removed:
        log.info("removed %d unfinished upload(s) left in %s", removed, spool)
    return removed


def api_services(co: Coordinator) -> ApiServices:
    """What the REST API reaches of `co`: each part it reads or asks something of, no more."""
    return ApiServices(
        engine=co.engine,
        settings=lambda: co.config,
        registry=co.registry,
        checkpoints=co.checkpoints,
        rounds=co.backend,
        control=co.control,
        metrics=co.metrics,
        health=co.health,
    )


def run_loop(co: Coordinator, grid: Grid) -> None:
    """The round loop on `grid`, with a crash recorded in `co.health` (serve runs this in a
    thread of its own)."""
    try:
        run_server_app(co, grid)
    except Exception as exc:
        log.exception("the round loop crashed")
        message = (str(exc).splitlines() or [""])[0]
        co.health.set("crashed", f"round loop crashed: {type(exc).__name__}: {message}")


def serve(co: Coordinator, *, stay: bool = False) -> LoopStatus:
    """gRPC + REST + the round loop, until done or SIGINT/SIGTERM; returns how the loop ended.

    With `rounds = 0`, or `stay`, it keeps answering (outcomes, downloads, REST) after the loop
    ended, until a signal; `/health` then says why the loop ended.
    """
    signals = _catch_signals()
    c = co.config
    clear_spool(c.path("spool"))
    clear_spool(c.path("payloads"))  # copies intake was making when it stopped
    rest = RestServer(api_services(co), c.rest_listen)
    watcher = _serve_tls(co, rest) if c.tls_cert is not None else None
    mailbox = Mailbox()
    grpc_server = start_server(
        co.backend,
        mailbox,
        address=c.listen,
        spool=c.path("spool"),
        tls=watcher.pem if watcher is not None else None,
        limits=RateLimits(**c.grpc_limits()),
    )
    log.info("REST API on %s://%s", "https" if watcher else "http", c.rest_listen)
    rest.start()
    if watcher is not None:
        watcher.start()
    loop = threading.Thread(
        target=run_loop, args=(co, GrpcGrid(mailbox)), name="rounds", daemon=True
    )
    try:
        loop.start()
        _wait_for(co, lambda: not loop.is_alive() or co.stop.is_set(), signals, mailbox)
        if not co.stop.is_set() and (c.rounds == 0 or stay):
            ended = co.health.status()
            if ended.healthy:
                log.info("%s; serving until stopped", ended.reason)
            else:
                log.warning("%s; serving until stopped (/health answers 503)", ended.reason)
            _wait_for(co, co.stop.is_set, signals, mailbox)
    finally:
        _shut_down(co, loop, mailbox, grpc_server, rest, watcher)
    return co.health.status()


def _serve_tls(co: Coordinator, rest: RestServer) -> CertificateWatcher:
    """The served certificate for gRPC and REST, followed through renewals on disk."""
    c = co.config
    assert c.tls_cert is not None and c.tls_key is not None
    cert, key = c.path(c.tls_cert), c.path(c.tls_key)
    watcher = CertificateWatcher(cert, key, interval_s=c.tls_reload_s)

    def note(pair: ServedPair) -> None:
        """Export a served certificate's expiry, and warn when it is close."""
        co.metrics.tls_expiry.set(pair.certificate.not_valid_after_utc.timestamp())
        if warning := expiry_warning(cert, pair.certificate):
            log.warning("%s", warning)

    note(watcher.current)
    watcher.on_change.append(note)
    # REST serves HTTPS with the same certificate; uvicorn's context follows a renewal too
    config = rest.server.config
    config.ssl_certfile, config.ssl_keyfile = str(cert), str(key)
    config.load()
    assert config.ssl is not None

    def fresh_context() -> ssl.SSLContext:
        return create_ssl_context(
            certfile=cert,
            keyfile=key,
            password=config.ssl_keyfile_password,
            ssl_version=config.ssl_version,
            cert_reqs=config.ssl_cert_reqs,
            ca_certs=config.ssl_ca_certs,
            ciphers=config.ssl_ciphers,
        )

    watcher.on_change.append(follow_in_ssl_context(config.ssl, fresh_context))
    return watcher


def _catch_signals() -> list[int]:
    """Note SIGINT / SIGTERM for the main thread to act on (`_wait_for`); a second one ends
    the process at once. The handler takes no lock, so it cannot deadlock what it interrupts."""
    caught: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if caught:
            os.write(2, b"second signal: stopping at once\n")
            os._exit(128 + signum)
        caught.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return caught


def _wait_for(
    co: Coordinator, done: Callable[[], bool], signals: list[int], mailbox: Mailbox
) -> None:
    """Sleep in short steps until `done()`; a signal caught meanwhile starts the stop."""
    while not done():
        if signals and not co.stop.is_set():
            name = signal.Signals(signals[0]).name
            log.info("stopping (%s): closing the open round, then the servers", name)
            co.health.set("stopping", "coordinator stopping")
            co.stop.set()
            mailbox.close()
        time.sleep(0.1)


def _shut_down(
    co: Coordinator,
    loop: threading.Thread,
    mailbox: Mailbox,
    grpc_server: ServerHandle,
    rest: RestServer,
    watcher: CertificateWatcher | None,
) -> None:
    """Let the loop close its round (up to `LOOP_STOP_S`), stop the servers, sign the log."""
    began = time.monotonic()
    co.stop.set()
    mailbox.close()
    loop.join(LOOP_STOP_S)
    if loop.is_alive():
        reason = (
            f"the round loop did not stop within {LOOP_STOP_S:.0f} s (busy evaluating or "
            "aggregating); a round it left open is recorded aborted at the next start"
        )
        log.error("%s", reason)
        co.health.set("stuck", reason)
    if watcher is not None:
        watcher.stop()
    grpc_server.stop()
    rest.stop()
    if not loop.is_alive():
        _sign_checkpoint(co)
    log.info("stopped in %.1f s", time.monotonic() - began)


def _sign_checkpoint(co: Coordinator) -> None:
    """Sign the log's head unless the latest checkpoint already covers every entry."""
    with Session(co.engine) as session:
        stats = ledger.ledger_stats(session)
        if stats.entries > stats.checkpoint_size:
            head = co.checkpoints.sign_checkpoint(session)  # to checkpoint_copy too
            log.info("signed checkpoint at log size %d", head.size)
