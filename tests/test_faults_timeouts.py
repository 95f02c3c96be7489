"""A hung environment cannot hang a run: each worker kind kills it after rollout.step_timeout_s, the episode is
retried on a fresh env, and past max_retries it is recorded as an errored episode while the run goes on."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# Only light imports at the top: worker processes and Ray actors import this module to build HangEnv, and the
# engine (which imports torch) would count against their step timeout.
from agentevo.envs import ENVIRONMENTS
from agentevo.envs.base import Task, TaskList
from agentevo.rollout.workers import ProcessEnvPool, ThreadEnvPool, _descendants, make_pool

HANG_ENV = "hang-test"
MAX_STEPS = 3


class HangEnv:
    """A fake env that hangs on a given step (0 = reset) of a given task, a given number of times in all.

    The number of hangs so far is kept as marker files in `marker_dir`, so it is shared by every instance,
    thread, worker process and Ray actor; a hang blocks on an Event that only close() sets.
    """

    name = HANG_ENV
    final_reward_mode = "last"

    def __init__(self, marker_dir: str = "", hang_at: int = 1, hangs: int = 1, hang_task: int = -1,
                 n_tasks: int = 2, sleep_s: float = 0.0) -> None:
        self.marker_dir, self.hang_at, self.hangs, self.hang_task = marker_dir, hang_at, hangs, hang_task
        self.n_tasks, self.sleep_s = n_tasks, sleep_s
        self._t = 0
        self._task: Task | None = None
        self._release = threading.Event()

    def tasks(self, split: str) -> TaskList:
        return TaskList(HANG_ENV, split, tuple(
            Task(HANG_ENV, f"{HANG_ENV}/{split}/{k}", split, "hang", {"k": k}, MAX_STEPS) for k in range(self.n_tasks)
        ))

    def _claim_hang(self) -> bool:
        if self.hang_task >= 0 and self._task is not None and self._task.params["k"] != self.hang_task:
            return False
        if self.hangs < 0:
            return True
        for n in range(self.hangs):
            try:
                os.close(os.open(os.path.join(self.marker_dir, f"hang{n}"), os.O_CREAT | os.O_EXCL))
                return True
            except FileExistsError:
                continue
        return False

    def _maybe_hang(self) -> None:
        if self._t == self.hang_at and self._claim_hang():
            self._release.wait()

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._task, self._t = task, 0
        time.sleep(self.sleep_s)
        self._maybe_hang()
        return "Observation: room 0", {"goal": f"wait in {task.task_id}"}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._t += 1
        self._maybe_hang()
        return f"Observation: room {self._t}", 0.0, False, {"score": self._t / 10, "success": False}

    def expert(self, task: Task) -> list[str] | None:
        time.sleep(self.sleep_s)
        return ["wait"] * MAX_STEPS

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        return "none"

    def instruction(self) -> str:
        return "Reply with 'Action: wait'."

    def close(self) -> None:
        if self.marker_dir:
            Path(self.marker_dir, f"closed-{os.getpid()}-{id(self)}").touch()
        self._release.set()


class WaitActor:
    """Always replies 'Action: wait' (no model needed)."""

    policy_id, source = "scripted", "self"

    def __init__(self, plan: bool = False) -> None:
        self.plan = plan

    def act(self, episodes: list[Any]) -> list[Any]:
        from agentevo.models.backend import Generation

        return [Generation([1], [], "Action: wait") for _ in episodes]

    def needs_plan(self) -> bool:
        return self.plan


@pytest.fixture()
def hang_env(monkeypatch):  # noqa: ANN201
    """Registers HangEnv as 'hang-test' (worker processes get the entry from their parent)."""
    monkeypatch.setitem(ENVIRONMENTS, HANG_ENV, (HangEnv.__module__, "HangEnv", "a fake env that hangs"))


def _play(pool: Any, n_tasks: int, max_retries: int, actor: Any = None) -> tuple[list[Any], list[Any], float]:
    from agentevo.rollout.engine import EpisodeRequest, run_episodes

    done: list[Any] = []
    tasks = list(HangEnv(n_tasks=n_tasks).tasks("train"))
    t0 = time.monotonic()
    trajs = run_episodes(actor or WaitActor(), pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], HangEnv(),
                         on_done=lambda req, traj: done.append(traj), max_retries=max_retries)
    return trajs, done, time.monotonic() - t0


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not: in a container nobody may reap an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


def _hangs(tmp_path: Path) -> int:
    return len(list(tmp_path.glob("hang*")))


def test_thread_worker_hung_on_a_step_is_abandoned_and_the_episode_retried(hang_env, tmp_path) -> None:  # noqa: ANN001
    params = {"marker_dir": str(tmp_path), "hang_at": 2, "hangs": 1}
    pool = ThreadEnvPool(HANG_ENV, params, 2, step_timeout_s=0.5)
    try:
        trajs, _, elapsed = _play(pool, 2, max_retries=2)
    finally:
        pool.close()
    assert 0.5 <= elapsed < 10  # waited out the timeout once, then went on
    assert _hangs(tmp_path) == 1
    assert [t.length for t in trajs] == [3, 3] and all("error" not in t.meta for t in trajs)
    assert sorted(t.meta["retries"] for t in trajs) == [0, 1]
    # the hung env was closed (in the background), which released its thread
    assert len(list(tmp_path.glob("closed-*"))) >= 1


def test_thread_worker_hung_past_max_retries_is_an_errored_episode_and_the_run_goes_on(hang_env, tmp_path) -> None:  # noqa: ANN001
    params = {"marker_dir": str(tmp_path), "hang_at": 2, "hangs": -1, "hang_task": 0}
    pool = make_pool(HANG_ENV, params, 2, "thread", step_timeout_s=0.3)
    try:
        trajs, done, elapsed = _play(pool, 2, max_retries=1)
    finally:
        pool.close()
    assert elapsed < 10  # two tries of 0.3 s each plus overhead, not forever
    errored, ok = trajs
    assert errored.task.task_id == "hang-test/train/0" and errored.meta["retries"] == 1
    assert errored.meta["error"] == (
        "hang-test worker 0: step gave no answer within rollout.step_timeout_s = 0.3 s; the environment was killed "
        "and is restarted (raise rollout.step_timeout_s if it is just slow)"
    )
    assert errored.steps == [] and errored.final_reward == 0.0 and errored.success is False
    assert "error" not in ok.meta and ok.length == 3 and ok.meta["retries"] == 0
    assert sorted(t.task.task_id for t in done) == ["hang-test/train/0", "hang-test/train/1"]  # both stored
    from agentevo.eval.metrics import summarize

    metrics = summarize([errored, ok])  # the errored episode is a failure, and counted as errored
    assert metrics["errored_episodes"] == 1 and metrics["n"] == 2 and metrics["success_rate"] == ok.success / 2


def test_qlass_guided_copy_hung_in_a_thread_worker_is_replayed(hang_env, tmp_path) -> None:  # noqa: ANN001
    """QLASS plays each candidate in its own replayed copy of the episode; a copy whose env hangs is killed after
    rollout.step_timeout_s and replayed from its reset on a fresh env (before 2026-12-06 it stopped the run)."""
    from types import SimpleNamespace

    from agentevo.algorithms.qlass import q_guided_episodes
    from agentevo.models.backend import Generation, Sampling
    from agentevo.rollout.engine import EpisodeRequest

    class Policy:
        policy_id = "scripted"
        renderer = SimpleNamespace(render=lambda messages, add_generation_prompt: SimpleNamespace(ids=[1, 2]))

        def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
            return [Generation([3], [-0.1], "Action: wait") for _ in prompts]

    params = {"marker_dir": str(tmp_path), "hang_at": 2, "hangs": 1}  # one copy hangs on its second step
    pool = ThreadEnvPool(HANG_ENV, params, 2, step_timeout_s=0.5)
    task = HangEnv().tasks("train")[0]
    t0 = time.monotonic()
    try:
        (traj,) = q_guided_episodes(Policy(), lambda seqs: [0.0] * len(seqs), pool, [EpisodeRequest(task, 0)],
                                    HangEnv(), "Reply.", 2, Sampling(1.0, 1.0, 4, seed=0), 2, True, 64,
                                    max_retries=1)
    finally:
        pool.close()
    assert 0.5 <= time.monotonic() - t0 < 10  # waited out the timeout once, then went on
    assert _hangs(tmp_path) == 1 and "error" not in traj.meta
    assert [s.next_obs for s in traj.steps] == ["Observation: room 1", "Observation: room 2", "Observation: room 3"]


def test_thread_deadline_is_per_call_not_per_batch(hang_env, tmp_path) -> None:  # noqa: ANN001
    # expert + reset take 0.6 s each, 1.2 s together: over a 1 s timeout per batch, within it per call
    params = {"marker_dir": str(tmp_path), "hangs": 0, "sleep_s": 0.6}
    pool = ThreadEnvPool(HANG_ENV, params, 1, step_timeout_s=1.0)
    try:
        trajs, _, _ = _play(pool, 1, max_retries=0, actor=WaitActor(plan=True))
    finally:
        pool.close()
    assert "error" not in trajs[0].meta and trajs[0].length == 3


def test_thread_worker_without_timeout_waits(hang_env, tmp_path) -> None:  # noqa: ANN001
    pool = ThreadEnvPool(HANG_ENV, {"marker_dir": str(tmp_path), "hangs": 0, "sleep_s": 0.3}, 1, step_timeout_s=None)
    try:
        got = pool.map([(0, "reset", (HangEnv().tasks("train")[0],))])
    finally:
        pool.close()
    assert got == [("Observation: room 0", {"goal": "wait in hang-test/train/0"})]


def test_process_worker_hung_on_reset_is_killed_and_the_episode_retried(hang_env, tmp_path) -> None:  # noqa: ANN001
    params = {"marker_dir": str(tmp_path), "hang_at": 0, "hangs": 1, "hang_task": 1}
    pool = ProcessEnvPool(HANG_ENV, params, 2, step_timeout_s=3.0)
    try:
        pool._worker(1)
        first = pool.worker_pid(1)
        trajs, _, elapsed = _play(pool, 2, max_retries=1)
        second = pool.worker_pid(1)
    finally:
        pool.close()
    assert 3.0 <= elapsed < 25
    assert [t.length for t in trajs] == [3, 3] and [t.meta["retries"] for t in trajs] == [0, 1]
    assert second is not None and second != first
    assert not _alive(first)  # type: ignore[arg-type]  # the hung worker is gone, not left behind


def test_process_worker_hung_past_max_retries_is_an_errored_episode(hang_env, tmp_path) -> None:  # noqa: ANN001
    params = {"marker_dir": str(tmp_path), "hang_at": 1, "hangs": -1, "hang_task": 0}
    pool = make_pool(HANG_ENV, params, 1, "process", step_timeout_s=2.0)
    try:
        trajs, done, elapsed = _play(pool, 2, max_retries=1)
    finally:
        pool.close()
    assert elapsed < 30
    assert [t.task.task_id for t in trajs] == ["hang-test/train/0", "hang-test/train/1"]
    assert trajs[0].steps == [] and trajs[0].meta["retries"] == 1
    assert trajs[0].meta["error"].startswith("hang-test worker 0: step gave no answer within rollout.step_timeout_s = 2 s")
    assert trajs[1].length == 3 and "error" not in trajs[1].meta and len(done) == 2


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_sigstopped_twx_jvm_is_killed_and_the_episode_retried(backend: str) -> None:
    """The operator's case: a SIGSTOPped TextWorldExpress JVM is killed (with its worker process), not leaked."""
    from agentevo.envs import make_env
    from agentevo.models.backend import Generation
    from agentevo.rollout.engine import EpisodeRequest, run_episodes

    env = make_env("twx-cookingworld", n_train=2)
    try:
        task = env.tasks("train")[0]
    finally:
        env.close()
    object.__setattr__(task, "max_steps", 2)
    pool = make_pool("twx-cookingworld", {"n_train": 2}, 1, backend, step_timeout_s=3.0)
    stopped: list[int] = []

    class StoppingActor(WaitActor):
        def act(self, episodes: list[Any]) -> list[Any]:
            if not stopped:  # before the first step: freeze the worker's JVM
                if backend == "process":
                    jvms = _descendants(pool.worker_pid(0))
                else:  # in a thread the env object is here: stop the JVM it started
                    jvms = [pool._envs[0].jvm_pid()]
                assert jvms, "the worker has started no JVM"
                for pid in jvms:
                    os.kill(pid, signal.SIGSTOP)
                stopped.extend(jvms)
            return [Generation([1], [], "Action: look around") for _ in episodes]

    t0 = time.monotonic()
    try:
        trajs = run_episodes(StoppingActor(), pool, [EpisodeRequest(task, 0)], env, max_retries=1)
    finally:
        pool.close()
    assert time.monotonic() - t0 < 30
    assert trajs[0].length == 2 and trajs[0].meta["retries"] == 1 and "error" not in trajs[0].meta
    # the stopped JVM was killed (SIGKILL ends a stopped process), not leaked
    assert stopped and not any(_alive(pid) for pid in stopped)


def test_step_timeout_must_be_positive_or_null() -> None:
    from agentevo.config import load_config
    from agentevo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^rollout.step_timeout_s must be > 0 or null \(got 0.0\)$"):
        load_config(overrides=["rollout.step_timeout_s=0"])
    assert load_config(overrides=["rollout.step_timeout_s=null"]).rollout.step_timeout_s is None
    assert load_config().rollout.step_timeout_s == 120.0
