"""Rich progress for `gym-client join`: one bar per round, plain lines otherwise.

What the contributor sees, in order: the connection and identity line and the base
version (said by the session), then per round the privacy plan (sigma, epsilon this
round and in total), a progress bar (steps, loss or reward, tokens/s), the upload
size before and after compression, the coordinator's decision at intake and, once the
round closes, the decision after aggregation with the reward earned.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from zoo_gym.client.runtime import RoundEvent


def size_text(n: float) -> str:
    """Bytes for people: ``size_text(1536) == '1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def privacy_text(d: dict[str, float | str]) -> str:
    """One line for a round's privacy plan (the detail of a "privacy" RoundEvent)."""

    def eps(key: str) -> str:
        return f"{float(d[key]):.3g}" if key in d else "unbounded"

    parts = []
    if float(d.get("dp_noise_multiplier", 0.0)) > 0:
        parts.append(
            f"DP-SGD sigma {float(d['dp_noise_multiplier']):.3g} at q {float(d['dp_sample_rate']):.3g}"
        )
    if float(d.get("update_noise_multiplier", 0.0)) > 0:
        parts.append(
            f"update noise {float(d['update_noise_multiplier']):.3g} x C "
            f"(user-level epsilon {eps('user_epsilon')} round, {eps('user_epsilon_total')} total)"
        )
    if not parts:
        return "no differential privacy this round"
    delta = float(d.get("dp_delta", 0.0))
    return f"{'; '.join(parts)}; epsilon {eps('epsilon')} this round, {eps('epsilon_total')} total at delta {delta:g}"


class JoinDisplay:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("{task.fields[metric]}  {task.fields[rate]:.0f} tok/s"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self.tasks: dict[int, TaskID] = {}

    def __enter__(self) -> JoinDisplay:
        self.progress.__enter__()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.__exit__(t, e, tb)

    def say(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def event(self, event: RoundEvent) -> None:
        d = event.detail
        if event.kind == "base":
            self.say(f"base model {d['version']} loaded")
        elif event.kind == "privacy":
            self.say(f"round {event.round} privacy: {privacy_text(d)}")
        elif event.kind == "step":
            self._step(event.round, d)
        elif event.kind == "compressed":
            raw, sent = float(d["raw_bytes"]), float(d["payload_bytes"])
            self.say(
                f"round {event.round}: update {size_text(raw)} as bf16 -> {size_text(sent)} compressed "
                f"({raw / max(sent, 1.0):.1f}x smaller)"
            )

    def _step(self, round_number: int, d: dict[str, float | str]) -> None:
        metric = (
            f"reward {float(d['reward']):.4f}" if "reward" in d else f"loss {float(d['loss']):.4f}"
        )
        rate = float(d["tokens_per_s"])
        if round_number not in self.tasks:
            self.tasks[round_number] = self.progress.add_task(
                f"round {round_number}", total=int(float(d["steps"])), metric=metric, rate=rate
            )
        self.progress.update(
            self.tasks[round_number], completed=int(float(d["step"])), metric=metric, rate=rate
        )
        if not self.console.is_terminal and d["step"] == d["steps"]:
            self.say(f"round {round_number}: {d['steps']} steps, last {metric}, {rate:.0f} tok/s")
