"""The TextEnv contract: tasks, splits, reset/step, expert demos and step signals."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "dev", "test")

# Step signals used by Q-Evolve's retrospective labels (precedence: format > invalid > repeat > none).
SIGNAL_FORMAT = "format"
SIGNAL_INVALID = "invalid"
SIGNAL_REPEAT = "repeat"
SIGNAL_NONE = "none"
SIGNALS = (SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_REPEAT, SIGNAL_NONE)


@dataclass(frozen=True)
class Task:
    """One episode specification: which environment, which split, and the parameters that fix the episode."""

    env: str
    task_id: str
    split: str
    task_type: str
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    max_steps: int = 50

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON / SQLite storage."""
        return {
            "env": self.env,
            "task_id": self.task_id,
            "split": self.split,
            "task_type": self.task_type,
            "params": self.params,
            "max_steps": self.max_steps,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        """Inverse of to_dict."""
        return cls(
            env=d["env"],
            task_id=d["task_id"],
            split=d["split"],
            task_type=d["task_type"],
            params=dict(d.get("params", {})),
            max_steps=int(d.get("max_steps", 50)),
        )


@dataclass(frozen=True)
class TaskList:
    """A fixed, ordered task list; its hash goes into every report so 'which tasks were run' is never a question."""

    env: str
    split: str
    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    @property
    def hash(self) -> str:
        """Short SHA-256 over the ordered task ids and parameters."""
        payload = json.dumps([t.to_dict() for t in self.tasks], sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def head(self, n: int | None) -> TaskList:
        """The first n tasks (all when n is None); order is fixed, so the result is fixed too."""
        if n is None or n >= len(self.tasks):
            return self
        return TaskList(self.env, self.split, self.tasks[:n])

    def sample(self, n: int, rng: random.Random) -> TaskList:
        """n tasks drawn by `sample_tasks` (stratified by task type); the result has its own hash."""
        return TaskList(self.env, self.split, tuple(sample_tasks(self.tasks, n, rng)))


def sample_tasks(tasks: Sequence[Task], n: int, rng: random.Random) -> list[Task]:
    """n tasks stratified by task type (round-robin over shuffled types); all tasks, in order, when n >= len."""
    if n >= len(tasks):
        return list(tasks)
    by_type: dict[str, list[Task]] = {}
    for t in tasks:
        by_type.setdefault(t.task_type, []).append(t)
    for group in by_type.values():
        rng.shuffle(group)
    out: list[Task] = []
    while len(out) < n:
        for group in by_type.values():
            if group and len(out) < n:
                out.append(group.pop())
    return out


def normalise_observation(text: str) -> str:
    """Strip an 'Observation:' prefix and collapse whitespace, for repeat detection."""
    text = text.strip()
    if text.startswith("Observation:"):
        text = text[len("Observation:") :]
    return re.sub(r"\s+", " ", text).strip()


def classify_signal(
    prev_obs: str,
    next_obs: str,
    parse_ok: bool,
    invalid_patterns: tuple[str, ...],
) -> str:
    """Q-Evolve's rule: format error > invalid action (env string) > repeat (observation unchanged) > none."""
    if not parse_ok:
        return SIGNAL_FORMAT
    stripped = next_obs.strip()
    if any(stripped.startswith(p) for p in invalid_patterns):
        return SIGNAL_INVALID
    if normalise_observation(prev_obs) == normalise_observation(next_obs):
        return SIGNAL_REPEAT
    return SIGNAL_NONE


@runtime_checkable
class TextEnv(Protocol):
    """A text environment. One instance plays one episode at a time; worker pools hold many instances.

    Conventions:
    - reset(task) -> (observation, info); info has "goal" (the task description) and "task_type".
    - step(action) -> (observation, reward, done, info); info has "score" in [0, 1] (the env's current
      normalised score), "success" (bool), and "won" where the env defines it.
    - final_reward_mode: "last" (trajectory reward = last score) or "max" (highest score reached).
    """

    name: str
    final_reward_mode: str

    def tasks(self, split: str) -> TaskList: ...

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...

    def expert(self, task: Task) -> list[str] | None: ...

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str: ...

    def instruction(self) -> str: ...

    def close(self) -> None: ...
