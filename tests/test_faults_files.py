"""Damaged or crafted run files: nothing executes on load, and each damage gives one line naming the file (or, for a
trainer's resume checkpoint, is set aside and the phase restarts from its start with the same result)."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.bc import nll_loss
from agentevo.config import OptimConfig
from agentevo.data.store import ExperienceStore
from agentevo.data.tensors import trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError
from agentevo.models.backend import DamagedCheckpointError, load_pretrained, write_manifest
from agentevo.train.loop import train
from agentevo.train.tracking import MetricsLogger


class _Evil:
    """Unpickling this creates the marker folder (what a crafted optimizer.pt would do with a shell command)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker,))


def _traj(k: int, slot_text: str = "take knife") -> Trajectory:
    task = Task("twx-cookingworld", f"t{k}", "train", "cookingworld", {}, 20)
    steps = [Step(t, f"obs {k} {t}", expert_reply(a), [], None, parse_action(expert_reply(a)), "next", 0.0, False)
             for t, a in enumerate([slot_text, "open fridge"], start=1)]
    return Trajectory(task, "expert", "expert", "Instruction.", steps, 1.0, True, goal=f"goal {k}")


def _samples(policy: Any, n: int = 6) -> list[Any]:
    out = []
    for k in range(n):
        traj = _traj(k)
        for s in traj.steps:
            s.action_ids = policy.renderer.encode_reply(s.action_text)
        out.extend(trajectory_samples(policy.renderer, traj, k, 10, 1024))
    return out


def _cfg() -> OptimConfig:
    return OptimConfig(lr=5e-3, epochs=4, batch_size=4, micro_batch_size=2, warmup_ratio=0.1, save_every=1)


def _garble(path: Path) -> None:
    """Overwrite bytes in the middle of a file, keeping its size (what a bad disk or copy leaves)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(255 - b for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- metrics.jsonl


def test_partial_last_metrics_line_is_skipped_and_the_next_record_starts_a_line(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log("bc/train", 1, {"loss": 2.5})
    logger.log("bc/train", 2, {"loss": 2.0})
    with open(logger.path, "a") as fh:
        fh.write('{"time": 1.0, "phase": "bc/tra')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["loss"] for r in logger.records()] == [2.5, 2.0]
    assert f"{logger.path} line 3 is not a complete record" in caplog.text
    logger.log("bc/train", 3, {"loss": 1.5})
    assert [r["step"] for r in logger.records("bc/train")] == [1, 2, 3]
    assert logger.path.read_text().splitlines()[3].startswith('{"time"')


def test_drop_after_rewrites_the_file_without_the_replayed_steps(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3, 4):
        logger.log("bc/train", step, {"loss": float(step)})
    logger.log("eval/init/test", 0, {"n": 4})
    logger.log("other/train", 7, {"loss": 0.5})
    with open(logger.path, "a") as fh:
        fh.write('{"time": 1.0, "ph')
    assert logger.drop_after("bc/train", 2) == 2
    assert [(r["phase"], r["step"]) for r in logger.records()] == [
        ("bc/train", 1), ("bc/train", 2), ("eval/init/test", 0), ("other/train", 7)]
    assert len(logger.path.read_text().splitlines()) == 4  # the partial line went too
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    assert logger.drop_after("bc/train", 2) == 0


# ------------------------------------------------------------------------------------------- experience.db


def _store_with_rows(path: Path) -> None:
    store = ExperienceStore(path)
    for k in range(40):
        store.add(_traj(k), "expert", k)
    store.close()


def test_store_loads_in_slot_order_whatever_the_finish_order(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path / "e.db")
    for slot in (2, 0, 1):
        store.add(_traj(slot), "b", slot)
    for slot in (1, 0):
        store.add(_traj(10 + slot), "a", slot)
    store.add(_traj(3), "b", 3)  # a resumed collection of b after a was started
    assert [(t.meta["collection"], t.meta["slot"]) for t in store.load()] == [
        ("b", 0), ("b", 1), ("b", 2), ("b", 3), ("a", 0), ("a", 1)]
    assert [t.meta["slot"] for t in store.load(prefix="b")] == [0, 1, 2, 3]
    store.close()


def test_truncated_store_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "experience.db"
    _store_with_rows(path)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    with pytest.raises(AgentevoError) as err:
        ExperienceStore(path)
    message = str(err.value)
    assert message.startswith(f"experience store {path} is damaged (") and "\n" not in message
    assert message.endswith("restore it from a copy (with its -wal file), or move the run folder aside and start the "
                            "run again")


def test_store_overwritten_with_other_bytes_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "experience.db"
    path.write_bytes(b"this is not sqlite at all\n" * 200)
    with pytest.raises(AgentevoError, match=r"^experience store .*experience\.db is damaged \(file is not a database\)"):
        ExperienceStore(path)


# ------------------------------------------------------------------------------------------- final checkpoints


def test_final_checkpoint_is_verified_on_load(tiny_policy: Any, tmp_path: Path) -> None:
    ckpt = tiny_policy.save(tmp_path / "bc")
    manifest = json.loads((ckpt / "manifest.json").read_text())["sha256"]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest)
    load_pretrained(ckpt)  # intact: loads

    _garble(ckpt / "model.safetensors")
    with pytest.raises(DamagedCheckpointError) as err:
        load_pretrained(ckpt)
    assert str(err.value).startswith(f"checkpoint file {ckpt / 'model.safetensors'} is damaged: its sha256 differs "
                                     f"from the one in {ckpt / 'manifest.json'}; re-create the checkpoint")
    assert "\n" not in str(err.value)

    (ckpt / "model.safetensors").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint file .*model\.safetensors is missing \(listed in"):
        load_pretrained(ckpt)


def test_checkpoint_without_manifest_still_loads(tiny_policy: Any, tmp_path: Path) -> None:
    ckpt = tiny_policy.save(tmp_path / "old")
    (ckpt / "manifest.json").unlink()  # written before manifests existed
    model, _ = load_pretrained(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), tiny_policy.model.parameters(), strict=True))


# ------------------------------------------------------------------------------------------- the trainer's last/


def _interrupt_at(step_to_stop: int):  # noqa: ANN202
    def crash(step: int, total: int, record: dict) -> None:
        if step == step_to_stop:
            raise KeyboardInterrupt
    return crash


def test_damaged_resume_checkpoint_is_set_aside_and_the_phase_restarts(tiny_policy: Any, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    samples = _samples(tiny_policy)
    base = copy.deepcopy(tiny_policy.model)
    straight = copy.deepcopy(base)
    train(straight, samples, nll_loss, _cfg(), tiny_policy.pad_id, tmp_path / "a", seed=0)

    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    work = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        train(copy.deepcopy(base), samples, nll_loss, _cfg(), tiny_policy.pad_id, work, seed=0, logger=logger,
              on_step=_interrupt_at(3))
    assert json.loads((work / "last" / "state.json").read_text())["step"] == 2
    _garble(work / "last" / "model" / "model.safetensors")
    resumed = copy.deepcopy(base)
    seen: list[int] = []
    with caplog.at_level(logging.WARNING):
        train(resumed, samples, nll_loss, _cfg(), tiny_policy.pad_id, work, seed=0, logger=logger,
              on_step=lambda s, n, r: seen.append(s))
    assert seen[0] == 1  # restarted from the phase start, not from the damaged step-2 state
    aside = [p.name for p in work.iterdir() if p.name.startswith("last.damaged-")]
    assert len(aside) == 1 and not (work / "last").exists()
    assert f"checkpoint file {work / 'last' / 'model' / 'model.safetensors'} is damaged" in caplog.text
    assert "set it aside as" in caplog.text
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = [r["step"] for r in logger.records("train")]
    assert steps == list(range(1, len(seen) + 1))  # each step once although 1-3 ran twice


def test_crafted_optimizer_state_is_refused_without_running(tiny_policy: Any, tmp_path: Path) -> None:
    samples = _samples(tiny_policy)
    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        train(copy.deepcopy(tiny_policy.model), samples, nll_loss, _cfg(), tiny_policy.pad_id, work, seed=0,
              on_step=_interrupt_at(2))
    last = work / "last"
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Evil(str(marker)), "rng": torch.get_rng_state()}, last / "optimizer.pt")
    (last / "manifest.json").unlink()  # as in a checkpoint from before manifests: no hash to catch it
    with pytest.raises(AgentevoError) as err:
        train(copy.deepcopy(tiny_policy.model), samples, nll_loss, _cfg(), tiny_policy.pad_id, work, seed=0)
    assert str(err.value) == (
        f"refusing to load {last / 'optimizer.pt'}: it holds objects other than tensors and plain values, so it is "
        f"damaged or was crafted (loading it could run code); delete {last} to restart this phase from its start")
    assert not marker.exists()


def test_grpo_checkpoint_refuses_crafted_or_damaged_files(tiny_policy: Any, tmp_path: Path) -> None:
    from agentevo.algorithms.grpo.config import GRPOConfig
    from agentevo.algorithms.grpo.recipe import PolicyTrainer
    from agentevo.config import RunConfig

    trainer = PolicyTrainer(copy.deepcopy(tiny_policy), RunConfig(), GRPOConfig())
    latest = tmp_path / "latest"
    trainer.save(latest, {"update": 2})
    assert (latest / "manifest.json").exists()
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Evil(str(marker))}, latest / "optimizer.pt")
    other = PolicyTrainer(copy.deepcopy(tiny_policy), RunConfig(), GRPOConfig())
    with pytest.raises(AgentevoError, match=r"^checkpoint file .*optimizer\.pt is damaged: its sha256 differs"):
        other.restore(latest)
    write_manifest(latest)  # a crafted folder with a matching manifest
    with pytest.raises(AgentevoError, match=r"^refusing to load .*optimizer\.pt: it holds objects other than"):
        other.restore(latest)
    assert not marker.exists()


def test_make_install_refuses_a_full_disk_in_one_line(tmp_path: Path) -> None:
    """Too little free disk for the venv stops `make` before pip with one line naming the need and the fix."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    # PYTHON=false: were the check to pass, creating the venv fails instead of installing anything
    done = subprocess.run(["make", ".venv/bin/python", "MIN_FREE_GB=1000000", "PYTHON=false"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "GB free" in errors[0] and "needs about 1000000 GB" in errors[0], done.stderr
    assert not (tmp_path / ".venv").exists()
    passed = subprocess.run(["make", ".venv/bin/python", "MIN_FREE_GB=0", "PYTHON=false"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "error:" not in passed.stderr and "false -m venv" in passed.stdout
