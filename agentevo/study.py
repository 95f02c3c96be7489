"""A study in one command: arms x seeds of `agentevo train`, run in a fixed order, resumed where they stopped,
archived as they finish, compared at the end.

A study file (YAML) names what a bash loop over `agentevo train` would, and nothing else:

    name: sg8s                      # runs are NAME-ARM-sSEED under output_dir
    output_dir: runs/real
    seeds: [0, 1, 2]
    order: seed                     # seed: every arm of seed 0, then seed 1 ...; arm: every seed of an arm in turn
    method: selfguide               # default recipe of the arms
    config: null                    # optional base YAML config (as `agentevo train --config`)
    set: {env.name: probe-guide}    # dotted overrides every arm gets
    arms:                           # in the order they run within a seed
      none: {set: {selfguide.guide: none}}
      lam0: {set: {selfguide.schedule: none}}
      const: {set: {selfguide.schedule: constant}, warm_start_from: lam0}   # that arm's run of the same seed
      # an arm may name its own base config (and take its recipe from it), and a value may name another arm's run
      # of the same seed as {run:ARM}: e.g. {config: configs/x.yaml, set: {qevolve.round1_data_from: "{run:qe}"}}
    archive: docs/studies/x/runs    # optional: `agentevo archive --no-steps` of each finished run
    compare:                        # optional: `agentevo compare` calls once every run has finished
      - {baseline: none, out: runs/cmp/vs-none}
      - {arms: [lam0, const], baseline: lam0, out: runs/cmp/vs-lam0}
      # an entry may add noise_floor: [ARM, ...], arms that repeat the baseline with nothing that matters changed
      # (another minibatch order): every other arm's per-seed differences are read against theirs
      # (agentevo compare --noise-floor; configs/study/qevolve_cookingworld.study.yaml has one)

`agentevo study FILE` checks every arm's config before any work, then for each run in order: skips it when it has
finished, resumes it when its folder exists, starts it otherwise, each in its own `agentevo train` / `resume`
process (what a user would type, printed before it runs). A failed run stops the study; running the command again
continues from that run. `--dry-run` prints the plan and each run's status; `--seed N` (repeatable) runs only those
seeds, in that order (one machine per seed, or the missing seed first); `--arm NAME` (repeatable) only those arms
and the arms they read from.

A run whose folder is gone but whose archive holds a finished run (a new machine, a deleted runs/) is `archived`:
it is not run again and its archive stands in for it in the comparisons. A run that starts from an archived run
(a warm start, a {run:ARM}) needs that run's folder, which an archive does not keep: the study refuses before any
work, or with `--rerun-sources` runs the source again first and goes on only if the rerun's evaluations equal its
archive's (same CPU model and threads reproduce a run exactly; another model trains another network). A finished
run is never archived over an archive of a finished run whose evaluations differ.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentevo.config import dump_config, flatten_dotted, load_config, read_yaml_mapping
from agentevo.errors import ConfigError
from agentevo.eval.compare import SEED_SUFFIX, compare
from agentevo.run import FINISHED

STUDY_KEYS = ("name", "output_dir", "seeds", "order", "method", "config", "set", "arms", "archive", "compare")
ARM_KEYS = ("method", "config", "set", "warm_start_from")
COMPARE_KEYS = ("arms", "baseline", "baseline_at", "baseline_point", "noise_floor", "split", "metric", "out")
_ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_RUN_REF = re.compile(r"\{run:([^}]*)\}")  # {run:ARM}: that arm's run folder, same seed


@dataclass
class Arm:
    """One arm: its recipe, base config, overrides (beside the study's), the arm whose run of the same seed it starts
    from, and every arm whose run it reads (the warm start and each {run:ARM} in its overrides)."""

    name: str
    method: str
    overrides: list[str]
    warm_start_from: str | None = None
    config: str | None = None
    needs: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """One `agentevo compare` call over the study's runs."""

    arms: list[str]
    out: Path
    baseline: str | None = None
    baseline_point: str | None = None
    split: str = "test"
    metric: str = "success"
    noise_floor: list[str] | None = None
    baseline_at: str | None = None


@dataclass
class Study:
    """A study file, checked."""

    path: Path
    name: str
    output_dir: Path
    seeds: list[int]
    order: str
    config: str | None
    arms: list[Arm]
    archive: Path | None = None
    compare: list[Comparison] = field(default_factory=list)


@dataclass
class PlannedRun:
    """One run of the study and what the command will do with it."""

    arm: Arm
    seed: int
    name: str
    dir: Path
    status: str  # finished | partial | new | archived
    argv: list[str]  # `agentevo ...` arguments (without the program)
    archive: Path | None = None  # where the study archives it (None: the study keeps no archive)

    @property
    def results(self) -> Path:
        """The folder its results are read from: the run's, or its archive's when only the archive is left."""
        return self.archive if self.status == "archived" and self.archive is not None else self.dir


def _overrides(where: str, raw: Any) -> list[str]:
    """A `set:` block (mapping of dotted keys, or a list of KEY=VALUE strings) as --set strings."""
    if raw is None:
        return []
    if isinstance(raw, dict):  # a {run:ARM} path stays unquoted, so the command line shows the folder plainly
        return [f"{k}={v}" if isinstance(v, str) and _RUN_REF.search(v) else
                f"{k}={yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"
                for k, v in raw.items()]
    if isinstance(raw, list) and all(isinstance(x, str) and "=" in x for x in raw):
        return list(raw)
    raise ConfigError(f"{where}: 'set' must map dotted keys to values ({{optim.lr: 1e-5}}) or list KEY=VALUE strings")


def _unknown(where: str, data: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = [k for k in data if k not in allowed]
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}; allowed: {', '.join(allowed)}")


def load_study(path: str | Path, check_configs: bool = True) -> Study:
    """Read and check a study file; with check_configs every arm's config is built and validated (no work done)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"study file {str(path)!r} does not exist; see configs/study/*.study.yaml")
    data = read_yaml_mapping(path)
    where = f"study {str(path)!r}"
    _unknown(where, data, STUDY_KEYS)
    name = data.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"{where}: 'name' must be a plain name (the runs are NAME-ARM-sSEED)")
    seeds = data.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}: 'seeds' must be a list of distinct non-negative integers, e.g. [0, 1, 2]")
    order = data.get("order", "seed")
    if order not in ("seed", "arm"):
        raise ConfigError(f"{where}: 'order' must be seed (every arm of a seed in turn) or arm (every seed of an arm)")
    raw_arms = data.get("arms")
    if not isinstance(raw_arms, dict) or not raw_arms:
        raise ConfigError(f"{where}: 'arms' must map each arm's name to its settings ({{none: {{set: {{...}}}}}})")
    base_method = data.get("method")
    base_sets = _overrides(where, data.get("set"))
    arms: list[Arm] = []
    for arm_name, raw in raw_arms.items():
        arm_where = f"{where}, arm {arm_name!r}"
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{arm_where}: settings must be a mapping (method, config, set, warm_start_from)")
        _unknown(arm_where, raw, ARM_KEYS)
        # a name ending in -sN would break compare's NAME-sN grouping
        if not isinstance(arm_name, str) or not _ARM_NAME.fullmatch(arm_name) or SEED_SUFFIX.search(arm_name):
            raise ConfigError(f"{arm_where}: an arm's name is letters, digits, '-' and '_' and does not end in -sN")
        config = raw.get("config", data.get("config"))
        if config is not None and not Path(config).exists():
            raise ConfigError(f"{arm_where}: config file {config!r} does not exist; see configs/ for examples")
        method = raw.get("method", base_method)
        if not method and config is not None:
            method = read_yaml_mapping(Path(config)).get("method")
        if not method:
            raise ConfigError(f"{arm_where}: no recipe; set 'method' for the study or the arm (or in its config)")
        dep = raw.get("warm_start_from")
        sets = base_sets + _overrides(arm_where, raw.get("set"))
        needs = list(dict.fromkeys([*([dep] if dep is not None else []),
                                    *(m for item in sets for m in _RUN_REF.findall(item))]))
        for need in needs:
            if need not in [a.name for a in arms]:
                how = f"warm_start_from {need!r}" if need == dep else f"{{run:{need}}}"
                raise ConfigError(f"{arm_where}: {how} must name an arm listed before it (its run of the same seed has "
                                  "to finish first)")
        arms.append(Arm(arm_name, str(method), sets, dep, config, needs))
    compares = []
    for k, raw in enumerate(data.get("compare") or []):
        c_where = f"{where}, compare #{k + 1}"
        if not isinstance(raw, dict) or "out" not in raw:
            raise ConfigError(f"{c_where}: each entry needs at least 'out' (the folder for compare.md)")
        _unknown(c_where, raw, COMPARE_KEYS)
        names = raw.get("arms") or [a.name for a in arms]
        missing = [a for a in [*names, *([raw["baseline"]] if raw.get("baseline") else []),
                               *(raw.get("noise_floor") or [])] if a not in [x.name for x in arms]]
        if missing:
            raise ConfigError(f"{c_where}: {missing[0]!r} is not an arm of the study ({', '.join(a.name for a in arms)})")
        if raw.get("baseline_at") and not raw.get("baseline"):
            raise ConfigError(f"{c_where}: baseline_at names an evaluation of the baseline arm; give baseline: ARM too")
        names = [*names, *(a for a in raw.get("noise_floor") or [] if a not in names)]  # their runs are read too
        compares.append(Comparison(list(names), Path(raw["out"]), raw.get("baseline"), raw.get("baseline_point"),
                                   raw.get("split", "test"), raw.get("metric", "success"), raw.get("noise_floor"),
                                   raw.get("baseline_at")))
    study = Study(path, name, Path(data.get("output_dir") or "runs"), seeds, order, data.get("config"), arms,
                  Path(data["archive"]) if data.get("archive") else None, compares)
    if check_configs:
        for arm in arms:  # every run's config is checked now, not hours later when its turn comes
            for k, seed in enumerate(seeds):
                try:
                    load_config(arm.config, _run_overrides(study, arm, seed), method=arm.method,
                                name=run_name(study, arm.name, seed), output_dir=str(study.output_dir))
                except ConfigError as exc:
                    at = f", seed {seed}" if k else ""  # the first seed's error is the arm's, at every seed
                    raise ConfigError(f"{where}, arm {arm.name!r}{at}: {exc}") from None
    return study


def arm_group(study: Study, arm: str) -> str:
    """The name compare gives an arm's runs (their folder names less -sSEED)."""
    return f"{study.name}-{arm}"


def run_name(study: Study, arm: str, seed: int) -> str:
    """The run folder's name: compare groups NAME-ARM-sSEED by arm."""
    return f"{arm_group(study, arm)}-s{seed}"


def eval_summary(run_dir: Path) -> dict[str, tuple[Any, ...]]:
    """Each evaluation's split results in a run's (or archive's) state.json: 'eval/bc/test' -> (task hash, n, success
    rate, average reward)."""
    try:
        state = json.loads((run_dir / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {f"{phase}/{split}": (r.get("task_hash"), r.get("n"), r.get("success_rate"), r.get("avg_reward"))
            for phase, splits in state.items() if phase.startswith("eval/") and isinstance(splits, dict)
            for split, r in splits.items() if isinstance(r, dict)}


def _shown(result: tuple[Any, ...] | None) -> str:
    return "missing" if result is None else f"success {result[2]} on {result[1]} (tasks {result[0]})"


def summary_difference(archived: dict[str, tuple[Any, ...]], now: dict[str, tuple[Any, ...]]) -> str | None:
    """The first evaluation where two summaries differ ('eval/bc/test: success 0.28 ... archived, 0.265 ... now'),
    else None."""
    for key in sorted(set(archived) | set(now)):
        if archived.get(key) != now.get(key):
            return f"{key}: {_shown(archived.get(key))} archived, {_shown(now.get(key))} now"
    return None


def _finished(run_dir: Path) -> bool:
    state = run_dir / "state.json"
    try:
        return state.exists() and FINISHED in json.loads(state.read_text())
    except (json.JSONDecodeError, TypeError):
        return False


def run_status(run_dir: Path, archive_dir: Path | None = None) -> str:
    """finished (its recipe returned), partial (a folder to resume), archived (no folder, but `archive_dir` holds the
    finished run's archive) or new."""
    if _finished(run_dir):
        return "finished"
    if (run_dir / "config.yaml").exists():
        return "partial"
    if archive_dir is not None and _finished(archive_dir) and (archive_dir / "experience.db").exists():
        return "archived"
    return "new"


def _run_overrides(study: Study, arm: Arm, seed: int) -> list[str]:
    """The --set overrides of one run: the study's and the arm's (each {run:ARM} as that arm's run folder), the seed,
    and the warm start's run folder."""
    def folder(name: str) -> Path:
        return study.output_dir / run_name(study, name, seed)

    sets = [_RUN_REF.sub(lambda m: str(folder(m.group(1))), item) for item in arm.overrides] + [f"seed={seed}"]
    if arm.warm_start_from:
        sets.append(f"bc.warm_start_from={folder(arm.warm_start_from)}")
    return sets


def with_needs(study: Study, arms: list[str]) -> list[str]:
    """`arms` and every arm whose runs they read (warm starts, {run:ARM}), transitively, in the study's order."""
    known = {a.name: a for a in study.arms}
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ConfigError(f"--arm {unknown[0]} is not an arm of study {study.name} ({', '.join(known)})")
    wanted, todo = set(), list(arms)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(known[name].needs)
    return [a.name for a in study.arms if a.name in wanted]


def plan(study: Study, quiet: bool = True, seeds: list[int] | None = None,
         arms: list[str] | None = None) -> list[PlannedRun]:
    """Every run of the study in the order it runs (only `seeds`, in that order, when given; only `arms` and the arms
    they read from, when given), with its status and the command that (re)runs it."""
    wanted = with_needs(study, arms) if arms else [a.name for a in study.arms]
    chosen = [a for a in study.arms if a.name in wanted]
    if seeds:
        unknown = [s for s in seeds if s not in study.seeds]
        if unknown:
            raise ConfigError(f"--seed {unknown[0]} is not a seed of study {study.name} "
                              f"({', '.join(map(str, study.seeds))}); add it to the study file's seeds first")
    order = seeds or study.seeds
    pairs = ([(arm, seed) for seed in order for arm in chosen] if study.order == "seed"
             else [(arm, seed) for arm in chosen for seed in order])
    runs = []
    for arm, seed in pairs:
        name = run_name(study, arm.name, seed)
        run_dir = study.output_dir / name
        archive_dir = study.archive / name if study.archive is not None else None
        status = run_status(run_dir, archive_dir)
        tail = ["--quiet"] if quiet else []
        if status == "partial":
            argv = ["resume", str(run_dir), *tail]
        else:
            argv = ["train", arm.method, *(["--config", arm.config] if arm.config else [])]
            for item in _run_overrides(study, arm, seed):
                argv += ["--set", item]
            argv += ["--name", name, "--output-dir", str(study.output_dir), *tail]
        runs.append(PlannedRun(arm, seed, name, run_dir, status, argv, archive_dir))
    return runs


def config_drift(study: Study, r: PlannedRun) -> str | None:
    """Where an existing run's config.yaml differs from what the study file now gives it ('key: A in the run, B in
    the study'), None when they agree (or the run has no folder yet)."""
    path = r.results / "config.yaml"
    if not path.exists():
        return None
    wanted = load_config(r.arm.config, _run_overrides(study, r.arm, r.seed), method=r.arm.method, name=r.name,
                         output_dir=str(study.output_dir))
    ours = flatten_dotted(yaml.safe_load(dump_config(wanted)))
    theirs = flatten_dotted(yaml.safe_load(path.read_text()) or {})
    for key in sorted(set(ours) & set(theirs)):  # a setting added or removed since the run was made is not drift
        if ours[key] != theirs[key]:
            return f"{key}: {theirs[key]!r} in the run, {ours[key]!r} in the study"
    return None


def duration(seconds: float) -> str:
    """'42 s', '7 min 05 s', '2 h 03 min'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def progress_note(k: int, left: list[str], took: dict[str, list[float]],
                  earlier: dict[str, list[float]] | None = None) -> str:
    """'run 3 of 9; 2 done in 31 min 10 s, about 1 h 49 min left' for the k-th run of this call, `left` the arms of
    the runs from this one on. Each is estimated at its arm's mean time in this call, else at its arm's mean over
    `earlier` (the study's runs made before, on this CPU model), else at the mean of every run timed, in this call
    and before it (a quick first arm alone would price a long new one at its few minutes); no estimate before one
    is timed."""
    earlier = earlier or {}
    done = [x for xs in took.values() for x in xs]
    timed = done + [x for xs in earlier.values() for x in xs]
    note = f"run {k} of {k - 1 + len(left)}"
    if done:
        note += f"; {len(done)} done in {duration(sum(done))}"
    if timed:
        mean = sum(timed) / len(timed)
        estimate = sum(sum(took[a]) / len(took[a]) if a in took else
                       sum(earlier[a]) / len(earlier[a]) if a in earlier else mean for a in left)
        note += f"{';' if not done else ','} about {duration(estimate)} left"
        if not done:
            n = len(timed)
            note += f" (from {n} earlier run{'s' * (n != 1)} on this CPU)"
    return note


def earlier_times(runs: list[PlannedRun], cpu: str) -> dict[str, list[float]]:
    """Arm -> the seconds each finished run of the study (its folder, else its archive) computed, for the runs whose
    first start was on this CPU model (recorded in state.json from 2026-12-07 on)."""
    from agentevo.machine import STATE_KEY, compute_seconds
    from agentevo.train.tracking import MetricsLogger

    times: dict[str, list[float]] = {}
    for r in runs:
        folder = next((d for d in (r.dir, r.archive) if d is not None and _finished(d)), None)
        if folder is None:
            continue
        try:
            starts = json.loads((folder / "state.json").read_text()).get(STATE_KEY) or []
        except (OSError, ValueError):
            continue
        if not starts or starts[0].get("cpu") != cpu:
            continue
        records = MetricsLogger(folder, enabled=False).records()
        seconds = compute_seconds(starts, [x["time"] for x in records if isinstance(x.get("time"), (int, float))])
        if seconds > 0:
            times.setdefault(r.arm.name, []).append(seconds)
    return times


def _subprocess_runner(argv: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "agentevo.cli", *argv], check=False).returncode


def run_study(study: Study, dry_run: bool = False, quiet: bool = True, echo: Callable[[str], None] = print,
              runner: Callable[[list[str]], int] = _subprocess_runner, seeds: list[int] | None = None,
              arms: list[str] | None = None, rerun_sources: bool = False,
              clock: Callable[[], float] = time.monotonic) -> list[PlannedRun]:
    """Run (or with dry_run only print) the study's unfinished runs in order (only `seeds` and `arms`, with the arms
    those read from, when given), archive each finished run, then write the comparisons over every finished run.
    With rerun_sources an archived run that a new run starts from is run again (and must reproduce its archive).
    Raises ConfigError naming the run when one fails."""
    runs = plan(study, quiet, seeds, arms)
    done = sum(r.status == "finished" for r in runs)
    kept = sum(r.status == "archived" for r in runs)
    n_arms, n_seeds = len({r.arm.name for r in runs}), len({r.seed for r in runs})
    echo(f"study {study.name}: {len(runs)} runs ({n_arms} arm{'s' * (n_arms != 1)} x {n_seeds} "
         f"seed{'s' * (n_seeds != 1)}), {done} finished"
         + (f", {kept} left as archives only" if kept else ""))
    for r in runs:
        echo(f"  {r.name:32s} {r.status:8s} agentevo {shlex.join(r.argv)}")
    for r in runs:  # an edited study file must not resume a run made with other settings
        drift = config_drift(study, r) if r.status != "new" else None
        if drift:
            raise ConfigError(f"study {study.name}: run {r.name} was made with other settings than {study.path} gives "
                              f"now ({drift}); restore the study file, or move {r.results} aside to run it again")
    by_name = {(r.arm.name, r.seed): r for r in runs}
    reruns: set[str] = set()
    for r in runs:  # a run that reads another needs its folder (checkpoints, data), which an archive does not keep
        for need in r.arm.needs if r.status == "new" else []:
            source = by_name.get((need, r.seed))
            if source is not None and source.status == "archived":
                if not rerun_sources:
                    raise ConfigError(f"study {study.name}: run {r.name} starts from {source.name}, which is left only "
                                      f"as an archive ({source.archive}, no checkpoints); pass --rerun-sources to run "
                                      f"{source.name} again first (it must reproduce its archive), or move that "
                                      "archive aside")
                reruns.add(source.name)
    for r in runs:
        if r.name in reruns:
            r.status = "new"
            echo(f"  {r.name}: run again (read by a later run; its archive has no checkpoints)")
    if dry_run:
        return runs
    todo = [r for r in runs if r.status not in ("archived", "finished")]
    took: dict[str, list[float]] = {}  # arm -> seconds of its runs finished by this call, for the estimate of what is left
    from agentevo.machine import cpu_description

    earlier = earlier_times(plan(study, quiet), cpu_description()[0])  # the arms' earlier runs (any seed), this CPU
    for r in runs:
        if r.status == "archived":
            continue
        if r.status != "finished":
            k = sum(map(len, took.values())) + 1
            echo(f"{r.name}: {'resuming' if r.status == 'partial' else 'starting'} "
                 f"({progress_note(k, [x.arm.name for x in todo[k - 1:]], took, earlier)})")
            start = clock()
            code = runner(r.argv)
            if code != 0 or run_status(r.dir) != "finished":
                raise ConfigError(f"study {study.name}: run {r.name} stopped (exit code {code}); see its output, fix "
                                  f"the cause and run `agentevo study {study.path}` again to continue from it")
            took.setdefault(r.arm.name, []).append(clock() - start)
            echo(f"{r.name}: finished in {duration(took[r.arm.name][-1])}")
            r.status = "finished"
        if r.archive is not None:
            from agentevo.data.archive import archive_run

            if _finished(r.archive):  # a rerun (or a run made again) must not replace a finished run's record
                now = eval_summary(r.dir)
                diff = summary_difference(eval_summary(r.archive), now)
                if diff:
                    raise ConfigError(f"study {study.name}: run {r.name} differs from its archive ({diff}); runs "
                                      f"that read it would start from another model than its archived runs did. Run "
                                      f"it on the CPU model (and threads) that made the archive, or move "
                                      f"{r.archive} aside to keep the new run")
                if r.name in reruns:
                    n = len(now)
                    echo(f"{r.name}: the rerun reproduces its archive ({n} evaluation{'s' * (n != 1)} equal)")
            echo(archive_run(r.dir, r.archive.parent, steps=False).line(r.dir))
    every = [r for r in plan(study, quiet) if r.status in ("finished", "archived")]  # other seeds' count too
    for c in study.compare:
        dirs = [r.results for r in every if r.arm.name in c.arms]
        if not dirs or (c.baseline and not any(r.arm.name == c.baseline for r in every)):
            echo(f"compare -> {c.out}: skipped, its arms have no finished runs yet")
            continue
        baseline = arm_group(study, c.baseline) if c.baseline else None
        noise = [arm_group(study, a) for a in c.noise_floor] if c.noise_floor else None
        result = compare(dirs, c.split, c.out, c.metric, baseline, baseline_point=c.baseline_point,
                         noise_floor=noise, baseline_at=c.baseline_at)
        echo(f"compare -> {result.path}")
        for line in [*result.sentences, *result.noise_sentences]:
            echo(line)
    return runs
