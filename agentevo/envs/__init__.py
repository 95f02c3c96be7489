"""Environment families behind the TextEnv contract, built by name."""

from __future__ import annotations

import importlib
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, TextEnv
from agentevo.errors import ConfigError

# name -> (module, class, one-line description). Modules are imported only when used, so a missing
# optional extra only matters for the environment that needs it.
ENVIRONMENTS: dict[str, tuple[str, str, str]] = {
    "twx-cookingworld": (
        "agentevo.envs.textworld_express",
        "CookingWorldEnv",
        "TextWorldExpress CookingWorld: read the cookbook, gather, prepare and eat a meal (fast, JVM)",
    ),
    "twx-twc": (
        "agentevo.envs.textworld_express",
        "TWCEnv",
        "TextWorldExpress TWC: put household objects in their usual places (fast, JVM)",
    ),
    "scienceworld": (
        "agentevo.envs.scienceworld",
        "ScienceWorldEnv",
        "ScienceWorld: 30 elementary-science task types (JVM, ~100 steps/s on the fast path)",
    ),
    "alfworld": (
        "agentevo.envs.alfworld",
        "ALFWorldEnv",
        "ALFWorld text games: real data via ALFWORLD_DATA, or games generated from the wheel's assets",
    ),
    "webshop": (
        "agentevo.envs.webshop",
        "WebShopEnv",
        "WebShop text protocol: the real WebShop when installed, else a local generated shop",
    ),
    "searchqa": (
        "agentevo.envs.searchqa",
        "SearchQAEnv",
        "SearchQA: search[query] over a local BM25 corpus, answer[text] scored by exact match",
    ),
}


def env_names() -> list[str]:
    """All registered environment names."""
    return sorted(ENVIRONMENTS)


def make_env(name: str, **params: Any) -> TextEnv:
    """Build an environment by name with its parameters."""
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"unknown environment {name!r}; choose one of: {', '.join(env_names())} "
            f"(see `agentevo envs list`)"
        )
    module_name, cls_name, _ = ENVIRONMENTS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("agentevo"):
            raise ConfigError(f"environment {name!r} is registered but not implemented in this version") from exc
        raise
    cls = getattr(module, cls_name)
    import inspect

    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"environment {name!r} has no parameter {unknown[0]!r} (check env.params in your config); "
            f"its parameters are: {', '.join(accepted)}"
        )
    return cls(**params)


__all__ = ["ENVIRONMENTS", "SPLITS", "Task", "TaskList", "TextEnv", "env_names", "make_env"]
