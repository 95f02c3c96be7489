"""ALFWorld text games behind the TextEnv contract: real data via ALFWORLD_DATA, or games generated from the wheel.

Both sources use one on-disk layout (`json_2.1.1/<split>/<task dir>/<trial>/{game.tw-pddl, traj_data.json}`) and
one loader: ALFWorld's own TextWorld machinery (`textworld.gym.register_games` with the `AlfredDemangler` and
`AlfredInfos` wrappers over TextWorld's `PddlEnv`), so observations, command grammar, admissible commands and
"Nothing happens." are ALFWorld's.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from agentevo.envs import alfworld_gen
from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.errors import AgentevoError, ConfigError, EnvCrashedError, MissingDependencyError

log = logging.getLogger(__name__)

INVALID_PATTERNS = ("Nothing happens.",)
TASK_TYPES = alfworld_gen.TASK_TYPES
# agentevo split -> directory of the real data (ETO: dev = valid_seen "in distribution", test = valid_unseen).
SPLIT_DIRS = {"train": "train", "dev": "valid_seen", "test": "valid_unseen"}

INSTRUCTION = (
    "Interact with a household to solve a task. Imagine you are an intelligent agent in a household environment "
    "and your target is to perform actions to complete the task goal. At the beginning of your interactions, you "
    "will be given the detailed description of the current environment and your goal to accomplish.\n"
    "For each of your turn, you will be given the observation of the last turn. You should first think about the "
    "current condition and plan for your future actions, and then output your action in this turn.\n\n"
    "The available actions are:\n"
    "1. go to {recep}\n"
    "2. take {obj} from {recep}\n"
    "3. move {obj} to {recep}\n"
    "4. open {recep}\n"
    "5. close {recep}\n"
    "6. use {obj}\n"
    "7. clean {obj} with {recep}\n"
    "8. heat {obj} with {recep}\n"
    "9. cool {obj} with {recep}\n"
    "10. examine {obj} / examine {recep}, look, inventory\n"
    "where {obj} and {recep} correspond to objects and receptacles, written with their number (e.g. cabinet 2).\n"
    "After each turn, the environment gives you immediate feedback on which you plan your next steps. If the "
    'environment outputs "Nothing happens.", the previous action was invalid and you should try other options.\n\n'
    "Your response should use the following format:\n\n"
    "Thought: <your thoughts>\n"
    "Action: <your next action>"
)

_INSTALL = alfworld_gen.INSTALL_HINT
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
# ETO strips "You arrive at loc 12. " (old grammar); the wheel's grammar says "You arrive at cabinet 2. " instead.
# Either way the next sentence names the receptacle again, so dropping the prefix loses nothing.
_ARRIVE = re.compile(r"^You arrive at (?:loc \d+|[a-z]+ \d+)\. ")
_GOAL = re.compile(r"Your task is to: (.*)", re.DOTALL)
# Where `alfworld-download` puts the data by default (importing alfworld also sets ALFWORLD_DATA to this).
_DEFAULT_ALFWORLD_DATA = os.path.expanduser("~/.cache/alfworld")

# TextWorld is not thread-safe: pddl2sas swaps sys.argv / sys.stdout, fast-downward's translator keeps module-level
# options, and steps of two instances in two threads raised IndexError inside TextWorld. Every call into TextWorld
# (load, reset, step, plan, close) holds this lock; threads add no speed here anyway (the work is Python under the
# GIL), so parallel ALFWorld rollouts use rollout.workers = process.
_TW_LOCK = threading.RLock()


def _import_textworld() -> dict[str, Any]:
    """TextWorld's gym API and ALFWorld's wrappers, or MissingDependencyError naming the install command."""
    try:
        import textworld
        import textworld.gym
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.core import Wrapper
    except ImportError as exc:
        raise MissingDependencyError(f"ALFWorld is not installed; {_INSTALL}") from exc
    return {
        "textworld": textworld,
        "gym": textworld.gym,
        "AlfredDemangler": AlfredDemangler,
        "AlfredInfos": AlfredInfos,
        "Wrapper": Wrapper,
    }


# ----------------------------------------------------------------------------------------------------------
# Speed-ups. PddlEnv re-derives every admissible command through its text grammar after every step; each derive
# re-parses the same template / condition strings with tatsu (~3 ms each, ~100 per step in a kitchen), and each
# load + reset translates the same PDDL twice over. All three are pure functions of their input text, so caching
# them changes no output (tests compare both paths) but makes steps ~10x and re-resets ~2-4x faster.
# ----------------------------------------------------------------------------------------------------------

_SPEEDUPS: dict[str, Any] = {}
_SAS_CACHE_SIZE = 8


def install_speedups() -> None:
    """Memoise TextWorld's grammar / query parsing and fast-downward's PDDL->SAS translation (idempotent)."""
    with _TW_LOCK:
        if _SPEEDUPS:
            return
        import fast_downward
        import textworld.envs.pddl.textgen as textgen
        from textworld.logic import Rule

        parse_orig = textgen._parse_and_convert
        query_orig = Rule.__dict__["parse_conjunctive_query"]
        sas_orig = fast_downward.pddl2sas
        parsed: dict[Any, Any] = {}
        queries: dict[str, Any] = {}
        translations: OrderedDict[Any, Any] = OrderedDict()

        def parse_cached(*args: Any, **kwargs: Any) -> Any:
            key = (args, tuple(sorted(kwargs.items())))
            if key not in parsed:
                parsed[key] = parse_orig(*args, **kwargs)
            return copy.deepcopy(parsed[key])  # derivation mutates symbols: hand out a fresh copy

        def query_cached(cls: Any, expression: str) -> Any:
            if expression not in queries:
                queries[expression] = query_orig.__func__(cls, expression)
            return queries[expression]  # Rule objects are only read by State.all_assignments

        def sas_cached(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
            key = (hash(domain), hash(problem), len(problem), verbose, optimize)
            if key in translations:
                translations.move_to_end(key)
                return translations[key]
            out = sas_orig(domain, problem, verbose=verbose, optimize=optimize)
            translations[key] = out
            while len(translations) > _SAS_CACHE_SIZE:
                translations.popitem(last=False)
            return out

        textgen._parse_and_convert = parse_cached
        Rule.parse_conjunctive_query = classmethod(query_cached)
        fast_downward.pddl2sas = sas_cached
        _SPEEDUPS.update(parse=(textgen, parse_orig), query=(Rule, query_orig), sas=(fast_downward, sas_orig))


def uninstall_speedups() -> None:
    """Restore TextWorld's and fast-downward's original functions (tests compare both paths)."""
    with _TW_LOCK:
        if not _SPEEDUPS:
            return
        textgen, parse_orig = _SPEEDUPS["parse"]
        rule_cls, query_orig = _SPEEDUPS["query"]
        fd, sas_orig = _SPEEDUPS["sas"]
        textgen._parse_and_convert = parse_orig
        rule_cls.parse_conjunctive_query = query_orig
        fd.pddl2sas = sas_orig
        _SPEEDUPS.clear()


def _memoise_commands(pddl_env: Any) -> None:
    """Cache the derived text of each admissible command of the loaded game (its templates read only names and
    static facts such as receptacleAtLocation, so an operator's command never changes within a game)."""
    grammar = pddl_env._logic.grammar
    templates = {action.template for action in pddl_env._logic.actions.values()}
    derive = grammar.derive
    memo: dict[Any, str] = {}

    def derive_memo(start: str, context: dict[str, Any] | None = None) -> str:
        context = context if context is not None else {}
        if start not in templates:
            return derive(start, context)  # feedback text depends on the state: never cached
        key = (start, tuple(sorted((ph.name, var.name) for ph, var in context.get("mapping", {}).items())))
        if key not in memo:
            memo[key] = derive(start, context)
        return memo[key]

    grammar.derive = derive_memo


# ----------------------------------------------------------------------------------------------------------
# Game runner: one TextWorld gym env (one PddlEnv, one copy of libdownward) that loads game after game.
# ----------------------------------------------------------------------------------------------------------


class _GameRunner:
    """Plays .tw-pddl games through `textworld.gym.register_games` + AlfredDemangler + AlfredInfos."""

    def __init__(self, max_steps: int, walkthrough: bool = False, fast: bool = True) -> None:
        self.max_steps = max_steps
        self.walkthrough = walkthrough
        self.fast = fast
        self._gym: Any = None
        self._loaded: str | None = None

    def _make(self, gamefile: str) -> Any:
        tw = _import_textworld()
        extras = ["gamefile"] + (["walkthrough"] if self.walkthrough else [])
        # admissible_commands costs nothing extra: PddlEnv computes them every step anyway (it matches the typed
        # command against them); only the walkthrough (a planner call at reset) is worth leaving out.
        infos = tw["textworld"].EnvInfos(won=True, admissible_commands=True, extras=extras)
        env_id = tw["gym"].register_games(
            [gamefile],
            infos,
            max_episode_steps=self.max_steps,
            asynchronous=False,
            wrappers=[tw["AlfredDemangler"](), tw["AlfredInfos"]],
        )
        env = tw["gym"].make(env_id)
        tw["gym"].registry.pop(env_id, None)  # one registration per runner; keep the global registry small
        return env

    def _pddl_env(self) -> Any:
        wrapper = _import_textworld()["Wrapper"]
        env = self._gym.batch_env.envs[0]
        while isinstance(env, wrapper):
            env = env._wrapped_env
        return env

    def reset(self, gamefile: str) -> tuple[str, dict[str, Any]]:
        """Load the game (unless it is the one loaded) and start a fresh episode."""
        with _TW_LOCK:
            if self.fast:
                install_speedups()
            if self._gym is None:
                idle = _IDLE_GYMS.get(self._settings())
                self._gym = idle.pop() if idle else self._make(gamefile)
            if self._loaded != gamefile:
                self._loaded = None
                self._gym.batch_env.load([gamefile])  # same as gym reset() does, minus re-loading a loaded game
                if self.fast:
                    _memoise_commands(self._pddl_env())
                self._loaded = gamefile
            obs, infos = self._gym.batch_env.reset()
        self._gym.last_commands = [None]
        return obs[0], {k: v[0] for k, v in infos.items()}

    def step(self, command: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One command through the gym env."""
        with _TW_LOCK:
            return self._gym.step(command)

    def close(self, reuse: bool = True) -> None:
        """Release the TextWorld env. Its copy of libdownward is never unloaded: every copy shares fast-downward's
        plugin registry (a GNU-unique symbol, options::RawRegistry::instance), so dlclose-ing the copy that owns it
        made the next load segfault. A healthy env is parked for the next runner with the same settings instead;
        one that raised (reuse=False) is dropped, its library left mapped."""
        with _TW_LOCK:
            if self._gym is None:
                return
            if reuse:
                _IDLE_GYMS.setdefault(self._settings(), []).append(self._gym)
            self._gym = None
            self._loaded = None

    def _settings(self) -> tuple[int, bool, bool]:
        return (self.max_steps, self.walkthrough, self.fast)


# Closed, healthy TextWorld envs by (max_steps, walkthrough, fast), reused by the next runner (see _GameRunner.close).
_IDLE_GYMS: dict[tuple[int, bool, bool], list[Any]] = {}


_CHECKER: dict[str, _GameRunner] = {}


def replay_walkthrough(gamefile: Path | str, planfile: Path | str | None = None, max_steps: int = 100) -> list[str]:
    """The planner's walkthrough (of planfile, default gamefile) if replaying it in gamefile wins, else []."""
    with _TW_LOCK:
        planner = _CHECKER.setdefault("planner", _GameRunner(max_steps, walkthrough=True))
        player = _CHECKER.setdefault("player", _GameRunner(max_steps))
        try:
            _, info = planner.reset(str(planfile or gamefile))
            walkthrough = [str(c) for c in info.get("extra.walkthrough") or []]
            won = False
            if walkthrough:
                player.reset(str(gamefile))
                for command in walkthrough:
                    _, _, done, info = player.step(command)
                    won = bool(info.get("won"))
                    if done:
                        break
        finally:
            planner._loaded = player._loaded = None  # checked files are temporary, retries reuse names: reload
        return walkthrough if won else []


# ----------------------------------------------------------------------------------------------------------
# Data layout
# ----------------------------------------------------------------------------------------------------------


def json_root(path: Path | str) -> Path | None:
    """The json_2.1.1 directory under (or at) a data path, if it holds any split directory."""
    path = Path(path).expanduser()
    for candidate in (path / "json_2.1.1", path):
        if any((candidate / d).is_dir() for d in alfworld_gen.DATA_SPLITS):
            return candidate
    return None


_LISTINGS: dict[tuple[str, str, int], list[tuple[str, str]]] = {}


def list_games(root: Path, split_dir: str) -> list[tuple[str, str]]:
    """(game path relative to root, task type) of every playable game of a split, in sorted path order.

    Same filter as ALFWorld's AlfredTWEnv (skips movable-receptacle and sliced trials, unsolvable games and
    other task types), but sorted, so the order never depends on the file system. Cached per process (reading
    every game file of the real train split takes a while) until the split directory changes."""
    base = root / split_dir
    if not base.is_dir():
        return []
    key = (str(base.resolve()), split_dir, base.stat().st_mtime_ns)
    if key not in _LISTINGS:
        _LISTINGS[key] = _scan_games(root, split_dir)
    return list(_LISTINGS[key])


def _scan_games(root: Path, split_dir: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    base = root / split_dir
    for traj in sorted(base.glob("*/*/traj_data.json"), key=lambda p: p.relative_to(root).as_posix()):
        trial = traj.parent
        rel = trial.relative_to(root).as_posix()
        if "movable" in rel or "Sliced" in rel:
            continue
        game = trial / "game.tw-pddl"
        if not game.exists():
            continue
        task_type = json.loads(traj.read_text()).get("task_type")
        if task_type not in TASK_TYPES:
            continue
        with game.open() as f:
            if not json.load(f).get("solvable"):
                continue
        out.append((f"{rel}/game.tw-pddl", task_type))
    return out


def normalise_observation(obs: str) -> str:
    """ETO's observation clean-up: strip the welcome banner and a leading 'You arrive at ...' sentence."""
    obs = obs.strip()
    if obs.startswith(_BANNER):
        obs = obs[len(_BANNER) :].strip()
    rest = _ARRIVE.sub("", obs, count=1)
    return rest if rest.strip() else obs


# ----------------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------------


class ALFWorldEnv:
    """ALFWorld; real games from ALFWORLD_DATA / data_path, or generated ones (see alfworld_gen)."""

    final_reward_mode = "last"

    def __init__(
        self,
        data_path: str | os.PathLike[str] | None = None,
        generated: bool | str = "auto",
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        max_steps: int = 40,
        cache_dir: str | os.PathLike[str] | None = None,
        seed: int = 0,
        fast: bool = True,
        strip_arrive: bool = True,
    ) -> None:
        if generated not in (True, False, "auto"):
            raise ConfigError(f"generated must be True, False or 'auto' (got {generated!r})")
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (got {max_steps})")
        for key, n in (("n_train", n_train), ("n_dev", n_dev), ("n_test", n_test)):
            if n is not None and n < 0:
                raise ConfigError(f"{key} must be >= 0 (got {n})")
        self.name = "alfworld"
        self.max_steps = int(max_steps)
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self.seed = int(seed)
        self.fast = fast
        self.strip_arrive = strip_arrive
        self.source, self.root = self._resolve_source(data_path, generated, cache_dir)
        self._runner = _GameRunner(self.max_steps, fast=fast)
        self._task: Task | None = None
        self._score = 0.0
        self._steps = 0
        self._done = False
        self._last_obs = ""
        self._walkthroughs: dict[str, list[str]] = {}

    def _resolve_source(self, data_path: Any, generated: bool | str, cache_dir: Any) -> tuple[str, Path]:
        """('data', json root) or ('generated', json root of the generator's cache)."""
        if generated is not True:
            env_path = os.environ.get("ALFWORLD_DATA")
            # Same default as `alfworld-download` when neither the argument nor the variable is set.
            path = data_path if data_path is not None else env_path or _DEFAULT_ALFWORLD_DATA
            root = json_root(path)
            if root is not None:
                return "data", root
            if data_path is not None or generated is False:
                raise ConfigError(
                    f"no ALFWorld data under {path}: expected json_2.1.1/{{train,valid_seen,valid_unseen}}/"
                    "<task>/<trial>/{game.tw-pddl,traj_data.json} (set ALFWORLD_DATA or data_path; fetch the data "
                    "with `alfworld-download`), or use generated=True for games generated from the alfworld wheel"
                )
            if env_path and env_path != _DEFAULT_ALFWORLD_DATA:
                log.warning("ALFWORLD_DATA=%s holds no json_2.1.1 games; using generated games instead", env_path)
        cache = Path(cache_dir).expanduser() if cache_dir is not None else alfworld_gen.DEFAULT_CACHE_DIR
        return "generated", cache / f"gen-v{alfworld_gen.GENERATOR_VERSION}-seed{self.seed}" / "json_2.1.1"

    # -- tasks ---------------------------------------------------------------------------------------------
    def tasks(self, split: str) -> TaskList:
        """The split's games in fixed order (sorted paths for real data, spec order for generated ones)."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        split_dir = SPLIT_DIRS[split]
        limit = self.limits[split]
        if self.source == "data":
            games = list_games(self.root, split_dir)
            if limit is not None:
                games = games[:limit]
            params: list[dict[str, Any]] = [{"source": "data", "game": rel} for rel, _ in games]
            types = [task_type for _, task_type in games]
        else:
            n = alfworld_gen.DEFAULT_SIZES[split_dir] if limit is None else limit
            specs = alfworld_gen.plan_split(split_dir, n, self.seed)
            params = [
                {
                    "source": "generated",
                    "game": f"{spec.rel_dir}/game.tw-pddl",
                    "generator_version": alfworld_gen.GENERATOR_VERSION,
                    "seed": self.seed,
                }
                for spec in specs
            ]
            types = [spec.task_type for spec in specs]
        tasks = tuple(
            Task(
                env=self.name,
                task_id=f"alfworld/{split}/{p['game'].split('/', 1)[1].rsplit('/', 1)[0]}",
                split=split,
                task_type=task_type,
                params=p,
                max_steps=self.max_steps,
            )
            for p, task_type in zip(params, types, strict=True)
        )
        return TaskList(self.name, split, tasks)

    def gamefile(self, task: Task) -> Path:
        """The task's game.tw-pddl, generating (and caching) it first for generated tasks."""
        rel = str(task.params["game"])
        path = self.root / rel
        if task.params.get("source") == "generated" and not path.exists():
            spec = self._spec_of(task)
            with _TW_LOCK:  # the planner check shares TextWorld's global state with loading
                alfworld_gen.generate_game(spec, self.root.parent)
        if not path.exists():
            raise ConfigError(f"ALFWorld game file {path} is missing (task {task.task_id})")
        return path

    def _spec_of(self, task: Task) -> alfworld_gen.GameSpec:
        split_dir = SPLIT_DIRS[task.split]
        index = int(str(task.params["game"]).split("/")[2].split("_")[2])
        spec = alfworld_gen.spec_at(split_dir, index, int(task.params.get("seed", self.seed)))
        if f"{spec.rel_dir}/game.tw-pddl" == task.params["game"]:
            return spec
        raise ConfigError(
            f"task {task.task_id} does not match generator version "
            f"{alfworld_gen.GENERATOR_VERSION} with seed {task.params.get('seed')}"
        )

    def prepare(self, split: str) -> list[Path]:
        """Make sure every game of the split exists on disk (generates missing ones); returns their paths."""
        return [self.gamefile(task) for task in self.tasks(split)]

    # -- episode -------------------------------------------------------------------------------------------
    def _normalise(self, obs: str) -> str:
        return normalise_observation(obs) if self.strip_arrive else obs.strip()

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start the task's game; the first observation is the room overview + 'Your task is to: ...'."""
        gamefile = self.gamefile(task)
        try:
            raw, info = self._runner.reset(str(gamefile))
        except AgentevoError:
            raise
        except Exception as exc:  # a broken game file or a TextWorld error: start clean next time
            self._runner.close(reuse=False)
            raise EnvCrashedError(
                f"alfworld: reset of {task.task_id} failed ({exc.__class__.__name__}: {exc})"
            ) from exc
        self._task = task
        self._score = 0.0
        self._steps = 0
        self._done = False
        obs = self._normalise(raw)
        match = _GOAL.search(obs)
        goal = match.group(1).strip() if match else ""
        self._last_obs = obs
        return obs, {
            "goal": goal,
            "task_type": task.task_type,
            "score": 0.0,
            "success": False,
            "won": False,
            "valid_actions": list(info.get("admissible_commands") or []),
        }

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One command; 'Nothing happens.' for anything not admissible; done when won or out of steps."""
        if self._task is None:
            raise ConfigError("call reset(task) before step()")
        if self._done:
            return (
                self._last_obs,
                0.0,
                True,
                {"score": self._score, "success": self._score >= 1.0, "won": self._score >= 1.0, "valid_actions": []},
            )
        try:
            raw, score, done, info = self._runner.step(str(action))
        except Exception as exc:  # noqa: BLE001 - the episode cannot continue; the pool retries it
            self._runner.close(reuse=False)
            self._task = None
            raise EnvCrashedError(f"alfworld: step {action!r} failed ({exc.__class__.__name__}: {exc})") from exc
        self._steps += 1
        won = bool(info.get("won"))
        new_score = 1.0 if won else 0.0
        reward = new_score - self._score
        self._score = new_score
        self._done = bool(done or won or self._steps >= self.max_steps)
        obs = self._normalise(raw)
        self._last_obs = obs
        return (
            obs,
            reward,
            self._done,
            {
                "score": new_score,
                "success": won,
                "won": won,
                "valid_actions": list(info.get("admissible_commands") or []),
            },
        )

    def expert(self, task: Task) -> list[str]:
        """The walkthrough stored in the game file, else the fast-downward plan from the initial state."""
        key = str(task.params["game"])
        if key not in self._walkthroughs:
            gamefile = self.gamefile(task)
            stored = json.loads(gamefile.read_text()).get("walkthrough")
            if stored:
                self._walkthroughs[key] = [str(c) for c in stored]
            else:
                with _TW_LOCK:
                    planner = _GameRunner(self.max_steps, walkthrough=True, fast=self.fast)
                    try:
                        _, info = planner.reset(str(gamefile))
                        self._walkthroughs[key] = [str(c) for c in info.get("extra.walkthrough") or []]
                    finally:
                        planner.close()
        return list(self._walkthroughs[key])

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid ("Nothing happens.") / repeat (unchanged observation) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """ETO-style ALFWorld instruction with this grammar's command templates."""
        return INSTRUCTION

    def close(self) -> None:
        """Release the TextWorld env (parked for reuse; see _GameRunner.close)."""
        self._runner.close()
        self._task = None
