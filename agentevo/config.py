"""Typed experiment configuration: dataclasses with help strings, YAML files and dotted overrides."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentevo.algorithms.baselines_config import ETOConfig, QLASSConfig
from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.algorithms.qevolve.config import QEvolveConfig
from agentevo.algorithms.rsd.config import RSDConfig
from agentevo.algorithms.selfguide.config import SelfGuideConfig
from agentevo.errors import ConfigError
from agentevo.models.http_backend import HTTPConfig
from agentevo.models.vllm_backend import VLLMConfig
from agentevo.options import check_choice, check_fields
from agentevo.options import option as _help

BACKENDS = ("transformers", "vllm", "http")
WORKERS = ("thread", "process", "ray")


@dataclass
class EnvConfig:
    """Which environment, its parameters and how many tasks of each split to use."""

    name: str = _help("environment name (see `agentevo envs list`)", "twx-cookingworld")
    params: dict[str, Any] = _help("constructor parameters of the environment", factory=dict)
    n_train: int | None = _help("training tasks (first n of the fixed train list; null = all)", 200, ge=1)
    n_dev: int | None = _help("validation tasks (first n of the fixed dev list)", 50, ge=1)
    n_test: int | None = _help("held-out test tasks (first n of the fixed test list)", 100, ge=1)

    def validate(self) -> None:
        from agentevo.envs import ENVIRONMENTS

        if self.name not in ENVIRONMENTS:
            raise ConfigError(
                f"env.name: unknown environment {self.name!r}; choose one of: {', '.join(sorted(ENVIRONMENTS))}"
            )
        self._check_params()

    def _check_params(self) -> None:
        """Unknown env.params keys fail here, before a run folder exists (factories taking **kwargs accept any)."""
        import importlib
        import inspect

        from agentevo import envs

        factory = getattr(envs, "_FACTORIES", {}).get(self.name)  # register()ed factories, when there are any
        if factory is None:
            module_name, target, _ = envs.ENVIRONMENTS[self.name]
            try:
                factory = getattr(importlib.import_module(module_name), target)
            except (ImportError, AttributeError):
                return  # make_env names the missing module or extra when the environment is built
        try:
            params = list(inspect.signature(factory).parameters.values())
        except (TypeError, ValueError):
            return  # no introspectable signature: make_env is the judge
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        accepted = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        unknown = sorted(str(k) for k in self.params if k not in accepted)
        if unknown:
            raise ConfigError(
                f"environment {self.name!r} has no parameter {unknown[0]!r} (check env.params in your config); "
                f"its parameters are: {', '.join(accepted) or 'none'}"
            )


@dataclass
class TinyModelConfig:
    """The embedded default: a small Llama-style model with a tokenizer trained on environment text."""

    hidden_size: int = _help("hidden size", 256, ge=1)
    num_layers: int = _help("transformer layers", 4, ge=1)
    num_heads: int = _help("attention heads", 4, ge=1)
    intermediate_size: int = _help("MLP width", 768, ge=1)
    vocab_size: int = _help("BPE vocabulary size trained on environment text (upper bound)", 2048, ge=1)
    max_positions: int = _help("maximum context length in tokens", 2048, ge=16)


@dataclass
class LoraConfig:
    """LoRA adapters via peft (used when enabled)."""

    enabled: bool = _help("train LoRA adapters instead of all weights", False)
    r: int = _help("LoRA rank", 16, ge=1)
    alpha: int = _help("LoRA alpha", 32, gt=0)
    dropout: float = _help("LoRA dropout", 0.0, ge=0, lt=1)
    target_modules: list[str] = _help(
        "module names to adapt", factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    """The policy model: the embedded tiny model, or any local transformers causal LM (GGUF included)."""

    path: str | None = _help("local model folder (save_pretrained layout) or GGUF folder, or a hub id (org/name) found "
                             "offline in the local Hugging Face cache; null = build the tiny model", None)
    gguf_file: str | None = _help("GGUF file name inside `path`", None)
    tiny: TinyModelConfig = _help("tiny-model shape (used when path is null)", factory=TinyModelConfig)
    lora: LoraConfig = _help("LoRA settings", factory=LoraConfig)
    torch_threads: int | None = _help("torch threads (null = idle cores, at least 1)", None, ge=1)
    device: str = _help("where this process's models live: auto (its GPU, cuda:LOCAL_RANK, when torch sees one, "
                        "else the CPU), cpu, cuda or cuda:N", "auto")
    dtype: str = _help("weights of loaded models: float32, bfloat16 or float16 (bf16/fp16 train in that precision; "
                       "for mixed precision keep float32 and set accelerate's mixed_precision), or auto: float32 "
                       "weights with bf16 autocast in training forwards and generation where the GPU or CPU has bf16 "
                       "(AMX-BF16 / AVX512-BF16), plain float32 elsewhere", "float32")
    attn_implementation: str | None = _help("attention kernel passed to transformers: eager, sdpa or "
                                            "flash_attention_2 (null = transformers' default)", None)
    chat_template: str | None = _help("a Jinja file that replaces the tokenizer's chat template (null = the "
                                      "tokenizer's own)", None)
    backend: str = _help("what generates rollouts and evaluations: transformers (in this process), vllm (a vLLM "
                         "engine on this machine's GPUs) or http (an OpenAI-compatible server); training always "
                         "uses transformers", "transformers")
    vllm: VLLMConfig = _help("vLLM engine settings (backend = vllm)", factory=VLLMConfig)
    http: HTTPConfig = _help("OpenAI-compatible server (backend = http)", factory=HTTPConfig)

    def validate(self) -> None:
        check_choice("model", "backend", self.backend, BACKENDS)
        self.vllm.validate()
        self.http.validate()
        from agentevo.models import placement

        placement.resolve_device(self.device)
        placement.resolve_dtype(self.dtype)
        placement.check_attn_implementation(self.attn_implementation)
        if self.chat_template is not None:
            from agentevo.agent.chat import load_chat_template

            load_chat_template(self.chat_template)
        if self.path is not None:
            p = placement.resolve_model_path(self.path)  # a local folder, or a hub id in the local HF cache
            if self.gguf_file is not None and not (p / self.gguf_file).exists():
                raise ConfigError(f"model.gguf_file {self.gguf_file!r} is not in {self.path!r}")
        if self.tiny.hidden_size % self.tiny.num_heads:
            raise ConfigError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")


@dataclass
class AgentConfig:
    """How prompts are built and how replies are parsed."""

    history_window: int = _help("past (action, observation) turns kept in the prompt", 3, ge=0)
    max_new_tokens: int = _help("token budget of one reply", 48, ge=1)
    thoughts: str = _help("thought text in expert demos: 'template' (short, derived from the action) or 'none'", "template")

    def validate(self) -> None:
        if self.thoughts not in ("template", "none"):
            raise ConfigError(f"agent.thoughts must be 'template' or 'none' (got {self.thoughts!r})")


@dataclass
class RolloutConfig:
    """The batched rollout engine."""

    n_parallel: int = _help("environments stepped at once (generation is batched across them)", 16, ge=1)
    batch_size: int = _help("largest generation batch", 16, ge=1)
    prefix_cache: int = _help("finished sequences whose keys/values the transformers backend keeps so the next turn "
                              "of an episode only runs its new tokens (0 = off)", 64, ge=0)
    prefix_cache_gb: float = _help("memory bound of those keys/values (GiB)", 4.0, gt=0)
    shared_prefix_attention: bool | None = _help("decode attention reads the prefix every episode of a generation "
                                                 "call shares (the instruction) once per step instead of once per "
                                                 "episode (null = on the CPU, where it was measured; off on a GPU)",
                                                 None)
    workers: str = _help("environment workers: 'thread', 'process' or 'ray' (Ray actors; RAY_ADDRESS names the "
                         "cluster, else a local Ray is started)", "thread")
    temperature: float = _help("sampling temperature for collection (evaluation: eval.temperature)", 0.7, ge=0)
    top_p: float = _help("nucleus sampling for collection", 1.0, gt=0, le=1)
    max_retries: int = _help("retries of an episode whose environment crashed or hung (past them it is stored as an errored episode)", 3, ge=0)
    step_timeout_s: float | None = _help("seconds one env reset/step may take before the env counts as hung: it is "
                                         "killed, a fresh one made and the episode retried (null = no limit)",
                                         120.0, gt=0)

    def validate(self) -> None:
        check_choice("rollout", "workers", self.workers, WORKERS)


@dataclass
class OptimConfig:
    """AdamW with warmup + cosine, gradient accumulation and clipping."""

    lr: float = _help("peak learning rate", 1e-3, gt=0)
    epochs: float = _help("passes over the training samples", 3.0, gt=0)
    batch_size: int = _help("samples per optimiser step (micro_batch_size x accumulation)", 32, ge=1)
    micro_batch_size: int = _help("samples per forward/backward", 16, ge=1)
    warmup_ratio: float = _help("fraction of steps with linear warmup", 0.03, ge=0, lt=1)
    weight_decay: float = _help("AdamW weight decay", 0.0, ge=0)
    betas: tuple[float, float] = _help("AdamW betas: two numbers in [0, 1)", (0.9, 0.95), ge=0, lt=1)
    grad_clip: float = _help("gradient-norm clip (0 = off)", 1.0, ge=0)
    save_every: int = _help("optimiser steps between resumable mid-training checkpoints (0 = only at the end)", 200,
                            ge=0)
    max_length: int = _help("samples longer than this (tokens) are left-truncated inside the history", 1024, ge=1)
    gradient_checkpointing: bool = _help("recompute activations in the backward pass instead of keeping them "
                                         "(less memory for long rows / large models, ~30% more compute)", False)
    padding_free: bool = _help(
        "pack each micro-batch's samples end to end into rows as wide as its longest sample (one row under "
        "flash-attention), with position ids restarting per sample and no attention mask (a block-diagonal causal "
        "mask; flash-attention varlen on a GPU): the same token-mean losses, less padding (under sdpa only samples "
        "at most half the longest can share a row; meant for flash-attention). Applies to every policy update (BC and the "
        "SFTs, RSD's distillation, Q-Evolve's and GRPO's updates); needs token-mean loss aggregation", False)

    def validate(self) -> None:
        if self.batch_size < self.micro_batch_size:
            raise ConfigError("optim.batch_size must be >= optim.micro_batch_size >= 1")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"optim.batch_size ({self.batch_size}) must be a multiple of optim.micro_batch_size "
                f"({self.micro_batch_size})"
            )


@dataclass
class EvalConfig:
    """The evaluation protocol: fixed splits, greedy decoding unless eval.temperature > 0."""

    splits: list[str] = _help("splits to evaluate on", factory=lambda: ["test"])
    n_tasks: int | None = _help("tasks per split (first n of the fixed list; null = env.n_<split>)", None, ge=1)
    temperature: float = _help("decoding temperature: 0 = greedy (the default and the papers' protocol); > 0 samples "
                               "with eval.seed, which shows a policy's spread where greedy decoding sits at a ceiling",
                               0.0, ge=0)
    top_p: float = _help("nucleus mass of sampled evaluation", 1.0, gt=0, le=1)
    samples: int = _help("episodes per task (> 1 needs eval.temperature > 0); rates average over all of them and "
                         "`compare` averages each task's episodes before pairing", 1, ge=1)
    seed: int = _help("sampling seed of every evaluation point when eval.temperature > 0", 0, ge=0)

    @property
    def protocol(self) -> str:
        """'greedy', or e.g. 'T=1, 4 samples per task' (plot titles, reports)."""
        if self.temperature <= 0:
            return "greedy"
        return f"T={self.temperature:g}" + (f", {self.samples} samples per task" if self.samples > 1 else "")

    def validate(self) -> None:
        if self.samples > 1 and self.temperature <= 0:
            raise ConfigError(f"eval.samples is {self.samples} but eval.temperature is 0: greedy episodes of one task "
                              "are identical; set eval.temperature > 0 (e.g. 1.0) or eval.samples: 1")
        if not self.splits:
            raise ConfigError("eval.splits must name at least one of train, dev, test (got [])")
        for split in self.splits:
            if split not in ("train", "dev", "test"):
                raise ConfigError(f"eval.splits: unknown split {split!r}; use train, dev or test")


@dataclass
class BCConfig:
    """Behaviour cloning on expert demos."""

    n_expert: int | None = _help("expert demos (one per training task, first n tasks; null = every training task the env keeps, i.e. env.n_train, which ScienceWorld and ALFWorld apply per task type)", None, ge=1)
    warm_start_from: str | None = _help(
        "an earlier run folder whose expert demos, init/bc checkpoints and their evaluations this run starts from "
        "(same env and agent settings; lets every method of a study share one BC model)", None)
    warm_start_checkpoint: str = _help(
        "which checkpoint of the warm_start_from run becomes this run's BC start (its checkpoints/NAME; e.g. "
        "bon-sft to start from a run that continued BC on the demos); any other than bc is evaluated again here",
        "bc")
    eval_epochs: list[int] = _help(
        "BC's learning curve in the same run: save BC at the end of these epochs (checkpoints/bc-epoch-E) and "
        "evaluate them and the final BC greedily on the dev split (eval points bc-epoch-E), so the report shows "
        "whether more epochs would still help; a snapshot is this run part way through its learning-rate "
        "schedule, not a shorter run (e.g. [4, 8] with optim.epochs 12; [] = off)", factory=list, ge=1)

    def validate(self) -> None:
        if self.eval_epochs != sorted(set(self.eval_epochs)):  # each >= 1: its range, checked before
            raise ConfigError(f"bc.eval_epochs {self.eval_epochs} must be increasing epoch numbers, each once, "
                              "e.g. [4, 8]")
        if self.warm_start_checkpoint != "bc" and not self.warm_start_from:
            raise ConfigError(f"bc.warm_start_checkpoint is {self.warm_start_checkpoint!r} but bc.warm_start_from "
                              "is not set; name the run it is a checkpoint of (bc.warm_start_from=runs/NAME)")


@dataclass
class TrackingConfig:
    """Experiment trackers that get a copy of every metric (metrics.jsonl stays what `report` and `compare` read)."""

    report_to: list[str] = _help("trackers besides metrics.jsonl, several at once: tensorboard, wandb, trackio, "
                                 "mlflow; [] or [none] = metrics.jsonl only (e.g. --set "
                                 "tracking.report_to=[tensorboard,wandb])", factory=list)
    project: str = _help("wandb/Trackio project and MLflow experiment the run is logged under", "agentevo")
    run_name: str | None = _help("the run's name in the trackers (null = the run folder's name)", None)
    samples: int = _help("episodes of each evaluation (the first n tasks) logged to the trackers as a table of "
                         "task id, actions, observations, reward and success (0 = none)", 8, ge=0)

    def validate(self) -> None:
        from agentevo.train.tracking import check_report_to

        check_report_to(self.report_to)  # unknown names and missing packages fail before any work


@dataclass
class RunConfig:
    """One experiment: a method on an environment with a model."""

    method: str = _help("recipe to run (bc)", "bc")
    name: str | None = _help("run name (folder under output_dir); null = <method>-<env>-<time>", None)
    output_dir: str = _help("where run folders are created", "runs")
    seed: int = _help("global seed", 0, ge=0, le=2**32 - 1)
    env: EnvConfig = _help("environment", factory=EnvConfig)
    model: ModelConfig = _help("policy model", factory=ModelConfig)
    agent: AgentConfig = _help("prompting and parsing", factory=AgentConfig)
    rollout: RolloutConfig = _help("rollout engine", factory=RolloutConfig)
    optim: OptimConfig = _help("optimiser", factory=OptimConfig)
    eval: EvalConfig = _help("evaluation protocol", factory=EvalConfig)
    bc: BCConfig = _help("BC settings", factory=BCConfig)
    qevolve: QEvolveConfig = _help("Q-Evolve settings (methods-spec section 2)", factory=QEvolveConfig)
    grpo: GRPOConfig = _help("GRPO settings (methods-spec section 5 / 3.2)", factory=GRPOConfig)
    selfguide: SelfGuideConfig = _help("Self-Guide settings (methods-spec section 3)", factory=SelfGuideConfig)
    rsd: RSDConfig = _help("RSD settings (methods-spec section 4)", factory=RSDConfig)
    eto: ETOConfig = _help("ETO baseline settings (methods-spec section 5)", factory=ETOConfig)
    qlass: QLASSConfig = _help("QLASS baseline settings (methods-spec section 5)", factory=QLASSConfig)
    tracking: TrackingConfig = _help("experiment trackers (TensorBoard, wandb, Trackio, MLflow)",
                                     factory=TrackingConfig)

    def validate(self) -> None:
        from agentevo.recipes import RECIPES

        if self.method not in RECIPES:
            raise ConfigError(f"method: unknown recipe {self.method!r}; choose one of: {', '.join(sorted(RECIPES))}")
        check_fields(self)  # every numeric field against its range first, so the checks below see sane numbers
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value) and hasattr(value, "validate"):
                value.validate()
        if self.optim.padding_free:
            check_padding_free(self)
        if self.bc.eval_epochs:
            check_bc_curve(self)
        if self.method == "selfguide" and self.selfguide.demo_verdicts == "self" and self.model.path is None:
            raise ConfigError("selfguide.demo_verdicts=self needs a pretrained model (set model.path): a tiny model "
                              "built from scratch cannot judge a step before training; use demo_verdicts=oracle")


def check_bc_curve(cfg: RunConfig) -> None:
    """bc.eval_epochs: snapshots inside BC's own schedule, of a whole model."""
    bc = cfg.bc
    if bc.eval_epochs[-1] >= cfg.optim.epochs:
        raise ConfigError(f"bc.eval_epochs {bc.eval_epochs} must stay below optim.epochs ({cfg.optim.epochs:g}): the "
                          "final BC is evaluated on the dev split anyway; drop the last epoch or raise optim.epochs")
    if bc.warm_start_from:
        raise ConfigError("bc.eval_epochs draws BC's learning curve while BC trains, but bc.warm_start_from starts "
                          "from a BC trained elsewhere; set it on the BC run, or drop bc.eval_epochs")
    if cfg.model.lora.enabled:
        raise ConfigError("bc.eval_epochs saves whole-model snapshots; with model.lora.enabled set it to [] (or "
                          "train BC without LoRA)")


def check_padding_free(cfg: RunConfig) -> None:
    """optim.padding_free needs losses that are token means (a packed row holds several samples) and a
    transformers that reads packed position ids."""
    for section in ("qevolve", "grpo"):
        agg = getattr(cfg, section).loss_agg
        if agg != "token-mean" and (cfg.method == section or (section == "grpo" and cfg.method == "selfguide")):
            raise ConfigError(f"optim.padding_free packs several samples into one row, so {section}.loss_agg={agg} "
                              f"would average over packed rows, not sequences; set {section}.loss_agg=token-mean "
                              "or optim.padding_free=false")
    import transformers.masking_utils as masking

    if not hasattr(masking, "find_packed_sequence_indices"):
        from importlib.metadata import version

        raise ConfigError(f"optim.padding_free needs a transformers that masks packed sequences by their position "
                          f"ids (masking_utils.find_packed_sequence_indices; installed {version('transformers')} has "
                          "none); upgrade transformers or set optim.padding_free=false")


# -- loading ----------------------------------------------------------------------------------------


def _resolve_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (got {value!r})")
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
            raise ConfigError(f"{where} may not be null")
        return _coerce(value, args[0], where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false (got {value!r})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer (got {value!r})")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads 1e-3 (no dot) as a string; accept any numeric string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number (got {value!r})")
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{where} must be a finite number (got {value!r})") from None
    if tp is str:
        if isinstance(value, bool) or value is None:
            raise ConfigError(
                f"{where} must be a string (got {value!r}: YAML reads yes/no/on/off/true/false as booleans and "
                f"null/~ as nothing; quote the word: {where}: 'no' in YAML, --set \"{where}='no'\" on the command line)"
            )
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string (got {value!r})")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where} must be a list of {len(args)} values (got {value!r})")
        return tuple(_coerce(v, a, f"{where}[{k}]") for k, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if isinstance(value, str) and arg is str:
            value = [value]  # `--set tracking.report_to=wandb` means [wandb]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list (got {value!r})")
        return [_coerce(v, arg, where) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (got {value!r})")
        return dict(value)
    return value


def _build(cls: type, data: dict[str, Any], where: str = "") -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!r}; allowed keys{' under ' + where if where else ''}: "
            f"{', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, _resolve_type(cls, name), f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """'<problem> at line L, column C' on one line."""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=x'] into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects KEY=VALUE (got {pair!r}), e.g. --set optim.lr=3e-4")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"--set {pair!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote it, "
                f"e.g. --set \"{key.strip()}='...'\"") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "params":
            out[key] = _merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def read_yaml_mapping(p: Path) -> dict[str, Any]:
    """A YAML file holding a mapping, or a one-line ConfigError naming the file (and the line and column)."""
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read as text: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **top: Any) -> RunConfig:
    """Build and validate a RunConfig from an optional YAML file, top-level keys and dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist; see configs/ for examples")
        data = read_yaml_mapping(p)
    data = _merge(data, {k: v for k, v in top.items() if v is not None})
    data = _merge(data, parse_overrides(overrides or []))
    cfg = _build(RunConfig, data)
    cfg.validate()
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def with_defaults(tree: dict[str, Any]) -> dict[str, Any]:
    """A saved config.yaml with every setting it lacks (one added to agentevo after it was written) at today's
    default: what an older run did, as long as new settings default to the old behaviour."""
    return _merge(config_to_dict(RunConfig()), tree or {})


def flatten_dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys ({"optim": {"lr": 1}} -> {"optim.lr": 1}); an empty mapping stays a value."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
