"""Trajectories to training tensors: one sample per step, the prompt rebuilt exactly as the policy saw it.

The prompt is rendered by the same function the rollout engine uses, with every earlier reply spliced in as
its stored token ids, and the step's own reply appended as the ids the policy produced. The loss mask covers
exactly those reply ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentevo.agent.chat import ChatRenderer
from agentevo.agent.prompt import HistoryTurn, build_messages
from agentevo.data.types import Trajectory
from agentevo.errors import ConfigError


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


def pad_sequences(sequences: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded to the longest sequence (on the right, or the left for generation) and the 0/1 mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[row, cols] = torch.tensor(s, dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask


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
    input_ids, attention = pad_sequences([s.input_ids for s in samples], pad_id)
    n, width = input_ids.shape
    action_mask = torch.zeros((n, width), dtype=torch.float32)
    step_id = torch.full((n, width), -1, dtype=torch.long)
    for row, s in enumerate(samples):
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


def pack_bins(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into rows of at most `width` tokens (longest first, ties by
    index, so the packing is a pure function of the lengths)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            if lengths[i] > width:
                raise ValueError(f"a sample of {lengths[i]} tokens does not fit a packed row of {width}")
            bins.append([i])
            room.append(width - lengths[i])
    return bins


def pack_batch(batch: dict[str, Any], pad_id: int, one_row: bool = False) -> dict[str, Any]:
    """A padded batch (collate's) repacked without padding between samples (`optim.padding_free`).

    Samples are placed end to end in rows as wide as the longest one (pack_bins), so no row is longer than the
    padded batch and a dense masked attention (sdpa, eager) costs no more; with `one_row` all of them go into one
    row, which is what flash-attention's variable-length kernel wants (its cost is per sample, not per row).
    `position_ids` restart at 0 with every sample and the attention mask is dropped, so transformers builds a
    block-diagonal causal mask from them (flash-attention: cumulative lengths) and no token sees another sample.
    Each row's free tail is filled with pad tokens whose positions also restart at 0: a segment of its own that no
    sample attends to and no loss counts. Every other [n, width] tensor moves with its tokens (padding: step_id -1,
    the rest 0); per-token sums and token means are unchanged, per-row reductions are not (the callers refuse
    per-sequence loss aggregation with padding_free).
    """
    attention = batch["attention_mask"]
    lengths = [int(n) for n in attention.sum(dim=1).tolist()]
    width = sum(lengths) if one_row else attention.shape[1]
    bins = [list(range(len(lengths)))] if one_row else pack_bins(lengths, width)
    fill = {"input_ids": pad_id, "step_id": -1}
    keys = [k for k, v in batch.items() if k != "attention_mask" and isinstance(v, torch.Tensor)
            and v.shape[:2] == attention.shape]
    out: dict[str, Any] = {k: v for k, v in batch.items() if k not in keys and k != "attention_mask"}
    for key in keys:
        src = batch[key]
        packed = torch.full((len(bins), width), fill.get(key, 0), dtype=src.dtype)
        for row, members in enumerate(bins):
            offset = 0
            for i in members:
                packed[row, offset : offset + lengths[i]] = src[i, : lengths[i]]
                offset += lengths[i]
        out[key] = packed
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    for row, members in enumerate(bins):
        offset = 0
        for n in [lengths[i] for i in members] + [width - sum(lengths[i] for i in members)]:
            positions[row, offset : offset + n] = torch.arange(n)
            offset += n
    out["position_ids"] = positions
    return out


def collate_padding_free(samples: list[StepSample], pad_id: int, one_row: bool = False) -> dict[str, Any]:
    """collate() then pack_batch(): the same tokens and labels in fewer, unpadded rows."""
    return pack_batch(collate(samples, pad_id), pad_id, one_row)


def padding_free_collate(model: Any) -> Callable[[list[StepSample], int], dict[str, Any]]:
    """The packing collate for this model: one row per micro-batch under flash-attention (variable-length
    kernels), rows no wider than the longest sample under dense-mask attention (sdpa, eager)."""
    config = getattr(model, "config", None)
    if "flash" in str(getattr(config, "_attn_implementation", "") or ""):
        return lambda samples, pad_id: collate_padding_free(samples, pad_id, one_row=True)
    return collate_padding_free


def packing_collate(model: Any) -> Callable[[list[StepSample], int], dict[str, Any]]:
    """What a padding-free phase collates with: verify_packing on this model, then padding_free_collate."""
    verify_packing(model, int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0))
    return padding_free_collate(model)


def forward_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The model's logits for a padded batch (attention_mask) or a packed one (position_ids, no mask).

    Packed: use_cache=False, because transformers only turns packed position ids into a block-diagonal mask when no
    KV cache is built (with one, the samples of a row would attend to each other)."""
    if "position_ids" in batch:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def verify_packing(model: Any, vocab_size: int) -> None:
    """ConfigError unless this model keeps packed samples apart: the second of two packed 8-token samples must get
    the logits it gets alone (a model or attention kernel that ignores packed position ids would let it read the
    first). Run once before a padding-free phase; costs two forwards of 16 tokens."""
    param = next(model.parameters())
    ids = torch.randint(5, max(6, vocab_size), (1, 16), generator=torch.Generator().manual_seed(0)).to(param.device)
    positions = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0).to(param.device)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 8:].float()
        alone = model(input_ids=ids[:, 8:], use_cache=False).logits[0].float()
    tolerance = 1e-3 if param.dtype == torch.float32 else 5e-2
    gap = float((packed - alone).abs().max())
    if gap > tolerance:
        raise ConfigError(f"optim.padding_free: this model lets packed samples attend to each other (logits differ by "
                          f"{gap:.3g} from the sample alone; its attention ignores packed position ids); set "
                          "optim.padding_free=false")


def reply_logprobs(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every token given its prefix, aligned to input positions (column 0 is 0), and the reply mask.
    The forward runs under placement.autocast(), as training forwards and generation do, so log-probs scored here
    (Q-Evolve's pi_old and pi_BC, GRPO's reference) are in the precision the loss compares them with: with
    model.dtype auto on bf16 hardware a float32 score would start every ratio and KL off 1 and 0 by rounding."""
    from agentevo.algorithms.losses import token_logprobs
    from agentevo.models import placement

    with placement.autocast():
        logits = forward_logits(model, batch)
    picked = token_logprobs(logits, batch["input_ids"])
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1), batch["action_mask"]
