"""The RL debugging ladder: every method must learn what it claims on a probe it can solve in seconds.

Each test runs a recipe through the same config/Run path as `agentevo train`, on a probe of agentevo/envs/probes.py,
with a very small tiny model, and states its budget and the score it must reach. RL methods start from a BC policy
trained on noisy demos (env.params.expert_noise), so the BC start is measurably wrong and the RL step must improve
on it. Ablation flags must change what they claim to change (compared with the full method on the same data).
See docs/probes.md for the probes, budgets and measured results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# A very small tiny model: 1 layer, width 32, a byte-level BPE trained on the probe's text. BC at lr 1e-2 for 60
# epochs of 8 demos (120 steps) fits the demos' action distribution.
TINY = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64", "model.tiny.vocab_size=400", "model.torch_threads=1",
    "agent.thoughts=none", "agent.history_window=2", "agent.max_new_tokens=10",
    "rollout.n_parallel=16", "rollout.batch_size=16", "rollout.prefix_cache=0",
    "env.n_train=8", "env.n_dev=4", "env.n_test=8", "eval.splits=[test]",
    "optim.lr=1e-2", "optim.epochs=60", "optim.batch_size=4", "optim.micro_batch_size=4", "optim.max_length=256",
    "optim.warmup_ratio=0.0",
]
# 3/4 of the demos wrong: BC then acts wrongly on (nearly) every greedy test episode but still samples the right
# action now and then, which is what an RL step needs to find it.
NOISY = ["env.params.expert_noise=0.75"]


def run_probe(method: str, env: str, overrides: list[str], out: str | Path, name: str = "r") -> dict[str, Any]:
    """Build the config as a user would (method, env, dotted overrides), run the recipe, return its results."""
    from agentevo.config import load_config
    from agentevo.recipes import get_recipe
    from agentevo.run import Run

    cfg = load_config(None, [f"env.name={env}", *TINY, *overrides], method=method, name=name, output_dir=str(out))
    run = Run.create(cfg, quiet=True)
    try:
        return get_recipe(method)(run)
    finally:
        run.close()


def success(results: dict[str, Any], phase: str) -> float:
    """Greedy test success rate of an evaluation phase."""
    return float(results[phase]["test"]["success_rate"])


def reward(results: dict[str, Any], phase: str) -> float:
    """Greedy test mean final reward of an evaluation phase."""
    return float(results[phase]["test"]["avg_reward"])


# -- the probes themselves -----------------------------------------------------------------------------------------


def test_probe_envs_keep_the_contract() -> None:
    from agentevo.envs import make_env
    from agentevo.envs.base import SIGNAL_INVALID, TextEnv
    from agentevo.envs.probes import TRAP_COIN_SCORE, vault_password
    from agentevo.errors import ConfigError

    for name in ("probe-constant", "probe-copy", "probe-trap", "probe-hindsight", "probe-guide"):
        env = make_env(name, n_train=6, n_test=4)
        assert isinstance(env, TextEnv)
        assert len(env.tasks("train")) == 6 and len(env.tasks("dev")) == 16
        assert env.tasks("test").hash == make_env(name, n_test=4).tasks("test").hash  # fixed lists
        assert env.tasks("test").hash != env.tasks("train").head(4).hash
        for task in env.tasks("train"):  # noise 0: every expert demo wins
            obs, info = env.reset(task)
            assert info["goal"] and info["task_type"] == task.task_type
            for action in env.expert(task):
                obs, _, done, info = env.step(action)
            assert done and info["success"] and info["won"] and info["score"] == 1.0
        # an unknown command is flagged invalid; a normal step is not
        obs, _ = env.reset(env.tasks("train")[0])
        bad, _, _, info = env.step("dance")
        assert bad.startswith("Invalid action") and info["score"] == 0.0 and not info["success"]
        assert env.signals(obs, "dance", bad, True) == SIGNAL_INVALID
        assert env.signals(obs, "x", "something new", False) == "format"
    trap = make_env("probe-trap")
    task = trap.tasks("test")[0]
    trap.reset(task)
    assert trap.step("take coin")[1] == TRAP_COIN_SCORE  # the trap pays at once ...
    obs, r, done, info = trap.step("walk through")  # ... and dead-ends: final score 0.3, no win
    assert done and info["score"] == TRAP_COIN_SCORE and not info["success"] and "locked" in obs
    trap.reset(task)
    assert trap.step("open door")[1] == 0.0 and trap.step("walk through")[3]["success"]
    # probe-hindsight: the password is never in the observation, only in the feedback to a wrong answer
    hs = make_env("probe-hindsight")
    task = hs.tasks("test")[0]
    obs, _ = hs.reset(task)
    password = vault_password(task.params["vault"])
    assert password not in obs and obs == "Open the north vault by saying its password."
    wrong = next(c for c in ("red", "green") if c != password)
    assert hs.step(f"say {wrong}")[0] == f"Wrong password. The password was {password}."
    hs.reset(task)  # a win names it too, so every episode's hindsight carries it verbatim
    assert hs.step(f"say {password}")[0] == f"The vault opens. The password was {password}. You win."
    # 16 vaults, each colour the password of four: a vault with only wrong demos shares its answer with solved ones
    assert len(hs.tasks("test")) == 16 and len({t.params["vault"] for t in hs.tasks("test")}) == 16
    assert sorted(vault_password(t.params["vault"]) for t in hs.tasks("test")) == sorted(4 * ["red", "green", "blue",
                                                                                               "yellow"])
    # n_vaults: more vaults, still balanced, one content word each, the first 16 as before; bad counts rejected
    many = make_env("probe-hindsight", n_vaults=32, n_train=64)
    vaults = [t.params["vault"] for t in many.tasks("train")]
    assert vaults[:16] == [t.params["vault"] for t in hs.tasks("train")][:16] and len(set(vaults)) == 32
    assert all(len(v.split()) == 1 for v in vaults) and vaults[32:] == vaults[:32]
    assert sorted(vault_password(v) for v in set(vaults)) == sorted(8 * ["red", "green", "blue", "yellow"])
    with pytest.raises(ConfigError, match="n_vaults must be a multiple of 4"):
        make_env("probe-hindsight", n_vaults=30)
    # expert noise: the stated fraction of demos act wrongly (here 6 of 8) and lose
    noisy = make_env("probe-constant", expert_noise=0.75, n_train=8)
    assert [noisy.expert(t) for t in noisy.tasks("train")].count(["wait"]) == 6
    with pytest.raises(ConfigError, match="expert_noise must be in"):
        make_env("probe-copy", expert_noise=2.0)
    with pytest.raises(ConfigError, match="max_steps must be >= 2"):
        make_env("probe-trap", max_steps=1)


def test_guide_probe_lights_and_success_reward() -> None:
    """n_lights sets the row and the episode length; reward=success pays 1 at the end of an all-right episode and
    nothing else, so the outcome cannot tell a wrong second press from a wrong fifth; score pays 1/n per right press."""
    from agentevo.envs import make_env
    from agentevo.errors import ConfigError

    env = make_env("probe-guide", n_lights=5, reward="success", n_test=2)
    task = env.tasks("test")[0]
    lights = task.params["lights"]
    assert len(lights) == 5 and task.max_steps == 5
    obs, _ = env.reset(task)
    assert obs.endswith(f"Light 1 of 5 is {lights[0]}.")
    rewards = [env.step(f"press {c}")[1] for c in lights]
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
    wrong = {c: next(o for o in ("red", "green") if o != c) for c in lights}
    for bad in (1, 4):  # one wrong press anywhere: every reward 0, the same observations' verdict names it
        env.reset(task)
        out = [env.step(f"press {wrong[c] if i == bad else c}") for i, c in enumerate(lights)]
        assert [r for _, r, _, _ in out] == [0.0] * 5 and not out[-1][3]["success"] and out[-1][3]["score"] == 0.0
        assert out[bad][0].startswith("Wrong button.") and all(o.startswith("Correct.") for o, *_ in out[:bad])
    scored = make_env("probe-guide", n_lights=4, n_test=1)
    task = scored.tasks("test")[0]
    scored.reset(task)
    assert [scored.step(f"press {c}")[1] for c in task.params["lights"]] == [0.25] * 4
    assert make_env("probe-guide").tasks("test")[0].max_steps == 3  # the default row is unchanged
    with pytest.raises(ConfigError, match="reward must be one of score, success"):
        make_env("probe-guide", reward="dense")
    with pytest.raises(ConfigError, match="max_steps must be >= 4"):
        make_env("probe-guide", n_lights=4, max_steps=3)


def test_guide_probe_noise_at_random_spreads_the_demo_errors() -> None:
    """noise_at=second errs at light 2 in every noisy demo; noise_at=random errs at one hashed light per task, over
    the whole row, and the same light every time the demo is built. Clean demos are unchanged by either."""
    from agentevo.envs import make_env
    from agentevo.errors import ConfigError

    def wrong_lights(env) -> list[int]:  # noqa: ANN001
        out = []
        for task in env.tasks("train"):
            demo = [a.removeprefix("press ") for a in env.expert(task)]
            bad = [i for i, (c, want) in enumerate(zip(demo, task.params["lights"], strict=True)) if c != want]
            assert len(bad) == env.noisy(task)  # one wrong press in a noisy demo, none in a clean one
            out += bad
        return out

    kw = {"n_lights": 6, "reward": "success", "expert_noise": 0.75, "n_train": 64}
    second = make_env("probe-guide", **kw)
    assert set(wrong_lights(second)) == {1} and len(wrong_lights(second)) == 49  # 64 x 0.75 = 48, golden-ratio rounding
    spread = make_env("probe-guide", noise_at="random", **kw)
    where = wrong_lights(spread)
    assert len(where) == 49 and set(where) == set(range(6))  # errors at every light
    assert max(where.count(i) for i in range(6)) == 11  # counts 9 8 7 6 11 8
    assert where == wrong_lights(make_env("probe-guide", noise_at="random", **kw))  # fixed across builds
    assert [spread.error_light(t) for t in spread.tasks("train")] != [1] * 64
    with pytest.raises(ConfigError, match="noise_at must be one of second, random"):
        make_env("probe-guide", noise_at="first")


def test_guide_probe_demo_errors_puts_k_wrong_presses_in_each_noisy_demo() -> None:
    """demo_errors=k errs at k distinct hashed lights per noisy demo, the first of them error_light(task); k=1 is the
    single-error demo. With 12 lights and 4 errors, a policy copying the demos errs at a third of the presses."""
    from agentevo.envs import make_env
    from agentevo.errors import ConfigError

    kw = {"n_lights": 12, "reward": "success", "expert_noise": 1.0, "n_train": 64, "noise_at": "random"}
    env = make_env("probe-guide", demo_errors=4, **kw)
    wrong = []
    for task in env.tasks("train"):
        demo = [a.removeprefix("press ") for a in env.expert(task)]
        bad = [i for i, (c, want) in enumerate(zip(demo, task.params["lights"], strict=True)) if c != want]
        assert bad == env.error_lights(task) and len(bad) == 4 and env.error_light(task) in bad
        wrong += bad
    assert len(wrong) / (64 * 12) == pytest.approx(1 / 3)
    assert set(wrong) == set(range(12))  # spread over the row
    assert [env.error_lights(t) for t in env.tasks("train")] == [
        make_env("probe-guide", demo_errors=4, **kw).error_lights(t) for t in env.tasks("train")]  # fixed
    one = make_env("probe-guide", **kw)  # demo_errors=1: the single hashed error light, as before
    assert all(one.error_lights(t) == [one.error_light(t)] for t in one.tasks("train"))
    with pytest.raises(ConfigError, match=r"demo_errors must be in \[1, n_lights = 6\], and above 1 only with "
                                          r"noise_at: random \(got 2 with noise_at: second\)"):
        make_env("probe-guide", n_lights=6, demo_errors=2)
    with pytest.raises(ConfigError, match="got 13 with noise_at: random"):
        make_env("probe-guide", demo_errors=13, **kw)


# -- BC: the copy probe (the policy must read its observation) ------------------------------------------------------


def test_bc_learns_to_copy_from_the_observation(tmp_path) -> None:  # noqa: ANN001
    """Budget: 32 clean demos x 30 epochs (240 steps) of a 2-layer width-64 model. A 1-layer width-32 model stays
    at the 25% of always saying one colour within 160 steps (measured): copying needs the second layer."""
    res = run_probe("bc", "probe-copy", ["env.n_train=32", "optim.epochs=30", "optim.lr=3e-3",
                                         "model.tiny.num_layers=2", "model.tiny.hidden_size=64",
                                         "model.tiny.intermediate_size=128", "env.n_dev=8", "bc.eval_epochs=[3,15]"],
                    tmp_path)
    assert success(res, "eval/init") == 0.0
    assert success(res, "eval/bc") >= 0.875  # measured 1.0: all four colours copied
    # BC's learning curve on the dev split (bc.eval_epochs): snapshots at epochs 3 and 15, the final BC at 30
    curve = {e: res[f"eval/bc-epoch-{e}"]["dev"]["success_rate"] for e in (3, 15, 30)}
    assert curve[3] <= 0.25 and curve[15] >= 0.75 and curve[30] >= 0.875  # measured 0 / 1 / 1
    assert (tmp_path / "r" / "checkpoints" / "bc-epoch-3" / "model.safetensors").exists()
    assert list(res["eval/bc-epoch-3"]) == ["dev"] and res["eval/bc-epoch-3"]["dev"]["n"] == 8
    from agentevo.eval.diagnostics import diagnostic_tables
    from agentevo.train.tracking import MetricsLogger

    (title, rows), = diagnostic_tables(MetricsLogger(tmp_path / "r", enabled=False).records())
    assert rows[-1].name == "dev success still rising at the end of BC (epoch 15 -> 30)"
    assert rows[-1].value.startswith(f"3: {100 * curve[3]:.1f}%, 15: ") and rows[-1].verdict == "pass"


# -- GRPO / DAPO: the constant probe ---------------------------------------------------------------------------------

GRPO = ["grpo.n_updates=6", "grpo.tasks_per_update=8", "grpo.group_size=4", "grpo.lr=1e-3", "grpo.batch_size=8",
        "grpo.micro_batch_size=8", "grpo.eval_every=3", "grpo.log_entropy=false"]


@pytest.fixture(scope="module")
def constant_bc(tmp_path_factory) -> Path:  # noqa: ANN001
    """pi_BC on probe-constant from 3/4 'wait' demos: greedy, it waits on every test task."""
    out = tmp_path_factory.mktemp("constant")
    res = run_probe("bc", "probe-constant", NOISY, out, "bc")
    assert success(res, "eval/bc") == 0.0
    return out / "bc"


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_grpo_and_dapo_learn_the_constant_action(tmp_path, constant_bc: Path, algo: str) -> None:  # noqa: ANN001
    """Budget: 6 updates x 8 tasks x G=4 one-step episodes (192 episodes). BC 0.0 -> >= 0.875 (measured 1.0)."""
    res = run_probe("grpo", "probe-constant", [*NOISY, *GRPO, f"grpo.algo={algo}",
                                               f"bc.warm_start_from={constant_bc}"], tmp_path)
    start, end = success(res, "eval/bc"), success(res, "eval/update-6")
    assert start == 0.0 and end >= 0.875, (start, end)
    updates = [res[f"update-{k}"] for k in range(1, 7)]
    kept = sum(u.get("groups_kept", 0) for u in updates)
    if algo == "dapo":  # dynamic sampling: the all-wait / all-press groups carry no signal and are dropped
        assert kept < sum(u["groups"] for u in updates)
    else:
        assert all(u.get("groups_kept", 0) <= u["groups"] for u in updates)


# -- Q-Evolve and its five ablations, ETO, QLASS: the trap probe -----------------------------------------------------

QEVOLVE = ["qevolve.n_self_per_task=4", "qevolve.critic_hidden=32", "qevolve.critic_lr=1e-3",
           "qevolve.critic_epochs=4", "qevolve.critic_batch_size=8", "qevolve.critic_micro_batch_size=8",
           "qevolve.policy_lr=1e-3", "qevolve.policy_epochs=2", "qevolve.policy_batch_size=8",
           "qevolve.policy_micro_batch_size=8"]


@pytest.fixture(scope="module")
def trap_runs(tmp_path_factory) -> Path:  # noqa: ANN001
    """pi_BC on probe-trap from 3/4 trap demos, then full Q-Evolve (2 rounds) from it."""
    out = tmp_path_factory.mktemp("trap")
    res = run_probe("bc", "probe-trap", NOISY, out, "bc")
    assert success(res, "eval/bc") <= 0.25  # BC takes the coin (measured 0.125 seed 0, 0.0 seed 1)
    run_probe("qevolve", "probe-trap", [*NOISY, *QEVOLVE, "qevolve.n_iters=2", f"bc.warm_start_from={out / 'bc'}"],
              out, "full")
    return out


def _labels(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "labels" / "round-1.json").read_text())


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def test_qevolve_escapes_the_trap(trap_runs: Path) -> None:
    """Budget: 2 rounds x 8 tasks x 4 trajectories. BC 0.0 -> >= 0.75 (measured 0.875); round 1 >= 0.5 (0.625)."""
    state = json.loads((trap_runs / "full" / "state.json").read_text())
    start, r1, r2 = (state[p]["test"]["success_rate"] for p in ("eval/bc", "eval/round-1", "eval/round-2"))
    assert start <= 0.25 and r1 >= 0.5 and r2 >= 0.75, (start, r1, r2)
    labels = _labels(trap_runs / "full")
    # the critic credits step 1: on the self data, 'open door' steps get a higher advantage than 'take coin' ones
    from agentevo.data.store import ExperienceStore

    store = ExperienceStore(trap_runs / "full" / "experience.db")
    try:
        by_id = {int(t.meta["store_id"]): t for t in store.load()}
    finally:
        store.close()
    door, coin = [], []
    for key, adv in zip(labels["keys"], labels["adv"], strict=True):
        first = by_id[key].steps[0].parsed_action
        (door if first == "open door" else coin if first == "take coin" else []).append(adv[0])
    assert door and coin and sum(door) / len(door) > sum(coin) / len(coin) + 0.5, (door, coin)


ABLATIONS = {
    # flag -> (what it must change against the full method on the same round-1 data, min round-1 success)
    "qevolve.rr=false": ("critic", 0.5),
    "qevolve.wiql=false": ("critic", 0.5),
    "qevolve.pr=q_minus_v": ("advantages", 0.0),
    "qevolve.pi=awr": ("weights", 0.0),  # measured 0.125 at this budget: see test_awr_escapes_the_trap
    "qevolve.pi=none": ("rerank", 0.0),
}


@pytest.mark.parametrize("flag", list(ABLATIONS))
def test_qevolve_ablation_changes_what_it_claims(trap_runs: Path, tmp_path, flag: str) -> None:  # noqa: ANN001
    """Budget: 1 round on the full run's round-1 data (qevolve.round1_data_from) from the same pi_BC."""
    claim, floor = ABLATIONS[flag]
    full = trap_runs / "full"
    res = run_probe("qevolve", "probe-trap", [*NOISY, *QEVOLVE, "qevolve.n_iters=1", flag,
                                              f"bc.warm_start_from={trap_runs / 'bc'}",
                                              f"qevolve.round1_data_from={full}"], tmp_path, "ablation")
    mine, theirs = _labels(tmp_path / "ablation"), _labels(full)
    assert mine["slots"] == theirs["slots"]  # the same D, trajectory by trajectory
    v_diff = max(abs(a - b) for a, b in zip(_flat(mine["v"]), _flat(theirs["v"]), strict=True))
    a_diff = max(abs(a - b) for a, b in zip(_flat(mine["raw"]), _flat(theirs["raw"]), strict=True))
    if claim == "critic":  # the critic's rewards / weights change, so its values and the advantages do
        assert v_diff > 1e-3 and a_diff > 1e-3, (v_diff, a_diff)
    elif claim == "advantages":  # the same critic, another process reward
        assert v_diff < 1e-5 < 1e-3 < a_diff, (v_diff, a_diff)
    elif claim == "weights":  # the same critic and advantages, another policy loss: other weights
        assert v_diff < 1e-5 and a_diff < 1e-5, (v_diff, a_diff)
        ours = (tmp_path / "ablation" / "checkpoints" / "round-1" / "model.safetensors").read_bytes()
        assert ours != (full / "checkpoints" / "round-1" / "model.safetensors").read_bytes()
        assert res["round-1/policy"]["awr_loss"] != 0.0
    else:  # w/o PI: the policy stays pi_BC and the critic reranks sampled candidates at test time
        assert "skipped" in res["round-1/policy"]
        assert not (tmp_path / "ablation" / "checkpoints" / "round-1").exists()
    assert success(res, "eval/bc") <= 0.25 and success(res, "eval/round-1") >= floor


def test_round1_critic_from_reuses_the_fitted_critic(trap_runs: Path, tmp_path) -> None:  # noqa: ANN001
    """An ablation after the critic (pr=q_minus_v) reading the full run's round-1 data and critic fits nothing and
    gets the advantages of the same ablation that fits its own critic; a critic setting that differs is refused."""
    common = [*NOISY, *QEVOLVE, "qevolve.n_iters=1", "qevolve.pr=q_minus_v", f"bc.warm_start_from={trap_runs / 'bc'}",
              f"qevolve.round1_data_from={trap_runs / 'full'}"]
    own = run_probe("qevolve", "probe-trap", common, tmp_path, "own")
    reused = run_probe("qevolve", "probe-trap", [*common, f"qevolve.round1_critic_from={trap_runs / 'full'}"],
                       tmp_path, "reused")
    metrics = (tmp_path / "reused" / "metrics.jsonl").read_text()
    assert '"round-1/critic/train"' not in metrics and '"round-1/critic/train"' in (tmp_path / "own" / "metrics.jsonl").read_text()
    assert reused["round-1/critic"]["imported_from"] == str(trap_runs / "full")
    assert (tmp_path / "reused" / "checkpoints" / "round-1-critic" / "heads.pt").exists()
    mine, theirs = _labels(tmp_path / "reused"), _labels(tmp_path / "own")
    assert mine["keys"] == theirs["keys"]
    assert max(abs(a - b) for a, b in zip(_flat(mine["raw"]), _flat(theirs["raw"]), strict=True)) < 1e-5
    for key in ("auc_v1_success", "n_fit", "n_holdout"):
        assert reused["round-1/critic"][key] == pytest.approx(own["round-1/critic"][key], abs=1e-6)
    # the drift rows come from the source's last critic pass
    assert reused["round-1/critic"]["diag"]["steps"] == own["round-1/critic"]["diag"]["steps"] > 0
    assert success(reused, "eval/round-1") == success(own, "eval/round-1")
    # a run reusing a reused critic still reports the fitted one's drift
    again = run_probe("qevolve", "probe-trap", [*common, "qevolve.pi=awr",
                                                f"qevolve.round1_critic_from={tmp_path / 'reused'}"], tmp_path, "again")
    assert again["round-1/critic"]["diag"]["steps"] == own["round-1/critic"]["diag"]["steps"]
    from agentevo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"round1_critic_from: qevolve.rr is False here but True in"):
        run_probe("qevolve", "probe-trap", [*common, "qevolve.rr=false",
                                            f"qevolve.round1_critic_from={trap_runs / 'full'}"], tmp_path, "wo-rr")


def test_policy_seed_changes_the_update_order_only(trap_runs: Path, tmp_path) -> None:  # noqa: ANN001
    """On the full run's round-1 data and critic, qevolve.policy_seed equal to the run's seed is the default update
    (the same weights); another one gives the same advantages and other weights (the noise-floor arm)."""
    common = [*NOISY, *QEVOLVE, "qevolve.n_iters=1", f"bc.warm_start_from={trap_runs / 'bc'}",
              f"qevolve.round1_data_from={trap_runs / 'full'}", f"qevolve.round1_critic_from={trap_runs / 'full'}"]
    runs = {"default": [], "same": ["qevolve.policy_seed=0"], "other": ["qevolve.policy_seed=5"]}
    for name, extra in runs.items():
        run_probe("qevolve", "probe-trap", [*common, *extra], tmp_path, name)

    def weights(name: str) -> bytes:
        return (tmp_path / name / "checkpoints" / "round-1" / "model.safetensors").read_bytes()

    assert weights("same") == weights("default") != weights("other")
    default, other = _labels(tmp_path / "default"), _labels(tmp_path / "other")
    assert default["slots"] == other["slots"] and default["raw"] == other["raw"]


def test_eto_escapes_the_trap(trap_runs: Path, tmp_path) -> None:  # noqa: ANN001
    """Budget: 4 iterations x 8 explorations (temperature 1) + DPO. BC <= 0.25 -> >= 0.5 after iteration 4
    (measured 1.0 / 0.875 / 0.75 at seeds 0 / 1 / 2). With 2 iterations seed 0 stays at 0.125: whether an iteration
    samples a door episode decides the run, so more iterations (not a higher temperature: 1.5 gives 0.0) fix it."""
    res = run_probe("eto", "probe-trap", [*NOISY, "eto.n_iters=4", "eto.lr=1e-3", "eto.lr_later=5e-4",
                                          "eto.batch_size=4", "eto.micro_batch_size=4", "eto.epochs=3",
                                          "eto.explore_temperature=1.0", f"bc.warm_start_from={trap_runs / 'bc'}"],
                    tmp_path)
    start, end = success(res, "eval/bc"), success(res, "eval/eto-iter-4")
    assert start <= 0.25 and end >= 0.5, (start, end)
    # each iteration's report row: held-out format errors after it vs at the start, from the evaluations
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    fmt = {r["step"]: r for r in rows if r["phase"] == "diag/eto" and "format_error" in r}
    assert sorted(fmt) == [1, 2, 3, 4]
    assert fmt[4]["format_error"] == res["eval/eto-iter-4"]["test"]["format_error_rate"]
    assert fmt[4]["format_error_start"] == res["eval/bc"]["test"]["format_error_rate"]


def test_awr_escapes_the_trap(trap_runs: Path, tmp_path) -> None:  # noqa: ANN001
    """'w/o PI + AWR' (advantage-weighted BC) needs more policy steps than BPPO at the same lr: with 2 policy epochs
    it reaches 0.125 (measured), with 6 (30 steps) BC 0.0 -> >= 0.75 (measured 1.0) in one round."""
    res = run_probe("qevolve", "probe-trap", [*NOISY, *QEVOLVE, "qevolve.n_iters=1", "qevolve.pi=awr",
                                              "qevolve.policy_epochs=6", f"bc.warm_start_from={trap_runs / 'bc'}",
                                              f"qevolve.round1_data_from={trap_runs / 'full'}"], tmp_path)
    start, end = success(res, "eval/bc"), success(res, "eval/round-1")
    assert start <= 0.25 and end >= 0.75, (start, end)


@pytest.mark.parametrize("with_expert", [False, True])
def test_bon_sft_escapes_the_trap(trap_runs: Path, tmp_path, with_expert: bool) -> None:  # noqa: ANN001
    """BoN + SFT (rejection sampling): 8 tasks x 8 samples at T = 1, the door episodes kept, SFT from pi_BC.
    BC <= 0.25 -> >= 0.75 (measured 1.0 at seeds 0 / 1 / 2, with and without the demos mixed in: only the
    successful ones, 2 of the 8 noisy demos, as the expert-iteration form trains on what succeeded)."""
    res = run_probe("bon_sft", "probe-trap", [*NOISY, "rsd.ctx_warm_start=false", "rsd.tasks_per_round=8",
                                              "rsd.bon_n=8", "rsd.rollout_temperature=1.0",
                                              f"rsd.bon_with_expert={str(with_expert).lower()}",
                                              f"bc.warm_start_from={trap_runs / 'bc'}"], tmp_path)
    start, end = success(res, "eval/bc"), success(res, "eval/bon-sft")
    assert start <= 0.25 and end >= 0.75, (start, end)
    assert res["bon-sft"]["expert_trajectories"] == (2 if with_expert else 0)


QLASS = ["qlass.max_depth=2", "qlass.min_prune_depth=1", "qlass.head_hidden=32", "qlass.lr=3e-3", "qlass.epochs=20",
         "qlass.batch_size=8", "qlass.micro_batch_size=8", "qlass.n_candidates=4", "qlass.explore_top_p=1.0",
         "qlass.explore_temperature=1.0", "qlass.samples_per_depth=4"]


# Not a code bug (docs/probes.md): on this probe per-tree min-max labels score 'take coin' 0.9-1.0 in every tree that
# never sampled the door, and Q-guided selection can only pick among candidates a sharp BC samples. No budget tried
# (up to 16 trees, 8 candidates at T=1, qlass.loss_tokens=reply) passed at all of seeds 0-2, so it stays slow.
@pytest.mark.slow
def test_qlass_escapes_the_trap(trap_runs: Path, tmp_path) -> None:  # noqa: ANN001
    """Budget: 8 trees (depth 2, 4 children per node), Q-net 20 epochs, 4 candidates per step. BC 0.0 -> >= 0.5."""
    res = run_probe("qlass", "probe-trap", [*NOISY, *QLASS, f"bc.warm_start_from={trap_runs / 'bc'}"], tmp_path)
    start, end = success(res, "eval/bc"), success(res, "eval/qlass")
    assert start <= 0.25 and end >= 0.5, (start, end)


# -- RSD: the hindsight probe ---------------------------------------------------------------------------------------

# 2 layers, width 64 (reading a word from the prompt needs the second layer: see the copy test). 32 vaults, 64 train
# tasks (each vault twice), noise 0.5: 9 vaults have only wrong demos, so the base is wrong there. The context is
# the future hindsight H_1 alone (its observation names the password). The warm start teaches every solved demo only
# with context (rsd.ctx_warm_keep_plain=0): with a plain row as well, the tiny model fits both by remembering
# vault -> password and never reads (docs/probes.md). With precedents in the context it learns to copy the top
# precedent's answer, which in round 1 is mostly another vault's, and the rule writer's lessons / reflection name
# one colour for all vaults, so the probe runs with the future only (rsd.components, a rule knob).
RSD = ["model.tiny.num_layers=2", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
       "env.params.expert_noise=0.5", "env.params.n_vaults=32", "env.n_train=64", "optim.lr=3e-3", "optim.epochs=30",
       "optim.max_length=768", "rsd.writer=rule", "rsd.ctx_warm_start=true", "rsd.ctx_warm_fraction=1.0",
       "rsd.ctx_warm_keep_plain=0.0", "rsd.ctx_warm_steps=1", "rsd.ctx_warm_epochs=60", "rsd.components=[future]",
       "rsd.tasks_per_round=64", "rsd.lr=3e-3", "rsd.epochs=30", "rsd.internalisation=false"]


@pytest.fixture(scope="module")
def rsd_full(tmp_path_factory) -> Path:  # noqa: ANN001
    """BC -> context warm start -> 2 RSD rounds (follow_freeze, content-overlap precedents, renormalised top-k)."""
    out = tmp_path_factory.mktemp("rsd")
    run_probe("rsd", "probe-hindsight", [*RSD, "rsd.rounds=2"], out, "full")
    return out / "full"


def _round_acts(run_dir: Path, r: int) -> list[Any]:
    from agentevo.data.store import ExperienceStore

    store = ExperienceStore(run_dir / "experience.db")
    try:
        return store.load(collection=f"round-{r}/act")
    finally:
        store.close()


def _precedent_vaults(run_dir: Path) -> list[list[str]]:
    """Per round-1 episode (in acting order), the vaults of its ranked precedents."""
    trajs = _round_acts(run_dir, 1)
    vault = {int(t.meta["store_id"]): t.task.params["vault"] for t in trajs}
    material = json.loads((run_dir / "rsd" / "round-1" / "material.json").read_text())
    return [[vault[i] for i in material["precedents"][str(t.meta["store_id"])]] for t in trajs]


def _cache(run_dir: Path, r: int) -> Any:
    from agentevo.algorithms.rsd.recipe import TeacherCache

    return TeacherCache.load(run_dir / "rsd" / f"round-{r}" / "teacher_topk.pt")


def _state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "state.json").read_text())


@pytest.mark.parametrize("flag", ["rsd.retrieval=random", "rsd.topk_tail=true", "rsd.teacher=fixed_init",
                                  "rsd.teacher=always_follow"])
def test_rsd_variant_changes_what_it_claims(rsd_full: Path, tmp_path, flag: str) -> None:  # noqa: ANN001
    """Each variant from the full run's base (bc.warm_start_from imports its BC and ctx-bc), on the same round-1
    episodes (same student, same sampling seed): it must change its claimed quantity and only that."""
    import torch

    rounds = 2 if flag.startswith("rsd.teacher") else 1
    # always_follow differs from follow_freeze only after a drop: a step size that breaks the round-1 student
    # (rsd.lr=0.3) makes follow_freeze freeze at the base (run 'freeze'), while always_follow keeps following
    # (schedule metric on the test split: the base solves none of the dev vaults, so dev cannot show a drop)
    extra = ["rsd.lr=0.3", "rsd.metric_split=test"] if flag.endswith("always_follow") else []
    base = [*RSD, f"rsd.rounds={rounds}", *extra, f"bc.warm_start_from={rsd_full}"]
    # the full run's context has no precedents: random retrieval shows them to the teacher (same base: a rule knob)
    shown = ["rsd.components=[prec,future]"] if flag == "rsd.retrieval=random" else []
    run_probe("rsd", "probe-hindsight", [*base, *shown, flag], tmp_path, "variant")
    mine = tmp_path / "variant"
    same = [t.steps[0].action_text for t in _round_acts(mine, 1)]
    assert same == [t.steps[0].action_text for t in _round_acts(rsd_full, 1)]  # the same round-1 episodes
    full_cache, my_cache = _cache(rsd_full, 1), _cache(mine, 1)
    if flag == "rsd.retrieval=random":
        # content overlap ranks the same vault first (its goal shares the vault word); random does not
        ours, theirs = _precedent_vaults(mine), _precedent_vaults(rsd_full)
        trajs = _round_acts(mine, 1)
        # episodes for which the bank holds another solved episode of the same vault: content overlap must rank
        # such a precedent first (hand-checkable from the bank), random only by chance
        has_same = [any(o.success and o is not t and o.task.params["vault"] == t.task.params["vault"] for o in trajs)
                    for t in trajs]
        top_same = [[bool(p) and p[0] == t.task.params["vault"] for p, t in zip(v, trajs, strict=True)]
                    for v in (theirs, ours)]
        assert top_same[0] == has_same and sum(has_same) >= 2, (top_same, has_same)
        assert ours != theirs and sum(top_same[1]) < sum(top_same[0]), top_same
        assert _state(mine)["round-1/teacher"]["ctx_tokens_prec"] > 0  # the random precedents reach the teacher
    elif flag == "rsd.topk_tail=true":
        # the same teacher top-k (same weights, same context); the divergence adds the tail bucket
        assert torch.equal(full_cache.ids, my_cache.ids) and torch.equal(full_cache.logp, my_cache.logp)
        kl = (_state(rsd_full)["round-1/teacher"]["kl_pre"], _state(mine)["round-1/teacher"]["kl_pre"])
        assert abs(kl[0] - kl[1]) > 1e-6, kl
        ours = (mine / "checkpoints" / "round-1" / "model.safetensors").read_bytes()
        assert ours != (rsd_full / "checkpoints" / "round-1" / "model.safetensors").read_bytes()
    else:
        # round 1 is taught by the base in every mode; the round-2 teacher follows the mode's rule
        assert torch.equal(full_cache.logp, my_cache.logp)
        ref = rsd_full
        if extra:
            ref = tmp_path / "freeze"
            run_probe("rsd", "probe-hindsight", base, tmp_path, "freeze")
            m = [_state(ref)[p]["test"]["success_rate"] for p in ("eval/base", "eval/round-1")]
            assert m[1] < m[0] and _state(ref)["round-1/schedule"]["frozen"], m
        ref_t, my_t = _state(ref)["round-2/teacher"]["teacher"], _state(mine)["round-2/teacher"]["teacher"]
        assert ref_t == ("ctx-bc" if ref != rsd_full else "round-1"), ref_t  # follow_freeze froze / followed
        assert my_t == ("ctx-bc" if flag.endswith("fixed_init") else "round-1"), my_t
        assert my_t != ref_t and not torch.equal(_cache(ref, 2).logp, _cache(mine, 2).logp)


def test_rsd_teacher_reads_the_password_from_hindsight(rsd_full: Path) -> None:
    """The teacher (ctx-bc with the round-1 context) names the password on >= 3/4 of the round-1 steps of vaults
    with no solved demo, the premise diagnostic says so, and 2 RSD rounds raise greedy test success by >= 0.25.
    Measured at seeds 0 / 1 / 2: see docs/probes.md."""
    import torch
    from transformers import AutoTokenizer

    from agentevo.envs.probes import vault_password
    from agentevo.eval.diagnostics import rsd_premise

    tokenizer = AutoTokenizer.from_pretrained(rsd_full / "checkpoints" / "bc")
    from agentevo.data.store import ExperienceStore

    store = ExperienceStore(rsd_full / "experience.db")
    try:
        solved = {t.task.params["vault"] for t in store.load(collection="expert") if t.success}
    finally:
        store.close()
    cache = _cache(rsd_full, 1)
    top1 = cache.topk_rows(torch.arange(cache.n_tokens))[0][:, 0]
    named = []
    for i, traj in enumerate(_round_acts(rsd_full, 1)):
        vault = traj.task.params["vault"]
        if vault not in solved:
            start, n = cache.offsets[(i, 1)]
            named.append(vault_password(vault) in tokenizer.decode(top1[start : start + n]))
    state = _state(rsd_full)
    assert state["ctx-bc"]["context_only_demos"] == state["ctx-bc"]["context_rows"] > 0  # no plain row for them
    start_s, end_s = (state[p]["test"]["success_rate"] for p in ("eval/base", "eval/round-2"))
    assert named and sum(named) >= 0.75 * len(named), (sum(named), len(named))
    # the premise as diagnosed: the teacher favours what succeeded over what failed (the mean over all sampled
    # tokens reads lower for this good teacher, since most of the weak student's samples are wrong)
    teach = state["round-1/teacher"]
    verdicts = {d.name.split(" (")[0]: d.verdict for d in rsd_premise(teach)}
    assert teach["separation"] > 0.1 and "fail" not in verdicts.values(), (teach, verdicts)
    assert verdicts["teacher − student log-prob per step, successful − failed episodes"] == "pass", verdicts
    assert teach["teacher_token_logp"] < teach["student_token_logp"]
    assert end_s >= start_s + 0.25, (start_s, end_s)


# -- Self-Guide: the guide probe (slow: the guided BC start alone is ~30 s) ----------------------------------------

# 2 layers, width 64 and 80 BC epochs: with 30 epochs the guided BC presses a colour by position, not by the light
# (success 0.0 at noise 0); with 80 it reads every light (1.0, guide/action agreement 1.0, measured at noise 0).
SELFGUIDE = ["model.tiny.num_layers=2", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
             "env.n_train=32", "optim.lr=3e-3", "optim.epochs=80", "optim.max_length=512",
             "selfguide.guide_max_tokens=24", *NOISY, *GRPO]


@pytest.fixture(scope="module")
def guide_full(tmp_path_factory) -> Path:  # noqa: ANN001
    """Guide-BC on 32 demos, 3/4 of which press the wrong colour at light 2, then 6 Self-Guide updates."""
    out = tmp_path_factory.mktemp("guide")
    run_probe("selfguide", "probe-guide", SELFGUIDE, out, "full")
    return out / "full"


@pytest.mark.slow
def test_selfguide_learns_the_lights(guide_full: Path) -> None:
    """Budget: 6 updates x 8 tasks x G=4 three-step episodes. Guide-BC 0.0 -> >= 0.875 at update 3 (measured 1.0),
    >= 0.5 at update 6 (0.75: stage III shows all past guides, a prompt shape that costs success, see the
    CookingWorld finding in docs). Premise: the guide's 'Next:' is the action taken, and its verdict (read off
    'Correct.' / 'Wrong button.') ranks the steps that scored. Seed 0 only: at seeds 1 and 2 this budget fails
    (0.0-0.25 after 6 updates; docs/probes.md)."""
    state = _state(guide_full)
    assert state["eval/bc"]["test"]["success_rate"] == 0.0
    assert state["eval/update-3"]["test"]["success_rate"] >= 0.875
    assert state["eval/update-6"]["test"]["success_rate"] >= 0.5
    assert state["diag/premise"]["guide_agreement"] >= 0.8  # measured 1.0
    assert state["update-1"]["verdict_auc_progress"] >= 0.9  # measured 1.0


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["selfguide.guide_tokens_adv=combined", "selfguide.schedule=none",
                                  "selfguide.lambda_max=1.0"])
def test_selfguide_variant_changes_what_it_claims(guide_full: Path, tmp_path, flag: str) -> None:  # noqa: ANN001
    """Same guide-BC (imported), same rollout seeds. In stage I (updates 1-2) lambda is 0 under every schedule, so
    each variant must match the full run bit for bit there; from update 3 (lambda 0.22 in the full run) the
    rollouts are still the same and the loss must differ."""
    # all 6 updates: the stage breakpoints are fractions of grpo.n_updates, so a shorter run has another schedule
    run_probe("selfguide", "probe-guide", [*SELFGUIDE, flag, f"bc.warm_start_from={guide_full}"], tmp_path,
              "variant")
    full, mine = _state(guide_full), _state(tmp_path / "variant")
    for k in (1, 2):
        assert mine[f"update-{k}"]["loss"] == full[f"update-{k}"]["loss"] and mine[f"update-{k}"]["lambda"] == 0.0
    assert mine["update-3"]["rollout_avg_reward"] == full["update-3"]["rollout_avg_reward"]  # same rollouts
    lam = {"selfguide.schedule=none": 0.0, "selfguide.lambda_max=1.0": 2 * full["update-3"]["lambda"]}
    assert mine["update-3"]["lambda"] == pytest.approx(lam.get(flag, full["update-3"]["lambda"]))
    assert abs(mine["update-3"]["loss"] - full["update-3"]["loss"]) > 1e-6, (mine["update-3"]["loss"],
                                                                              full["update-3"]["loss"])
