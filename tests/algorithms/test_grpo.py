"""GRPO / DAPO: group advantages, dropping, penalties, clip sides and KL of the loss, token alignment, the update."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.algorithms.grpo.recipe import (
    PolicyTrainer,
    add_ref_logprobs,
    group_diagnostics,
    group_requests,
    group_returns,
    grpo_loss,
    outcome_advantages,
    outcome_samples,
    split_groups,
    step_penalties,
    update_tasks,
)
from agentevo.config import RunConfig, load_config
from agentevo.data.tensors import collate, reply_logprobs, trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError


def _task(k: int = 0) -> Task:
    return Task("twx-cookingworld", f"t{k}", "train", "cookingworld", {}, 20)


def _traj(policy, actions: list[str], reward: float = 0.0, signals: list[str] | None = None,  # noqa: ANN001
          with_logprobs: bool = True, meta: dict | None = None) -> Trajectory:
    """A trajectory of scripted replies whose behaviour log-probs are the policy's own (on-policy)."""
    r = policy.renderer
    steps = []
    for t, action in enumerate(actions, start=1):
        text = expert_reply(action)
        steps.append(Step(t, f"obs {t}", text, r.encode_reply(text), None, parse_action(text), f"obs {t + 1}", 0.0,
                          False, signal=(signals or ["none"] * len(actions))[t - 1]))
    traj = Trajectory(_task(), "self", "p", "Instruction.", steps, reward, reward >= 1.0, goal="g", meta=meta or {})
    if with_logprobs:
        (sample,) = trajectory_samples(r, traj, 0, 20, 4096)
        logp, _ = reply_logprobs(policy.model, collate([sample], policy.pad_id))
        for s, (a, b) in zip(traj.steps, sample.spans, strict=True):
            s.logprobs = logp[0, a:b].tolist()
    return traj


# ------------------------------------------------------------------------------------------- config


def test_algo_resolves_clip_and_dropping() -> None:
    assert GRPOConfig().clip_high == 0.2 and not GRPOConfig().drop_groups
    dapo = GRPOConfig(algo="dapo")
    assert dapo.clip_high == 0.28 and dapo.drop_groups and dapo.eps_low == 0.2
    assert GRPOConfig(algo="dapo", eps_high=0.3, drop_equal_groups=False).clip_high == 0.3
    assert not GRPOConfig(algo="dapo", drop_equal_groups=False).drop_groups
    cfg = load_config(None, ["grpo.algo=dapo", "grpo.group_size=4", "selfguide.schedule=constant"])
    assert cfg.grpo.clip_high == 0.28 and cfg.selfguide.schedule == "constant"
    with pytest.raises(ConfigError, match="grpo.algo must be one of grpo, dapo"):
        load_config(None, ["grpo.algo=ppo"])
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_config(None, ["grpo.group_size=1"])
    with pytest.raises(ConfigError, match="penalty_signals"):
        load_config(None, ["grpo.penalty_signals=[bogus]"])


# ------------------------------------------------------------------------------------------- groups


def test_update_tasks_cycle_and_group_slots() -> None:
    tasks = [_task(k) for k in range(5)]
    assert [t.task_id for t in update_tasks(tasks, 1, 2)] == ["t0", "t1"]
    assert [t.task_id for t in update_tasks(tasks, 3, 2)] == ["t4", "t0"]  # wraps around the fixed list
    reqs = group_requests(tasks[:2], 3, meta={"keep": 0})
    assert [r.slot for r in reqs] == [0, 1, 2, 3, 4, 5]
    assert [(r.meta["group"], r.meta["member"]) for r in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(r.meta["keep"] == 0 for r in reqs) and reqs[0].task.task_id == "t0" and reqs[3].task.task_id == "t1"
    # as loaded from the store: meta carries group and slot, order scrambled
    trajs = [SimpleNamespace(meta={"group": r.meta["group"], "slot": r.slot}) for r in reversed(reqs)]
    groups = split_groups(trajs)
    assert [[t.meta["slot"] for t in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]


# ------------------------------------------------------------------------------------------- advantages


def test_group_normalised_advantages_by_hand() -> None:
    adv = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), GRPOConfig())
    # mean 0.5, sample std sqrt(1/3): (1 - 0.5)/0.57735 = 0.8660
    assert adv.tolist() == pytest.approx([0.8660, -0.8660, -0.8660, 0.8660], abs=1e-4)
    adv = outcome_advantages(torch.tensor([0.5, 0.25, 0.0]), GRPOConfig())
    assert adv.tolist() == pytest.approx([1.0, 0.0, -1.0], abs=1e-5)  # mean .25, std .25


def test_all_equal_groups_zero_for_grpo_dropped_for_dapo() -> None:
    equal = torch.tensor([0.3, 0.3, 0.3])
    assert outcome_advantages(equal, GRPOConfig()).tolist() == [0.0, 0.0, 0.0]
    assert outcome_advantages(equal, GRPOConfig(algo="dapo")) is None
    assert outcome_advantages(torch.tensor([0.0, 0.0, 1.0]), GRPOConfig(algo="dapo")) is not None


def test_invalid_action_penalty_return_and_step_modes(tiny_policy) -> None:  # noqa: ANN001
    a = _traj(tiny_policy, ["take knife", "open fridge", "take knife"], 1.0, ["none", "invalid", "format"], False)
    b = _traj(tiny_policy, ["take knife", "open fridge"], 1.0, ["repeat", "none"], False)
    off = GRPOConfig()
    assert group_returns([a, b], off).tolist() == [1.0, 1.0] and step_penalties(a, off) == [0.0, 0.0, 0.0]
    ret = GRPOConfig(invalid_penalty=0.1)  # format + invalid count, repeat does not
    assert group_returns([a, b], ret).tolist() == pytest.approx([0.8, 1.0])
    assert outcome_advantages(group_returns([a, b], ret), ret).tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    step = GRPOConfig(invalid_penalty=0.1, penalty_mode="step", penalty_signals=["invalid", "repeat"])
    assert group_returns([a, b], step).tolist() == [1.0, 1.0]
    assert step_penalties(a, step) == [0.0, -0.1, 0.0] and step_penalties(b, step) == [-0.1, 0.0]


def test_outcome_advantage_broadcast_to_every_reply_token(tiny_policy) -> None:  # noqa: ANN001
    traj = _traj(tiny_policy, ["take knife", "open fridge", "take apple"], signals=["none", "invalid", "none"])
    cfg = GRPOConfig(invalid_penalty=0.5, penalty_mode="step")
    samples = outcome_samples(tiny_policy.renderer, traj, 0, 1.25, cfg, 20, 4096)
    assert len(samples) == 1  # full-history window: the trajectory is one packed row
    batch = collate(samples, tiny_policy.pad_id)
    mask = batch["action_mask"][0].bool()
    (a1, b1), (a2, b2), (a3, b3) = samples[0].spans
    adv = batch["adv"][0]
    assert torch.all(adv[a1:b1] == 1.25) and torch.all(adv[a2:b2] == 0.75) and torch.all(adv[a3:b3] == 1.25)
    assert torch.all(adv[~mask] == 0)
    behaviour = [lp for s in traj.steps for lp in s.logprobs]
    assert batch["old_logp"][0][mask].tolist() == pytest.approx(behaviour)
    # π_ref = the same weights: its log-probs of the reply tokens equal the behaviour log-probs (ratio 1)
    add_ref_logprobs(tiny_policy.model, samples, tiny_policy.pad_id, 4)
    assert samples[0].token_labels["ref_logp"] == pytest.approx(behaviour, abs=1e-4)


def test_missing_behaviour_logprobs_are_an_error(tiny_policy) -> None:  # noqa: ANN001
    traj = _traj(tiny_policy, ["take knife"], with_logprobs=False)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        outcome_samples(tiny_policy.renderer, traj, 0, 1.0, GRPOConfig(), 20, 4096)


# ------------------------------------------------------------------------------------------- the loss


class _FreeLogits(torch.nn.Module):
    """A 'model' whose logits are free parameters, so each position's gradient can be read off."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.z)


def _clip_batch(ratios: list[float], advs: list[float]) -> tuple[_FreeLogits, dict]:
    torch.manual_seed(0)
    ids = torch.tensor([[0, 1, 2, 3]])
    model = _FreeLogits(torch.randn(1, 4, 5))
    logp = torch.log_softmax(model.z.detach(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    old = torch.zeros(1, 4)
    old[0, 1:] = logp - torch.log(torch.tensor(ratios))
    adv = torch.zeros(1, 4)
    adv[0, 1:] = torch.tensor(advs)
    batch = {"input_ids": ids, "attention_mask": torch.ones(1, 4), "action_mask": torch.tensor([[0.0, 1, 1, 1]]),
             "old_logp": old, "adv": adv, "ref_logp": old.clone()}
    return model, batch


@pytest.mark.parametrize("algo, inside", [("grpo", [False, False, False]), ("dapo", [False, True, False])])
def test_clip_sides_zero_gradient_outside_the_band(algo: str, inside: list[bool]) -> None:
    # token 1: ratio 1.5, A>0 (above 1+eps_high for both); token 2: ratio 1.25, A>0 (inside only for DAPO's 0.28);
    # token 3: ratio 0.7, A<0 (below 1-eps_low = 0.8): clipped on the side its advantage pushes towards.
    model, batch = _clip_batch([1.5, 1.25, 0.7], [1.0, 1.0, -1.0])
    loss, stats = grpo_loss(GRPOConfig(algo=algo, beta_kl=0.0))(model, batch)
    loss.backward()
    grads = [float(model.z.grad[0, j].abs().sum()) for j in range(3)]  # logits at j predict token j+1
    assert [g > 0 for g in grads] == inside
    assert stats["clip_frac_high"] == pytest.approx((2 if algo == "grpo" else 1) / 3)
    assert stats["clip_frac_low"] == pytest.approx(1 / 3)
    # inside the band the other way round: gradient flows on every token
    model, batch = _clip_batch([1.1, 0.9, 1.0], [1.0, -1.0, 1.0])
    grpo_loss(GRPOConfig(algo=algo, beta_kl=0.0))(model, batch)[0].backward()
    assert all(float(model.z.grad[0, j].abs().sum()) > 0 for j in range(3))


def test_kl_term_token_mean_by_hand() -> None:
    model, batch = _clip_batch([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    batch["ref_logp"] = batch["old_logp"] - 0.1 * batch["action_mask"]  # log π_ref − log π = −0.1 on every token
    loss, stats = grpo_loss(GRPOConfig(beta_kl=0.5))(model, batch)
    k3 = math.exp(-0.1) + 0.1 - 1.0
    assert stats["kl"] == pytest.approx(k3, rel=1e-4) and float(loss.detach()) == pytest.approx(0.5 * k3, rel=1e-4)
    assert stats["pg_loss"] == pytest.approx(0.0, abs=1e-7) and stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["entropy"] > 0 and stats["tokens"] == 3


# ------------------------------------------------------------------------------------------- the update


def test_one_update_prefers_the_positive_reply(tiny_policy) -> None:  # noqa: ANN001
    policy = copy.deepcopy(tiny_policy)
    good, bad = _traj(policy, ["take knife"], 1.0), _traj(policy, ["open fridge"], 0.0)
    adv = outcome_advantages(group_returns([good, bad], GRPOConfig()), GRPOConfig())
    cfg = GRPOConfig(lr=3e-3, batch_size=2, micro_batch_size=1, beta_kl=0.0)
    samples = [s for k, (t, a) in enumerate(zip([good, bad], adv.tolist(), strict=True))
               for s in outcome_samples(policy.renderer, t, k, a, cfg, 20, 4096)]
    add_ref_logprobs(policy.model, samples, policy.pad_id, 2)
    trainer = PolicyTrainer(policy, RunConfig(), cfg)
    stats = trainer.update(samples, grpo_loss(cfg), seed=0)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # first step is exactly on-policy
    after = [_traj(policy, ["take knife"]), _traj(policy, ["open fridge"])]
    before = [good, bad]
    delta = [sum(sum(s.logprobs) for s in a.steps) - sum(sum(s.logprobs) for s in b.steps)
             for a, b in zip(after, before, strict=True)]
    # Shared tokens (Thought:/Action:) get +A and -A and move little; the margin good - bad must grow.
    assert delta[0] > 0 and delta[0] - delta[1] > 1.0


def test_padding_free_update_gives_the_padded_update(tiny_policy) -> None:  # noqa: ANN001
    """optim.padding_free in GRPO's own update loop: a 6-step trajectory and two 1-step ones in one micro-batch;
    packed, the short two share a row as wide as the long one. Statistics and trained weights equal the padded
    update's."""
    cfg = GRPOConfig(lr=3e-3, batch_size=3, micro_batch_size=3, beta_kl=0.1)
    results = []
    for free in (False, True):
        policy = copy.deepcopy(tiny_policy)
        group = [_traj(policy, ["take knife", "open fridge"] * 3, 1.0), _traj(policy, ["open fridge"], 0.0),
                 _traj(policy, ["take knife"], 0.0)]
        adv = outcome_advantages(group_returns(group, cfg), cfg)
        samples = [s for k, (t, a) in enumerate(zip(group, adv.tolist(), strict=True))
                   for s in outcome_samples(policy.renderer, t, k, a, cfg, 20, 4096)]
        add_ref_logprobs(policy.model, samples, policy.pad_id, 3)
        run_cfg = RunConfig()
        run_cfg.optim.padding_free = free
        trainer = PolicyTrainer(policy, run_cfg, cfg)
        assert len(trainer.collate(samples, policy.pad_id)["input_ids"]) == (2 if free else 3)
        results.append((trainer.update(samples, grpo_loss(cfg), seed=0), [p.detach().clone() for p in
                                                                          policy.model.parameters()]))
    (stats_pad, w_pad), (stats_free, w_free) = results
    for key in ("loss", "pg_loss", "kl", "tokens", "ratio_mean"):
        assert stats_free[key] == pytest.approx(stats_pad[key], abs=1e-5), key
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(w_pad, w_free, strict=True))


def test_update_forward_runs_in_the_reference_precision(tiny_policy, monkeypatch) -> None:  # noqa: ANN001
    """Every loss forward of the GRPO update runs under placement.autocast(), as the reference and behaviour
    log-probs it is compared with were scored (bf16 where model.dtype auto finds bf16 hardware)."""
    import contextlib

    from agentevo.algorithms.grpo import recipe as grpo_recipe

    entered = []

    @contextlib.contextmanager
    def recorder():  # noqa: ANN202
        entered.append(1)
        yield

    policy = copy.deepcopy(tiny_policy)
    cfg = GRPOConfig(lr=1e-3, batch_size=2, micro_batch_size=1)
    samples = [s for k, a in enumerate(["take knife", "open fridge"])
               for s in outcome_samples(policy.renderer, _traj(policy, [a], 1.0), k, 1.0, cfg, 20, 4096)]
    add_ref_logprobs(policy.model, samples, policy.pad_id, 2)
    trainer = PolicyTrainer(policy, RunConfig(), cfg)
    monkeypatch.setattr(grpo_recipe.placement, "autocast", recorder)
    trainer.update(samples, grpo_loss(cfg), seed=0)
    assert len(entered) == 2  # one optimiser batch of two micro-batches


def test_trainer_checkpoint_round_trip(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    policy = copy.deepcopy(tiny_policy)
    cfg = GRPOConfig(lr=1e-3, batch_size=1, micro_batch_size=1)
    traj = _traj(policy, ["take knife"], 1.0)
    samples = outcome_samples(policy.renderer, traj, 0, 1.0, cfg, 20, 4096)
    add_ref_logprobs(policy.model, samples, policy.pad_id, 1)
    trainer = PolicyTrainer(policy, RunConfig(), cfg)
    trainer.update(samples, grpo_loss(cfg), seed=0)
    trainer.save(tmp_path / "latest", {"update": 3})
    assert not (tmp_path / "latest.tmp").exists()
    other = PolicyTrainer(copy.deepcopy(tiny_policy), RunConfig(), cfg)
    assert other.restore(tmp_path / "nothing") is None
    assert other.restore(tmp_path / "latest") == {"update": 3}
    for a, b in zip(trainer.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = trainer.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    # a kill between the save's two renames leaves latest.old and no latest: restore finds the previous save
    (tmp_path / "latest").rename(tmp_path / "latest.old")
    assert PolicyTrainer(copy.deepcopy(tiny_policy), RunConfig(), cfg).restore(tmp_path / "latest") == {"update": 3}


# ------------------------------------------------------------------------------------------- end to end


SMOKE = [
    "env.n_train=3", "env.n_test=2", "env.params={max_steps: 4}", "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.intermediate_size=128", "agent.max_new_tokens=16",
    "agent.history_window=4", "optim.epochs=1", "optim.batch_size=4", "optim.micro_batch_size=4",
    "rollout.n_parallel=2", "rollout.batch_size=4", "grpo.n_updates=1", "grpo.tasks_per_update=1",
    "grpo.group_size=2", "grpo.lr=1.0e-4", "grpo.batch_size=2", "grpo.micro_batch_size=2", "model.torch_threads=1",
]


def test_grpo_recipe_one_update_end_to_end(tmp_path) -> None:  # noqa: ANN001
    import json

    from agentevo.algorithms.grpo.recipe import run as grpo_run
    from agentevo.run import Run

    cfg = load_config(None, SMOKE, method="grpo", name="g", output_dir=str(tmp_path))
    r = Run.create(cfg, quiet=True)
    try:
        results = grpo_run(r)
    finally:
        r.close()
    update = results["update-1"]
    assert update["groups"] == 1 and update["rollout_n"] == 2 and update["samples"] >= 2
    assert update["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy: behaviour log-probs = π_old
    assert results["eval/update-1"]["test"]["train_env_steps"] == update["train_env_steps"]
    assert json.loads((tmp_path / "g/checkpoints/latest/state.json").read_text())["update"] == 1
    assert (tmp_path / "g/checkpoints/update-1/config.json").exists()
    assert (tmp_path / "g/plots/success_vs_env_steps.png").exists()
    phases = [json.loads(x)["phase"] for x in (tmp_path / "g/metrics.jsonl").read_text().splitlines()]
    assert "grpo/update" in phases and "eval/update-1/test" in phases
    # a resumed run finds every phase done and returns the same record without playing again
    r = Run.open(tmp_path / "g", quiet=True)
    n = r.store.count()
    try:
        again = grpo_run(r)
        assert again["update-1"] == update and r.store.count() == n
    finally:
        r.close()


def test_on_policy_rollouts_follow_the_backend(tmp_path) -> None:  # noqa: ANN001
    """transformers: the trained model itself; vLLM: each update's weights exported and refreshed; HTTP: refused."""
    from types import SimpleNamespace

    from agentevo.algorithms.grpo.recipe import acting_policy, check_on_policy_backend
    from agentevo.errors import ConfigError

    calls: list[tuple[str, object]] = []

    class FakeRun:
        def __init__(self, backend: str) -> None:
            self.cfg = SimpleNamespace(model=SimpleNamespace(backend=backend), method="grpo")

        def checkpoint_dir(self, name: str):  # noqa: ANN202
            return tmp_path / name

        def rollout_policy(self, name: str, policy_id: str) -> str:
            calls.append(("load", (name, policy_id)))
            return f"engine:{policy_id}"

    trainer = SimpleNamespace(policy="in-memory", export=lambda path: calls.append(("export", path)))
    assert acting_policy(FakeRun("transformers"), trainer, 3) == "in-memory" and calls == []
    assert acting_policy(FakeRun("vllm"), trainer, 1) == "engine:bc"
    assert calls == [("load", ("bc", "bc"))]  # update 1 rolls out pi_0 = the BC checkpoint, nothing to export
    calls.clear()
    assert acting_policy(FakeRun("vllm"), trainer, 3) == "engine:update-2"
    assert calls == [("export", tmp_path / "rollout"), ("load", ("rollout", "update-2"))]
    calls.clear()
    (tmp_path / "update-2").mkdir()  # update 2 was evaluated: its export holds the same weights
    assert acting_policy(FakeRun("vllm"), trainer, 3) == "engine:update-2"
    assert calls == [("load", ("update-2", "update-2"))]
    check_on_policy_backend(FakeRun("vllm"))
    with pytest.raises(ConfigError, match="grpo rolls out with the policy it is training, but model.backend: http"):
        check_on_policy_backend(FakeRun("http"))


def test_group_diagnostics_separates_solved_groups_from_starved_ones(tiny_policy) -> None:  # noqa: ANN001
    def group(*rewards: float) -> list[Trajectory]:
        return [_traj(tiny_policy, ["look"], reward=r, with_logprobs=False) for r in rewards]

    groups = [group(1.0, 1.0), group(0.0, 0.0), group(1.0, 0.0), group(1.0, 1.0)]
    assert group_diagnostics(groups, GRPOConfig()) == {"zero_var_frac": 0.75, "zero_var_won_frac": 0.5}
    # a return penalty makes a won group unequal when one episode was flagged: it carries signal again
    flagged = [_traj(tiny_policy, ["look"], 1.0, signals=["invalid"], with_logprobs=False), group(1.0)[0]]
    got = group_diagnostics([flagged], GRPOConfig(invalid_penalty=0.1, penalty_mode="return"))
    assert got == {"zero_var_frac": 0.0, "zero_var_won_frac": 0.0}
    assert group_diagnostics([], GRPOConfig()) == {}
