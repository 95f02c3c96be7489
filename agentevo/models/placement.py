"""Where models live: model.device and model.dtype, resolved once per process and applied to every loaded model.

`auto` puts a process's models on its own GPU (cuda:LOCAL_RANK under `accelerate launch` / torchrun) when torch sees
one, else on the CPU. The dtype defaults to float32 (the CPU here has no bf16; on GPUs mixed precision comes from
accelerate's `mixed_precision`); bfloat16 halves the memory of rollout, reference and teacher models and trains
in pure bf16.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from agentevo.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_settings: dict[str, str] = {"device": "auto", "dtype": "float32"}


def resolve_device(name: str) -> torch.device:
    """The torch device named by model.device ('auto', 'cpu', 'cuda', 'cuda:N')."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"model.device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device is {name!r} but torch sees no GPU; set model.device: auto or cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"model.device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


def configure(device: str = "auto", dtype: str = "float32") -> None:
    """Set this process's placement (Run does it from the config); both names are checked here."""
    resolve_device(device)
    resolve_dtype(dtype)
    _settings.update(device=device, dtype=dtype)


def device() -> torch.device:
    return resolve_device(_settings["device"])


def dtype() -> torch.dtype:
    return resolve_dtype(_settings["dtype"])


def place(model: Any) -> Any:
    """Move a freshly built or loaded model to this process's device and dtype."""
    return model.to(device=device(), dtype=dtype())
