"""Rollout engine + experience store: stored ids are the generated ids, resume after a crash, env crashes."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from agentevo.data.store import ExperienceStore, content_words
from agentevo.data.tensors import collate, reply_logprobs, trajectory_samples
from agentevo.envs import make_env
from agentevo.models.backend import Generation, Sampling
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool


class RecordingPolicy:
    """Wraps a policy and keeps every prompt and generation it produced."""

    def __init__(self, policy) -> None:  # noqa: ANN001
        self.policy = policy
        self.renderer = policy.renderer
        self.policy_id = policy.policy_id
        self.calls: list[tuple[list[int], Generation]] = []

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        gens = self.policy.generate(prompts, sampling)
        self.calls.extend(zip(prompts, gens, strict=True))
        return gens


def _play(policy, env, tasks, pool, store=None, collection="c", stop_after=None):  # noqa: ANN001, ANN202
    actor = PolicyActor(policy, env.instruction(), 10, Sampling(temperature=1.0, max_new_tokens=12, seed=3))
    stored = []

    def on_done(req, traj) -> None:  # noqa: ANN001
        if store is not None:
            store.add(traj, collection, req.slot)
        stored.append(traj)
        if stop_after is not None and len(stored) >= stop_after:
            raise KeyboardInterrupt("simulated crash")

    requests = [EpisodeRequest(t, k) for k, t in enumerate(tasks)]
    done = store.done_slots(collection) if store is not None else set()
    return run_episodes(actor, pool, [r for r in requests if r.slot not in done], env, on_done)


def test_stored_ids_and_logprobs_are_what_the_policy_generated(tiny_policy, twx_env, tmp_path) -> None:  # noqa: ANN001
    rec = RecordingPolicy(tiny_policy)
    tasks = list(twx_env.tasks("train").head(3))
    for t in tasks:
        object.__setattr__(t, "max_steps", 3)
    store = ExperienceStore(tmp_path / "experience.db")
    pool = make_pool("twx-cookingworld", {"n_train": 8}, 2, "thread")
    try:
        _play(rec, twx_env, tasks, pool, store)
    finally:
        pool.close()
    trajs = store.load(collection="c")
    assert len(trajs) == 3 and all(t.length == 3 for t in trajs)
    generated = {tuple(g.token_ids) for _, g in rec.calls}
    for traj in trajs:
        for step in traj.steps:
            assert tuple(step.action_ids) in generated
            assert len(step.logprobs) == len(step.action_ids)
        # rebuilding the training row reproduces the exact prompts, so rescoring gives the behaviour log-probs
        samples = trajectory_samples(tiny_policy.renderer, traj, 0, 10, 4096, pack=False)
        prompts = {tuple(p) for p, _ in rec.calls}
        for sample in samples:
            assert tuple(sample.input_ids[: sample.spans[0][0]]) in prompts
        with torch.no_grad():
            logp, mask = reply_logprobs(tiny_policy.model, collate(samples, tiny_policy.pad_id))
        for row, sample in enumerate(samples):
            s, e = sample.spans[0]
            assert torch.allclose(logp[row, s:e], torch.tensor(sample.behaviour_logprobs), atol=1e-4)
    store.close()


def test_run_killed_mid_collection_resumes_without_loss(tiny_policy, twx_env, tmp_path) -> None:  # noqa: ANN001
    tasks = list(twx_env.tasks("train").head(6))
    for t in tasks:
        object.__setattr__(t, "max_steps", 2)
    path = tmp_path / "experience.db"
    store = ExperienceStore(path)
    pool = make_pool("twx-cookingworld", {"n_train": 8}, 2, "thread")
    try:
        with pytest.raises(KeyboardInterrupt):
            _play(tiny_policy, twx_env, tasks, pool, store, stop_after=2)
        store.close()
        store = ExperienceStore(path)  # a new process would reopen the file like this
        before = store.load(collection="c")
        assert len(before) == 2
        _play(tiny_policy, twx_env, tasks, pool, store)
    finally:
        pool.close()
    after = store.load(collection="c")
    assert sorted(t.meta["slot"] for t in after) == list(range(6))
    kept = {t.meta["store_id"]: t for t in after}
    for t in before:  # the first two are untouched, not replayed
        assert kept[t.meta["store_id"]].steps[0].action_ids == t.steps[0].action_ids
    store.close()


def test_process_worker_whose_jvm_dies_is_restarted_and_episode_retried(tiny_policy, twx_env) -> None:  # noqa: ANN001
    tasks = list(twx_env.tasks("train").head(2))
    for t in tasks:
        object.__setattr__(t, "max_steps", 3)
    pool = make_pool("twx-cookingworld", {"n_train": 8}, 1, "process")
    killed = {"done": False}

    class KillingPolicy(RecordingPolicy):
        def generate(self, prompts, sampling):  # noqa: ANN001, ANN201
            if not killed["done"]:
                killed["done"] = True
                os.kill(pool.worker_pid(0), signal.SIGKILL)
            return super().generate(prompts, sampling)

    try:
        trajs = _play(KillingPolicy(tiny_policy), twx_env, tasks, pool)
    finally:
        pool.close()
    assert len(trajs) == 2 and all(t.length == 3 for t in trajs)
    # the killed worker's episode was replayed from its reset (which episode depends on signal timing)
    assert sorted(t.meta["retries"] for t in trajs) == [0, 1]


def test_store_search_goals_and_content_words(tmp_path, twx_env) -> None:  # noqa: ANN001
    from agentevo.data.types import Step, Trajectory

    store = ExperienceStore(tmp_path / "e.db")
    task = twx_env.tasks("train")[0]
    for k, goal in enumerate(["cook the red apple", "slice a yellow potato", "put the shirt in the wardrobe"]):
        step = Step(1, "o", "Action: x", [1], None, "x", "o2", 0.0, True)
        store.add(Trajectory(task, "self", "p", "I", [step], 0.0, False, goal=goal), "c", k)
    assert content_words("Put the red apple in the fridge") == {"red", "apple", "fridge"}
    ids = store.search_goals("a red apple pie")
    assert ids[0] == store.load(collection="c")[0].meta["store_id"]
    assert store.count("c") == 3 and store.done_slots("c") == {0, 1, 2}
    with pytest.raises(Exception, match="UNIQUE"):
        store.add(Trajectory(task, "self", "p", "I", [step], 0.0, False, goal="x"), "c", 0)
    assert store.count("c") == 3  # the failed write left nothing behind
    store.close()


def test_store_add_missing_keeps_slots_and_skips_stored_ones(tmp_path, twx_env) -> None:  # noqa: ANN001
    from agentevo.data.types import Step, Trajectory

    source, target = ExperienceStore(tmp_path / "a.db"), ExperienceStore(tmp_path / "b.db")
    task = twx_env.tasks("train")[0]
    step = Step(1, "o", "Action: x", [1], None, "x", "o2", 0.0, True)
    for slot, reward in [(3, 0.3), (1, 0.1)]:
        source.add(Trajectory(task, "self", "p", "I", [step], reward, False, meta={"k": slot}), "c", slot)
    target.add(Trajectory(task, "self", "p", "I", [step], 0.9, False), "c", 1)  # already imported before a resume
    target.add_missing("c", ((int(t.meta["slot"]), t) for t in source.load(collection="c")))
    assert {t.meta["slot"]: t.final_reward for t in target.load(collection="c")} == {1: 0.9, 3: 0.3}
    row = target._db.execute("SELECT meta_json FROM trajectories WHERE slot = 3").fetchone()[0]
    assert json.loads(row) == {"k": 3}  # the source store's id / collection / slot are not written into meta
    source.close()
    target.close()


def test_unknown_environment_is_rejected() -> None:
    from agentevo.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown environment 'nope'; choose one of"):
        make_env("nope")
