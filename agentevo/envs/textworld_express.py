"""TextWorldExpress (CookingWorld, TWC) behind the TextEnv contract; one JVM per env instance."""

from __future__ import annotations

import threading
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.envs.java import bounded_jvm, jvm_process, quiet_when_half_built, require_java, shutdown_jvm
from agentevo.errors import ConfigError, EnvCrashedError, MissingDependencyError

INVALID_PATTERNS = (
    "Unknown action",
    "You can't move there",
)

_FOLD_SEEDS = {"train": "getValidSeedsTrain", "dev": "getValidSeedsDev", "test": "getValidSeedsTest"}
_SEED_CACHE: dict[tuple[str, str, str], tuple[int, ...]] = {}
_SEED_LOCK = threading.Lock()

INSTRUCTION = (
    "You are an agent in a text-based household game. Each turn you read an observation and reply with "
    "one line 'Thought: <your reasoning>' and one line 'Action: <a command>'. Commands look like: "
    "look around, inventory, take <object>, put <object> in/on <container>, open/close <container>, "
    "move <direction>, read <object>, slice/dice/chop <food>, cook <food> in <appliance>, "
    "prepare meal, eat meal."
)


def _import_twx() -> Any:
    try:
        from textworld_express import TextWorldExpressEnv
    except ImportError as exc:
        raise MissingDependencyError(
            "TextWorldExpress is not installed; install it with `pip install 'agentevo[twx]'` "
            "(or `pip install textworld-express`)"
        ) from exc
    return quiet_when_half_built(TextWorldExpressEnv)


class _TWXBase:
    """Shared TextWorldExpress wrapper; subclasses fix the game and its default parameters."""

    game: str = ""
    default_params: dict[str, int] = {}
    final_reward_mode = "last"

    def __init__(
        self,
        game_params: dict[str, int] | None = None,
        max_steps: int = 20,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        jvm_heap_mb: int = 256,
    ) -> None:
        params = dict(self.default_params)
        for key in game_params or {}:
            if key not in params:
                raise ConfigError(
                    f"unknown {self.game} game parameter {key!r}; allowed: {', '.join(sorted(params))}"
                )
        params.update(game_params or {})
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (got {max_steps})")
        self.name = f"twx-{self.game}"
        self.params = params
        self.param_string = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        self.max_steps = max_steps
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self.jvm_heap_mb = jvm_heap_mb
        self._env: Any = None
        self._task: Task | None = None

    # -- process management ------------------------------------------------------------------
    def _jvm(self) -> Any:
        if self._env is None:
            require_java(self.name)
            cls = _import_twx()
            with bounded_jvm(self.jvm_heap_mb):
                self._env = cls(envStepLimit=self.max_steps + 10)
            self._env.load(gameName=self.game, gameParams=self.param_string)
        return self._env

    def close(self, crashed: bool = False) -> None:
        """Shut the JVM down (killed if it does not exit; a dead one's bridge is not dialled again; crashed: kill it
        without asking, see shutdown_jvm)."""
        env, self._env = self._env, None
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

    # -- contract ------------------------------------------------------------------------------
    def tasks(self, split: str) -> TaskList:
        """Seeds of the game fold for this split, in the simulator's order, first n_<split> of them."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        key = (self.game, self.param_string, split)
        with _SEED_LOCK:
            if key not in _SEED_CACHE:
                _SEED_CACHE[key] = tuple(int(s) for s in getattr(self._jvm(), _FOLD_SEEDS[split])())
        seeds = _SEED_CACHE[key]
        limit = self.limits[split]
        if limit is not None:
            seeds = seeds[:limit]
        tasks = tuple(
            Task(
                env=self.name,
                task_id=f"{self.name}/{split}/{seed}",
                split=split,
                task_type=self.game,
                params={"seed": seed, "fold": split, "game_params": self.param_string},
                max_steps=self.max_steps,
            )
            for seed in seeds
        )
        return TaskList(self.name, split, tasks)

    def _call(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._jvm(), fn)(*args, **kwargs)
        except (ConfigError, MissingDependencyError):
            raise
        except Exception as exc:  # py4j raises several types when the JVM is gone
            self.restart()
            raise EnvCrashedError(f"{self.name}: JVM call {fn} failed ({exc.__class__.__name__}: {exc})") from exc

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start the task's episode; the first observation starts with the task description."""
        self._task = task
        obs, info = self._call("reset", seed=int(task.params["seed"]), gameFold=task.params["fold"],
                               generateGoldPath=False)
        goal = info["taskDescription"].strip()
        return f"{goal}\n{obs.strip()}", {"goal": goal, "task_type": task.task_type, "score": 0.0,
                                          "success": False, "won": False}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One command; done on task success or failure."""
        obs, reward, done, info = self._call("step", action)
        success = bool(info["tasksuccess"])
        failure = bool(info["taskfailure"])
        out = {
            "score": float(info["score"]),
            "success": success,
            "won": success,
            "failure": failure,
            "valid_actions": list(info.get("validActions", [])),
        }
        return obs.strip(), float(reward), bool(success or failure or done), out

    def expert(self, task: Task) -> list[str]:
        """The simulator's gold action sequence (its leading 'look around' dropped: reset already shows it)."""
        self._call("reset", seed=int(task.params["seed"]), gameFold=task.params["fold"], generateGoldPath=True)
        gold = [str(a) for a in self._call("getGoldActionSequence")]
        if gold and gold[0] == "look around":
            gold = gold[1:]
        return gold

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid ("Unknown action...") / repeat (unchanged observation) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        return INSTRUCTION


class CookingWorldEnv(_TWXBase):
    """CookingWorld; the defaults give one room, two ingredients and about 13 gold steps."""

    game = "cookingworld"
    default_params = {
        "numLocations": 1,
        "numIngredients": 2,
        "numDistractorItems": 2,
        "includeDoors": 0,
        "limitInventorySize": 0,
    }


class TWCEnv(_TWXBase):
    """TextWorld Commonsense; the defaults give one room, two items and about 6 gold steps."""

    game = "twc"
    default_params = {
        "numLocations": 1,
        "numItemsToPutAway": 2,
        "includeDoors": 0,
        "limitInventorySize": 0,
    }
