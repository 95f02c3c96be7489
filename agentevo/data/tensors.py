"""Trajectories to training tensors: one sample per step, the prompt rebuilt exactly as the policy saw it.

The prompt is rendered by the same function the rollout engine uses, with every earlier reply spliced in as
its stored token ids, and the step's own reply appended as the ids the policy produced. The loss mask covers
exactly those reply ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from agentevo.agent.chat import ChatRenderer
from agentevo.agent.prompt import HistoryTurn, build_messages
from agentevo.data.types import Trajectory


@dataclass
class StepSample:
    """One training row: token ids and the [start, end) span of each reply in it, with per-step labels.

    A row holds one step's prompt + reply, or (packed) a whole trajectory whose per-step prompts are exact
    prefixes of each other, so every reply is trained in the very context it was produced in.
    """

    input_ids: list[int]
    spans: list[tuple[int, int]]
    traj_index: int
    steps: list[int]  # the step index t of each span
    behaviour_logprobs: list[float] | None = None  # concatenated over spans (None for expert replies)
    labels: dict[str, list[float]] = field(default_factory=dict)  # one value per span (advantage, weight, ...)
    token_labels: dict[str, list[float]] = field(default_factory=dict)  # per reply token, concatenated

    @property
    def n_action_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)


def step_prompt_ids(
    renderer: ChatRenderer, traj: Trajectory, t: int, window: int, prefix: str = ""
) -> list[int]:
    """Prompt ids for step t (1-based) of a stored trajectory, identical to what the acting policy saw."""
    history = [HistoryTurn(s.action_ids, s.next_obs) for s in traj.steps[: t - 1]]
    messages = build_messages(traj.instruction, traj.goal, traj.first_obs, history, window, prefix=prefix)
    return renderer.render(messages, add_generation_prompt=True).ids


def trajectory_samples(
    renderer: ChatRenderer,
    traj: Trajectory,
    traj_index: int,
    window: int,
    max_length: int,
    prefix: str = "",
    steps: list[int] | None = None,
    pack: bool = True,
) -> list[StepSample]:
    """Training rows for a trajectory's steps (all, or those listed).

    With pack=True and every step's prompt + reply a prefix of the next step's prompt (true whenever the
    history window keeps the whole episode and the template does not rewrite earlier turns), the trajectory
    becomes one row: same tokens, same contexts, a fraction of the compute. Otherwise one row per step,
    prompts longer than max_length cut from the left.
    """
    chosen = [s for s in traj.steps if steps is None or s.t in steps]
    prompts = [step_prompt_ids(renderer, traj, s.t, window, prefix) for s in traj.steps]
    if pack and chosen:
        full = prompts[-1] + list(traj.steps[-1].action_ids)
        is_prefix = all(
            full[: len(p) + len(s.action_ids)] == p + list(s.action_ids) for p, s in zip(prompts, traj.steps, strict=True)
        )
        if is_prefix and len(full) <= max_length:
            spans = [(len(prompts[s.t - 1]), len(prompts[s.t - 1]) + len(s.action_ids)) for s in chosen]
            logprobs = [lp for s in chosen for lp in (s.logprobs or [])]
            return [
                StepSample(
                    input_ids=full,
                    spans=spans,
                    traj_index=traj_index,
                    steps=[s.t for s in chosen],
                    behaviour_logprobs=logprobs if all(s.logprobs for s in chosen) else None,
                )
            ]
    out = []
    for step in chosen:
        prompt = prompts[step.t - 1]
        room = max_length - len(step.action_ids)
        if room < 1:
            raise ValueError(
                f"a reply of {len(step.action_ids)} tokens does not fit optim.max_length={max_length}; raise it"
            )
        prompt = prompt[-room:]
        out.append(
            StepSample(
                input_ids=prompt + list(step.action_ids),
                spans=[(len(prompt), len(prompt) + len(step.action_ids))],
                traj_index=traj_index,
                steps=[step.t],
                behaviour_logprobs=step.logprobs,
            )
        )
    return out


def collate(samples: list[StepSample], pad_id: int) -> dict[str, Any]:
    """Right-padded batch: input_ids, attention_mask, action_mask (1 on reply tokens), step_id (t on reply
    tokens, -1 elsewhere), per-step labels broadcast to their reply tokens, per-token labels."""
    width = max(len(s.input_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    action_mask = torch.zeros((n, width), dtype=torch.float32)
    step_id = torch.full((n, width), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        input_ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        attention[row, : len(s.input_ids)] = 1
        for (start, end), t in zip(s.spans, s.steps, strict=True):
            action_mask[row, start:end] = 1.0
            step_id[row, start:end] = t
    batch: dict[str, Any] = {
        "input_ids": input_ids, "attention_mask": attention, "action_mask": action_mask, "step_id": step_id,
    }
    for key in sorted({k for s in samples for k in s.labels}):
        values = torch.zeros((n, width), dtype=torch.float32)
        for row, s in enumerate(samples):
            for (start, end), v in zip(s.spans, s.labels.get(key, [0.0] * len(s.spans)), strict=True):
                values[row, start:end] = v
        batch[key] = values
    for key in sorted({k for s in samples for k in s.token_labels}):
        values = torch.zeros((n, width), dtype=torch.float32)
        for row, s in enumerate(samples):
            labels = s.token_labels.get(key)
            if labels is None:
                continue
            flat = torch.tensor(labels, dtype=torch.float32)
            offset = 0
            for start, end in s.spans:
                values[row, start:end] = flat[offset : offset + end - start]
                offset += end - start
        batch[key] = values
    return batch


def reply_logprobs(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every token given its prefix, aligned to input positions (column 0 is 0), and the reply mask.
    The forward runs under placement.autocast(), as training forwards and generation do, so log-probs scored here
    (Q-Evolve's pi_old and pi_BC, GRPO's reference) are in the precision the loss compares them with: with
    model.dtype auto on bf16 hardware a float32 score would start every ratio and KL off 1 and 0 by rounding."""
    from agentevo.algorithms.losses import token_logprobs
    from agentevo.models import placement

    with placement.autocast():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    picked = token_logprobs(logits, batch["input_ids"])
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1), batch["action_mask"]
