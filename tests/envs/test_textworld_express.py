"""TextWorldExpress adapter: gold replays, fixed hashed splits, signals on the real strings, JVM crash."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from agentevo.envs import make_env
from agentevo.envs.java import jvm_process
from agentevo.errors import ConfigError, EnvCrashedError


@pytest.mark.parametrize("name", ["twx-cookingworld", "twx-twc"])
def test_gold_sequences_reach_success(name: str) -> None:
    env = make_env(name, n_test=5)
    try:
        for task in env.tasks("test"):
            gold = env.expert(task)
            obs, info = env.reset(task)
            assert info["goal"] and info["goal"] in obs
            done = False
            for action in gold:
                obs, reward, done, info = env.step(action)
                if done:
                    break
            assert done and info["success"] and info["score"] == pytest.approx(1.0), task.task_id
    finally:
        env.close()


def test_task_lists_are_fixed_and_hashed() -> None:
    a = make_env("twx-cookingworld", n_train=10, n_dev=5, n_test=5)
    b = make_env("twx-cookingworld", n_train=10, n_dev=5, n_test=5)
    try:
        for split in ("train", "dev", "test"):
            assert a.tasks(split).hash == b.tasks(split).hash
            assert [t.task_id for t in a.tasks(split)] == [t.task_id for t in b.tasks(split)]
        train_ids = {t.task_id for t in a.tasks("train")}
        assert train_ids.isdisjoint({t.task_id for t in a.tasks("test")})
        assert a.tasks("train")[0].task_id == "twx-cookingworld/train/0"
        assert a.tasks("test")[0].params["seed"] == 20000
        # the hash depends on the game parameters too
        c = make_env("twx-cookingworld", n_train=10, game_params={"numIngredients": 3})
        assert c.tasks("train").hash != a.tasks("train").hash
        c.close()
    finally:
        a.close()
        b.close()


def test_signals_on_real_strings(twx_env) -> None:  # noqa: ANN001
    task = twx_env.tasks("train")[0]
    obs, _ = twx_env.reset(task)
    bad, _, _, _ = twx_env.step("fly to the moon")
    assert bad.startswith("Unknown action")
    assert twx_env.signals(obs, "fly to the moon", bad, True) == "invalid"
    assert twx_env.signals(obs, "", "whatever", False) == "format"
    look, _, _, _ = twx_env.step("look around")
    again, _, _, _ = twx_env.step("look around")
    assert twx_env.signals(look, "look around", again, True) == "repeat"
    took, _, _, _ = twx_env.step("take cookbook")
    assert twx_env.signals(again, "take cookbook", took, True) == "none"


def test_unknown_game_parameter_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="numIngredients"):
        make_env("twx-cookingworld", game_params={"numIngredientz": 2})


def test_killed_jvm_raises_env_crashed_and_recovers(twx_env, caplog) -> None:  # noqa: ANN001
    task = twx_env.tasks("train")[0]
    twx_env.reset(task)
    port = twx_env._env._gateway.gateway_parameters.port
    os.kill(twx_env.jvm_pid(), signal.SIGKILL)
    with pytest.raises(EnvCrashedError):
        for _ in range(3):
            twx_env.step("look around")
    assert twx_env.jvm_pid() is None
    gc.collect()  # the dead JVM's object proxies (and any earlier test's garbage: only this JVM's port counts)
    # py4j's own retry of the failed call dials once; the shutdown and the proxies' finalizers do not (it was 7 times)
    dials = [r for r in caplog.records if f"trying to connect to the Java server (127.0.0.1:{port})" in r.getMessage()]
    assert len(dials) <= 1
    gold = twx_env.expert(task)
    twx_env.reset(task)
    for action in gold:
        _, _, done, info = twx_env.step(action)
    assert info["success"]


def test_close_kills_a_wedged_jvm(twx_env) -> None:  # noqa: ANN001
    twx_env.reset(twx_env.tasks("train")[0])
    proc = jvm_process(twx_env._env)
    os.kill(proc.pid, signal.SIGSTOP)  # a stopped JVM answers no shutdown request
    t0 = time.monotonic()
    twx_env.close()
    assert proc.poll() is not None and time.monotonic() - t0 < 30
    assert twx_env.jvm_pid() is None


def test_bounded_jvm_options_reach_the_jvm_and_write_no_perf_file() -> None:
    """The JVMs an env starts run with the bounded options, UsePerfData off among them: no hsperfdata file whose
    lock warning (printed on stdout) py4j would read as the gateway's port."""
    import subprocess

    from agentevo.envs.java import bounded_jvm

    before = os.environ.get("JAVA_TOOL_OPTIONS")  # another env's block may be open in this process
    with bounded_jvm(64):
        out = subprocess.run(["java", "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True,
                             timeout=60).stdout
    flags = {line.split()[1]: line.split()[3] for line in out.splitlines() if len(line.split()) >= 4
             and line.split()[2] == "="}
    assert (flags["UsePerfData"], flags["UseSerialGC"], flags["ActiveProcessorCount"]) == ("false", "true", "1")
    assert flags["MaxHeapSize"] == str(64 * 1024 * 1024)
    assert os.environ.get("JAVA_TOOL_OPTIONS") == before  # restored on leaving the block


def test_a_jvm_that_fails_to_start_leaves_no_traceback_behind(monkeypatch) -> None:  # noqa: ANN001
    """The failed start raises; the half-built simulator is then collected without printing an AttributeError (its
    own __del__ read a gateway it never had)."""
    import sys

    import textworld_express.textworld_express as simulator

    def no_port(*args: object, **kwargs: object) -> None:
        raise ValueError("invalid literal for int() with base 10: '[warning][perf,memops] Cannot use file'")

    monkeypatch.setattr(simulator, "launch_gateway", no_port)
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(repr(info.exc_value)))
    env = make_env("twx-cookingworld", n_train=2, n_dev=2, n_test=2)
    with pytest.raises(ValueError, match="invalid literal"):
        env._jvm()
    gc.collect()
    assert unraisable == []
    assert env.jvm_pid() is None
