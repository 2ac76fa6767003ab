"""What every command shares: logging set-up and one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console

P = ParamSpec("P")
R = TypeVar("R")

# bitsandbytes (imported by peft when installed) warns at import on CPUs with AVX512-BF16 that
# an optional kernel package is missing; its own fallback works, so only its errors are shown
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
# peft probes `model.is_gradient_checkpointing`, which transformers 5 deprecates; nothing to act on
warnings.filterwarnings(
    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
)

# emoji=False: rich would render ":ab:" in a hex fingerprint or digest as an emoji
console = Console(stderr=False, highlight=False, emoji=False)
err_console = Console(stderr=True, highlight=False, emoji=False)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a user can cause; they are shown as one line, never as a traceback."""
    from zoo_gym.client.config import ClientConfigError
    from zoo_gym.client.data import DataError
    from zoo_gym.client.report import RewardsError
    from zoo_gym.client.session import JoinError
    from zoo_gym.compression import EnvelopeError
    from zoo_gym.coordinator.config import ConfigError
    from zoo_gym.core.identity import IdentityError
    from zoo_gym.core.manifest import ManifestError
    from zoo_gym.core.weights import WeightsError
    from zoo_gym.simulation.sweep import SweepError
    from zoo_gym.transport.client import TransportError

    return (
        ClientConfigError,
        DataError,
        JoinError,
        RewardsError,
        EnvelopeError,
        ConfigError,
        IdentityError,
        ManifestError,
        WeightsError,
        SweepError,
        TransportError,
        FileNotFoundError,
        PermissionError,
    )


def friendly(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a command; user errors print `error: <one line>` and exit 1; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            err_console.print("stopped.")
            raise typer.Exit(130) from None
        except user_errors() as exc:
            message = str(exc) or type(exc).__name__
            if isinstance(exc, (FileNotFoundError, PermissionError)) and exc.filename:
                message = f"{exc.strerror}: {exc.filename}"
            err_console.print(f"error: {message}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("flwr", "httpx", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_libraries(verbose)


def quiet_libraries(verbose: bool = False) -> None:
    """Keep third-party chatter (weight-loading bars, deprecation notes) off the console."""
    import warnings

    for quiet in ("bitsandbytes", "alembic", "opacus"):
        logging.getLogger(quiet).setLevel(logging.ERROR)
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
