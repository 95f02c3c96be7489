"""Exact resume: a BC run on the tiny default, killed during collection, training or evaluation and resumed, ends
with bit-identical weights, the same state.json and each metrics record once; a planted pickle is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from agentevo.config import load_config
from agentevo.data.store import ExperienceStore
from agentevo.errors import AgentevoError
from agentevo.recipes import get_recipe
from agentevo.run import Run

# 6 expert demos of 8-10 steps on 2 workers: resumed after 3 are stored, demo 4 (9 steps) finishes before demo 3
# (10 steps), so the rows' insertion order differs from an uninterrupted run's; 9 training steps, saved every step.
OVERRIDES = ["env.n_train=6", "env.n_test=4", "optim.epochs=3", "optim.batch_size=2", "optim.micro_batch_size=2",
             "optim.save_every=1", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "rollout.n_parallel=2", "agent.max_new_tokens=6"]


def _bc_run(run_dir: Path, resume: bool = False) -> None:
    if resume:
        run = Run.open(run_dir, quiet=True)
    else:
        cfg = load_config("configs/demo_twx_bc.yaml", OVERRIDES, name=run_dir.name, output_dir=str(run_dir.parent))
        run = Run(cfg, run_dir, quiet=True)
    try:
        get_recipe("bc")(run)
    finally:
        run.close()


def _interrupted(run_dir: Path, monkeypatch: pytest.MonkeyPatch, collection: str | None = None, after: int = 0,
                 train_step: int | None = None) -> None:
    """Run until the after-th trajectory of `collection` is stored, or until training reaches `train_step` (logged,
    not checkpointed), then stop as a kill would (KeyboardInterrupt) and undo the patches."""
    stored: dict[str, int] = {}
    original_add = ExperienceStore.add

    def add(self: ExperienceStore, traj: Any, coll: str, slot: int) -> int:
        out = original_add(self, traj, coll, slot)
        stored[coll] = stored.get(coll, 0) + 1
        if coll == collection and stored[coll] == after:
            raise KeyboardInterrupt
        return out

    import agentevo.train.loop as loop

    original_save = loop._save_state

    def save(ckpt: Path, model: Any, tokenizer: Any, optimizer: Any, step: int, extra: dict[str, Any]) -> None:
        if step == train_step:
            raise KeyboardInterrupt  # step logged, its checkpoint never written: resume replays it
        original_save(ckpt, model, tokenizer, optimizer, step, extra)

    with monkeypatch.context() as m:
        m.setattr(ExperienceStore, "add", add)
        m.setattr(loop, "_save_state", save)
        with pytest.raises(KeyboardInterrupt):
            _bc_run(run_dir)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]


def _assert_same(run_dir: Path, reference: Path) -> None:
    """Bit-identical final weights, the same phase results and the same metrics records, each once."""
    for name in ("init", "bc"):
        a = load_file(str(run_dir / "checkpoints" / name / "model.safetensors"))
        b = load_file(str(reference / "checkpoints" / name / "model.safetensors"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    state, reference_state = (json.loads((d / "state.json").read_text()) for d in (run_dir, reference))
    starts, (first,) = state.pop("machine"), reference_state.pop("machine")  # each start's machine record
    assert state == reference_state
    assert len(starts) >= 2 and {s["threads"] for s in starts} == {first["threads"]}
    records = _records(run_dir)
    assert len({(r["phase"], r["step"]) for r in records}) == len(records)  # no replayed step twice
    assert records == _records(reference)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "r"
    _bc_run(run_dir)
    return run_dir


def test_kill_during_collection(straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "r"
    _interrupted(run_dir, monkeypatch, collection="expert", after=3)
    _bc_run(run_dir, resume=True)
    store = ExperienceStore(run_dir / "experience.db")
    try:
        finish_order = [int(r[0]) for r in store._db.execute(
            "SELECT slot FROM trajectories WHERE collection = 'expert' ORDER BY id").fetchall()]
    finally:
        store.close()
    assert finish_order != sorted(finish_order)  # stored out of slot order, and still the same training
    _assert_same(run_dir, straight)


def test_kill_during_training(straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "r"
    _interrupted(run_dir, monkeypatch, train_step=4)
    assert max(r["step"] for r in _records(run_dir) if r["phase"] == "bc/train") == 4
    assert json.loads((run_dir / "checkpoints" / "bc-work" / "last" / "state.json").read_text())["step"] == 3
    spare = tmp_path / "spare"
    shutil.copytree(run_dir, spare)
    _bc_run(run_dir, resume=True)
    _assert_same(run_dir, straight)

    # the same interrupted run with a crafted optimizer.pt (its manifest updated too): refused, nothing runs
    marker = tmp_path / "pwned"
    last = spare / "checkpoints" / "bc-work" / "last"
    torch.save({"optimizer": _Evil(str(marker))}, last / "optimizer.pt")
    from agentevo.models.backend import write_manifest

    write_manifest(last)
    with pytest.raises(AgentevoError) as err:
        _bc_run(spare, resume=True)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"refusing to load {last / 'optimizer.pt'}: it holds objects other than")
    assert not marker.exists()


def test_kill_during_evaluation(straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "r"
    _interrupted(run_dir, monkeypatch, collection="eval/bc/test", after=2)
    _bc_run(run_dir, resume=True)
    _assert_same(run_dir, straight)


def test_kill_after_an_evaluation_is_logged_but_not_recorded(straight: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval record reached metrics.jsonl, state.json never heard of it: resume logs it once, not twice."""
    from agentevo.train.tracking import MetricsLogger

    run_dir = tmp_path / "r"
    original_log = MetricsLogger.log

    def log(self: MetricsLogger, phase: str, step: int, metrics: dict[str, Any]) -> None:
        original_log(self, phase, step, metrics)
        if phase.startswith("eval/bc/"):
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(MetricsLogger, "log", log)
        with pytest.raises(KeyboardInterrupt):
            _bc_run(run_dir)
    _bc_run(run_dir, resume=True)
    _assert_same(run_dir, straight)


class _Evil:
    """Unpickling this creates the marker file (what a crafted checkpoint would do with a shell command)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker,))
