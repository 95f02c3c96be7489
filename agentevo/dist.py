"""Recipes under `accelerate launch`: which process this is, and rank-0 work shared with the other ranks.

A recipe runs in every process. Phases that collect, evaluate or write the run folder run on rank 0 only; their
JSON result is broadcast so every rank follows the same path. Phases that train run on every rank (DDP / FSDP /
DeepSpeed through `train()`), and rank 0 writes what they save. With one process (the default) every helper is a
no-op and nothing touches torch.distributed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

# Waiting ranks sit in a collective while rank 0 collects or evaluates; at scale that takes hours.
WAIT_TIMEOUT = timedelta(hours=int(os.environ.get("AGENTEVO_DIST_TIMEOUT_HOURS", "24")))


def world_size() -> int:
    """Processes started by `accelerate launch` / torchrun (WORLD_SIZE), 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes of this run on this machine (LOCAL_WORLD_SIZE, else WORLD_SIZE), 1 otherwise."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world_size())


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def ensure_group() -> None:
    """Join the process group with a long timeout before accelerate would start it with its 30-minute default."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=WAIT_TIMEOUT)


def broadcast(obj: Any) -> Any:
    """Rank 0's obj on every rank (JSON-like objects); obj itself with one process."""
    if world_size() == 1:
        return obj
    import torch.distributed as dist

    ensure_group()
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world_size() == 1:
        return
    import torch.distributed as dist

    ensure_group()
    dist.barrier()
