"""Chat-template rendering to token ids, with stored assistant token ids spliced in (never re-tokenized).

The template is rendered once as text with a sentinel in place of each assistant message; the text pieces
between sentinels are tokenized, and each assistant slot receives the exact token ids the policy produced.
Assistant spans are therefore known from token positions by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentevo.errors import ConfigError

_SENTINEL = "\u2063AGENTEVO_ASSISTANT_{}\u2063"

# Used for tokenizers that ship no chat template (e.g. base models such as Gemma 3 270M).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def load_chat_template(path: str | Path) -> str:
    """The text of a Jinja chat-template file (model.chat_template), checked to parse; ConfigError otherwise."""
    import jinja2

    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError, RuntimeError, ValueError) as exc:  # RuntimeError: '~nobody', ValueError: NUL
        raise ConfigError(f"model.chat_template {str(path)!r} cannot be read ({exc.__class__.__name__}); give a "
                          "Jinja file such as the chat_template.jinja of a model folder, or null") from None
    if not text.strip():
        raise ConfigError(f"model.chat_template {str(path)!r} is empty; give a Jinja chat template, or null")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"model.chat_template {str(path)!r} is not a valid Jinja template ({exc.message} at line "
                          f"{exc.lineno}); fix the file, or set model.chat_template to null") from None
    return text


def use_chat_template(tokenizer: Any, path: str | Path) -> None:
    """Replace the tokenizer's chat template with the file's; it is saved with every checkpoint of the tokenizer,
    so later loads render the same way."""
    import jinja2

    text = load_chat_template(path)
    tokenizer.chat_template = text
    try:
        ChatRenderer(tokenizer)  # probes the end-of-turn token: a template that cannot frame replies fails here
    except (ValueError, jinja2.TemplateError) as exc:
        raise ConfigError(f"model.chat_template {str(path)!r} cannot be used: {exc}") from None


@dataclass
class Message:
    """A chat message: text for system/user turns, token ids for assistant turns."""

    role: str
    text: str = ""
    ids: list[int] | None = None


@dataclass
class Rendered:
    """Token ids of a rendered conversation and the [start, end) span of each assistant message."""

    ids: list[int]
    assistant_spans: list[tuple[int, int]]


class ChatRenderer:
    """Renders message lists to token ids with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        self.end_of_turn_id = self._probe_end_of_turn()
        stops = {self.end_of_turn_id}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = sorted(stops)

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _probe_end_of_turn(self) -> int:
        """The first token the template emits after an assistant message: the token that ends a turn."""
        text = self.tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": _SENTINEL.format(0)},
                {"role": "user", "content": "v"},
            ],
            tokenize=False,
        )
        after = text.split(_SENTINEL.format(0), 1)[1]
        ids = self._encode(after)
        if not ids:
            raise ValueError("the chat template emits nothing after an assistant message; cannot find its end token")
        return ids[0]

    def render(self, messages: list[Message], add_generation_prompt: bool) -> Rendered:
        """Token ids for the conversation; assistant messages must carry ids."""
        payload = []
        slots: list[list[int]] = []
        for m in messages:
            if m.role == "assistant":
                if m.ids is None:
                    raise ValueError("assistant messages must carry the token ids the policy produced")
                payload.append({"role": "assistant", "content": _SENTINEL.format(len(slots))})
                slots.append(m.ids)
            else:
                payload.append({"role": m.role, "content": m.text})
        text = self.tokenizer.apply_chat_template(payload, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        rest = text
        slot_ends_turn = False
        for k, slot in enumerate(slots):
            before, rest = rest.split(_SENTINEL.format(k), 1)
            piece = self._encode(before)
            if slot_ends_turn and piece and piece[0] == self.end_of_turn_id:
                piece = piece[1:]  # the stored ids of the previous reply already end the turn
            ids.extend(piece)
            start = len(ids)
            ids.extend(slot)
            spans.append((start, len(ids)))
            slot_ends_turn = bool(slot) and slot[-1] == self.end_of_turn_id
        tail = self._encode(rest)
        if slot_ends_turn and tail and tail[0] == self.end_of_turn_id:
            tail = tail[1:]
        ids.extend(tail)
        return Rendered(ids, spans)

    def encode_reply(self, text: str) -> list[int]:
        """Token ids of a scripted (expert) reply, ending with the end-of-turn token as a generated one would."""
        return self._encode(text) + [self.end_of_turn_id]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids without special tokens."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
