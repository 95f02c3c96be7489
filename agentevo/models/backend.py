"""The transformers policy backend: batched generation with token ids and log-probs, scoring, save/load."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentevo.agent.chat import ChatRenderer
from agentevo.data.tensors import pad_sequences
from agentevo.errors import AgentevoError, ConfigError
from agentevo.files import replacing_dir, write_text_atomic
from agentevo.models import placement
from agentevo.models.prefix_cache import (
    PrefixKVCache,
    SlotKVCache,
    generate_cached,
    generate_slots,
    supports_prefix_cache,
    supports_slot_cache,
)


def _quiet_transformers() -> None:
    """transformers prints a progress bar for every shard it reads or writes; runs have their own bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


_quiet_transformers()

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class DamagedCheckpointError(AgentevoError):
    """A checkpoint file is missing, truncated or altered (its content hash differs from the folder's manifest)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | Path) -> Path:
    """Record the sha256 of every file under folder in folder/manifest.json; call it last, when the folder is
    complete (the manifest itself is written atomically)."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): _sha256(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and not (p.parent == folder and p.name in (MANIFEST, MANIFEST + ".tmp"))}
    return write_text_atomic(folder / MANIFEST, json.dumps({"sha256": files}, indent=1))


def verify_manifest(folder: str | Path) -> bool:
    """Check a checkpoint folder's files against its manifest.json: True when they match, False when the folder has
    no manifest (written before manifests existed: loaded unverified); DamagedCheckpointError naming the file else."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.exists():
        log.debug("%s has no %s; loading it unverified", folder, MANIFEST)
        return False
    fix = "re-create the checkpoint (rerun the phase that wrote it) or copy it again from where it came"
    try:
        files = json.loads(manifest.read_text())["sha256"]
        entries = [(str(k), str(v)) for k, v in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"checkpoint manifest {manifest} is unreadable ({exc}); {fix}") from exc
    for rel, digest in entries:
        path = folder / rel
        if not path.is_file():
            raise DamagedCheckpointError(f"checkpoint file {path} is missing (listed in {manifest}); {fix}")
        if _sha256(path) != digest:
            raise DamagedCheckpointError(f"checkpoint file {path} is damaged: its sha256 differs from the one in "
                                         f"{manifest}; {fix}")
    return True


@dataclass(frozen=True)
class Sampling:
    """Decoding settings for one generate call (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    seed: int | None = None
    top_k: int = 0  # sample from the k most likely tokens only (0 = all)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Generation:
    """One reply: the generated token ids (ending with a stop token when it stopped), their log-probs, text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str


def set_torch_threads(threads: int) -> int:
    """Use the given thread count (Run picks it: the config's, the first start's, or the idle cores); returns it."""
    torch.set_num_threads(threads)
    return threads


class TransformersPolicy:
    """A causal LM from transformers acting as a policy: generate(), token_logprobs(), save()."""

    def __init__(
        self, model: Any, tokenizer: Any, policy_id: str = "init", batch_size: int = 16, prefix_cache: int = 64,
        prefix_cache_gb: float = 4.0, kv_engine: str = "slots", shared_prefix_attention: bool | None = None,
    ) -> None:
        """prefix_cache: sequences whose keys/values are kept for reuse across turns (0 = off, plain generate),
        in at most prefix_cache_gb GiB. kv_engine 'slots': persistent per-sequence KV rows extended in place
        (sdpa/eager attention); 'prefix': the earlier path that rebuilds a padded cache per call (kept for the
        bench); a model the slot path cannot run uses 'prefix'. shared_prefix_attention (slots): decode attention
        reads the prefix all rows of a call share once per step, not once per row (None: on the CPU only)."""
        if kv_engine not in ("slots", "prefix"):
            raise ConfigError(f"kv_engine must be 'slots' or 'prefix' (got {kv_engine!r})")
        self.kv_engine = kv_engine
        self.shared_prefix_attention = shared_prefix_attention
        self.model = model
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.policy_id = policy_id
        self.batch_size = batch_size
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = int(tokenizer.pad_token_id)
        self.kv_cache: PrefixKVCache | SlotKVCache | None = (
            self._new_cache(model, prefix_cache, int(prefix_cache_gb * (1 << 30)))
            if prefix_cache > 0 and supports_prefix_cache(model) else None)

    def _new_cache(self, model: Any, capacity: int, max_bytes: int) -> PrefixKVCache | SlotKVCache:
        if self.kv_engine == "slots" and supports_slot_cache(model):
            return SlotKVCache(model, capacity, max_bytes)
        return PrefixKVCache(model, capacity, max_bytes)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        """Replies for a batch of prompt token ids; batched by length with left padding and a KV cache."""
        self.model.eval()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Generation | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = [prompts[i] for i in chunk]
            with placement.autocast():  # bf16 autocast when model.dtype auto resolved to bf16, else nothing
                gens = (self._generate_cached(batch, sampling) if self._cache_usable()
                        else self._generate_batch(batch, sampling))
            for i, gen in zip(chunk, gens, strict=True):
                out[i] = gen
        return [g for g in out if g is not None]

    def _cache_usable(self) -> bool:
        if self.kv_cache is None:
            return False
        if self.kv_cache.model is not self.model:  # the model was swapped (e.g. wrapped with LoRA)
            self.kv_cache = self._new_cache(self.model, self.kv_cache.capacity, self.kv_cache.max_bytes)
        return True

    def _generate_cached(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        assert self.kv_cache is not None
        args = (self.model, self.kv_cache, prompts, sampling.max_new_tokens,
                0.0 if sampling.greedy else sampling.temperature, sampling.top_p, sampling.top_k,
                self.renderer.stop_ids, self.pad_id)
        if isinstance(self.kv_cache, SlotKVCache):
            replies = generate_slots(*args, shared_prefix=self.shared_prefix_attention)  # type: ignore[arg-type]
        else:
            replies = generate_cached(*args)  # type: ignore[arg-type]
        return [Generation(ids, logps, self.renderer.decode(ids)) for ids, logps in replies]

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        input_ids, attention = pad_sequences(prompts, self.pad_id, left=True)
        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "eos_token_id": self.renderer.stop_ids,
            "pad_token_id": self.pad_id,
            "return_dict_in_generate": True,
            "output_logits": True,
            "top_k": None,
        }
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or None)
        result = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), **kwargs
        )
        new_tokens = result.sequences[:, input_ids.shape[1] :].cpu()
        # Raw (temperature-1) logits: the stored log-probs are log pi(a|s) of the policy itself, what ratios need.
        logits = torch.stack(result.logits, dim=1).float().cpu()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        stops = set(self.renderer.stop_ids)
        gens = []
        for row in range(len(prompts)):
            ids = new_tokens[row].tolist()
            n = len(ids)
            for j, tok in enumerate(ids):
                if tok in stops:
                    n = j + 1
                    break
            ids = ids[:n]
            gens.append(Generation(ids, logp[row, :n].tolist(), self.renderer.decode(ids)))
        return gens

    def save(self, path: str | Path) -> Path:
        """Write a save_pretrained folder atomically (temp folder, then rename)."""
        return save_pretrained_atomic(self.model, self.tokenizer, path)


def save_pretrained_atomic(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """save_pretrained into path.tmp, then swap it into place so a crash never leaves a half-written folder."""
    path = Path(path)
    with replacing_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
    return path


def require_checkpoint(path: Path) -> None:
    """Refuse a folder that is not a save_pretrained checkpoint (no config.json), naming the one inside it if any
    (a run's `checkpoints/latest/` keeps its model in `latest/model/`)."""
    if not (path / "config.json").exists():
        inner = path / "model"
        hint = f"; the model inside it is {inner}" if (inner / "config.json").exists() else ""
        raise ConfigError(f"could not load a causal LM from {str(path)!r}: it is not a model checkpoint "
                          f"(no config.json){hint}; give a checkpoint folder such as runs/NAME/checkpoints/bc")


def load_pretrained(path: str | Path, gguf_file: str | None = None,
                    attn_implementation: str | None = None) -> tuple[Any, Any]:
    """Load a local causal LM and its tokenizer on this process's device and dtype (models/placement.py; fp32 on
    the CPU by default); GGUF files are dequantised and made saveable. `path` is a folder or a hub id found offline
    in the local Hugging Face cache; attn_implementation None = the process's model.attn_implementation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = placement.resolve_model_path(path, "model path")  # never the network: local_files_only below too
    kwargs: dict[str, Any] = {"local_files_only": True}
    attn = attn_implementation or placement.attn_implementation()
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    else:
        require_checkpoint(p)
    verify_manifest(p)  # a damaged or altered checkpoint is an error, never silently different weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, **kwargs,
                                                     **({"attn_implementation": attn} if attn else {}))
    except (OSError, ValueError) as exc:  # missing files; a folder without a tokenizer raises ValueError
        raise ConfigError(f"could not load a causal LM from {str(p)!r}: {exc}") from exc
    if gguf_file:
        # A GGUF-loaded model refuses save_pretrained; rebuild it as a plain fp32 model with the same weights.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 **({"attn_implementation": attn} if attn else {}))
        plain.load_state_dict(model.state_dict())
        model = plain
    model = placement.place(model)
    tokenizer.padding_side = "left"
    return model, tokenizer
