"""The batched rollout engine: many episodes at once, one batched generation per turn across them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentevo.agent.prompt import FORMAT_ERROR_OBSERVATION, HistoryTurn, build_messages, expert_reply, parse_action
from agentevo.data.types import Step, Trajectory, final_reward
from agentevo.envs.base import Task
from agentevo.errors import EnvCrashedError
from agentevo.models.backend import Generation, Sampling

log = logging.getLogger(__name__)


@dataclass
class EpisodeRequest:
    """One episode to play: the task, its slot in its collection (for resume), and optional prompt context."""

    task: Task
    slot: int
    prefix: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """An episode in flight."""

    request: EpisodeRequest
    worker: int
    first_obs: str = ""
    goal: str = ""
    obs: str = ""
    steps: list[Step] = field(default_factory=list)
    history: list[HistoryTurn] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)
    retries: int = 0
    done: bool = False


class Actor(Protocol):
    """Produces one reply per episode in flight."""

    policy_id: str
    source: str

    def act(self, episodes: list[Episode]) -> list[Generation]: ...

    def needs_plan(self) -> bool: ...


class PolicyActor:
    """An LLM policy acting from ReAct prompts with a bounded history window."""

    source = "self"

    def __init__(self, policy: Any, instruction: str, window: int, sampling: Sampling, source: str = "self") -> None:
        self.policy, self.instruction, self.window, self.sampling = policy, instruction, window, sampling
        self.policy_id = policy.policy_id
        self.source = source
        self._calls = 0

    def prompt_ids(self, ep: Episode) -> list[int]:
        """Token ids of the prompt for the episode's next reply (history replies spliced in as stored ids)."""
        messages = build_messages(
            self.instruction, ep.goal, ep.first_obs, ep.history, self.window, prefix=ep.request.prefix
        )
        return self.policy.renderer.render(messages, add_generation_prompt=True).ids

    def act(self, episodes: list[Episode]) -> list[Generation]:
        prompts = [self.prompt_ids(ep) for ep in episodes]
        sampling = self.sampling
        if sampling.seed is not None:
            # A fresh seed per call keeps sampled rollouts reproducible for the same call sequence.
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self._calls)
        self._calls += 1
        return self.policy.generate(prompts, sampling)

    def needs_plan(self) -> bool:
        return False


class ExpertActor:
    """Replays the environment's gold action sequence as ReAct replies (for demos)."""

    source = "expert"
    policy_id = "expert"

    def __init__(self, renderer: Any, thoughts: str = "template") -> None:
        self.renderer, self.thoughts = renderer, thoughts

    def act(self, episodes: list[Episode]) -> list[Generation]:
        gens = []
        for ep in episodes:
            t = len(ep.steps)
            action = ep.plan[t] if t < len(ep.plan) else "look around"
            text = expert_reply(action, self.thoughts)
            gens.append(Generation(self.renderer.encode_reply(text), [], text))
        return gens

    def needs_plan(self) -> bool:
        return True


def run_episodes(
    actor: Actor,
    pool: Any,
    requests: list[EpisodeRequest],
    signal_env: Any,
    on_done: Callable[[EpisodeRequest, Trajectory], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    max_retries: int = 3,
) -> list[Trajectory]:
    """Play every request to the end with up to pool.size episodes in flight; returns trajectories in request order.

    `signal_env` is a local env instance used for its pure parts (signals, final-reward mode, instruction).
    An episode whose env crashes or hangs (the pool's step timeout) is restarted from its reset, up to max_retries
    times; after that it is recorded as an errored episode (no steps, reward 0, meta "error") and the run goes on.
    """
    pending = list(range(len(requests)))[::-1]
    free = list(range(pool.size))[::-1]
    active: list[Episode] = []
    results: list[Trajectory | None] = [None] * len(requests)
    index_of = {id(r): k for k, r in enumerate(requests)}

    def start(episodes: list[Episode]) -> None:
        calls = []
        for ep in episodes:
            if actor.needs_plan():
                calls.append((ep.worker, "expert", (ep.request.task,)))
            calls.append((ep.worker, "reset", (ep.request.task,)))
        answers = iter(pool.map(calls))
        for ep in episodes:
            plan = next(answers) if actor.needs_plan() else []
            reset = next(answers)
            failure = plan if isinstance(plan, Exception) else reset if isinstance(reset, Exception) else None
            if failure is not None:
                retry(ep, failure)
                continue
            ep.plan = list(plan)
            ep.first_obs, info = reset
            ep.obs = ep.first_obs
            ep.goal = str(info.get("goal", ""))
            active.append(ep)

    def retry(ep: Episode, exc: Exception) -> None:
        if not isinstance(exc, EnvCrashedError):
            raise exc
        pool.restart(ep.worker)
        if ep.retries >= max_retries:
            # One broken task must not stop a collection of hundreds: record it and let the run go on.
            log.error("episode %s failed %d times because its environment crashed or hung; recorded as an "
                      "errored episode; last error: %s", ep.request.task.task_id, ep.retries + 1, exc)
            finish(ep, error=str(exc))
            return
        ep.retries += 1
        log.warning("episode %s: environment crashed or hung (%s); retry %d/%d", ep.request.task.task_id, exc,
                    ep.retries, max_retries)
        fresh = Episode(ep.request, ep.worker, retries=ep.retries)
        start([fresh])

    def finish(ep: Episode, error: str | None = None) -> None:
        # An errored episode keeps none of its last attempt's steps: it was never played to its end.
        steps = [] if error is not None else ep.steps
        scores = [s.score for s in steps]
        last_info = steps[-1].info if steps else {}
        meta = {**ep.request.meta, "retries": ep.retries, "prefix": ep.request.prefix}
        if error is not None:
            meta["error"] = error
        traj = Trajectory(
            task=ep.request.task,
            source=actor.source,
            policy_id=actor.policy_id,
            instruction=signal_env.instruction(),
            steps=steps,
            final_reward=final_reward(scores, signal_env.final_reward_mode),
            success=bool(last_info.get("success", False)),
            goal=ep.goal,
            meta=meta,
        )
        k = index_of[id(ep.request)]
        results[k] = traj
        free.append(ep.worker)
        if on_done is not None:
            on_done(ep.request, traj)
        if on_progress is not None:
            on_progress(1)

    while pending or active:
        starting = []
        while pending and free:
            starting.append(Episode(requests[pending.pop()], free.pop()))
        if starting:
            start(starting)
        if not active:
            continue
        current = active[:]
        active.clear()  # retry() appends restarted episodes here while we walk `current`
        gens = actor.act(current)
        calls, parsed = [], []
        for ep, gen in zip(current, gens, strict=True):
            action = parse_action(gen.text)
            parsed.append(action)
            if action is not None:
                calls.append((ep.worker, "step", (action,)))
        answers = iter(pool.map(calls))
        still: list[Episode] = []
        for ep, gen, action in zip(current, gens, parsed, strict=True):
            t = len(ep.steps) + 1
            if action is None:
                next_obs, reward, done, info = FORMAT_ERROR_OBSERVATION, 0.0, False, {
                    "score": ep.steps[-1].score if ep.steps else 0.0, "success": False}
            else:
                answer = next(answers)
                if isinstance(answer, Exception):
                    retry(ep, answer)
                    continue
                next_obs, reward, done, info = answer
            signal = signal_env.signals(ep.obs, action or "", next_obs, action is not None)
            ep.steps.append(
                Step(
                    t=t,
                    obs=ep.obs,
                    action_text=gen.text,
                    action_ids=list(gen.token_ids),
                    logprobs=list(gen.logprobs) if gen.logprobs else None,
                    parsed_action=action,
                    next_obs=next_obs,
                    reward=float(reward),
                    done=bool(done),
                    score=float(info.get("score", 0.0)),
                    signal=signal,
                    info={k: v for k, v in info.items() if k in ("success", "won", "failure")},
                )
            )
            ep.history.append(HistoryTurn(list(gen.token_ids), next_obs))
            ep.obs = next_obs
            if done or t >= ep.request.task.max_steps:
                finish(ep)
            else:
                still.append(ep)
        active[:] = still + active
    return [r for r in results if r is not None]
