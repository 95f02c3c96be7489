"""The training loop: AdamW, warmup + cosine, gradient accumulation and clipping, atomic resumable checkpoints."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentevo.config import OptimConfig
from agentevo.data.tensors import StepSample, collate
from agentevo.train.tracking import MetricsLogger

LossFn = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def plan_micro_batches(n_samples: int, cfg: OptimConfig, seed: int) -> list[list[int]]:
    """The fixed sequence of micro-batches (sample indices) for the whole run: shuffled per epoch, seeded."""
    rng = random.Random(seed)
    n_micro = max(1, math.ceil(n_samples * cfg.epochs / cfg.micro_batch_size))
    accum = cfg.batch_size // cfg.micro_batch_size
    n_micro = math.ceil(n_micro / accum) * accum  # whole optimiser steps only
    order: list[int] = []
    while len(order) < n_micro * cfg.micro_batch_size:
        epoch = list(range(n_samples))
        rng.shuffle(epoch)
        order.extend(epoch)
    return [order[i * cfg.micro_batch_size : (i + 1) * cfg.micro_batch_size] for i in range(n_micro)]


def _save_state(ckpt: Path, model: Any, tokenizer: Any, optimizer: Any, step: int, extra: dict[str, Any]) -> None:
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **extra}))
    if ckpt.exists():
        shutil.rmtree(ckpt)
    tmp.rename(ckpt)


def _load_state(ckpt: Path, model: Any, optimizer: Any) -> int:
    from safetensors.torch import load_file

    weights = ckpt / "model" / "model.safetensors"
    if weights.exists():
        state = load_file(str(weights))
        missing, unexpected = model.load_state_dict(state, strict=False)
        # tied embeddings are saved once; anything else missing means a different model
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"checkpoint {ckpt} does not match the model (missing {missing}, unexpected {unexpected})")
    else:  # LoRA adapters
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file as load_adapter

        set_peft_model_state_dict(model, load_adapter(str(ckpt / "model" / "adapter_model.safetensors")))
    blob = torch.load(ckpt / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"])
    return int(json.loads((ckpt / "state.json").read_text())["step"])


def train(
    model: Any,
    samples: list[StepSample],
    loss_fn: LossFn,
    cfg: OptimConfig,
    pad_id: int,
    work_dir: str | Path,
    seed: int,
    logger: MetricsLogger | None = None,
    phase: str = "train",
    tokenizer: Any = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Optimise loss_fn over the samples for cfg.epochs; resumes from work_dir/last if a run was interrupted.

    Returns the mean of each logged statistic over the last 10% of optimiser steps.
    """
    from accelerate import Accelerator

    if not samples:
        raise ValueError(f"{phase}: no training samples")
    work_dir = Path(work_dir)
    accum = cfg.batch_size // cfg.micro_batch_size
    accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=not torch.cuda.is_available())
    plan = plan_micro_batches(len(samples), cfg, seed)
    total_steps = len(plan) // accum
    warmup = int(cfg.warmup_ratio * total_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, total_steps, warmup))
    start_step = 0
    last = work_dir / "last"
    if last.exists():
        start_step = _load_state(last, model, optimizer)
        scheduler.last_epoch = start_step
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * _schedule(start_step, total_steps, warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    history: list[dict[str, float]] = []
    step = start_step
    for micro_index in range(start_step * accum, len(plan)):
        batch = collate([samples[i] for i in plan[micro_index]], pad_id)
        batch = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with accelerator.accumulate(model):
            loss, stats = loss_fn(model, batch)
            accelerator.backward(loss)
            grad_norm = 0.0
            if accelerator.sync_gradients and cfg.grad_clip > 0:
                grad_norm = float(accelerator.clip_grad_norm_(params, cfg.grad_clip))
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if (micro_index + 1) % accum:
            continue
        step += 1
        record = {"loss": float(loss.detach()), "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0], **stats}
        history.append(record)
        if logger is not None:
            logger.log(phase, step, record)
        if on_step is not None:
            on_step(step, total_steps, record)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            _save_state(last, accelerator.unwrap_model(model), tokenizer, optimizer, step, {"total": total_steps})
    model.eval()
    if last.exists():
        shutil.rmtree(last)
    tail = history[-max(1, len(history) // 10) :] if history else []
    return {k: sum(r[k] for r in tail) / len(tail) for k in (tail[0] if tail else {})}
