"""ScienceWorld behind the TextEnv contract; one JVM per env instance, stepped through the raw server calls."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.envs.java import bounded_jvm, jvm_process, quiet_when_half_built, require_java, shutdown_jvm
from agentevo.errors import ConfigError, EnvCrashedError, MissingDependencyError

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_NAME = "scienceworld"

# The simulator's 30 task names, in its own order (ScienceWorldEnv.get_task_names()); kept here so names can be
# checked without starting a JVM.
TASK_NAMES: tuple[str, ...] = (
    "boil",
    "change-the-state-of-matter-of",
    "chemistry-mix",
    "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color",
    "find-animal",
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "freeze",
    "grow-fruit",
    "grow-plant",
    "identify-life-stages-1",
    "identify-life-stages-2",
    "inclined-plane-determine-angle",
    "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces",
    "lifespan-longest-lived",
    "lifespan-longest-lived-then-shortest-lived",
    "lifespan-shortest-lived",
    "measure-melting-point-known-substance",
    "measure-melting-point-unknown-substance",
    "melt",
    "mendelian-genetics-known-plant",
    "mendelian-genetics-unknown-plant",
    "power-component",
    "power-component-renewable-vs-nonrenewable-energy",
    "test-conductivity",
    "test-conductivity-of-unknown-substances",
    "use-thermometer",
)

# Task types whose median gold path is at most 20 actions (measured on 5 train variations each).
SHORT_TASKS: tuple[str, ...] = (
    "chemistry-mix",
    "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color",
    "find-animal",
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "identify-life-stages-2",
    "lifespan-longest-lived",
    "lifespan-longest-lived-then-shortest-lived",
    "lifespan-shortest-lived",
    "power-component",
    "use-thermometer",
)

# ETO's per-task episode limits (agent steps), the protocol behind the published ScienceWorld numbers.
ETO_MAX_STEPS: dict[str, int] = {
    "boil": 100,
    "change-the-state-of-matter-of": 80,
    "chemistry-mix": 60,
    "chemistry-mix-paint-secondary-color": 15,
    "chemistry-mix-paint-tertiary-color": 30,
    "find-animal": 15,
    "find-living-thing": 15,
    "find-non-living-thing": 15,
    "find-plant": 15,
    "freeze": 80,
    "grow-fruit": 60,
    "grow-plant": 30,
    "identify-life-stages-1": 30,
    "identify-life-stages-2": 30,
    "inclined-plane-determine-angle": 40,
    "inclined-plane-friction-named-surfaces": 40,
    "inclined-plane-friction-unnamed-surfaces": 40,
    "lifespan-longest-lived": 10,
    "lifespan-longest-lived-then-shortest-lived": 12,
    "lifespan-shortest-lived": 10,
    "measure-melting-point-known-substance": 120,
    "measure-melting-point-unknown-substance": 120,
    "melt": 80,
    "mendelian-genetics-known-plant": 50,
    "mendelian-genetics-unknown-plant": 50,
    "power-component": 20,
    "power-component-renewable-vs-nonrenewable-energy": 30,
    "test-conductivity": 30,
    "test-conductivity-of-unknown-substances": 30,
    "use-thermometer": 30,
}

# Median number of gold actions until the task completes (5 train variations each); the fallback limit for a
# task missing from ETO_MAX_STEPS is max(10, 2 x this).
GOLD_MEDIAN_STEPS: dict[str, int] = {
    "boil": 36,
    "change-the-state-of-matter-of": 24,
    "chemistry-mix": 15,
    "chemistry-mix-paint-secondary-color": 8,
    "chemistry-mix-paint-tertiary-color": 17,
    "find-animal": 10,
    "find-living-thing": 10,
    "find-non-living-thing": 5,
    "find-plant": 10,
    "freeze": 30,
    "grow-fruit": 88,
    "grow-plant": 39,
    "identify-life-stages-1": 28,
    "identify-life-stages-2": 12,
    "inclined-plane-determine-angle": 56,
    "inclined-plane-friction-named-surfaces": 52,
    "inclined-plane-friction-unnamed-surfaces": 179,
    "lifespan-longest-lived": 5,
    "lifespan-longest-lived-then-shortest-lived": 6,
    "lifespan-shortest-lived": 5,
    "measure-melting-point-known-substance": 27,
    "measure-melting-point-unknown-substance": 89,
    "melt": 39,
    "mendelian-genetics-known-plant": 143,
    "mendelian-genetics-unknown-plant": 145,
    "power-component": 11,
    "power-component-renewable-vs-nonrenewable-energy": 23,
    "test-conductivity": 26,
    "test-conductivity-of-unknown-substances": 26,
    "use-thermometer": 19,
}

SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors", "noElectricalAction")

# Inside the simulator an episode also completes once its move counter passes this (ETO uses 200); `wait` costs
# 10 moves. The per-task agent-step limits above are far lower and are enforced by the rollout loop.
SIM_STEP_LIMIT = 200

AMBIGUOUS_PREFIX = "Ambiguous request:"
INVALID_PATTERNS = (
    "No known action matches that input.",
    "Unknown action.",
    AMBIGUOUS_PREFIX,
)

_VARIATION_GETTERS = {"train": "getVariationsTrain", "dev": "getVariationsDev", "test": "getVariationsTest"}
_VARIATION_CACHE: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
_VARIATION_LOCK = threading.Lock()
_MENU_LINE = re.compile(r"^(\d+):\s*(.*)$")

_INSTRUCTION_HEAD = (
    "You are an agent in ScienceWorld, a text-based simulated world for elementary-school science tasks. "
    "Each turn you read an observation and reply with one line 'Thought: <your reasoning>' and one line "
    "'Action: <a command>'. Commands (OBJ is an object you can see):\n"
    "open/close OBJ; activate/deactivate OBJ; connect OBJ to OBJ; disconnect OBJ; use OBJ on OBJ; "
    "look around; look at OBJ; look in OBJ; read OBJ; move OBJ to OBJ; pick up OBJ; put down OBJ; "
    "pour OBJ in OBJ; dunk OBJ in OBJ; mix OBJ; eat OBJ; flush OBJ; go to LOCATION; "
)
_INSTRUCTION_TELEPORT = "teleport to LOCATION; "
_INSTRUCTION_TAIL = (
    "focus on OBJ (marks the object the task is about; focusing on the wrong object ends the task as a "
    "failure); inventory; task (repeats the task); wait (10 time steps); wait1 (one time step)."
)
_INSTRUCTION_MENU = (
    "\nIf the reply is a numbered 'Ambiguous request' menu, answer with the number alone (for example "
    "'Action: 0')."
)


def _import_scienceworld() -> Any:
    try:
        from scienceworld import ScienceWorldEnv as _SimEnv
    except ImportError as exc:
        raise MissingDependencyError(
            "ScienceWorld is not installed; install it with `pip install 'agentevo[scienceworld]'` "
            "(or `pip install scienceworld`)"
        ) from exc
    return quiet_when_half_built(_SimEnv)


def _resolve_task_names(task_names: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...]:
    if task_names is None or task_names == "all":
        return TASK_NAMES
    if task_names == "short":
        return SHORT_TASKS
    if isinstance(task_names, str):
        task_names = [task_names]
    names = tuple(task_names)
    unknown = [n for n in names if n not in TASK_NAMES]
    if unknown:
        raise ConfigError(
            f"unknown ScienceWorld task name(s) {', '.join(map(repr, unknown))}; allowed: 'all', 'short', "
            f"or a list of: {', '.join(TASK_NAMES)}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"ScienceWorld task names must not repeat (got {list(names)})")
    if not names:
        raise ConfigError("ScienceWorld task_names is empty; give 'all', 'short' or a list of task names")
    return names


def _check_simplification(simplification: str, names: tuple[str, ...]) -> None:
    parts = [p for p in simplification.split(",") if p]
    bad = [p for p in parts if p not in SIMPLIFICATIONS]
    if bad:
        raise ConfigError(
            f"unknown ScienceWorld simplification(s) {', '.join(map(repr, bad))}; allowed: "
            f"{', '.join(SIMPLIFICATIONS)} (comma-separated, no spaces), or '' for none"
        )
    electrical = [n for n in names if "power-component" in n or "conductivity" in n]
    if "noElectricalAction" in parts and electrical:
        raise ConfigError(
            f"simplification noElectricalAction cannot be used with the electrical tasks {', '.join(electrical)}"
        )


def default_max_steps(task_name: str) -> int:
    """ETO's per-task step limit, or max(10, 2 x median gold length) for a task ETO does not list."""
    if task_name in ETO_MAX_STEPS:
        return ETO_MAX_STEPS[task_name]
    return max(10, 2 * GOLD_MEDIAN_STEPS.get(task_name, 25))


def parse_menu(text: str) -> list[str]:
    """The options of an 'Ambiguous request' menu, in menu order (option i is answered with 'i')."""
    options: list[str] = []
    for line in text.splitlines()[1:]:
        m = _MENU_LINE.match(line.strip())
        if m:
            options.append(m.group(2).strip())
    return options


class ScienceWorldEnv:
    """ScienceWorld's 30 task types; reward is the score change / 100 and the trajectory reward the best score."""

    name = ENV_NAME
    final_reward_mode = "max"

    def __init__(
        self,
        task_names: list[str] | tuple[str, ...] | str | None = None,
        simplification: str = "easy",
        max_steps: int | dict[str, int] | None = None,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        jvm_heap_mb: int = 512,
        fast: bool = True,
        auto_disambiguate: bool = True,
    ) -> None:
        names = _resolve_task_names(task_names)
        _check_simplification(simplification, names)
        limits = {n: default_max_steps(n) for n in TASK_NAMES}
        if isinstance(max_steps, bool):
            raise ConfigError(f"max_steps must be an int or a dict of task name -> int (got {max_steps!r})")
        if isinstance(max_steps, int):
            limits = dict.fromkeys(TASK_NAMES, max_steps)
        elif isinstance(max_steps, dict):
            unknown = [k for k in max_steps if k not in TASK_NAMES]
            if unknown:
                raise ConfigError(
                    f"max_steps names unknown ScienceWorld task(s) {', '.join(map(repr, unknown))}; "
                    f"allowed: {', '.join(TASK_NAMES)}"
                )
            limits.update({k: int(v) for k, v in max_steps.items()})
        elif max_steps is not None:
            raise ConfigError(f"max_steps must be an int or a dict of task name -> int (got {max_steps!r})")
        if any(v < 1 for v in limits.values()):
            raise ConfigError(f"max_steps must be >= 1 (got {max_steps!r})")
        for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
            if n is not None and n < 1:
                raise ConfigError(f"n_{split} must be >= 1 or None (got {n})")
        if jvm_heap_mb < 128:
            raise ConfigError(f"jvm_heap_mb must be >= 128 (got {jvm_heap_mb})")
        self.task_names = names
        self.simplification = simplification
        self.step_limits = limits
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self.jvm_heap_mb = jvm_heap_mb
        self.fast = fast
        self.auto_disambiguate = auto_disambiguate
        self._env: Any = None
        # (task name, variation, simplification, gold path generated) now loaded in the JVM; reset() reuses it.
        self._loaded: tuple[str, int, str, bool] | None = None
        self._task: Task | None = None
        self._score = 0  # current simulator score, 0..100 (or negative after a failure)
        self._best = 0  # highest score reached after a step this episode, clipped at 0

    # -- process management ------------------------------------------------------------------
    def _jvm(self) -> Any:
        if self._env is None:
            require_java(self.name)
            cls = _import_scienceworld()
            with bounded_jvm(self.jvm_heap_mb):
                self._env = cls("", envStepLimit=SIM_STEP_LIMIT)
            self._loaded = None
        return self._env

    def close(self, crashed: bool = False) -> None:
        """Shut the JVM down (crashed: kill it without asking, see shutdown_jvm)."""
        env, self._env = self._env, None
        self._loaded = None
        self._task = None
        if env is not None:
            shutdown_jvm(env, crashed)

    def restart(self) -> None:
        """Kill and forget the JVM; the next call starts a fresh one."""
        self.close(crashed=True)

    def jvm_pid(self) -> int | None:
        """The JVM's process id (tests kill it to check crash recovery)."""
        if self._env is None:
            return None
        proc = jvm_process(self._env)
        return None if proc is None else int(proc.pid)

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run fn(simulator); any failure of the JVM bridge restarts the env and raises EnvCrashedError."""
        env = self._jvm()
        try:
            return fn(env)
        except (ConfigError, MissingDependencyError):
            raise
        except Exception as exc:  # py4j raises several types when the JVM is gone
            self.restart()
            raise EnvCrashedError(f"{self.name}: JVM call {what} failed ({exc.__class__.__name__}: {exc})") from exc

    def _load(self, task_name: str, variation: int, gold: bool) -> None:
        """Load a task variation unless it (or the same variation with a gold path) is loaded already."""
        loaded = self._loaded
        if loaded is not None and loaded[:3] == (task_name, variation, self.simplification) and (loaded[3] or not gold):
            return
        self._loaded = None
        self._call("load", lambda e: e.load(task_name, variation, self.simplification, generateGoldPath=gold))
        self._loaded = (task_name, variation, self.simplification, gold)

    # -- contract ------------------------------------------------------------------------------
    def _variations(self, task_name: str) -> dict[str, tuple[int, ...]]:
        key = (task_name, self.simplification)
        with _VARIATION_LOCK:
            if key not in _VARIATION_CACHE:
                # Loading a task replaces whatever episode was running in this JVM.
                self._loaded = None
                self._task = None

                def fetch(e: Any) -> dict[str, tuple[int, ...]]:
                    e.load(task_name, 0, self.simplification, generateGoldPath=False)
                    return {s: tuple(int(v) for v in getattr(e.server, g)()) for s, g in _VARIATION_GETTERS.items()}

                _VARIATION_CACHE[key] = self._call("variations", fetch)
            return _VARIATION_CACHE[key]

    def tasks(self, split: str) -> TaskList:
        """The split's variations of every task type (task order as given, then variation order), n_<split> per type."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        limit = self.limits[split]
        out: list[Task] = []
        for task_name in self.task_names:
            variations = self._variations(task_name)[split]
            if limit is not None:
                variations = variations[:limit]
            out.extend(
                Task(
                    env=self.name,
                    task_id=f"{self.name}/{split}/{task_name}/{v}",
                    split=split,
                    task_type=task_name,
                    params={"task_name": task_name, "variation": v, "simplification": self.simplification},
                    max_steps=self.step_limits[task_name],
                )
                for v in variations
            )
        return TaskList(self.name, split, tuple(out))

    def _task_key(self, task: Task) -> tuple[str, int]:
        task_name = str(task.params.get("task_name", task.task_type))
        if task_name not in TASK_NAMES:
            raise ConfigError(f"unknown ScienceWorld task name {task_name!r}; allowed: {', '.join(TASK_NAMES)}")
        simplification = task.params.get("simplification", self.simplification)
        if simplification != self.simplification:
            raise ConfigError(
                f"task {task.task_id} was made with simplification {simplification!r} but this env uses "
                f"{self.simplification!r}"
            )
        return task_name, int(task.params["variation"])

    def _raw_step(self, action: str) -> tuple[str, int, bool, int]:
        """One simulator step: (observation, score 0..100, completed, moves); the fast path skips the valid-action list."""
        if self.fast:

            def fn(e: Any) -> tuple[str, int, bool, int]:
                server = e.server
                obs = server.step(action)
                score = int(round(100 * server.getScore()))
                return str(obs), score, bool(server.getCompleted()), int(server.getNumMoves())

            obs, score, completed, moves = self._call("step", fn)
        else:
            obs, _, completed, info = self._call("step", lambda e: e.step(action))
            score, moves = int(info["score"]), int(info["moves"])
        # Same completion rule as the stock env.step: the move limit, or a negative score (a failed focus).
        return obs, score, bool(completed or moves > SIM_STEP_LIMIT or score < 0), moves

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start the task's episode; the first observation is the task description followed by 'look around'."""
        task_name, variation = self._task_key(task)
        self._task = None
        self._load(task_name, variation, gold=False)
        if self.fast:

            def fn(e: Any) -> tuple[str, str, int]:
                e.server.reset()
                look = e.server.step("look around")
                return str(look), str(e.server.freeActionTaskDesc()), int(round(100 * e.server.getScore()))

            look, desc, score = self._call("reset", fn)
        else:

            def stock(e: Any) -> tuple[str, str, int]:
                look, info = e.reset()
                return str(look), str(info["taskDesc"]), int(info["score"])

            look, desc, score = self._call("reset", stock)
        goal = re.sub(r"^Task Description:\s*", "", desc.strip(), flags=re.IGNORECASE)
        self._task = task
        self._score = score
        self._best = 0  # like rollout's final_reward(scores, "max"): only scores after steps count
        info = {
            "goal": goal,
            "task_type": task.task_type,
            "score": score / 100.0,
            "max_score": self._best / 100.0,
            "success": False,
            "won": False,
            "failure": False,
            "moves": 0,
        }
        return f"{goal}\n{look.strip()}", info

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One command; reward is the score change / 100; done on completion, a failed focus or the move limit."""
        if self._task is None:
            raise ConfigError("ScienceWorldEnv.step() called before reset(task)")
        # The simulator trims ordinary commands itself but not menu answers ('0 ' is rejected), so trim here.
        action = action.strip()
        obs, score, done, moves = self._raw_step(action)
        extra: dict[str, Any] = {}
        if self.auto_disambiguate and obs.startswith(AMBIGUOUS_PREFIX):
            # Answer the menu with option 0 in the same agent step, as every gold path does (see
            # docs/envs/scienceworld.md for why 0 and not, say, the alphabetically first option).
            options = parse_menu(obs)
            extra = {"ambiguous_options": options, "auto_choice": options[0] if options else ""}
            obs, score, done, moves = self._raw_step("0")
        reward = (score - self._score) / 100.0
        self._score = score
        self._best = max(self._best, score)
        success = bool(done and score >= 100)
        info = {
            "score": score / 100.0,
            "max_score": self._best / 100.0,
            "success": success,
            "won": success,
            "failure": score < 0,
            "moves": moves,
            **extra,
        }
        return obs.strip(), reward, done, info

    def valid_actions(self) -> list[str]:
        """The simulator's concrete valid actions in the current state (slow: ~50-100 ms, hundreds of strings)."""
        return [str(a) for a in self._call("valid_actions", lambda e: e.server.getValidActionObjectCombinations())]

    def expert(self, task: Task) -> list[str] | None:
        """The simulator's gold actions, cut after the step that completes the task (None if the gold path fails).

        Replays the gold path once on the raw server to find where the task completes, then keeps the `wait`/`wait1`
        actions that directly follow: the simulator's update order varies between episodes, so e.g. a circuit may
        light up one tick later on the next replay. With auto_disambiguate the gold's menu answers (always '0' in
        the gold paths we checked) are dropped, since step() answers menus with 0 itself.
        """
        task_name, variation = self._task_key(task)
        self._task = None
        self._load(task_name, variation, gold=True)

        def replay(e: Any) -> tuple[list[str], bool]:
            # Mirrors step(): with auto_disambiguate every menu is answered with 0 on the spot and the gold's own
            # answers are dropped (a replay can meet a menu the gold path did not, or miss one it did).
            server = e.server
            server.reset()
            server.step("look around")
            gold = [str(a) for a in server.getGoldActionSequence()]
            kept: list[str] = []
            for i, action in enumerate(gold):
                if self.auto_disambiguate and action.strip().isdigit():
                    continue
                kept.append(action)
                obs = str(server.step(action.strip()))
                if obs.startswith(AMBIGUOUS_PREFIX):
                    if not self.auto_disambiguate:
                        continue  # the gold's next action answers it
                    server.step("0")
                score = int(round(100 * server.getScore()))
                if score < 0:
                    return kept, False
                if server.getCompleted():
                    for extra in gold[i + 1 :]:
                        if extra.strip() not in ("wait", "wait1"):
                            break
                        kept.append(extra)
                    return kept, score >= 100
            return kept, False

        kept, ok = self._call("expert", replay)
        if not ok:
            logger.warning("ScienceWorld gold path for %s did not complete the task; no expert demo", task.task_id)
            return None
        return kept

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid (unknown input, impossible action, ambiguity menu) / repeat (unchanged observation) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        parts = self.simplification.split(",")
        text = _INSTRUCTION_HEAD
        if "easy" in parts or "teleportAction" in parts:
            text += _INSTRUCTION_TELEPORT
        text += _INSTRUCTION_TAIL
        if not self.auto_disambiguate:
            text += _INSTRUCTION_MENU
        return text
