"""Plug-in environments: register(), `agentevo.envs` entry points, the gymnasium-style adapters, docs/envs/custom.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

import agentevo.envs as envs
from agentevo.config import EnvConfig
from agentevo.envs.base import Task
from agentevo.envs.gym import SPLIT_SEED_BASE, GymTextEnv, TextGymEnv
from agentevo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tests" / "plugin_pkg"


@pytest.fixture()
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(envs, "ENVIRONMENTS", envs._EnvMap(dict(envs.ENVIRONMENTS)))
    monkeypatch.setattr(envs, "_FACTORIES", {})
    monkeypatch.setattr(envs, "_tried_plugins", set())


def _counter_cls() -> Any:
    sys.path.insert(0, str(PKG))
    try:
        import counter_env
    finally:
        sys.path.remove(str(PKG))
    return counter_env.CounterEnv


def test_register_builds_by_name_and_guards_names(clean_registry: None) -> None:
    counter = _counter_cls()
    envs.register("my-counter", counter, "Count things")
    assert envs.ENVIRONMENTS["my-counter"] == ("counter_env", "CounterEnv", "Count things")
    env = envs.make_env("my-counter", n_test=3, max_steps=4)
    assert len(env.tasks("test")) == 3 and env.tasks("test")[0].max_steps == 4
    EnvConfig(name="my-counter").validate()
    with pytest.raises(ConfigError, match=r"^environment 'my-counter' is already registered \(Count things\); pick "
                                          r"another name, or pass overwrite=True to replace it$"):
        envs.register("my-counter", counter)
    with pytest.raises(ConfigError, match="environment 'my-counter' has no parameter 'colour'"):
        envs.make_env("my-counter", colour="red")
    # a function factory taking **kwargs accepts any parameter; the description is its docstring's first line
    def factory(**kw: Any) -> Any:
        """Counter from a function."""
        return counter(max_steps=kw.get("max_steps", 6))

    envs.register("my-counter", factory, overwrite=True)
    assert envs.ENVIRONMENTS["my-counter"][2] == "Counter from a function."
    assert envs.make_env("my-counter", max_steps=2, anything=1).max_steps == 2
    envs.register("not-an-env", lambda: object())
    with pytest.raises(ConfigError, match=r"environment 'not-an-env' built a object without name, final_reward_mode"):
        envs.make_env("not-an-env")
    with pytest.raises(ConfigError, match="environment name must be a non-empty string without spaces"):
        envs.register("two words", counter)


def test_entry_points_load_lazily_on_first_unknown_lookup(clean_registry: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    eps = [EntryPoint("fake-counter", "counter_env:CounterEnv", "agentevo.envs"),
           EntryPoint("broken", "no_such_module_xyz:Env", "agentevo.envs")]

    def fake() -> list[EntryPoint]:
        calls.append("scan")
        return eps

    monkeypatch.setattr(envs, "_entry_points", fake)
    monkeypatch.syspath_prepend(str(PKG))
    monkeypatch.delitem(sys.modules, "counter_env", raising=False)
    envs.make_env("probe-constant")  # a built-in name never scans the entry points
    assert calls == [] and "counter_env" not in sys.modules
    assert "fake-counter" in envs.ENVIRONMENTS  # config validation's check loads just that plug-in
    assert calls == ["scan"] and "counter_env" in sys.modules and "broken" not in envs._tried_plugins
    assert envs.make_env("fake-counter", n_train=2).tasks("train")[1].task_id == "counter/train/1"
    assert envs.ENVIRONMENTS["fake-counter"][2].startswith("Counter: make the counter show the target")
    with pytest.raises(ConfigError, match=r"^environment plug-in 'broken' \(no_such_module_xyz:Env\) failed to load: "
                                          r"ModuleNotFoundError"):
        EnvConfig(name="broken").validate()
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        envs.make_env("nope")


class _Guess:
    """A gymnasium-style text env: guess the number 0..3 derived from the seed; wrong guesses cost a step."""

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.target, self.left = (seed or 0) % 4, int((options or {}).get("tries", 2))
        return "Guess a number from 0 to 3.", {"goal": "guess the number"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        if action == f"guess {self.target}":
            return "Right!", 1.0, True, False, {}
        return "Wrong.", 0.0, False, self.left <= 0, {}


def test_gym_adapter_both_ways() -> None:
    env = GymTextEnv(_Guess, "guess", "Guess.", max_steps=5, n_train=3, n_test=2, options={"tries": 2},
                     expert_fn=lambda task: [f"guess {task.params['seed'] % 4}"])
    train = env.tasks("train")
    assert [t.params["seed"] for t in train] == [0, 1, 2]
    assert env.tasks("test")[1].params == {"seed": SPLIT_SEED_BASE["test"] + 1, "options": {"tries": 2}}
    obs, info = env.reset(train[2])
    assert (obs, info["goal"], info["task_type"]) == ("Guess a number from 0 to 3.", "guess the number", "guess")
    assert env.step("guess 0") == ("Wrong.", 0.0, False, {"score": 0.0, "success": False, "terminated": False,
                                                           "truncated": False})
    assert env.step("guess 1") == ("Wrong.", 0.0, True, {"score": 0.0, "success": False, "terminated": False,
                                                          "truncated": True})
    env.reset(train[2])
    _, reward, done, info = env.step("guess 2")
    assert (reward, done, info["success"], info["score"]) == (1.0, True, True, 1.0)
    assert env.expert(train[1]) == ["guess 1"]
    assert env.signals("a", "x", "a", True) == "repeat"
    # and back: a TextEnv behind reset(seed, options) / step() -> 5-tuple; max_steps without an end is truncation
    gym = TextGymEnv(GymTextEnv(_Guess, "guess", "Guess.", max_steps=3, n_train=3, options={"tries": 9}))
    obs, info = gym.reset(seed=4)  # 4 mod 3 tasks -> task 1 (seed 1, target 1)
    assert info["task_id"] == "guess/train/1"
    assert gym.step("guess 0")[2:4] == (False, False) and gym.step("guess 3")[2:4] == (False, False)
    assert gym.step("guess 2")[2:4] == (False, True)
    gym.reset(options={"task": Task("guess", "t", "train", "guess", {"seed": 3}, 3)})
    assert gym.step("guess 3")[1:4] == (1.0, True, False)
    gym.close()


def test_the_documented_plugin_installs_lists_and_trains_bc(tmp_path: Path) -> None:
    """docs/envs/custom.md shows tests/plugin_pkg verbatim; installed with pip, the CLI finds it and BC runs."""
    doc = (ROOT / "docs" / "envs" / "custom.md").read_text()
    assert (PKG / "counter_env.py").read_text().strip() in doc
    assert f"```toml\n{(PKG / 'pyproject.toml').read_text()}```" in doc
    command = re.search(r"^agentevo train bc --set env\.name=counter.*$", doc, re.M)
    assert command is not None
    shutil.copytree(PKG, tmp_path / "pkg")  # the build writes into the source folder: keep the repository clean
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(tmp_path / "pkg")], capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)}
    cli = [sys.executable, "-m", "agentevo.cli"]
    listed = subprocess.run([*cli, "envs", "list"], env=env, capture_output=True, text=True, timeout=120)
    assert re.search(r"^counter +Counter: make the counter show the target", listed.stdout, re.M), listed.stderr
    small = ["--set", "env.n_train=4", "--set", "env.n_dev=2", "--set", "env.n_test=3", "--set", "optim.epochs=1",
             "--set", "optim.batch_size=2", "--set", "optim.micro_batch_size=2", "--set", "model.tiny.hidden_size=32",
             "--set", "model.tiny.num_layers=1", "--set", "model.tiny.num_heads=2",
             "--set", "model.tiny.intermediate_size=64", "--set", "agent.max_new_tokens=6", "--set", "eval.splits=[test]",
             "--set", "env.params.max_steps=4", "--quiet",
             "--output-dir", str(tmp_path / "runs")]
    args = command.group(0).split()[1:]  # the documented command, made small
    out = subprocess.run([*cli, *args, *small], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    name = args[args.index("--name") + 1]
    state = json.loads((tmp_path / "runs" / name / "state.json").read_text())
    assert state["expert"] == {"n": 4, "success_rate": 1.0, "mean_steps": 2.0}  # targets 2, 3, 4, 5: 1, 2, 2, 3 steps
    assert state["eval/bc"]["test"]["n"] == 3
