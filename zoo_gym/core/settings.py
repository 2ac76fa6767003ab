"""TOML configuration files validated by pydantic, with one-line errors.

Coordinator and client configs are both a file whose relative paths resolve
against the file's own directory (`home`), and both fail with one line that
names the file, the key and what is wrong.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class HomeConfig(BaseModel):
    """A config whose relative paths are relative to `home`."""

    model_config = ConfigDict(extra="forbid")
    home: Path = Path(".")

    def path(self, value: Path | str) -> Path:
        """`value` resolved against `home`."""
        p = Path(value)
        return p if p.is_absolute() else self.home / p


C = TypeVar("C", bound=HomeConfig)


def load_toml(
    path: Path, model: type[C], *, error: type[ValueError], missing: str, kind: str = "config"
) -> C:
    """Read and validate `path` as `model`; `home` defaults to the file's directory.

    Problems raise `error` with one line; `missing` says what to do when the file is absent.
    """
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"no {kind} at {path}; {missing}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path} is not valid TOML ({exc})") from None
    data.setdefault("home", str(path.parent.resolve()))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        raise error(f"{path}: {where}: {err['msg'].removeprefix('Value error, ')}") from None
