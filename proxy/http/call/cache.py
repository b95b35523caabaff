"""The response cache, opt-in per model (``models.<name>.cache: {ttl_s, max_entries}``).

Only deterministic calls are cached: chat, legacy completions and Anthropic Messages calls
with ``temperature: 0`` or a ``seed``. A call's fingerprint, which its entry is found by,
is the SHA-256 of the canonical request: the call's endpoint and key name (one key never
sees another's answers), the public model, and the body with its fields sorted, whole
numbers written alike (``0`` and ``0.0``) and the fields that do not change the answer
left out (``stream``, ``stream_options``, ``user``, ``metadata``, ``store``,
``service_tier``). An entry is in the client's format, whatever the provider's.
Identical calls arriving while one of them is on its way upstream wait for its answer
(until their own deadline) instead of going upstream too. An entry is the JSON answer as
the upstream gave it (a streamed answer is assembled into
one when it carries only text), at most ``MAX_ENTRY_BYTES``; a hit is served as JSON, or
replayed as a valid SSE stream when the call asks to stream. Entries live in a
``cachetools.TLRUCache`` per model, on the service clock, each until its own expiry.

With the redis backend the fleet shares the entries (``proxy.state.shared_answers``): an answer
is also stored in Redis (``pack``: a short orjson head, then the answer's bytes), with the
TTL as its Redis expiry; a call this replica has no entry for asks Redis once (``recall``)
and keeps what it finds here until the Redis entry's own expiry, never longer. Identical
calls still wait for one another per replica only.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import orjson
from cachetools import TLRUCache

from ...core.call.route import CacheSettings, ModelRoute
from ...core.clock import Clock
from ...core.formats import messages
from ...core.formats.events import End
from ...core.formats.request import Call
from ...core.value import value
from ...state.base import Answers

CACHED_KINDS = frozenset({"chat", "completions", "messages"})
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store",
                            "service_tier"})
MAX_ENTRY_BYTES = 1 << 20
PACKED = 1  # the format ``pack`` writes: a head of another one reads as a miss


@value
class Entry:
    answer: bytes  # the JSON answer
    deployment: str
    prompt_tokens: int | None
    completion_tokens: int | None


def deterministic(body: Mapping[str, Any]) -> bool:
    temperature = body.get("temperature")
    zero = (isinstance(temperature, int | float) and not isinstance(temperature, bool)
            and temperature == 0)
    return zero or body.get("seed") is not None


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def fingerprint_of(key_name: str, call: Call) -> bytes:
    body = {k: v for k, v in call.body.items() if k not in IGNORED_FIELDS and k != "model"}
    canonical = orjson.dumps([call.kind, key_name, call.model, _canonical(body)],
                             option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).digest()


def pack(entry: Entry) -> bytes:
    """An entry as stored in Redis: its head as orjson (which never writes a raw newline),
    a newline, then the answer's bytes as they are."""
    head = [PACKED, entry.deployment, entry.prompt_tokens, entry.completion_tokens]
    return orjson.dumps(head) + b"\n" + entry.answer


def unpack(data: bytes) -> Entry | None:
    """``pack``'s entry, or None for anything else."""
    head, newline, answer = data.partition(b"\n")
    try:
        fields = orjson.loads(head)
    except orjson.JSONDecodeError:
        return None
    if not (newline and answer and isinstance(fields, list) and len(fields) == 4
            and fields[0] == PACKED and isinstance(fields[1], str)):
        return None
    prompt, completion = fields[2], fields[3]
    counts = [n if isinstance(n, int) and not isinstance(n, bool) else None
              for n in (prompt, completion)]
    return Entry(answer, fields[1], counts[0], counts[1])


def _until(_key: bytes, kept: tuple[Entry, float], _now: float) -> float:
    return kept[1]


Local = TLRUCache[bytes, tuple[Entry, float]]  # fingerprint → (entry, when it expires)


class ResponseCache:
    def __init__(self, clock: Clock, shared: Answers | None = None) -> None:
        """``shared``: the fleet's entries (redis backend), behind this replica's own."""
        self._clock = clock
        self._shared = shared
        self._caches: dict[str, tuple[CacheSettings, Local]] = {}
        # Misses on their way upstream, by fingerprint: identical calls wait for the answer
        # instead of going upstream too (one entry per call in flight, so bounded by them).
        self._flights: dict[bytes, asyncio.Event] = {}

    @property
    def across_replicas(self) -> bool:
        return self._shared is not None

    def flight(self, fingerprint: bytes) -> asyncio.Event | None:
        """Set when the identical call fetching ``fingerprint`` is done (None: none)."""
        return self._flights.get(fingerprint)

    def take_off(self, fingerprint: bytes) -> asyncio.Event:
        """This call fetches ``fingerprint``; ``land`` it however it ends."""
        event = self._flights[fingerprint] = asyncio.Event()
        return event

    def land(self, fingerprint: bytes, event: asyncio.Event) -> None:
        if self._flights.get(fingerprint) is event:
            del self._flights[fingerprint]
        event.set()

    def configure(self, models: Mapping[str, ModelRoute]) -> None:
        """The models' cache settings as configured now: a cache whose settings did not
        change keeps its entries."""
        caches = {}
        for name, route in models.items():
            if route.cache is None:
                continue
            found = self._caches.get(name)
            caches[name] = found if found is not None and found[0] == route.cache else (
                route.cache, TLRUCache(route.cache.max_entries, _until,
                                       timer=self._clock.now))
        self._caches = caches

    def applies(self, call: Call) -> bool:
        return (call.model in self._caches and call.kind in CACHED_KINDS
                and deterministic(call.body))

    def get(self, model: str, fingerprint: bytes) -> Entry | None:
        """This replica's entry (no I/O)."""
        found = self._caches.get(model)  # a model with only a semantic cache has none
        kept = None if found is None else found[1].get(fingerprint)
        return None if kept is None else kept[0]

    async def recall(self, model: str, fingerprint: bytes) -> Entry | None:
        """The fleet's entry (one round trip to Redis; None without it, or when it fails),
        kept here too until it expires there."""
        if self._shared is None:
            return None
        asked = self._clock.now()  # Redis' seconds left count from after this
        found = await self._shared.recall(fingerprint)
        cache = self._caches.get(model)
        entry = None if found is None else unpack(found[0])
        if found is None or entry is None or cache is None:
            return None
        settings, local = cache
        local[fingerprint] = (entry, asked + min(settings.ttl_s, found[1]))
        return entry

    def put(self, model: str, fingerprint: bytes, entry: Entry) -> None:
        found = self._caches.get(model)
        if found is None or len(entry.answer) > MAX_ENTRY_BYTES:
            return
        settings, local = found
        local[fingerprint] = (entry, self._clock.now() + settings.ttl_s)
        if self._shared is not None:
            self._shared.keep(model, fingerprint, pack(entry), settings.ttl_s,
                              settings.max_entries)

    def size(self, model: str) -> int:
        found = self._caches.get(model)
        if found is None:
            return 0
        found[1].expire()
        return len(found[1])


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def replay(kind: str, answer: bytes, include_usage: bool) -> bytes:
    """A cached JSON answer as the SSE stream the upstream would have sent."""
    if kind == "messages":
        encoder = messages.MessagesStreamEncoder()
        return b"".join(encoder.encode(event) for event in messages.decode_answer(answer))
    whole = orjson.loads(answer)
    head = {k: whole[k] for k in ("id", "created", "model", "system_fingerprint")
            if k in whole}
    events = []
    if kind == "chat":
        head["object"] = "chat.completion.chunk"
        for choice in whole.get("choices", []):
            message = dict(choice.get("message") or {})
            if isinstance(message.get("tool_calls"), list):
                message["tool_calls"] = [{"index": i, **call}
                                         for i, call in enumerate(message["tool_calls"])]
            index = choice.get("index", 0)
            events.append(_event({**head, "choices": [
                {"index": index, "delta": message, "logprobs": choice.get("logprobs"),
                 "finish_reason": None}]}))
            events.append(_event({**head, "choices": [
                {"index": index, "delta": {}, "logprobs": None,
                 "finish_reason": choice.get("finish_reason")}]}))
    else:
        head["object"] = "text_completion"
        for choice in whole.get("choices", []):
            events.append(_event({**head, "choices": [choice]}))
    if include_usage and isinstance(whole.get("usage"), dict):
        events.append(_event({**head, "choices": [], "usage": whole["usage"]}))
    return b"".join(events) + b"data: [DONE]\n\n"


def assemble(kind: str, payloads: list[bytes]) -> bytes | None:
    """A streamed answer's events as the one JSON answer a non-streamed call gets; None if
    they carry more than text (tool calls, logprobs, refusals) or do not parse."""
    if kind == "messages":
        return _assemble_message(payloads)
    head: dict[str, Any] = {}
    texts: dict[int, list[str]] = {}
    finish: dict[int, Any] = {}
    usage = None
    try:
        for data in payloads:
            chunk = orjson.loads(data)
            for field in ("id", "created", "model", "system_fingerprint"):
                if field in chunk and field not in head:
                    head[field] = chunk[field]
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                index = choice["index"]
                if choice.get("logprobs") is not None:
                    return None
                if kind == "chat":
                    delta = choice.get("delta") or {}
                    if set(delta) - {"role", "content"}:
                        return None
                    piece = delta.get("content")
                else:
                    piece = choice.get("text")
                texts.setdefault(index, []).append(piece or "")
                if choice.get("finish_reason") is not None:
                    finish[index] = choice["finish_reason"]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not texts:
        return None
    choices = []
    for index in sorted(texts):
        text = "".join(texts[index])
        body: dict[str, Any] = ({"message": {"role": "assistant", "content": text,
                                             "refusal": None}}
                                if kind == "chat" else {"text": text})
        choices.append({"index": index, **body, "logprobs": None,
                        "finish_reason": finish.get(index)})
    whole = {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
             "choices": choices}
    if usage is not None:
        whole["usage"] = usage
    return orjson.dumps(whole)


def _assemble_message(payloads: list[bytes]) -> bytes | None:
    """A Messages stream's events as one ``message``, if it holds only text."""
    decoder = messages.MessagesStreamDecoder()
    events = []
    try:
        for data in payloads:
            event = orjson.loads(data)
            if (event.get("type") == "content_block_start"
                    and event["content_block"]["type"] != "text"):
                return None
            events += decoder.feed(b"data: " + data + b"\n\n")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    events += decoder.close()
    if not isinstance(events[-1], End):
        return None
    return messages.encode_answer(events)
