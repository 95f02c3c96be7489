"""Where models live: model.device, model.dtype and model.attn_implementation, resolved once per process and
applied to every loaded model.

`auto` puts a process's models on its own GPU (cuda:LOCAL_RANK under `accelerate launch` / torchrun) when torch sees
one, else on the CPU. model.dtype float32 / bfloat16 / float16 is the weights' dtype (bf16 / fp16 train in that
precision); `auto` keeps float32 weights and runs training forwards and generation under bf16 autocast where the
hardware has bf16 (a CUDA GPU that supports it, or a CPU with AMX-BF16 / AVX512-BF16, which machines differ in, so
it is detected: `detect_bf16`), and plain float32 elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentevo.errors import ConfigError
from agentevo.machine import parse_cpuinfo

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

_settings: dict[str, Any] = {"device": "auto", "dtype": "float32", "attn": None}


@dataclass(frozen=True)
class Bf16Support:
    """Whether a device computes in bf16 natively, and the evidence (for the run's log and state.json)."""

    device: str
    bf16: bool
    why: str


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
    """The weights' dtype named by model.dtype (auto: float32 weights, bf16 comes from autocast)."""
    if name == AUTO:
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)} (got {name!r}) or auto (bf16 autocast "
                          "where the hardware has bf16, float32 elsewhere)")
    return DTYPES[name]


def check_attn_implementation(name: str | None) -> None:
    """ConfigError unless model.attn_implementation is null or one transformers can run here."""
    if name is None:
        return
    if name not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation must be null (transformers' default) or one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)} (got {name!r})")
    if name == "flash_attention_2":
        import importlib.util

        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("model.attn_implementation flash_attention_2 needs a CUDA GPU and the flash-attn "
                              "package (pip install flash-attn); use sdpa or null here")


def _read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text, None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _cpu_bf16() -> tuple[bool, str]:
    text = _read_cpuinfo()
    if text is not None:
        features = parse_cpuinfo(text)[1]
        found = [f for f in CPU_BF16_FLAGS if f in features]
        if found:
            return True, f"CPU flags {', '.join(found)} in /proc/cpuinfo"
        return False, f"no {' / '.join(CPU_BF16_FLAGS)} flag in /proc/cpuinfo"
    try:  # not Linux: ask torch's own CPU probe (a private API, so any failure means 'unknown')
        caps = torch._C._cpu._get_cpu_capability()
        found = [f for f in CPU_BF16_FLAGS if caps.get(f)]
    except Exception:  # noqa: BLE001
        return False, "no /proc/cpuinfo and torch reports no CPU capabilities"
    if found:
        return True, f"torch reports CPU {', '.join(found)}"
    return False, f"torch reports no {' / '.join(CPU_BF16_FLAGS)} on this CPU"


def detect_bf16(device: torch.device | str | None = None) -> Bf16Support:
    """Whether `device` (default: this process's) has native bf16: a CUDA GPU with torch.cuda.is_bf16_supported(),
    or a CPU with AMX-BF16 / AVX512-BF16."""
    dev = torch.device(device) if device is not None else resolve_device(_settings["device"])
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Bf16Support(str(dev), True, "torch.cuda.is_bf16_supported()")
        return Bf16Support(str(dev), False, "this GPU has no bf16 (torch.cuda.is_bf16_supported() is False)")
    ok, why = _cpu_bf16()
    return Bf16Support(str(dev), ok, why)


def configure(device: str = "auto", dtype: str = "float32", attn_implementation: str | None = None) -> None:
    """Set this process's placement (Run does it from the config); the names are checked here, and the precision
    that model.dtype resolves to is logged once."""
    resolve_device(device)
    resolve_dtype(dtype)
    check_attn_implementation(attn_implementation)
    changed = (_settings["device"], _settings["dtype"]) != (device, dtype) or "bf16" not in _settings
    _settings.update(device=device, dtype=dtype, attn=attn_implementation)
    if dtype == AUTO:
        if changed:
            _settings["bf16"] = detect_bf16(resolve_device(device))
            log.info("precision: %s", describe())
    else:
        _settings.pop("bf16", None)


def device() -> torch.device:
    """This process's model device."""
    return resolve_device(_settings["device"])


def dtype() -> torch.dtype:
    """The dtype loaded and built models' weights take."""
    return resolve_dtype(_settings["dtype"])


def attn_implementation() -> str | None:
    """model.attn_implementation for this process (None = transformers' default)."""
    return _settings["attn"]


def autocast_dtype() -> torch.dtype | None:
    """bf16 when model.dtype is auto and the device has bf16 (training forwards and generation run under
    autocast then), else None."""
    if _settings["dtype"] != AUTO:
        return None
    support = _settings.get("bf16")
    if support is None:
        support = _settings["bf16"] = detect_bf16(device())
    return torch.bfloat16 if support.bf16 else None


def autocast() -> contextlib.AbstractContextManager[Any]:
    """The autocast context for a forward pass: bf16 autocast on this process's device, or nothing."""
    dt = autocast_dtype()
    if dt is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device().type, dtype=dt)


def describe() -> str:
    """One line saying what precision this process computes in, and why (for logs and state.json)."""
    name = _settings["dtype"]
    if name != AUTO:
        return f"{name} weights on {device()} (model.dtype {name})"
    support = _settings.get("bf16") or detect_bf16(device())
    if support.bf16:
        return (f"float32 weights, bf16 autocast for training and generation on {support.device} "
                f"(model.dtype auto: {support.why})")
    return f"float32 on {support.device} (model.dtype auto: {support.why})"


def place(model: Any) -> Any:
    """Move a freshly built or loaded model to this process's device and dtype."""
    return model.to(device=device(), dtype=dtype())


# -- models named as on the Hugging Face Hub -------------------------------------------------------------------

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(path: str) -> bool:
    """True for 'org/name' (one slash, no leading ./ or ~): what model.path means when no such folder exists."""
    return bool(_REPO_ID.match(path)) and ".." not in path


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub, else
    huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model_path(path: str | Path, what: str = "model.path") -> Path:
    """A local folder as given, or the local Hugging Face cache's snapshot of a hub id ('Qwen/Qwen2.5-0.5B-Instruct'),
    found offline (the network is never used); ConfigError naming how to get it when it is neither."""
    try:
        p = Path(path).expanduser()
        if p.exists():
            return p
    except (OSError, RuntimeError, ValueError):  # '~nobody/x' (no such home), a NUL byte: no such folder either
        pass
    name = str(path)
    if looks_like_repo_id(name):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        cache = hub_cache_dir()
        try:
            return Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
            raise ConfigError(
                f"{what} {name!r} is neither a local folder nor a model in the local Hugging Face cache ({cache}); "
                f"run `hf download {name}` (older huggingface_hub: `huggingface-cli download`) on a machine with network "
                "and copy that cache here (or set HF_HOME / HF_HUB_CACHE to where it is), or give a local "
                "save_pretrained folder") from None
    raise ConfigError(
        f"{what} {name!r} does not exist; give a local model folder (a transformers save_pretrained directory, or a "
        "folder holding a GGUF file with model.gguf_file), a hub id such as Qwen/Qwen2.5-0.5B-Instruct that is in "
        "the local Hugging Face cache, or null for the embedded tiny model")
