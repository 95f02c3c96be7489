"""The vLLM backend: config checks and output conversion everywhere; generation only where vLLM and a GPU exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agentevo.errors import ConfigError, MissingDependencyError
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained
from agentevo.models.vllm_backend import VLLMConfig, VLLMPolicy

HAS_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs vLLM and a CUDA GPU (pip install 'agentevo[vllm]')")
REPO = Path(__file__).resolve().parents[1]


def _backend_wired() -> bool:
    from agentevo.config import ModelConfig

    return "backend" in {f.name for f in dataclasses.fields(ModelConfig)}


needs_backend_field = pytest.mark.skipif(
    not _backend_wired(), reason="model.backend is not in agentevo/config.py yet (the scale-out config change)")


def test_config_rejects_impossible_values() -> None:
    VLLMConfig().validate()
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        VLLMConfig(gpu_memory_utilization=1.5).validate()
    with pytest.raises(ConfigError, match="dtype must be one of auto, bfloat16, float16, float32"):
        VLLMConfig(dtype="int4").validate()
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        VLLMConfig(tensor_parallel_size=0).validate()


def test_missing_vllm_names_the_extra(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentevo\[vllm\]'"):
        VLLMPolicy(tmp_path)


def test_outputs_become_generations_with_the_sampled_tokens_logprobs() -> None:
    policy = VLLMPolicy.__new__(VLLMPolicy)  # conversion only: no engine
    lp = SimpleNamespace
    out = SimpleNamespace(token_ids=[5, 9, 2], text="take knife",
                          logprobs=[{5: lp(logprob=-0.5), 7: lp(logprob=-1.0)}, {9: lp(logprob=-0.25)}, {2: lp(logprob=-2.0)}])
    gen = policy._generation(out)
    assert gen.token_ids == [5, 9, 2] and gen.logprobs == [-0.5, -0.25, -2.0] and gen.text == "take knife"
    with pytest.raises(RuntimeError, match="2 log-probs for 3 tokens"):
        policy._generation(SimpleNamespace(token_ids=[5, 9, 2], text="", logprobs=out.logprobs[:2]))


@needs_backend_field
@pytest.mark.parametrize("name", ["qevolve", "rsd", "selfguide"])
def test_scale_configs_load(name: str) -> None:
    from agentevo.config import load_config

    cfg = load_config(REPO / "configs" / "scale" / f"{name}_qwen3_8b.yaml", ["model.path=null"])
    assert cfg.method == name and cfg.model.backend == "vllm" and cfg.model.lora.enabled
    assert cfg.model.vllm.dtype == "bfloat16" and cfg.agent.max_new_tokens == 512
    with pytest.raises(ConfigError, match="model.backend must be one of transformers, vllm, http"):
        load_config(REPO / "configs" / "scale" / f"{name}_qwen3_8b.yaml", ["model.path=null", "model.backend=tgi"])


# -- on a GPU ------------------------------------------------------------------------------------


def _teacher_forced_logprobs(policy: TransformersPolicy, prompt: list[int], reply: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + reply], device=policy.device)
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply, device=policy.device)[:, None])[:, 0].cpu()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_policy):  # noqa: ANN001, ANN201
    """A vLLM engine on a tiny Llama saved from a fresh build (4 layers, 128 hidden: vLLM's kernels accept it)."""
    from agentevo.config import TinyModelConfig
    from agentevo.models.tiny import build_tiny_model

    tok = tiny_policy.tokenizer
    model = build_tiny_model(TinyModelConfig(hidden_size=128, num_layers=4, num_heads=2, intermediate_size=256), tok, 0)
    path = tmp_path_factory.mktemp("vllm") / "init"
    TransformersPolicy(model, tok, "init").save(path)
    policy = VLLMPolicy(path, policy_id="init", cfg=VLLMConfig(dtype="float32", gpu_memory_utilization=0.3,
                                                              enforce_eager=True, max_model_len=1024))
    yield policy, path
    policy.close()


def _prompts(policy: VLLMPolicy) -> list[list[int]]:
    from agentevo.agent.chat import Message

    texts = ["You are in the kitchen. take knife", "Your task is to cook a meal.", "open fridge"]
    return [policy.renderer.render([Message("user", t)], add_generation_prompt=True).ids for t in texts]


@needs_gpu
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_vllm_logprobs_are_the_raw_policys(engine, temperature) -> None:  # noqa: ANN001
    policy, path = engine
    model, tok = load_pretrained(path)
    reference = TransformersPolicy(model.cuda(), tok, "ref")
    prompts = _prompts(policy)
    gens = policy.generate(prompts, Sampling(temperature=temperature, max_new_tokens=16, seed=3))
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids and len(gen.logprobs) == len(gen.token_ids)
        if len(gen.token_ids) < 16:
            assert gen.token_ids[-1] in policy.renderer.stop_ids  # a finished reply ends with its stop token
        # temperature-1 log-probs of the sampled ids, whatever temperature sampled them (what ratios need)
        expected = _teacher_forced_logprobs(reference, prompt, gen.token_ids)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=2e-3), (gen.logprobs, expected)
    if temperature == 0.0:
        direct = reference.generate(prompts, Sampling(max_new_tokens=16))
        assert [g.token_ids for g in gens] == [g.token_ids for g in direct]


@needs_gpu
def test_refresh_serves_new_weights(engine, tmp_path) -> None:  # noqa: ANN001
    policy, path = engine
    model, tok = load_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new = TransformersPolicy(model.cuda(), tok, "round-1")
    new.save(tmp_path / "round-1")
    how = policy.refresh(tmp_path / "round-1", "round-1")
    assert how in ("in-place", "recreated") and policy.policy_id == "round-1"
    prompts = _prompts(policy)
    gens = policy.generate(prompts, Sampling(max_new_tokens=12))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert torch.allclose(torch.tensor(gen.logprobs), _teacher_forced_logprobs(new, prompt, gen.token_ids), atol=2e-3)
    policy.refresh(path, "init")  # back to the module's weights for other tests


def test_run_refreshes_weights_only_when_they_change(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """Run.rollout_policy / rollout_adapter with a stand-in engine: new weights -> refresh, a LoRA round -> adapter
    on the loaded base, back to the base -> adapter dropped, no reload."""
    import agentevo.models.vllm_backend as vb
    from agentevo.config import load_config
    from agentevo.run import Run

    events: list[tuple[str, str]] = []

    class FakeEngine(vb.VLLMPolicy):
        def __init__(self, path, tokenizer, policy_id, cfg, seed) -> None:  # noqa: ANN001
            self.model_path, self.policy_id, self.weights_id, self.cfg, self._lora = path, policy_id, policy_id, cfg, None
            events.append(("start", policy_id))

        def refresh(self, path, policy_id=None) -> str:  # noqa: ANN001
            events.append(("refresh", policy_id))
            self.model_path, self.policy_id, self.weights_id = path, policy_id, policy_id
            return "in-place"

        def load_adapter(self, path, policy_id=None) -> None:  # noqa: ANN001
            events.append(("adapter", policy_id))
            self._lora, self.policy_id = path, policy_id

        def close(self) -> None:
            pass

    monkeypatch.setattr(vb, "VLLMPolicy", FakeEngine)
    cfg = load_config("configs/demo_twx_bc.yaml", ["model.backend=vllm", "model.vllm.enable_lora=true"], name="v",
                      output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        for name in ("bc", "round-1", "rollout"):
            run.checkpoint_dir(name).mkdir(parents=True)
        engine = run.rollout_policy("bc")
        assert run.rollout_policy("bc") is engine  # same weights: nothing happens
        assert run.rollout_adapter("bc", run.checkpoint_dir("round-1"), "round-1").policy_id == "round-1"
        assert run.rollout_policy("bc").policy_id == "bc" and engine._lora is None  # adapter dropped, no reload
        run.rollout_policy("rollout", policy_id="update-1")
        run.rollout_policy("rollout", policy_id="update-1")
        run.rollout_policy("rollout", policy_id="update-2")  # same folder, new weights
        assert events == [("start", "bc"), ("adapter", "round-1"), ("refresh", "update-1"), ("refresh", "update-2")]
    finally:
        run.close()
