"""ScienceWorld adapter: config checks, splits, gold demos, fast-path equivalence, signals and crash recovery."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agentevo.envs import make_env
from agentevo.envs import scienceworld as sw
from agentevo.envs.base import SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_NONE, SIGNAL_REPEAT, Task, TextEnv
from agentevo.errors import ConfigError, EnvCrashedError

needs_sim = pytest.mark.skipif(
    importlib.util.find_spec("scienceworld") is None or shutil.which("java") is None,
    reason="needs `pip install scienceworld` and a Java runtime",
)

# Small, fast task types; chemistry-mix dev variation 18 has an ambiguity menu on its gold path.
TEST_TASKS = ["find-animal", "lifespan-shortest-lived", "power-component", "chemistry-mix"]
MENU_TASK = ("chemistry-mix", 18)


def make_task(task_name: str, variation: int, split: str = "train") -> Task:
    """A Task for one variation, as tasks() would build it."""
    return Task(
        env="scienceworld",
        task_id=f"scienceworld/{split}/{task_name}/{variation}",
        split=split,
        task_type=task_name,
        params={"task_name": task_name, "variation": variation, "simplification": "easy"},
        max_steps=sw.default_max_steps(task_name),
    )


def play(env: sw.ScienceWorldEnv, task: Task, actions: list[str]) -> list[tuple[str, float, bool, dict[str, Any]]]:
    """Reset and play the actions until done, like a rollout; element 0 is (first observation, 0, False, reset info)."""
    obs, info = env.reset(task)
    out: list[tuple[str, float, bool, dict[str, Any]]] = [(obs, 0.0, False, info)]
    for action in actions:
        out.append(env.step(action))
        if out[-1][2]:
            break
    return out


def trailing_waits(actions: list[str]) -> int:
    """How many wait/wait1 actions end the list (expert() keeps them as slack for simulator timing)."""
    n = 0
    while n < len(actions) and actions[len(actions) - 1 - n] in ("wait", "wait1"):
        n += 1
    return n


@pytest.fixture(scope="module")
def env() -> Iterator[sw.ScienceWorldEnv]:
    e = sw.ScienceWorldEnv(task_names=TEST_TASKS, n_train=2, n_dev=2, n_test=1)
    yield e
    e.close()


# -- no JVM needed -------------------------------------------------------------------------------------
def test_unknown_task_name_lists_allowed_names() -> None:
    with pytest.raises(ConfigError) as err:
        sw.ScienceWorldEnv(task_names=["find-animal", "boil-water"])
    msg = str(err.value)
    assert "'boil-water'" in msg and "find-animal" in msg and "use-thermometer" in msg and "'short'" in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"simplification": "easy,superEasy"},
        {"task_names": ["power-component"], "simplification": "noElectricalAction"},
        {"max_steps": 0},
        {"max_steps": {"boil-water": 10}},
        {"task_names": ["boil", "boil"]},
        {"n_train": 0},
    ],
)
def test_bad_config_raises(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        sw.ScienceWorldEnv(**kwargs)


def test_presets_and_step_limits() -> None:
    assert sw.ScienceWorldEnv().task_names == sw.TASK_NAMES and len(sw.TASK_NAMES) == 30
    short = sw.ScienceWorldEnv(task_names="short")
    assert short.task_names == sw.SHORT_TASKS
    assert all(sw.GOLD_MEDIAN_STEPS[t] <= 20 for t in sw.SHORT_TASKS)
    assert set(sw.ETO_MAX_STEPS) == set(sw.TASK_NAMES) == set(sw.GOLD_MEDIAN_STEPS)
    assert short.step_limits["find-animal"] == 15 and short.step_limits["boil"] == 100
    assert sw.ScienceWorldEnv(max_steps=25).step_limits["grow-fruit"] == 25
    custom = sw.ScienceWorldEnv(max_steps={"grow-plant": 80})
    assert custom.step_limits["grow-plant"] == 80 and custom.step_limits["melt"] == 80
    assert isinstance(make_env("scienceworld", task_names="short"), sw.ScienceWorldEnv)
    assert isinstance(short, TextEnv) and short.final_reward_mode == "max"


def test_instruction_lists_templates() -> None:
    text = sw.ScienceWorldEnv().instruction()
    for template in ("Thought:", "Action:", "focus on OBJ", "move OBJ to OBJ", "wait1", "teleport to LOCATION"):
        assert template in text
    assert "Ambiguous" not in text
    assert "answer with the number" in sw.ScienceWorldEnv(auto_disambiguate=False).instruction()
    assert "teleport" not in sw.ScienceWorldEnv(simplification="openDoors").instruction()


def test_signals_on_scripted_strings() -> None:
    e = sw.ScienceWorldEnv()
    look = "This room is called the hallway. In it, you see: \n\tthe agent"
    assert e.signals(look, "xyzzy", "No known action matches that input.", True) == SIGNAL_INVALID
    unknown = "Unknown action.  Type 'help' for a list of actions, and 'objects' for a list of possible object referents. "
    assert e.signals(look, "99", unknown, True) == SIGNAL_INVALID
    menu = "Ambiguous request: Please enter the number for the action you intended (or blank to cancel):\n0:\ta\n1:\tb\n"
    assert e.signals(look, "look at door", menu, True) == SIGNAL_INVALID
    assert e.signals("The door is already open.", "open door", "The door is already open.", True) == SIGNAL_REPEAT
    assert e.signals(look, "go to kitchen", "You move to the kitchen.", True) == SIGNAL_NONE
    assert e.signals(look, "", "No known action matches that input.", False) == SIGNAL_FORMAT
    assert sw.parse_menu(menu) == ["a", "b"]


def test_step_before_reset_raises() -> None:
    with pytest.raises(ConfigError):
        sw.ScienceWorldEnv().step("look around")


# -- real simulator ------------------------------------------------------------------------------------
@needs_sim
def test_jvm_heap_is_bounded(env: sw.ScienceWorldEnv) -> None:
    env.reset(make_task("find-animal", 0))
    pid = env.jvm_pid()
    assert pid is not None
    if sys.platform.startswith("linux"):
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
        assert b"JAVA_TOOL_OPTIONS=-Xmx512m -XX:+UseSerialGC -XX:ActiveProcessorCount=1 -XX:-UsePerfData" in environ


@needs_sim
def test_splits_are_stable_disjoint_and_per_type(env: sw.ScienceWorldEnv) -> None:
    lists = {s: env.tasks(s) for s in ("train", "dev", "test")}
    assert [len(lists[s]) for s in ("train", "dev", "test")] == [8, 8, 4]
    assert [t.task_type for t in lists["dev"]][::2] == TEST_TASKS  # task order as given, n_dev of each type
    ids = [set(t.task_id for t in lists[s]) for s in lists]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    first = lists["train"][0]
    assert first.task_id == "scienceworld/train/find-animal/0" and first.max_steps == 15
    assert lists["dev"][0].params["variation"] == 150  # find-animal: 150 train, then 75 dev, then 75 test
    assert lists["test"][0].params["variation"] == 225
    # A second instance with a fresh JVM and an empty variation cache gives the same lists and hashes.
    sw._VARIATION_CACHE.clear()
    other = sw.ScienceWorldEnv(task_names=TEST_TASKS, n_train=2, n_dev=2, n_test=1)
    try:
        for split, tl in lists.items():
            again = other.tasks(split)
            assert again.hash == tl.hash and [t.task_id for t in again] == [t.task_id for t in tl]
    finally:
        other.close()


@needs_sim
@pytest.mark.parametrize("task_name,variation", [("find-animal", 0), ("lifespan-shortest-lived", 1), ("power-component", 0)])
def test_gold_demo_succeeds(env: sw.ScienceWorldEnv, task_name: str, variation: int) -> None:
    task = make_task(task_name, variation)
    gold = env.expert(task)
    assert gold and not any(a.strip().isdigit() for a in gold)
    steps = play(env, task, gold)
    obs0, _, _, info0 = steps[0]
    assert info0["goal"].startswith("Your task is") and obs0.startswith(info0["goal"])
    # Cut at completion: only the trailing waits kept as timing slack may go unused.
    assert steps[-1][2] and len(gold) - trailing_waits(gold) <= len(steps) - 1 <= len(gold)
    final = steps[-1][3]
    assert final["success"] and final["won"] and final["score"] == 1.0 and final["max_score"] == 1.0
    assert abs(info0["score"] + sum(r for _, r, _, _ in steps[1:]) - 1.0) < 1e-9


@needs_sim
def test_ambiguity_menu_auto_and_manual(env: sw.ScienceWorldEnv) -> None:
    task = make_task(*MENU_TASK, split="dev")
    try:
        env.auto_disambiguate = True
        gold = env.expert(task)
        assert gold is not None and "0" not in gold
        steps = play(env, task, gold)
        resolved = [info for _, _, _, info in steps[1:] if "auto_choice" in info]
        assert len(resolved) == 1 and resolved[0]["auto_choice"] == resolved[0]["ambiguous_options"][0]
        assert steps[-1][3]["success"]

        env.auto_disambiguate = False
        manual = env.expert(task)
        assert manual is not None and manual.count("0") == 1 and len(manual) == len(gold) + 1
        steps = play(env, task, manual)
        k = manual.index("0")
        menu_obs = steps[k][0]  # the observation after the ambiguous action (steps[0] is the reset)
        assert menu_obs.startswith("Ambiguous request:")
        assert env.signals(steps[k - 1][0], manual[k - 1], menu_obs, True) == SIGNAL_INVALID
        assert steps[-1][3]["success"]
    finally:
        env.auto_disambiguate = True


@needs_sim
@pytest.mark.parametrize("task_name,variation,split", [("find-animal", 0, "train"), ("chemistry-mix", 18, "dev")])
def test_fast_path_matches_stock_step(env: sw.ScienceWorldEnv, task_name: str, variation: int, split: str) -> None:
    task = make_task(task_name, variation, split)
    gold = env.expert(task)
    assert gold is not None
    # An invalid input first, then the gold path (chemistry-mix 18 has a menu whose options are all the same text;
    # menus with different options, like 'look at door', are listed in a varying order, so they are left out).
    actions = ["xyzzy", *gold]
    try:
        env.fast = True
        fast = play(env, task, actions)
        env.fast = False
        stock = play(env, task, actions)
    finally:
        env.fast = True
    assert fast == stock
    assert fast[-1][3]["success"]


@needs_sim
def test_signals_from_real_steps(env: sw.ScienceWorldEnv) -> None:
    task = make_task("find-animal", 0)
    obs, _ = env.reset(task)
    nxt, reward, done, _ = env.step("xyzzy foo")
    assert nxt == "No known action matches that input." and reward == 0.0 and not done
    assert env.signals(obs, "xyzzy foo", nxt, True) == SIGNAL_INVALID
    again, _, _, _ = env.step("open door to kitchen")
    again2, _, _, _ = env.step("open door to kitchen")
    assert again2 == "The door is already open." and env.signals(again, "open door to kitchen", again2, True) == SIGNAL_REPEAT
    # auto_disambiguate answers the door menu with option 0 in the same step (the simulator's menu order varies).
    door, _, _, info = env.step("look at door")
    assert len(info["ambiguous_options"]) == 6 and info["auto_choice"] == info["ambiguous_options"][0]
    room = info["auto_choice"].removeprefix("look at door between ").removesuffix(" and hallway")
    assert door == f"A door to the {room} (that is open)"
    assert env.signals(again2, "look at door", door, True) == SIGNAL_NONE
    env.auto_disambiguate = False
    try:
        menu, _, _, info = env.step("look at door")
        assert menu.startswith("Ambiguous request:") and "auto_choice" not in info
        assert env.signals(door, "look at door", menu, True) == SIGNAL_INVALID
        unknown, _, _, _ = env.step("look around")  # anything but a number after a menu is rejected
        assert unknown.startswith("Unknown action.") and env.signals(menu, "look around", unknown, True) == SIGNAL_INVALID
    finally:
        env.auto_disambiguate = True
    assert "look around" in env.valid_actions()


@needs_sim
def test_failed_focus_ends_episode(env: sw.ScienceWorldEnv) -> None:
    _, info0 = env.reset(make_task("find-animal", 0))
    env.step("go to kitchen")
    obs, reward, done, info = env.step("focus on air")
    assert obs == "You focus on the air."
    assert done and not info["success"] and info["failure"] and info["score"] == -1.0
    assert reward < 0 and info["max_score"] > 0


@needs_sim
def test_jvm_kill_raises_crash_then_recovers(env: sw.ScienceWorldEnv) -> None:
    task = make_task("find-animal", 1)
    gold = env.expert(task)
    assert gold is not None
    env.reset(task)
    env.step(gold[0])
    pid = env.jvm_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EnvCrashedError):
        env.step(gold[1])
    assert env.jvm_pid() is None
    steps = play(env, task, gold)  # the reset starts a fresh JVM
    assert steps[-1][3]["success"] and env.jvm_pid() not in (None, pid)


@needs_sim
@pytest.mark.slow
def test_gold_replay_all_30_tasks() -> None:
    e = sw.ScienceWorldEnv(jvm_heap_mb=1024)
    failed: list[str] = []
    try:
        for task_name in sw.TASK_NAMES:
            task = make_task(task_name, 0)
            gold = e.expert(task)
            if gold is None or not play(e, task, gold)[-1][3]["success"]:
                failed.append(task_name)
    finally:
        e.close()
    assert not failed
