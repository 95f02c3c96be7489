"""The CLI end to end on a very small BC run: killed mid-collection, resumed, report written."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

SMALL = [
    "--config", "configs/demo_twx_bc.yaml",
    "--set", "env.n_train=4", "--set", "env.n_test=6", "--set", "env.params.max_steps=3",
    "--set", "optim.epochs=1", "--set", "optim.batch_size=2", "--set", "optim.micro_batch_size=2",
    "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1", "--set", "model.tiny.num_heads=2",
    "--set", "model.tiny.intermediate_size=64", "--set", "rollout.n_parallel=2", "--set", "agent.max_new_tokens=6",
    "--quiet",
]


def _count(db: Path, collection: str) -> int:
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT COUNT(*) FROM trajectories WHERE collection = ?", (collection,)).fetchone()[0]
    except sqlite3.Error:
        return 0


def _rewards(db: Path, collection: str) -> list[tuple[int, str, float]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT slot, task_id, final_reward FROM trajectories WHERE collection = ? ORDER BY slot",
                            (collection,)).fetchall()


def _rows(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT id, collection, slot, task_id, n_steps FROM trajectories ORDER BY id").fetchall()


def test_killed_run_resumes_and_reports(tmp_path) -> None:  # noqa: ANN001
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "agentevo.cli", "train", *SMALL, "--name", "r", "--output-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    db = tmp_path / "r" / "experience.db"
    deadline = time.time() + 240
    while _count(db, "eval/init/test") < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    os.killpg(proc.pid, signal.SIGKILL)  # the JVMs go too, as in a real crash
    proc.wait()
    before = _rows(db)
    # killed somewhere after the untrained eval started storing and before the run finished
    assert any(r[1] == "expert" for r in before) and sum(r[1] == "eval/init/test" for r in before) >= 2
    assert sum(r[1] == "eval/bc/test" for r in before) < 6

    out = subprocess.run([sys.executable, "-m", "agentevo.cli", "resume", str(tmp_path / "r"), "--quiet"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    after = _rows(db)
    assert after[: len(before)] == before  # nothing stored before the crash was lost or replayed
    assert _count(db, "eval/init/test") == 6 and _count(db, "eval/bc/test") == 6 and _count(db, "expert") == 4
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| init | test | 6 |" in report and "| bc | test | 6 |" in report
    assert (tmp_path / "r" / "plots" / "success.png").exists()
    assert (tmp_path / "r" / "checkpoints" / "bc" / "model.safetensors").exists()
    assert "success" in out.stdout and "bc" in out.stdout  # the closing summary table
    _check_warm_start_from(tmp_path, env)
    # resuming a finished run continues nothing: it needs no checkpoint and rewrites the report
    (tmp_path / "r" / "checkpoints").rename(tmp_path / "r" / "checkpoints-aside")
    again = subprocess.run([sys.executable, "-m", "agentevo.cli", "resume", str(tmp_path / "r"), "--quiet"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "nothing to resume (report rewritten)" in again.stdout and "| bc | test | 6 |" in report
    assert _rows(db) == after  # and stores nothing


def _check_warm_start_from(tmp_path: Path, env: dict[str, str]) -> None:
    """A second run starts from the finished BC run: demos of its (fewer) training tasks, checkpoints, evals."""
    import json

    base = [sys.executable, "-m", "agentevo.cli", "train", *SMALL, "--output-dir", str(tmp_path),
            "--set", f"bc.warm_start_from={tmp_path / 'r'}", "--set", "env.n_train=2"]
    out = subprocess.run([*base, "--name", "w"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    state = json.loads((tmp_path / "w" / "state.json").read_text())
    source = json.loads((tmp_path / "r" / "state.json").read_text())
    assert state["eval/bc"] == source["eval/bc"] and state["bc"] == source["bc"]
    assert "finished" in source and "finished" in state  # what `agentevo study` reads to skip a run
    assert state["expert"]["n"] == 2 and _count(tmp_path / "w" / "experience.db", "expert") == 2
    # the imported evaluations' trajectories are copied slot for slot (the run folder is self-contained) and the
    # phases were not re-run: same collections, same rewards per slot
    for collection in ("eval/init/test", "eval/bc/test"):
        assert _rewards(tmp_path / "w" / "experience.db", collection) == _rewards(tmp_path / "r" / "experience.db",
                                                                                   collection)
        phase = collection.rsplit("/", 1)[0]  # eval/bc/test -> eval/bc
        assert len(_rewards(tmp_path / "w" / "experience.db", collection)) == source[phase]["test"]["n"]
    assert (tmp_path / "w" / "checkpoints" / "bc" / "model.safetensors").exists()
    bad = subprocess.run([*base, "--name", "x", "--set", "agent.max_new_tokens=7"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0
    assert "agent.max_new_tokens is 7 here but 6" in bad.stderr and "Traceback" not in bad.stderr
    # more held-out tasks (a powered study): the same checkpoints are evaluated again here, on the longer list
    more = subprocess.run([*base, "--name", "m", "--set", "env.n_test=8"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr
    state = json.loads((tmp_path / "m" / "state.json").read_text())
    assert state["warm_start_from"]["reevaluated"] == "env.n_test 6 -> 8"
    assert state["eval/bc"]["test"]["n"] == 8 and state["bc"] == source["bc"]
    assert len(_rewards(tmp_path / "m" / "experience.db", "eval/bc/test")) == 8
    # another of the source's checkpoints as the start (here its init): copied as bc and evaluated again here, so
    # its greedy evaluation repeats the source's evaluation of that checkpoint episode for episode
    other = subprocess.run([*base, "--name", "c", "--set", "bc.warm_start_checkpoint=init"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr
    state = json.loads((tmp_path / "c" / "state.json").read_text())
    assert state["warm_start_from"]["checkpoint"] == "init" and "reevaluated" not in state["warm_start_from"]
    assert state["bc"] == {"checkpoint": "init", "from": str(tmp_path / "r"), **source["init"]}  # its phase result
    ckpt = "checkpoints/{}/model.safetensors"
    assert (tmp_path / "c" / ckpt.format("bc")).read_bytes() == (tmp_path / "r" / ckpt.format("init")).read_bytes()
    assert state["eval/bc"]["test"] == source["eval/init"]["test"] and state["eval/init"] == source["eval/init"]
    assert _rewards(tmp_path / "c" / "experience.db", "eval/bc/test") == _rewards(tmp_path / "r" / "experience.db",
                                                                                  "eval/init/test")
    missing = subprocess.run([*base, "--name", "d", "--set", "bc.warm_start_checkpoint=bon-sft"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert f"bc.warm_start_checkpoint: '{tmp_path / 'r'}' has no checkpoint 'bon-sft'; it has bc, init" in missing.stderr


def test_checkpoint_loads_with_plain_transformers(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentevo.config import TinyModelConfig
    from agentevo.models.backend import TransformersPolicy
    from agentevo.models.tiny import build_tiny_model, train_tokenizer

    tok = train_tokenizer(["take knife. open fridge. You are in the kitchen."] * 5, 300)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    TransformersPolicy(model, tok).save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt.tmp").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    ids = tok2("take knife", return_tensors="pt")["input_ids"]
    import torch

    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)
    assert tok2.chat_template == tok.chat_template
