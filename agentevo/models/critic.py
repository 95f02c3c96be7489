"""Q-Evolve's in-distribution critic: V, two Q heads and Polyak target Q heads on a causal-LM backbone.

One forward pass over a rendered trajectory gives every value (methods-spec §2.3 step 3, `lasttoken` readout):

    V(s_t)       = V_head(H[v_pos_t])     t = 1..T+1   v_pos_t = the token just before reply t starts (the end of the
                                                       generation prompt for step t, i.e. after o_t and the
                                                       assistant header); v_pos_{T+1} = the end of the prompt that
                                                       would follow o_{T+1}
    Q_i(s_t,a_t) = Q_i_head(H[q_pos_t])   t = 1..T     q_pos_t = the last token of reply t

H are the backbone's last-layer hidden states. Causal attention means V_t never sees a_t's tokens.
The heads are MLPs hidden -> W -> ReLU -> W -> ReLU -> 1 [P:QLASS QNet]. The target heads read the online
backbone's features [P:ILQL heads on a shared backbone]; only they are Polyak-averaged.
With LoRA the backbone is the policy's own base model with a second adapter named "critic" (one copy of the
base weights), selected only for the critic's forward passes.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentevo.agent.chat import ChatRenderer, Rendered
from agentevo.agent.prompt import HistoryTurn, build_messages
from agentevo.algorithms import losses
from agentevo.data.tensors import pad_sequences, step_prompt_ids
from agentevo.data.types import Trajectory
from agentevo.eval.diagnostics import relative_drift
from agentevo.files import replacing_dir
from agentevo.models import placement

CRITIC_ADAPTER = "critic"


# ---------------------------------------------------------------------------------------------------------------
# Readout positions


@dataclass
class CriticRow:
    """One critic input row: token ids and where to read V (state values) and Q (reply values), with their t."""

    input_ids: list[int]
    v_pos: list[int]
    v_steps: list[int]  # t of each V readout, 1..T+1
    q_pos: list[int]
    q_steps: list[int]  # t of each Q readout, 1..T


def render_full_trajectory(renderer: ChatRenderer, traj: Trajectory, prefix: str = "") -> Rendered:
    """The whole episode as one conversation (no history window), ending with the prompt after o_{T+1}."""
    history = [HistoryTurn(list(s.action_ids), s.next_obs) for s in traj.steps]
    messages = build_messages(traj.instruction, traj.goal, traj.first_obs, history, max(1, len(history)), prefix)
    return renderer.render(messages, add_generation_prompt=True)


def critic_rows(
    renderer: ChatRenderer, traj: Trajectory, max_length: int, window: int, prefix: str = ""
) -> list[CriticRow]:
    """Critic rows of a trajectory: one packed row when it fits max_length, else one row per state t = 1..T+1."""
    T = len(traj.steps)
    if any(not s.action_ids for s in traj.steps):
        raise ValueError("every step needs its reply token ids before the critic can read it")
    full = render_full_trajectory(renderer, traj, prefix)
    if len(full.ids) <= max_length:
        spans = full.assistant_spans
        v_pos = [start - 1 for start, _ in spans] + [len(full.ids) - 1]
        q_pos = [end - 1 for _, end in spans]
        return [CriticRow(full.ids, v_pos, list(range(1, T + 2)), q_pos, list(range(1, T + 1)))]
    # Too long for one row: the prompt the policy saw at step t (its history window, cut from the left),
    # plus the reply; V at the prompt's last token and Q at the reply's last token, as in the packed row [O].
    rows = []
    for t in range(1, T + 2):
        reply = list(traj.steps[t - 1].action_ids) if t <= T else []
        prompt = step_prompt_ids(renderer, traj, t, window, prefix)
        prompt = prompt[-max(1, max_length - len(reply)) :]
        ids = prompt + reply
        rows.append(
            CriticRow(ids, [len(prompt) - 1], [t], [len(ids) - 1] if reply else [], [t] if reply else [])
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Per-trajectory training items and batches


@dataclass
class CriticItem:
    """A trajectory for the critic: its rows and one value per step of r_t (= r_env + r_aux), done_t and w_t."""

    rows: list[CriticRow]
    rewards: list[float]
    dones: list[bool]
    weights: list[float]
    key: int = 0  # the caller's id for the trajectory

    @property
    def T(self) -> int:
        return len(self.rewards)


def collate_critic(items: list[CriticItem], pad_id: int) -> dict[str, Tensor]:
    """Right-padded rows plus flat readout indices.

    V values come out item-major, t = 1..T+1 (index base_v + t − 1); Q values item-major, t = 1..T.
    `v_cur`/`v_next` index V(s_t)/V(s_{t+1}) for every step.
    """
    input_ids, attention = pad_sequences([r.input_ids for it in items for r in it.rows], pad_id)
    v_where: list[tuple[int, int]] = []
    q_where: list[tuple[int, int]] = []
    v_cur, v_next = [], []
    row = 0
    for it in items:
        v_slot: dict[int, tuple[int, int]] = {}
        q_slot: dict[int, tuple[int, int]] = {}
        for r in it.rows:
            v_slot.update({t: (row, p) for t, p in zip(r.v_steps, r.v_pos, strict=True)})
            q_slot.update({t: (row, p) for t, p in zip(r.q_steps, r.q_pos, strict=True)})
            row += 1
        if sorted(v_slot) != list(range(1, it.T + 2)) or sorted(q_slot) != list(range(1, it.T + 1)):
            raise ValueError("a critic item must read V at t = 1..T+1 and Q at t = 1..T")
        base = len(v_where)
        v_where.extend(v_slot[t] for t in range(1, it.T + 2))
        q_where.extend(q_slot[t] for t in range(1, it.T + 1))
        v_cur.extend(base + t - 1 for t in range(1, it.T + 1))
        v_next.extend(base + t for t in range(1, it.T + 1))

    def long(xs: list[int]) -> Tensor:
        return torch.tensor(xs, dtype=torch.long)

    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "v_rows": long([r for r, _ in v_where]),
        "v_cols": long([c for _, c in v_where]),
        "q_rows": long([r for r, _ in q_where]),
        "q_cols": long([c for _, c in q_where]),
        "v_cur": long(v_cur),
        "v_next": long(v_next),
        "rewards": torch.tensor([x for it in items for x in it.rewards], dtype=torch.float32),
        "dones": torch.tensor([float(x) for it in items for x in it.dones], dtype=torch.float32),
        "weights": torch.tensor([x for it in items for x in it.weights], dtype=torch.float32),
    }


# ---------------------------------------------------------------------------------------------------------------
# The model


def mlp_head(hidden: int, width: int) -> nn.Module:
    """hidden -> width -> ReLU -> width -> ReLU -> 1 [P:QLASS QNet]."""
    return nn.Sequential(nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def _decoder(lm: Any) -> Any:
    """The transformer body (no LM head) of a causal LM or of a peft model around one."""
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return inner.get_decoder()


@contextmanager
def use_adapter(lm: Any, name: str | None) -> Iterator[None]:
    """Make a peft adapter active for a block, then restore the previous one and every requires_grad flag."""
    if name is None:
        yield
        return
    previous = lm.active_adapter
    flags = {n: p.requires_grad for n, p in lm.named_parameters()}
    lm.set_adapter(name)
    try:
        yield
    finally:
        lm.set_adapter(previous)
        for n, p in lm.named_parameters():
            p.requires_grad_(flags[n])


class Critic(nn.Module):
    """Backbone + V head + Q heads (2) + target Q heads (2, Polyak only)."""

    def __init__(self, lm: Any, width: int, adapter: str | None = None, n_q: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.lm = lm
        self.adapter = adapter
        hidden = int(lm.config.hidden_size)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.v_head = mlp_head(hidden, width)
            self.q_heads = nn.ModuleList(mlp_head(hidden, width) for _ in range(n_q))
        self.target_q_heads = copy.deepcopy(self.q_heads)
        self.target_q_heads.requires_grad_(False)
        device = next(lm.parameters()).device
        for head in (self.v_head, self.q_heads, self.target_q_heads):
            head.to(device)
        if adapter is not None:
            # Only the critic's adapter (and the heads) train; the shared base and the policy adapter stay as they are.
            for name, p in lm.named_parameters():
                p.requires_grad_(f".{adapter}." in name)
        self.width = width

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Backbone (or critic adapter) and online heads; never the target heads."""
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        return self.v_head[0].weight.device

    def features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Last-layer hidden states [B, L, H] (float32). The backbone runs under placement.autocast() (bf16 when
        model.dtype is auto on bf16 hardware, as the policy's training forwards do); the heads read float32."""
        with use_adapter(self.lm, self.adapter), placement.autocast():
            out = _decoder(self.lm)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state.float()

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """V at every state [Nv], Q_i [n_q, Nq] and target Q̄_i [n_q, Nq] (constant) for a collated batch."""
        dev = self.device
        h = self.features(batch["input_ids"].to(dev), batch["attention_mask"].to(dev))
        hv = h[batch["v_rows"].to(dev), batch["v_cols"].to(dev)]
        hq = h[batch["q_rows"].to(dev), batch["q_cols"].to(dev)]
        v = self.v_head(hv).squeeze(-1)
        q = torch.stack([head(hq).squeeze(-1) for head in self.q_heads])
        with torch.no_grad():
            q_target = torch.stack([head(hq.detach()).squeeze(-1) for head in self.target_q_heads])
        return {"v": v, "q": q, "q_target": q_target}

    def polyak(self, rho: float) -> None:
        """θ̄ ← (1 − ρ)θ̄ + ρθ on the target Q heads only."""
        losses.polyak_update(self.target_q_heads.parameters(), self.q_heads.parameters(), rho)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], pad_id: int, batch_size: int = 16) -> Tensor:
        """min_i Q_i read at the last token of each sequence (a prompt followed by a candidate reply)."""
        self.eval()
        out = []
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start : start + batch_size]
            ids, att = pad_sequences(chunk, pad_id)
            h = self.features(ids.to(self.device), att.to(self.device))
            last = h[torch.arange(len(chunk), device=self.device), att.sum(dim=1).to(self.device) - 1]
            out.append(torch.stack([head(last).squeeze(-1) for head in self.q_heads]).min(dim=0).values.cpu())
        return torch.cat(out)


# ---------------------------------------------------------------------------------------------------------------
# Weighted-IQL losses (methods-spec §2.3 step 3)


def value_loss(out: dict[str, Tensor], batch: dict[str, Tensor], tau: float) -> Tensor:
    """L_V = Σ_t w_t L_2^τ(min_i Q̄_i(s_t,a_t) − V(s_t)) / Σ_t w_t."""
    v = out["v"][batch["v_cur"].to(out["v"].device)]
    q_min = out["q_target"].min(dim=0).values
    return losses.iql_value_loss(q_min, v, batch["weights"].to(v.device), tau)


def q_loss(out: dict[str, Tensor], batch: dict[str, Tensor], gamma: float) -> Tensor:
    """L_Q = Σ_t w_t Σ_i (r_t + γ(1 − done_t)V(s_{t+1}) − Q_i(s_t,a_t))² / Σ_t w_t, V detached."""
    dev = out["v"].device
    next_v = out["v"][batch["v_next"].to(dev)].detach()
    y = losses.bellman_targets(batch["rewards"].to(dev), next_v, batch["dones"].to(dev), gamma)
    return losses.iql_q_loss(out["q"], y, batch["weights"].to(dev))


@dataclass
class CriticFit:
    """Optimisation settings of the critic: the budget is `steps` optimiser steps, or `epochs` passes when steps=0."""

    tau: float = 0.7
    gamma: float = 0.99
    polyak: float = 0.005
    lr: float = 2e-5
    epochs: int = 2
    batch_size: int = 64
    micro_batch_size: int = 8
    grad_clip: float = 1.0
    steps: int = 0  # > 0: exactly this many optimiser steps, reshuffling D each pass (epochs is then unused)

    def total_steps(self, n_items: int) -> int:
        """Optimiser steps of a fit on n_items trajectories."""
        per_epoch = -(-n_items // self.batch_size) if n_items else 0
        return self.steps if self.steps > 0 and per_epoch else self.epochs * per_epoch


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([g.grad.norm() for g in grads])))


def fit_critic(
    critic: Critic,
    items: list[CriticItem],
    fit: CriticFit,
    pad_id: int,
    seed: int,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Weighted IQL on the items; per minibatch: V step -> Q step (against the new V) -> Polyak [P:IQL learner.py].

    Returns one record per pass over the items (mean L_V, L_Q; the last pass may be partial when fit.steps is set),
    each with the optimiser steps so far and the relative L2 drift of the target and online Q heads from their
    weights at the start of the fit. Each loss is normalised by the minibatch's Σw, also when the minibatch is split
    into micro-batches.
    """
    params = critic.trainable_parameters()
    # One AdamW over backbone + heads: parameters without a gradient in a step (the Q heads in the V step, the
    # V head in the Q step) are skipped by AdamW, so each step moves only what its loss depends on [O].
    optimizer = torch.optim.AdamW(params, lr=fit.lr, weight_decay=0.0)
    rng = random.Random(seed)
    step = 0
    total = fit.total_steps(len(items))
    target0 = [p.detach().clone() for p in critic.target_q_heads.parameters()]
    online0 = [p.detach().clone() for p in critic.q_heads.parameters()]
    epochs: list[dict[str, float]] = []
    critic.train()
    epoch = 0
    while step < total:
        order = list(range(len(items)))
        rng.shuffle(order)
        sums = {"loss_v": 0.0, "loss_q": 0.0, "n": 0}
        for start in range(0, len(order), fit.batch_size):
            if step >= total:
                break
            chosen = [items[i] for i in order[start : start + fit.batch_size]]
            micro = [chosen[j : j + fit.micro_batch_size] for j in range(0, len(chosen), fit.micro_batch_size)]
            batches = [collate_critic(m, pad_id) for m in micro]
            total_w = float(sum(b["weights"].sum() for b in batches))
            record: dict[str, float] = {}
            for name, loss_fn in (("loss_v", lambda o, b: value_loss(o, b, fit.tau)),
                                  ("loss_q", lambda o, b: q_loss(o, b, fit.gamma))):
                optimizer.zero_grad(set_to_none=True)
                value = 0.0
                for b in batches:
                    share = float(b["weights"].sum()) / max(total_w, 1e-12)
                    loss = loss_fn(critic(b), b) * share
                    loss.backward()
                    value += float(loss.detach())
                record[name] = value
                record[f"grad_norm_{name[-1]}"] = _clip(params, fit.grad_clip)
                optimizer.step()
            critic.polyak(fit.polyak)
            step += 1
            record["loss"] = record["loss_v"] + record["loss_q"]
            sums["loss_v"] += record["loss_v"]
            sums["loss_q"] += record["loss_q"]
            sums["n"] += 1
            if on_step is not None:
                on_step(step, record)
        n = max(1, sums["n"])
        epoch += 1
        epochs.append({
            "epoch": epoch, "loss_v": sums["loss_v"] / n, "loss_q": sums["loss_q"] / n, "steps": step,
            "target_drift": relative_drift([p.detach() for p in critic.target_q_heads.parameters()], target0),
            "online_drift": relative_drift([p.detach() for p in critic.q_heads.parameters()], online0),
        })
    critic.eval()
    return epochs


@torch.no_grad()
def critic_values(critic: Critic, items: list[CriticItem], pad_id: int, batch_size: int = 8) -> list[dict[str, list[float]]]:
    """Per item: V (T+1 values), Q1..Qn and Q̄1..Q̄n (T values each), from one forward pass per row."""
    critic.eval()
    out: list[dict[str, list[float]]] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        res = critic(collate_critic(chunk, pad_id))
        v, q, qt = res["v"].cpu(), res["q"].cpu(), res["q_target"].cpu()
        iv = iq = 0
        for it in chunk:
            rec = {"v": v[iv : iv + it.T + 1].tolist()}
            for i in range(q.shape[0]):
                rec[f"q{i + 1}"] = q[i, iq : iq + it.T].tolist()
                rec[f"qbar{i + 1}"] = qt[i, iq : iq + it.T].tolist()
            out.append(rec)
            iv += it.T + 1
            iq += it.T
    return out


# ---------------------------------------------------------------------------------------------------------------
# Building, saving, loading


def add_critic_adapter(peft_model: Any, lora_config: Any, copy_from: str | None) -> None:
    """Add the "critic" LoRA adapter on the policy's base model, optionally initialised from another adapter."""
    peft_model.add_adapter(CRITIC_ADAPTER, lora_config)
    if copy_from is None:
        return
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if f".{CRITIC_ADAPTER}." in name:
                p.copy_(params[name.replace(f".{CRITIC_ADAPTER}.", f".{copy_from}.")])


def save_critic(critic: Critic, path: str | Path, tokenizer: Any = None) -> Path:
    """Write backbone (or the critic adapter's weights) and heads to path atomically (temp folder, rename)."""
    path = Path(path)
    with replacing_dir(path) as tmp:
        if critic.adapter is None:
            critic.lm.save_pretrained(tmp / "backbone")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "backbone")
        else:
            from peft import get_peft_model_state_dict
            from safetensors.torch import save_file

            state = get_peft_model_state_dict(critic.lm, adapter_name=critic.adapter)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter.safetensors"))
        heads = {k: v for k, v in critic.state_dict().items() if not k.startswith("lm.")}
        torch.save(heads, tmp / "heads.pt")
        (tmp / "critic.json").write_text(json.dumps({"width": critic.width, "adapter": critic.adapter,
                                                     "n_q": len(critic.q_heads)}))
    return path


def load_critic_weights(critic: Critic, path: str | Path) -> None:
    """Load heads (and the critic adapter's weights, for a LoRA critic) saved by save_critic."""
    path = Path(path)
    missing, unexpected = critic.load_state_dict(torch.load(path / "heads.pt", weights_only=True), strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm.")]:
        raise RuntimeError(f"critic heads in {path} do not match (missing {missing}, unexpected {unexpected})")
    if critic.adapter is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(critic.lm, load_file(str(path / "adapter.safetensors")), adapter_name=critic.adapter)
        for name, p in critic.lm.named_parameters():
            p.requires_grad_(f".{critic.adapter}." in name)


def critic_meta(path: str | Path) -> dict[str, Any]:
    """The width / adapter / n_q a saved critic was built with."""
    return json.loads((Path(path) / "critic.json").read_text())
