"""Q-Evolve recipe: labels, process rewards, advantage labels on reply tokens, the policy loss, flags, reranking."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.qevolve import recipe as qevolve
from agentevo.algorithms.qevolve.config import QEvolveConfig
from agentevo.algorithms.qevolve.recipe import (
    Dataset,
    RerankActor,
    StepLabels,
    auc,
    dataset_advantages,
    is_holdout,
    policy_loss,
    policy_samples,
    process_rewards,
    span_logprobs,
    spearman,
    step_labels,
)
from agentevo.config import load_config
from agentevo.data.tensors import collate, reply_logprobs
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.models.backend import Generation, Sampling


def _traj(renderer, actions, signals=None, final=1.0, source="self", rewards=None, task_id="t0"):  # noqa: ANN001, ANN202
    task = Task("twx-cookingworld", task_id, "train", "cookingworld", {}, 20)
    steps = []
    for t, action in enumerate(actions, start=1):
        text = expert_reply(action)
        ids = renderer.encode_reply(text) if renderer is not None else []
        steps.append(Step(t, f"obs {t}", text, ids, None, parse_action(text), f"obs {t + 1}",
                          (rewards or [0.0] * len(actions))[t - 1], t == len(actions),
                          signal=(signals or ["none"] * len(actions))[t - 1]))
    return Trajectory(task, source, source, "Cook a meal.", steps, final, final > 0, goal="cook",
                      meta={"store_id": 0})


# -- step 2: labels ------------------------------------------------------------------------------------------------


def test_step_labels_sparse_reward_aux_weights_and_flags() -> None:
    traj = _traj(None, ["a", "b", "c", "d"], signals=["format", "none", "invalid", "repeat"], final=0.5,
                 rewards=[0.1, 0.0, 0.2, 0.2])
    lab = step_labels(traj, QEvolveConfig())
    assert lab.r_env == [0.0, 0.0, 0.0, 0.5]  # terminal final reward only
    assert lab.r_aux == pytest.approx([-0.1, 0.0, -0.1, -0.1])
    assert lab.done == [False, False, False, True]
    assert lab.d is True
    assert lab.w == pytest.approx([0.5 * (t / 4 + 1) + 0.5 for t in range(1, 5)])  # 1.125 ... 1.5
    assert lab.critic_rewards(True) == pytest.approx([-0.1, 0.0, -0.1, 0.4])
    assert lab.critic_rewards(False) == [0.0, 0.0, 0.0, 0.5]  # rr off
    q = QEvolveConfig(wiql=False, sci_dense=True, r_fmt=-1.0, r_inv=-0.5, r_repeat=-0.25)
    lab = step_labels(traj, q)
    assert lab.w == [1.0] * 4  # w/o W-IQL
    assert lab.r_env == [0.1, 0.0, 0.2, 0.2]  # per-step score deltas
    assert lab.r_aux == [-1.0, 0.0, -0.5, -0.25]
    failed = step_labels(_traj(None, ["a", "b"], final=0.0), QEvolveConfig())
    assert failed.d is False and failed.w == pytest.approx([0.75, 1.0])


# -- step 4: process rewards ---------------------------------------------------------------------------------------

_LAB = StepLabels(r_env=[0.0, 0.0, 1.0], r_aux=[-0.1, 0.0, -0.1], done=[False, False, True], w=[1.0] * 3, d=True)
_VAL = {"v": [0.5, 0.6, 0.8, 0.3], "q1": [0.7, 0.2, 0.9], "q2": [0.6, 0.4, 1.0]}


@pytest.mark.parametrize(
    "pr, expected",
    [
        # δ = [0.9·0.6 − 0.5, 0.9·0.8 − 0.6, 1 − 0.8] = [0.04, 0.12, 0.2]; A_t = δ_t + 0.45·A_{t+1}
        ("gae", [0.04 + 0.45 * (0.12 + 0.45 * 0.2), 0.12 + 0.45 * 0.2, 0.2]),
        # r_aux inside δ: [−0.06, 0.12, 0.1]
        ("gae_aux", [-0.06 + 0.45 * (0.12 + 0.45 * 0.1), 0.12 + 0.45 * 0.1, 0.1]),
        ("td", [0.04, 0.12, 0.2]),
        ("q_minus_v", [0.6 - 0.5, 0.2 - 0.6, 0.9 - 0.8]),
    ],
)
def test_process_rewards(pr: str, expected: list[float]) -> None:
    assert process_rewards(pr, _LAB, _VAL, gamma=0.9, lam=0.5) == pytest.approx(expected, abs=1e-6)


def test_advantages_are_normalised_over_the_dataset_when_adv_norm() -> None:
    labels, values = [_LAB, _LAB], [_VAL, {**_VAL, "v": [0.0, 0.0, 0.0, 0.0]}]
    q = QEvolveConfig(gamma=0.9, lam=0.5)
    raw, final = dataset_advantages(q, labels, values)
    flat = torch.tensor(raw[0] + raw[1])
    assert raw[1] == pytest.approx([0.45 * 0.45, 0.45, 1.0])  # V ≡ 0: δ = r_env = [0, 0, 1]
    assert final[0] + final[1] == pytest.approx(((flat - flat.mean()) / (flat.std() + 1e-8)).tolist(), abs=1e-6)
    raw2, final2 = dataset_advantages(QEvolveConfig(gamma=0.9, lam=0.5, adv_norm=False), labels, values)
    assert final2 == raw2 == raw


# -- step 5: advantage labels reach the right reply tokens ----------------------------------------------------------


@pytest.mark.parametrize("window", [10, 1])  # packed rows, and one row per step
def test_advantage_and_logprob_labels_reach_their_reply_tokens(tiny_policy, window: int) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    data = Dataset([_traj(r, ["take knife", "open fridge", "take carrot"]), _traj(r, ["eat meal", "open fridge"])])
    adv = [[0.5, -1.0, 2.0], [-0.25, 0.75]]
    samples = policy_samples(r, data, adv, window, 4096)
    # window 1: the 3-step episode drops a turn at t = 3 (one row per step); the 2-step one still packs
    assert len(samples) == (2 if window == 10 else 4)
    old = span_logprobs(tiny_policy.model, samples, tiny_policy.pad_id, 2)
    for s, o in zip(samples, old, strict=True):
        s.token_labels["old_logp"] = o
    batch = collate(samples, tiny_policy.pad_id)
    with torch.no_grad():
        logp, mask = reply_logprobs(tiny_policy.model, batch)
    for row, s in enumerate(samples):
        for col in range(batch["input_ids"].shape[1]):
            t = int(batch["step_id"][row, col])
            if t < 0:
                assert batch["adv"][row, col] == 0.0 and mask[row, col] == 0
            else:
                assert batch["adv"][row, col] == pytest.approx(adv[s.traj_index][t - 1])
                assert batch["old_logp"][row, col] == pytest.approx(float(logp[row, col]), abs=1e-5)
        n_reply = sum(len(data.trajs[s.traj_index].steps[t - 1].action_ids) for t in s.steps)
        assert int(mask[row].sum()) == n_reply


def _policy_batch(policy, shift_old: float = 0.0, shift_ref: float = 0.0):  # noqa: ANN001, ANN202
    r = policy.renderer
    data = Dataset([_traj(r, ["take knife", "open fridge"])])
    samples = policy_samples(r, data, [[1.0, -1.0]], 10, 4096)
    lp = span_logprobs(policy.model, samples, policy.pad_id, 2)
    samples[0].token_labels["old_logp"] = [x + shift_old for x in lp[0]]
    samples[0].token_labels["ref_logp"] = [x + shift_ref for x in lp[0]]
    return collate(samples, policy.pad_id)


def test_policy_loss_bppo_and_kl(tiny_policy) -> None:  # noqa: ANN001
    batch = _policy_batch(tiny_policy, shift_ref=-0.1)
    mask = batch["action_mask"].bool()
    mean_adv = float(batch["adv"][mask].mean())
    loss, stats = policy_loss(QEvolveConfig(kl_alpha=0.5))(tiny_policy.model, batch)
    kl = math.exp(-0.1) + 0.1 - 1  # k3 with ref − logp = −0.1 on every token
    # η = 1 everywhere: −J = −mean(A); plus α·KL
    assert float(loss.detach()) == pytest.approx(-mean_adv + 0.5 * kl, abs=1e-5)
    assert stats["kl_ref"] == pytest.approx(kl, abs=1e-6) and stats["kl_old"] == pytest.approx(0.0, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and stats["entropy"] > 0


def test_policy_loss_clips_asymmetrically(tiny_policy) -> None:  # noqa: ANN001
    # old = logp + 0.5: η = e^{−0.5} ≈ 0.61 < 1 − ε_low for ε_low = 0.28, inside for ε_low = 0.45
    batch = _policy_batch(tiny_policy, shift_old=0.5)
    mask = batch["action_mask"].bool()
    adv = batch["adv"][mask]
    eta = math.exp(-0.5)
    for eps_low, lower in ((0.28, 0.72), (0.45, eta)):
        q = QEvolveConfig(eps_low=eps_low, eps_high=0.2, kl_alpha=0.0)
        loss, stats = policy_loss(q)(tiny_policy.model, batch)
        # A > 0: min(ηA, clip(η)A) = ηA (η below the band); A < 0: the clipped value when η < 1 − ε_low
        per_token = torch.where(adv > 0, -eta * adv, -max(eta, lower) * adv)
        assert float(loss.detach()) == pytest.approx(float(per_token.mean()), abs=1e-5)
        expect_low = float((adv < 0).float().mean()) if eta < 1 - eps_low else 0.0
        assert stats["clip_frac_low"] == pytest.approx(expect_low, abs=1e-6)
        assert stats["clip_frac_high"] == 0.0


def test_policy_loss_awr(tiny_policy) -> None:  # noqa: ANN001
    batch = _policy_batch(tiny_policy, shift_ref=-0.3)
    with torch.no_grad():
        logp, mask = reply_logprobs(tiny_policy.model, batch)
    m = mask.bool()
    w = torch.clamp(torch.exp(2.0 * batch["adv"]), max=5.0)
    loss, stats = policy_loss(QEvolveConfig(pi="awr", awr_beta=2.0, awr_cap=5.0, kl_alpha=1.0))(tiny_policy.model, batch)
    assert float(loss.detach()) == pytest.approx(float(-(w * logp)[m].mean()), abs=1e-4)  # no KL term in AWR
    assert stats["kl_ref"] > 0 and stats["awr_loss"] == pytest.approx(float(loss.detach()), abs=1e-6)


# -- 'w/o PI': reranking ---------------------------------------------------------------------------------------------


class _Policy:
    """Generates fixed candidates; records the prompts."""

    def __init__(self, renderer, n) -> None:  # noqa: ANN001
        self.renderer, self.policy_id, self.pad_id = renderer, "bc", 0
        self.prompts: list[list[int]] = []
        self.n = n

    def generate(self, prompts, sampling):  # noqa: ANN001, ANN201
        self.prompts.extend(prompts)
        return [Generation([100 + k, k % self.n], [-0.1, -0.2], f"Action: c{k % self.n}") for k in range(len(prompts))]


class _Critic:
    def __init__(self, scores) -> None:  # noqa: ANN001
        self.scores, self.rows = scores, []

    def score(self, rows, pad_id):  # noqa: ANN001, ANN201
        self.rows.extend(rows)
        return torch.tensor(self.scores[: len(rows)], dtype=torch.float32)


def test_rerank_actor_keeps_the_candidate_with_the_highest_min_q(tiny_policy) -> None:  # noqa: ANN001
    from agentevo.rollout.engine import Episode, EpisodeRequest

    task = Task("twx-cookingworld", "t0", "test", "cookingworld", {}, 20)
    eps = [Episode(EpisodeRequest(task, k), k, first_obs=f"start {k}", goal="g", obs=f"start {k}") for k in range(2)]
    policy, critic = _Policy(tiny_policy.renderer, 3), _Critic([0.1, 0.9, 0.3, 0.5, -1.0, 0.4])
    actor = RerankActor(policy, critic, "Cook.", 5, 3, Sampling(0.7, max_new_tokens=4, seed=1), 4096)
    gens = actor.act(eps)
    assert [g.text for g in gens] == ["Action: c1", "Action: c0"]  # argmax of [0.1, 0.9, 0.3] and [0.5, -1, 0.4]
    assert len(policy.prompts) == 6 and policy.prompts[0] == policy.prompts[2] != policy.prompts[3]
    # the critic reads the full-history prompt followed by each candidate's ids
    assert critic.rows[1] == actor.critic_prompt(eps[0]) + [101, 1]
    assert actor.policy_id == "bc+rerank3" and not actor.needs_plan()


# -- helpers, config -------------------------------------------------------------------------------------------------


def test_spearman_auc_holdout() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    assert auc([0.9, 0.8, 0.1, 0.8], [True, True, False, False]) == pytest.approx((2 + 1.5) / 4)
    assert auc([0.1, 0.2], [True, True]) is None
    ids = [f"task-{k}" for k in range(2000)]
    frac = sum(is_holdout(i, 0.1, 0) for i in ids) / len(ids)
    assert 0.08 < frac < 0.12 and [is_holdout(i, 0.1, 0) for i in ids] == [is_holdout(i, 0.1, 0) for i in ids]
    assert not any(is_holdout(i, 0.0, 0) for i in ids)


@pytest.mark.parametrize(
    "override, message",
    [
        ("qevolve.eps_low=0.2", "must be greater than qevolve.eps_high"),
        ("qevolve.pr=mc", "qevolve.pr must be one of gae, q_minus_v, td, gae_aux"),
        ("qevolve.pi=ppo", "qevolve.pi must be one of bppo, awr, none"),
        ("qevolve.critic_arch=each_token", "not implemented"),
        ("qevolve.critic_init=random", "critic_init must be one of"),
        ("qevolve.buffer=all", "buffer must be one of refresh, accumulate"),
        ("qevolve.tau=1.0", "tau must be in (0, 1)"),
        ("qevolve.critic_batch_size=12", "multiple of qevolve.critic_micro_batch_size"),
        ("qevolve.loss_agg=sum", "loss_agg must be one of"),
    ],
)
def test_config_rejects_what_is_not_allowed(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override], method="qevolve")


def test_config_defaults_and_flags() -> None:
    cfg = load_config(None, ["qevolve.rr=off", "qevolve.wiql=off", "qevolve.pr=q_minus_v", "qevolve.pi=awr"],
                      method="qevolve")
    q = cfg.qevolve
    assert (q.rr, q.wiql, q.pr, q.pi) == (False, False, "q_minus_v", "awr")
    d = QEvolveConfig()
    # critic budget (issue 19): Polyak 0.05 over 500 steps; critic_epochs is a legacy override
    assert (d.eps_low, d.eps_high, d.tau, d.gamma, d.lam, d.polyak, d.kl_alpha) == (0.28, 0.2, 0.7, 0.99, 0.95, 0.05, 0.01)
    assert (d.critic_steps, d.critic_epochs) == (500, None)
    assert (d.n_iters, d.n_self_per_task, d.critic_hidden, d.collect_temperature) == (2, 33, 1024, 0.7)


# -- buffer and critic init (with a minimal run) -----------------------------------------------------------------


def test_buffer_refresh_and_accumulate(tmp_path) -> None:
    from agentevo.data.store import ExperienceStore

    store = ExperienceStore(tmp_path / "e.db")
    for coll, n in (("expert", 2), ("round-1/self", 3), ("round-2/self", 4)):
        for k in range(n):
            store.add(_traj(None, ["a"], source="expert" if coll == "expert" else "self", task_id=f"{coll}{k}"), coll, k)
    for buffer, n_self in (("refresh", 4), ("accumulate", 7)):
        run = SimpleNamespace(cfg=SimpleNamespace(qevolve=QEvolveConfig(buffer=buffer)), store=store)
        data = qevolve.hybrid_dataset(run, 2)
        assert [t.source for t in data.trajs] == ["expert"] * 2 + ["self"] * n_self
        assert len(set(data.keys)) == len(data.keys)
    store.close()


def test_critic_init_choices(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    from agentevo.models.critic import save_critic

    cfg = load_config(None, ["qevolve.critic_hidden=8"], method="qevolve")
    bc = copy.deepcopy(tiny_policy)
    with torch.no_grad():
        for p in bc.model.parameters():
            p.add_(0.01)
    run = SimpleNamespace(cfg=cfg, checkpoint_dir=lambda name: tmp_path / name, load_policy=lambda name: bc)
    policy = copy.deepcopy(tiny_policy)
    assert qevolve.build_critic(run, 1, policy, "policy").lm is policy.model
    assert qevolve.build_critic(run, 1, policy, "bc").lm is bc.model
    # prev_critic in round 1 (no previous critic): starts from the policy
    assert qevolve.build_critic(run, 1, policy, "prev_critic").lm is policy.model
    prev = qevolve.build_critic(run, 1, copy.deepcopy(tiny_policy), "policy")
    with torch.no_grad():
        prev.v_head[0].weight.add_(1.0)
    save_critic(prev, tmp_path / "round-1-critic", tiny_policy.tokenizer)
    again = qevolve.build_critic(run, 2, policy, "prev_critic")
    # compared on the CPU: on a GPU machine the reloaded critic lives on the GPU, the saved one may not
    assert torch.equal(again.v_head[0].weight.cpu(), prev.v_head[0].weight.cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(again.lm.parameters(), prev.lm.parameters(), strict=True))


# -- end to end ------------------------------------------------------------------------------------------------------


def _smoke_overrides(tmp_path, extra: list[str]) -> list[str]:  # noqa: ANN001
    return [
        "env.n_train=3", "env.n_dev=2", "env.n_test=2", "env.params={max_steps: 4}",
        "model.tiny={hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, vocab_size: 400}",
        "agent.history_window=4", "agent.max_new_tokens=12", "rollout.n_parallel=4", "rollout.batch_size=8",
        "optim.epochs=1", "optim.batch_size=4", "optim.micro_batch_size=4", "optim.lr=5.0e-3",
        "qevolve.n_iters=1", "qevolve.n_self_per_task=2", "qevolve.critic_hidden=16", "qevolve.critic_lr=1.0e-3",
        "qevolve.critic_epochs=1", "qevolve.critic_batch_size=4", "qevolve.critic_micro_batch_size=4",
        "qevolve.policy_lr=1.0e-4", "qevolve.policy_batch_size=4", "qevolve.policy_micro_batch_size=4",
        "qevolve.critic_holdout=0.34", f"output_dir={tmp_path}", "name=qe", *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["qevolve.pi=none", "qevolve.rerank_n=2", "model.lora.enabled=true"]])
def test_one_round_end_to_end_and_resume(tmp_path, extra: list[str]) -> None:  # noqa: ANN001
    from agentevo.run import Run

    cfg = load_config(None, _smoke_overrides(tmp_path, extra), method="qevolve")
    run = Run.create(cfg, quiet=True)
    try:
        results = qevolve.run(run)
    finally:
        run.close()
    for key in ("round-1/collect", "round-1/label", "round-1/critic", "round-1/advantages", "round-1/policy",
                "eval/round-1"):
        assert key in results and key in json.loads((tmp_path / "qe" / "state.json").read_text())
    assert results["round-1/collect"]["n"] == 3 * 2  # n_self_per_task per training task
    assert results["round-1/label"]["n_expert"] == 3 and results["round-1/label"]["n_self"] == 6
    assert results["eval/round-1"]["test"]["n"] == 2
    labels = json.loads((tmp_path / "qe" / "labels" / "round-1.json").read_text())
    assert len(labels["adv"]) == 9
    flat = torch.tensor([a for t in labels["adv"] for a in t])
    assert abs(float(flat.mean())) < 1e-5 and float(flat.std()) == pytest.approx(1.0, abs=1e-4)
    # the premise record of step 4: mean advantage of rule-flagged steps vs the others, from the same labels
    records = [json.loads(line) for line in (tmp_path / "qe" / "metrics.jsonl").read_text().splitlines()]
    (diag,) = [r for r in records if r["phase"] == "diag/qevolve" and "flagged_n" in r]
    n_flagged = results["round-1/label"]["n_steps"] - round(results["round-1/label"]["aux_frac_none"]
                                                            * results["round-1/label"]["n_steps"])
    assert diag["step"] == 1 and diag["flagged_n"] == n_flagged
    if diag["unflagged_adv"] is not None and diag["flagged_adv"] is not None:
        n_all = int(flat.numel())
        assert diag["flagged_adv"] * n_flagged + diag["unflagged_adv"] * (n_all - n_flagged) == pytest.approx(
            float(flat.sum()), abs=1e-4)
    # step 6's record: held-out format errors against the BC start, and the update's KL (none without an update)
    state = json.loads((tmp_path / "qe" / "state.json").read_text())
    (drift,) = [r for r in records if r["phase"] == "diag/qevolve" and "format_error" in r]
    assert drift["step"] == 1 and drift["format_error"] == state["eval/round-1"]["test"]["format_error_rate"]
    assert drift["format_error_start"] == state["eval/bc"]["test"]["format_error_rate"]
    assert drift.get("kl_ref") == state["round-1/policy"].get("kl_ref")
    assert ("kl_ref" in drift) == ("qevolve.pi=none" not in extra)
    assert (tmp_path / "qe" / "checkpoints" / "round-1-critic" / "heads.pt").exists()
    phases = {json.loads(line)["phase"] for line in (tmp_path / "qe" / "metrics.jsonl").read_text().splitlines()}
    assert {"qevolve/data", "round-1/critic/train", "round-1/critic", "round-1/advantages"} <= phases
    if "qevolve.pi=none" in extra:
        assert "skipped" in results["round-1/policy"]
        assert not (tmp_path / "qe" / "checkpoints" / "round-1").exists()
    else:
        assert "round-1/policy/train" in phases and (tmp_path / "qe" / "checkpoints" / "round-1").exists()
        # step 5's premise record: how log pi moved per training step, over every step of D
        (follow,) = [r for r in records if r["phase"] == "diag/qevolve" and "follow_auc" in r]
        assert follow["step"] == 1 and follow["dlogp_flagged_n"] == n_flagged
        assert results["round-1/policy"]["diag"]["dlogp_flagged_n"] == n_flagged
    # resume: every phase is read back, nothing is recomputed
    n_lines = len((tmp_path / "qe" / "metrics.jsonl").read_text().splitlines())
    run = Run.open(tmp_path / "qe", quiet=True)
    try:
        again = qevolve.run(run)
    finally:
        run.close()
    assert again["eval/round-1"] == results["eval/round-1"]
    assert len((tmp_path / "qe" / "metrics.jsonl").read_text().splitlines()) == n_lines


def test_lora_policy_rounds_share_the_bc_base(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    from agentevo.run import Run

    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.r=4", f"output_dir={tmp_path}", "name=r"],
                      method="qevolve")
    run = Run.create(cfg, quiet=True)
    try:
        tiny_policy.save(run.checkpoint_dir("bc"))
        ids = torch.tensor([tiny_policy.renderer.encode_reply("Action: take knife")])
        with torch.no_grad():  # logits compared on the CPU, wherever each model was placed
            base = tiny_policy.model(input_ids=ids.to(tiny_policy.model.device)).logits.cpu()
        pi0 = qevolve.load_round_policy(run, 0)  # fresh adapter: the same function as pi_BC
        with torch.no_grad():
            assert torch.allclose(pi0.model(input_ids=ids.to(pi0.model.device)).logits.cpu(), base, atol=1e-5)
            for name, p in pi0.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
            moved = pi0.model(input_ids=ids.to(pi0.model.device)).logits.cpu()
            with pi0.model.disable_adapter():  # the reference pi_BC
                assert torch.allclose(pi0.model(input_ids=ids.to(pi0.model.device)).logits.cpu(), base, atol=1e-5)
        assert not torch.allclose(moved, base, atol=1e-3)
        pi0.save(run.checkpoint_dir("round-1"))
        assert (run.checkpoint_dir("round-1") / "adapter_config.json").exists()
        pi1 = qevolve.load_round_policy(run, 1)
        with torch.no_grad():
            assert torch.allclose(pi1.model(input_ids=ids.to(pi1.model.device)).logits.cpu(), moved, atol=1e-5)
        assert any(p.requires_grad for n, p in pi1.model.named_parameters() if "lora_" in n)
        assert not any(p.requires_grad for n, p in pi1.model.named_parameters() if "lora_" not in n)
    finally:
        run.close()


def test_round1_data_from_copies_the_collection_and_checks_settings(tmp_path) -> None:  # noqa: ANN001
    import json

    from agentevo.algorithms.qevolve.recipe import import_round1_data
    from agentevo.config import load_config
    from agentevo.data.types import Step, Trajectory
    from agentevo.envs.base import Task
    from agentevo.errors import ConfigError
    from agentevo.run import Run

    def make(name: str, *sets: str) -> Run:
        cfg = load_config(None, ["env.n_train=4", "env.n_test=2", *sets], method="qevolve", name=name,
                          output_dir=str(tmp_path))
        return Run.create(cfg, quiet=True)

    src = make("main")
    for slot in range(3):
        task = Task("twx-cookingworld", f"t{slot}", "train", "cookingworld", {}, 5)
        steps = [Step(1, "obs", "Action: look", [5, 6], [-0.5, -0.1], "look", "next", 0.0, True)]
        src.store.add(Trajectory(task, "self", "bc", "Instr.", steps, float(slot == 1), slot == 1), "round-1/self",
                      slot)
    src.state["round-1/collect"] = {"n": 3, "success_rate": 1 / 3}
    (src.dir / "state.json").write_text(json.dumps(src.state))
    src.close()

    ablation = make("wo-rr", "qevolve.rr=false")
    out = import_round1_data(ablation, tmp_path / "main")
    got = ablation.store.load(collection="round-1/self")
    assert [t.meta["slot"] for t in got] == [0, 1, 2] and [t.success for t in got] == [False, True, False]
    assert got[0].steps[0].action_ids == [5, 6] and got[0].steps[0].logprobs == pytest.approx([-0.5, -0.1])
    assert out["imported_from"] == str(tmp_path / "main") and out["n"] == 3
    import_round1_data(ablation, tmp_path / "main")  # again (a resumed run): nothing is stored twice
    assert len(ablation.store.load(collection="round-1/self")) == 3
    ablation.close()

    other = make("other-seed", "seed=3")
    with pytest.raises(ConfigError, match="seed is 3 here but 0"):
        import_round1_data(other, tmp_path / "main")
    other.close()

    # a source written before a setting existed (its config.yaml lacks it) counts as that setting's default
    import yaml

    old = yaml.safe_load((tmp_path / "main" / "config.yaml").read_text())
    del old["env"]["params"], old["agent"]["history_window"]
    (tmp_path / "main" / "config.yaml").write_text(yaml.safe_dump(old))
    again = make("after-upgrade")
    assert import_round1_data(again, tmp_path / "main")["n"] == 3
    again.close()
    window = make("other-window", "agent.history_window=1")
    with pytest.raises(ConfigError, match="agent is .*'history_window': 1.* here but .*'history_window': 3"):
        import_round1_data(window, tmp_path / "main")
    window.close()


def test_flagged_gap_under_other_process_rewards_by_hand() -> None:
    """The diagnostic's what-if rows: the normalised flagged-minus-other advantage gap under lam 0 (TD), from the
    same critic values, checked by hand; the run's own setting is not repeated; the report names passing ones."""
    from agentevo.algorithms.qevolve.recipe import flagged_gap_alternatives, step_labels
    from agentevo.eval import diagnostics as dg

    a = _traj(None, ["take knife", "eat knife", "eat meal"], signals=["none", "invalid", "none"], final=1.0)
    b = _traj(None, ["eat fridge", "look"], signals=["invalid", "none"], final=0.0)
    values = [{"v": [0.5, 0.5, 0.8, 0.0]}, {"v": [0.4, 0.4, 0.0]}]
    # lam 0: A_t = r_t + 0.99 V_{t+1} (0 after the last step) - V_t
    #   a: -0.005, 0.292 (flagged), 0.2; b: -0.004 (flagged), -0.4
    # gap of the normalised values = (mean flagged - mean others) / sample std
    #   = (0.144 - (-0.068333)) / sqrt(0.2839272 / 4) = 0.212333 / 0.266424 = 0.79697
    flagged = [False, True, False, True, False]
    labels = [step_labels(t, QEvolveConfig()) for t in (a, b)]
    got = flagged_gap_alternatives(QEvolveConfig(), labels, values, flagged)
    assert set(got) == {"flagged_gap_if_gae_lam0.5", "flagged_gap_if_gae_lam0", "flagged_gap_if_gae_aux_lam0.95"}
    assert got["flagged_gap_if_gae_lam0"] == pytest.approx(0.79697, abs=1e-4)
    assert "flagged_gap_if_gae_lam0.5" not in flagged_gap_alternatives(QEvolveConfig(lam=0.5), labels, values,
                                                                         flagged)
    (row,) = dg.critic_fit({"flagged_adv": 0.5, "unflagged_adv": 0.0, "flagged_gap_if_gae_lam0.5": -0.3,
                            "flagged_gap_if_gae_lam0": 0.2})
    assert row.verdict == "fail" and row.fix.endswith(
        "; from this round's critic values, pr=gae lam=0.5 gives -0.3 (qevolve.pr / qevolve.lam)")
