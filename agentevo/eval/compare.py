"""Compare runs: held-out success per evaluation point per seed, mean ± sd, and paired differences vs a baseline.

Runs are grouped into arms by name with a trailing seed suffix removed (`qe-cw-s0`, `qe-cw-s1` -> `qe-cw`; N of
`-sN` is the seed index). Evaluation points are the `eval/<label>` phases of state.json (`bc`, `round-1`,
`update-4`, ...), in the order they ran. Environment steps at each point are those the run collected after its BC
warm start (Q-Evolve's self-collected steps, `round-r/label`; GRPO's `train_env_steps`; RSD's `round-r/act`; BoN's
samples; Harness@Inf's bank); `bc` is 0.

Each arm is compared with a baseline arm on per-task outcomes (the run's experience.db, collection
eval/<label>/<split>): seeds paired by index, tasks by id on the same task list (agentevo/eval/stats.py).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentevo.errors import ConfigError
from agentevo.eval.metrics import eval_collection
from agentevo.eval.stats import PairedResult, format_p, paired_difference, permutation_p
from agentevo.files import replacing, write_text_atomic
from agentevo.train.tracking import MetricsLogger

SEED_SUFFIX = re.compile(r"-s(\d+)$")
METRICS = {"success": "held-out success (%)", "reward": "held-out average final reward (x100)"}
N_BOOT = 10_000
BOOT_SEED = 0


@dataclass
class Point:
    """One evaluation of one run."""

    label: str  # what rows and columns are matched by
    success: float
    reward: float
    env_steps: float | None
    task_hash: str | None = None
    key: str = ""  # the label the run stored it under (state.json, experience.db), when it differs from `label`

    @property
    def stored_label(self) -> str:
        return self.key or self.label

    def value(self, metric: str) -> float:
        """The compared number in percent: success rate, or average final reward (ScienceWorld's score) x 100."""
        return 100 * (self.success if metric == "success" else self.reward)


@dataclass
class RunInfo:
    """One run folder of an arm: its seed index, environment and evaluation points by label."""

    dir: Path
    seed: int | None
    env: str
    points: dict[str, Point]

    @property
    def name(self) -> str:
        """The run folder's name."""
        return self.dir.name


@dataclass
class Group:
    """Runs that differ only by seed (an arm), ordered by seed index."""

    name: str
    runs: list[str] = field(default_factory=list)
    points: dict[str, list[Point]] = field(default_factory=dict)  # label -> one point per run that has it
    members: list[RunInfo] = field(default_factory=list)

    @property
    def envs(self) -> list[str]:
        """The environments of its runs, in order, without repeats."""
        return list(dict.fromkeys(m.env for m in self.members))


@dataclass
class Paired:
    """One arm against the baseline at one pair of evaluation points; result None with a reason when not paired."""

    arm: str
    label: str
    base_label: str
    result: PairedResult | None
    reason: str = ""


@dataclass
class Comparison:
    """What compare() wrote: compare.md's path, the per-seed table, the paired table and sentences, warnings."""

    path: Path
    baseline: str
    table: str
    paired_table: str
    sentences: list[str]
    warnings: list[str]
    text: str
    noise_table: str = ""  # each arm's per-seed differences against the noise-floor arms' (--noise-floor)
    noise_sentences: list[str] = field(default_factory=list)


def _env_steps(state: dict[str, Any], label: str, result: dict[str, Any]) -> float | None:
    """Environment steps the run collected after its BC warm start, up to this evaluation (bc = 0)."""
    if "train_env_steps" in result:
        return float(result["train_env_steps"])
    if label in ("bc", "ctx-bc", "base", "gt-sft"):  # warm starts and gold-only fine-tuning collect nothing
        return 0.0
    match = re.fullmatch(r"round-(\d+)", label)
    if match:
        rec = state.get(f"round-{match.group(1)}/label", {})
        if "env_steps_cumulative" in rec:
            return float(rec["env_steps_cumulative"] - rec.get("env_steps_expert", 0))
        acts = [state.get(f"round-{i}/act", {}) for i in range(1, int(match.group(1)) + 1)]
        if all("env_steps" in a for a in acts):  # RSD / GT-OPSD: one trajectory per task per round
            return float(sum(a["env_steps"] for a in acts))
    collected = {"bon-sft": "bon/collect", "harness": "harness/bank"}.get(label)
    if collected and "env_steps" in state.get(collected, {}):
        return float(state[collected]["env_steps"])  # BoN's samples; Harness@Inf's bank of base trajectories
    match = re.fullmatch(r"eto-iter-(\d+)", label)
    if match:  # ETO: every exploration up to this iteration
        explores = [state.get(f"eto/iter-{i}/explore", {}) for i in range(1, int(match.group(1)) + 1)]
        if all("env_steps" in e for e in explores):
            return float(sum(e["env_steps"] for e in explores))
    if label == "qlass" and "env_steps" in state.get("qlass/trees", {}):
        return float(state["qlass/trees"]["env_steps"])  # tree building; its test-time search steps are not training
    return None


_STANDALONE = re.compile(r"-[0-9a-f]{8}$")  # the hash `agentevo eval` appends to a checkpoint's name


def load_points(run_dir: Path, split: str) -> list[Point]:
    """The run's evaluation points on the split, in the order they ran."""
    path = run_dir / "state.json"
    if not path.exists():
        raise ConfigError(f"{str(run_dir)!r} is not a run folder (no state.json); give runs/NAME")
    state = json.loads(path.read_text())
    points = []
    for key, per_split in state.items():
        if key.startswith("eval/") and isinstance(per_split, dict) and isinstance(per_split.get(split), dict):
            label, m = key[len("eval/") :], per_split[split]
            points.append(Point(label, float(m["success_rate"]), float(m["avg_reward"]), _env_steps(state, label, m),
                                m.get("task_hash")))
    # `agentevo eval` stores CHECKPOINT-<hash of checkpoint and settings> (a cache key, unique per checkpoint); match
    # such points by the checkpoint's name, so the same checkpoint of several seeds' runs pairs up
    names = [_STANDALONE.sub("", p.label) for p in points]
    for p, name in zip(points, names, strict=True):
        if name != p.label and names.count(name) == 1 and name not in (q.label for q in points):
            p.key, p.label = p.label, name
    return points


def _run_env(run_dir: Path) -> str:
    """The environment name in the run's config.yaml ('?' when it has none)."""
    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text()) if path.exists() else None
    except yaml.YAMLError:
        return "?"
    env = cfg.get("env") if isinstance(cfg, dict) else None
    return str(env.get("name", "?")) if isinstance(env, dict) else "?"


def group_runs(run_dirs: list[Path], split: str) -> list[Group]:
    """Arms in the order first named, each with its runs sorted by seed index."""
    groups: dict[str, Group] = {}
    for run_dir in run_dirs:
        match = SEED_SUFFIX.search(run_dir.name)
        seed = int(match.group(1)) if match else None
        group = groups.setdefault(SEED_SUFFIX.sub("", run_dir.name), Group(SEED_SUFFIX.sub("", run_dir.name)))
        same = [m for m in group.members if m.seed == seed]
        if same:  # pairing is by seed index, so one arm cannot hold a seed twice
            raise ConfigError(f"runs {str(same[0].dir)!r} and {str(run_dir)!r} are both seed {seed} of arm "
                              f"{group.name!r}; give each seed of an arm once")
        points = {p.label: p for p in load_points(run_dir, split)}
        group.members.append(RunInfo(run_dir, seed, _run_env(run_dir), points))
    for group in groups.values():
        group.members.sort(key=lambda m: -1 if m.seed is None else m.seed)
        group.runs = [m.name for m in group.members]
        for m in group.members:
            for label, point in m.points.items():
                group.points.setdefault(label, []).append(point)
    return list(groups.values())


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _seed_name(m: RunInfo) -> str:
    return "-" if m.seed is None else f"s{m.seed}"


def markdown_table(groups: list[Group], labels: list[str], metric: str = "success") -> str:
    """The metric (%) per arm and evaluation point: mean ± sd over seeds, then each seed's value in seed order
    (the `seeds` column), '-' for a seed (or a whole arm) without that point."""
    head = "| runs | env | seeds | " + " | ".join(labels) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(labels)]
    for g in groups:
        cells = []
        for label in labels:
            values = [m.points[label].value(metric) if label in m.points else None for m in g.members]
            known = [v for v in values if v is not None]
            if not known:
                cells.append("-")
                continue
            mean, sd = _mean_sd(known)
            per_seed = " / ".join("-" if v is None else f"{v:.1f}" for v in values)
            cells.append(f"{mean:.1f} ± {sd:.1f} ({per_seed})")
        seeds = ", ".join(_seed_name(m) for m in g.members)
        lines.append(f"| {g.name} | {', '.join(g.envs)} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_outcomes(run_dir: Path, label: str, split: str, metric: str) -> dict[str, float] | None:
    """Per-task outcome (points: success or final reward x 100) of one evaluation from the run's experience.db;
    None when the store or the evaluation's collection is not there."""
    db = run_dir / "experience.db"
    if not db.exists():
        return None
    try:
        con = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)  # read-only: never touch the run
        try:
            rows = con.execute("SELECT task_id, success, final_reward FROM trajectories WHERE collection = ? "
                               "ORDER BY slot", (eval_collection(label, split),)).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    per_task: dict[str, list[float]] = {}
    for task_id, success, reward in rows:
        per_task.setdefault(str(task_id), []).append(100.0 * float(success if metric == "success" else reward))
    return {t: statistics.fmean(v) for t, v in per_task.items()} or None


def _different_tasks(a: RunInfo, b: RunInfo, split: str, detail: str) -> ConfigError:
    return ConfigError(f"runs {a.name!r} and {b.name!r} were evaluated on different task lists for split {split!r} "
                       f"({detail}); pair only runs evaluated on the same tasks (same env, env.n_{split} and "
                       f"eval.n_tasks), or compare them in separate calls")


def pair_arms(arm: Group, base: Group, label: str, base_label: str, split: str, metric: str,
              n_boot: int = N_BOOT) -> Paired:
    """Arm at `label` minus baseline at `base_label`, seeds paired by index and tasks by id.

    Raises ConfigError when two paired runs were evaluated on different task lists of the same environment.
    """
    by_seed = {m.seed: m for m in base.members if base_label in m.points}
    pairs = [(m, by_seed[m.seed]) for m in arm.members if label in m.points and m.seed in by_seed]
    if not pairs:
        return Paired(arm.name, label, base_label, None, "no seed index in common with the baseline")
    envs = {(a.env, b.env) for a, b in pairs if a.env != b.env and "?" not in (a.env, b.env)}
    if envs:
        a_env, b_env = sorted(envs)[0]
        return Paired(arm.name, label, base_label, None, f"different environment ({a_env} vs {b_env})")
    for a, b in pairs:
        ha, hb = a.points[label].task_hash, b.points[base_label].task_hash
        if ha and hb and ha != hb:
            raise _different_tasks(a, b, split, f"task hash {ha} vs {hb}")
    outcomes = [(task_outcomes(a.dir, a.points[label].stored_label, split, metric),
                 task_outcomes(b.dir, b.points[base_label].stored_label, split, metric)) for a, b in pairs]
    missing = [run.name for (a, b), (oa, ob) in zip(pairs, outcomes, strict=True) for run, o in ((a, oa), (b, ob))
               if o is None]
    if missing:
        return Paired(arm.name, label, base_label, None, f"no per-task outcomes in {missing[0]}/experience.db")
    ref_run, tasks = pairs[0][1], sorted(outcomes[0][1] or {})
    for (a, b), (oa, ob) in zip(pairs, outcomes, strict=True):
        for run, o in ((a, oa), (b, ob)):
            if sorted(o or {}) != tasks:
                raise _different_tasks(run, ref_run, split, "their task ids differ")
    arm_m = [[(oa or {})[t] for t in tasks] for oa, _ in outcomes]
    base_m = [[(ob or {})[t] for t in tasks] for _, ob in outcomes]
    return Paired(arm.name, label, base_label, paired_difference(arm_m, base_m, n_boot, BOOT_SEED))


_SERIES = re.compile(r"-?\d+$")


def series(label: str) -> str:
    """The kind of evaluation point without its count: update-6 -> update, round-2 -> round, eto-iter-3 -> eto-iter."""
    return _SERIES.sub("", label)


def paired_rows(groups: list[Group], base: Group, split: str, metric: str, n_boot: int = N_BOOT,
                base_at: str | None = None) -> list[Paired]:
    """Every other arm vs the baseline: each of the arm's evaluation points against the baseline's point of the
    same label, or its last one where it has no such label (GRPO's update-6 vs BC), then last point vs last point.
    `base_at` names the baseline's point to use instead of its last (e.g. a control matched to round 2's budget).

    A point is not read against the baseline's last one of the same series (update-6 vs update-3): the baseline
    has not got there (still running, or a shorter run), and the row says so instead of pairing unequal budgets;
    a `base_at` point is paired with any label, since it was chosen."""
    rows = []
    for g in groups:
        if g is base:
            continue
        base_last = base_at or (list(base.points)[-1] if base.points else None)
        compared = ([(label, label if label in base.points else base_last) for label in g.points]
                    if base_last is not None else [])
        final = (list(g.points)[-1], base_last) if g.points and base_last is not None else None
        if final and final not in compared:
            compared.append(final)
        for a, b in compared:
            if a != b and b != base_at and series(a) == series(b):
                if a in base.points:  # the arm is the shorter run: already paired at its own last point
                    continue
                rows.append(Paired(g.name, a, b, None, f"the baseline has no {a} (its last evaluation is {b}: still "
                                                       f"running or a shorter run); compare at a point both have"))
            else:
                rows.append(pair_arms(g, base, a, b, split, metric, n_boot))
    return rows


def within_run_rows(groups: list[Group], point: str, split: str, metric: str, n_boot: int = N_BOOT) -> list[Paired]:
    """Each arm's evaluation points after `point` against the same runs' own evaluation at `point` (e.g. `bc`, the
    start every run evolved from): seeds pair with themselves, so no separate baseline runs are needed."""
    rows = []
    for g in groups:
        if point not in g.points:
            rows.append(Paired(g.name, list(g.points)[-1] if g.points else "-", point, None,
                               f"no evaluation at {point!r} in this arm"))
            continue
        later = list(g.points)[list(g.points).index(point) + 1:]  # what came after the start (not e.g. init)
        rows += [pair_arms(g, g, label, point, split, metric, n_boot) for label in later]
    return rows


def _point_name(p: Paired) -> str:
    return p.label if p.label == p.base_label else f"{p.label} vs {p.base_label}"


def _per_seed(r: PairedResult) -> str:
    return " / ".join(f"{x:+.1f}" for x in r.per_pair)


def _seeds_interval(r: PairedResult) -> str:
    if r.seeds_lo is None or r.seeds_hi is None:
        return "- (one seed pair)"
    return f"[{r.seeds_lo + 0.0:+.1f}, {r.seeds_hi + 0.0:+.1f}]"  # + 0.0: no "-0.0"


def paired_table(rows: list[Paired]) -> str:
    """Markdown: difference (points), 95% bootstrap interval, better / worse (pair, task) cells and the exact p."""
    lines = ["| runs | evaluation | seed pairs | tasks | difference | per seed | 95% interval (tasks) | "
             "95% interval (seeds and tasks) | better / worse | p |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in rows:
        r = p.result
        if r is None:
            lines.append(f"| {p.arm} | {_point_name(p)} | not paired: {p.reason} | | | | | | | |")
            continue
        p_cell = format_p(r.p).replace("p = ", "").replace("p ", "")
        lines.append(f"| {p.arm} | {_point_name(p)} | {r.n_pairs} | {r.n_tasks} | {r.mean:+.1f} | {_per_seed(r)} | "
                     f"[{r.lo:+.1f}, {r.hi:+.1f}] | {_seeds_interval(r)} | {r.wins} / {r.losses} | {p_cell} |")
    return "\n".join(lines)


def paired_sentence(p: Paired, base: str) -> str:
    """One line of prose for an arm's last evaluation vs the baseline's, with honest wording about the interval.
    An empty `base` means the arm's own runs at p.base_label (compare's baseline_point)."""
    head = f"- **{p.arm}** ({p.label}; {base} at {p.base_label})" if base else f"- **{p.arm}** ({p.label})"
    base = base or f"its own {p.base_label}"
    r = p.result
    if r is None:
        return f"{head}: not paired with {base} ({p.reason})."
    if not r.excludes_zero:
        verdict = "the interval includes zero: these runs do not show a difference at this sample size"
    elif r.p >= 0.05:  # a percentile bootstrap over few tasks is too narrow; say so when the exact test disagrees
        verdict = "the interval excludes zero, but the exact test does not rule out chance (p >= 0.05): too few tasks"
    elif r.seeds_exclude_zero is False:  # the tasks say yes, another training seed might not
        verdict = (f"the interval over tasks excludes zero, but not the one over seeds and tasks "
                   f"{_seeds_interval(r)}: the seeds disagree (per seed {_per_seed(r)}), so the "
                   f"difference may not hold for another training seed; run more seeds")
    else:
        verdict = "the interval excludes zero"
        if r.seeds_exclude_zero:
            verdict += f", and so does the one over seeds and tasks {_seeds_interval(r)}"
    return (f"{head}: difference vs {base}: {r.mean:+.1f} points [{r.lo:+.1f}, {r.hi:+.1f}], {format_p(r.p)} "
            f"({r.wins} better / {r.losses} worse over {r.n_pairs} seed pair(s) x {r.n_tasks} tasks); {verdict}.")


def noise_floor_rows(finals: dict[str, Paired], noise: list[str], base: str) -> tuple[str, list[str]]:
    """Every other arm's per-seed differences from the baseline against those of the noise-floor arms (the
    baseline's method again with nothing that matters changed, e.g. another minibatch order): a table and one
    sentence per arm, with the permutation p of the difference of means (stats.permutation_p)."""
    draws = [x for name in noise if (floor := finals.get(name)) and floor.result for x in floor.result.per_pair]
    if len(draws) < 2:
        return "", [f"- noise floor: {', '.join(noise)} give {len(draws)} seed pair(s) vs {base}; it needs 2 or more"]
    sd = statistics.stdev(draws)
    lines = ["| runs | per seed | noise draws | arm mean − noise mean | p (one-sided / two-sided) |",
             "|---|---|---|---|---|"]
    sentences = []
    for name, p in finals.items():
        if name in noise or p.result is None:
            continue
        per = list(p.result.per_pair)
        one, two = permutation_p(per, draws)
        gap = statistics.mean(per) - statistics.mean(draws)
        lines.append(f"| {name} | {_per_seed(p.result)} | {' / '.join(f'{x:+.1f}' for x in draws)} | {gap:+.1f} | "
                     f"{one:.3g} / {two:.3g} |")
        smallest = 1 / math.comb(len(per) + len(draws), len(per))
        if two < 0.05:
            verdict = "outside the noise floor"
        elif smallest >= 0.05:
            verdict = (f"too few draws to tell (the smallest p these counts allow is {smallest:.2g}): run the "
                       "noise-floor arms at more seeds")
        else:
            verdict = "within the noise floor: the same method with nothing that matters changed moves as far"
        sentences.append(f"- **{name}** against the noise floor ({', '.join(noise)}: {len(draws)} differences from "
                         f"{base}, sd {sd:.1f}): {gap:+.1f} points beyond their mean, permutation p = {two:.3g} "
                         f"two-sided; {verdict}.")
    return "\n".join(lines), sentences


def plot_groups(groups: list[Group], labels: list[str], path: Path, metric: str = "success") -> None:
    """Left: the metric per evaluation point (mean ± sd); right: the metric against training env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, g in enumerate(groups):
        color = colors[n % len(colors)]
        xs, means, sds, steps = [], [], [], []
        for x, label in enumerate(labels):
            pts = g.points.get(label, [])
            if not pts:
                continue
            mean, sd = _mean_sd([p.value(metric) for p in pts])
            xs.append(x)
            means.append(mean)
            sds.append(sd)
            known = [p.env_steps for p in pts if p.env_steps is not None]
            steps.append(statistics.fmean(known) if len(known) == len(pts) else None)
        left.errorbar(xs, means, yerr=sds, marker="o", capsize=3, label=g.name, color=color)
        paired = [(s, m, d) for s, m, d in zip(steps, means, sds, strict=True) if s is not None]
        if paired:
            right.errorbar([p[0] for p in paired], [p[1] for p in paired], yerr=[p[2] for p in paired], marker="o",
                           capsize=3, label=g.name, color=color)
    left.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
    left.set_ylabel(METRICS[metric])
    left.set_title(f"{metric} per evaluation point (mean ± sd over seeds)", fontsize=9)
    right.set_xlabel("env steps collected after the BC warm start")
    right.set_title(f"{metric} vs environment steps used", fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def diagnostics_table(groups: list[Group]) -> str:
    """One row per diagnostics table of each run (arm, seed), '' when no run logged diagnostics."""
    from agentevo.eval import diagnostics  # imports torch: only when compare writes its tables

    rows = []
    for g in groups:
        for m in g.members:
            records = MetricsLogger(m.dir, enabled=False).records()  # skips a line a killed run left half-written
            for title, diags in diagnostics.diagnostic_tables(records):
                rows.append(f"| {g.name} | {_seed_name(m)} | {title} | {diagnostics.worst(diags)} | "
                            f"{diagnostics.not_passing(diags)} |")
    if not rows:
        return ""
    return "\n".join(["| runs | seed | diagnostics | worst | not passing |", "|---|---|---|---|---|", *rows])


def compare(run_dirs: list[Path], split: str, out: Path, metric: str = "success", baseline: str | None = None,
            n_boot: int = N_BOOT, baseline_point: str | None = None,
            noise_floor: list[str] | None = None, baseline_at: str | None = None) -> Comparison:
    """Write out/compare.md and out/compare.png: per-seed values, mean ± sd, paired differences vs the baseline arm
    (at its last evaluation, or at `baseline_at`), or with `baseline_point` vs each run's own evaluation at that
    label; with `noise_floor` (arms that repeat the baseline with nothing that matters changed) each other arm's
    per-seed differences are read against theirs."""
    if metric not in METRICS:
        raise ConfigError(f"--metric must be one of {', '.join(METRICS)} (got {metric!r})")
    if not run_dirs:
        raise ConfigError("give at least one run folder: agentevo compare runs/A-s0 runs/A-s1 runs/B-s0 ...")
    groups = group_runs(run_dirs, split)
    names = [g.name for g in groups]
    if baseline is not None and baseline_point is not None:
        raise ConfigError("give --baseline ARM (pair with another arm) or --baseline-point LABEL (pair each run with "
                          "its own evaluation at LABEL), not both")
    if baseline is not None and baseline not in names:
        raise ConfigError(f"--baseline {baseline!r} is not one of the arms ({', '.join(names)}); give an arm name "
                          "without its -sN suffix")
    base = groups[names.index(baseline)] if baseline is not None else groups[0]
    if baseline_at is not None and baseline_point is not None:
        raise ConfigError("--baseline-at names a point of the baseline arm; it goes with --baseline ARM, not "
                          "--baseline-point")
    if baseline_at is not None and baseline_at not in base.points:
        raise ConfigError(f"--baseline-at {baseline_at!r}: the baseline {base.name} has no evaluation with that label; "
                          f"give one of {', '.join(base.points) or 'none (it has no evaluation yet)'}")
    if noise_floor and baseline_point is not None:
        raise ConfigError("--noise-floor reads differences from another arm: give it with --baseline ARM (the method "
                          "the noise-floor arms repeat), not --baseline-point")
    unknown = [a for a in noise_floor or [] if a not in names]
    if unknown:
        raise ConfigError(f"--noise-floor {unknown[0]!r} is not one of the arms ({', '.join(names)}); give arm names "
                          "without their -sN suffix")
    labels: list[str] = []
    for g in groups:
        labels += [label for label in g.points if label not in labels]
    if not labels:
        raise ConfigError(f"no run has an evaluation on split {split!r}; pick another with --split")
    warnings = []
    envs = list(dict.fromkeys(e for g in groups for e in g.envs if e != "?"))
    if len(envs) > 1:
        warnings.append(f"this table mixes environments ({', '.join(envs)}): their numbers are not comparable, and "
                        "arms of another environment than the baseline's are not paired")
    table = markdown_table(groups, labels, metric)
    if baseline_point is not None and all(baseline_point not in g.points for g in groups):
        raise ConfigError(f"--baseline-point {baseline_point!r}: no arm has an evaluation with that label; give one of "
                          f"{', '.join(labels)}")
    rows = (within_run_rows(groups, baseline_point, split, metric, n_boot) if baseline_point is not None
            else paired_rows(groups, base, split, metric, n_boot, baseline_at))
    p_table = paired_table(rows) if rows else ""
    finals = {p.arm: p for p in rows}  # an arm's last row is its last evaluation vs the baseline's last
    finals |= {p.arm: p for p in rows if p.result is not None}  # or the last one that could be paired
    base_name = "" if baseline_point is not None else base.name
    sentences = [paired_sentence(finals[g.name], base_name) for g in groups if g.name in finals]
    noise_table, noise_sentences = (noise_floor_rows(finals, noise_floor, base.name) if noise_floor and rows
                                    else ("", []))
    plot_groups(groups, labels, out / "compare.png", metric)
    runs = ", ".join(f"`{d}`" for d in run_dirs)
    test = ("exact McNemar (sign) test on the discordant tasks" if metric == "success" else
            "exact sign test on the per-task score differences (ties dropped)")
    text = f"# Comparison on split `{split}`\n\nRuns: {runs}\n\n"
    text += "".join(f"> warning: {w}\n\n" for w in warnings)
    text += (f"{METRICS[metric].capitalize()}: mean ± sd over seeds, then each seed's value in the order of the "
             f"`seeds` column:\n\n{table}\n\n")
    if rows:
        against = (f"each run's own `{baseline_point}` evaluation (arm at a later point − the same run at "
                   f"`{baseline_point}`, points): each run paired with itself" if baseline_point is not None else
                   f"`{base.name}`{f' at `{baseline_at}`' if baseline_at else ''} (arm − baseline, points): seeds "
                   "paired by their -sN index")
        text += (f"Paired differences vs {against}, "
                 f"tasks by id; 95% interval (tasks) from a bootstrap over tasks ({n_boot} resamples, RNG seed "
                 f"{BOOT_SEED}, seed pairs kept: these trained policies on more tasks); 95% interval (seeds and "
                 f"tasks) resampling seed pairs as well (would another training seed agree; needs >= 2 pairs); "
                 f"better / worse counts (seed pair, task) cells; p from the two-sided {test}, "
                 f"pooled over seed pairs:\n\n{p_table}\n\n" + "\n".join(sentences) + "\n\n")
    if noise_sentences:
        text += (f"Against the noise floor ({', '.join(noise_floor or [])}: `{base.name}` again with nothing that "
                 "matters changed; their per-seed differences from it are what training alone moves): each arm's "
                 "per-seed differences and theirs, with the permutation p of the difference of means over every "
                 "relabelling of the pooled values (a seeded sample of 200,000 where there are more):\n\n"
                 + (f"{noise_table}\n\n" if noise_table else "") + "\n".join(noise_sentences) + "\n\n")
    diag = diagnostics_table(groups)
    if diag:
        text += ("Premise diagnostics of each run (its report's tables: the worst verdict, and the rows that do not "
                 f"pass; read a difference only where its premises hold):\n\n{diag}\n\n")
    text += "![comparison](compare.png)\n"
    path = out / "compare.md"
    write_text_atomic(path, text)
    against_name = base.name + (f" at {baseline_at}" if baseline_at else "")
    return Comparison(path, f"own {baseline_point}" if baseline_point is not None else against_name, table, p_table,
                      sentences, warnings, text, noise_table, noise_sentences)
