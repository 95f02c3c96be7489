"""The `option()` field helper used by every config dataclass (kept apart so method configs can import it)."""

from __future__ import annotations

import dataclasses
from typing import Any


def option(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a help string (shown by the docs and error messages)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": text})
    return dataclasses.field(default=default, metadata={"help": text})
