"""QLASS: tree insertion, Bellman Q + min-max labels, expansion/pruning rule, QNet, Q-guided selection."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.agent.chat import Message
from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.qlass import (
    QNet,
    Tree,
    bellman_q,
    nodes_to_expand,
    normalised_labels,
    q_guided_episodes,
    qnet_loss_fn,
    qnet_scores,
)
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError, EnvCrashedError
from agentevo.models.backend import Generation, Sampling
from agentevo.rollout.engine import EpisodeRequest

TASK = Task("fake", "fake/0", "test", "fake", {}, max_steps=3)


def _traj(actions: list[str], reward: float, done_last: bool = True) -> Trajectory:
    steps = [
        Step(t, f"obs {t}", expert_reply(a), [t], None, parse_action(expert_reply(a)), f"after {a}", 0.0,
             done_last and t == len(actions))
        for t, a in enumerate(actions, start=1)
    ]
    return Trajectory(TASK, "self", "p", "Instr.", steps, reward, reward >= 1.0, goal="g")


def _tree() -> Tree:
    tree = Tree(_traj(["x"], 1.0))
    tree.insert(_traj(["a", "b", "c"], 0.8))
    tree.insert(_traj(["a", "b", "d"], 0.0))
    tree.insert(_traj(["a", "e"], 0.5))
    tree.insert(_traj(["f"], 0.0))
    return tree


def test_tree_merges_shared_prefixes_and_bellman_labels_are_min_max_normalised() -> None:
    tree = _tree()
    assert list(tree.root.children) == ["a", "f"]
    a = tree.find(["a"])
    assert list(a.children) == ["b", "e"] and list(tree.find(["a", "b"]).children) == ["c", "d"]
    assert a.reward == 0.0 and tree.find(["a", "b", "c"]).reward == 0.8  # inner nodes r = 0, leaves the env reward
    # Q(c)=.8, Q(d)=0, Q(b)=.9*.8=.72, Q(e)=.5, Q(a)=.9*max(.72,.5)=.648, Q(f)=0
    assert bellman_q(tree.root, 0.9) == pytest.approx(0.9 * 0.648)
    q = {n.key: n.q for n in tree.nodes()}
    assert q == pytest.approx({("a",): 0.648, ("a", "b"): 0.72, ("a", "b", "c"): 0.8, ("a", "b", "d"): 0.0,
                               ("a", "e"): 0.5, ("f",): 0.0})
    labels = {n.key: v for n, v in normalised_labels(tree, 0.9)}  # min 0, max .8
    assert labels == pytest.approx({("a",): 0.81, ("a", "b"): 0.9, ("a", "b", "c"): 1.0, ("a", "b", "d"): 0.0,
                                    ("a", "e"): 0.625, ("f",): 0.0})
    flat = Tree(_traj(["x"], 1.0))
    flat.insert(_traj(["a"], 0.3))
    flat.insert(_traj(["b"], 0.3))
    assert [v for _, v in normalised_labels(flat, 0.9)] == [0.0, 0.0]  # all equal -> 0 (QLASS)


def test_expansion_rule_prunes_unrewarded_and_shallow_rollouts() -> None:
    tree = Tree(_traj(["x"], 1.0))
    path = tree.insert(_traj(["s1", "s2", "s3", "s4", "s5", "s6"], 1.0))
    t = [n.t for n in path]
    assert t == [1, 2, 3, 4, 5, 6] and path[-1].terminal

    def expand(branch_t: int, reward: float) -> list[int]:
        return [n.t for n in nodes_to_expand(path, branch_t, reward, max_depth=5, min_prune_depth=3,
                                             prune_reward=0.01)]

    # branch at step 2, rollout from step 3 (>= 3) with reward: the branch and the rollout's nodes below depth 5
    assert expand(2, 1.0) == [2, 3, 4]
    assert expand(2, 0.0) == [2]  # no reward: the rollout is pruned
    assert expand(1, 1.0) == [1]  # the rollout starts at step 2 < min_prune_depth: pruned
    assert expand(5, 1.0) == []  # step 5 = max_depth: no more branching there


class _Env:
    """Deterministic toy env: 'win' ends the episode with score 1."""

    final_reward_mode = "last"

    def __init__(self) -> None:
        self.trace: list[str] = []

    def reset(self, task: Task) -> tuple[str, dict]:
        self.trace = []
        return "start", {"goal": "win"}

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.trace.append(action)
        win = action == "win"
        return "after " + ",".join(self.trace), float(win), win, {"score": float(win), "success": win}

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        return "none" if parse_ok else "format"

    def instruction(self) -> str:
        return "Instr."


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.envs = [_Env() for _ in range(size)]
        self.calls = {"reset": 0, "step": 0}

    def map(self, calls: list) -> list:
        out = []
        for i, method, args in calls:
            self.calls[method] += 1
            out.append(getattr(self.envs[i], method)(*args))
        return out


class _ScriptedPolicy:
    policy_id = "scripted"

    def __init__(self, renderer, script: list[list[str]]) -> None:  # noqa: ANN001
        self.renderer, self.script, self.prompts = renderer, list(script), []

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        texts = self.script.pop(0)
        assert len(texts) == len(prompts)
        self.prompts.append(prompts)
        return [Generation(self.renderer.encode_reply(t), [-0.1], t) for t in texts]


VALUES = {"Action: a": 0.2, "Action: b": 0.7, "Action: c": 0.9, "Action: win": 0.1, "Thought: hmm": 0.05}


class _FlakyPool(_Pool):
    """Env i's next crashes[i] 'step' calls fail with EnvCrashedError, and so do its later calls in that batch (a dead
    env); restart(i) gives it a fresh env. error=True raises a plain error instead (not a crash)."""

    def __init__(self, size: int, crashes: dict[int, int], error: bool = False) -> None:
        super().__init__(size)
        self.crashes, self.error, self.restarts = dict(crashes), error, []

    def map(self, calls: list) -> list:
        out, dead = [], set()
        for i, method, args in calls:
            if i in dead:
                out.append(EnvCrashedError(f"env {i} is gone"))
                continue
            if method == "step" and self.crashes.get(i, 0) > 0:
                self.crashes[i] -= 1
                out.append(ValueError("bad action") if self.error else EnvCrashedError(f"env {i} crashed"))
                dead.add(i)
                continue
            out.extend(super().map([(i, method, args)]))
        return out

    def restart(self, i: int) -> None:
        self.restarts.append(i)
        self.envs[i] = _Env()


def _guided(tiny_policy, script: list[list[str]], terminal_uses_reward: bool, pool: _Pool | None = None,  # noqa: ANN001, ANN202
            tasks: int = 1, max_retries: int = 3):
    policy = _ScriptedPolicy(tiny_policy.renderer, script)
    scored: list[list[int]] = []
    ids = {text: tiny_policy.renderer.encode_reply(text) for text in VALUES}

    def score(seqs: list[list[int]]) -> list[float]:
        scored.extend(seqs)
        return [next(v for text, v in VALUES.items() if s[-len(ids[text]):] == ids[text]) for s in seqs]

    pool = pool or _Pool(2)
    env = _Env()
    trajs = q_guided_episodes(policy, score, pool, [EpisodeRequest(TASK, k) for k in range(tasks)], env,
                              env.instruction(), 10, Sampling(0.7, 1.0, 16, seed=0), 2, terminal_uses_reward, 4096,
                              max_retries=max_retries)
    return (trajs[0] if tasks == 1 else trajs), pool, policy, scored


def test_q_guided_selection_takes_the_argmax_and_counts_every_replayed_step(tiny_policy) -> None:  # noqa: ANN001
    script = [["Action: a", "Action: b"], ["Action: c", "Action: win"]]
    traj, pool, policy, scored = _guided(tiny_policy, script, terminal_uses_reward=True)
    # step 1: Q(a)=.2 < Q(b)=.7 -> b; step 2: c has Q .9 but win ends the episode with env reward 1 -> win
    assert [s.parsed_action for s in traj.steps] == ["b", "win"] and traj.success and traj.final_reward == 1.0
    assert traj.steps[0].info["q_values"] == pytest.approx([0.2, 0.7]) and traj.steps[1].info["chosen"] == 1
    assert traj.steps[0].next_obs == "after b" and traj.steps[1].next_obs == "after b,win"
    # 1 reset to start + a reset per executed candidate (2 + 2); the step-2 candidates each replay 'b' once.
    assert {k: traj.meta[k] for k in ("resets", "replay_steps", "candidate_steps", "replay_mismatches")} == {
        "resets": 5, "replay_steps": 2, "candidate_steps": 4, "replay_mismatches": 0}
    assert pool.calls == {"reset": 5, "step": 6}
    # The QNet scores exactly the prompt the policy saw + the candidate's reply ids; a terminal win is not scored.
    first_prompt = policy.prompts[0][0]
    assert scored[0] == first_prompt + tiny_policy.renderer.encode_reply("Action: a")
    assert len(scored) == 3


def test_q_guided_selection_replays_a_crashed_copy_and_plays_on(tiny_policy) -> None:  # noqa: ANN001
    script = [["Action: a", "Action: b"], ["Action: c", "Action: win"]]
    clean, *_ = _guided(tiny_policy, script, terminal_uses_reward=True)
    # env 1 (candidate b's copy) crashes on its first step, then on its replay of 'b' at step 2
    traj, pool, *_ = _guided(tiny_policy, script, terminal_uses_reward=True, pool=_FlakyPool(2, {1: 2}))
    assert [s.parsed_action for s in traj.steps] == ["b", "win"] and traj.success and "error" not in traj.meta
    assert [s.next_obs for s in traj.steps] == [s.next_obs for s in clean.steps]
    assert pool.restarts == [1, 1]
    # each crashed copy is run again whole from its reset: 2 more resets; the steps that crashed never ran, so the
    # steps that did are those of the clean run
    assert pool.calls == {"reset": 5 + 2, "step": 6}


def test_q_guided_selection_records_an_episode_that_keeps_crashing_and_goes_on(tiny_policy) -> None:  # noqa: ANN001
    # two episodes on a pool of 4 (two copies each); env 3 (the second episode's 'b' copy) always crashes
    script = [["Action: a", "Action: b"] * 2, ["Action: c", "Action: win"]]
    trajs, pool, *_ = _guided(tiny_policy, script, terminal_uses_reward=True, pool=_FlakyPool(4, {3: 99}), tasks=2,
                              max_retries=1)
    first, second = trajs
    assert [s.parsed_action for s in first.steps] == ["b", "win"] and first.success
    assert second.steps == [] and not second.success and second.final_reward == 0.0
    assert second.meta["error"] == "env 3 crashed"
    assert pool.restarts == [3, 3]  # the try and its one retry


def test_q_guided_selection_records_an_episode_whose_reset_keeps_crashing(tiny_policy) -> None:  # noqa: ANN001
    class ResetCrashes(_FlakyPool):
        def map(self, calls: list) -> list:
            return [EnvCrashedError("reset failed") if m == "reset" else None for _, m, _ in calls]

    # nothing is generated for an episode that never started (the scripted policy would fail on an empty script)
    traj, pool, policy, _ = _guided(tiny_policy, [], terminal_uses_reward=True, pool=ResetCrashes(2, {}),
                                    max_retries=2)
    assert traj.steps == [] and traj.meta["error"] == "reset failed" and policy.prompts == []
    assert pool.restarts == [0, 0, 0]


def test_q_guided_selection_stops_on_an_env_error_that_is_not_a_crash(tiny_policy) -> None:  # noqa: ANN001
    with pytest.raises(AgentevoError, match="Q-guided inference: environment call failed: bad action"):
        _guided(tiny_policy, [["Action: a", "Action: b"]], terminal_uses_reward=True,
                pool=_FlakyPool(2, {0: 1}, error=True))


def test_q_guided_selection_can_value_terminal_candidates_by_the_qnet(tiny_policy) -> None:  # noqa: ANN001
    script = [["Action: a", "Action: b"], ["Action: c", "Action: win"], ["Action: win", "Thought: hmm"]]
    traj, pool, _, scored = _guided(tiny_policy, script, terminal_uses_reward=False)
    # step 2: Q(c)=.9 > Q(win)=.1 -> c; step 3: Q(win)=.1 > Q(format error)=.05 -> win
    assert [s.parsed_action for s in traj.steps] == ["b", "c", "win"] and traj.success
    # the format-error candidate is never executed: 1 + 2 + 2 + 1 resets, replays 0 + 2 + 2 (b, c for 'win')
    assert {k: traj.meta[k] for k in ("resets", "replay_steps", "candidate_steps")} == {
        "resets": 6, "replay_steps": 4, "candidate_steps": 5}
    assert pool.calls == {"reset": 6, "step": 9} and len(scored) == 6


def test_qnet_reads_the_last_token_and_round_trips(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    qnet = QNet(copy.deepcopy(tiny_policy.model), head_hidden=16).eval()
    r = tiny_policy.renderer
    a = r.render([Message("user", "take knife")], add_generation_prompt=True).ids + r.encode_reply("Action: take knife")
    b = a[:-3]
    scores = qnet_scores(qnet, [a, b], tiny_policy.pad_id, batch_size=2)  # b is right-padded in the batch
    with torch.no_grad():
        alone = [float(qnet(torch.tensor([s]))[0, -1]) for s in (a, b)]
    assert scores == pytest.approx(alone, abs=1e-5)
    qnet.save_pretrained(tmp_path / "qnet")
    again = QNet.load(tmp_path / "qnet")
    assert qnet_scores(again, [a, b], tiny_policy.pad_id) == pytest.approx(scores, abs=1e-6)


class _FixedQ(torch.nn.Module):
    def __init__(self, values: list[list[float]]) -> None:
        super().__init__()
        self.values = torch.nn.Parameter(torch.tensor(values))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.values


def test_qnet_loss_regresses_every_token_or_the_reply_to_the_node_label() -> None:
    batch = {
        "input_ids": torch.zeros((2, 4), dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "action_mask": torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]),
        "q": torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 1.0, 1.0, 0.0]]),
    }
    model = _FixedQ([[0.5, 0.0, 1.0, 0.5], [1.0, 0.0, 2.0, 9.0]])
    # all 7 real tokens: row 1 errors (0, .25, .25, 0), row 2 errors (0, 1, 1); the padded 9.0 is ignored
    loss, stats = qnet_loss_fn("all")(model, batch)
    assert float(loss.detach()) == pytest.approx((0.25 + 0.25 + 1 + 1) / 7)
    assert stats["mse_last_token"] == pytest.approx((0.0 + 1.0) / 2)
    reply, _ = qnet_loss_fn("reply")(model, batch)  # reply tokens: (.25, 0) and (1, 1)
    assert float(reply.detach()) == pytest.approx((0.25 + 0 + 1 + 1) / 4)


@pytest.mark.slow
def test_qlass_recipe_end_to_end_on_textworld_express(tmp_path) -> None:  # noqa: ANN001
    """A small QLASS run: trees with replay, labels, QNet, Q-guided evaluation; a rerun resumes without new work."""
    from agentevo.algorithms import qlass
    from agentevo.config import load_config
    from agentevo.run import Run

    overrides = [
        "env.n_train=2", "env.n_test=2", "env.params={max_steps: 6}", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.intermediate_size=64",
        "agent.history_window=6", "agent.max_new_tokens=16", "rollout.n_parallel=4", "optim.epochs=1",
        "optim.batch_size=4", "optim.micro_batch_size=2", "qlass.max_depth=2", "qlass.head_hidden=16",
        "qlass.batch_size=8", "qlass.micro_batch_size=4", "qlass.epochs=1",
    ]
    cfg = load_config(None, overrides, method="qlass", name="qlass", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        results = qlass.run(run)
        trees = results["qlass/trees"]
        assert trees["trees"] == 2 and trees["replay_mismatches"] == 0  # TextWorldExpress replays exactly
        played = run.store.load(prefix="qlass/trees/")
        assert trees["episodes"] == len(played) > 0
        assert trees["env_steps"] == sum(1 for t in played for s in t.steps if s.parsed_action is not None)
        assert 0 < trees["replay_steps"] <= trees["env_steps"]  # the expert branches replay at least one step
        assert results["qlass/qnet"]["samples"] == trees["nodes"]
        ev = results["eval/qlass"]["test"]
        assert ev["n"] == 2 and ev["inference_env_steps"] == ev["inference_replay_steps"] + ev["inference_candidate_steps"]
        assert ev["inference_replay_mismatches"] == 0
        assert results["env_steps"]["total"] == results["env_steps"]["expert"] + trees["env_steps"]
        before = run.store.count()
        again = qlass.run(run)
        assert run.store.count() == before and again["eval/qlass"] == results["eval/qlass"]
    finally:
        run.close()


def test_qlass_config_rejects_impossible_values() -> None:
    from agentevo.algorithms.baselines_config import QLASSConfig
    from agentevo.errors import ConfigError

    QLASSConfig().validate()
    for bad, match in [({"n_candidates": 0}, "n_candidates"), ({"explore_top_k": 0}, "top_k"),
                       ({"loss_tokens": "some"}, "loss_tokens"), ({"gamma": 1.5}, "gamma"),
                       ({"batch_size": 10, "micro_batch_size": 4}, "multiple")]:
        with pytest.raises(ConfigError, match=match):
            QLASSConfig(**bad).validate()
