"""Lesson and reflection writers for RSD's hindsight context (methods-spec §4.3 step 3) and Reflexion (§5).

A writer turns finished trajectories into text:
    lessons(task_type, successes, failures) -> one lesson list for the task type (one per type per round [S])
    reflections(trajs, precedents) -> one reflection per trajectory: earliest critical mistake + better action [S]

Three writers share that interface:
    LLMWriter(PolicyChatClient(policy))  - the policy model itself writes (the paper's setting [S])
    LLMWriter(OpenAIChatClient(url, ...)) - any OpenAI-compatible endpoint, stdlib urllib only
    RuleWriter()                          - derived from env signals and score changes; the stand-in for tiny
                                            models that cannot write useful text [O]
A chat client only needs `chat_many(conversations, max_tokens) -> list[str]`, so another backend (for example
agentevo.models.http_backend) plugs in by providing that one method.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from agentevo.data.types import Trajectory
from agentevo.errors import AgentevoError

# Observations are clipped in writer prompts so one long page does not crowd out the rest of the episode [O].
_OBS_CHARS = 300


class ChatClient(Protocol):
    """Anything that answers chat conversations (lists of {'role', 'content'} dicts)."""

    def chat_many(self, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[str]: ...


class Writer(Protocol):
    """Writes lessons per task type and reflections per trajectory."""

    name: str

    def lessons(self, task_type: str, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> str: ...

    def reflections(self, trajs: Sequence[Trajectory], precedents: Sequence[Trajectory | None] | None = None,
                    ) -> list[str]: ...


# -- chat clients ----------------------------------------------------------------------------------------------


class OpenAIChatClient:
    """POST /chat/completions to an OpenAI-compatible server (vLLM, llama.cpp, OpenAI, ...) with urllib."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 temperature: float = 0.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout, self.temperature = model, api_key, timeout, temperature

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        """One completion's text."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": self.temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode())
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as exc:
            raise AgentevoError(f"chat endpoint {self.url} failed: {exc}") from exc
        try:
            return str(payload["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError) as exc:
            raise AgentevoError(f"chat endpoint {self.url} returned no choices[0].message.content: {payload}") from exc

    def chat_many(self, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[str]:
        """Completions one after the other (servers batch on their side)."""
        return [self.chat(c, max_tokens) for c in conversations]


class PolicyChatClient:
    """The policy model answers, greedily, in one batched generate call."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def chat_many(self, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[str]:
        from agentevo.agent.chat import Message
        from agentevo.models.backend import Sampling

        prompts = [
            self.policy.renderer.render([Message(m["role"], m["content"]) for m in conv], add_generation_prompt=True).ids
            for conv in conversations
        ]
        return [g.text.strip() for g in self.policy.generate(prompts, Sampling(temperature=0.0, max_new_tokens=max_tokens))]


def http_client_from_config(rsd: Any) -> OpenAIChatClient:
    """The endpoint client named by rsd.writer_url / writer_model / writer_api_key_env."""
    key = os.environ.get(rsd.writer_api_key_env) if rsd.writer_api_key_env else None
    return OpenAIChatClient(rsd.writer_url, rsd.writer_model, api_key=key)


# -- trajectory text ---------------------------------------------------------------------------------------------


def _clip(text: str, n: int = _OBS_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def trajectory_text(traj: Trajectory) -> str:
    """A finished episode as numbered steps plus its outcome (what writers read)."""
    lines = [f"Task: {traj.goal}", f"Start: {_clip(traj.first_obs)}"]
    for s in traj.steps:
        lines.append(f"Step {s.t}: Action: {s.parsed_action or '(no action line)'}")
        lines.append(f"  Observation: {_clip(s.next_obs)}")
    lines.append(outcome_text(traj))
    return "\n".join(lines)


def outcome_text(traj: Trajectory) -> str:
    """One line: success or failure, steps and score."""
    verdict = "success" if traj.success else "failure"
    return f"Outcome: {verdict} after {traj.length} steps (score {traj.final_reward:.2f})."


# -- the LLM writer ------------------------------------------------------------------------------------------------

LESSON_PROMPT = (
    "You are reviewing episodes of an agent on tasks of type '{task_type}'. Below are successful and failed "
    "episodes. Write a short numbered list of lessons (at most 5) that would help the agent succeed on new tasks "
    "of this type: what works, and which mistakes to avoid.\n\n{episodes}"
)
REFLECTION_PROMPT = (
    "Below is a finished episode of an agent and its outcome. Identify the earliest critical mistake (give its "
    "step index) and the better action the agent should have taken instead. Answer in two lines:\n"
    "Earliest critical mistake: step <k>, <what went wrong>\nBetter action: <command>\n\n{episode}"
)


class LLMWriter:
    """Lessons and reflections written by a chat model (the policy itself [S], or an endpoint)."""

    def __init__(self, client: ChatClient, max_tokens: int = 256, name: str = "llm") -> None:
        self.client, self.max_tokens, self.name = client, max_tokens, name

    def lessons(self, task_type: str, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> str:
        parts = [f"[Successful episode {k + 1}]\n{trajectory_text(t)}" for k, t in enumerate(successes)]
        parts += [f"[Failed episode {k + 1}]\n{trajectory_text(t)}" for k, t in enumerate(failures)]
        prompt = LESSON_PROMPT.format(task_type=task_type, episodes="\n\n".join(parts) or "(no episodes)")
        return self.client.chat_many([[{"role": "user", "content": prompt}]], self.max_tokens)[0].strip()

    def reflections(self, trajs: Sequence[Trajectory], precedents: Sequence[Trajectory | None] | None = None,
                    ) -> list[str]:
        # The prompt is the finished trajectory and its outcome only [S]; precedents are for the rule writer.
        convs = [[{"role": "user", "content": REFLECTION_PROMPT.format(episode=trajectory_text(t))}] for t in trajs]
        return [r.strip() for r in self.client.chat_many(convs, self.max_tokens)] if convs else []


# -- the rule-based writer ----------------------------------------------------------------------------------------

_BETTER_BY_SIGNAL = {
    "format": "a reply that ends with a line 'Action: <command>'",
    "invalid": "a command the game accepts, naming an object or exit from the observation",
    "repeat": "a different command that changes the state",
}
_WHY_BY_SIGNAL = {
    "format": "the reply had no 'Action:' line",
    "invalid": "the game rejected the command",
    "repeat": "nothing changed",
}


def critical_step(traj: Trajectory) -> tuple[int | None, str]:
    """The earliest critical mistake: first format/invalid/repeat step, else (failures) the first step after the
    last score increase; (None, '') for a clean success."""
    for s in traj.steps:
        if s.signal in _WHY_BY_SIGNAL:
            return s.t, _WHY_BY_SIGNAL[s.signal]
    if traj.success or not traj.steps:
        return None, ""
    last_gain, prev = 0, 0.0
    for s in traj.steps:
        if s.score > prev:
            last_gain = s.t
        prev = max(prev, s.score)
    t = min(last_gain + 1, traj.length)
    return t, "no progress was made from here on"


class RuleWriter:
    """Reflections and lessons from env signals and score changes (no language model) [O].

    The stand-in for tiny models: a reflection names the first format / invalid / repeated step (or, for a
    failure without such a step, the first step after the score last rose) and a better action taken from a
    solved precedent of the same task when one is given, else a generic fix for that kind of mistake. A lesson
    lists how successful episodes of the type began and which commands failed ones used that the game rejected.
    """

    name = "rule"

    def __init__(self, lesson_prefix_len: int = 3) -> None:
        self.lesson_prefix_len = lesson_prefix_len

    def reflection(self, traj: Trajectory, precedent: Trajectory | None = None) -> str:
        """Earliest critical mistake and a better action for one trajectory."""
        t, why = critical_step(traj)
        if t is None:
            return f"No critical mistake: the episode succeeded in {traj.length} steps."
        step = traj.steps[t - 1]
        better = _BETTER_BY_SIGNAL.get(step.signal, "an action that makes progress towards the goal")
        if precedent is not None and precedent.success and t - 1 < precedent.length:
            ref = precedent.steps[t - 1].parsed_action
            if ref and ref != step.parsed_action:
                better = ref
        action = step.parsed_action or "(no action line)"
        return f"Earliest critical mistake: step {t}, '{action}' ({why}). Better action: {better}."

    def reflections(self, trajs: Sequence[Trajectory], precedents: Sequence[Trajectory | None] | None = None) -> list[str]:
        refs = list(precedents) if precedents is not None else [None] * len(trajs)
        return [self.reflection(t, p) for t, p in zip(trajs, refs, strict=True)]

    def lessons(self, task_type: str, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> str:
        lines: list[str] = []
        if successes:
            openings = Counter(
                tuple(s.parsed_action for s in t.steps[: self.lesson_prefix_len] if s.parsed_action) for t in successes
            )
            opening, _ = openings.most_common(1)[0]
            mean_len = sum(t.length for t in successes) / len(successes)
            if opening:
                lines.append(f"Successful {task_type} episodes began with: {'; '.join(opening)}.")
            lines.append(f"They finished in {mean_len:.0f} steps on average.")
        if failures:
            rejected = Counter(s.parsed_action for t in failures for s in t.steps if s.signal == "invalid")
            if rejected:
                listed = ", ".join(f"'{a}' ({n}x)" for a, n in rejected.most_common(2))
                lines.append(f"Commands the game rejected in failed episodes: {listed}.")
            repeats = sum(s.signal == "repeat" for t in failures for s in t.steps)
            if repeats:
                lines.append(f"Failed episodes repeated commands without effect {repeats} times; avoid repeating.")
            formats = sum(s.signal == "format" for t in failures for s in t.steps)
            if formats:
                lines.append(f"{formats} replies had no 'Action:' line.")
            mean_score = sum(t.final_reward for t in failures) / len(failures)
            lines.append(f"Failed episodes reached a score of {mean_score:.2f} on average.")
        return " ".join(lines) if lines else "No lessons yet."


def make_writer(rsd: Any, policy: Any = None) -> Any:
    """The writer named by rsd.writer: 'rule', 'policy' (needs the policy) or 'http'."""
    if rsd.writer == "rule":
        return RuleWriter()
    if rsd.writer == "http":
        return LLMWriter(http_client_from_config(rsd), rsd.writer_max_tokens, name="http")
    if policy is None:
        raise AgentevoError("rsd.writer=policy needs the policy model")
    return LLMWriter(PolicyChatClient(policy), rsd.writer_max_tokens, name="policy")
