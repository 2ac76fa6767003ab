"""Rich progress for `gym-client join`: one bar per round, plain lines otherwise."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from zoo_gym.client.runtime import RoundEvent


class JoinDisplay:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.0f} tok/s"), TimeElapsedColumn(),
            console=console, transient=True, disable=not console.is_terminal,
        )
        self.tasks: dict[int, TaskID] = {}

    def __enter__(self) -> JoinDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.__exit__(t, e, tb)

    def say(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)

    def event(self, event: RoundEvent) -> None:
        if event.kind == "base":
            self.say(f"base model {event.detail['version']} loaded")
        elif event.kind == "step":
            d = event.detail
            if event.round not in self.tasks:
                self.tasks[event.round] = self.progress.add_task(
                    f"round {event.round}", total=int(float(d["steps"])), loss=0.0, rate=0.0)
            self.progress.update(self.tasks[event.round], completed=int(float(d["step"])),
                                 loss=float(d["loss"]), rate=float(d["tokens_per_s"]))
            if not self.console.is_terminal and d["step"] == d["steps"]:
                self.say(f"round {event.round}: {d['steps']} steps, last loss {float(d['loss']):.4f}, "
                         f"{float(d['tokens_per_s']):.0f} tok/s")
