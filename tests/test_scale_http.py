"""The HTTP backend acts in an environment through the local OpenAI-compatible server serving the tiny model."""

from __future__ import annotations

import pytest
import torch

from agentevo.agent.prompt import HistoryTurn
from agentevo.data.types import Step
from agentevo.errors import AgentevoError
from agentevo.models.backend import Sampling
from agentevo.models.http_backend import HTTPChatActor, HTTPConfig, HTTPPolicy, http_actor
from agentevo.models.serve import PolicyServer
from agentevo.rollout.engine import Episode, EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool


@pytest.fixture()
def server(tiny_policy):  # noqa: ANN001, ANN201
    with PolicyServer(tiny_policy, "tiny") as s:
        yield s


def _tasks(env, n: int = 2, max_steps: int = 3):  # noqa: ANN001, ANN202
    tasks = list(env.tasks("train").head(n))
    for t in tasks:
        object.__setattr__(t, "max_steps", max_steps)
    return tasks


@pytest.fixture(scope="module")
def pool():  # noqa: ANN201
    p = make_pool("twx-cookingworld", {"n_train": 8}, 2, "thread")
    yield p
    p.close()


def _play(actor, env, tasks, pool):  # noqa: ANN001, ANN202
    return run_episodes(actor, pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], env)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_mode_reproduces_the_local_policy(tiny_policy, twx_env, server, pool, temperature) -> None:  # noqa: ANN001
    tasks = _tasks(twx_env)
    sampling = Sampling(temperature=temperature, max_new_tokens=12, seed=5)
    direct = _play(PolicyActor(tiny_policy, twx_env.instruction(), 10, sampling), twx_env, tasks, pool)
    remote = HTTPPolicy(server.url, tiny_policy.tokenizer, policy_id="tiny-http", batch_size=tiny_policy.batch_size)
    via_http = _play(http_actor(remote, twx_env.instruction(), 10, sampling), twx_env, tasks, pool)
    assert remote.model == "tiny" and server.requests >= 3  # asked /v1/models, then one request per turn
    assert [t.policy_id for t in via_http] == ["tiny-http"] * 2
    for a, b in zip(direct, via_http, strict=True):
        assert a.length == b.length == 3
        for sa, sb in zip(a.steps, b.steps, strict=True):
            # the ids the server sampled come back exactly, with their behaviour log-probs (ratio-ready)
            assert sa.action_ids == sb.action_ids and sa.action_text == sb.action_text
            assert sa.next_obs == sb.next_obs
            assert sb.logprobs is not None and len(sb.logprobs) == len(sb.action_ids)
            assert torch.allclose(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5)


def test_chat_mode_keeps_text_and_drops_logprobs(tiny_policy, twx_env, server, pool) -> None:  # noqa: ANN001
    tasks = _tasks(twx_env)
    sampling = Sampling(temperature=0.0, max_new_tokens=12)
    remote = HTTPPolicy(server.url, tiny_policy.tokenizer, model="tiny", mode="chat")
    actor = http_actor(remote, twx_env.instruction(), 10, sampling)
    assert isinstance(actor, HTTPChatActor)
    trajs = _play(actor, twx_env, tasks, pool)
    direct = _play(PolicyActor(tiny_policy, twx_env.instruction(), 10, sampling), twx_env, tasks, pool)
    for traj, ref in zip(trajs, direct, strict=True):
        assert traj.length == 3
        # the first prompt has no history, so the server's own rendering equals ours: same reply text
        assert traj.steps[0].action_text == ref.steps[0].action_text
        for step in traj.steps:
            assert step.logprobs is None  # not usable for ratio-based training
            assert step.action_ids == tiny_policy.renderer.encode_reply(step.action_text) or \
                step.action_ids == tiny_policy.tokenizer(step.action_text, add_special_tokens=False)["input_ids"]
    # the chat prompt replays the kept replies as their stored text, in the same layout as the token-id prompt
    ep = Episode(EpisodeRequest(tasks[0], 0), 0, first_obs="You are in the kitchen.", goal="cook")
    for t, reply in enumerate(["Action: open fridge", "Action: take knife", "Action: eat meal"], start=1):
        ep.steps.append(Step(t, "o", reply, [99, t], None, reply[8:], f"obs {t}", 0.0, False))
        ep.history.append(HistoryTurn([99, t], f"obs {t}"))
    assert HTTPChatActor(remote, "Instr.", 2, sampling).messages(ep) == [
        {"role": "user", "content": "Instr.\n\nGoal: cook\n(1 earlier steps omitted.)\nObservation: obs 1"},
        {"role": "assistant", "content": "Action: take knife"}, {"role": "user", "content": "Observation: obs 2"},
        {"role": "assistant", "content": "Action: eat meal"}, {"role": "user", "content": "Observation: obs 3"},
    ]
    with pytest.raises(Exception, match="chat mode"):
        remote.generate([[1, 2, 3]], sampling)


def test_complete_is_text_in_text_out(tiny_policy, server) -> None:  # noqa: ANN001
    remote = HTTPPolicy(server.url, model="tiny")  # no tokenizer needed for writers / proposers
    text = remote.complete("Write one lesson about the fridge.", Sampling(max_new_tokens=10))
    chat = tiny_policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one lesson about the fridge."}], tokenize=False, add_generation_prompt=True)
    ids = tiny_policy.tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert text == tiny_policy.generate([ids], Sampling(max_new_tokens=10))[0].text


def test_server_without_token_ids_falls_back_to_text(tiny_policy) -> None:  # noqa: ANN001
    remote = HTTPPolicy("http://127.0.0.1:9/v1", tiny_policy.tokenizer, model="m")
    reply = "Thought: x\nAction: take knife"
    plain = {"text": reply, "finish_reason": "stop", "logprobs": {"tokens": ["Thought", ":"], "token_logprobs": [-1, -2]}}
    gen = remote._completion_generation(plain)
    assert gen.logprobs == [] and gen.token_ids == tiny_policy.renderer.encode_reply(reply)
    cut = remote._completion_generation({**plain, "finish_reason": "length", "logprobs": None})
    assert cut.token_ids[-1] != tiny_policy.renderer.end_of_turn_id and cut.logprobs == []
    ids = {"text": "ab", "logprobs": {"tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.5, -0.25]}}
    assert remote._completion_generation(ids).token_ids == [7, 9]
    assert remote._completion_generation({**ids, "token_ids": [4, 5]}).logprobs == [-0.5, -0.25]


def test_errors_name_the_server(tiny_policy, server) -> None:  # noqa: ANN001
    dead = HTTPPolicy("http://127.0.0.1:9/v1", tiny_policy.tokenizer, model="m", retries=0, timeout_s=2)
    with pytest.raises(AgentevoError, match="no answer from the OpenAI-compatible server at http://127.0.0.1:9/v1"):
        dead.generate([[1, 2]], Sampling())
    refused = HTTPPolicy(server.url, tiny_policy.tokenizer, model="tiny", retries=3)
    with pytest.raises(AgentevoError, match="answered 400: .*n = 1"):
        refused._request("completions", {"prompt": [1, 2], "n": 2})
    assert refused.requests == 1  # a 4xx is not retried
    with pytest.raises(Exception, match="mode must be one of"):
        HTTPConfig(mode="grpc").validate()


@pytest.mark.skipif(not hasattr(__import__("agentevo.run").run.Run, "rollout_policy"),
                    reason="Run.rollout_policy (model.backend) is not wired yet (the scale-out run.py change)")
def test_run_evaluates_through_an_http_server(tiny_policy, server, tmp_path) -> None:  # noqa: ANN001
    from agentevo.config import load_config
    from agentevo.run import Run

    tiny_policy.save(tmp_path / "ckpt")
    cfg = load_config(None, ["env.n_test=2", "eval.n_tasks=2", "env.params={max_steps: 2}", "rollout.n_parallel=2",
                             "model.backend=http", f"model.http.base_url={server.url}", "agent.max_new_tokens=8"],
                      name="http", output_dir=str(tmp_path / "runs"))
    run = Run.create(cfg, quiet=True)
    try:
        policy = run.rollout_policy(tmp_path / "ckpt", "served")
        assert isinstance(policy, HTTPPolicy) and policy.policy_id == "served"
        before = server.requests
        metrics = run.evaluate(policy, "served")["test"]
        assert metrics["n"] == 2 and server.requests > before
        assert {t.policy_id for t in run.store.load(collection="eval/served/test")} == {"served"}
    finally:
        run.close()


def test_cli_eval_acts_on_the_configured_backend(tiny_policy, server, tmp_path) -> None:  # noqa: ANN001
    from agentevo.cli import main

    tiny_policy.save(tmp_path / "ckpt")
    before = server.requests
    code = main(["eval", "--model", str(tmp_path / "ckpt"), "--n", "2", "--output-dir", str(tmp_path / "runs"),
                 "--name", "e", "--quiet", "--set", "env.params={max_steps: 2}", "--set", "rollout.n_parallel=2",
                 "--set", "model.backend=http", "--set", f"model.http.base_url={server.url}",
                 "--set", "agent.max_new_tokens=8"])
    assert code == 0 and server.requests > before
