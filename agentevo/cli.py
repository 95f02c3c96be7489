"""The `agentevo` command: train, eval, report, resume, compare, study, archive, export, import, envs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentevo.errors import AgentevoError, ConfigError
from agentevo.eval.compare import METRICS
from agentevo.eval.metrics import tasks_played

if TYPE_CHECKING:
    from agentevo.run import Run


def _summary_table(run: Run, results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{run.cfg.method} on {run.cfg.env.name} — {run.dir}")
    for col in ("policy", "split", "tasks", "success", "avg reward", "steps", "format err", "invalid", "task hash"):
        table.add_column(col)
    for key, per_split in results.items():
        if not key.startswith("eval/") or not isinstance(per_split, dict):
            continue
        for split, m in per_split.items():
            if not isinstance(m, dict) or "success_rate" not in m:
                continue
            table.add_row(
                key[len("eval/") :], split, str(tasks_played(m)), f"{100 * m['success_rate']:.1f}%",
                f"{m['avg_reward']:.3f}", f"{m['mean_steps']:.1f}", f"{100 * m['format_error_rate']:.1f}%",
                f"{100 * m['invalid_rate']:.1f}%", m.get("task_hash", ""),
            )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    errored = [(key[len("eval/"):], split, m["errored_episodes"]) for key, per_split in results.items()
               if key.startswith("eval/") and isinstance(per_split, dict)
               for split, m in per_split.items() if isinstance(m, dict) and m.get("errored_episodes")]
    for label, split, n in errored:
        console.print(f"warning: {label} on {split}: {n} episode(s) errored (environment crashed or hung past "
                      "rollout.max_retries) and count as failures above")


def _run_recipe(run: Run) -> int:
    from agentevo import dist
    from agentevo.eval.report import write_report
    from agentevo.recipes import DISTRIBUTED_RECIPES, get_recipe
    from agentevo.run import FINISHED

    finished = FINISHED in run.state  # resumed after its recipe returned: nothing to continue
    if not finished and dist.world_size() > 1 and run.cfg.method not in DISTRIBUTED_RECIPES:
        run.close()
        raise ConfigError(
            f"recipe {run.cfg.method!r} does not run under accelerate launch yet (ready: "
            f"{', '.join(sorted(DISTRIBUTED_RECIPES))}); run it as one process with LoRA and vLLM (docs/scaling.md)"
        )
    try:
        if finished:  # no model, checkpoint or optimiser state loaded: the report is rewritten from state.json
            results = run.state
        else:
            results = get_recipe(run.cfg.method)(run)
            run.phase(FINISHED, lambda: {"at": time.strftime("%Y-%m-%dT%H:%M:%S")})  # what `agentevo study` skips
        report = write_report(run) if run.main else None
    finally:
        run.close()
    if not run.main:
        return 0
    _summary_table(run, results)
    print(f"report: {report}")
    if finished:
        print(f"{run.dir} finished at {run.state[FINISHED].get('at', '?')}: nothing to resume (report rewritten)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from agentevo.config import load_config
    from agentevo.run import Run

    cfg = load_config(args.config, args.set, method=args.method, name=args.name, output_dir=args.output_dir)
    run = Run.create(cfg, quiet=args.quiet, overwrite=args.overwrite)
    _set_interrupt_hint(f"continue with `agentevo resume {run.dir}`")
    return _run_recipe(run)


def cmd_resume(args: argparse.Namespace) -> int:
    from agentevo.run import Run

    run = Run.open(args.run_dir, quiet=args.quiet)
    _set_interrupt_hint(f"continue with `agentevo resume {run.dir}`")
    return _run_recipe(run)


# What main() says after Ctrl-C: set once the command has made its run folder.
_INTERRUPT_HINT: str | None = None


def _set_interrupt_hint(hint: str | None) -> None:
    global _INTERRUPT_HINT
    _INTERRUPT_HINT = hint


def _checkpoint_env_warning(model: Path, cfg: Any) -> str | None:
    """A warning when the checkpoint's own run (runs/X/checkpoints/Y -> runs/X/config.yaml) used other env
    settings than this evaluation: its score would be on games it was not trained for."""
    import yaml

    source = model.resolve().parent.parent
    if model.resolve().parent.name != "checkpoints" or not (source / "config.yaml").exists():
        return None
    try:
        theirs = (yaml.safe_load((source / "config.yaml").read_text()) or {}).get("env") or {}
    except (yaml.YAMLError, AttributeError):
        return None
    if theirs.get("name", cfg.env.name) != cfg.env.name:
        return (f"{model} was trained on {theirs.get('name')} (in {source}) but this evaluation plays "
                f"{cfg.env.name}; evaluate with its settings, e.g. -c {source / 'config.yaml'}")
    ours, params = cfg.env.params, theirs.get("params") or {}
    differ = sorted(k for k in set(ours) | set(params) if ours.get(k) != params.get(k))
    if not differ:
        return None
    return (f"{model} was trained (in {source}) with other {cfg.env.name} settings: env.params "
            f"{', '.join(differ)} differ(s), so these are not its games; evaluate with its settings, "
            f"e.g. -c {source / 'config.yaml'}")


def cmd_eval(args: argparse.Namespace) -> int:
    from agentevo.config import load_config
    from agentevo.run import Run

    overrides = list(args.set)
    if args.env:
        overrides.append(f"env.name={args.env}")
    if args.n is not None:
        overrides.append(f"eval.n_tasks={args.n}")
    if args.split:
        overrides.append(f"eval.splits=[{args.split}]")
    cfg = load_config(args.config, overrides, name=args.name, output_dir=args.output_dir)
    if args.name is not None:
        from agentevo.run import check_run_name

        check_run_name(args.name, cfg.output_dir)
    if not Path(args.model).exists():
        raise AgentevoError(f"model path {args.model!r} does not exist; give a checkpoint folder such as runs/NAME/checkpoints/bc")
    from agentevo.models.backend import require_checkpoint

    require_checkpoint(Path(args.model))  # before the eval run's folder is made
    if args.guide_history and not args.guide:
        raise AgentevoError("--guide-history only applies to a guided evaluation: add --guide")
    cfg.method = "eval"
    cfg.name = args.name  # an eval run is named by --name only: a config's name is the training run's folder
    if args.guide and cfg.selfguide.guide == "none":
        cfg.selfguide.guide = "infer_only"  # the checkpoint writes guides; the config's selfguide section says where
    from agentevo.config import config_to_dict
    from agentevo.eval.metrics import eval_label

    # cached evaluations are found by everything that decides them, never by the checkpoint folder's name alone
    settings = {"env": config_to_dict(cfg.env), "eval": config_to_dict(cfg.eval), "agent": config_to_dict(cfg.agent),
                "backend": cfg.model.backend,
                "guide": [args.guide_history or "all", config_to_dict(cfg.selfguide)] if args.guide else None}
    run = Run.create(cfg, quiet=args.quiet)
    _set_interrupt_hint(f"run the same `agentevo eval ... --name {cfg.name}` again to continue")
    label = eval_label(Path(args.model), settings)
    warning = _checkpoint_env_warning(Path(args.model), cfg)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        policy = run.rollout_policy(args.model)
        if args.guide:
            from agentevo.algorithms.selfguide.recipe import evaluate_guided, guides_kept

            keep = guides_kept(args.guide_history or "all", 1)
            results = {"eval/" + label: run.phase("eval/" + label, lambda: evaluate_guided(run, policy, label, keep))}
        else:
            results = {"eval/" + label: run.phase("eval/" + label, lambda: run.evaluate(policy, label))}
    finally:
        run.close()
    _summary_table(run, results)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from agentevo.eval.report import write_report
    from agentevo.run import RunView

    run = RunView(args.run_dir)  # read-only: works while the run goes on
    try:
        path = write_report(run)
    finally:
        run.close()
    print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from agentevo.eval.compare import compare

    result = compare([Path(d) for d in args.run_dirs], args.split, Path(args.out), args.metric, args.baseline,
                     baseline_point=args.baseline_point, noise_floor=args.noise_floor, baseline_at=args.baseline_at)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(result.table)
    if result.paired_table:
        print(f"\npaired differences vs {result.baseline} (arm - baseline, points; 95% bootstrap intervals over tasks "
              f"and over seeds and tasks; exact sign-test p; see {result.path.name}):\n{result.paired_table}\n")
        print("\n".join(result.sentences))
    if result.noise_sentences:
        print(f"\nagainst the noise floor ({', '.join(args.noise_floor)}):\n{result.noise_table}\n")
        print("\n".join(result.noise_sentences))
    print(result.path)
    return 0


def cmd_envs(args: argparse.Namespace) -> int:
    from agentevo.envs import ENVIRONMENTS, load_plugins, make_env

    if args.action == "list":
        load_plugins()  # installed `agentevo.envs` entry points are listed too
        for name, (_, _, text) in sorted(ENVIRONMENTS.items()):
            print(f"{name:18s} {text}")
        return 0
    if not args.name:
        raise AgentevoError(f"`agentevo envs {args.action}` needs an environment name; see `agentevo envs list`")
    env = make_env(args.name)
    try:
        if args.action == "show":
            print(env.instruction())
            for split in ("train", "dev", "test"):
                tl = env.tasks(split)
                print(f"{split:5s} {len(tl):6d} tasks  hash {tl.hash}  first: {tl[0].task_id if len(tl) else '-'}")
            return 0
        task = env.tasks(args.split)[args.task]
        obs, info = env.reset(task)
        print(f"[{task.task_id}] (type 'quit' to stop, 'expert' to see the gold sequence)\n{obs}")
        for _ in range(task.max_steps):
            try:
                action = input("> ").strip()
            except EOFError:  # end of input (Ctrl-D, a finished pipe): stop as 'quit' does
                print()
                break
            except KeyboardInterrupt:
                print("\nstopped")
                return 130
            if action == "quit":
                break
            if action == "expert":
                print(env.expert(task))
                obs, info = env.reset(task)
                print(obs)
                continue
            obs, reward, done, info = env.step(action)
            print(f"{obs}\n  reward={reward:.3f} score={info.get('score', 0):.3f} done={done}")
            if done:
                print("success" if info.get("success") else "episode over")
                break
        return 0
    finally:
        env.close()


def cmd_export(args: argparse.Namespace) -> int:
    from agentevo.data.export import KINDS, export_run

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "export"
    for kind, n, path in export_run(run_dir, args.format, args.kind or list(KINDS), args.collection or None, out):
        print(f"{kind:18s} {n:7d} rows  {path if path else '(nothing to write)'}")
    return 0


def cmd_archive(args: argparse.Namespace) -> int:
    from agentevo.data.archive import DEFAULT_COLLECTIONS, archive_run

    for run_dir in args.run_dirs:
        summary = archive_run(Path(run_dir), Path(args.out), args.collection or DEFAULT_COLLECTIONS,
                              steps=not args.no_steps)
        print(summary.line(Path(run_dir)))
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from agentevo.study import load_study, run_study

    run_study(load_study(args.file), dry_run=args.dry_run, quiet=not args.progress, seeds=args.seed, arms=args.arm,
              rerun_sources=args.rerun_sources)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from agentevo.data.export import import_file

    counts = import_file(Path(args.file), Path(args.into), args.collection, args.source, args.drop_ids)
    added = ", ".join(f"{c}: {n}" for c, n in counts.items()) or "nothing new"
    print(f"imported {sum(counts.values())} trajectories into {args.into} ({added})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `agentevo` command."""
    parser = argparse.ArgumentParser(prog="agentevo", description="Self-evolving LLM agents")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="YAML config file (see configs/)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. --set optim.lr=3e-4 (repeatable)")
        p.add_argument("--name", help="run name (folder under --output-dir)")
        p.add_argument("--output-dir", help="where run folders go (default runs/)")
        p.add_argument("--quiet", action="store_true", help="no progress bars")

    from agentevo.recipes import RECIPES  # a plain name table: importing it loads no recipe

    recipes = ", ".join(RECIPES)
    p = sub.add_parser("train", help="run a recipe end to end", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"recipes: {recipes}\n\nexample: agentevo train qevolve --config "
                              "configs/qevolve_alfworld.yaml --set seed=1 --name qe-alfworld-s1")
    p.add_argument("method", nargs="?", help=f"recipe name, one of: {recipes} (default: from config, else bc)")
    common(p)
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an existing run folder of that --name (its contents are deleted)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on fixed splits (greedy, or eval.temperature / eval.samples)")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--env", help="environment name")
    p.add_argument("--split", help="split to evaluate (train/dev/test)")
    p.add_argument("--n", type=int, help="number of tasks")
    p.add_argument("--guide", action="store_true",
                   help="Self-Guide checkpoint: it writes a guide before each action and the guide steers it "
                        "(the config's selfguide section gives the guide position)")
    p.add_argument("--guide-history", choices=["none", "last", "all"],
                   help="with --guide: past guides kept in the prompt (default all)")
    common(p)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("resume", help="continue an interrupted run")
    p.add_argument("run_dir")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_resume)

    p = sub.add_parser("report", help="(re)write runs/NAME/report.md and its plots")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("compare", help="success of several runs per seed, mean ± sd, and paired differences vs a "
                                       "baseline (names ending -sN group into arms)")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--baseline", metavar="ARM",
                   help="arm the others are compared with, by name without -sN (default: the first arm)")
    p.add_argument("--baseline-point", metavar="LABEL",
                   help="instead of another arm, pair each run with its own evaluation at LABEL (e.g. bc: the start "
                        "it evolved from), so no separate baseline runs are needed")
    p.add_argument("--baseline-at", metavar="LABEL",
                   help="the baseline arm's evaluation to pair with, instead of its last (e.g. bon-sft of a control "
                        "matched to another arm's round 2, bon-sft-2); with --baseline")
    p.add_argument("--noise-floor", metavar="ARM", nargs="+",
                   help="arms that repeat the baseline with nothing that matters changed (e.g. another minibatch "
                        "order, qevolve.policy_seed): each other arm's per-seed differences are read against theirs "
                        "(permutation p over relabellings of the pooled values); with --baseline")
    p.add_argument("--split", default="test")
    p.add_argument("--out", default="runs/compare", help="folder for compare.md and compare.png")
    p.add_argument("--metric", default="success", choices=list(METRICS),
                   help="success rate, or average final reward (ScienceWorld's published metric: the final score)")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("export", help="a run's trajectories as TRL-style datasets (messages, prompt/completion, "
                                      "preference pairs, steps); see docs/data.md")
    p.add_argument("run_dir")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet",
                   help="parquet needs the export extra (pyarrow); jsonl needs nothing")
    p.add_argument("--kind", action="append", choices=["messages", "prompt_completion", "preference", "steps"],
                   help="which rows (repeatable; default all four)")
    p.add_argument("--collection", action="append", help="only these collections (repeatable; default all)")
    p.add_argument("--out", help="output folder (default RUN_DIR/export)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("study", help="arms x seeds of `agentevo train` from one study file, in order, each resumed "
                                     "where it stopped, archived and compared at the end (agentevo/study.py)")
    p.add_argument("file", help="study YAML (configs/study/*.study.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the runs, their status and commands; run nothing")
    p.add_argument("--progress", action="store_true", help="progress bars in each run (default: plain lines)")
    p.add_argument("--seed", action="append", type=int, help="only this seed (repeatable; runs in the order given)")
    p.add_argument("--arm", action="append", help="only this arm and the arms it reads from (repeatable)")
    p.add_argument("--rerun-sources", action="store_true",
                   help="run again an archived run that a new run starts from (an archive keeps no checkpoints); it "
                        "must reproduce its archive's evaluations")
    p.set_defaults(fn=cmd_study)

    p = sub.add_parser("archive", help="a run's record without its weights (config, state, metrics, report, and "
                                       "the evaluations' trajectories), small enough to commit beside a study; "
                                       "compare and report read the archive like the run")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", required=True, help="folder the archives go in, one OUT/NAME per run (replaced whole)")
    p.add_argument("--collection", action="append", metavar="PATTERN",
                   help="trajectories of the collections matching this SQL LIKE pattern (repeatable; default "
                        "'eval/%%', the evaluations; add e.g. 'update-%%' for a GRPO run's rollouts)")
    p.add_argument("--no-steps", action="store_true",
                   help="keep only each trajectory's outcome (what compare reads), not its steps")
    p.set_defaults(fn=cmd_archive)

    p = sub.add_parser("import", help="trajectories from a file (our steps/trajectory export, or the plain format "
                                      "of docs/data.md) into a run's store")
    p.add_argument("file", help=".jsonl or .parquet file")
    p.add_argument("--into", required=True, help="run folder, runs/NAME (made if new)")
    p.add_argument("--collection", help="put every trajectory here (default: the collection each one names, "
                                        "else 'expert', the demos every method's warm start trains on)")
    p.add_argument("--source", help="set every trajectory's source (expert, self, ...)")
    p.add_argument("--drop-ids", action="store_true",
                   help="store replies as text only (token ids and log-probs dropped): needed when the target run's "
                        "tokenizer differs from the one that produced them, e.g. between two tiny-model runs")
    p.set_defaults(fn=cmd_import)

    p = sub.add_parser("envs", help="list, show or play environments")
    p.add_argument("action", choices=["list", "show", "play"])
    p.add_argument("name", nargs="?")
    p.add_argument("--split", default="train")
    p.add_argument("--task", type=int, default=0, help="task index in the split")
    p.set_defaults(fn=cmd_envs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; user errors print one line and exit with status 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _set_interrupt_hint(None)
    try:
        return int(args.fn(args))
    except AgentevoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; {_INTERRUPT_HINT}" if _INTERRUPT_HINT else "interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """Console-script entry: exit with main()'s status."""
    code = main()
    if "fast_downward" in sys.modules:
        # ALFWorld's planner library (ctypes) segfaults in native teardown at exit: leave without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
