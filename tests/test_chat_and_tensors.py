"""Chat rendering with spliced reply ids, the loss mask, packing, and action parsing."""

from __future__ import annotations

import torch

from agentevo.agent.chat import ChatRenderer, Message
from agentevo.agent.prompt import HistoryTurn, build_messages, expert_reply, parse_action
from agentevo.data.tensors import collate, pad_sequences, step_prompt_ids, trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task


def _traj(renderer: ChatRenderer, replies: list[str]) -> Trajectory:
    task = Task("twx-cookingworld", "t0", "train", "cookingworld", {}, 20)
    steps = []
    obs = "Your task is to cook a meal.\nYou are in the kitchen."
    for t, text in enumerate(replies, start=1):
        nxt = f"You did thing {t}."
        steps.append(Step(t, obs, text, renderer.encode_reply(text), None, parse_action(text), nxt, 0.0, False))
        obs = nxt
    return Trajectory(task, "expert", "expert", "Instruction.", steps, 0.0, False, goal="cook a meal")


def test_parse_action() -> None:
    assert parse_action("Thought: x\nAction: take knife") == "take knife"
    assert parse_action("Action: open fridge\nmore text") == "open fridge"
    assert parse_action("Action: a\nAction: b") == "b"
    assert parse_action("Thought: only thinking") is None
    assert parse_action("Action:   ") is None


def test_expert_reply_format() -> None:
    assert expert_reply("take knife") == "Thought: I need the knife.\nAction: take knife"
    assert expert_reply("take knife", "none") == "Action: take knife"
    assert parse_action(expert_reply("cook red apple in oven")) == "cook red apple in oven"


def test_assistant_spans_hold_exactly_the_stored_ids(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    a1 = [5, 6, 7, r.end_of_turn_id]
    a2 = [8, 9]  # a reply cut by the token budget: no end-of-turn token of its own
    rendered = r.render(
        [Message("user", "hi"), Message("assistant", ids=a1), Message("user", "obs"), Message("assistant", ids=a2),
         Message("user", "next")],
        add_generation_prompt=True,
    )
    (s1, e1), (s2, e2) = rendered.assistant_spans
    assert rendered.ids[s1:e1] == a1 and rendered.ids[s2:e2] == a2
    # the turn ended by a1's own end token is not ended twice; a2's turn is closed by the template
    assert rendered.ids[e1] != r.end_of_turn_id
    assert rendered.ids[e2] == r.end_of_turn_id
    assert r.end_of_turn_id in r.stop_ids


def test_default_template_for_tokenizers_without_one(tiny_policy) -> None:  # noqa: ANN001
    import copy

    tok = copy.deepcopy(tiny_policy.tokenizer)
    tok.chat_template = None
    r = ChatRenderer(tok)
    assert r.end_of_turn_id == tok.eos_token_id
    out = r.render([Message("user", "hello"), Message("assistant", ids=[11, 12, tok.eos_token_id])], False)
    assert out.ids[slice(*out.assistant_spans[0])] == [11, 12, tok.eos_token_id]


def test_history_window_keeps_goal_and_last_turns() -> None:
    hist = [HistoryTurn([1], f"obs {k}") for k in range(1, 6)]
    msgs = build_messages("I.", "cook", "first", hist, window=2)
    assert msgs[0].text.startswith("I.\n\nGoal: cook\n(3 earlier steps omitted.)\nObservation: obs 3")
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[-1].text == "Observation: obs 5"
    full = build_messages("I.", "cook", "first", hist, window=10)
    assert full[0].text == "I.\n\nfirst" and len(full) == 11


def test_loss_mask_covers_exactly_the_reply_tokens(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, [expert_reply("take knife"), expert_reply("open fridge"), expert_reply("take apple")])
    for pack, window in ((True, 10), (False, 10), (False, 1)):
        samples = trajectory_samples(r, traj, 0, window, 4096, pack=pack)
        assert len(samples) == (1 if pack else 3)
        batch = collate(samples, tiny_policy.pad_id)
        for row, sample in enumerate(samples):
            masked = [i for i, m in enumerate(batch["action_mask"][row].tolist()) if m]
            expected = [i for s, e in sample.spans for i in range(s, e)]
            assert masked == expected
            ids = batch["input_ids"][row].tolist()
            got = [[ids[i] for i in range(s, e)] for s, e in sample.spans]
            assert got == [traj.steps[t - 1].action_ids for t in sample.steps]
            for (s, _), t in zip(sample.spans, sample.steps, strict=True):
                if not pack:
                    assert ids[:s] == step_prompt_ids(r, traj, t, window)[-s:]
                assert batch["step_id"][row, s].item() == t
    # packed and unpacked rows put each reply in the same context
    packed = trajectory_samples(r, traj, 0, 10, 4096, pack=True)[0]
    for (s, _), t in zip(packed.spans, packed.steps, strict=True):
        assert packed.input_ids[:s] == step_prompt_ids(r, traj, t, 10)


def test_windowed_history_is_not_packed(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, [expert_reply("take knife")] * 4)
    assert len(trajectory_samples(r, traj, 0, 1, 4096, pack=True)) == 4


def test_step_labels_broadcast_to_reply_tokens(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, [expert_reply("take knife"), expert_reply("open fridge")])
    sample = trajectory_samples(r, traj, 0, 10, 4096)[0]
    sample.labels["adv"] = [0.5, -1.0]
    batch = collate([sample], tiny_policy.pad_id)
    (s1, e1), (s2, e2) = sample.spans
    adv = batch["adv"][0]
    assert torch.all(adv[s1:e1] == 0.5) and torch.all(adv[s2:e2] == -1.0)
    assert adv.abs().sum().item() == 0.5 * (e1 - s1) + 1.0 * (e2 - s2)


def test_pad_sequences_right_and_left() -> None:
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=9, left=True)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
