"""Sampled evaluation (eval.temperature / eval.samples): k seeded episodes per task, averaged in rates, reports and
`compare`; greedy stays the default."""

from pathlib import Path
from typing import Any

import pytest

from agentevo.config import load_config
from agentevo.errors import ConfigError


def _cfg(tmp_path: Path, name: str, *extra: str) -> Any:
    return load_config(None, ["env.name=probe-constant", "eval.n_tasks=3", "agent.max_new_tokens=6",
                              "model.torch_threads=1", *extra], method="bc", name=name, output_dir=str(tmp_path))


def test_samples_need_a_temperature_and_the_protocol_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="eval.samples is 3 but eval.temperature is 0: greedy episodes of one task "
                                          "are identical"):
        _cfg(tmp_path, "a", "eval.samples=3")
    assert _cfg(tmp_path, "b").eval.protocol == "greedy"
    assert _cfg(tmp_path, "c", "eval.temperature=0.7").eval.protocol == "T=0.7"
    assert _cfg(tmp_path, "d", "eval.temperature=1.0", "eval.samples=4").eval.protocol == "T=1, 4 samples per task"


def test_sampled_evaluation_plays_each_task_k_times_reproducibly(tmp_path: Path, tiny_policy: Any,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from agentevo.eval.compare import task_outcomes
    from agentevo.eval.report import write_report
    from agentevo.run import Run

    def evaluate(name: str, *extra: str) -> tuple[dict[str, Any], list[Any]]:
        run = Run.create(_cfg(tmp_path, name, *extra), quiet=True)
        try:
            metrics = run.evaluate(tiny_policy, "init")["test"]
            run.state["eval/init"] = {"test": metrics}
            write_report(run)
            return metrics, sorted(run.store.load(collection="eval/init/test"), key=lambda t: t.meta["slot"])
        finally:
            run.close()

    sampled = ("eval.temperature=1.0", "eval.samples=2")
    metrics, trajs = evaluate("s", *sampled)
    ids = [t.task.task_id for t in trajs]
    assert [t.meta["slot"] for t in trajs] == list(range(6)) and ids[:3] == ids[3:] and len(set(ids)) == 3
    assert metrics["n"] == 6 and metrics["samples_per_task"] == 2 and metrics["temperature"] == 1.0
    replies = [[s.action_text for s in t.steps] for t in trajs]
    assert replies[:3] != replies[3:]  # the second pass samples other replies
    assert [[s.action_text for s in t.steps] for t in evaluate("s2", *sampled)[1]] == replies  # seeded: the same
    report = (tmp_path / "s" / "report.md").read_text()
    assert "## Held-out evaluation (T=1, 2 samples per task)" in report and "| init | test | 3 |" in report
    per_task = task_outcomes(tmp_path / "s", "init", "test", "reward")
    assert per_task == {t: pytest.approx(50.0 * sum(x.final_reward for x in trajs if x.task.task_id == t))
                        for t in ids[:3]}  # each task's two episodes averaged
    from agentevo.cli import _summary_table

    run = Run.open(tmp_path / "s", quiet=True)
    try:
        _summary_table(run, {"eval/init": {"test": metrics}})
    finally:
        run.close()
    assert "│ init   │ test  │ 3     │" in capsys.readouterr().out  # tasks, not episodes
    greedy, one_each = evaluate("g")
    assert greedy["n"] == 3 and "samples_per_task" not in greedy and len(one_each) == 3
    assert "## Held-out evaluation (greedy)" in (tmp_path / "g" / "report.md").read_text()
