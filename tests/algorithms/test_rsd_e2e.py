"""RSD end to end on TextWorldExpress with a tiny model: every phase runs, files and metrics exist, resume is a no-op."""

from __future__ import annotations

import json

import pytest

from agentevo.config import load_config

TINY = [
    "env.n_train=3", "env.n_dev=2", "env.n_test=2", "env.params.max_steps=4", "rsd.tasks_per_round=3", "rsd.rounds=2",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.intermediate_size=64",
    "optim.epochs=1", "rsd.ctx_warm_epochs=1", "rollout.n_parallel=3", "agent.max_new_tokens=8", "model.torch_threads=1",
]


@pytest.mark.slow
def test_rsd_recipe_end_to_end_and_resume(tmp_path) -> None:  # noqa: ANN001
    from agentevo.algorithms.rsd import recipe as rsd
    from agentevo.run import Run

    cfg = load_config("configs/rsd_twx.yaml", [*TINY, "rsd.rule_search=random", "rsd.probe_tasks=2",
                                               "rsd.infer_ctx=true"], name="e2e", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        results = rsd.run(run)
    finally:
        run.close()
    d = tmp_path / "e2e"
    for name in ("init", "bc", "ctx-bc", "round-1", "round-2"):
        assert (d / "checkpoints" / name / "config.json").exists(), name
    for r in (1, 2):
        assert (d / "rsd" / f"round-{r}" / "teacher_topk.pt").exists()
        material = json.loads((d / "rsd" / f"round-{r}" / "material.json").read_text())
        assert set(material) == {"lessons", "reflections", "precedents", "bank_round"}
        assert len(material["reflections"]) == 3
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["phase"] == "rsd/round"]
    assert [r["step"] for r in rounds] == [1, 2]
    for key in ("success_test", "success_dev", "teacher_ckpt", "teacher_frozen", "kl_pre", "top1_mismatch",
                "dlogp_disfavoured", "ctx_tokens_total", "rule", "rule_decision"):
        assert key in rounds[0], key
    assert rounds[0]["teacher_ckpt"] == "ctx-bc"  # round 1 is taught by the base
    assert set(results["internalisation"]) == {"test", "dev"}
    assert "eval/base+ctx" in results and "eval/final+ctx" in results
    state = json.loads((d / "state.json").read_text())
    assert state["round-1/rule"]["proposal"] is not None and "current" in state["round-1/rule"]["probe"]
    # resume: every phase is recorded, nothing runs again and the results are the same
    n_lines = len(records)
    run = Run.open(d, quiet=True)
    try:
        again = rsd.run(run)
    finally:
        run.close()
    assert again["eval/round-2"] == results["eval/round-2"]
    assert len((d / "metrics.jsonl").read_text().splitlines()) == n_lines + 3  # only the re-logged round records


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gt_opsd", "gt_sft", "bon_sft", "harness", "reflexion"])
def test_rsd_baselines_end_to_end(tmp_path, method: str) -> None:  # noqa: ANN001
    from agentevo.recipes import get_recipe
    from agentevo.run import Run

    cfg = load_config("configs/rsd_twx.yaml", [*TINY, "rsd.rounds=1", "rsd.bon_n=2", "rsd.ctx_warm_start=false"],
                      method=method, name=method, output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        results = get_recipe(method)(run)
    finally:
        run.close()
    evals = {k: v for k, v in results.items() if k.startswith("eval/") and k not in ("eval/init", "eval/bc")}
    assert evals, results.keys()
    for per_split in evals.values():
        for m in per_split.values():
            assert m["n"] == 2 and 0.0 <= m["success_rate"] <= 1.0
    if method == "reflexion":
        m = results["eval/reflexion"]["test"]
        assert m["success_at_1"] <= m["success_at_2"] <= m["success_at_3"] == m["success_rate"]


def test_rsd_base_shared_through_warm_start_from(tmp_path) -> None:  # noqa: ANN001
    """A second seed or arm imports a finished run's demos, BC and context-aware base (ctx-bc) instead of training its
    own; the rule's whitelisted knobs may differ (ablations keep the base), the ctx warm-start settings may not."""
    from agentevo.algorithms.rsd import recipe as rsd
    from agentevo.config import ConfigError
    from agentevo.run import Run

    base = ["rsd.internalisation=false"]

    def prepare(name: str, extra: list[str]) -> dict:
        cfg = load_config("configs/rsd_twx.yaml", [*TINY, *base, *extra], name=name, output_dir=str(tmp_path))
        run = Run.create(cfg, quiet=True)
        try:
            return rsd.prepare_base(run)[1]
        finally:
            run.close()

    first = prepare("a", [])
    ablation = prepare("b", ["seed=1", "rsd.components=[prec,lessons,reflect]", f"bc.warm_start_from={tmp_path / 'a'}"])
    assert ablation["eval/ctx-bc"] == first["eval/ctx-bc"]
    for name in ("bc", "ctx-bc"):
        assert (tmp_path / "b/checkpoints" / name / "model.safetensors").read_bytes() == \
            (tmp_path / "a/checkpoints" / name / "model.safetensors").read_bytes()
    state = json.loads((tmp_path / "b/state.json").read_text())
    assert state["warm_start_from"]["expert"] == 3 and state["ctx-bc"] == first["ctx-bc"]
    with pytest.raises(ConfigError, match="rsd.ctx_warm_fraction is 0.9 here but 0.5"):
        prepare("c", ["rsd.ctx_warm_fraction=0.9", f"bc.warm_start_from={tmp_path / 'a'}"])
    # a source written before a setting existed (no key in its config.yaml) counts as that setting's default
    import yaml
    source_cfg = yaml.safe_load((tmp_path / "a/config.yaml").read_text())
    del source_cfg["rsd"]["ctx_warm_detours"]
    (tmp_path / "a/config.yaml").write_text(yaml.safe_dump(source_cfg, sort_keys=False))
    assert prepare("e", [f"bc.warm_start_from={tmp_path / 'a'}"])["eval/ctx-bc"] == first["eval/ctx-bc"]
    with pytest.raises(ConfigError, match="rsd.ctx_warm_detours is 0.5 here but 0.0"):
        prepare("f", ["rsd.ctx_warm_detours=0.5", f"bc.warm_start_from={tmp_path / 'a'}"])
    # the detour variant replays the gold plans with wasted steps and cuts rows at them
    detoured = prepare("d", ["rsd.ctx_warm_detours=1.0", "rsd.ctx_warm_fraction=1.0", "env.params.max_steps=8"])
    # the wasted steps never cost the plan its step budget: the replays succeed where the clean demos do
    assert detoured["expert-detour"]["n"] == 3
    assert detoured["expert-detour"]["success_rate"] == detoured["expert"]["success_rate"]
    assert detoured["expert-detour"]["detours"] > 0 and detoured["ctx-bc"]["detour_rows"] > 0


def test_bon_sft_practises_on_new_tasks_and_keeps_the_demos(tmp_path) -> None:  # noqa: ANN001
    """BoN + SFT from a finished BC run on more training tasks than it had (its demos pinned by bc.n_expert), and the
    expert-iteration form (rsd.bon_with_expert) adds exactly the demos' rows to the kept samples' rows."""
    from agentevo.algorithms.bc import expert_samples, warm_start
    from agentevo.algorithms.rsd import bon_sft
    from agentevo.config import ConfigError
    from agentevo.recipes import get_recipe
    from agentevo.run import Run

    def make(name: str, extra: list[str], method: str = "bon_sft") -> Run:
        overrides = [*TINY, "env.params.max_steps=8", "rsd.ctx_warm_start=false", "rsd.bon_n=1", *extra]
        cfg = load_config("configs/rsd_twx.yaml", overrides,
                          method=method, name=name, output_dir=str(tmp_path))
        return Run.create(cfg, quiet=True)

    source = make("bc", [], method="bc")
    try:
        get_recipe("bc")(source)
    finally:
        source.close()
    practise = ["env.n_train=5", "rsd.tasks_per_round=5", f"bc.warm_start_from={tmp_path / 'bc'}"]
    with pytest.raises(ConfigError, match=r"larger than the BC run's 3; .*set bc.n_expert=3 \(got None\)"):
        run = make("x", practise)
        try:
            warm_start(run)
        finally:
            run.close()

    def sft_with_demos_as_kept(name: str, with_expert: bool) -> dict:
        run = make(name, [*practise, "bc.n_expert=3", f"rsd.bon_with_expert={str(with_expert).lower()}"])
        try:
            first = bon_sft.run(run)
            assert run.state["expert"]["n"] == 3 and first["bon/collect"]["tasks"] == 5
            diag = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()
                    if '"diag/bon_sft"' in line]  # the report's BoN diagnostics read this record
            assert len(diag) == 1 and diag[0]["pass_at_n"] == first["bon/collect"]["pass@1"]
            assert {t.task.task_id for t in run.store.load(collection="bon/samples")} == \
                {t.task_id for t in run.tasks("train")}  # the two tasks without a demo are played too
            # make sure SFT has kept samples to train on: the demos, stored as successful samples
            demos = run.store.load(collection="expert")
            run.store.add_missing("bon/samples", ((100 + k, t) for k, t in enumerate(demos)))
            for phase in ("bon-sft", "eval/bon-sft"):
                run.state.pop(phase)
            out = bon_sft.run(run)["bon-sft"]
            policy = run.load_policy("bc")
            out["demo_rows"] = len(expert_samples(policy, demos, run.cfg.agent.history_window,
                                                  run.cfg.optim.max_length))
            out["kept"] = len(run.store.load(collection="bon/samples", success=True))
            return out
        finally:
            run.close()

    def demos_alone() -> dict:
        """The continued-BC control (rsd.bon_with_wins=false): no practice, the demos' rows alone."""
        run = make("c", [*practise, "bc.n_expert=3", "rsd.bon_with_expert=true", "rsd.bon_with_wins=false"])
        try:
            out = bon_sft.run(run)
            assert "bon/collect" not in out and not run.store.load(collection="bon/samples")
            assert (run.dir / "checkpoints/bon-sft/model.safetensors").exists() and "eval/bon-sft" in out
            return out["bon-sft"]
        finally:
            run.close()

    plain, iterated, control = (sft_with_demos_as_kept("p", False), sft_with_demos_as_kept("e", True),
                                demos_alone())
    assert control["trajectories"] == 0 and control["expert_trajectories"] == 3
    assert control["samples"] == iterated["demo_rows"] > 0
    assert plain["expert_trajectories"] == 0 and iterated["expert_trajectories"] == 3
    assert plain["trajectories"] == plain["kept"] and iterated["trajectories"] == iterated["kept"]
    # same seed, same BC: the same samples are kept, and the demos add exactly their own rows
    assert iterated["kept"] == plain["kept"] >= 3
    assert iterated["samples"] == plain["samples"] + iterated["demo_rows"] > plain["samples"]


def test_bon_sft_rounds_act_with_the_latest_policy_and_accumulate_kept_samples(tmp_path) -> None:  # noqa: ANN001
    from agentevo.algorithms.rsd import bon_sft
    from agentevo.run import Run

    cfg = load_config("configs/rsd_twx.yaml", [*TINY, "env.params.max_steps=8", "rsd.ctx_warm_start=false",
                                               "rsd.bon_n=1", "rsd.bon_rounds=2", "rsd.bon_with_expert=true"],
                      method="bon_sft", name="r", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        first = bon_sft.run(run)
        assert first["bon/collect"]["actor"] == "bc" and "eval/bon-sft-2" in first
        # give round 1 successes to keep (the demos), then redo what depends on them
        run.store.add_missing("bon/samples", ((100 + k, t) for k, t in enumerate(run.store.load(collection="expert"))))
        for phase in ("bon-sft", "eval/bon-sft", "bon/collect-2", "bon-sft-2", "eval/bon-sft-2"):
            run.state.pop(phase)
        again = bon_sft.run(run)
        kept = [len(run.store.load(collection=c, success=True)) for c in ("bon/samples", "bon/samples-2")]
    finally:
        run.close()
    assert again["bon-sft"]["trajectories"] == kept[0] >= 3
    assert again["bon/collect-2"]["actor"] == "bon-sft"  # round 2 samples with round 1's policy
    assert again["bon-sft-2"]["trajectories"] == kept[0] + kept[1]  # and trains on both rounds' kept samples
    assert (tmp_path / "r/checkpoints/bon-sft-2/model.safetensors").exists()
    diag_steps = [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()
                  if '"diag/bon_sft"' in line]
    assert sorted(set(diag_steps)) == [1, 2]
