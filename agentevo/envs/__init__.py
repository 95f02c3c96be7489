"""Environment families behind the TextEnv contract, built by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
    # The RL debugging ladder (docs/probes.md): pure-Python probes with a known right behaviour.
    "probe-constant": ("agentevo.envs.probes", "ConstantProbe", "Probe: one fixed action always wins"),
    "probe-copy": ("agentevo.envs.probes", "CopyProbe", "Probe: copy the colour named in the observation"),
    "probe-trap": ("agentevo.envs.probes", "TrapProbe",
                   "Probe: two steps, delayed reward; 'take coin' pays now and dead-ends"),
    "probe-hindsight": ("agentevo.envs.probes", "HindsightProbe",
                        "Probe: a vault's password is revealed only after a wrong answer (hindsight)"),
    "probe-guide": ("agentevo.envs.probes", "GuideProbe",
                    "Probe: a row of lights; each observation says whether the last press was right"),
}


class _EnvMap(dict):  # type: ignore[type-arg]
    """The name -> (module, class, description) map; looking up an unknown name first loads the
    `agentevo.envs` entry points, so `name in ENVIRONMENTS` (config validation, make_env) sees installed plug-ins."""

    def __contains__(self, name: object) -> bool:
        if not dict.__contains__(self, name) and isinstance(name, str):
            load_plugins(name)
        return dict.__contains__(self, name)


ENVIRONMENTS = _EnvMap(ENVIRONMENTS)

ENTRY_POINT_GROUP = "agentevo.envs"
_tried_plugins: set[str] = set()  # entry points already loaded (or failed): each is loaded at most once
_FACTORIES: dict[str, Callable[..., Any]] = {}  # register()ed factories by name


def _entry_points() -> list[Any]:
    """The installed `agentevo.envs` entry points (a function, so tests can fake it)."""
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def register(name: str, factory: Callable[..., Any], description: str = "", overwrite: bool = False) -> None:
    """Make an environment buildable by name: factory(**env.params, n_train=, n_dev=, n_test=) returns a TextEnv."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ConfigError(f"environment name must be a non-empty string without spaces (got {name!r})")
    if not callable(factory):
        raise ConfigError(f"environment {name!r}: the factory must be a class or function returning a TextEnv, "
                          f"not {type(factory).__name__}")
    if dict.__contains__(ENVIRONMENTS, name) and not overwrite:
        raise ConfigError(f"environment {name!r} is already registered ({ENVIRONMENTS[name][2]}); pick another "
                          "name, or pass overwrite=True to replace it")
    doc = (getattr(factory, "__doc__", None) or "").strip().splitlines()
    # The map keeps its (module, attribute, description) strings for code that reads it; make_env calls the
    # factory object itself (a lambda or a class defined in a function has no importable attribute).
    _FACTORIES[name] = factory
    ENVIRONMENTS[name] = (str(getattr(factory, "__module__", "") or ""), str(getattr(factory, "__qualname__", "")),
                          description or (doc[0] if doc else name))


def load_plugins(name: str | None = None) -> None:
    """Register the entry-point environments not known yet (only `name`'s when given): each loaded once."""
    for ep in _entry_points():
        if (name is not None and ep.name != name) or ep.name in _tried_plugins:
            continue
        _tried_plugins.add(ep.name)
        if dict.__contains__(ENVIRONMENTS, ep.name):
            continue  # a built-in or register()ed name wins over a plug-in of the same name
        try:
            factory = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in names itself instead of a traceback
            raise ConfigError(f"environment plug-in {ep.name!r} ({ep.value}) failed to load: {exc!r}; fix or "
                              "uninstall the package that declares it") from exc
        register(ep.name, factory)


def env_names() -> list[str]:
    """All registered environment names (installed plug-ins included)."""
    load_plugins()
    return sorted(ENVIRONMENTS)


_TEXT_ENV_MEMBERS = ("name", "final_reward_mode", "tasks", "reset", "step", "expert", "signals", "instruction", "close")


def make_env(name: str, **params: Any) -> TextEnv:
    """Build an environment by name with its parameters."""
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"unknown environment {name!r}; choose one of: {', '.join(env_names())} "
            f"(see `agentevo envs list`)"
        )
    module_name, target, _ = ENVIRONMENTS[name]
    factory = _FACTORIES.get(name)
    if factory is None:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("agentevo"):
                raise ConfigError(f"environment {name!r} is registered but not implemented in this version") from exc
            raise
        factory = getattr(module, target)
    import inspect

    signature = inspect.signature(factory)
    kinds = {p.kind for p in signature.parameters.values()}
    accepted = [p for p, v in signature.parameters.items() if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
    unknown = [] if inspect.Parameter.VAR_KEYWORD in kinds else sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"environment {name!r} has no parameter {unknown[0]!r} (check env.params in your config); "
            f"its parameters are: {', '.join(accepted)}"
        )
    env = factory(**params)
    missing = [m for m in _TEXT_ENV_MEMBERS if not hasattr(env, m)]
    if missing:
        raise ConfigError(f"environment {name!r} built a {type(env).__name__} without {', '.join(missing)}; a "
                          "TextEnv needs all of: " + ", ".join(_TEXT_ENV_MEMBERS) + " (see docs/envs/custom.md)")
    return env


__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "SPLITS", "Task", "TaskList", "TextEnv", "env_names", "load_plugins",
           "make_env", "register"]
