"""runs/NAME/report.md with plots: evaluation table, success per policy, training curves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentevo import machine
from agentevo.eval.diagnostics import render_section
from agentevo.eval.metrics import eval_collection, tasks_played
from agentevo.files import write_text_atomic

if TYPE_CHECKING:
    from agentevo.run import Run


def _eval_rows(state: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    rows = []
    for key, per_split in state.items():
        if key.startswith("eval/") and isinstance(per_split, dict):
            for split, m in per_split.items():
                if isinstance(m, dict) and "success_rate" in m:
                    rows.append((key[len("eval/") :], split, m))
    return rows


def _plot_success(rows: list[tuple[str, str, dict[str, Any]]], path: Path, protocol: str = "greedy") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{policy}\n{split}" for policy, split, _ in rows]
    values = [100 * m["success_rate"] for _, _, m in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 3.2))
    ax.bar(labels, values, color="#4c72b0")
    for x, v in enumerate(values):
        ax.text(x, v + 1, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_ylabel("success rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"held-out success ({protocol})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_training(records: list[dict[str, Any]], path: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = sorted({r["phase"] for r in records if r["phase"].endswith("/train") and "loss" in r})
    if not phases:
        return []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for phase in phases:
        pts = [(r["step"], r["loss"]) for r in records if r["phase"] == phase and "loss" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=phase)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return phases


def _task_type_lines(store: Any, rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Per task type success / mean final reward of each evaluation, when the tasks span several types."""
    cells: dict[str, dict[str, tuple[int, float, float]]] = {}
    for policy, split, _ in rows:
        collection = eval_collection(policy, split)
        for task_type, n, reward, success in store.by_task_type(collection):
            cells.setdefault(task_type, {})[f"{policy} ({split})"] = (n, reward, success)
    if len(cells) < 2:
        return []
    columns = [f"{policy} ({split})" for policy, split, _ in rows]
    lines = ["", "## By task type (success % / mean final reward)", "",
             "| task type | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for task_type, per in cells.items():
        shown = [f"{100 * per[c][2]:.0f}% / {per[c][1]:.3f} (n={per[c][0]})" if c in per else "-" for c in columns]
        lines.append(f"| {task_type} | " + " | ".join(shown) + " |")
    return lines


def format_value(value: Any, max_items: int = 12, nested: bool = False) -> str:
    """A phase result for reading: floats to 4 significant digits, dicts as `key: value` lists (inner ones in
    parentheses), lists past max_items cut."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        text = ", ".join(f"{k}: {format_value(v, max_items, True)}" for k, v in value.items()) or "-"
        return f"({text})" if nested and value else text
    if isinstance(value, (list, tuple)):
        shown = [format_value(v, max_items, True) for v in value[:max_items]]
        more = f", ... ({len(value)} in all)" if len(value) > max_items else ""
        return "[" + ", ".join(shown) + more + "]"
    return str(value)


def _machine_lines(run: Run, records: list[dict[str, Any]]) -> list[str]:
    """The machine of the run's first start, any later start on other hardware, and the time it computed."""
    from agentevo.study import duration

    starts = run.state.get(machine.STATE_KEY) or []
    if not starts:
        return []
    lines = [f"- machine: {machine.summary(starts[0])}"]
    if starts[0].get("precision"):
        lines.append(f"- precision: {starts[0]['precision']}")
    for k, rec in enumerate(starts[1:], 1):
        diff = machine.resume_difference(starts[0], rec)
        if diff:
            lines.append(f"- resume {k} ran with {diff}: from there on it may differ from an uninterrupted run")
    seconds = machine.compute_seconds(starts, [r["time"] for r in records if "time" in r])
    n = len(starts)
    busy = [rec for rec in starts if rec.get("idle_cores") is not None and rec["idle_cores"] < rec["threads"] - 0.5]
    note = (f"; {len(busy)} of its starts found fewer idle cores than threads (another job was busy), so it is not "
            "a timing" if busy else "")
    lines.append(f"- time: {duration(seconds)} over {n} start{'s' * (n != 1)} (from each start to its last logged "
                 f"record){note}")
    return lines


def write_report(run: Run) -> Path:
    """Write report.md (and plots/*.png) from state.json and metrics.jsonl; returns its path."""
    plots = run.dir / "plots"
    plots.mkdir(exist_ok=True)
    cfg = run.cfg
    rows = _eval_rows(run.state)
    records = run.logger.records()  # metrics.jsonl, read once
    lines = [
        f"# {cfg.method} on {cfg.env.name}",
        "",
        f"- run folder: `{run.dir}`",
        f"- model: {cfg.model.path or 'embedded tiny Llama (tokenizer trained on environment text)'}",
        f"- seed: {cfg.seed}; torch threads: {run.threads}",
        *_machine_lines(run, records),
        f"- reproduce: `agentevo train {cfg.method} --config {run.dir / 'config.yaml'}`",
        "",
        f"## Held-out evaluation ({cfg.eval.protocol})",
        "",
        "| policy | split | tasks | success | avg reward | mean steps | format err | invalid | repeat | task hash |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, split, m in rows:
        lines.append(
            f"| {policy} | {split} | {tasks_played(m)} | {100 * m['success_rate']:.1f}% | {m['avg_reward']:.3f} | "
            f"{m['mean_steps']:.1f} | {100 * m['format_error_rate']:.1f}% | {100 * m['invalid_rate']:.1f}% | "
            f"{100 * m['repeat_rate']:.1f}% | `{m.get('task_hash', '')}` |"
        )
    if rows:
        _plot_success(rows, plots / "success.png", cfg.eval.protocol)
        lines += ["", "![success](plots/success.png)"]
    lines += _task_type_lines(run.store, rows)
    phases = _plot_training(records, plots / "training.png")
    if phases:
        lines += ["", "## Training", "", "![training loss](plots/training.png)"]
    method_plots = sorted(p.name for p in plots.glob("*.png") if p.name not in ("success.png", "training.png"))
    if method_plots:
        lines += ["", "## Method plots", ""] + [f"![{name[:-4]}](plots/{name})" for name in method_plots]
    lines += render_section(records)  # premise diagnostics (phases diag/<method>), when logged
    extra = {k: v for k, v in run.state.items() if not k.startswith("eval/") and k != machine.STATE_KEY}
    if extra:
        lines += ["", "## Phases", ""]
        for key, value in extra.items():
            lines.append(f"- **{key}**: {format_value(value)}")
    path = run.dir / "report.md"
    return write_text_atomic(path, "\n".join(lines) + "\n")
