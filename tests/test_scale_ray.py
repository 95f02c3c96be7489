"""Ray env workers: same trajectories as the thread pool, a killed worker is replaced and its episode replayed.

The tests that start Ray are slow (`pytest -m slow tests/test_scale_ray.py`): Ray itself takes 10-30 s to start.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

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
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _tasks(env, n: int, max_steps: int):  # noqa: ANN001, ANN202
    tasks = list(env.tasks("train").head(n))
    for t in tasks:
        object.__setattr__(t, "max_steps", max_steps)
    return tasks


def _play(policy, env, tasks, pool):  # noqa: ANN001, ANN202
    actor = PolicyActor(policy, env.instruction(), 10, Sampling(temperature=0.0, max_new_tokens=12))
    return run_episodes(actor, pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], env)


@pytest.mark.slow  # starting Ray takes 10-30 s on 2 cores
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


@pytest.mark.slow  # starting Ray takes 10-30 s on 2 cores
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


@pytest.mark.slow  # starting Ray takes 10-30 s on 2 cores
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


@pytest.mark.slow
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
