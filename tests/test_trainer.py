"""The training loop: BC lowers the loss, checkpoints are atomic, an interrupted run resumes to the same weights."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.bc import nll_loss
from agentevo.config import OptimConfig
from agentevo.data.tensors import trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.train.loop import _schedule, epoch_end_step, plan_micro_batches, train


def _samples(policy, n: int = 6):  # noqa: ANN001, ANN202
    r = policy.renderer
    out = []
    for k in range(n):
        task = Task("twx-cookingworld", f"t{k}", "train", "cookingworld", {}, 20)
        steps = []
        for t, action in enumerate(["take knife", "open fridge"], start=1):
            text = expert_reply(action)
            steps.append(Step(t, f"obs {k} {t}", text, r.encode_reply(text), None, parse_action(text), "next", 0.0, False))
        traj = Trajectory(task, "expert", "expert", "Instruction.", steps, 1.0, True, goal="g")
        out.extend(trajectory_samples(r, traj, k, 10, 1024))
    return out


def _cfg() -> OptimConfig:
    return OptimConfig(lr=5e-3, epochs=4, batch_size=4, micro_batch_size=2, warmup_ratio=0.1, save_every=1)


def test_schedule_and_plan() -> None:
    assert _schedule(0, 10, 2) == pytest.approx(0.5) and _schedule(1, 10, 2) == pytest.approx(1.0)
    assert _schedule(10, 10, 2) == pytest.approx(0.0)
    plan = plan_micro_batches(6, _cfg(), seed=1)
    assert len(plan) == 12 and all(len(b) == 2 for b in plan)
    assert sorted(i for b in plan[:3] for i in b) == list(range(6))  # each epoch is a permutation
    assert plan == plan_micro_batches(6, _cfg(), seed=1)


def test_bc_lowers_the_loss_and_resume_reproduces_weights(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    samples = _samples(tiny_policy)
    base = copy.deepcopy(tiny_policy.model)

    straight = copy.deepcopy(base)
    losses: list[float] = []
    train(straight, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "a", seed=0,
          on_step=lambda s, n, r: losses.append(r["loss"]))
    assert losses[-1] < losses[0] - 0.5
    assert not (tmp_path / "a" / "last").exists()  # the resumable checkpoint is removed when done

    interrupted = copy.deepcopy(base)

    def crash(step: int, total: int, record: dict) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(interrupted, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "b", seed=0, on_step=crash)
    last = tmp_path / "b" / "last"
    assert (last / "state.json").exists() and not (tmp_path / "b" / "last.tmp").exists()
    resumed = copy.deepcopy(base)
    seen: list[int] = []
    train(resumed, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "b", seed=0,
          on_step=lambda s, n, r: seen.append(s))
    assert seen[0] == 3  # continued after the last checkpoint (step 2)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_snapshots_are_the_model_at_the_end_of_their_epochs(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    """6 samples, batch 4: epoch 1 ends after step ceil(6/4) = 2, epoch 3 after ceil(18/4) = 5 (of 6 steps); each
    snapshot holds the weights as they were right after that step, and training is the same with or without them."""
    from safetensors.torch import load_file

    assert [epoch_end_step(e, 6, 4) for e in (1, 2, 3, 4)] == [2, 3, 5, 6]
    samples = _samples(tiny_policy)
    base = copy.deepcopy(tiny_policy.model)
    model = copy.deepcopy(base)
    at_step: dict[int, dict[str, torch.Tensor]] = {}

    def keep(step: int, total: int, record: dict) -> None:
        at_step[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    snaps = {1: tmp_path / "e1", 3: tmp_path / "e3"}
    train(model, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "w", seed=0, on_step=keep,
          tokenizer=tiny_policy.tokenizer, snapshots=snaps)
    for epoch, step in ((1, 2), (3, 5)):
        saved = load_file(str(snaps[epoch] / "model.safetensors"))
        assert (snaps[epoch] / "tokenizer_config.json").exists()
        for name, value in saved.items():
            assert torch.equal(value, at_step[step][name]), (epoch, name)
    first = load_file(str(snaps[1] / "model.safetensors"))
    assert len(first) > 3 and any(not torch.equal(v, at_step[6][k]) for k, v in first.items())  # not the final model
    plain = copy.deepcopy(base)
    train(plain, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "p", seed=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"snapshot epochs \[5\] past the run's 4 epochs"):
        train(copy.deepcopy(base), samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "x", seed=0,
              snapshots={5: tmp_path / "e5"})
