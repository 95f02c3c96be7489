"""Fine-tune a recipe's policy with train() and save it as checkpoints/<name>, in one process or under accelerate.

Every recipe phase that trains the policy (BC, Q-Evolve's policy update, ETO's DPO, RSD's distillation, GT-SFT,
BoN + SFT, the context warm start) goes through `finetune`, and the phase runs on every rank
(`run.phase(..., all_ranks=True)`): each rank builds the same samples from the run folder, `train` splits every
optimiser step's micro-batches across the ranks, and exactly one complete save_pretrained folder is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentevo import dist
from agentevo.config import OptimConfig
from agentevo.models import placement
from agentevo.models.policy import with_lora
from agentevo.train.loop import LossFn, train

if TYPE_CHECKING:
    from agentevo.run import Run


def finetune(
    run: Run,
    policy: Any,
    samples: list[Any],
    loss_fn: LossFn,
    name: str,
    *,
    optim: OptimConfig | None = None,
    seed: int | None = None,
    log_phase: str | None = None,
    model: Any = None,
    merge_lora: bool = True,
    reload_after: bool = False,
    **train_kwargs: Any,
) -> dict[str, float]:
    """Train `policy` on `samples` and save it as checkpoints/<name>; returns train()'s final statistics.

    `model` is what train() optimises (default: the policy's model, wrapped with LoRA when model.lora.enabled);
    with `merge_lora` LoRA adapters are merged and the whole model is saved, else the adapter folder. Several
    processes with full fine-tuning: train() gathers the weights from any layout (DDP, FSDP, ZeRO-3) and rank 0
    writes the folder; one process, or LoRA (whole model on every rank): rank 0 saves the policy as it is.
    `reload_after` reloads the saved weights into the policy on every rank, for phases that use the trained model
    afterwards (under FSDP / ZeRO-3 each rank holds only a shard).
    """
    cfg = run.cfg
    lora = cfg.model.lora.enabled
    if model is None:
        model = with_lora(policy, cfg)
    target = run.checkpoint_dir(name)
    save_to: Path | None = target if dist.world_size() > 1 and not lora else None
    with run.progress(f"{name} training") as bar:
        stats = train(model, samples, loss_fn, optim or cfg.optim, policy.pad_id, run.checkpoint_dir(f"{name}-work"),
                      cfg.seed if seed is None else seed, run.logger, log_phase or f"{name}/train", policy.tokenizer,
                      bar.training_callback(), save_to=save_to, **train_kwargs)
    if lora and merge_lora:
        policy.model = policy.model.merge_and_unload()
    policy.policy_id = name
    if save_to is None and run.main:
        policy.save(target)
    dist.barrier()
    if reload_after and save_to is not None:
        from agentevo.models.backend import load_pretrained

        policy.model = load_pretrained(target)[0].eval()
    # what the phase computed in (model.dtype auto resolves per machine), so state.json says what ran
    return {**stats, "processes": dist.world_size(), "precision": placement.describe()}
