"""Episode metrics: success rate, average reward, steps, and format / invalid / repeat rates."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentevo.data.types import Trajectory


def eval_collection(label: str, split: str) -> str:
    """The experience-store collection of one evaluation: eval/<policy label>/<split>."""
    return f"eval/{label}/{split}"


def checkpoint_digest(path: Path) -> str:
    """sha256 over a checkpoint folder's files (names and bytes: weights, configs, tokenizer, adapter)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def eval_label(model: Path, settings: dict[str, Any]) -> str:
    """The label of a standalone evaluation: the checkpoint folder name and a short hash of everything that decides
    its result (checkpoint bytes, env, splits, task count, sampling, guides), so a cache is never another's."""
    key = json.dumps({"checkpoint": checkpoint_digest(model), **settings}, sort_keys=True, default=str)
    return f"{Path(model).name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def summarize(trajs: list[Trajectory]) -> dict[str, Any]:
    """Aggregate metrics over trajectories (rates are per step for the signals, per episode otherwise)."""
    n = len(trajs)
    if n == 0:
        return {"n": 0}
    steps = [s for t in trajs for s in t.steps]
    n_steps = max(1, len(steps))
    return {
        "n": n,
        "success_rate": sum(t.success for t in trajs) / n,
        "avg_reward": sum(t.final_reward for t in trajs) / n,
        "mean_steps": len(steps) / n,
        "format_error_rate": sum(s.signal == "format" for s in steps) / n_steps,
        "invalid_rate": sum(s.signal == "invalid" for s in steps) / n_steps,
        "repeat_rate": sum(s.signal == "repeat" for s in steps) / n_steps,
        "env_steps": sum(1 for s in steps if s.parsed_action is not None),
        # episodes whose environment crashed or hung past rollout.max_retries: counted as failures above
        "errored_episodes": sum(1 for t in trajs if t.meta.get("error")),
    }


def tasks_played(metrics: dict[str, Any]) -> int:
    """Tasks an evaluation played: its episodes over eval.samples (samples_per_task, logged when sampled)."""
    return int(metrics["n"]) // int(metrics.get("samples_per_task", 1))


def auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """ROC AUC of scores for the positive class (Mann-Whitney, ties count 1/2); None without both classes."""
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    if not pos or not neg:
        return None
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def auc_same_step(scores: Sequence[float], steps: Sequence[int], positive: Sequence[bool]) -> float | None:
    """ROC AUC that compares a positive and a negative only when they share a step index (pairs pooled over steps);
    None without such a pair. A state value V(s_t) scored this way cannot gain from t alone: failed episodes run
    longer, so a V that just falls with t gets a plain AUC above 0.5 and exactly 0.5 here."""
    by_step: dict[int, tuple[list[float], list[bool]]] = {}
    for s, t, p in zip(scores, steps, positive, strict=True):
        group = by_step.setdefault(t, ([], []))
        group[0].append(s)
        group[1].append(p)
    wins = pairs = 0.0
    for xs, ys in by_step.values():
        step_auc = auc(xs, ys)  # None unless this step has both outcomes
        if step_auc is not None:
            n = sum(ys) * (len(ys) - sum(ys))
            wins += step_auc * n
            pairs += n
    return wins / pairs if pairs else None

