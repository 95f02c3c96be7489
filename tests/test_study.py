"""agentevo study: the plan of a study file, its checks, and a run through a stand-in for `agentevo train`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentevo.cli import main
from agentevo.config import RunConfig, dump_config, load_config
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.eval.metrics import eval_collection
from agentevo.study import PlannedRun, load_study, plan, run_status, run_study, with_needs

STUDY = """
name: st
output_dir: {out}
seeds: [0, 1]
method: bc
set: {{env.name: probe-copy, env.n_test: 4, "eval.splits": [test]}}
arms:
  base: {{}}
  lr: {{set: {{optim.lr: 0.001}}, warm_start_from: base}}
archive: {archive}
compare:
  - {{baseline: base, out: {cmp}}}
"""


def _study(tmp_path: Path, text: str = STUDY, **fmt: str) -> Path:
    path = tmp_path / "s.study.yaml"
    path.write_text(text.format(out=tmp_path / "runs", archive=tmp_path / "arch", cmp=tmp_path / "cmp", **fmt))
    return path


def _sets(argv: list[str]) -> list[str]:
    """The --set overrides of a planned command line, in order."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def _planned_config(r: PlannedRun) -> RunConfig:
    """The config a planned run's `agentevo train` command line builds."""
    return load_config(r.arm.config, _sets(r.argv), method=r.arm.method)


def _fake_train(out: Path, wins: dict[str, list[int]]) -> tuple[list[list[str]], object]:
    """A stand-in for `agentevo train/resume`: writes a finished run whose bc evaluation wins the given tasks."""
    calls: list[list[str]] = []

    def runner(argv: list[str]) -> int:
        calls.append(argv)
        name = argv[argv.index("--name") + 1] if "--name" in argv else Path(argv[1]).name
        run = out / name
        run.mkdir(parents=True, exist_ok=True)
        if argv[0] == "train":  # the config `agentevo train` would write
            sets = _sets(argv)
            base = argv[argv.index("--config") + 1] if "--config" in argv else None
            (run / "config.yaml").write_text(dump_config(load_config(base, sets, method=argv[1], name=name,
                                                                     output_dir=str(out))))
        won = wins[name.rsplit("-s", 1)[0].split("-", 1)[1]]
        state = {"eval/bc": {"test": {"success_rate": sum(won) / len(won), "avg_reward": 0.0}}, "finished": {}}
        (run / "state.json").write_text(json.dumps(state))
        store = ExperienceStore(run / "experience.db")
        for k, w in enumerate(won):
            store.add(Trajectory(Task("probe-copy", f"t{k}", "test", "copy"), "self", "bc", "", [], float(w), bool(w)),
                      eval_collection("bc", "test"), k)
        store.close()
        return 0

    return calls, runner


def test_plan_orders_runs_and_names_their_commands(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path))
    runs = plan(study)
    assert [r.name for r in runs] == ["st-base-s0", "st-lr-s0", "st-base-s1", "st-lr-s1"]  # every arm of a seed
    assert [r.status for r in runs] == ["new"] * 4
    lr1 = runs[3].argv
    assert lr1[:2] == ["train", "bc"] and lr1[-5:] == ["--name", "st-lr-s1", "--output-dir", str(tmp_path / "runs"),
                                                       "--quiet"]
    assert _sets(lr1) == ["env.name=probe-copy", "env.n_test=4", "eval.splits=[test]", "optim.lr=0.001", "seed=1",
                    f"bc.warm_start_from={tmp_path / 'runs' / 'st-base-s1'}"]
    assert [r.name for r in plan(study, seeds=[1])] == ["st-base-s1", "st-lr-s1"]
    with pytest.raises(ConfigError, match="--seed 5 is not a seed of study st"):
        plan(study, seeds=[5])
    arm_major = load_study(_study(tmp_path, STUDY.replace("seeds: [0, 1]", "seeds: [0, 1]\norder: arm")))
    assert [r.name for r in plan(arm_major)] == ["st-base-s0", "st-base-s1", "st-lr-s0", "st-lr-s1"]
    # a folder with a config is resumed; one whose state says finished is skipped
    (tmp_path / "runs" / "st-base-s0").mkdir(parents=True)
    (tmp_path / "runs" / "st-base-s0" / "config.yaml").write_text("method: bc\n")
    assert run_status(tmp_path / "runs" / "st-base-s0") == "partial"
    assert plan(study)[0].argv == ["resume", str(tmp_path / "runs" / "st-base-s0"), "--quiet"]
    (tmp_path / "runs" / "st-base-s0" / "state.json").write_text('{"eval/bc": {}, "finished": {}}')
    assert plan(study)[0].status == "finished"


def test_a_study_runs_what_is_left_archives_and_compares(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path))
    calls, runner = _fake_train(tmp_path / "runs", {"base": [0, 1, 0, 0], "lr": [1, 1, 1, 0]})
    lines: list[str] = []
    runner(plan(study)[0].argv)  # st-base-s0 already finished before the study command
    calls.clear()
    run_study(study, echo=lines.append, runner=runner)
    assert [c[c.index("--name") + 1] for c in calls] == ["st-lr-s0", "st-base-s1", "st-lr-s1"]
    assert lines[0] == "study st: 4 runs (2 arms x 2 seeds), 1 finished"
    assert sorted(p.name for p in (tmp_path / "arch").iterdir()) == ["st-base-s0", "st-base-s1", "st-lr-s0",
                                                                     "st-lr-s1"]
    # lr wins t0 and t2 where base does not, at both seeds: +50 points
    compare_md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| st-lr | bc | 2 | 4 | +50.0 | +50.0 / +50.0 |" in compare_md
    assert any(line.startswith("- **st-lr** (bc; st-base at bc): difference vs st-base: +50.0") for line in lines)
    # nothing left: a second call starts nothing
    calls.clear()
    run_study(study, echo=lines.append, runner=runner)
    assert calls == []
    # an edited study file does not resume (or skip) runs made with the old settings
    edited = load_study(_study(tmp_path, STUDY.replace("optim.lr: 0.001", "optim.lr: 0.002")))
    with pytest.raises(ConfigError, match=r"run st-lr-s0 was made with other settings than .* \(optim.lr: 0.001 in "
                                          r"the run, 0.002 in the study\); restore the study file, or move .*st-lr-s0 "
                                          r"aside"):
        run_study(edited, dry_run=True, echo=lambda _: None, runner=runner)


def test_a_study_says_how_far_it_is_and_how_long_is_left(tmp_path: Path) -> None:
    """Each run left is estimated at its arm's mean time so far (arms differ: a reused critic saves 10 minutes)."""
    study = load_study(_study(tmp_path))
    _, runner = _fake_train(tmp_path / "runs", {"base": [0, 1, 0, 0], "lr": [1, 1, 1, 0]})
    ticks = iter([0.0, 100.0, 100.0, 400.0, 400.0, 500.0, 500.0, 4100.0])  # runs of 100, 300, 100, 3600 s
    lines: list[str] = []
    run_study(study, echo=lines.append, runner=runner, clock=lambda: next(ticks))
    said = [x for x in lines if ": starting" in x or ": finished in" in x]
    assert said == [
        "st-base-s0: starting (run 1 of 4)",
        "st-base-s0: finished in 1 min 40 s",
        "st-lr-s0: starting (run 2 of 4; 1 done in 1 min 40 s, about 5 min 00 s left)",  # 3 x the one mean
        "st-lr-s0: finished in 5 min 00 s",
        "st-base-s1: starting (run 3 of 4; 2 done in 6 min 40 s, about 6 min 40 s left)",  # base 100 + lr 300
        "st-base-s1: finished in 1 min 40 s",
        "st-lr-s1: starting (run 4 of 4; 3 done in 8 min 20 s, about 5 min 00 s left)",  # lr's own mean
        "st-lr-s1: finished in 1 h 00 min",
    ]


def test_the_first_estimate_comes_from_the_same_arms_earlier_runs_on_this_cpu(tmp_path: Path) -> None:
    from agentevo.machine import cpu_description

    study = load_study(_study(tmp_path))
    _, runner = _fake_train(tmp_path / "runs", {"base": [0, 1, 0, 0], "lr": [1, 1, 1, 0]})
    run_study(study, echo=lambda line: None, runner=runner, seeds=[0], clock=lambda: 0.0)
    for arm, seconds, cpu in (("base", 100.0, cpu_description()[0]), ("lr", 300.0, cpu_description()[0])):
        run = tmp_path / "runs" / f"st-{arm}-s0"
        state = json.loads((run / "state.json").read_text())
        state["machine"] = [{"started": 1000.0, "cpu": cpu, "threads": 2}]
        (run / "state.json").write_text(json.dumps(state))
        times = [1000.0 + seconds / 2, 1000.0 + seconds, 5.0]  # the last one before the start: not counted
        (run / "metrics.jsonl").write_text("".join(json.dumps({"time": t, "phase": "x", "step": 0}) + "\n"
                                                   for t in times))
    lines: list[str] = []
    run_study(study, echo=lines.append, runner=runner, seeds=[1], clock=lambda: 0.0)
    assert "st-base-s1: starting (run 1 of 2; about 6 min 40 s left (from 2 earlier runs on this CPU))" in lines

    state = json.loads((tmp_path / "runs" / "st-lr-s0" / "state.json").read_text())
    state["machine"][0]["cpu"] = "Another CPU"  # timed elsewhere: not an estimate here
    (tmp_path / "runs" / "st-lr-s0" / "state.json").write_text(json.dumps(state))
    for name in ("st-base-s1", "st-lr-s1"):  # seed 1 to be made again
        shutil.rmtree(tmp_path / "runs" / name)
        shutil.rmtree(tmp_path / "arch" / name)
    lines.clear()
    run_study(study, echo=lines.append, runner=runner, seeds=[1], clock=lambda: 0.0)
    assert "st-base-s1: starting (run 1 of 2; about 3 min 20 s left (from 1 earlier run on this CPU))" in lines
    # lr has no time of its own: it is priced at the mean of every run timed, base-s1 here (0 s) and base-s0 (100 s)
    assert "st-lr-s1: starting (run 2 of 2; 1 done in 0 s, about 50 s left)" in lines


def test_archives_stand_in_for_lost_run_folders(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path))
    calls, runner = _fake_train(tmp_path / "runs", {"base": [0, 1, 0, 0], "lr": [1, 1, 1, 0]})
    run_study(study, echo=lambda _: None, runner=runner)
    before = (tmp_path / "cmp" / "compare.md").read_text()
    shutil.rmtree(tmp_path / "runs")  # a new machine: every run folder gone, the committed archives left
    shutil.rmtree(tmp_path / "cmp")
    calls.clear()
    lines: list[str] = []
    runs = run_study(study, echo=lines.append, runner=runner)
    assert calls == [] and [r.status for r in runs] == ["archived"] * 4
    assert lines[0] == "study st: 4 runs (2 arms x 2 seeds), 0 finished, 4 left as archives only"
    assert runs[0].results == tmp_path / "arch" / "st-base-s0"
    assert lines[1].startswith("  st-base-s0                       archived")
    after = (tmp_path / "cmp" / "compare.md").read_text()
    assert "arch/st-base-s0" in after.splitlines()[2]  # read from the archives ...
    assert after.splitlines()[3:] == before.splitlines()[3:]  # ... and compared as the runs were
    # an archive without the finished marker (or without its store) is not a finished run
    state = json.loads((tmp_path / "arch" / "st-lr-s1" / "state.json").read_text())
    del state["finished"]
    (tmp_path / "arch" / "st-lr-s1" / "state.json").write_text(json.dumps(state))
    assert run_status(tmp_path / "runs" / "st-lr-s1", tmp_path / "arch" / "st-lr-s1") == "new"
    # that run warm-starts from st-base-s1, of which only the archive (no checkpoint) is left: refused before any work
    with pytest.raises(ConfigError, match=r"run st-lr-s1 starts from st-base-s1, which is left only as an archive "
                                          r"\(.*st-base-s1, no checkpoints\); pass --rerun-sources to run st-base-s1 "
                                          r"again first \(it must reproduce its archive\), or move that archive aside"):
        run_study(study, echo=lambda _: None, runner=runner)
    assert calls == []
    # --rerun-sources runs the source again; a rerun that trains another model stops before anything reads it
    other_calls, other = _fake_train(tmp_path / "runs", {"base": [1, 1, 0, 0], "lr": [1, 1, 1, 0]})
    archived = (tmp_path / "arch" / "st-base-s1" / "state.json").read_text()
    with pytest.raises(ConfigError, match=r"run st-base-s1 differs from its archive \(eval/bc/test: success 0.25 on "
                                          r"None \(tasks None\) archived, success 0.5 on None \(tasks None\) now\).* "
                                          r"move .*st-base-s1 aside to keep the new run"):
        run_study(study, echo=lambda _: None, runner=other, rerun_sources=True)
    assert [c[c.index("--name") + 1] for c in other_calls] == ["st-base-s1"]
    assert (tmp_path / "arch" / "st-base-s1" / "state.json").read_text() == archived  # the record is kept
    shutil.rmtree(tmp_path / "runs" / "st-base-s1")
    lines.clear()
    run_study(study, echo=lines.append, runner=runner, rerun_sources=True)  # the same training reproduces it
    assert [c[c.index("--name") + 1] for c in calls] == ["st-base-s1", "st-lr-s1"]
    assert "  st-base-s1: run again (read by a later run; its archive has no checkpoints)" in lines
    assert "st-base-s1: the rerun reproduces its archive (1 evaluation equal)" in lines


def test_an_arm_takes_its_own_config_and_names_other_arms_runs(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("method: bc\noptim:\n  lr: 0.003\n")
    text = STUDY.replace("method: bc\n", "").replace("  base: {{}}", "  base: {{method: bc}}").replace(
        "  lr: {{set: {{optim.lr: 0.001}}, warm_start_from: base}}",
        "  lr: {{method: bc, set: {{optim.lr: 0.001}}, warm_start_from: base}}\n"
        "  own: {{config: {cfg}, set: {{bc.warm_start_from: '{{run:lr}}'}}}}")
    study = load_study(_study(tmp_path, text, cfg=str(base)))
    own = study.arms[2]
    assert (own.method, own.config, own.needs) == ("bc", str(base), ["lr"])  # the recipe read from its config
    argv = plan(study, seeds=[1])[2].argv
    assert [r.name for r in plan(study, arms=["own"])] == ["st-base-s0", "st-lr-s0", "st-own-s0", "st-base-s1",
                                                            "st-lr-s1", "st-own-s1"]  # with the arms it reads
    assert [r.name for r in plan(study, seeds=[1], arms=["base"])] == ["st-base-s1"]
    with pytest.raises(ConfigError, match=r"--arm nope is not an arm of study st \(base, lr, own\)"):
        plan(study, arms=["nope"])
    assert argv[:4] == ["train", "bc", "--config", str(base)]
    assert f"bc.warm_start_from={tmp_path / 'runs' / 'st-lr-s1'}" in argv  # unquoted, this seed's run
    calls, runner = _fake_train(tmp_path / "runs", {"base": [0, 1], "lr": [1, 1], "own": [1, 0]})
    run_study(study, echo=lambda _: None, runner=runner, seeds=[0])
    cfg = load_config(tmp_path / "runs" / "st-own-s0" / "config.yaml")
    assert (cfg.optim.lr, cfg.bc.warm_start_from) == (0.003, str(tmp_path / "runs" / "st-lr-s0"))
    # a run that reads an arm left only as an archive is refused, as a warm start is
    shutil.rmtree(tmp_path / "runs" / "st-lr-s0")
    shutil.rmtree(tmp_path / "runs" / "st-own-s0")
    shutil.rmtree(tmp_path / "arch" / "st-own-s0")  # (with its archive it would count as done)
    with pytest.raises(ConfigError, match="run st-own-s0 starts from st-lr-s0, which is left only as an archive"):
        run_study(study, echo=lambda _: None, runner=runner, seeds=[0])
    bad = text.replace("'{{run:lr}}'", "'{{run:later}}'")
    with pytest.raises(ConfigError, match=r"arm 'own': \{run:later\} must name an arm listed before it"):
        load_study(_study(tmp_path, bad, cfg=str(base)))
    with pytest.raises(ConfigError, match=r"arm 'base': no recipe; set 'method' for the study or the arm"):
        load_study(_study(tmp_path, text.replace("  base: {{method: bc}}", "  base: {{}}"), cfg=str(base)))
    with pytest.raises(ConfigError, match=r"arm 'own': config file '.*nowhere.yaml' does not exist"):
        load_study(_study(tmp_path, text, cfg=str(tmp_path / "nowhere.yaml")))
    # every seed's config is checked up front, not only the first seed's
    with pytest.raises(ConfigError, match=r"arm 'base', seed 4294967296: seed must be in \[0, 4294967295\]"):
        load_study(_study(tmp_path, text.replace("seeds: [0, 1]", "seeds: [0, 4294967296]"), cfg=str(base)))


def test_a_failed_run_stops_the_study_with_the_way_on(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path))
    with pytest.raises(ConfigError, match=r"run st-base-s0 stopped \(exit code 3\).*run `agentevo study .*s.study"
                                          r".yaml` again to continue from it"):
        run_study(study, echo=lambda _: None, runner=lambda argv: 3)


@pytest.mark.parametrize(("change", "message"), [
    (("name: st", "name: st\ncolour: red"), "unknown key 'colour'; allowed: name, output_dir"),
    (("warm_start_from: base", "warm_start_from: later"), "warm_start_from 'later' must name an arm listed before"),
    (("  lr:", "  lr-s1:"), "does not end in -sN"),
    (("baseline: base", "baseline: nobody"), r"'nobody' is not an arm of the study \(base, lr\)"),
    (("baseline: base", "baseline: base, noise_floor: [again]"), r"'again' is not an arm of the study \(base, lr\)"),
    (("baseline: base", "baseline_at: bc"), "compare #1: baseline_at names an evaluation of the baseline arm; give "
                                             "baseline: ARM too"),
    (("optim.lr: 0.001", "optim.bogus: 1"), "arm 'lr': .*bogus"),
    (("seeds: [0, 1]", "seeds: [0, 0]"), "'seeds' must be a list of distinct non-negative integers"),
])
def test_study_file_errors_name_the_problem(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_study(_study(tmp_path, STUDY.replace(*change)))


def test_dry_run_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _study(tmp_path)
    assert main(["study", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "study st: 4 runs (2 arms x 2 seeds), 0 finished" in out
    assert "st-lr-s1" in out and "agentevo train bc --set env.name=probe-copy" in out
    assert not (tmp_path / "runs").exists()
    assert main(["study", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_shipped_stall_probe_study_reads() -> None:
    study = load_study("configs/study/selfguide_stall_probe.study.yaml", check_configs=False)
    assert [(a.name, a.warm_start_from) for a in study.arms] == [("none", None), ("lam0", None), ("const", "lam0"),
                                                                 ("step", "lam0"), ("pen", "lam0")]
    assert study.seeds == [0, 1, 2] and len(plan(study)) == 15
    assert [r.name for r in plan(study, seeds=[2], arms=["const"])] == ["sg8s-lam0-s2", "sg8s-const-s2"]
    assert "selfguide.int_norm=step" in study.arms[3].overrides and "grpo.invalid_penalty=0.1" in study.arms[4].overrides
    assert "selfguide.schedule=constant" in study.arms[2].overrides and "eval.samples=4" in study.arms[2].overrides


def test_the_shipped_qevolve_study_reads() -> None:
    study = load_study("configs/study/qevolve_cookingworld.study.yaml")  # every arm's config built and validated
    assert len(study.arms) == 28 and len(plan(study)) == 84
    order = plan(study, seeds=[2], arms=["qe-order1"])[2]  # the noise-floor arm: the same data and critic as qe
    assert {"qevolve.policy_seed=1000", "qevolve.round1_critic_from=runs/qe200/qe200-qe-s2"} <= set(order.argv)
    assert study.compare[1].noise_floor == ["qe-order1", "qe-order2"] and "qe-order2" in study.compare[1].arms
    assert with_needs(study, ["qe-wo-gae"]) == ["bc", "qe", "qe-wo-gae"]
    wo_gae = plan(study, seeds=[1], arms=["qe-wo-gae"])[2]
    cfg = _planned_config(wo_gae)
    assert (cfg.seed, cfg.qevolve.pr, cfg.qevolve.n_iters) == (1, "q_minus_v", 1)
    assert (cfg.qevolve.round1_data_from, cfg.bc.warm_start_from) == ("runs/qe200/qe200-qe-s1", "runs/qe200/qe200-bc-s1")
    assert cfg.qevolve.round1_critic_from == "runs/qe200/qe200-qe-s1"  # an ablation after the critic reuses it
    control = plan(study, seeds=[0], arms=["bon-demos-long"])[1]  # BoN + SFT's continued-BC control
    cfg = _planned_config(control)
    assert (cfg.rsd.bon_with_wins, cfg.rsd.bon_with_expert, cfg.rsd.bon_rounds, cfg.optim.epochs) == (False, True, 1, 9)
    assert cfg.bc.warm_start_from == "runs/qe200/qe200-bc-s0" and study.compare[3].baseline == "bon-demos-long"
    assert (study.compare[4].baseline, study.compare[4].baseline_at) == ("bon2-demos-long", "bon-sft")  # vs round 2
    long_qe = plan(study, seeds=[2], arms=["long-qe"])  # Q-Evolve from the continued BC's checkpoint
    assert [r.name for r in long_qe] == ["qe200-bc-s2", "qe200-bon2-demos-long-s2", "qe200-long-qe-s2"]
    cfg = _planned_config(long_qe[2])
    assert (cfg.bc.warm_start_from, cfg.bc.warm_start_checkpoint) == ("runs/qe200/qe200-bon2-demos-long-s2", "bon-sft")
    again, e30 = (_planned_config(r) for r in plan(study, seeds=[0], arms=["bc200", "bc-e30"])[1:])
    assert (e30.optim.epochs, e30.env.n_test, e30.bc.warm_start_from) == (30, 200, None)  # BC from scratch
    assert (again.optim.epochs, again.env.n_test, again.bc.warm_start_from) == (12, 200, "runs/qe200/qe200-bc-s0")
    wo_rr = plan(study, seeds=[1], arms=["qe-wo-rr"])[2]
    assert not any("round1_critic_from" in a for a in wo_rr.argv)  # w/o RR changes the critic: it fits its own
