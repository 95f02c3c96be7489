"""The methods. One module per method that fits in one (bc, eto, qlass); a subpackage per family that spans several
files (qevolve, grpo, selfguide, rsd: each a `recipe` with the numbered steps and a `config` dataclass); shared math
in `advantages` and `losses`. `agentevo.recipes.RECIPES` maps each `method:` name to its `run` function."""
