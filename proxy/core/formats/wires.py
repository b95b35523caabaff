"""Which wire format a provider speaks, and which calls can be sent to it.

An OpenAI-style provider (``openai``, ``azure``, ``simulated``) takes every endpoint's
calls in OpenAI's formats, and Messages calls translated to Chat Completions; an
``anthropic`` provider takes Messages calls as they are, and Chat Completions calls
translated to Messages (``chat_to_messages``, ``messages_to_chat``; answers back by
``chat`` and ``messages``). Nothing else crosses: a Responses, legacy completions or
embeddings call never goes to Anthropic.
"""

from __future__ import annotations

from typing import Literal

from .request import Kind

Wire = Literal["openai", "messages"]
WIRE_OF: dict[str, Wire] = {"openai": "openai", "azure": "openai", "simulated": "openai",
                            "anthropic": "messages"}
# The path a call of each kind goes to, relative to the provider's base URL, by its wire.
MESSAGES_PATH = "/v1/messages"
_TO_MESSAGES: frozenset[Kind] = frozenset({"chat", "messages"})


def speaks(provider_kind: str, kind: Kind) -> bool:
    """Whether a call of ``kind`` can go to a provider of ``provider_kind``."""
    return WIRE_OF.get(provider_kind, "openai") == "openai" or kind in _TO_MESSAGES


def translation(provider_kind: str, kind: Kind) -> str | None:
    """How a call of ``kind`` is translated for a provider of ``provider_kind``:
    ``chat_to_messages``, ``messages_to_chat``, or None (sent as it is)."""
    wire = WIRE_OF.get(provider_kind, "openai")
    if wire == "messages" and kind == "chat":
        return "chat_to_messages"
    if wire == "openai" and kind == "messages":
        return "messages_to_chat"
    return None
