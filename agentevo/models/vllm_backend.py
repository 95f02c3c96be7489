"""The vLLM policy backend: fast batched generation from token-id prompts, with the TransformersPolicy interface.

`VLLMPolicy.generate(prompt_ids_list, Sampling) -> [Generation(token_ids, logprobs, text)]` works like
TransformersPolicy.generate: token-id prompts (the renderer's, history replies spliced in as stored ids), replies
ending with their stop token, and the log-probs of the sampled tokens under the raw policy (temperature 1: vLLM's
default `raw_logprobs` mode computes them before temperature, penalties and top-p), so trajectories it collects
train ratio-based methods unchanged.

New weights after a training round:
* `refresh(path)` loads a save_pretrained folder into the running engine (a worker extension calls the model's
  `load_weights` on every GPU worker, then the prefix cache is dropped); if the engine refuses, it is re-created.
  Offline rounds (Q-Evolve, RSD) call it once per round; on-policy GRPO / Self-Guide call it after every update
  (save to a fast local disk such as /dev/shm first).
* `load_adapter(path)` switches to a LoRA adapter folder (engine built with enable_lora), without touching the base.
* `sleep()` / `wake_up()` free and restore the engine's GPU memory (enable_sleep_mode) so training can use the
  same GPUs between collection phases.

vLLM is imported only when a VLLMPolicy is built: without it (or without a GPU) the error names
`pip install 'agentevo[vllm]'`.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentevo.errors import ConfigError, MissingDependencyError
from agentevo.options import check_choice, check_fields, option

if TYPE_CHECKING:  # backend imports torch; this module stays light so config.py can import VLLMConfig
    from agentevo.models.backend import Generation, Sampling

log = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class VLLMConfig:
    """The vLLM engine used for rollouts and evaluation (model.backend = vllm)."""

    gpu_memory_utilization: float = option("fraction of each GPU's memory vLLM may take (weights + KV cache)", 0.85,
                                           gt=0, le=1)
    tensor_parallel_size: int = option("GPUs one engine spans (8B fits one GPU; 1 is fastest when it fits)", 1, ge=1)
    max_model_len: int | None = option("longest prompt + reply in tokens (null = the model's own limit)", None, ge=16)
    dtype: str = option("weights and activations: auto (the checkpoint's), bfloat16, float16, float32", "auto")
    enable_lora: bool = option("serve LoRA adapters per round (load_adapter) instead of merged checkpoints", False)
    max_lora_rank: int = option("largest LoRA rank the engine accepts (>= model.lora.r)", 64, ge=1)
    enable_prefix_caching: bool = option("reuse the KV cache of shared prompt prefixes (multi-turn prompts)", True)
    enable_sleep_mode: bool = option("allow sleep()/wake_up() to lend the GPUs to training between rounds", False)
    enforce_eager: bool = option("no CUDA graphs (slower, starts faster; for debugging)", False)

    def validate(self) -> None:
        check_fields(self, "model.vllm")  # the ranges declared on the fields
        check_choice("model.vllm", "dtype", self.dtype, DTYPES)


def _vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(
            "model.backend = vllm needs vLLM and a CUDA GPU: pip install 'agentevo[vllm]' "
            "(or set model.backend to transformers)"
        ) from exc
    return vllm


class WeightLoaderExtension:
    """Mixed into each vLLM GPU worker (worker_extension_cls): loads a checkpoint folder's weights in place."""

    def agentevo_load_weights(self, path: str) -> int:
        """Stream every tensor of path/*.safetensors into the worker's model; returns the tensor count."""
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        count = 0

        def tensors() -> Any:
            nonlocal count
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as fh:
                    for name in fh.keys():
                        count += 1
                        yield name, fh.get_tensor(name)

        # model.load_weights maps checkpoint names to vLLM's fused layers (qkv, gate_up) and shards them for TP
        self.model_runner.model.load_weights(weights=tensors())  # type: ignore[attr-defined]
        return count


class VLLMPolicy:
    """A checkpoint served by an in-process vLLM engine: generate(), refresh(), load_adapter(), renderer, pad_id."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: Any = None,
        policy_id: str = "init",
        cfg: VLLMConfig | None = None,
        seed: int = 0,
        lora_path: str | Path | None = None,
    ) -> None:
        from agentevo.agent.chat import ChatRenderer

        _vllm()
        self.cfg = cfg or VLLMConfig()
        self.cfg.validate()
        self.seed = seed
        self.model_path = Path(model_path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = int(tokenizer.pad_token_id)
        self.policy_id = policy_id
        self.weights_id = policy_id  # which weights the engine holds (policy_id also names a served adapter)
        self._lora: Any = None
        self._lora_ids = 0
        self.llm = self._engine(self.model_path)
        if lora_path is not None:
            self.load_adapter(lora_path, policy_id)

    def _engine(self, path: Path) -> Any:
        vllm = _vllm()
        c = self.cfg
        kwargs: dict[str, Any] = {
            "model": str(path),
            "tokenizer": str(path),
            "dtype": c.dtype,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "tensor_parallel_size": c.tensor_parallel_size,
            "enable_prefix_caching": c.enable_prefix_caching,
            "enforce_eager": c.enforce_eager,
            "seed": self.seed,
            "worker_extension_cls": f"{__name__}.WeightLoaderExtension",
        }
        if c.max_model_len is not None:
            kwargs["max_model_len"] = c.max_model_len
        if c.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=c.max_lora_rank, max_loras=1)
        if c.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        try:
            return vllm.LLM(**kwargs)
        except RuntimeError as exc:
            if "CUDA" in str(exc) or "GPU" in str(exc) or "device" in str(exc).lower():
                raise MissingDependencyError(f"vLLM could not start on this machine (it needs a CUDA GPU): {exc}") from exc
            raise

    # -- generation ------------------------------------------------------------------------------
    def _params(self, sampling: Sampling, k: int) -> Any:
        vllm = _vllm()
        # One seed per prompt: identical prompts (a GRPO group) must still get different samples.
        seed = None if sampling.seed is None else sampling.seed + k
        return vllm.SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 and not sampling.greedy else -1,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob only
            stop_token_ids=list(self.renderer.stop_ids),
            skip_special_tokens=True,
        )

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        """Replies for a batch of token-id prompts (vLLM schedules the whole batch itself)."""
        if not prompts:
            return []
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        params = [self._params(sampling, k) for k in range(len(prompts))]
        outputs = self.llm.generate(requests, params, lora_request=self._lora, use_tqdm=False)
        return [self._generation(out.outputs[0]) for out in outputs]

    def _generation(self, completion: Any) -> Generation:
        from agentevo.models.backend import Generation

        ids = [int(t) for t in completion.token_ids]
        logprobs: list[float] = []
        for pos, tok in zip(completion.logprobs or [], ids, strict=False):
            entry = pos[tok]  # {token_id: Logprob}; the sampled token is always present
            logprobs.append(float(entry.logprob))
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        return Generation(ids, logprobs, completion.text)

    # -- new weights -------------------------------------------------------------------------------
    def refresh(self, path: str | Path, policy_id: str | None = None) -> str:
        """Serve the weights of a save_pretrained folder; returns 'in-place' or 'recreated' (how it was done)."""
        path = Path(path)
        self._lora = None
        how = "in-place"
        try:
            self.llm.collective_rpc("agentevo_load_weights", args=(str(path),))
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        except Exception as exc:  # noqa: BLE001 - any refusal falls back to a fresh engine
            log.warning("vLLM in-place weight load failed (%s); re-creating the engine", exc)
            self.close()
            self.llm = self._engine(path)
            how = "recreated"
        self.model_path = path
        self.policy_id = self.weights_id = policy_id or path.name
        return how

    def load_adapter(self, path: str | Path, policy_id: str | None = None) -> None:
        """Generate with the LoRA adapter in `path` (a peft save_pretrained folder) from now on."""
        if not self.cfg.enable_lora:
            raise ConfigError("load_adapter needs model.vllm.enable_lora: true (the engine reserves LoRA slots at start)")
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1  # a new id per adapter: vLLM caches adapters by id
        self.policy_id = policy_id or Path(path).name
        self._lora = LoRARequest(self.policy_id, self._lora_ids, str(path))

    def drop_adapter(self) -> None:
        """Generate with the base weights again."""
        self._lora = None
        self.policy_id = self.weights_id

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights offloaded, KV cache dropped) while training runs."""
        if not self.cfg.enable_sleep_mode:
            raise ConfigError("sleep() needs model.vllm.enable_sleep_mode: true")
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Take the GPU memory back after sleep()."""
        self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down and free its GPU memory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
