"""Gymnasium-style adapters for text environments, both ways (gymnasium itself is not needed).

GymTextEnv wraps an env with reset(seed=, options=) -> (obs, info) and step(action) -> (obs, reward, terminated,
truncated, info) whose actions and observations are text, into agentevo's TextEnv: task k of a split is the episode
reset with a fixed seed, so task lists are fixed and hashable like every other env's. TextGymEnv goes the other way:
any TextEnv (built-in or plug-in) behind the gymnasium API, for code written against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, TextEnv, classify_signal
from agentevo.errors import AgentevoError, ConfigError

# Seeds of split k start here, so train / dev / test episodes never share a seed.
SPLIT_SEED_BASE = {"train": 0, "dev": 1_000_000, "test": 2_000_000}
_DEFAULT_SIZES = {"train": 100, "dev": 20, "test": 50}


class GymTextEnv:
    """A gymnasium-like text env as a TextEnv.

    - reset(task) calls env.reset(seed=task's seed, options=options); info["goal"] (if any) is the task's goal.
    - step(action) maps (terminated or truncated) to done; info["score"] is the env's own score if it reports one,
      else the return so far; success is info["success"] (or "is_success"), else terminated with a positive return.
    - expert(task) calls `expert_fn(task)` when given (a list of actions), else None (no demos: BC needs them).
    """

    def __init__(
        self,
        make: Callable[[], Any],
        name: str,
        instruction: str,
        max_steps: int = 50,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        options: dict[str, Any] | None = None,
        expert_fn: Callable[[Task], list[str] | None] | None = None,
        invalid_patterns: tuple[str, ...] = (),
        final_reward_mode: str = "last",
        task_type: str | None = None,
    ) -> None:
        if final_reward_mode not in ("last", "max"):
            raise ConfigError(f"{name}: final_reward_mode must be 'last' or 'max' (got {final_reward_mode!r})")
        self.name, self._instruction, self.max_steps = name, instruction, max_steps
        self.final_reward_mode = final_reward_mode
        self.sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        self.options, self.expert_fn = dict(options or {}), expert_fn
        self.invalid_patterns, self.task_type = tuple(invalid_patterns), task_type or name
        self._make = make
        self._env: Any = None
        self._return = 0.0

    def tasks(self, split: str) -> TaskList:
        """Task k of a split = the episode reset with seed SPLIT_SEED_BASE[split] + k."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        n = self.sizes[split] or _DEFAULT_SIZES[split]
        return TaskList(self.name, split, tuple(
            Task(self.name, f"{self.name}/{split}/{k}", split, self.task_type,
                 {"seed": SPLIT_SEED_BASE[split] + k, "options": self.options}, self.max_steps)
            for k in range(n)))

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Reset the wrapped env with the task's seed and options."""
        if self._env is None:
            self._env = self._make()
        obs, info = self._env.reset(seed=task.params.get("seed"), options=task.params.get("options") or None)
        self._return = 0.0
        return str(obs), {**dict(info or {}), "goal": str((info or {}).get("goal", "")), "task_type": task.task_type}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One action: (observation, reward, terminated or truncated, info with score and success)."""
        if self._env is None:
            raise AgentevoError(f"{self.name}: step() before reset()")
        obs, reward, terminated, truncated, info = self._env.step(action)
        info = dict(info or {})
        self._return += float(reward)
        success = info.get("success", info.get("is_success", bool(terminated) and self._return > 0))
        out = {**info, "score": float(info.get("score", self._return)), "success": bool(success),
               "terminated": bool(terminated), "truncated": bool(truncated)}
        return str(obs), float(reward), bool(terminated or truncated), out

    def expert(self, task: Task) -> list[str] | None:
        """The gold action sequence from expert_fn, if one was given."""
        return None if self.expert_fn is None else self.expert_fn(task)

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid (invalid_patterns) / repeat / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, self.invalid_patterns)

    def instruction(self) -> str:
        """The instruction shown at the top of every prompt."""
        return self._instruction

    def close(self) -> None:
        """Close the wrapped env (if it has close())."""
        if self._env is not None and hasattr(self._env, "close"):
            self._env.close()
        self._env = None


class TextGymEnv:
    """A TextEnv behind the gymnasium API: reset(seed, options) -> (obs, info), step(a) -> 5-tuple.

    reset picks the task options["task"] (a Task), else options["task_index"], else the seed (mod the split's
    size), else the next task in order. An episode that reaches the task's max_steps without ending is truncated.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    render_mode = None

    def __init__(self, env: TextEnv, split: str = "train") -> None:
        self.env, self.split = env, split
        self.task_list = env.tasks(split)
        self._next, self._t = 0, 0
        self.task: Task | None = None

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start the chosen task's episode."""
        options = options or {}
        if isinstance(options.get("task"), Task):
            task = options["task"]
        else:
            index = options.get("task_index", seed if seed is not None else self._next)
            if not len(self.task_list):
                raise AgentevoError(f"{self.env.name} has no {self.split} tasks")
            task = self.task_list[int(index) % len(self.task_list)]
            self._next = int(index) + 1
        self.task, self._t = task, 0
        obs, info = self.env.reset(task)
        return obs, {**info, "task_id": task.task_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """(observation, reward, terminated, truncated, info)."""
        if self.task is None:
            raise AgentevoError(f"{self.env.name}: step() before reset()")
        obs, reward, done, info = self.env.step(action)
        self._t += 1
        truncated = not done and self._t >= self.task.max_steps
        return obs, reward, bool(done), truncated, info

    def close(self) -> None:
        """Close the wrapped TextEnv."""
        self.env.close()
