"""Compare runs: held-out success per evaluation point, mean ± sd over seeds, as a markdown table and plots.

Runs are grouped by name with a trailing seed suffix removed (`qe-cw-s0`, `qe-cw-s1` -> `qe-cw`). Evaluation
points are the `eval/<label>` phases of state.json (`bc`, `round-1`, `update-4`, ...), in the order they ran.
Environment steps at each point are those the run collected after its BC warm start (Q-Evolve's self-collected
steps, `round-r/label`; GRPO's `train_env_steps`; RSD's `round-r/act`; BoN's samples; Harness@Inf's bank); `bc` is 0.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentevo.errors import ConfigError

SEED_SUFFIX = re.compile(r"-s\d+$")
METRICS = {"success": "held-out success (%)", "reward": "held-out average final reward (x100)"}


@dataclass
class Point:
    """One evaluation of one run."""

    label: str
    success: float
    reward: float
    env_steps: float | None

    def value(self, metric: str) -> float:
        """The compared number in percent: success rate, or average final reward (ScienceWorld's score) x 100."""
        return 100 * (self.success if metric == "success" else self.reward)


@dataclass
class Group:
    """Runs that differ only by seed."""

    name: str
    runs: list[str] = field(default_factory=list)
    points: dict[str, list[Point]] = field(default_factory=dict)  # label -> one point per run


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
            points.append(Point(label, float(m["success_rate"]), float(m["avg_reward"]), _env_steps(state, label, m)))
    return points


def group_runs(run_dirs: list[Path], split: str) -> list[Group]:
    groups: dict[str, Group] = {}
    for run_dir in run_dirs:
        name = SEED_SUFFIX.sub("", run_dir.name)
        group = groups.setdefault(name, Group(name))
        group.runs.append(run_dir.name)
        for point in load_points(run_dir, split):
            group.points.setdefault(point.label, []).append(point)
    return list(groups.values())


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def markdown_table(groups: list[Group], labels: list[str], metric: str = "success") -> str:
    """The metric (%) as mean ± sd (n runs) per group and evaluation point; '-' where a group has no such point."""
    head = "| runs | seeds | " + " | ".join(labels) + " |"
    lines = [head, "|---|---|" + "---|" * len(labels)]
    for g in groups:
        cells = []
        for label in labels:
            pts = g.points.get(label, [])
            if not pts:
                cells.append("-")
                continue
            mean, sd = _mean_sd([p.value(metric) for p in pts])
            cells.append(f"{mean:.1f} ± {sd:.1f} (n={len(pts)})")
        lines.append(f"| {g.name} | {len(g.runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(run_dirs: list[Path], split: str, out: Path, metric: str = "success") -> tuple[Path, str]:
    """Write out/compare.md and out/compare.png; returns the markdown path and the table."""
    if metric not in METRICS:
        raise ConfigError(f"--metric must be one of {', '.join(METRICS)} (got {metric!r})")
    if not run_dirs:
        raise ConfigError("give at least one run folder: agentevo compare runs/A-s0 runs/A-s1 runs/B-s0 ...")
    groups = group_runs(run_dirs, split)
    labels: list[str] = []
    for g in groups:
        labels += [label for label in g.points if label not in labels]
    if not labels:
        raise ConfigError(f"no run has an evaluation on split {split!r}; pick another with --split")
    table = markdown_table(groups, labels, metric)
    plot_groups(groups, labels, out / "compare.png", metric)
    runs = ", ".join(f"`{d}`" for d in run_dirs)
    text = (f"# Comparison on split `{split}`\n\nRuns: {runs}\n\n{METRICS[metric].capitalize()}, mean ± sd over seeds:\n\n"
            f"{table}\n\n![comparison](compare.png)\n")
    path = out / "compare.md"
    path.write_text(text)
    return path, table
