"""Recipe name -> 'module:function'; each function takes a Run and returns its summary."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RECIPES: dict[str, str] = {
    "bc": "agentevo.algorithms.bc:run",
}


def get_recipe(name: str) -> Callable[[Any], dict[str, Any]]:
    """The run() function of a recipe."""
    module, fn = RECIPES[name].split(":")
    return getattr(importlib.import_module(module), fn)
