"""ALFWorld adapter: generated games of every task type, the real-data layout, splits, signals, fast path, errors."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentevo.envs import alfworld as aw
from agentevo.envs import alfworld_gen as gen
from agentevo.envs import make_env
from agentevo.envs.base import SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_NONE, SIGNAL_REPEAT, Task, TextEnv
from agentevo.errors import ConfigError, MissingDependencyError

needs_alfworld = pytest.mark.skipif(
    importlib.util.find_spec("alfworld") is None or importlib.util.find_spec("textworld") is None,
    reason="needs `pip install 'agentevo[alfworld]'`",
)


def replay(env: aw.ALFWorldEnv, task: Task, actions: list[str]) -> list[tuple[str, float, bool, dict[str, Any]]]:
    """Reset and play the actions; element 0 is (first observation, 0, False, reset info)."""
    obs, info = env.reset(task)
    out: list[tuple[str, float, bool, dict[str, Any]]] = [(obs, 0.0, False, info)]
    for action in actions:
        out.append(env.step(action))
    return out


@pytest.fixture(scope="session")
def gen_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache dir shared by the session: the 6 dev games (one per task type) are generated once."""
    return tmp_path_factory.mktemp("alfworld_cache")


@pytest.fixture(scope="session")
def gen_env(gen_cache: Path) -> Iterator[aw.ALFWorldEnv]:
    env = aw.ALFWorldEnv(generated=True, cache_dir=gen_cache, n_train=6, n_dev=6, n_test=6)
    env.prepare("dev")
    yield env
    env.close()


# -- no alfworld needed ---------------------------------------------------------------------------------
def test_normalise_observation_strips_banner_and_arrival() -> None:
    assert aw.normalise_observation("You arrive at loc 12. On the countertop 1, you see a mug 1.") == (
        "On the countertop 1, you see a mug 1."
    )
    assert aw.normalise_observation("You arrive at cabinet 2. The cabinet 2 is closed.") == "The cabinet 2 is closed."
    assert aw.normalise_observation("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.") == (
        "You are in the middle of a room."
    )
    assert aw.normalise_observation("Nothing happens.") == "Nothing happens."


def test_missing_install_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_textworld(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] in ("textworld", "alfworld"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_textworld)
    monkeypatch.setattr(gen, "_ASSETS", {})
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentevo\[alfworld\]'"):
        aw._import_textworld()
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentevo\[alfworld\]'"):
        gen.plan_split("train", 1)
    env = aw.ALFWorldEnv(generated=True)  # construction stays cheap; the error comes on first use
    with pytest.raises(MissingDependencyError, match=r"agentevo\[alfworld\]"):
        env.tasks("dev")


def test_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ConfigError, match="generated"):
        aw.ALFWorldEnv(generated="maybe")
    with pytest.raises(ConfigError, match="max_steps"):
        aw.ALFWorldEnv(max_steps=0)
    monkeypatch.setattr(aw, "_DEFAULT_ALFWORLD_DATA", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="ALFWORLD_DATA"):
        aw.ALFWorldEnv(generated=False)
    with pytest.raises(ConfigError, match="json_2.1.1"):
        aw.ALFWorldEnv(data_path=tmp_path)  # an explicit path without data is an error, not a silent fallback
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    assert aw.ALFWorldEnv().source == "generated"  # env var without data: 'auto' falls back to generated games
    with pytest.raises(ConfigError, match="unknown split"):
        aw.ALFWorldEnv(generated=True).tasks("valid")


def test_instruction_lists_templates_and_invalid_string() -> None:
    text = aw.ALFWorldEnv(generated=True).instruction()
    for template in (
        "go to {recep}",
        "take {obj} from {recep}",
        "move {obj} to {recep}",
        "open {recep}",
        "use {obj}",
        "clean {obj} with {recep}",
        "heat {obj} with {recep}",
        "cool {obj} with {recep}",
    ):
        assert template in text
    assert '"Nothing happens."' in text and "Action: <your next action>" in text


# -- generated games -------------------------------------------------------------------------------------
@needs_alfworld
def test_splits_fixed_hashed_and_unseen_by_floor_plan(tmp_path: Path) -> None:
    env = aw.ALFWorldEnv(generated=True, cache_dir=tmp_path, n_dev=12)
    dev = env.tasks("dev")
    again = aw.ALFWorldEnv(generated=True, cache_dir=tmp_path / "elsewhere", n_dev=12).tasks("dev")
    assert dev.hash == again.hash and [t.task_id for t in dev] == [t.task_id for t in again]
    assert len(dev) == 12 and dev.head(5).tasks == dev.tasks[:5]
    assert aw.ALFWorldEnv(generated=True, n_dev=5).tasks("dev").hash == dev.head(5).hash  # lists extend stably
    assert aw.ALFWorldEnv(generated=True, seed=1, n_dev=12).tasks("dev").hash != dev.hash
    assert [t.task_type for t in dev][:6] == list(aw.TASK_TYPES)
    assert all(t.params["source"] == "generated" and not Path(t.params["game"]).is_absolute() for t in dev)
    # Nothing is generated by listing.
    assert not any(tmp_path.rglob("game.tw-pddl"))
    # Default sizes mirror ALFWorld: valid_seen 140, valid_unseen 134; unseen floor plans are held out.
    full = aw.ALFWorldEnv(generated=True)
    assert (len(full.tasks("dev")), len(full.tasks("test"))) == (140, 134)
    seen = {spec.floor_plan for spec in gen.plan_split("train", 300) + gen.plan_split("valid_seen", 140)}
    unseen = {spec.floor_plan for spec in gen.plan_split("valid_unseen", 134)}
    assert seen and unseen and not seen & unseen


@needs_alfworld
def test_registry_builds_the_adapter(gen_cache: Path) -> None:
    env = make_env("alfworld", generated=True, cache_dir=gen_cache, n_dev=1)
    assert isinstance(env, aw.ALFWorldEnv) and isinstance(env, TextEnv) and env.final_reward_mode == "last"


@needs_alfworld
def test_every_task_type_expert_replay_wins(gen_env: aw.ALFWorldEnv) -> None:
    tasks = gen_env.tasks("dev")
    assert sorted(t.task_type for t in tasks) == sorted(aw.TASK_TYPES)
    for task in tasks:
        gamefile = gen_env.gamefile(task)
        assert json.loads((gamefile.parent / "traj_data.json").read_text())["task_type"] == task.task_type
        expert = gen_env.expert(task)
        assert expert, task.task_id
        steps = replay(gen_env, task, expert)
        obs0, _, _, info0 = steps[0]
        assert "Your task is to: " in obs0 and info0["goal"] and info0["goal"] in obs0
        assert not obs0.startswith("-= Welcome")
        assert info0["task_type"] == task.task_type and info0["score"] == 0.0
        *_, (last_obs, reward, done, info) = steps
        assert info["won"] and info["success"] and info["score"] == 1.0 and reward == 1.0 and done, task.task_id
        assert all(not s[3]["won"] for s in steps[:-1])
        assert not any(s[0].startswith("You arrive at") for s in steps)


@needs_alfworld
def test_nothing_happens_is_the_invalid_signal(gen_env: aw.ALFWorldEnv) -> None:
    task = gen_env.tasks("dev")[0]
    obs0, info = gen_env.reset(task)
    bad, reward, done, _ = gen_env.step("xyzzy")
    assert bad == "Nothing happens." and reward == 0.0 and not done
    assert gen_env.signals(obs0, "xyzzy", bad, True) == SIGNAL_INVALID
    assert gen_env.signals(obs0, "xyzzy", bad, False) == SIGNAL_FORMAT
    go = next(a for a in info["valid_actions"] if a.startswith("go to "))
    arrived, _, _, step_info = gen_env.step(go)
    assert gen_env.signals(bad, go, arrived, True) == SIGNAL_NONE
    again, _, _, _ = gen_env.step(go)  # going where you already are is not admissible either
    assert again == "Nothing happens." and gen_env.signals(arrived, go, again, True) == SIGNAL_INVALID
    look1, _, _, _ = gen_env.step("look")
    look2, _, _, _ = gen_env.step("look")
    assert look1 == look2 and gen_env.signals(look1, "look", look2, True) == SIGNAL_REPEAT
    assert go not in step_info["valid_actions"] and "look" in step_info["valid_actions"]


@needs_alfworld
def test_episode_ends_at_max_steps(gen_cache: Path) -> None:
    env = aw.ALFWorldEnv(generated=True, cache_dir=gen_cache, n_dev=1, max_steps=3)
    task = env.tasks("dev")[0]
    assert task.max_steps == 3
    dones = [s[2] for s in replay(env, task, ["look", "inventory", "look"])[1:]]
    assert dones == [False, False, True]
    assert env.step("look")[2]  # stays done
    env.close()


@needs_alfworld
def test_generation_is_deterministic_and_cached(gen_env: aw.ALFWorldEnv, gen_cache: Path) -> None:
    spec = gen_env._spec_of(gen_env.tasks("dev")[0])
    assert gen.build_problem(spec) == gen.build_problem(spec)
    gamefile = gen_env.gamefile(gen_env.tasks("dev")[0])
    stamp = gamefile.stat().st_mtime_ns
    assert gen.generate_game(spec, gen_cache / f"gen-v{gen.GENERATOR_VERSION}-seed0") == gamefile
    assert gamefile.stat().st_mtime_ns == stamp  # cached: not regenerated
    data = json.loads(gamefile.read_text())
    assert data["solvable"] and data["walkthrough"] and "UNKNOWN GOAL" not in data["grammar"]


@needs_alfworld
def test_real_data_layout_through_alfworld_data(
    gen_env: aw.ALFWorldEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generated games copied into the real layout load through ALFWORLD_DATA like real ALFWorld games."""
    data = tmp_path / "alfworld_data"
    src_games = [gen_env.gamefile(t).parent for t in gen_env.tasks("dev")]
    for i, trial in enumerate(src_games):
        dst = data / "json_2.1.1" / "valid_seen" / f"{trial.parent.name}" / f"trial_T2019_{i:02d}"
        shutil.copytree(trial, dst)
    # Walkthrough-less copy (exercises the planner expert), and trials ALFWorld's own loader skips.
    keep = data / "json_2.1.1" / "valid_unseen" / src_games[0].parent.name / "trial_T2020_00"
    shutil.copytree(src_games[0], keep)
    game = json.loads((keep / "game.tw-pddl").read_text())
    (keep / "game.tw-pddl").write_text(json.dumps({**game, "walkthrough": None}))
    for name, patch in (
        ("pick_and_place_with_movable_recep-X-Y-Z-1", {}),
        ("pick_heat_Sliced-1", {}),
        ("pick_and_place_simple-Unsolvable-None-Z-1", {"solvable": False}),
    ):
        bad = data / "json_2.1.1" / "valid_unseen" / name / "trial_T2021_00"
        shutil.copytree(src_games[0], bad)
        (bad / "game.tw-pddl").write_text(json.dumps({**game, **patch}))
    monkeypatch.setenv("ALFWORLD_DATA", str(data))

    env = aw.ALFWorldEnv(max_steps=40)
    assert env.source == "data"
    dev = env.tasks("dev")
    rel = [t.params["game"] for t in dev]
    assert rel == sorted(rel) and len(dev) == len(src_games)
    assert all(t.params == {"source": "data", "game": t.params["game"]} for t in dev)
    assert {t.task_type for t in dev} == set(aw.TASK_TYPES)
    assert aw.ALFWorldEnv().tasks("dev").hash == dev.hash
    test = env.tasks("test")
    assert [t.params["game"] for t in test] == [f"valid_unseen/{keep.parent.name}/{keep.name}/game.tw-pddl"]
    assert env.tasks("train").tasks == ()

    task = next(t for t in dev if t.task_type == "pick_heat_then_place_in_recep")
    *_, (_, _, done, info) = replay(env, task, env.expert(task))
    assert done and info["won"]
    planned = env.expert(test[0])  # no stored walkthrough: fast-downward plans it
    assert planned and replay(env, test[0], planned)[-1][3]["won"]
    env.close()


@needs_alfworld
@pytest.mark.slow  # the stock path reloads fast-downward's library per game; many loads in one process can crash it
def test_fast_path_matches_stock_textworld(gen_env: aw.ALFWorldEnv) -> None:
    """The parse / translation caches and the command memo change speed only: same text, same commands."""
    tasks = [t for t in gen_env.tasks("dev") if t.task_type in ("look_at_obj_in_light", "pick_two_obj_and_place")]

    def play_all(fast: bool) -> list[Any]:
        env = aw.ALFWorldEnv(generated=True, cache_dir=gen_env.root.parent.parent, n_dev=6, fast=fast)
        out = []
        for task in tasks:
            expert = gen_env.expert(task)
            actions = expert[:2] + ["xyzzy", "look", "inventory"] + expert[2:]
            out.append([(s[0], s[1], s[2], s[3]["won"], s[3]["valid_actions"]) for s in replay(env, task, actions)])
            out.append(replay(env, task, [])[0][0])  # re-reset of the loaded game
        env.close()
        return out

    aw.uninstall_speedups()
    try:
        stock = play_all(fast=False)
    finally:
        aw.install_speedups()
    assert play_all(fast=True) == stock


@needs_alfworld
@pytest.mark.slow
def test_many_generated_games_win_in_every_split(tmp_path: Path) -> None:
    env = aw.ALFWorldEnv(generated=True, cache_dir=tmp_path, n_train=12, n_dev=12, n_test=12)
    for split in ("train", "dev", "test"):
        for task in env.tasks(split):
            *_, (_, _, done, info) = replay(env, task, env.expert(task))
            assert done and info["won"], task.task_id
    env.close()


_THREADED_ROUNDS = """
import sys
from agentevo.envs import alfworld as aw
from agentevo.rollout.workers import ThreadEnvPool

params = dict(generated=True, cache_dir=sys.argv[1], n_dev=6)
source = aw.ALFWorldEnv(**params)
tasks = source.tasks("dev")[:3]
experts = [source.expert(task) for task in tasks]
for round_ in range(2):  # the second pool loads after the first closed: the load that segfaulted
    pool = ThreadEnvPool("alfworld", params, size=len(tasks))
    results = pool.map([(i, "reset", (task,)) for i, task in enumerate(tasks)])
    assert not any(isinstance(r, Exception) for r in results), results
    won = [False] * len(tasks)
    for t in range(max(map(len, experts))):
        calls = [(i, "step", (e[t],)) for i, e in enumerate(experts) if t < len(e)]
        for (i, _, _), r in zip(calls, pool.map(calls)):
            assert not isinstance(r, Exception), r
            won[i] = bool(r[3]["won"])
    pool.close()
    print("round", round_, "won", sum(won), "of", len(tasks), flush=True)
"""


@needs_alfworld
def test_thread_workers_survive_concurrent_steps_and_reopened_envs(gen_env: aw.ALFWorldEnv) -> None:
    """Envs in a thread pool step concurrently, close, and a second pool loads again (a subprocess: the failure this
    guards against was a segfault in dlopen after libdownward copies were dlclose-d, plus IndexErrors in steps)."""
    cache = gen_env.root.parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", _THREADED_ROUNDS, str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["round 0 won 3 of 3", "round 1 won 3 of 3"]


def test_closed_runner_parks_its_env_for_reuse_and_a_crashed_one_is_dropped() -> None:
    """close() never unloads libdownward (shared plugin registry): a healthy env is handed to the next runner with
    the same settings; one closed after an exception is not."""
    sentinel, broken = object(), object()
    aw._IDLE_GYMS.clear()
    try:
        runner = aw._GameRunner(max_steps=7)
        runner._gym = sentinel
        runner.close()
        assert runner._gym is None and aw._IDLE_GYMS == {(7, False, True): [sentinel]}
        crashed = aw._GameRunner(max_steps=7)
        crashed._gym = broken
        crashed.close(reuse=False)
        assert aw._IDLE_GYMS == {(7, False, True): [sentinel]}
    finally:
        aw._IDLE_GYMS.clear()
