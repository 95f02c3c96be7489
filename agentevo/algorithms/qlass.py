"""QLASS (Lin et al. 2025): exploration trees, Bellman Q labels, a Q-network, Q-guided action selection (§5).

Starting from SFT (checkpoints/bc):

 1. Exploration trees (one per training task with an expert demo). The root is the reset state. A node that is
    expanded gets `samples_per_depth` children, each sampled with exploratory decoding (T=2.0, top-k 10,
    top-p 0.5) and, when the node already has children, a prompt asking for a different reply. Every new child is
    rolled out to the end of the episode with the same decoding. Non-terminal new children are expanded in turn
    (branching at steps 1..max_depth); the rollout's own nodes are expanded too only when it earned reward
    > 0.01 and it starts at step >= min_prune_depth (pruning). The expert trajectory joins the tree with one
    rollout branching off each of its first max_depth-1 steps. Reaching a node means resetting the environment
    and replaying its actions (deterministic per seed); every one of those steps is counted.
 2. Q labels: leaves keep the env reward of their episode, inner nodes get r = 0, and
        Q(n) = r(n) + γ max_c Q(c),  γ = 0.9,
    then min-max normalised over the tree's nodes (0 when all are equal).
 3. QNet = the SFT LLM + MLP(h -> 1024 -> 1024 -> 1) on every token's last hidden state, trained by MSE of every
    token's output against its node's label (the node's sequence = its prompt + its reply).
 4. Q-guided inference: at each step sample N candidate replies, execute each in a replayed copy of the
    environment (reset + replay the episode so far + the candidate), value it by the QNet at the candidate's
    last token (or by the env reward when the candidate ends the episode), keep the argmax.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentevo.agent.chat import Message
from agentevo.agent.prompt import FORMAT_ERROR_OBSERVATION, HistoryTurn, build_messages, parse_action
from agentevo.algorithms.bc import warm_start
from agentevo.algorithms.losses import aggregate
from agentevo.data.tensors import StepSample, pad_sequences, step_prompt_ids
from agentevo.data.types import Step, Trajectory, final_reward
from agentevo.errors import AgentevoError, EnvCrashedError
from agentevo.eval.metrics import eval_collection, summarize
from agentevo.files import replacing_dir
from agentevo.models import placement
from agentevo.models.backend import Generation, Sampling, TransformersPolicy
from agentevo.rollout.engine import Episode, EpisodeRequest, PolicyActor
from agentevo.train.loop import train

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from agentevo.run import Run

# -- 1. exploration trees ------------------------------------------------------------------------


@dataclass(eq=False)
class Node:
    """A tree node: the state after `traj.steps[t-1]` (t = 0 is the root, the reset state of `traj`'s task)."""

    traj: Trajectory
    t: int
    key: tuple[str, ...] = ()  # action keys from the root
    children: dict[str, Node] = field(default_factory=dict)
    terminal: bool = False  # the episode ended after this node's action
    leaf_reward: float = 0.0  # the env reward of the episode that ended here
    q: float = 0.0
    budget: int | None = None  # branches still to sample (None: never expanded)

    @property
    def step(self) -> Step:
        return self.traj.steps[self.t - 1]

    @property
    def reward(self) -> float:
        """r(n): the episode's env reward at a leaf, 0 inside the tree (QLASS's 'vanilla' labels)."""
        return 0.0 if self.children else self.leaf_reward


def action_key(step: Step) -> str:
    """Children are told apart by the command they send (a format error: by its text)."""
    return step.parsed_action if step.parsed_action is not None else f"<format error> {step.action_text}"


class Tree:
    """One task's exploration tree; trajectories that share a command prefix share its nodes."""

    def __init__(self, expert: Trajectory) -> None:
        self.task = expert.task
        self.root = Node(expert, 0)

    def insert(self, traj: Trajectory) -> list[Node]:
        """Add a trajectory; returns the nodes along its path (root excluded), existing or new."""
        node, path = self.root, []
        for t, step in enumerate(traj.steps, start=1):
            k = action_key(step)
            child = node.children.get(k)
            if child is None:
                # The first reply that reached a node keeps it (QLASS drops repeated actions the same way).
                child = Node(traj, t, node.key + (k,))
                node.children[k] = child
            node = child
            path.append(node)
        node.terminal = True
        node.leaf_reward = traj.final_reward
        return path

    def find(self, key: Sequence[str]) -> Node:
        """The node reached by a sequence of action keys."""
        node = self.root
        for k in key:
            node = node.children[k]
        return node

    def nodes(self) -> list[Node]:
        """Every node except the root, depth first."""
        out, stack = [], list(self.root.children.values())[::-1]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(list(node.children.values())[::-1])
        return out


def bellman_q(node: Node, gamma: float) -> float:
    """Set Q(n) = r(n) + γ max_c Q(c) on the subtree (a leaf: Q = r); returns Q(node)."""
    if node.children:
        node.q = node.reward + gamma * max(bellman_q(c, gamma) for c in node.children.values())
    else:
        node.q = node.reward
    return node.q


def normalised_labels(tree: Tree, gamma: float) -> list[tuple[Node, float]]:
    """Each non-root node with its Q min-max normalised over the tree (all 0 when every Q is equal)."""
    bellman_q(tree.root, gamma)
    nodes = tree.nodes()
    if not nodes:
        return []
    lo, hi = min(n.q for n in nodes), max(n.q for n in nodes)
    return [(n, (n.q - lo) / (hi - lo) if hi > lo else 0.0) for n in nodes]


def nodes_to_expand(path: list[Node], branch_t: int, reward: float, max_depth: int, min_prune_depth: int,
                    prune_reward: float) -> list[Node]:
    """After a branch at step branch_t was rolled out along `path`: the nodes QLASS queues for expansion.

    The branch node itself (when it can still branch), plus, for a rollout that earned more than prune_reward
    and starts at step >= min_prune_depth, the rollout's own nodes up to max_depth (pruning keeps the rest).
    """
    def expandable(n: Node) -> bool:
        return not n.terminal and n.t < max_depth

    branch = path[branch_t - 1]
    out = [branch] if expandable(branch) else []
    if reward > prune_reward and branch_t + 1 >= min_prune_depth:
        out.extend(n for n in path[branch_t:] if expandable(n))
    return out


def node_prompt_ids(renderer: Any, node: Node, window: int, suffix: str = "") -> list[int]:
    """Prompt ids for the reply after this node (its history replies spliced in as stored ids)."""
    traj = node.traj
    history = [HistoryTurn(s.action_ids, s.next_obs) for s in traj.steps[: node.t]]
    messages = build_messages(traj.instruction, traj.goal, traj.first_obs, history, window)
    if suffix:
        messages[-1] = Message("user", messages[-1].text + suffix)
    return renderer.render(messages, add_generation_prompt=True).ids


def diversity_suffix(actions: list[str]) -> str:
    """QLASS's request for a reply different from the ones already explored at this node."""
    if len(actions) == 1:
        return f"\nPlease provide another reasonable response different from '{actions[0]}'."
    listed = "".join(f"Answer {i + 1}: '{a}'\n" for i, a in enumerate(actions))
    return f"\nYou have given the following answers.\n{listed}Please provide a reasonable response different from previous answers."


class ReplayActor:
    """Replays each episode's forced replies (the path to its branch node and the branch), then samples."""

    source = "qlass-explore"

    def __init__(self, inner: PolicyActor, forced: dict[int, list[tuple[list[int], str]]],
                 expected_obs: dict[int, list[str]]) -> None:
        self.inner, self.forced, self.expected_obs = inner, forced, expected_obs
        self.policy_id = inner.policy_id
        self.mismatches = 0  # replayed steps whose observation differs from the tree's (a non-deterministic env)

    def act(self, episodes: list[Episode]) -> list[Generation]:
        out: list[Generation | None] = [None] * len(episodes)
        free = []
        for k, ep in enumerate(episodes):
            t, forced = len(ep.steps), self.forced[ep.request.slot]
            expected = self.expected_obs[ep.request.slot]
            if 0 < t <= len(expected) and ep.steps[t - 1].next_obs != expected[t - 1]:
                self.mismatches += 1
            if t < len(forced):
                out[k] = Generation(list(forced[t][0]), [], forced[t][1])
            else:
                free.append(k)
        if free:
            for k, gen in zip(free, self.inner.act([episodes[k] for k in free]), strict=True):
                out[k] = gen
        return [g for g in out if g is not None]

    def needs_plan(self) -> bool:
        return False


def _fill_expert_ids(policy: TransformersPolicy, traj: Trajectory) -> Trajectory:
    for step in traj.steps:
        if not step.action_ids:
            step.action_ids = policy.renderer.encode_reply(step.action_text)
    return traj


def tree_task_indices(n_experts: int, n: int | None, pick: str) -> list[int]:
    """Which expert demos (training tasks) get a tree: the first n, or n spread evenly over the list."""
    if n is None or n >= n_experts:
        return list(range(n_experts))
    if pick == "first":
        return list(range(n))
    return [k * n_experts // n for k in range(n)]


def build_trees(run: Run, policy: TransformersPolicy) -> tuple[list[Tree], dict[str, Any]]:
    """Grow the exploration trees wave by wave (each wave resumable) and return them with step counts."""
    cfg, q = run.cfg, run.cfg.qlass
    window = cfg.agent.history_window
    experts = run.store.load(collection="expert")
    picked = tree_task_indices(len(experts), q.n_tree_tasks or cfg.bc.n_expert, q.tree_tasks)
    trees = [Tree(_fill_expert_ids(policy, experts[k])) for k in picked]
    sampler = policy
    sampling = Sampling(q.explore_temperature, q.explore_top_p, cfg.agent.max_new_tokens, top_k=q.explore_top_k)
    queue: list[tuple[int, Node]] = [(k, tree.root) for k, tree in enumerate(trees)]
    experts_added = not q.expert_branches
    stats = {"waves": 0, "episodes": 0, "resets": 0, "env_steps": 0, "replay_steps": 0, "duplicates": 0,
             "replay_mismatches": 0}
    wave = 0
    while True:
        todo: list[tuple[int, Node, bool]] = []  # (tree, node, expanded from the queue)
        requeue: list[tuple[int, Node]] = []
        for k, node in queue:
            if node.budget is None:  # first visit: QLASS samples up to samples_per_depth children in all
                node.budget = max(0, q.samples_per_depth - len(node.children))
            if node.budget > 0:
                node.budget -= 1
                todo.append((k, node, True))
                if node.budget > 0:
                    requeue.append((k, node))
        if not todo and not experts_added:
            # As in QLASS, the expert trajectory joins the tree after the exploration, with one rollout
            # branching off each of its first max_depth-1 steps (those branches are not expanded further).
            experts_added = True
            for k, tree in enumerate(trees):
                path = tree.insert(tree.root.traj)
                todo.extend((k, n, False) for n in path[: min(len(path) - 1, q.max_depth - 1)])
        if not todo:
            break

        def branches(todo: list[tuple[int, Node, bool]] = todo, wave: int = wave) -> dict[str, Any]:
            prompts = []
            for _, node, from_queue in todo:
                siblings = list(node.children)
                suffix = diversity_suffix(siblings) if q.diversity_prompt and from_queue and siblings else ""
                prompts.append(node_prompt_ids(sampler.renderer, node, window, suffix))
            gens = sampler.generate(prompts, dataclasses.replace(sampling, seed=cfg.seed * 7919 + wave))
            kept, dups = [], 0
            for (k, node, from_queue), gen in zip(todo, gens, strict=True):
                parsed = parse_action(gen.text)
                key = parsed if parsed is not None else f"<format error> {gen.text}"
                if key in node.children:  # QLASS skips a sample that repeats an explored action
                    dups += 1
                    continue
                kept.append({"tree": k, "node": list(node.key), "queue": from_queue, "ids": gen.token_ids,
                             "logprobs": gen.logprobs, "text": gen.text})
            return {"branches": kept, "duplicates": dups}

        planned = run.phase(f"qlass/trees/wave-{wave}/branches", branches)
        forced: dict[int, list[tuple[list[int], str]]] = {}
        expected: dict[int, list[str]] = {}
        requests = []
        for slot, b in enumerate(planned["branches"]):
            tree = trees[b["tree"]]
            node = tree.find(b["node"])
            path = [tree.find(node.key[:d]) for d in range(1, node.t + 1)]
            forced[slot] = [(n.step.action_ids, n.step.action_text) for n in path] + [(b["ids"], b["text"])]
            expected[slot] = [n.step.next_obs for n in path]
            requests.append(EpisodeRequest(tree.task, slot, meta={"wave": wave, "branch_t": node.t + 1}))
        actor = ReplayActor(PolicyActor(sampler, run.signal_env.instruction(), window,
                                        dataclasses.replace(sampling, seed=cfg.seed * 7919 + 104729 + wave)),
                            forced, expected)
        trajs = run.collect(actor, requests, f"qlass/trees/wave-{wave}", f"qlass trees wave {wave}")
        next_queue = list(requeue)
        for traj in sorted(trajs, key=lambda tr: tr.meta["slot"]):
            b = planned["branches"][traj.meta["slot"]]
            tree = trees[b["tree"]]
            path = tree.insert(traj)
            branch_t = int(traj.meta["branch_t"])
            if b["queue"]:
                next_queue.extend((b["tree"], n) for n in nodes_to_expand(
                    path, branch_t, traj.final_reward, q.max_depth, q.min_prune_depth, q.prune_reward))
            m = summarize([traj])
            replayed = sum(1 for s in traj.steps[: branch_t - 1] if s.parsed_action is not None)
            stats["episodes"] += 1
            stats["resets"] += 1
            stats["env_steps"] += m["env_steps"]
            stats["replay_steps"] += replayed
        stats["duplicates"] += planned["duplicates"]
        stats["replay_mismatches"] += actor.mismatches
        queue = next_queue
        wave += 1
    stats["waves"] = wave
    stats["trees"] = len(trees)
    stats["nodes"] = sum(len(t.nodes()) for t in trees)
    return trees, stats


# -- 2./3. Q labels and the QNet -----------------------------------------------------------------


class QNet(torch.nn.Module):
    """The SFT LLM with an MLP head on every token's last hidden state: one scalar Q per token position."""

    def __init__(self, lm: Any, head_hidden: int = 1024) -> None:
        super().__init__()
        self.lm = lm
        self.head_hidden = head_hidden
        h = lm.config.hidden_size
        self.head = torch.nn.Sequential(
            torch.nn.Linear(h, head_hidden), torch.nn.ReLU(),
            torch.nn.Linear(head_hidden, head_hidden), torch.nn.ReLU(),
            torch.nn.Linear(head_hidden, 1, bias=False),
        )
        self.head.to(next(lm.parameters()).device)  # fp32 like the critic's heads, whatever the LM's dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden.to(self.head[0].weight.dtype)).squeeze(-1)

    def save_pretrained(self, path: str | Path) -> None:
        """model.safetensors with every weight (tied ones copied) + the LM config + the head width."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in self.state_dict().items()},
                  str(path / "model.safetensors"))
        self.lm.config.save_pretrained(path)
        (path / "qnet.json").write_text(json.dumps({"head_hidden": self.head_hidden}))

    @classmethod
    def load(cls, path: str | Path) -> QNet:
        """Rebuild a saved QNet."""
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        lm = placement.place(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
        qnet = cls(lm, json.loads((path / "qnet.json").read_text())["head_hidden"])
        qnet.load_state_dict(load_file(str(path / "model.safetensors"), device=str(placement.device())))
        return qnet.eval()


def qnet_samples(renderer: Any, trees: list[Tree], gamma: float, window: int, max_length: int,
                 max_nodes: int | None, seed: int) -> list[StepSample]:
    """One row per (sampled) tree node: the node's prompt + reply, labelled with its normalised Q."""
    rng = random.Random(seed)
    out = []
    for k, tree in enumerate(trees):
        labelled = normalised_labels(tree, gamma)
        if max_nodes is not None and len(labelled) > max_nodes:
            labelled = rng.sample(labelled, max_nodes)
        for node, label in labelled:
            reply = list(node.step.action_ids)
            prompt = step_prompt_ids(renderer, node.traj, node.t, window)[-max(1, max_length - len(reply)):]
            out.append(StepSample(prompt + reply, [(len(prompt), len(prompt) + len(reply))], k, [node.t],
                                  labels={"q": [label]}))
    return out


def qnet_loss_fn(tokens: str) -> Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """MSE of the per-token Q against the row's label, over every token ('all') or the reply ('reply')."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        q = model(batch["input_ids"], batch["attention_mask"])
        reply = batch["action_mask"]
        label = (batch["q"] * reply).sum(-1) / reply.sum(-1).clamp(min=1)  # the row's label, on its reply tokens
        err = (q - label.unsqueeze(-1)) ** 2
        mask = batch["attention_mask"].float() if tokens == "all" else reply
        with torch.no_grad():
            last = (batch["attention_mask"].sum(-1) - 1).clamp(min=0)
            rows = torch.arange(q.shape[0], device=q.device)
            last_mse = float(err[rows, last].mean())
        return aggregate(err, mask, "token-mean"), {"mse_last_token": last_mse, "label_mean": float(label.mean())}

    return loss_fn


@torch.no_grad()
def qnet_scores(qnet: QNet, sequences: list[list[int]], pad_id: int, batch_size: int = 16) -> list[float]:
    """Q at the last token of each sequence."""
    qnet.eval()
    device = next(qnet.parameters()).device
    out: list[float] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        ids, mask = pad_sequences(chunk, pad_id)
        q = qnet(ids.to(device), mask.to(device)).float().cpu()
        out.extend(q[row, len(s) - 1].item() for row, s in enumerate(chunk))
    return out


# -- 4. Q-guided inference -----------------------------------------------------------------------


Call = tuple[int, str, tuple[Any, ...]]  # (env index, method, args) for the env pool


@dataclass
class _Guided:
    """An episode under Q-guided selection."""

    request: EpisodeRequest
    slot: int  # its block of n_candidates workers
    first_obs: str = ""
    goal: str = ""
    obs: str = ""
    steps: list[Step] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"resets": 0, "replay_steps": 0, "candidate_steps": 0,
                                                             "replay_mismatches": 0})


def q_guided_episodes(
    policy: Any,
    score: Callable[[list[list[int]]], list[float]],
    pool: Any,
    requests: list[EpisodeRequest],
    signal_env: Any,
    instruction: str,
    window: int,
    sampling: Sampling,
    n_candidates: int,
    terminal_uses_reward: bool,
    max_length: int,
    on_done: Callable[[EpisodeRequest, Trajectory], None] | None = None,
    max_retries: int = 3,
) -> list[Trajectory]:
    """Play each request choosing, at every step, the best of n_candidates sampled replies (see module doc).

    Every candidate is executed in a fresh copy of the episode: reset, replay the chosen commands, step the
    candidate. Per episode, meta counts resets, replayed steps, candidate steps and replay mismatches. A copy whose
    env crashed or hung is replayed again from its reset, up to max_retries times (`_map_segments`); an episode
    with a copy still failing is recorded as an errored episode (no steps, reward 0, meta "error"), as in
    run_episodes, and the others go on.
    """
    n_slots = pool.size // n_candidates
    if n_slots < 1:
        raise AgentevoError(f"Q-guided inference needs a pool of at least {n_candidates} envs (got {pool.size})")
    pending = list(requests)[::-1]
    free = list(range(n_slots))[::-1]
    active: list[_Guided] = []
    results: dict[int, Trajectory] = {}
    calls_made = 0

    def errored(ep: _Guided, exc: Exception) -> None:
        traj = Trajectory(
            task=ep.request.task, source="qlass", policy_id=policy.policy_id, instruction=instruction, steps=[],
            final_reward=final_reward([], signal_env.final_reward_mode), success=False, goal=ep.goal,
            meta={**ep.request.meta, **ep.counts, "error": str(exc)},
        )
        log.error("Q-guided episode %s: its environment crashed or hung past %d retries; recorded as an errored "
                  "episode; last error: %s", ep.request.task.task_id, max_retries, exc)
        results[id(ep.request)] = traj
        free.append(ep.slot)
        if on_done is not None:
            on_done(ep.request, traj)

    def history(ep: _Guided) -> list[HistoryTurn]:
        return [HistoryTurn(s.action_ids, s.next_obs) for s in ep.steps]

    while pending or active:
        starting = []
        while pending and free:
            starting.append(_Guided(pending.pop(), free.pop()))
        if starting:
            resets = _map_segments(pool, [[(ep.slot * n_candidates, "reset", (ep.request.task,))] for ep in starting],
                                   max_retries)
            for ep, answer in zip(starting, resets, strict=True):
                if isinstance(answer, Exception):
                    errored(ep, answer)
                    continue
                ((obs, info),) = answer
                ep.first_obs = ep.obs = obs
                ep.goal = str(info.get("goal", ""))
                ep.counts["resets"] += 1
                active.append(ep)
        if not active:  # every episode that started errored on its reset
            continue
        # Sample N candidates per episode in one batched call.
        prompts = []
        for ep in active:
            messages = build_messages(instruction, ep.goal, ep.first_obs, history(ep), window)
            prompts.append(policy.renderer.render(messages, add_generation_prompt=True).ids)
        seeded = dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + calls_made)
        calls_made += 1
        gens = policy.generate([p for p in prompts for _ in range(n_candidates)], seeded)
        # Execute every candidate in its own replayed copy of the episode.
        segments: list[list[Call]] = []  # one per executed candidate: reset, replay, step
        where: dict[tuple[int, int], int] = {}  # (episode, candidate) -> its segment
        for e, ep in enumerate(active):
            chosen = [s.parsed_action for s in ep.steps if s.parsed_action is not None]
            for c in range(n_candidates):
                action = parse_action(gens[e * n_candidates + c].text)
                if action is None:
                    continue  # a format error never reaches the env: its outcome is known
                w = ep.slot * n_candidates + c
                where[(e, c)] = len(segments)
                segments.append([(w, "reset", (ep.request.task,)), *((w, "step", (a,)) for a in chosen),
                                 (w, "step", (action,))])
                ep.counts["resets"] += 1
                ep.counts["replay_steps"] += len(chosen)
                ep.counts["candidate_steps"] += 1
        answers = _map_segments(pool, segments, max_retries)
        broken = {e: answers[k] for (e, _), k in where.items() if isinstance(answers[k], Exception)}
        for e, exc in broken.items():
            errored(active[e], exc)
        outcomes: dict[int, list[tuple[str, float, bool, dict[str, Any]]]] = {}  # by episode, errored ones left out
        to_score: list[tuple[int, int]] = []
        sequences: list[list[int]] = []
        for e, ep in enumerate(active):
            if e in broken:
                continue
            per = []
            replay_obs = [s.next_obs for s in ep.steps if s.parsed_action is not None]
            for c in range(n_candidates):
                gen = gens[e * n_candidates + c]
                if (e, c) in where:
                    segment = answers[where[(e, c)]]
                    replayed = [answer[0] for answer in segment[1:-1]]
                    ep.counts["replay_mismatches"] += sum(a != b for a, b in zip(replayed, replay_obs, strict=True))
                    per.append(segment[-1])
                else:
                    score_now = ep.steps[-1].score if ep.steps else 0.0
                    per.append((FORMAT_ERROR_OBSERVATION, 0.0, False, {"score": score_now, "success": False}))
                if not (per[-1][2] and terminal_uses_reward):
                    seq = prompts[e] + list(gen.token_ids)
                    sequences.append(seq[-max_length:])
                    to_score.append((e, c))
            outcomes[e] = per
        scored = dict(zip(to_score, score(sequences), strict=True)) if sequences else {}
        still = []
        for e, ep in enumerate(active):
            if e in broken:
                continue  # recorded by errored(), its slot freed
            scores_so_far = [s.score for s in ep.steps]
            values = []
            for c in range(n_candidates):
                _, _, done, info = outcomes[e][c]
                if done and terminal_uses_reward:
                    values.append(final_reward(scores_so_far + [float(info.get("score", 0.0))],
                                               signal_env.final_reward_mode))
                else:
                    values.append(scored[(e, c)])
            best = max(range(n_candidates), key=lambda c: values[c])  # first of equal values
            gen = gens[e * n_candidates + best]
            next_obs, reward, done, info = outcomes[e][best]
            action = parse_action(gen.text)
            t = len(ep.steps) + 1
            ep.steps.append(Step(
                t=t, obs=ep.obs, action_text=gen.text, action_ids=list(gen.token_ids),
                logprobs=list(gen.logprobs) if gen.logprobs else None, parsed_action=action, next_obs=next_obs,
                reward=float(reward), done=bool(done), score=float(info.get("score", 0.0)),
                signal=signal_env.signals(ep.obs, action or "", next_obs, action is not None),
                info={"success": bool(info.get("success", False)), "q_values": values, "chosen": best},
            ))
            ep.obs = next_obs
            if done or t >= ep.request.task.max_steps:
                traj = Trajectory(
                    task=ep.request.task, source="qlass", policy_id=policy.policy_id, instruction=instruction,
                    steps=ep.steps, final_reward=final_reward([s.score for s in ep.steps],
                                                              signal_env.final_reward_mode),
                    success=bool(info.get("success", False)), goal=ep.goal,
                    meta={**ep.request.meta, **ep.counts},
                )
                results[id(ep.request)] = traj
                free.append(ep.slot)
                if on_done is not None:
                    on_done(ep.request, traj)
            else:
                still.append(ep)
        active = still
    return [results[id(r)] for r in requests if id(r) in results]


def _map_segments(pool: Any, segments: list[list[Call]], max_retries: int) -> list[list[Any] | Exception]:
    """Run independent call segments on the pool (each on its own env, starting with a reset): the answers of each,
    or its last error. A segment whose env crashed or hung (EnvCrashedError) is run again from its reset on the
    restarted env, up to max_retries times; any other error stops inference with a one-line AgentevoError."""
    results: list[list[Any] | Exception] = [[] for _ in segments]
    todo = list(range(len(segments)))
    for attempt in range(max_retries + 1):
        answers = iter(pool.map([call for k in todo for call in segments[k]]))
        failed = []
        for k in todo:
            got = [next(answers) for _ in segments[k]]
            error = next((a for a in got if isinstance(a, Exception)), None)
            if error is not None and not isinstance(error, EnvCrashedError):
                raise AgentevoError(f"Q-guided inference: environment call failed: {error}") from error
            results[k] = got if error is None else error
            if error is not None:
                failed.append(k)
                pool.restart(segments[k][0][0])
                if attempt < max_retries:
                    log.warning("Q-guided inference: env %d crashed or hung (%s); replaying its copy, retry %d/%d",
                                segments[k][0][0], error, attempt + 1, max_retries)
        todo = failed
        if not todo:
            break
    return results


def q_guided_evaluate(run: Run, policy: TransformersPolicy, qnet: QNet, label: str) -> dict[str, dict[str, Any]]:
    """Q-guided evaluation on the configured splits (stored as eval/<label>/<split>), with env-step counts."""
    cfg, q = run.cfg, run.cfg.qlass
    out = {}
    for split in cfg.eval.splits:
        tasks = run.tasks(split, cfg.eval.n_tasks)
        collection = eval_collection(label, split)
        done = run.store.done_slots(collection)
        todo = [EpisodeRequest(t, k) for k, t in enumerate(tasks) if k not in done]
        if todo:
            with run.pool(cfg.rollout.n_parallel * q.n_candidates) as pool, \
                    run.progress(f"eval {label} on {split}", len(tasks)) as bar:
                bar.advance(len(tasks) - len(todo))

                def store(req: EpisodeRequest, traj: Trajectory, collection: str = collection) -> None:
                    run.store.add(traj, collection, req.slot)
                    bar.advance()

                q_guided_episodes(
                    policy, lambda seqs: qnet_scores(qnet, seqs, policy.pad_id, cfg.rollout.batch_size), pool, todo,
                    run.signal_env, run.signal_env.instruction(), cfg.agent.history_window,
                    Sampling(q.candidate_temperature, 1.0, cfg.agent.max_new_tokens, seed=cfg.seed * 31 + 7),
                    q.n_candidates, q.terminal_uses_reward, cfg.optim.max_length, store, cfg.rollout.max_retries,
                )
        trajs = run.store.load(collection=collection)
        metrics = {**summarize(trajs), "task_hash": tasks.hash, "split": split}
        for key in ("resets", "replay_steps", "candidate_steps", "replay_mismatches"):
            metrics[f"inference_{key}"] = sum(int(t.meta.get(key, 0)) for t in trajs)
        # Every env.step the selection made: replays of the chosen prefix plus one per executed candidate.
        metrics["inference_env_steps"] = metrics["inference_replay_steps"] + metrics["inference_candidate_steps"]
        run.logger.log(eval_collection(label, split), 0, {k: v for k, v in metrics.items() if k != "split"})
        out[split] = metrics
    return out


# -- the recipe ----------------------------------------------------------------------------------


def run(run: Run) -> dict[str, Any]:
    """QLASS end to end: BC warm start, exploration trees, QNet, Q-guided evaluation."""
    cfg, q = run.cfg, run.cfg.qlass
    results = warm_start(run)
    expert_steps = summarize(run.store.load(collection="expert")).get("env_steps", 0)

    def trees_phase() -> dict[str, Any]:
        _, stats = build_trees(run, run.load_policy("bc"))
        return stats

    tree_stats = run.phase("qlass/trees", trees_phase)
    results["qlass/trees"] = tree_stats

    def qnet_phase() -> dict[str, Any]:
        policy = run.load_policy("bc")
        trees, _ = build_trees(run, policy)  # every wave is recorded: this only rebuilds them from the store
        samples = qnet_samples(policy.renderer, trees, q.gamma, cfg.agent.history_window, cfg.optim.max_length,
                               q.max_nodes_per_tree, cfg.seed)
        labels = [s.labels["q"][0] for s in samples]
        qnet = QNet(policy.model, q.head_hidden)
        optim = dataclasses.replace(cfg.optim, lr=q.lr, epochs=q.epochs, batch_size=q.batch_size,
                                    micro_batch_size=q.micro_batch_size, warmup_ratio=q.warmup_ratio,
                                    padding_free=False)  # the Q-net reads each row's last token: rows stay padded
        with run.progress("QNet training") as bar:
            stats = train(qnet, samples, qnet_loss_fn(q.loss_tokens), optim, policy.pad_id,
                          run.checkpoint_dir("qnet-work"), cfg.seed, run.logger, "qlass/qnet/train", policy.tokenizer,
                          bar.training_callback())
        with replacing_dir(run.checkpoint_dir("qnet")) as tmp:
            qnet.save_pretrained(tmp)
            policy.tokenizer.save_pretrained(tmp)
        return {**stats, "samples": len(samples), "label_mean": sum(labels) / max(1, len(labels)),
                "label_nonzero": sum(v > 0 for v in labels) / max(1, len(labels))}

    results["qlass/qnet"] = run.phase("qlass/qnet", qnet_phase)
    results["eval/qlass"] = run.phase(
        "eval/qlass", lambda: q_guided_evaluate(run, run.load_policy("bc"), QNet.load(run.checkpoint_dir("qnet")),
                                                "qlass"))
    train_steps = expert_steps + tree_stats["env_steps"]
    results["env_steps"] = {"expert": expert_steps, "trees": tree_stats["env_steps"],
                            "trees_replay": tree_stats["replay_steps"], "total": train_steps}
    record = {"env_steps_expert": expert_steps, "env_steps_trees": tree_stats["env_steps"],
              "env_steps_trees_replay": tree_stats["replay_steps"], "env_steps_total": train_steps}
    for split, metrics in results["eval/qlass"].items():
        record[f"{split}_success_rate"] = metrics["success_rate"]
        record[f"{split}_avg_reward"] = metrics["avg_reward"]
        record[f"{split}_inference_env_steps"] = metrics["inference_env_steps"]
    run.logger.log("qlass", 1, record)
    return results
