"""Q-Evolve's critic: readout positions, causality, the weighted-IQL losses, update order, Polyak, LoRA sharing."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.data.tensors import step_prompt_ids
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.models.critic import (
    Critic,
    CriticFit,
    CriticItem,
    add_critic_adapter,
    collate_critic,
    critic_rows,
    critic_values,
    fit_critic,
    load_critic_weights,
    q_loss,
    render_full_trajectory,
    save_critic,
    value_loss,
)


def _traj(renderer, actions: list[str], obs_tag: str = "o") -> Trajectory:  # noqa: ANN001
    task = Task("twx-cookingworld", "t0", "train", "cookingworld", {}, 20)
    steps = []
    for t, action in enumerate(actions, start=1):
        text = expert_reply(action)
        steps.append(Step(t, f"{obs_tag} {t} kitchen", text, renderer.encode_reply(text), None, parse_action(text),
                          f"{obs_tag} {t + 1} kitchen", 0.0, t == len(actions)))
    return Trajectory(task, "expert", "expert", "Your task is to cook a meal.", steps, 1.0, True, goal="cook")


def _critic(policy, width: int = 8, seed: int = 0) -> Critic:  # noqa: ANN001
    return Critic(copy.deepcopy(policy.model), width, seed=seed)


def _item(renderer, traj, rewards, weights, max_length: int = 4096) -> CriticItem:  # noqa: ANN001
    T = traj.length
    return CriticItem(critic_rows(renderer, traj, max_length, 50), rewards, [False] * (T - 1) + [True], weights)


def test_readout_positions_are_the_prompt_ends_and_reply_ends(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge", "take carrot"])
    (row,) = critic_rows(r, traj, 4096, 50)
    ids = row.input_ids
    assert row.v_steps == [1, 2, 3, 4] and row.q_steps == [1, 2, 3]
    for t in range(1, 5):
        # V_t is read at the last token of exactly the prompt the policy saw at step t (full history)
        prompt = step_prompt_ids(r, traj, t, 50)
        assert ids[: row.v_pos[t - 1] + 1] == prompt
    for t, step in enumerate(traj.steps, start=1):
        end = row.q_pos[t - 1]
        assert ids[end - len(step.action_ids) + 1 : end + 1] == step.action_ids  # Q_t: last token of a_t
        assert row.v_pos[t - 1] == end - len(step.action_ids)  # V_t: the token just before a_t starts
    assert row.v_pos[-1] == len(ids) - 1 and ids == render_full_trajectory(r, traj).ids


def test_v_t_does_not_see_a_t(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    a = _traj(r, ["take knife", "open fridge", "take carrot"])
    b = copy.deepcopy(a)
    # same length, different tokens for a_2
    b.steps[1].action_ids = list(reversed(a.steps[1].action_ids[:-1])) + a.steps[1].action_ids[-1:]
    assert b.steps[1].action_ids != a.steps[1].action_ids
    critic = _critic(tiny_policy)
    va, vb = critic_values(critic, [_item(r, a, [0.0] * 3, [1.0] * 3), _item(r, b, [0.0] * 3, [1.0] * 3)],
                           tiny_policy.pad_id)
    assert torch.allclose(torch.tensor(va["v"][:2]), torch.tensor(vb["v"][:2]), atol=1e-6)  # V_1, V_2
    assert va["q1"][0] == pytest.approx(vb["q1"][0], abs=1e-6)  # Q_1
    assert abs(va["q1"][1] - vb["q1"][1]) > 1e-6  # Q_2 reads a_2
    assert abs(va["v"][2] - vb["v"][2]) > 1e-6  # V_3 comes after a_2


def test_rows_per_step_when_the_episode_is_too_long(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge", "take carrot"])
    full = render_full_trajectory(r, traj).ids
    rows = critic_rows(r, traj, len(full) - 1, 50)
    assert len(rows) == 4 and [row.v_steps for row in rows] == [[1], [2], [3], [4]]
    assert rows[-1].q_pos == [] and len(rows[-1].input_ids) == len(full) - 1  # cut from the left
    critic = _critic(tiny_policy)
    packed, split = critic_values(
        critic, [_item(r, traj, [0.0] * 3, [1.0] * 3), _item(r, traj, [0.0] * 3, [1.0] * 3, len(full) - 1)],
        tiny_policy.pad_id,
    )
    # uncut rows give the same values as the packed row (same prefixes, causal attention)
    assert torch.allclose(torch.tensor(packed["v"][:3]), torch.tensor(split["v"][:3]), atol=1e-5)
    assert torch.allclose(torch.tensor(packed["q2"]), torch.tensor(split["q2"]), atol=1e-5)


def test_collate_indices(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    a = _item(r, _traj(r, ["take knife", "open fridge"]), [0.0, 1.0], [0.75, 1.0])
    b = _item(r, _traj(r, ["take knife", "open fridge", "eat meal"]), [-0.1, 0.0, 0.0], [0.6, 0.8, 1.0])
    batch = collate_critic([a, b], tiny_policy.pad_id)
    assert batch["v_rows"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert batch["v_cols"].tolist() == a.rows[0].v_pos + b.rows[0].v_pos
    assert batch["q_cols"].tolist() == a.rows[0].q_pos + b.rows[0].q_pos
    assert batch["v_cur"].tolist() == [0, 1, 3, 4, 5] and batch["v_next"].tolist() == [1, 2, 4, 5, 6]
    assert batch["dones"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert batch["weights"].tolist() == pytest.approx([0.75, 1.0, 0.6, 0.8, 1.0])


def _fake_out_batch() -> tuple[dict, dict]:
    # one trajectory, T = 2: V(s_1..s_3), Q heads and target heads at t = 1, 2
    v = torch.tensor([0.5, 0.2, 9.0], requires_grad=True)
    out = {"v": v, "q": torch.tensor([[0.4, 1.0], [0.6, 0.7]], requires_grad=True),
           "q_target": torch.tensor([[1.0, 0.0], [0.8, 0.3]])}
    batch = {"v_cur": torch.tensor([0, 1]), "v_next": torch.tensor([1, 2]), "rewards": torch.tensor([-0.1, 1.0]),
             "dones": torch.tensor([0.0, 1.0]), "weights": torch.tensor([0.75, 1.5])}
    return out, batch


def test_value_loss_is_the_weighted_expectile_against_min_target_q() -> None:
    out, batch = _fake_out_batch()
    # min Q̄ = [0.8, 0.0]; residuals 0.8 − 0.5 = 0.3 (weight τ) and 0.0 − 0.2 = −0.2 (weight 1 − τ)
    expected = (0.75 * 0.7 * 0.09 + 1.5 * 0.3 * 0.04) / (0.75 + 1.5)
    loss = value_loss(out, batch, tau=0.7)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert out["q"].grad is None  # the online Q heads play no part in L_V


def test_q_loss_uses_weighted_bellman_targets_with_v_detached() -> None:
    out, batch = _fake_out_batch()
    # y_1 = −0.1 + 0.9·V(s_2) = 0.08; y_2 = 1.0 (terminal: V(s_3) = 9 must not enter)
    y = [-0.1 + 0.9 * 0.2, 1.0]
    q = [[0.4, 1.0], [0.6, 0.7]]
    per_step = [sum((y[t] - q[i][t]) ** 2 for i in range(2)) for t in range(2)]
    expected = (0.75 * per_step[0] + 1.5 * per_step[1]) / 2.25
    loss = q_loss(out, batch, gamma=0.9)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert out["v"].grad is None or float(out["v"].grad.abs().sum()) == 0.0
    # unweighted (w/o W-IQL) is the plain mean over steps
    batch["weights"] = torch.ones(2)
    assert float(q_loss(out, batch, gamma=0.9).detach()) == pytest.approx(sum(per_step) / 2, rel=1e-6)


def test_polyak_moves_only_the_target_heads(tiny_policy) -> None:  # noqa: ANN001
    critic = _critic(tiny_policy)
    with torch.no_grad():
        for p in critic.q_heads.parameters():
            p.add_(1.0)
    before = copy.deepcopy(critic.state_dict())
    critic.polyak(0.25)
    after = critic.state_dict()
    for name, value in after.items():
        if name.startswith("target_q_heads."):
            online = before[name.replace("target_q_heads.", "q_heads.")]
            assert torch.allclose(value, 0.75 * before[name] + 0.25 * online, atol=1e-6), name
            assert not torch.allclose(value, before[name])
        else:
            assert torch.equal(value, before[name]), name  # backbone, V head and online Q heads untouched
    assert all(not p.requires_grad for p in critic.target_q_heads.parameters())
    assert not any(p is t for p in critic.trainable_parameters() for t in critic.target_q_heads.parameters())


class _Recording(Critic):
    """Keeps a copy of the V head and Q head weights at every forward pass."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, batch):  # noqa: ANN001, ANN201
        self.seen.append((self.v_head[0].weight.detach().clone(), self.q_heads[0][0].weight.detach().clone()))
        return super().forward(batch)


def test_update_order_v_step_then_q_step_then_polyak(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    items = [_item(r, _traj(r, ["take knife", "open fridge"]), [0.0, 1.0], [0.75, 1.5])]
    critic = _Recording(copy.deepcopy(tiny_policy.model), 8)
    v0, q0 = critic.seen_init = (critic.v_head[0].weight.detach().clone(), critic.q_heads[0][0].weight.detach().clone())
    target0 = copy.deepcopy(critic.target_q_heads.state_dict())
    fit = CriticFit(tau=0.7, gamma=0.9, polyak=0.1, lr=1e-2, epochs=1, batch_size=1, micro_batch_size=1)
    records = []
    fit_critic(critic, items, fit, tiny_policy.pad_id, seed=0, on_step=lambda s, rec: records.append(rec))
    assert len(critic.seen) == 2 and len(records) == 1  # one minibatch: a V pass, then a Q pass
    (v_a, q_a), (v_b, q_b) = critic.seen
    assert torch.equal(v_a, v0) and torch.equal(q_a, q0)
    assert not torch.equal(v_b, v0) and torch.equal(q_b, q0)  # V moved before the Q pass; Q not yet
    assert torch.equal(critic.v_head[0].weight, v_b)  # the Q step leaves the V head alone
    assert not torch.equal(critic.q_heads[0][0].weight, q0)
    for name, value in critic.target_q_heads.state_dict().items():  # Polyak after both steps, with the new Q
        assert torch.allclose(value, 0.9 * target0[name] + 0.1 * critic.q_heads.state_dict()[name], atol=1e-6)
    assert records[0]["loss_v"] > 0 and records[0]["loss_q"] > 0


def test_weights_change_the_fitted_critic(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge"])
    fit = CriticFit(lr=1e-2, epochs=1, batch_size=1, micro_batch_size=1)
    results = []
    for w in ([1.0, 1.0], [0.5, 2.0]):
        critic = _critic(tiny_policy)
        fit_critic(critic, [_item(r, traj, [0.0, 1.0], w)], fit, tiny_policy.pad_id, seed=0)
        results.append(critic_values(critic, [_item(r, traj, [0.0, 1.0], w)], tiny_policy.pad_id)[0]["v"])
    assert results[0] != pytest.approx(results[1], abs=1e-6)


def test_micro_batches_give_the_same_step_as_one_batch(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    items = [_item(r, _traj(r, ["take knife", "open fridge"]), [0.0, 1.0], [0.75, 1.5]),
             _item(r, _traj(r, ["take knife", "open fridge", "eat meal"], "p"), [0.0, 0.0, 0.0], [0.6, 0.8, 1.0])]
    out = []
    for micro in (2, 1):
        critic = _critic(tiny_policy)
        fit = CriticFit(lr=1e-2, epochs=1, batch_size=2, micro_batch_size=micro, grad_clip=0.0)
        fit_critic(critic, items, fit, tiny_policy.pad_id, seed=0)
        out.append(critic.v_head[0].weight.detach().clone())
    assert torch.allclose(out[0], out[1], atol=1e-5)


def test_save_load_and_score(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge"])
    item = _item(r, traj, [0.0, 1.0], [1.0, 1.0])
    critic = _critic(tiny_policy, seed=3)
    with torch.no_grad():
        for p in critic.q_heads.parameters():
            p.mul_(2.0)
    save_critic(critic, tmp_path / "c", tiny_policy.tokenizer)
    from agentevo.models.backend import load_pretrained

    again = Critic(load_pretrained(tmp_path / "c" / "backbone")[0], 8, seed=9)
    load_critic_weights(again, tmp_path / "c")
    a, b = critic_values(critic, [item], tiny_policy.pad_id)[0], critic_values(again, [item], tiny_policy.pad_id)[0]
    for key in ("v", "q1", "q2", "qbar1"):
        assert a[key] == pytest.approx(b[key], abs=1e-6)
    # score = min_i Q_i at the last token of (prompt + reply): Q_2 of the packed row
    ids = item.rows[0].input_ids[: item.rows[0].q_pos[1] + 1]
    assert float(critic.score([ids], tiny_policy.pad_id)[0]) == pytest.approx(min(a["q1"][1], a["q2"][1]), abs=1e-5)


def test_lora_critic_is_a_second_adapter_on_the_policy_base(tiny_policy) -> None:  # noqa: ANN001
    from peft import LoraConfig, get_peft_model

    r = tiny_policy.renderer
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft = get_peft_model(copy.deepcopy(tiny_policy.model), cfg)
    with torch.no_grad():  # a policy adapter that is not the identity
        for name, p in peft.named_parameters():
            if "lora_B.default" in name:
                p.normal_(0, 0.5)
    add_critic_adapter(peft, cfg, copy_from="default")
    critic = Critic(peft, 8, adapter="critic")
    base = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" not in n}
    policy_adapter = {n: p.detach().clone() for n, p in peft.named_parameters() if ".default." in n}
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all(".critic." in n or n.startswith(("v_head", "q_heads")) for n in trainable)
    item = _item(r, _traj(r, ["take knife", "open fridge"]), [0.0, 1.0], [1.0, 1.0])
    batch = collate_critic([item], tiny_policy.pad_id)
    with torch.no_grad():
        h_critic = critic.features(batch["input_ids"], batch["attention_mask"])
        h_policy = peft.get_base_model().get_decoder()(input_ids=batch["input_ids"],
                                                       attention_mask=batch["attention_mask"]).last_hidden_state
    assert torch.allclose(h_critic, h_policy, atol=1e-5)  # initialised from the policy adapter
    assert peft.active_adapter == "default"  # the critic's forward restores the policy adapter
    fit_critic(critic, [item], CriticFit(lr=1e-2, epochs=1, batch_size=1, micro_batch_size=1),
               tiny_policy.pad_id, seed=0)
    params = dict(peft.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base.items())  # the shared base is untouched
    assert all(torch.equal(params[n], v) for n, v in policy_adapter.items())
    moved = [n for n in params if ".critic." in n and not torch.equal(params[n], params[n.replace(".critic.", ".default.")])]
    assert moved
    assert sum(1 for n in params if "lora_" not in n) == len(base)  # one copy of the base weights


def test_backbone_runs_under_bf16_autocast_when_dtype_auto_and_heads_read_float32(tiny_policy, monkeypatch) -> None:  # noqa: ANN001
    """model.dtype auto on a bf16 CPU: the critic's backbone matmuls run in bf16 (as the policy's training forwards
    do) and the heads read float32 features; with float32 nothing is autocast."""
    from agentevo.models import placement

    critic = _critic(tiny_policy)
    seen: list[torch.dtype] = []
    first_linear = next(m for m in critic.lm.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    ids = torch.tensor([[1, 2, 3, 4]])
    try:
        monkeypatch.setattr(placement, "_read_cpuinfo", lambda: "flags : avx512f amx_bf16 avx512_bf16")
        placement.configure("cpu", "auto")
        h = critic.features(ids, torch.ones_like(ids))
        placement.configure("cpu", "float32")
        h32 = critic.features(ids, torch.ones_like(ids))
    finally:
        placement.configure("auto", "float32")
    assert seen == [torch.bfloat16, torch.float32]
    assert h.dtype == torch.float32 and h32.dtype == torch.float32
    assert torch.allclose(h, h32, atol=0.1) and not torch.equal(h, h32)  # bf16 rounding, same function
