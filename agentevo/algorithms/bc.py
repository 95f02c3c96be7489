"""BC / SFT: negative log-likelihood of the expert's reply tokens (methods-spec §2.3 step 0, §5 'SFT / BC').

    L_BC(theta) = -(1/N_tok) sum_{tau in D_expert} sum_t sum_j log pi_theta(a_t^j | s_t, a_t^{<j})

The recipe: 1. collect expert demos on the training tasks; 2. build the initial policy (the tiny model with a
tokenizer trained on the demos' text, or a local model); 3. evaluate it; 4. train by BC; 5. evaluate again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from agentevo.algorithms import losses
from agentevo.config import RunConfig, with_defaults
from agentevo.data.store import ExperienceStore
from agentevo.data.tensors import StepSample, reply_logprobs, trajectory_samples
from agentevo.data.types import Trajectory
from agentevo.errors import ConfigError
from agentevo.models.backend import TransformersPolicy
from agentevo.models.policy import initial_policy, tokenizer_corpus
from agentevo.rollout.engine import EpisodeRequest, ExpertActor
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run


def nll_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL over reply tokens."""
    logp, mask = reply_logprobs(model, batch)
    return losses.nll_loss(logp, mask, "token-mean"), {"tokens": float(mask.sum())}


def collect_expert(run: Run, n: int | None) -> list[Trajectory]:
    """Expert demos (the environment's gold sequences as ReAct replies) on the first n training tasks (None: all of
    them; the env applies env.n_train itself, per task type for ScienceWorld)."""
    tasks = run.tasks("train", n)
    # Replies are stored as text: the tiny model's tokenizer is trained on this very text, so token ids are
    # filled in by the training policy's tokenizer (expert_samples). Expert text is not policy output.
    return run.collect(
        ExpertActor(_TextOnlyRenderer(), run.cfg.agent.thoughts),
        [EpisodeRequest(t, k) for k, t in enumerate(tasks)],
        "expert",
        "expert demos",
    )


def ensure_reply_ids(policy: Any, trajs: Sequence[Trajectory]) -> None:
    """Scripted (expert) replies are stored as text: give them this policy's token ids (as BC tokenises them)."""
    for traj in trajs:
        for step in traj.steps:
            if not step.action_ids:
                step.action_ids = policy.renderer.encode_reply(step.action_text)


class _TextOnlyRenderer:
    """Expert replies are stored as text first; token ids come from the policy's tokenizer at training time."""

    def encode_reply(self, text: str) -> list[int]:
        return []


def expert_samples(policy: TransformersPolicy, trajs: list[Trajectory], window: int, max_length: int) -> list[StepSample]:
    """Training samples from expert trajectories, their replies tokenized by this policy's tokenizer."""
    samples: list[StepSample] = []
    for k, traj in enumerate(trajs):
        for step in traj.steps:
            if not step.action_ids:
                step.action_ids = policy.renderer.encode_reply(step.action_text)
        samples.extend(trajectory_samples(policy.renderer, traj, k, window, max_length))
    return samples


def train_bc(run: Run, policy: TransformersPolicy, trajs: list[Trajectory], name: str,
             snapshot_epochs: Sequence[int] = ()) -> dict[str, float]:
    """BC on the given trajectories; saves checkpoints/<name> (and checkpoints/<name>-epoch-E at the end of each of
    snapshot_epochs) and returns the final training stats."""
    cfg = run.cfg
    samples = expert_samples(policy, trajs, cfg.agent.history_window, cfg.optim.max_length)
    snapshots = {e: run.checkpoint_dir(epoch_checkpoint(name, e)) for e in snapshot_epochs}
    return {**finetune(run, policy, samples, nll_loss, name, snapshots=snapshots), "samples": len(samples)}


def epoch_checkpoint(name: str, epoch: float) -> str:
    """The name of checkpoint `name` as it was at the end of `epoch` (a snapshot; also its eval label)."""
    return f"{name}-epoch-{epoch:g}"


def bc_curve_labels(cfg: RunConfig) -> list[tuple[str, str]]:
    """(eval label, checkpoint) of each point of BC's learning curve: the bc.eval_epochs snapshots, then the final
    BC as the point at optim.epochs."""
    points = [(epoch_checkpoint("bc", e), epoch_checkpoint("bc", e)) for e in cfg.bc.eval_epochs]
    return points + [(epoch_checkpoint("bc", cfg.optim.epochs), "bc")] if points else []


def run(run: Run) -> dict[str, Any]:
    """The BC recipe end to end; returns the evaluation table."""
    return warm_start(run)


def warm_start(run: Run) -> dict[str, Any]:
    """Expert demos -> initial policy (checkpoints/init) -> eval -> BC (checkpoints/bc) -> eval.

    Every phase is recorded in state.json, so recipes that start from BC (Q-Evolve, ETO, QLASS, GRPO, ...)
    call this first and a resumed run skips what is done. Returns each phase's result.
    """
    cfg = run.cfg
    if cfg.bc.warm_start_from:
        run.phase("warm_start_from", lambda: import_warm_start(run, Path(cfg.bc.warm_start_from)))
    demos = run.phase("expert", lambda: _expert_stats(collect_expert(run, cfg.bc.n_expert)))
    trajs = run.store.load(collection="expert")

    def build_init() -> dict[str, Any]:
        policy = initial_policy(cfg, tokenizer_corpus(run.signal_env.instruction(), trajs))
        policy.save(run.checkpoint_dir("init"))
        return {"parameters": sum(p.numel() for p in policy.model.parameters()), "vocab": len(policy.tokenizer)}

    init_info = run.phase("init", build_init)
    results: dict[str, Any] = {"expert": demos, "init": init_info}
    results["eval/init"] = run.phase("eval/init", lambda: run.evaluate(run.rollout_policy("init"), "init"))

    def do_bc() -> dict[str, Any]:
        policy = run.load_policy("init")
        return train_bc(run, policy, trajs, "bc", cfg.bc.eval_epochs)

    results["bc"] = run.phase("bc", do_bc, all_ranks=True)
    results["eval/bc"] = run.phase("eval/bc", lambda: run.evaluate(run.rollout_policy("bc"), "bc"))
    # BC's learning curve (bc.eval_epochs): each snapshot and the final BC on the dev split, one phase each
    for label, checkpoint in bc_curve_labels(cfg):
        results[f"eval/{label}"] = run.phase(
            f"eval/{label}", lambda c=checkpoint, lab=label: run.evaluate(run.rollout_policy(c, lab), lab, ["dev"]))
    return results


WARM_START_PHASES = ("expert", "init", "eval/init", "bc", "eval/bc")


def _same_folder(a: Any, b: Any) -> bool:
    """Whether two model.path values name one existing folder (relative paths read from the working directory)."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def import_warm_start(run: Run, source: Path, collection: str = "expert",
                      phases: tuple[str, ...] = WARM_START_PHASES,
                      also_equal: dict[str, tuple[str, ...]] | None = None,
                      checkpoints: tuple[str, ...] = ("init", "bc")) -> dict[str, Any]:
    """Copy a finished BC run's demos, init/bc checkpoints and phase results into this run (its phases are then
    skipped). The environment and agent settings must match, or the evaluations would not be comparable; only
    env.n_train may be smaller (the demos of this run's training tasks are copied) or larger with bc.n_expert set to
    the BC run's n_train (the same demos; the other training tasks are new ones to practise on), and env.n_dev / env.n_test may
    differ (the imported checkpoints are then evaluated again here, on this run's task lists). A recipe with its own warm start
    names its demo collection, phases (phases[0] is the collection's) and checkpoints, and `also_equal` the settings
    of other config sections that shape it. bc.warm_start_checkpoint takes another of the source's checkpoints as
    this run's BC (e.g. bon-sft: BC continued on the demos); it is then evaluated again here."""
    state_path, config_path = source / "state.json", source / "config.yaml"
    if not state_path.exists() or not config_path.exists():
        raise ConfigError(f"bc.warm_start_from: {str(source)!r} is not a run folder; give runs/NAME of a BC run")
    state = json.loads(state_path.read_text())
    missing = [p for p in phases if p not in state]
    if missing:
        raise ConfigError(f"bc.warm_start_from: run {str(source)!r} has not finished {', '.join(missing)}; "
                          f"finish it with `agentevo resume {source}`")
    theirs = with_defaults(yaml.safe_load(config_path.read_text()))  # settings it predates count as their defaults
    ours = yaml.safe_load((run.dir / "config.yaml").read_text())
    start = run.cfg.bc.warm_start_checkpoint
    if start != "bc" and not (source / "checkpoints" / start / "config.json").exists():
        have = sorted(p.name for p in (source / "checkpoints").glob("*") if (p / "config.json").exists())
        raise ConfigError(f"bc.warm_start_checkpoint: {str(source)!r} has no checkpoint {start!r}; "
                          f"it has {', '.join(have) or 'none'}")
    checks = [("env", None), ("agent", None), ("model", ("path", "tiny", "gguf_file")), *(also_equal or {}).items()]
    resized: list[str] = []  # evaluation split sizes that differ: the imported evaluations are redone here
    for section, keys in checks:
        a, b = ours.get(section, {}), theirs.get(section) or {}
        for key in keys or sorted(set(a) | set(b)):
            if (section, key) == ("env", "n_train") and _n_tasks(a.get(key)) <= _n_tasks(b.get(key)):
                continue  # a study may evolve on the first n training tasks of a BC run trained on more
            if (section, key) == ("env", "n_train") and _demos_pinned(run.cfg.bc.n_expert, b.get(key)):
                continue  # more training tasks than the BC run's, the demos still its own: new tasks to practise on
            if section == "env" and key in ("n_dev", "n_test"):
                if a.get(key) != b.get(key):
                    resized.append(f"env.{key} {b.get(key)} -> {a.get(key)}")
                continue  # a powered study evaluates the same checkpoints on more held-out tasks
            if (section, key) == ("model", "path") and _same_folder(a.get(key), b.get(key)):
                continue  # the same model folder written relative in one run and absolute in the other
            if a.get(key) != b.get(key):
                raise ConfigError(f"bc.warm_start_from: {section}.{key} is {a.get(key)!r} here but "
                                  f"{b.get(key)!r} in {str(source)!r}; use the same setting or another BC run")
    # evaluations redone here: all of them on resized task lists; eval/bc when another checkpoint is taken as BC
    # (the source evaluated its BC, not that checkpoint)
    redone = {p for p in phases[1:] if p.startswith("eval/") and (resized or (p == "eval/bc" and start != "bc"))}
    src_store = ExperienceStore(source / "experience.db")
    try:
        experts = src_store.load(collection=collection)
        train_ids = {t.task_id for t in run.tasks("train")}
        experts = [t for t in experts if t.task.task_id in train_ids]
        run.store.add_missing(collection, enumerate(experts))
        _copy_evaluations(src_store, run.store, [p for p in phases[1:] if p.startswith("eval/") and p not in redone])
    finally:
        src_store.close()
    for name in checkpoints:
        target = run.checkpoint_dir(name)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source / "checkpoints" / (start if name == "bc" else name), target)
    run.state.setdefault(phases[0], {**_expert_stats(experts), "imported_from": str(source)})
    for phase in phases[1:]:
        if phase == "bc" and start != "bc":
            took = state[start] if isinstance(state.get(start), dict) else {}  # its phase result, when it has one
            run.state.setdefault(phase, {**took, "checkpoint": start, "from": str(source)})
        elif phase not in redone:
            run.state.setdefault(phase, state[phase])
    out: dict[str, Any] = {"source": str(source), "expert": len(experts)}
    if start != "bc":
        out["checkpoint"] = start
    if resized:
        out["reevaluated"] = ", ".join(resized)
    return out


def _n_tasks(n: int | None) -> float:
    return float("inf") if n is None else n


def _demos_pinned(n_expert: int | None, source_n_train: int | None) -> bool:
    """Whether this run's demos are exactly the BC run's though it has more training tasks: bc.n_expert must name
    the BC run's task count (its demos are one per training task), else the larger env.n_train is an error."""
    if source_n_train is None:
        return False
    if n_expert != source_n_train:
        raise ConfigError(f"bc.warm_start_from: env.n_train is larger than the BC run's {source_n_train}; to practise on "
                          f"more tasks with its demos, set bc.n_expert={source_n_train} (got {n_expert})")
    return True


def _copy_evaluations(source: ExperienceStore, target: ExperienceStore, phases: list[str]) -> None:
    """Copy the trajectories of imported evaluation phases (eval/LABEL -> collections eval/LABEL/SPLIT), slot for
    slot, so the run folder alone holds everything its report reads."""
    for name in source.collections():
        if any(name.startswith(phase + "/") for phase in phases):
            target.add_missing(name, ((int(t.meta["slot"]), t) for t in source.load(collection=name)))


def _expert_stats(trajs: list[Trajectory]) -> dict[str, Any]:
    n = max(1, len(trajs))
    return {
        "n": len(trajs),
        "success_rate": sum(t.success for t in trajs) / n,
        "mean_steps": sum(t.length for t in trajs) / n,
    }
