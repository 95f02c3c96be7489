"""The training loop: AdamW, warmup + cosine, gradient accumulation and clipping, atomic resumable checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from agentevo.config import OptimConfig
from agentevo.data.tensors import StepSample, collate, packing_collate
from agentevo.errors import AgentevoError, ConfigError
from agentevo.files import replacing_dir
from agentevo.models import placement
from agentevo.models.backend import DamagedCheckpointError, verify_manifest, write_manifest
from agentevo.train.tracking import MetricsLogger

log = logging.getLogger(__name__)

LossFn = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


SCHEDULES = ("cosine", "constant")


def _schedule(step: int, total: int, warmup: int, kind: str = "cosine") -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    if kind == "constant":  # constant-with-warmup (ETO's DPO stage)
        return 1.0
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


def epoch_end_step(epoch: int, n_samples: int, batch_size: int) -> int:
    """The optimiser step after which `epoch` epochs of samples have been seen (steps take batch_size samples from
    the plan's concatenated epochs, so a step may straddle two epochs: it counts for the later one)."""
    return math.ceil(epoch * n_samples / batch_size)


def rank_micro_batches(n_micro: int, accum: int, world: int, rank: int, start_step: int = 0) -> list[int]:
    """The plan's micro-batch indices that process `rank` of `world` runs, from optimiser step start_step on.

    Each optimiser step's accum micro-batches are dealt out round-robin, accum / world to each process; every
    process averages its share and DDP averages over processes, so the step's gradient is the mean over the same
    accum micro-batches as in one process, and N processes follow the single-process loss curve.
    """
    if accum % world:
        raise ConfigError(
            f"optim.batch_size / optim.micro_batch_size = {accum} micro-batches per optimiser step cannot be "
            f"shared by {world} processes; choose optim.micro_batch_size so that this ratio is a multiple of {world}"
        )
    return list(range(start_step * accum + rank, n_micro, world))


def _set_checkpointing(model: Any, on: bool) -> None:
    """Activation checkpointing on or off, under the name this transformers version uses (v5 renamed it)."""
    if on:
        kwargs = {"use_reentrant": False}  # non-reentrant: works with frozen inputs (LoRA) without extra hooks
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def _save_final(accelerator: Any, model: Any, tokenizer: Any, path: Path) -> None:
    """save_pretrained of the whole model from any layout (DDP, FSDP, DeepSpeed): gathered, written by rank 0."""
    state = accelerator.get_state_dict(model)  # every rank takes part: FSDP / ZeRO-3 gather their shards here
    if accelerator.is_main_process:
        with replacing_dir(path) as tmp:
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            write_manifest(tmp)
    accelerator.wait_for_everyone()


def _rng_state() -> dict[str, Any]:
    """Torch's CPU and CUDA generator states as uint8 tensors: what torch.load(weights_only=True) accepts."""
    cuda = [t.cpu() for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _save_state(ckpt: Path, model: Any, tokenizer: Any, optimizer: Any, step: int, extra: dict[str, Any]) -> None:
    """Write the resume checkpoint: model, optimiser, RNG and step, then its manifest; swapped in atomically."""
    with replacing_dir(ckpt) as tmp:  # the previous checkpoint stays (as last.old) until the new one is in place
        model.save_pretrained(tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **extra}))
        write_manifest(tmp)


def _read_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], bool, dict[str, Any], int]:
    """Read a resume checkpoint into memory without applying anything: (weights, is_lora, optimizer blob, step).

    DamagedCheckpointError when a file is missing, truncated or differs from the manifest; AgentevoError when
    optimizer.pt holds anything but tensors and plain values (nothing in it is executed: weights_only=True).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    verify_manifest(ckpt)
    weights = ckpt / "model" / "model.safetensors"
    lora = not weights.exists()
    if lora:
        weights = ckpt / "model" / "adapter_model.safetensors"
    try:
        state = load_file(str(weights))
        blob = torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu")
        step = int(json.loads((ckpt / "state.json").read_text())["step"])
        if not isinstance(blob, dict) or "optimizer" not in blob:
            raise ValueError("optimizer.pt has no optimizer state")
    except pickle.UnpicklingError as exc:
        raise AgentevoError(
            f"refusing to load {ckpt / 'optimizer.pt'}: it holds objects other than tensors and plain values, so it "
            f"is damaged or was crafted (loading it could run code); delete {ckpt} to restart this phase from its "
            "start") from exc
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, SafetensorError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DamagedCheckpointError(f"checkpoint {ckpt} is damaged ({first})") from exc
    return state, lora, blob, step


def _apply_state(ckpt: Path, model: Any, optimizer: Any, state: dict[str, torch.Tensor], lora: bool,
                 blob: dict[str, Any]) -> None:
    """Load what _read_state read into the model, the optimiser and torch's generators."""
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        # tied embeddings are saved once; anything else missing means a different model
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"checkpoint {ckpt} does not match the model (missing {missing}, unexpected {unexpected})")
    optimizer.load_state_dict(blob["optimizer"])
    rng = blob.get("rng")
    if isinstance(rng, torch.Tensor):  # checkpoints written before the CUDA states were kept
        torch.set_rng_state(rng)
    elif isinstance(rng, dict):
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])


def _resume(work_dir: Path, model: Any, optimizer: Any, phase: str, main: bool) -> int:
    """Load the newest good resume checkpoint of work_dir (last/, or last.old/ left by a save cut short) and return
    its step, 0 when there is none. A damaged one is set aside as NAME.damaged-TIME with a warning, and the phase
    goes on from the next good state (the older checkpoint, else the phase start)."""
    for ckpt in (work_dir / "last", work_dir / "last.old"):
        if not ckpt.exists():
            continue
        try:
            state, lora, blob, step = _read_state(ckpt)
        except DamagedCheckpointError as exc:
            if main:  # one process renames; the others read the same damage and skip it too
                aside = ckpt.with_name(f"{ckpt.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(ckpt, aside)
                log.warning("%s; set it aside as %s, %s goes on from the previous good state", exc, aside, phase)
            continue
        _apply_state(ckpt, model, optimizer, state, lora, blob)
        return step
    return 0


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
    collate_fn: Callable[[list[Any], int], dict[str, Any]] = collate,
    schedule: str = "cosine",
    gradient_checkpointing: bool = False,
    mixed_precision: str | None = None,
    save_to: str | Path | None = None,
    snapshots: Mapping[int, str | Path] | None = None,
) -> dict[str, float]:
    """Optimise loss_fn over the samples for cfg.epochs; resumes from work_dir/last if a run was interrupted.

    `collate_fn` turns a micro-batch of samples into tensors (default: StepSample rows; DPO passes pairs);
    `schedule` is the learning-rate shape after warmup: "cosine" or "constant". With cfg.padding_free the default
    collate packs each micro-batch (data.tensors.pack_batch); a custom collate_fn is used as it is.
    Under `accelerate launch` each process runs its share of every optimiser step's micro-batches
    (rank_micro_batches); logged values are means over the whole step, identical on every rank, and only rank 0
    writes logs and checkpoints. `gradient_checkpointing` (or cfg.gradient_checkpointing) trades compute for
    activation memory; the loss forward runs under placement.autocast() (bf16 when model.dtype is auto on bf16
    hardware, master weights and the backward's accumulation stay in their dtype); `mixed_precision`
    ("no", "bf16", "fp16"; None = accelerate's config / environment) is passed to the Accelerator; `save_to` writes
    the trained model as a save_pretrained folder gathered from any layout (needed under FSDP / ZeRO-3, where the
    caller's model object holds only this rank's shard). `snapshots` ({epoch: folder}) writes the model the same way
    at the end of each of those epochs (epoch_end_step), before that step's resume checkpoint.
    Returns the mean of each logged statistic over the last 10% of optimiser steps.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, GradientAccumulationPlugin

    if not samples:
        raise ValueError(f"{phase}: no training samples")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {SCHEDULES}")
    work_dir = Path(work_dir)
    accum = cfg.batch_size // cfg.micro_batch_size
    cpu = not torch.cuda.is_available()
    world = PartialState(cpu=cpu).num_processes
    rank_micro_batches(accum, accum, world, 0)  # fail before any work when the step cannot be shared
    kwargs: dict[str, Any] = {} if mixed_precision is None else {"mixed_precision": mixed_precision}
    # An explicit plugin: ACCELERATE_GRADIENT_ACCUMULATION_STEPS from a launcher config must not override the split.
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accum // world),
                              cpu=cpu, **kwargs)
    if cfg.padding_free and collate_fn is collate:  # custom row types (DPO pairs, Q-net rows) stay padded
        collate_fn = packing_collate(model)
    plan = plan_micro_batches(len(samples), cfg, seed)
    total_steps = len(plan) // accum
    warmup = int(cfg.warmup_ratio * total_steps)
    snapshot_at = {epoch_end_step(e, len(samples), cfg.batch_size): Path(p) for e, p in (snapshots or {}).items()}
    if any(s > total_steps for s in snapshot_at):
        raise ValueError(f"{phase}: snapshot epochs {sorted(snapshots or {})} past the run's {cfg.epochs} epochs")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, total_steps, warmup, schedule))
    last = work_dir / "last"
    start_step = _resume(work_dir, model, optimizer, phase, accelerator.is_main_process)
    if logger is not None and accelerator.is_main_process:
        logger.drop_after(phase, start_step)  # the steps replayed from here on are logged again
    if start_step:
        scheduler.last_epoch = start_step
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * _schedule(start_step, total_steps, warmup, schedule)
    gradient_checkpointing = gradient_checkpointing or cfg.gradient_checkpointing
    if gradient_checkpointing:
        _set_checkpointing(model, True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Sharded layouts keep optimiser state per rank; the single-file resume checkpoint covers DDP and one process.
    resumable = accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    model.train()
    history: list[dict[str, float]] = []
    step = start_step
    local_accum = accum // world
    step_losses: list[float] = []
    step_stats: list[dict[str, float]] = []
    for micro_index in rank_micro_batches(len(plan), accum, world, accelerator.process_index, start_step):
        batch = collate_fn([samples[i] for i in plan[micro_index]], pad_id)
        batch = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with accelerator.accumulate(model):
            with placement.autocast():  # model.dtype auto on bf16 hardware: bf16 forward, fp32 master weights
                loss, stats = loss_fn(model, batch)
            accelerator.backward(loss)
            grad_norm = 0.0
            if accelerator.sync_gradients and cfg.grad_clip > 0:
                # the wrapped model's parameters: under FSDP the original tensors are no longer the ones trained
                norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                grad_norm = float("nan") if norm is None else float(norm)  # DeepSpeed clips inside its step
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        step_losses.append(float(loss.detach()))
        step_stats.append(stats)
        if len(step_losses) < local_accum:
            continue
        step += 1
        # means over all of the step's micro-batches, summed across processes: the same record on every rank
        keys = list(step_stats[0])
        sums = torch.tensor([sum(step_losses)] + [sum(float(s[k]) for s in step_stats) for k in keys],
                            dtype=torch.float64, device=accelerator.device)
        means = (accelerator.reduce(sums, reduction="sum") / accum).tolist()
        step_losses, step_stats = [], []
        record = {"loss": means[0], "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                  **dict(zip(keys, means[1:], strict=True))}
        history.append(record)
        if logger is not None and accelerator.is_main_process:
            logger.log(phase, step, record)
        if step in snapshot_at:  # every rank: gathering a sharded model is collective
            _save_final(accelerator, model, tokenizer, snapshot_at[step])
        if on_step is not None:
            on_step(step, total_steps, record)
        if resumable and cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            if accelerator.is_main_process:
                _save_state(last, accelerator.unwrap_model(model), tokenizer, optimizer, step, {"total": total_steps})
            accelerator.wait_for_everyone()
    model.eval()
    if gradient_checkpointing:
        _set_checkpointing(accelerator.unwrap_model(model), False)
    if save_to is not None:
        _save_final(accelerator, model, tokenizer, Path(save_to))
    if accelerator.is_main_process:
        for ckpt in (last, last.with_name("last.old")):
            if ckpt.exists():
                shutil.rmtree(ckpt)
    accelerator.wait_for_everyone()
    tail = history[-max(1, len(history) // 10) :] if history else []
    return {k: sum(r[k] for r in tail) / len(tail) for k in (tail[0] if tail else {})}
