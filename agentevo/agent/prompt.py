"""ReAct prompts with a bounded history window, action parsing, and templated thoughts for expert demos."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentevo.agent.chat import Message

FORMAT_ERROR_OBSERVATION = "Invalid format. The reply must contain a line 'Action: <command>'."

_ACTION_RE = re.compile(r"Action:[ \t]*(.*)")


def parse_action(reply: str) -> str | None:
    """The command after the last 'Action:' (up to the end of its line), or None for a format error."""
    found = _ACTION_RE.findall(reply.strip())
    if not found:
        return None
    action = found[-1].strip()
    return action or None


@dataclass
class HistoryTurn:
    """One past turn as the prompt needs it: the reply's token ids and the observation that followed."""

    action_ids: list[int]
    next_obs: str


def build_messages(
    instruction: str,
    goal: str,
    first_obs: str,
    history: list[HistoryTurn],
    window: int,
    prefix: str = "",
) -> list[Message]:
    """Messages for the next reply: instruction + task, the last `window` turns, the current observation.

    When turns are dropped, the first message restates the goal and the observation the kept turns start
    from, so the conversation stays coherent. `prefix` is extra context placed before the task (e.g. a
    privileged context for a teacher, or precedents at inference).
    """
    # A blank line after the prefix, whether or not it ends with a newline: a context's last line must not run
    # into the observation ("...score 0.00).Open the vault...").
    head = f"{instruction}\n\n{prefix.rstrip()}\n\n" if prefix.strip() else f"{instruction}\n\n"
    kept = history[-window:] if window > 0 else []
    dropped = len(history) - len(kept)
    if dropped == 0:
        first = f"{head}{first_obs}"
    else:
        start_obs = history[dropped - 1].next_obs
        first = f"{head}Goal: {goal}\n({dropped} earlier steps omitted.)\nObservation: {start_obs}"
    messages = [Message("user", first)]
    for turn in kept:
        messages.append(Message("assistant", ids=turn.action_ids))
        messages.append(Message("user", f"Observation: {turn.next_obs}"))
    return messages


_THOUGHTS = {
    "take": "I need the {obj}.",
    "open": "The {obj} may hold what I need.",
    "read": "The {obj} tells me what to do.",
    "put": "The {obj} goes there.",
    "cook": "The recipe says to cook the {obj}.",
    "slice": "The recipe says to slice the {obj}.",
    "dice": "The recipe says to dice the {obj}.",
    "chop": "The recipe says to chop the {obj}.",
    "prepare": "I have everything for the meal.",
    "eat": "The meal is ready.",
    "move": "I should go {obj}.",
    "go": "I should go to the {obj}.",
    "search": "I should search for {obj}.",
    "click": "I should click {obj}.",
    "answer": "I know the answer.",
}


def expert_reply(action: str, style: str = "template") -> str:
    """An expert reply in ReAct format; the thought is a short template derived from the action."""
    if style == "none":
        return f"Action: {action}"
    verb, _, rest = action.partition(" ")
    obj = re.split(r" (?:in|on|into|from|with|to) ", rest)[0].strip("[] ") or "it"
    template = _THOUGHTS.get(verb.lower(), "I should {verb} next.")
    return f"Thought: {template.format(obj=obj, verb=verb.lower())}\nAction: {action}"
