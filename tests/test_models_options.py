"""Model options: hub ids from the local HF cache, dtype auto (bf16 detection + autocast), attention kernel, chat
template override and gradient checkpointing."""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.bc import nll_loss
from agentevo.config import ModelConfig, OptimConfig, load_config
from agentevo.data.tensors import trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.models import placement
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained
from agentevo.train.loop import train

REPO = Path(__file__).resolve().parents[1]
FLAGS_WITH = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_tile amx_bf16 avx512_bf16 amx_int8\n"
FLAGS_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
CORPUS = ["You are in the kitchen. take knife open fridge", "Thought: I need the knife.\nAction: take knife"] * 20


def _samples(policy, n: int):  # noqa: ANN001, ANN202
    """n two-step expert trajectories as packed training rows (as in test_trainer)."""
    out = []
    for k in range(n):
        task = Task("twx-cookingworld", f"t{k}", "train", "cookingworld", {}, 20)
        steps = []
        for t, action in enumerate(["take knife", "open fridge"], start=1):
            text = expert_reply(action)
            steps.append(Step(t, f"obs {k} {t}", text, policy.renderer.encode_reply(text), None, parse_action(text),
                              "next", 0.0, False))
        traj = Trajectory(task, "expert", "expert", "Instruction.", steps, 1.0, True, goal="g")
        out.extend(trajectory_samples(policy.renderer, traj, k, 10, 1024))
    return out


# -- bf16 detection --------------------------------------------------------------------------------------------


def test_cpu_bf16_is_read_from_the_cpuinfo_flags(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: FLAGS_WITH)
    assert placement.detect_bf16("cpu") == placement.Bf16Support(
        "cpu", True, "CPU flags amx_bf16, avx512_bf16 in /proc/cpuinfo")
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: FLAGS_WITHOUT)
    assert placement.detect_bf16("cpu") == placement.Bf16Support(
        "cpu", False, "no amx_bf16 / avx512_bf16 flag in /proc/cpuinfo")
    # no /proc/cpuinfo (not Linux): torch's CPU probe decides
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: None)
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: {"amx_bf16": False, "avx512_bf16": True})
    assert placement.detect_bf16("cpu") == placement.Bf16Support("cpu", True, "torch reports CPU avx512_bf16")


def test_cuda_bf16_follows_torch(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert placement.detect_bf16(torch.device("cuda", 1)) == placement.Bf16Support(
        "cuda:1", True, "torch.cuda.is_bf16_supported()")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert not placement.detect_bf16("cuda:0").bf16
    # auto on a (mocked) bf16 GPU: float32 weights, bf16 autocast on cuda
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    placement.configure("auto", "auto")
    assert (placement.device(), placement.dtype(), placement.autocast_dtype()) == (
        torch.device("cuda", 0), torch.float32, torch.bfloat16)
    assert placement.describe() == ("float32 weights, bf16 autocast for training and generation on cuda:0 "
                                    "(model.dtype auto: torch.cuda.is_bf16_supported())")


def test_auto_resolves_per_machine_and_explicit_dtypes_never_autocast(monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: FLAGS_WITHOUT)
    with caplog.at_level("INFO", logger="agentevo.models.placement"):
        placement.configure("cpu", "auto")
        placement.configure("cpu", "auto")  # the same decision again: logged once
    assert [r.getMessage() for r in caplog.records] == [
        "precision: float32 on cpu (model.dtype auto: no amx_bf16 / avx512_bf16 flag in /proc/cpuinfo)"]
    assert placement.autocast_dtype() is None and placement.dtype() == torch.float32
    assert placement.describe() == "float32 on cpu (model.dtype auto: no amx_bf16 / avx512_bf16 flag in /proc/cpuinfo)"
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: FLAGS_WITH)
    placement.configure("cpu", "float32")
    assert placement.autocast_dtype() is None and placement.describe() == "float32 weights on cpu (model.dtype float32)"
    placement.configure("cpu", "auto")
    assert placement.autocast_dtype() == torch.bfloat16
    ModelConfig(dtype="auto").validate()
    with pytest.raises(ConfigError, match=r"model.dtype must be one of float32, bfloat16, float16 \(got 'bf16'\) or "
                                          r"auto \(bf16 autocast where the hardware has bf16"):
        ModelConfig(dtype="bf16").validate()


def _linear_dtypes(model) -> list[torch.dtype]:  # noqa: ANN001
    """Records the output dtype of the first decoder layer's MLP down-projection on every forward."""
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    return seen


@pytest.mark.parametrize(("dtype", "flags", "expected"), [
    ("auto", FLAGS_WITH, torch.bfloat16), ("auto", FLAGS_WITHOUT, torch.float32), ("float32", FLAGS_WITH, torch.float32),
], ids=["auto-bf16-cpu", "auto-no-bf16-cpu", "float32"])
def test_training_forward_and_generation_run_under_bf16_autocast_when_auto_resolves_to_bf16(
        tiny_policy, tmp_path, monkeypatch, dtype, flags, expected) -> None:  # noqa: ANN001
    monkeypatch.setattr(placement, "_read_cpuinfo", lambda: flags)
    placement.configure("cpu", dtype)
    model = copy.deepcopy(tiny_policy.model)
    seen = _linear_dtypes(model)
    cfg = OptimConfig(lr=1e-3, epochs=1, batch_size=2, micro_batch_size=2, save_every=0)
    stats = train(model, _samples(tiny_policy, 2), nll_loss, cfg, tiny_policy.pad_id, tmp_path / "w", seed=0)
    assert seen and set(seen) == {expected}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights stay fp32
    assert stats["loss"] == stats["loss"]  # a number, not NaN
    for cache in (0, 8):  # plain generate, and the prefix-cached path
        policy = TransformersPolicy(model, tiny_policy.tokenizer, "p", prefix_cache=cache)
        seen.clear()
        policy.generate([[1, 5, 6]], Sampling(max_new_tokens=2))
        assert seen and set(seen) == {expected}, cache


# -- hub ids from the local Hugging Face cache -----------------------------------------------------------------


def _no_network(monkeypatch) -> None:  # noqa: ANN001
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_hub_id_in_the_local_cache_loads_offline(tiny_policy, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"
    tiny_policy.save(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _no_network(monkeypatch)
    assert placement.resolve_model_path("acme/tiny-chat") == repo / "snapshots" / commit
    cfg = load_config(REPO / "configs" / "demo_twx_bc.yaml", ["model.path=acme/tiny-chat"])
    assert cfg.model.path == "acme/tiny-chat"  # the config keeps the id; it is resolved where models load
    model, tokenizer = load_pretrained("acme/tiny-chat")
    ref = dict(tiny_policy.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name
    assert tokenizer.get_vocab() == tiny_policy.tokenizer.get_vocab()
    # HF_HUB_CACHE names the cache directly and wins over HF_HOME
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError) as err:
        ModelConfig(path="acme/tiny-chat").validate()
    assert str(err.value) == (
        f"model.path 'acme/tiny-chat' is neither a local folder nor a model in the local Hugging Face cache "
        f"({tmp_path / 'elsewhere'}); run `hf download acme/tiny-chat` (older huggingface_hub: `huggingface-cli "
        "download`) on a machine with network and copy that cache here (or set HF_HOME / HF_HUB_CACHE to where it "
        "is), or give a local save_pretrained folder")


def test_a_path_that_is_no_hub_id_is_a_missing_folder(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=r"model.path '.*/a/b' does not exist; give a local model folder .* a hub "
                                          r"id such as Qwen/Qwen2.5-0.5B-Instruct that is in the local Hugging Face"):
        ModelConfig(path=str(tmp_path / "a" / "b")).validate()
    with pytest.raises(ConfigError, match="model path 'runs/x/checkpoints/bc' does not exist"):
        load_pretrained("runs/x/checkpoints/bc")


# -- attention kernel ------------------------------------------------------------------------------------------


def test_attn_implementation_reaches_built_and_loaded_models(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    cfg = load_config(None, ["model.attn_implementation=eager", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
                             "model.tiny.vocab_size=300"])
    from agentevo.models.policy import initial_policy

    assert initial_policy(cfg, CORPUS).model.config._attn_implementation == "eager"
    tiny_policy.save(tmp_path / "m")
    assert load_pretrained(tmp_path / "m", attn_implementation="eager")[0].config._attn_implementation == "eager"
    placement.configure("cpu", "float32", attn_implementation="eager")  # the process's setting for every later load
    assert load_pretrained(tmp_path / "m")[0].config._attn_implementation == "eager"
    placement.configure("cpu", "float32")
    assert load_pretrained(tmp_path / "m")[0].config._attn_implementation == "sdpa"  # transformers' default


def test_attn_implementation_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"model.attn_implementation must be null \(transformers' default\) or one "
                                          r"of eager, sdpa, flash_attention_2 \(got 'flash'\)"):
        ModelConfig(attn_implementation="flash").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="flash_attention_2 needs a CUDA GPU and the flash-attn package"):
            ModelConfig(attn_implementation="flash_attention_2").validate()


# -- chat template override ------------------------------------------------------------------------------------

TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>[' + message['content'] + ']</s>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def test_a_chat_template_file_replaces_the_tokenizers_and_is_saved(tmp_path) -> None:  # noqa: ANN001
    from agentevo.agent.chat import Message
    from agentevo.models.policy import initial_policy

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    cfg = load_config(None, [f"model.chat_template={path}", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
                             "model.tiny.vocab_size=300"])
    policy = initial_policy(cfg, CORPUS)
    tok = policy.tokenizer
    reply = policy.renderer.encode_reply("take knife")
    rendered = policy.renderer.render([Message("user", "open fridge"), Message("assistant", ids=reply)], True)
    assert tok.decode(rendered.ids) == "<|user|>[open fridge]</s><|assistant|>[take knife]</s><|assistant|>"
    assert policy.renderer.end_of_turn_id == tok.convert_tokens_to_ids("]")  # the file's framing, not <|end|>
    policy.save(tmp_path / "ckpt")
    assert load_pretrained(tmp_path / "ckpt")[1].chat_template == TEMPLATE  # later loads render the same way


def test_a_bad_chat_template_file_is_a_config_error(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=r"model.chat_template '.*nope.jinja' cannot be read \(FileNotFoundError\)"):
        ModelConfig(chat_template=str(tmp_path / "nope.jinja")).validate()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ConfigError, match=r"model.chat_template '.*bad.jinja' is not a valid Jinja template \(.* at "
                                          r"line 1\); fix the file, or set model.chat_template to null"):
        ModelConfig(chat_template=str(bad)).validate()


# -- gradient checkpointing ------------------------------------------------------------------------------------


def test_gradient_checkpointing_recomputes_and_gives_the_same_training(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    samples = _samples(tiny_policy, 4)
    runs = {}
    for on in (False, True):
        model = copy.deepcopy(tiny_policy.model)
        calls: list[int] = []
        grad_norms: list[float] = []
        # a pre-hook inside the layer: the recompute stops early once the tensors the backward needs are back
        model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, i, calls=calls: calls.append(1))
        cfg = OptimConfig(lr=5e-3, epochs=1, batch_size=4, micro_batch_size=2, save_every=0, gradient_checkpointing=on)
        train(model, samples, nll_loss, cfg, tiny_policy.pad_id, tmp_path / f"w{on}", seed=0,
              on_step=lambda s, n, r, g=grad_norms: g.append(r["grad_norm"]))
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # off again after
        runs[on] = (model, len(calls), grad_norms)
    (plain, n_plain, g_plain), (ckpt, n_ckpt, g_ckpt) = runs[False], runs[True]
    assert (n_plain, n_ckpt) == (2, 4)  # 2 micro-batches; checkpointing runs the layer again in each backward
    assert g_ckpt == pytest.approx(g_plain, rel=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_the_8b_configs_turn_checkpointing_on_and_the_key_is_validated() -> None:
    for name in ("qevolve", "rsd", "selfguide"):
        cfg = load_config(REPO / "configs" / "scale" / f"{name}_qwen3_8b.yaml", ["model.path=null"])
        assert cfg.optim.gradient_checkpointing is True, name
    assert load_config(None).optim.gradient_checkpointing is False
    with pytest.raises(ConfigError, match="optim.gradient_checkpointing must be true or false"):
        load_config(None, ["optim.gradient_checkpointing=sometimes"])
