"""ETO: preference pairs (truncation, wins, ties), DPO through the pair batching, a DPO step, and a smoke run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.eto import (
    PreferencePair,
    collate_pairs,
    dpo_loss_fn,
    fill_reference,
    preference_pairs,
    sequence_logps,
    trajectory_rows,
)
from agentevo.config import OptimConfig
from agentevo.data.tensors import StepSample
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.train.loop import train


def _traj(task_id: str, actions: list[str], reward: float, source: str = "self", renderer=None) -> Trajectory:  # noqa: ANN001
    task = Task("twx-cookingworld", task_id, "train", "cookingworld", {}, 20)
    steps = []
    for t, action in enumerate(actions, start=1):
        text = expert_reply(action)
        ids = renderer.encode_reply(text) if renderer is not None else []
        steps.append(Step(t, f"obs {task_id} {t}", text, ids, None, parse_action(text), f"after {action}", 0.0,
                          t == len(actions)))
    return Trajectory(task, source, source, "Instruction.", steps, reward, reward >= 1.0, goal="cook")


def test_preference_pairs_truncate_losers_keep_winners_and_drop_ties() -> None:
    expert = {
        "a": _traj("a", ["take knife", "open fridge", "eat meal"], 1.0, "expert"),
        "b": _traj("b", ["take knife", "eat meal"], 1.0, "expert"),
        "c": _traj("c", ["take knife", "eat meal"], 0.5, "expert"),
        "e": _traj("e", ["take knife", "open fridge", "eat meal"], 1.0, "expert"),
    }
    agent = [
        _traj("a", [f"move north {k}" for k in range(10)], 0.0),  # loses: cut to 3 + 5 = 8 turns
        _traj("b", ["take knife", "open fridge", "eat meal", "look around"], 1.0),  # tie: dropped
        _traj("c", ["take knife", "open fridge", "read cookbook", "eat meal", "prepare meal"], 1.0),  # wins
        _traj("d", ["look around"], 0.0),  # no expert for this task
        _traj("e", ["look around", "inventory"], 0.0),  # loses, already shorter than the cut
    ]
    pairs, counts = preference_pairs(expert, agent, extra_turns=5)
    assert counts == {"win": 1, "tie": 1, "lose": 2, "no_expert": 1}
    by_task = {p.task_id: p for p in pairs}
    assert set(by_task) == {"a", "c", "e"}
    a = by_task["a"]
    assert a.kind == "lose" and a.chosen is expert["a"] and a.rejected.length == 8
    assert [s.parsed_action for s in a.rejected.steps] == [f"move north {k}" for k in range(8)]
    assert agent[0].length == 10  # the stored trajectory is not modified
    c = by_task["c"]
    assert c.kind == "win" and c.chosen is agent[2] and c.rejected is expert["c"] and c.chosen.length == 5
    assert by_task["e"].rejected.length == 2
    uncut, _ = preference_pairs(expert, agent, extra_turns=None)  # ALFWorld: never cut
    assert {p.task_id: p.rejected.length for p in uncut}["a"] == 10


class _Bigram(torch.nn.Module):
    """logits at position j = table[input_ids[j]]: log p(y | x) = table[x, y] − logsumexp(table[x])."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


TABLE = [[0.0, 1.0, 2.0, 0.5], [1.5, 0.0, -1.0, 0.0], [0.3, 0.2, 0.1, 2.0], [-0.5, 1.0, 0.0, 0.7]]


def _lp(x: int, y: int) -> float:
    row = TABLE[x]
    return row[y] - math.log(sum(math.exp(v) for v in row))


def _row(ids: list[int], span: tuple[int, int]) -> StepSample:
    return StepSample(ids, [span], 0, [1])


def test_dpo_loss_on_hand_log_probs_through_the_pair_batching() -> None:
    # Pair A: the chosen trajectory spans two rows (a short history window), the rejected one row.
    pair_a = PreferencePair("a", [_row([0, 1, 2], (1, 3)), _row([3, 0, 1], (2, 3))], [_row([2, 2, 3, 1], (2, 4))],
                            ref_chosen=-2.0, ref_rejected=-3.5)
    pair_b = PreferencePair("b", [_row([1, 0], (1, 2))], [_row([0, 3, 3], (1, 3))], ref_chosen=-1.0,
                            ref_rejected=-0.5)
    chosen_a = _lp(0, 1) + _lp(1, 2) + _lp(0, 1)
    rejected_a = _lp(2, 3) + _lp(3, 1)
    chosen_b = _lp(1, 0)
    rejected_b = _lp(0, 3) + _lp(3, 3)
    batch = collate_pairs([pair_a, pair_b], pad_id=0)
    model = _Bigram(TABLE)
    seq = sequence_logps(model, batch)
    assert seq.flatten().tolist() == pytest.approx([chosen_a, rejected_a, chosen_b, rejected_b], abs=1e-5)

    beta = 0.5

    def hand(c: float, r: float, rc: float, rr: float) -> float:
        z = beta * ((c - rc) - (r - rr))
        return math.log(1 + math.exp(-z))

    expected = (hand(chosen_a, rejected_a, -2.0, -3.5) + hand(chosen_b, rejected_b, -1.0, -0.5)) / 2
    loss, stats = dpo_loss_fn(beta)(model, batch)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)
    assert stats["reward_accuracy"] == pytest.approx(
        ((chosen_a + 2.0 > rejected_a + 3.5) + (chosen_b + 1.0 > rejected_b + 0.5)) / 2)
    # A small gradient step lowers the loss (the table is shared, so not every pair's margin has to grow).
    loss.backward()
    with torch.no_grad():
        model.table -= 0.1 * model.table.grad
        after, _ = dpo_loss_fn(beta)(model, batch)
    assert float(after) < float(loss.detach()) - 1e-4


def test_reference_is_the_current_policy_and_dpo_training_separates_the_pair(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    import copy

    policy = copy.copy(tiny_policy)
    policy.model = copy.deepcopy(tiny_policy.model)
    r = policy.renderer
    chosen = _traj("a", ["take knife", "open fridge"], 1.0, "expert")  # expert text: ids come from the tokenizer
    rejected = _traj("a", ["open fridge", "open fridge", "open fridge"], 0.0, renderer=r)
    pair = PreferencePair("a", trajectory_rows(policy, chosen, 0, 10, 1024), trajectory_rows(policy, rejected, 1, 10, 1024))
    assert chosen.steps[0].action_ids == r.encode_reply(chosen.steps[0].action_text)
    assert len(pair.chosen) == 1 and len(pair.chosen[0].spans) == 2  # packed: one row, one span per reply
    fill_reference(policy.model, [pair], policy.pad_id, 2)
    batch = collate_pairs([pair], policy.pad_id)
    loss, stats = dpo_loss_fn(0.5)(policy.model, batch)
    assert float(loss.detach()) == pytest.approx(math.log(2), abs=1e-4)  # π = π_ref: zero implicit reward margin
    records: list[dict] = []
    cfg = OptimConfig(lr=5e-3, epochs=8, batch_size=1, micro_batch_size=1, warmup_ratio=0.0, save_every=0)
    train(policy.model, [pair], dpo_loss_fn(0.5), cfg, policy.pad_id, tmp_path, seed=0,
          on_step=lambda s, n, rec: records.append(rec), collate_fn=collate_pairs, schedule="constant")
    assert [r["lr"] for r in records] == pytest.approx([5e-3] * 8)  # constant schedule, no warmup
    assert records[-1]["reward_margin"] > records[0]["reward_margin"] + 0.5
    assert records[-1]["loss"] < math.log(2) - 0.1


@pytest.mark.slow
def test_eto_recipe_end_to_end_on_textworld_express(tmp_path) -> None:  # noqa: ANN001
    """A small ETO run: warm start, one exploration, pairs, DPO, evaluation; a rerun resumes without new work."""
    from agentevo.algorithms import eto
    from agentevo.config import load_config
    from agentevo.run import Run

    overrides = [
        "env.n_train=3", "env.n_test=2", "env.params={max_steps: 8}", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.intermediate_size=64",
        "agent.history_window=8", "agent.max_new_tokens=16", "rollout.n_parallel=3", "optim.epochs=1",
        "optim.batch_size=4", "optim.micro_batch_size=2", "eto.n_iters=1", "eto.batch_size=2",
        "eto.micro_batch_size=1", "eto.epochs=1", "eto.lr=1.0e-4",
    ]
    cfg = load_config(None, overrides, method="eto", name="eto", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        results = eto.run(run)
        dpo = results["eto/iter-1"]
        assert dpo["n"] == 3 and dpo["pairs"] == dpo["win"] + dpo["lose"] and dpo["win"] + dpo["tie"] + dpo["lose"] == 3
        assert results["eval/eto-iter-1"]["test"]["n"] == 2
        assert (run.checkpoint_dir("eto-iter-1") / "config.json").exists()
        explored = run.store.load(collection="eto/iter-1/explore")
        steps = sum(1 for t in explored for s in t.steps if s.parsed_action is not None)
        assert results["env_steps"]["explore"] == steps
        assert results["env_steps"]["total"] == steps + results["env_steps"]["expert"]
        before = run.store.count()
        again = eto.run(run)  # every phase is recorded: nothing is played or trained again
        assert run.store.count() == before and again["eval/eto-iter-1"] == results["eval/eto-iter-1"]
    finally:
        run.close()


def test_eto_config_rejects_impossible_values() -> None:
    from agentevo.algorithms.baselines_config import ETOConfig
    from agentevo.errors import ConfigError

    ETOConfig().validate()
    for bad, match in [({"beta": 0.0}, "beta"), ({"batch_size": 5}, "multiple"), ({"schedule": "linear"}, "constant"),
                       ({"rejected_extra_turns": -1}, "rejected_extra_turns"), ({"explore_temperature": 0.0}, "temp")]:
        with pytest.raises(ConfigError, match=match):
            ETOConfig(**bad).validate()
