"""The loopback server's chat template: messages rendered into the served model's token ids, server-side.

The real servers render chat messages with the model's template, so the
token ids behind the routes are the server's, never the caller's text. This
template does the same, deterministically, for a model of `vocab_size`
tokens (at least `FIRST_TEXT_ID + 1`):

- each message is `[START, role] + text(content) + [END]` (roles `system`,
  `user`, `assistant`, `tool`, ids 2..5), then the generation prompt
  `[START, ASSISTANT]`;
- a character of the Unicode private-use block at `TOKEN_CHAR_BASE + t` is
  token `t` itself (this is how generated tokens come back as text: the
  server's answer text holds one such character per generated token, so an
  assistant message echoing it re-renders into the very tokens generated);
  any other character `c` is token `FIRST_TEXT_ID + ord(c) % (vocab_size - FIRST_TEXT_ID)`.

So turn 2's rendered prompt starts with turn 1's prompt and generated tokens,
then `END` and the new messages: the layout a multi-turn trace depends on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FIRST_TEXT_ID", "ROLES", "TOKEN_CHAR_BASE", "render_messages", "tokens_as_text"]

START, END = 0, 1
#: Role -> its token id.
ROLES = {"system": 2, "user": 3, "assistant": 4, "tool": 5}
#: The first id text characters map to (below it: the template's own tokens).
FIRST_TEXT_ID = 6
#: Private-use character `TOKEN_CHAR_BASE + t` stands for token `t`.
TOKEN_CHAR_BASE = 0xE000
# The most messages and characters one request may carry (checked before rendering).
_MAX_MESSAGES = 1024
_MAX_CHARS = 1 << 20


def tokens_as_text(token_ids: list[int]) -> str:
    """The answer text of generated `token_ids`: one private-use character per token.

    Examples:
        >>> render_messages([{"role": "assistant", "content": tokens_as_text([9, 7])}], 64, generation_prompt=False)
        [0, 4, 9, 7, 1]
    """
    return "".join(chr(TOKEN_CHAR_BASE + t) for t in token_ids)


def render_messages(messages: Any, vocab_size: int, *, generation_prompt: bool = True) -> list[int]:
    """`messages` rendered with the template (see the module docstring).

    Raises:
        TypeError: `messages` is not a list of objects with a string `role`
            and a string (or list of `{"type": "text", "text"}` parts) `content`.
        ValueError: No messages, too many, an unknown role, or a model too small for the template.
    """
    if vocab_size <= FIRST_TEXT_ID:
        raise ValueError(f"the chat template needs a vocabulary of more than {FIRST_TEXT_ID} tokens, got {vocab_size}")
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list, got {type(messages).__name__}")
    if not 0 < len(messages) <= _MAX_MESSAGES:
        raise ValueError(f"messages must hold 1 .. {_MAX_MESSAGES} messages, got {len(messages)}")
    out: list[int] = []
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r:.40}")
        text = _content(message.get("content"), i)
        chars += len(text)
        if chars > _MAX_CHARS:
            raise ValueError(f"messages hold more than {_MAX_CHARS} characters")
        out += [START, ROLES[role], *(_char_token(c, vocab_size) for c in text), END]
    if generation_prompt:
        out += [START, ROLES["assistant"]]
    return out


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise TypeError(f"messages[{i}].content[{j}] must be a {{'type': 'text', 'text': str}} part")
            parts.append(part["text"])
        return "".join(parts)
    raise TypeError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def _char_token(c: str, vocab_size: int) -> int:
    code = ord(c) - TOKEN_CHAR_BASE
    if 0 <= code < vocab_size:
        return code
    return FIRST_TEXT_ID + ord(c) % (vocab_size - FIRST_TEXT_ID)
