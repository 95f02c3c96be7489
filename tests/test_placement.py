"""model.device / model.dtype: where every loaded model lives."""

from __future__ import annotations

import pytest
import torch

from agentevo.config import ModelConfig
from agentevo.errors import ConfigError
from agentevo.models import placement
from agentevo.models.backend import DamagedCheckpointError, load_pretrained


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")
def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused() -> None:
    assert placement.resolve_device("auto") == torch.device("cpu")
    assert placement.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="model.device is 'cuda' but torch sees no GPU; set model.device: auto or cpu"):
        placement.resolve_device("cuda")
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        ModelConfig(device="cuda:1").validate()


def test_bad_names_name_the_choices() -> None:
    with pytest.raises(ConfigError, match="model.device 'gpu0' is not a device; use auto, cpu, cuda or cuda:N"):
        placement.resolve_device("gpu0")
    with pytest.raises(ConfigError, match="model.device 'meta' is not supported"):
        placement.resolve_device("meta")
    with pytest.raises(ConfigError, match=r"model.dtype must be one of float32, bfloat16, float16 \(got 'fp8'\)"):
        ModelConfig(dtype="fp8").validate()


def test_loaded_models_take_the_configured_dtype(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    tiny_policy.save(tmp_path / "m")
    model, _ = load_pretrained(tmp_path / "m")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    placement.configure("cpu", "bfloat16")
    model, _ = load_pretrained(tmp_path / "m")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # the same weights, rounded to bf16
    ref = dict(tiny_policy.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name].detach().to(torch.bfloat16)), name


def test_run_applies_the_config(tmp_path) -> None:  # noqa: ANN001
    from agentevo.config import load_config
    from agentevo.run import Run

    cfg = load_config("configs/demo_twx_bc.yaml", ["model.dtype=bfloat16", "model.device=cpu"], name="p",
                      output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        assert (placement.device(), placement.dtype()) == (torch.device("cpu"), torch.bfloat16)
    finally:
        run.close()


def test_a_folder_without_a_model_or_tokenizer_is_a_config_error(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="could not load a causal LM from .*empty"):
        load_pretrained(tmp_path / "empty")
    tiny_policy.save(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    # its manifest lists the tokenizer: the damage is named before transformers is asked
    with pytest.raises(DamagedCheckpointError, match="checkpoint file .*tokenizer.json is missing"):
        load_pretrained(tmp_path / "m")
    (tmp_path / "m" / "manifest.json").unlink()  # a folder from before manifests: transformers raises ValueError
    with pytest.raises(ConfigError, match="could not load a causal LM from .*m'"):
        load_pretrained(tmp_path / "m")


def test_scoring_forwards_run_in_the_precision_of_the_loss(tiny_policy, monkeypatch) -> None:  # noqa: ANN001
    """With model.dtype auto on a bf16 CPU, the log-probs a recipe scores before its update (Q-Evolve's pi_old /
    pi_BC and GRPO's reference through reply_logprobs; RSD's teacher through reply_logits) come from bf16 forwards,
    as the loss's forward does, so ratio 1 and KL 0 hold at the first step; under float32 nothing is autocast."""
    import torch

    from agentevo.algorithms.rsd.recipe import reply_logits
    from agentevo.data.tensors import StepSample, collate, reply_logprobs
    from agentevo.models import placement

    seen: list[torch.dtype] = []
    first_linear = next(m for m in tiny_policy.model.modules() if isinstance(m, torch.nn.Linear))
    hook = first_linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    sample = StepSample(input_ids=[5, 6, 7, 8, 9, 10], spans=[(3, 6)], traj_index=0, steps=[0])
    batch = collate([sample], tiny_policy.pad_id)
    try:
        monkeypatch.setattr(placement, "_read_cpuinfo", lambda: "flags : avx512f amx_bf16 avx512_bf16")
        placement.configure("cpu", "auto")
        with torch.no_grad():
            auto, _ = reply_logprobs(tiny_policy.model, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # what the training loop's loss forward computes
                want, _ = reply_logprobs(tiny_policy.model, batch)
        list(reply_logits(tiny_policy.model, [sample], tiny_policy.pad_id, 1))
        placement.configure("cpu", "float32")
        with torch.no_grad():
            fp32, _ = reply_logprobs(tiny_policy.model, batch)
        list(reply_logits(tiny_policy.model, [sample], tiny_policy.pad_id, 1))
    finally:
        hook.remove()  # placement is restored by conftest's _process_settings_restored
    assert seen == [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(auto, want) and not torch.equal(auto, fp32)
    assert torch.allclose(auto, fp32, atol=0.1)  # bf16 rounding of the same function
