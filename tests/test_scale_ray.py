"""Ray env workers: same trajectories as the thread pool, a killed or hung worker is replaced and its episode replayed.

These run in the default suite (`make test` installs the `ray` extra): one local Ray for the whole module, two CPUs,
no dashboard; starting it is most of the module's time (about 10 s on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agentevo.envs import ENVIRONMENTS
from agentevo.errors import ConfigError, EnvCrashedError, MissingDependencyError
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'agentevo[ray]')")

from agentevo.rollout.ray_pool import RayEnvPool  # noqa: E402

ENV_PARAMS = {"n_train": 8}


@pytest.fixture(scope="module")
def local_ray():  # noqa: ANN201
    """A local Ray with 2 CPUs for this module (started once: Ray takes seconds to come up)."""
    # Ray's worker processes inherit this environment: they import test_faults_timeouts (HangEnv) from tests/.
    old_path = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = here if not old_path else here + os.pathsep + old_path
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 1024**2)
    yield
    ray.shutdown()
    if old_path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_path


def _tasks(env, n: int, max_steps: int):  # noqa: ANN001, ANN202
    tasks = list(env.tasks("train").head(n))
    for t in tasks:
        object.__setattr__(t, "max_steps", max_steps)
    return tasks


def _play(policy, env, tasks, pool):  # noqa: ANN001, ANN202
    actor = PolicyActor(policy, env.instruction(), 10, Sampling(temperature=0.0, max_new_tokens=12))
    return run_episodes(actor, pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], env)


def test_ray_pool_gives_the_thread_pools_trajectories(tiny_policy, twx_env, local_ray) -> None:  # noqa: ANN001
    tasks = _tasks(twx_env, 4, 3)
    threads = make_pool("twx-cookingworld", ENV_PARAMS, 2, "thread")
    try:
        expected = _play(tiny_policy, twx_env, tasks, threads)
    finally:
        threads.close()
    pool = RayEnvPool("twx-cookingworld", ENV_PARAMS, 2)
    try:
        assert pool.num_cpus == 1.0  # 2 CPUs shared by 2 workers
        pids = {pool.worker_pid(0), pool.worker_pid(1)}
        assert len(pids) == 2 and os.getpid() not in pids  # two separate worker processes
        got = _play(tiny_policy, twx_env, tasks, pool)
    finally:
        pool.close()
    assert [t.task.task_id for t in got] == [t.task.task_id for t in expected]
    for a, b in zip(expected, got, strict=True):
        assert a.first_obs == b.first_obs and a.goal == b.goal and a.success == b.success
        assert [(s.action_ids, s.next_obs, s.reward, s.done) for s in a.steps] == \
            [(s.action_ids, s.next_obs, s.reward, s.done) for s in b.steps]


def test_worker_killed_mid_round_is_replaced_and_the_round_completes(tiny_policy, twx_env, local_ray) -> None:  # noqa: ANN001
    tasks = _tasks(twx_env, 4, 3)
    pool = RayEnvPool("twx-cookingworld", ENV_PARAMS, 2)
    calls = {"n": 0}
    victim: dict[str, int] = {}

    class KillingPolicy:
        """Kills worker 1's process before the third generation (mid-episode, mid-round)."""

        renderer, policy_id = tiny_policy.renderer, tiny_policy.policy_id

        def generate(self, prompts, sampling):  # noqa: ANN001, ANN201
            calls["n"] += 1
            if calls["n"] == 3:
                victim["pid"] = pool.worker_pid(1)
                os.kill(victim["pid"], signal.SIGKILL)
            return tiny_policy.generate(prompts, sampling)

    try:
        trajs = _play(KillingPolicy(), twx_env, tasks, pool)
        replacement = pool.worker_pid(1)
    finally:
        pool.close()
    assert len(trajs) == 4 and all(t.length == 3 for t in trajs)
    assert sorted(t.meta["retries"] for t in trajs) == [0, 0, 0, 1]  # only the killed worker's episode replayed
    assert replacement != victim["pid"]


def test_env_errors_come_back_as_values(local_ray) -> None:  # noqa: ANN001
    pool = RayEnvPool("twx-cookingworld", ENV_PARAMS, 1, num_cpus=0.5)
    try:
        bad, good = pool.map([(0, "no_such_method", ()), (0, "instruction", ())])
        assert isinstance(bad, EnvCrashedError) and "no_such_method" in str(bad)
        assert isinstance(good, str) and good  # the env was rebuilt for the next call, same actor
        assert pool.num_cpus == 0.5
    finally:
        pool.close()


def _ray_wired() -> bool:
    from agentevo.config import RolloutConfig

    try:
        RolloutConfig(workers="ray").validate()
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _ray_wired(), reason="rollout.workers = ray is not in agentevo/config.py / make_pool yet")
def test_rollout_workers_ray_builds_a_ray_pool(local_ray) -> None:  # noqa: ANN001
    pool = make_pool("twx-cookingworld", ENV_PARAMS, 1, "ray")
    try:
        assert isinstance(pool, RayEnvPool) and isinstance(pool.map([(0, "instruction", ())])[0], str)
    finally:
        pool.close()


def test_missing_ray_names_the_extra(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentevo\[ray\]'"):
        RayEnvPool("twx-cookingworld", ENV_PARAMS, 1)


def test_hung_worker_is_killed_and_past_max_retries_recorded(local_ray, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """Task 0 hangs at its first step twice: killed, retried once, then recorded as errored; task 1 is played."""
    from test_faults_timeouts import HANG_ENV, HangEnv, WaitActor

    monkeypatch.setitem(ENVIRONMENTS, HANG_ENV, (HangEnv.__module__, "HangEnv", "a fake env that hangs"))
    pool = RayEnvPool(HANG_ENV, {"marker_dir": str(tmp_path), "hang_at": 1, "hangs": 2, "hang_task": 0},
                      2, num_cpus=0.5, step_timeout_s=4.0)
    tasks = list(HangEnv(n_tasks=2).tasks("train"))
    try:
        # Both actors up before the clock starts: on a loaded 2-core machine an actor's cold start took over 2 s
        # and its first reset of the healthy task was timed out as a hang.
        victim, _ = pool.worker_pid(0), pool.worker_pid(1)
        t0 = time.monotonic()
        errored, fine = run_episodes(WaitActor(), pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)],
                                     HangEnv(), max_retries=1)
        elapsed = time.monotonic() - t0
        replacement = pool.worker_pid(0)
    finally:
        pool.close()
    assert elapsed < 45  # two 4 s timeouts and actor restarts, not forever
    assert len(list(tmp_path.glob("hang*"))) == 2  # hung on the first try and on the retry
    assert errored.steps == [] and errored.meta["retries"] == 1
    assert errored.meta["error"].startswith("hang-test worker 0: step gave no answer within rollout.step_timeout_s = 4 s")
    assert fine.length == 3 and fine.meta["retries"] == 0 and "error" not in fine.meta
    assert replacement != victim
    with pytest.raises(ProcessLookupError):  # the hung actor's process was killed (Ray reaps its workers)
        for _ in range(50):  # ray.kill is asynchronous
            os.kill(victim, 0)
            time.sleep(0.1)
