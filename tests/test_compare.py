"""agentevo compare: grouping by seed suffix, mean ± sd per evaluation point, env steps, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentevo.cli import main
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.eval.compare import compare, group_runs, load_points
from agentevo.eval.metrics import eval_collection


def _run(root: Path, name: str, successes: dict[str, float], steps: dict[str, int] | None = None,
         outcomes: dict[str, list[int]] | None = None, env: str | None = None, task_hash: str | None = None) -> Path:
    """A run folder: state.json (eval points), optionally config.yaml (env) and experience.db (per-task outcomes
    of tasks t0, t1, ... for each label in `outcomes`, success 0/1 and final reward = success / 2)."""
    state: dict = {}
    for label, s in successes.items():
        state[f"eval/{label}"] = {"test": {"success_rate": s, "avg_reward": s / 2}}
        if task_hash:
            state[f"eval/{label}"]["test"]["task_hash"] = task_hash
    for r, n in (steps or {}).items():
        state[f"round-{r}/label"] = {"env_steps_cumulative": n, "env_steps_expert": 100}
    (root / name).mkdir()
    (root / name / "state.json").write_text(json.dumps(state))
    if env:
        (root / name / "config.yaml").write_text(f"method: bc\nenv:\n  name: {env}\n")
    if outcomes:
        store = ExperienceStore(root / name / "experience.db")
        for label, wins in outcomes.items():
            for k, won in enumerate(wins):
                task = Task(env or "twx", f"t{k}", "test", "cook")
                store.add(Trajectory(task, "self", label, "", [], won / 2, bool(won)), eval_collection(label, "test"), k)
        store.close()
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
    result = compare(runs, "test", tmp_path / "out")
    # round-1 of qe: mean of 30 and 10 = 20, sample sd = sqrt(((10)^2 + (10)^2) / 1) = 14.1; then each seed's value
    table = result.table
    assert "| qe | ? | s0, s1 | 20.0 ± 0.0 (20.0 / 20.0) | 20.0 ± 14.1 (30.0 / 10.0) |" in table
    assert "| wo-pi | ? | s0 | 20.0 ± 0.0 (20.0) | 0.0 ± 0.0 (0.0) |" in table
    assert table in result.path.read_text() and (tmp_path / "out" / "compare.png").exists()
    # no experience.db: the arms are listed but not paired, and the reason is given
    assert "| wo-pi | bc | not paired: no per-task outcomes in wo-pi-s0/experience.db |" in result.paired_table
    assert result.sentences == ["- **wo-pi** (round-1; qe at round-1): not paired with qe (no per-task outcomes in "
                                "wo-pi-s0/experience.db)."]
    # average reward is success / 2 here: qe round-1 = mean(15, 5) = 10, sd = sqrt(2 * 5^2) = 7.1
    result = compare(runs, "test", tmp_path / "out-r", metric="reward")
    assert "| qe | ? | s0, s1 | 10.0 ± 0.0 (10.0 / 10.0) | 10.0 ± 7.1 (15.0 / 5.0) |" in result.table
    assert "average final reward" in result.path.read_text()
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


def _paired_runs(root: Path) -> list[Path]:
    # per task t0..t3: base s0 1000, s1 1100; qe s0 1110, s1 1101 -> differences s0 0110, s1 0001
    return [
        _run(root, "base-s0", {"round-1": 0.25}, outcomes={"round-1": [1, 0, 0, 0]}, env="twx", task_hash="h4"),
        _run(root, "base-s1", {"round-1": 0.5}, outcomes={"round-1": [1, 1, 0, 0]}, env="twx", task_hash="h4"),
        _run(root, "qe-s1", {"bc": 0.5, "round-1": 0.75}, outcomes={"bc": [1, 1, 0, 0], "round-1": [1, 1, 0, 1]},
             env="twx", task_hash="h4"),
        _run(root, "qe-s0", {"bc": 0.25, "round-1": 0.75}, outcomes={"bc": [1, 0, 0, 0], "round-1": [1, 1, 1, 0]},
             env="twx", task_hash="h4"),
    ]


def test_paired_difference_vs_baseline_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _paired_runs(tmp_path)
    result = compare(runs, "test", tmp_path / "out")
    assert result.baseline == "base"
    # columns in the order the labels first appear: base's round-1, then qe's bc
    assert "| base | twx | s0, s1 | 37.5 ± 17.7 (25.0 / 50.0) | - |" in result.table
    assert "| qe | twx | s0, s1 | 75.0 ± 0.0 (75.0 / 75.0) | 37.5 ± 17.7 (25.0 / 50.0) |" in result.table
    # 3 better cells, 0 worse: mean 3/8 = 37.5 points, p = 2 / 2^3; per seed 2/4 and 1/4 of the tasks (+50, +25);
    # per-task means 0, 50, 50, 50 -> [12.5, 50] (see test_stats); resampling seeds as well: of the 2^2 x 4^4
    # equally likely (rows, columns) draws of [[0,100,100,0],[0,0,0,100]], the 2.5% / 97.5% quantiles are 0 and 75
    # (enumerated). `bc` is not in the baseline, so it is read against the baseline's last point (round-1),
    # whose outcomes it equals task for task: +0.0, no discordant cell, p = 1
    assert result.paired_table.splitlines()[2:] == [
        "| qe | bc vs round-1 | 2 | 4 | +0.0 | +0.0 / +0.0 | [+0.0, +0.0] | [+0.0, +0.0] | 0 / 0 | 1 |",
        "| qe | round-1 | 2 | 4 | +37.5 | +50.0 / +25.0 | [+12.5, +50.0] | [+0.0, +75.0] | 3 / 0 | 0.25 |"]
    assert result.sentences == ["- **qe** (round-1; base at round-1): difference vs base: +37.5 points "
                                "[+12.5, +50.0], p = 0.25 (3 better / 0 worse over 2 seed pair(s) x 4 tasks); "
                                "the interval excludes zero, but the exact test does not rule out chance "
                                "(p >= 0.05): too few tasks."]
    text = result.path.read_text()
    assert result.paired_table in text and result.sentences[0] in text and "![comparison](compare.png)" in text
    # the other way round (--baseline qe): every difference changes sign, so does the interval
    assert main(["compare", *map(str, runs), "--baseline", "qe", "--out", str(tmp_path / "o2")]) == 0
    out = capsys.readouterr().out
    assert "| base | round-1 | 2 | 4 | -37.5 | -50.0 / -25.0 | [-50.0, -12.5] | [-75.0, +0.0] | 0 / 3 | 0.25 |" in out
    assert ("- **base** (round-1; qe at round-1): difference vs qe: -37.5 points [-50.0, -12.5], p = 0.25" in out)
    # reward (= success / 2 here): every difference halves, the sign test is unchanged
    result = compare(runs, "test", tmp_path / "o3", metric="reward")
    assert "| qe | round-1 | 2 | 4 | +18.8 | +25.0 / +12.5 | [+6.2, +25.0] | [+0.0, +37.5] | 3 / 0 | 0.25 |" in result.paired_table
    assert "exact sign test on the per-task score differences" in result.text


def test_baseline_point_pairs_each_run_with_its_own_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _paired_runs(tmp_path)
    result = compare(runs, "test", tmp_path / "out", baseline_point="bc")
    # qe's own bc -> round-1: s0 1000 -> 1110, s1 1100 -> 1101: the same cells as vs `base` above, so the same
    # numbers (+37.5 [+12.5, +50.0], 3 better / 0 worse, p = 2 / 2^3); `base` has no bc point and says so
    assert result.paired_table.splitlines()[2:] == [
        "| base | round-1 vs bc | not paired: no evaluation at 'bc' in this arm | | | | | | | |",
        "| qe | round-1 vs bc | 2 | 4 | +37.5 | +50.0 / +25.0 | [+12.5, +50.0] | [+0.0, +75.0] | 3 / 0 | 0.25 |"]
    assert result.sentences[1].startswith("- **qe** (round-1): difference vs its own bc: +37.5 points [+12.5, +50.0]")
    assert "each run paired with itself" in result.text
    # only the points after the start: an `init` evaluated before `bc` is not a result of the method
    early = _run(tmp_path, "e-s0", {"init": 0.0, "bc": 0.5, "round-1": 0.5}, outcomes={
        "init": [0, 0], "bc": [1, 0], "round-1": [0, 1]})
    rows = compare([early], "test", tmp_path / "o5", baseline_point="bc").paired_table.splitlines()[2:]
    assert rows == ["| e | round-1 vs bc | 1 | 2 | +0.0 | +0.0 | [-100.0, +100.0] | - (one seed pair) | 1 / 1 | 1 |"]
    assert main(["compare", *map(str, runs[2:]), "--baseline-point", "bc", "--out", str(tmp_path / "o2")]) == 0
    assert "| qe | round-1 vs bc | 2 | 4 | +37.5 |" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--baseline-point 'init': no arm has an evaluation with that label"):
        compare(runs, "test", tmp_path / "o3", baseline_point="init")
    with pytest.raises(ConfigError, match="not both"):
        compare(runs, "test", tmp_path / "o4", baseline="base", baseline_point="bc")


def test_interval_including_zero_is_worded_honestly(tmp_path: Path) -> None:
    runs = [_run(tmp_path, "a-s0", {"bc": 0.5}, outcomes={"bc": [1, 0]}),
            _run(tmp_path, "b-s0", {"bc": 0.5}, outcomes={"bc": [0, 1]})]
    result = compare(runs, "test", tmp_path / "out")
    # same success, different tasks: mean 0, per-task differences -100 and +100 -> [-100, +100]
    assert result.sentences == ["- **b** (bc; a at bc): difference vs a: +0.0 points [-100.0, +100.0], p = 1 "
                                "(1 better / 1 worse over 1 seed pair(s) x 2 tasks); the interval includes zero: "
                                "these runs do not show a difference at this sample size."]
    assert "significant" not in result.text


def test_refuses_to_pair_different_task_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run(tmp_path, "a-s0", {"bc": 0.5}, outcomes={"bc": [1, 0]}, env="twx", task_hash="h1")
    b = _run(tmp_path, "b-s0", {"bc": 0.5}, outcomes={"bc": [1, 0]}, env="twx", task_hash="h2")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runs 'b-s0' and 'a-s0' were evaluated on different task lists for split 'test' "
                          "(task hash h2 vs h1); pair only runs evaluated on the same tasks")
    assert len(err.strip().splitlines()) == 1
    # same hash (or none) but other task ids in the stores
    c = _run(tmp_path, "c-s0", {"bc": 0.5}, outcomes={"bc": [1, 0, 1]}, env="twx")
    with pytest.raises(ConfigError, match=r"'c-s0' and 'a-s0' .*\(their task ids differ\)"):
        compare([a, c], "test", tmp_path / "o")


def test_mixed_environments_are_labelled_and_not_paired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run(tmp_path, "a-s0", {"bc": 0.5}, outcomes={"bc": [1, 0]}, env="twx", task_hash="h1")
    b = _run(tmp_path, "b-s0", {"bc": 0.2}, outcomes={"bc": [0, 0]}, env="alfworld", task_hash="h2")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "warning: this table mixes environments (twx, alfworld)" in captured.err
    assert "| b | alfworld | s0 | 20.0 ± 0.0 (20.0) |" in captured.out
    assert "| b | bc | not paired: different environment (alfworld vs twx) |" in captured.out
    assert "> warning: this table mixes environments" in (tmp_path / "o" / "compare.md").read_text()


def test_baseline_and_seed_errors(tmp_path: Path) -> None:
    runs = _paired_runs(tmp_path)
    with pytest.raises(ConfigError, match=r"--baseline 'bc' is not one of the arms \(base, qe\)"):
        compare(runs, "test", tmp_path / "o", baseline="bc")
    (tmp_path / "copy").mkdir()
    again = _run(tmp_path / "copy", "qe-s0", {"bc": 0.5})
    with pytest.raises(ConfigError, match="are both seed 0 of arm 'qe'; give each seed of an arm once"):
        compare([*runs, again], "test", tmp_path / "o")


def test_interval_and_exact_test_agreeing_say_the_interval_excludes_zero(tmp_path: Path) -> None:
    # 10 tasks, the arm wins on 8 and loses none: p = 2 / 2^8 = 0.0078; per-task differences eight 100s and two 0s:
    # a resample's mean is 10 * K with K ~ Binomial(10, 0.8): P(K <= 4) = 0.6%, P(K <= 5) = 3.3%, so the 2.5%
    # quantile is 50; P(K = 10) = 11%, so the 97.5% quantile is 100
    runs = [_run(tmp_path, "a-s0", {"bc": 0.2}, outcomes={"bc": [1, 1] + [0] * 8}),
            _run(tmp_path, "b-s0", {"bc": 1.0}, outcomes={"bc": [1] * 10})]
    (sentence,) = compare(runs, "test", tmp_path / "out").sentences
    assert sentence.startswith("- **b** (bc; a at bc): difference vs a: +80.0 points [+50.0, +100.0], p = 0.0078 ")
    assert sentence.endswith("; the interval excludes zero.")


def test_standalone_evaluations_pair_by_checkpoint_name_across_seeds(tmp_path: Path) -> None:
    # `agentevo eval` labels an evaluation CHECKPOINT-<hash>, a hash that differs per seed's checkpoint; compare
    # matches them by the checkpoint's name, so two seeds pool (s0: +1 task of 2, s1: +2 of 2 -> +75.0, 3 / 0; task
    # means 100 / 50 -> [50, 100]; resampling seeds too, seed 0 twice and its null task twice has p 1/16 -> [0, 100])
    runs = [_run(tmp_path, "b-s0", {"update-3-0a1b2c3d": 0.0}, outcomes={"update-3-0a1b2c3d": [0, 0]}),
            _run(tmp_path, "b-s1", {"update-3-99887766": 0.0}, outcomes={"update-3-99887766": [0, 0]}),
            _run(tmp_path, "a-s0", {"update-3-deadbeef": 0.5}, outcomes={"update-3-deadbeef": [1, 0]}),
            _run(tmp_path, "a-s1", {"update-3-12345678": 1.0}, outcomes={"update-3-12345678": [1, 1]})]
    result = compare(runs, "test", tmp_path / "out", baseline="b")
    assert result.paired_table.splitlines()[2:] == [
        "| a | update-3 | 2 | 2 | +75.0 | +50.0 / +100.0 | [+50.0, +100.0] | [+0.0, +100.0] | 3 / 0 | 0.25 |"]
    # two evaluations of different checkpoints with the same name in one folder keep their full labels
    (tmp_path / "two").mkdir()
    two = _run(tmp_path / "two", "c-s0", {"bc-11111111": 0.5, "bc-22222222": 0.0},
               outcomes={"bc-11111111": [1, 0], "bc-22222222": [0, 0]})
    assert [p.label for p in load_points(two, "test")] == ["bc-11111111", "bc-22222222"]


def test_a_difference_one_seed_carries_is_called_inconsistent_across_seeds(tmp_path: Path) -> None:
    # 20 tasks; the arm's seed 1 wins every task its baseline seed loses, seed 0 changes nothing: 20 better / 0 worse,
    # every task's mean difference is 50, so the task interval is [50, 50]; resampling the two seeds as well gives
    # seed 0 twice (mean 0) with p 1/4, one of each (50) with p 1/2, seed 1 twice (100) with p 1/4: [0, 100]
    runs = [_run(tmp_path, "b-s0", {"bc": 0.0}, outcomes={"bc": [0] * 20}),
            _run(tmp_path, "b-s1", {"bc": 0.0}, outcomes={"bc": [0] * 20}),
            _run(tmp_path, "a-s0", {"bc": 0.0}, outcomes={"bc": [0] * 20}),
            _run(tmp_path, "a-s1", {"bc": 1.0}, outcomes={"bc": [1] * 20})]
    result = compare(runs, "test", tmp_path / "out", baseline="b")
    assert result.paired_table.splitlines()[2:] == [
        "| a | bc | 2 | 20 | +50.0 | +0.0 / +100.0 | [+50.0, +50.0] | [+0.0, +100.0] | 20 / 0 | < 0.001 |"]
    (sentence,) = result.sentences
    assert sentence == ("- **a** (bc; b at bc): difference vs b: +50.0 points [+50.0, +50.0], p < 0.001 (20 better / 0 "
                        "worse over 2 seed pair(s) x 20 tasks); the interval over tasks excludes zero, but not the one "
                        "over seeds and tasks [+0.0, +100.0]: the seeds disagree (per seed +0.0 / +100.0), so the "
                        "difference may not hold for another training seed; run more seeds.")
    # both seeds win the same 12 of the 20 tasks: resampling identical seeds changes nothing, so both intervals are
    # 100 K / 20 with K ~ Binomial(20, 0.6): P(K <= 7) = 2.1% < 2.5% < P(K <= 8), P(K >= 17) = 1.6% < 2.5% <
    # P(K >= 16): [40, 80]
    (tmp_path / "c").mkdir()
    runs[2] = _run(tmp_path / "c", "a-s0", {"bc": 0.6}, outcomes={"bc": [1] * 12 + [0] * 8})
    runs[3] = _run(tmp_path / "c", "a-s1", {"bc": 0.6}, outcomes={"bc": [1] * 12 + [0] * 8})
    (sentence,) = compare(runs, "test", tmp_path / "out2", baseline="b").sentences
    assert sentence.startswith("- **a** (bc; b at bc): difference vs b: +60.0 points [+40.0, +80.0], p < 0.001")
    assert sentence.endswith("the interval excludes zero, and so does the one over seeds and tasks [+40.0, +80.0].")


# -- the newcomer's small things: plain progress lines, readable Phases, recipes in `train --help` ------------------
def test_plain_progress_lines_at_each_tenth_and_every_interval() -> None:
    import io

    from agentevo.run import ProgressBar

    now = [100.0]
    out = io.StringIO()
    bar = ProgressBar(None, None, plain="eval bc on test", total=50, interval=30.0, clock=lambda: now[0], out=out)
    for _ in range(12):
        now[0] += 2.5  # 12 items in 30 s: a line at 5 and 10 (tenths), none at 12 yet
        bar.advance()
    assert out.getvalue().splitlines() == ["eval bc on test: 5/50 (10%) 00:12 elapsed",
                                           "eval bc on test: 10/50 (20%) 00:25 elapsed"]
    now[0] += 3661  # no new tenth, but over 30 s since the last line
    bar.advance()
    assert out.getvalue().splitlines()[-1] == "eval bc on test: 13/50 (26%) 1:01:31 elapsed"
    bar.finish()  # nothing new since that line
    assert len(out.getvalue().splitlines()) == 3
    # training: update() with an unknown total prints by time only; finish() prints where it ended
    out = io.StringIO()
    bar = ProgressBar(None, None, plain="round 1: critic", clock=lambda: now[0], out=out)
    bar.update(7)
    bar.finish()
    assert out.getvalue() == "round 1: critic: 7 00:00 elapsed\n"
    # a quiet bar does nothing
    ProgressBar(None, None).advance(3)


def test_run_progress_prints_plain_lines_when_stdout_is_piped(capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from agentevo.run import Run

    with Run.progress(SimpleNamespace(quiet=False), "eval bc on test", 4) as bar:  # pytest's stdout is no TTY
        bar.advance(4)
    assert capsys.readouterr().out == "eval bc on test: 4/4 (100%) 00:00 elapsed\n"
    with Run.progress(SimpleNamespace(quiet=True), "eval bc on test", 4) as bar:
        bar.advance(4)
    assert capsys.readouterr().out == ""


def test_report_phases_are_readable() -> None:
    from agentevo.eval.report import format_value

    value = {"loss": 0.12345678901234567, "steps": 400, "lr": 3e-05, "ok": True, "by_type": {"a": 0.5, "b": 1 / 3},
             "curve": [0.1, 0.25, 1 / 3], "empty": {}}
    assert format_value(value) == ("loss: 0.1235, steps: 400, lr: 3e-05, ok: True, by_type: (a: 0.5, b: 0.3333), "
                                   "curve: [0.1, 0.25, 0.3333], empty: -")
    assert format_value(list(range(20)), max_items=3) == "[0, 1, 2, ... (20 in all)]"
    assert format_value(12345.678) == "1.235e+04" and format_value("done") == "done"


def test_train_help_lists_the_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    from agentevo.recipes import RECIPES

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "recipes: " + ", ".join(RECIPES) in out and "qevolve" in out


def test_a_later_point_is_not_read_against_an_earlier_one_of_the_same_series(tmp_path: Path) -> None:
    # the baseline is still running (no update-6 yet): the arm's update-6 is not paired with its update-3, and the
    # sentence reads the last point both have; BC-style fallbacks (another series) still pair
    base = _run(tmp_path, "none-s0", {"bc": 0.0, "update-3": 0.25}, env="twx", task_hash="h",
                outcomes={"bc": [0, 0, 0, 0], "update-3": [1, 0, 0, 0]})
    arm = _run(tmp_path, "sg-s0", {"bc": 0.0, "update-3": 0.75, "update-6": 1.0}, env="twx", task_hash="h",
               outcomes={"bc": [0, 0, 0, 0], "update-3": [1, 1, 1, 0], "update-6": [1, 1, 1, 1]})
    result = compare([base, arm], "test", tmp_path / "out")
    rows = result.paired_table.splitlines()[2:]
    assert rows[0].startswith("| sg | bc | 1 | 4 | +0.0 |")
    assert rows[1].startswith("| sg | update-3 | 1 | 4 | +50.0 |")  # 2 better / 0 worse
    assert rows[2] == ("| sg | update-6 vs update-3 | not paired: the baseline has no update-6 (its last evaluation "
                       "is update-3: still running or a shorter run); compare at a point both have | | | | | | | |")
    assert len(rows) == 3
    assert result.sentences[0].startswith("- **sg** (update-3; none at update-3): difference vs none: +50.0 points")
    # the other way round the arm is the shorter run: update-3 pairs with update-3, and no update-3 vs update-6 row
    rows = compare([arm, base], "test", tmp_path / "o2").paired_table.splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["bc", "update-3"]
    # another series still falls back to the baseline's last point (GRPO's update-3 vs a BC-only run's bc)
    bc = _run(tmp_path, "bc-s0", {"bc": 0.25}, env="twx", task_hash="h", outcomes={"bc": [1, 0, 0, 0]})
    rows = compare([bc, arm], "test", tmp_path / "o3").paired_table.splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["bc", "update-3 vs bc", "update-6 vs bc"]
    assert rows[2].startswith("| sg | update-6 vs bc | 1 | 4 | +75.0 |")


def test_baseline_at_pairs_with_a_chosen_point_of_the_baseline(tmp_path: Path) -> None:
    # a control matched to the arm's round 2 has one evaluation, bon-sft: --baseline-at pairs the arm's bon-sft-2
    # with it (chosen, so the same-series guard stands aside); the arm's bon-sft still pairs label with label
    control = _run(tmp_path, "ctl-s0", {"bc": 0.0, "bon-sft": 0.75}, env="twx", task_hash="h",
                   outcomes={"bc": [0, 0, 0, 0], "bon-sft": [1, 1, 1, 0]})
    arm = _run(tmp_path, "bon-s0", {"bc": 0.0, "bon-sft": 0.25, "bon-sft-2": 0.5}, env="twx", task_hash="h",
               outcomes={"bc": [0, 0, 0, 0], "bon-sft": [1, 0, 0, 0], "bon-sft-2": [1, 1, 0, 0]})
    result = compare([control, arm], "test", tmp_path / "out", baseline="ctl", baseline_at="bon-sft")
    rows = result.paired_table.splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["bc", "bon-sft", "bon-sft-2 vs bon-sft"]
    assert rows[1].startswith("| bon | bon-sft | 1 | 4 | -50.0 |") and rows[2].startswith(
        "| bon | bon-sft-2 vs bon-sft | 1 | 4 | -25.0 | -25.0 |")  # 0 better / 1 worse
    assert result.sentences[0].startswith("- **bon** (bon-sft-2; ctl at bon-sft): difference vs ctl: -25.0 points")
    assert "Paired differences vs `ctl` at `bon-sft` (arm − baseline" in result.text and result.baseline == "ctl at bon-sft"
    without = compare([control, arm], "test", tmp_path / "o2", baseline="ctl").paired_table
    assert "not paired: the baseline has no bon-sft-2" in without  # the default refuses that pair
    with pytest.raises(ConfigError, match=r"--baseline-at 'round-1': the baseline ctl has no evaluation with that "
                                          r"label; give one of bc, bon-sft$"):
        compare([control, arm], "test", tmp_path / "o3", baseline="ctl", baseline_at="round-1")
    with pytest.raises(ConfigError, match="--baseline-at names a point of the baseline arm; it goes with --baseline"):
        compare([control, arm], "test", tmp_path / "o4", baseline_point="bc", baseline_at="bon-sft")


def test_premise_diagnostics_of_each_run_sit_beside_the_differences(tmp_path: Path) -> None:
    """compare.md lists each run's diagnostics tables with the worst verdict and the rows that do not pass."""
    a = _run(tmp_path, "g-s0", {"bc": 0.5, "update-1": 1.0}, outcomes={"bc": [1, 0], "update-1": [1, 1]})
    b = _run(tmp_path, "g-s1", {"bc": 0.5, "update-1": 0.5}, outcomes={"bc": [0, 1], "update-1": [0, 1]})
    # GRPO update 1: 0.9 of the groups all equal (fail, > 0.8), KL 0.2 (warn, 0.1-0.5), clipping 0.01 (pass)
    (a / "metrics.jsonl").write_text(json.dumps({"time": 0.0, "phase": "diag/grpo", "step": 1, "zero_var_frac": 0.9,
                                                 "kl": 0.2, "clip_frac_low": 0.01}) + "\n"
                                     + json.dumps({"time": 0.0, "phase": "grpo/train", "step": 1, "loss": 1.0}) + "\n"
                                     + '{"time": 0.0, "phase": "diag/gr')  # a line a killed run left half-written
    (b / "metrics.jsonl").write_text(json.dumps({"time": 0.0, "phase": "diag/grpo", "step": 1, "zero_var_frac": 0.1,
                                                 "kl": 0.01}) + "\n")
    text = compare([a, b], "test", tmp_path / "out", baseline_point="bc").text
    assert "| g | s0 | grpo, update 1 | fail | fail: zero-variance groups (all rewards equal); warn: KL to the " \
           "reference (k3, per token) |" in text
    assert "| g | s1 | grpo, update 1 | pass | - |" in text
    assert text.index("Premise diagnostics") > text.index("Paired differences")
    # the BC start's table, from the held-out evaluation of the BC checkpoint in the metrics
    with (b / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"time": 0.0, "phase": "eval/bc/test", "step": 0, "invalid_rate": 0.4,
                            "format_error_rate": 0.0}) + "\n")
    text = compare([a, b], "test", tmp_path / "out2", baseline_point="bc").text
    assert ("| g | s1 | BC start (every method's first policy), held-out test | fail | fail: held-out invalid actions "
            "(BC start; the expert's are 0) |") in text
    # runs without diagnostics: no section
    plain = _run(tmp_path, "p-s0", {"bc": 0.5}, outcomes={"bc": [1, 0]})
    assert "Premise diagnostics" not in compare([plain], "test", tmp_path / "o2").text


def test_noise_floor_reads_each_arm_against_the_same_method_trained_again(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Per-seed differences vs base (3 seeds x 4 tasks): the arm +25 / +25 / +25; the two noise-floor arms
    0 / -25 / +25 and +25 / 0 / 0. The arm's three values are read against the six by an exact permutation test."""
    base = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    arm = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    noise = {"n1": [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], "n2": [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]}
    runs = []
    for s in range(3):
        runs.append(_run(tmp_path, f"base-s{s}", {"r1": sum(base[s]) / 4}, outcomes={"r1": base[s]}))
        runs.append(_run(tmp_path, f"arm-s{s}", {"r1": sum(arm[s]) / 4}, outcomes={"r1": arm[s]}))
        for name, rows in noise.items():
            runs.append(_run(tmp_path, f"{name}-s{s}", {"r1": sum(rows[s]) / 4}, outcomes={"r1": rows[s]}))
    result = compare(runs, "test", tmp_path / "out", baseline="base", noise_floor=["n1", "n2"])
    draws = "+0.0 / -25.0 / +25.0 / +25.0 / +0.0 / +0.0"
    # pooled [25, 25, 25] + [0, -25, 25, 25, 0, 0] (total 75): arm mean 25, noise mean 4.17, gap +20.8; noise sd
    # sqrt(1770.8 / 5) = 18.8. A triple with sum S differs from the other six by S / 3 - (75 - S) / 6 = S / 2 - 12.5:
    # >= 20.8 needs S = 75, three of the five +25s: C(5, 3) = 10 of C(9, 3) = 84 splits (0.119 one-sided);
    # <= -20.8 needs S <= -16.7: -25 with two of the three zeros, 3 more (13 / 84 = 0.155 two-sided).
    assert result.noise_table.splitlines()[2] == f"| arm | +25.0 / +25.0 / +25.0 | {draws} | +20.8 | 0.119 / 0.155 |"
    assert result.noise_sentences[0].startswith("- **arm** against the noise floor (n1, n2: 6 differences from base, "
                                                "sd 18.8): +20.8 points beyond their mean, permutation p = 0.155")
    assert result.noise_sentences[0].endswith("within the noise floor: the same method with nothing that matters "
                                              "changed moves as far.")
    assert "Against the noise floor (n1, n2" in result.path.read_text()
    assert not any(line.startswith("| n1 ") for line in result.noise_table.splitlines())  # no row for the floor
    assert main(["compare", *map(str, runs), "--baseline", "base", "--noise-floor", "n1", "n2", "--out",
                 str(tmp_path / "o2")]) == 0
    assert "against the noise floor (n1, n2):" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"--noise-floor 'n3' is not one of the arms"):
        compare(runs, "test", tmp_path / "o3", baseline="base", noise_floor=["n3"])
    with pytest.raises(ConfigError, match=r"--noise-floor reads differences from another arm"):
        compare(runs, "test", tmp_path / "o4", baseline_point="r1", noise_floor=["n1"])
