"""Building the initial policy of a run: the tiny model trained from environment text, or a local model."""

from __future__ import annotations

from typing import Any

from agentevo.agent.chat import use_chat_template
from agentevo.agent.prompt import FORMAT_ERROR_OBSERVATION
from agentevo.config import RunConfig
from agentevo.data.types import Trajectory
from agentevo.models import placement
from agentevo.models.backend import TransformersPolicy, load_pretrained
from agentevo.models.tiny import build_tiny_model, train_tokenizer


def tokenizer_corpus(instruction: str, trajs: list[Trajectory]) -> list[str]:
    """Environment text for the tiny tokenizer: the instruction, observations, replies and prompt glue."""
    texts = [instruction, FORMAT_ERROR_OBSERVATION, "Observation: Goal: earlier steps omitted. Thought: Action:"]
    for traj in trajs:
        texts.append(traj.first_obs)
        for step in traj.steps:
            texts.append(step.action_text)
            texts.append(f"Observation: {step.next_obs}")
    return texts


def initial_policy(cfg: RunConfig, corpus: list[str]) -> TransformersPolicy:
    """The run's starting policy: a local model (or a hub id in the local HF cache) when model.path is set, else the
    tiny model; with model.attn_implementation and model.chat_template applied (the template is saved with the
    tokenizer, so every later checkpoint renders with it)."""
    attn = cfg.model.attn_implementation
    if cfg.model.path is not None:
        model, tokenizer = load_pretrained(cfg.model.path, cfg.model.gguf_file, attn_implementation=attn)
    else:
        tokenizer = train_tokenizer(corpus, cfg.model.tiny.vocab_size)
        model = placement.place(build_tiny_model(cfg.model.tiny, tokenizer, cfg.seed, attn_implementation=attn))
    if cfg.model.chat_template is not None:
        use_chat_template(tokenizer, cfg.model.chat_template)
    model.eval()
    return TransformersPolicy(model, tokenizer, "init", cfg.rollout.batch_size, cfg.rollout.prefix_cache,
                              cfg.rollout.prefix_cache_gb, shared_prefix_attention=cfg.rollout.shared_prefix_attention)


def with_lora(policy: TransformersPolicy, cfg: RunConfig) -> Any:
    """Wrap the policy's model with LoRA adapters when model.lora.enabled (returns the model to train)."""
    if not cfg.model.lora.enabled:
        return policy.model
    from peft import LoraConfig, get_peft_model

    lora = cfg.model.lora
    present = {name.split(".")[-1] for name, _ in policy.model.named_modules()}
    targets = [m for m in lora.target_modules if m in present]
    peft_model = get_peft_model(
        policy.model,
        LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                   task_type="CAUSAL_LM"),
    )
    policy.model = peft_model
    return peft_model
