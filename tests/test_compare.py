"""agentevo compare: grouping by seed suffix, mean ± sd per evaluation point, env steps, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentevo.cli import main
from agentevo.errors import ConfigError
from agentevo.eval.compare import compare, group_runs


def _run(root: Path, name: str, successes: dict[str, float], steps: dict[str, int] | None = None) -> Path:
    state: dict = {}
    for label, s in successes.items():
        state[f"eval/{label}"] = {"test": {"success_rate": s, "avg_reward": s / 2}}
    for r, n in (steps or {}).items():
        state[f"round-{r}/label"] = {"env_steps_cumulative": n, "env_steps_expert": 100}
    (root / name).mkdir()
    (root / name / "state.json").write_text(json.dumps(state))
    return root / name


def test_groups_by_seed_suffix_with_mean_and_sd(tmp_path: Path) -> None:
    runs = [
        _run(tmp_path, "qe-s0", {"bc": 0.2, "round-1": 0.3}, {1: 500}),
        _run(tmp_path, "qe-s1", {"bc": 0.2, "round-1": 0.1}, {1: 700}),
        _run(tmp_path, "wo-pi-s0", {"bc": 0.2, "round-1": 0.0}),
    ]
    groups = group_runs(runs, "test")
    assert [g.name for g in groups] == ["qe", "wo-pi"]
    # self-collected steps: cumulative minus the 100 expert steps; the BC point is 0
    assert [p.env_steps for p in groups[0].points["round-1"]] == [400.0, 600.0]
    assert groups[0].points["bc"][0].env_steps == 0.0
    path, table = compare(runs, "test", tmp_path / "out")
    # round-1 of qe: mean of 30 and 10 = 20, sample sd = sqrt(((10)^2 + (10)^2) / 1) = 14.1
    assert "| qe | 2 | 20.0 ± 0.0 (n=2) | 20.0 ± 14.1 (n=2) |" in table
    assert "| wo-pi | 1 | 20.0 ± 0.0 (n=1) | 0.0 ± 0.0 (n=1) |" in table
    assert table in path.read_text() and (tmp_path / "out" / "compare.png").exists()
    # average reward is success / 2 here: qe round-1 = mean(15, 5) = 10, sd = sqrt(2 * 5^2) = 7.1
    path, table = compare(runs, "test", tmp_path / "out-r", metric="reward")
    assert "| qe | 2 | 10.0 ± 0.0 (n=2) | 10.0 ± 7.1 (n=2) |" in table
    assert "average final reward" in path.read_text()
    with pytest.raises(ConfigError, match="--metric must be one of success, reward"):
        compare(runs, "test", tmp_path / "out-x", metric="score")


def test_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no state.json"):
        compare([tmp_path / "empty"], "test", tmp_path / "out")
    run = _run(tmp_path, "a-s0", {"bc": 0.5})
    assert main(["compare", str(run), "--split", "dev", "--out", str(tmp_path / "o")]) == 2
    assert "pick another with --split" in capsys.readouterr().err


def test_env_steps_of_eto_and_qlass_evaluations() -> None:
    from agentevo.eval.compare import _env_steps

    state = {"eto/iter-1/explore": {"env_steps": 900}, "eto/iter-2/explore": {"env_steps": 1100},
             "qlass/trees": {"env_steps": 196, "replay_steps": 0}}
    assert _env_steps(state, "eto-iter-1", {}) == 900.0
    assert _env_steps(state, "eto-iter-2", {}) == 2000.0
    assert _env_steps(state, "eto-iter-3", {}) is None  # not explored yet
    assert _env_steps(state, "qlass", {"inference_env_steps": 6356}) == 196.0
    assert _env_steps(state, "bc", {}) == 0.0


def test_env_steps_of_rsd_table_evaluations() -> None:
    from agentevo.eval.compare import _env_steps

    state = {"round-1/act": {"env_steps": 1123}, "round-2/act": {"env_steps": 1318},
             "bon/collect": {"env_steps": 4400}, "harness/bank": {"env_steps": 1050}}
    assert _env_steps(state, "round-1", {}) == 1123.0
    assert _env_steps(state, "round-2", {}) == 2441.0
    assert _env_steps(state, "round-3", {}) is None  # not acted yet
    assert _env_steps(state, "bon-sft", {}) == 4400.0 and _env_steps(state, "harness", {}) == 1050.0
    assert _env_steps(state, "base", {}) == 0.0 and _env_steps(state, "gt-sft", {}) == 0.0
    assert _env_steps(state, "reflexion", {}) is None  # its attempts are test-time steps, not training
