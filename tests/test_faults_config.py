"""Bad configuration fails in one line before any work: ranges, NaN, list lengths, YAML syntax, env.params."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import yaml

pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis (a bare GPU machine may lack it)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from agentevo.cli import main
from agentevo.config import RunConfig, load_config
from agentevo.errors import ConfigError
from agentevo.options import describe_range, numeric_fields

# fields whose whole real line is meaningful (aux rewards and a reward threshold may have either sign)
ANY_REAL = {"qevolve.r_fmt", "qevolve.r_inv", "qevolve.r_repeat", "qlass.prune_reward"}
RANGED = [(path, f, tp) for path, f, tp in numeric_fields(RunConfig) if "range" in f.metadata]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_every_numeric_field_has_a_range() -> None:
    fields = numeric_fields(RunConfig)
    missing = [path for path, f, _ in fields if "range" not in f.metadata and path not in ANY_REAL]
    assert missing == []
    assert len(RANGED) > 140  # all config sections are covered, the recipe configs and model.http/vllm included
    assert {"optim.betas", "model.http.deadline_s", "model.vllm.max_model_len", "rsd.kl_beta"} <= {p for p, *_ in RANGED}
    assert describe_range({"ge": 0, "lt": 1}) == "in [0, 1)" and describe_range({"gt": 0}) == "> 0"


@pytest.mark.parametrize(("override", "expected"), [
    ("optim.max_length=-1", "optim.max_length must be >= 1 (got -1)"),
    ("optim.save_every=-5", "optim.save_every must be >= 0 (got -5)"),
    ("model.tiny.hidden_size=0", "model.tiny.hidden_size must be >= 1 (got 0)"),
    ("model.tiny.num_layers=-1", "model.tiny.num_layers must be >= 1 (got -1)"),
    ("model.tiny.num_heads=0", "model.tiny.num_heads must be >= 1 (got 0)"),
    ("eval.n_tasks=0", "eval.n_tasks must be >= 1 or null (got 0)"),
    ("bc.n_expert=-1", "bc.n_expert must be >= 1 or null (got -1)"),
    ("optim.grad_clip=-1", "optim.grad_clip must be >= 0 (got -1.0)"),
    ("optim.betas=[0.9]", "optim.betas must be a list of 2 values (got [0.9])"),
    ("optim.betas=[0.9, 0.95, 0.99]", "optim.betas must be a list of 2 values (got [0.9, 0.95, 0.99])"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1] must be in [0, 1) (got 1.0)"),
    ("model.lora.r=-1", "model.lora.r must be >= 1 (got -1)"),
    ("model.lora.dropout=5", "model.lora.dropout must be in [0, 1) (got 5.0)"),
    ("optim.lr=nan", "optim.lr must be a finite number (got nan)"),
    ("optim.lr=.inf", "optim.lr must be a finite number (got inf)"),
    ("optim.epochs=1e999", "optim.epochs must be a finite number (got inf)"),
    (f"optim.epochs={10**400}", "optim.epochs must be a finite number (got 1000"),
    ("rollout.temperature=.nan", "rollout.temperature must be a finite number (got nan)"),
    ("model.torch_threads=-4", "model.torch_threads must be >= 1 or null (got -4)"),
    ("rollout.max_retries=-1", "rollout.max_retries must be >= 0 (got -1)"),
    ("eval.splits=[]", "eval.splits must name at least one of train, dev, test (got [])"),
    ("eval.splits=[val]", "eval.splits: unknown split 'val'"),
    ("bc.warm_start_checkpoint=bon-sft", "bc.warm_start_checkpoint is 'bon-sft' but bc.warm_start_from is not set"),
    ("seed=-1", "seed must be in [0, 4294967295] (got -1)"),
    ("model.http.timeout_s=0", "model.http.timeout_s must be in (0, 3600] (got 0.0)"),
    ("model.http.retries=-1", "model.http.retries must be in [0, 20] (got -1)"),
    ("model.vllm.gpu_memory_utilization=1.5", "model.vllm.gpu_memory_utilization must be in (0, 1] (got 1.5)"),
    ("model.vllm.max_model_len=8", "model.vllm.max_model_len must be >= 16 or null (got 8)"),
    ("qevolve.tau=.nan", "qevolve.tau must be a finite number (got nan)"),
    ("rsd.kl_beta=1", "rsd.kl_beta must be in (0, 1) (got 1.0)"),
    ("selfguide.breakpoints=[0.2, 1.5]", "selfguide.breakpoints[1] must be in [0, 1] (got 1.5)"),
    ("eto.warmup_ratio=-0.1", "eto.warmup_ratio must be in [0, 1) (got -0.1)"),
    ("qlass.gamma=2", "qlass.gamma must be in [0, 1] (got 2.0)"),
])
def test_impossible_values_are_one_line_errors(override: str, expected: str) -> None:
    assert _error([override]).startswith(expected)


def test_cli_rejects_before_making_the_run_folder(capsys, tmp_path) -> None:  # noqa: ANN001
    runs = tmp_path / "runs"
    assert main(["train", "bc", "--set", "model.tiny.num_heads=0", "--output-dir", str(runs)]) == 2
    assert capsys.readouterr().err.strip() == "error: model.tiny.num_heads must be >= 1 (got 0)"
    assert main(["train", "bc", "--set", "env.params.max_stepz=3", "--output-dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: environment 'twx-cookingworld' has no parameter 'max_stepz'") and "max_steps" in err
    assert len(err.splitlines()) == 1
    assert not runs.exists()


def test_invalid_yaml_names_file_line_and_column(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "bad.yaml"
    path.write_text("env:\n  name: twx-twc\noptim:\n  lr: [0.1\n  epochs: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"config file {str(path)!r} is not valid YAML: ") and "\n" not in msg
    assert msg.endswith("at line 5, column 9")
    path.write_text("a: b: c\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: mapping values are not allowed here at line 1, column 5$"):
        load_config(path)
    msg = _error(["optim.lr=1", "env.params={max_steps: 2"])
    assert msg.startswith("--set 'env.params={max_steps: 2': the value is not valid YAML (") and "line 1, column" in msg
    assert msg.endswith("quote it, e.g. --set \"env.params='...'\"")


def test_env_params_checked_against_the_factory_signature(monkeypatch) -> None:  # noqa: ANN001
    from agentevo.envs import ENVIRONMENTS

    msg = _error(["env.name=searchqa", "env.params={max_steps: 3, corpus: x}"])
    assert msg.startswith("environment 'searchqa' has no parameter 'corpus' (check env.params in your config)")
    assert "corpus_path" in msg and "max_steps" in msg
    assert load_config(None, ["env.name=searchqa", "env.params={max_steps: 3}"]).env.params == {"max_steps": 3}

    class Strict:
        def __init__(self, size: int = 1, *, colour: str = "red") -> None: ...

    class Open:
        def __init__(self, size: int = 1, **kwargs: object) -> None: ...

    fake = types.ModuleType("agentevo_fake_envs")
    fake.Strict, fake.Open = Strict, Open  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentevo_fake_envs", fake)
    monkeypatch.setitem(ENVIRONMENTS, "fake-strict", ("agentevo_fake_envs", "Strict", "test"))
    monkeypatch.setitem(ENVIRONMENTS, "fake-open", ("agentevo_fake_envs", "Open", "test"))
    assert _error(["env.name=fake-strict", "env.params={size: 2, shape: 3}"]) == (
        "environment 'fake-strict' has no parameter 'shape' (check env.params in your config); "
        "its parameters are: size, colour")
    assert load_config(None, ["env.name=fake-strict", "env.params={colour: blue}"]).env.params == {"colour": "blue"}
    # a factory taking **kwargs accepts any key
    assert load_config(None, ["env.name=fake-open", "env.params={shape: 3}"]).env.params == {"shape": 3}


# -- property-based: random fields, random junk -----------------------------------------------------------------


def _leaf_paths(cls: type, where: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        path = f"{where}.{f.name}" if where else f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.extend(_leaf_paths(type(default), path) if dataclasses.is_dataclass(default) else [path])
    return out


LEAVES = [p for p in _leaf_paths(RunConfig) if p not in ("method",)]
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _as_yaml(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(LEAVES), raw=st.one_of(JUNK.map(_as_yaml), st.text(max_size=10)))
def test_any_value_in_any_field_is_accepted_or_a_config_error(path: str, raw: str) -> None:
    try:
        load_config(None, [f"{path}={raw}"])
    except ConfigError as exc:
        assert "\n" not in str(exc)


@st.composite
def _out_of_range(draw: st.DrawFn) -> tuple[str, str]:
    path, f, tp = draw(st.sampled_from(RANGED))
    bounds = f.metadata["range"]
    is_tuple = getattr(tp, "__origin__", None) is tuple
    if tp is int:  # just past each bound (an open bound itself is out)
        step = draw(st.integers(1, 10**6))
        edge = {"ge": -step, "gt": 1 - step, "le": step, "lt": step - 1}
        choices: list[object] = [bounds[k] + edge[k] for k in bounds]
    else:
        step = draw(st.floats(1e-3, 1e6))
        edge = {"ge": -step, "gt": 1e-3 - step, "le": step, "lt": step - 1e-3}
        choices = [bounds[k] + edge[k] for k in bounds] + [math.nan, math.inf, -math.inf]
    value = draw(st.sampled_from(choices))
    text = {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan" if value != value else repr(value))
    return path, f"[{text}, {text}]" if is_tuple else text


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=_out_of_range())
def test_out_of_range_values_always_name_their_field(case: tuple[str, str]) -> None:
    path, text = case
    msg = _error([f"{path}={text}"])
    assert msg.startswith(path + ("[0]" if text.startswith("[") else "") + " must be "), msg
