"""Recipe name -> 'module:function'; each function takes a Run and returns its summary."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from agentevo.errors import ConfigError

RECIPES: dict[str, str] = {
    "bc": "agentevo.algorithms.bc:run",
    # Q-Evolve and the baselines of its table
    "qevolve": "agentevo.algorithms.qevolve.recipe:run",
    "eto": "agentevo.algorithms.eto:run",
    "qlass": "agentevo.algorithms.qlass:run",
    # GRPO and Self-Guide
    "grpo": "agentevo.algorithms.grpo.recipe:run",
    "selfguide": "agentevo.algorithms.selfguide.recipe:run",
    # RSD and the baselines of its table
    "rsd": "agentevo.algorithms.rsd.recipe:run",
    "gt_sft": "agentevo.algorithms.rsd.baselines:run_gt_sft",
    "gt_opsd": "agentevo.algorithms.rsd.baselines:run_gt_opsd",
    "bon_sft": "agentevo.algorithms.rsd.bon_sft:run",
    "harness": "agentevo.algorithms.rsd.harness:run",
    "reflexion": "agentevo.algorithms.rsd.reflexion:run",
}

# Recipes whose phases are marked for `accelerate launch`: collection, evaluation, critic / Q-network fitting and
# teacher scoring run on rank 0; every policy fine-tuning phase (agentevo/train/finetune.py) and every GRPO /
# Self-Guide update (grpo.PolicyTrainer under DDP) runs on every rank.
DISTRIBUTED_RECIPES = frozenset(
    {"bc", "qevolve", "eto", "rsd", "gt_sft", "gt_opsd", "bon_sft", "grpo", "selfguide"}
)


def get_recipe(name: str) -> Callable[[Any], dict[str, Any]]:
    """The run() function of a recipe."""
    module, fn = RECIPES[name].split(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise ConfigError(f"recipe {name!r} is registered but not implemented in this version") from exc
        raise
