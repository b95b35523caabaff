"""The soak's clients (scripts/soak.py): every call made, and what became of it.

A call goes to one replica that is up (the soak stops choosing a replica the moment it
kills or drains it, so no call is sent to a closed port) and ends in one ``outcome``:

- ``ok``: a status 2xx with a whole answer (JSON with choices; a stream up to ``[DONE]``);
- ``status``: another status (an answer; 5xx and 4xx are answers, but a 500 fails);
- ``stream_error``: a 200 stream ended by a ``data: {"error": ...}`` event (an answer);
- ``cut``: a 200 stream that ended with neither (fails);
- ``cancelled``: the client itself gave up (mid-queue, or mid-stream) as planned;
- ``killed``: a connection error on a replica generation SIGKILLed while the call ran;
- ``conn_error``: a connection error otherwise (fails);
- ``timeout``: no answer within the client's timeout (a hang: fails);
- ``bad_ok``: a bad body not answered 4xx (fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

TIERS = ("critical", "high", "normal", "low")
KEYS = {"k-a": "sk-soak-a", "k-b": "sk-soak-b", "k-c": "sk-soak-c",
        "k-budget": "sk-soak-budget", "k-batch": "sk-soak-batch"}
FAILING = frozenset({"cut", "conn_error", "timeout", "bad_ok", "bad_answer"})

BAD_BODIES: tuple[tuple[str, bytes], ...] = (
    ("truncated", b'{"model": "chat", "messages": [{"role": "user", "content": "hi'),
    ("not json", b"model=chat&messages=hi"),
    ("messages a string", b'{"model": "chat", "messages": "hi"}'),
    ("no model", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ("no messages", b'{"model": "chat"}'),
    ("stream not a bool", b'{"model": "chat", "stream": "yes", "messages": '
                          b'[{"role": "user", "content": "hi"}]}'),
    ("too deep", b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], '
                 b'"x": ' + b"[" * 100 + b"]" * 100 + b"}"),
    ("invalid utf-8", b'{"model": "chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("unknown model", b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'),
    ("empty", b""),
)


@dataclass
class Call:
    n: int
    kind: str  # json | stream | cancel_queue | cancel_stream | bad | budget
    tier: str
    key: str
    replica: int
    gen: int
    start: float
    end: float = 0.0
    status: int | None = None
    outcome: str = ""
    queue_ms: float | None = None
    code: str = ""  # the error's code, or the bad body's name
    detail: str = ""


class Clients:
    """One client session per replica generation (a restarted replica gets a fresh pool)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self.sessions: dict[tuple[int, int], aiohttp.ClientSession] = {}

    def session(self, replica: int, gen: int) -> aiohttp.ClientSession:
        found = self.sessions.get((replica, gen))
        if found is None:
            found = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))
            self.sessions[(replica, gen)] = found
        return found

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()


def _error_code(payload: bytes) -> str:
    try:
        found = orjson.loads(payload)
        return str(found["error"].get("code") or found["error"].get("type") or "")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return ""


def chat_body(call: Call, rng: random.Random, stream: bool, words: int,
              model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": words,
        "messages": [{"role": "user", "content": f"[{call.key}] c{call.n} tier {call.tier}: "
                                                 + "say something " * rng.randint(1, 6)}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _read_stream(call: Call, resp: aiohttp.ClientResponse, cancel_after: int) -> None:
    events = 0
    done = error = False
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                events += 1
                if data.startswith(b'{"error"') or b'"error":' in data[:40]:
                    error = True
                    call.code = _error_code(data)
        if cancel_after and events >= cancel_after and not done:
            call.outcome = "cancelled"
            resp.close()
            return
    call.outcome = "ok" if done and not error else "stream_error" if error else "cut"
    if call.outcome == "cut":
        call.detail = f"{events} events, no [DONE], no error event"


async def send(call: Call, session: aiohttp.ClientSession, base: str, body: bytes,
               cancel_after_s: float = 0.0, cancel_after_events: int = 0) -> None:
    """Make the call, setting its status and outcome (never raises but for a cancel from
    outside)."""
    headers = {"Authorization": f"Bearer {KEYS[call.key]}", "X-Priority": call.tier,
               "Content-Type": "application/json", "X-Request-Id": f"soak-c{call.n}"}

    async def go() -> None:
        async with session.post(f"{base}/v1/chat/completions", data=body,
                                headers=headers) as resp:
            call.status = resp.status
            queued = resp.headers.get("x-proxy-queue-ms")
            call.queue_ms = float(queued) if queued is not None else None
            if call.kind == "bad":
                await resp.read()
                call.outcome = "status" if 400 <= resp.status < 500 else "bad_ok"
                if call.outcome == "bad_ok":
                    call.detail = f"answered {resp.status}"
                return
            if resp.status != 200:
                call.code = _error_code(await resp.read())
                call.outcome = "status"
                return
            if resp.content_type == "text/event-stream":
                await _read_stream(call, resp, cancel_after_events)
                return
            payload = await resp.read()
            try:
                call.outcome = "ok" if orjson.loads(payload)["choices"] else "bad_answer"
            except (orjson.JSONDecodeError, KeyError, TypeError):
                call.outcome, call.detail = "bad_answer", payload[:200].decode(errors="replace")

    try:
        if cancel_after_s:
            try:
                await asyncio.wait_for(go(), cancel_after_s)
            except TimeoutError:
                call.outcome = "cancelled"
        else:
            await go()
    except TimeoutError:
        call.outcome, call.detail = "timeout", "no answer within the client's timeout"
    except (aiohttp.ClientError, OSError) as exc:
        call.outcome, call.detail = "conn_error", f"{type(exc).__name__}: {exc}"[:200]
    finally:
        call.end = time.monotonic()


Pick = Callable[[], tuple[int, int, str] | None]  # (replica, generation, base URL)


class Load:
    """Poisson arrivals of the mixed calls, a budget key's calls one at a time."""

    def __init__(self, pick: Pick, clients: Clients, rate: float, seed: int,
                 max_in_flight: int = 300) -> None:
        self.pick = pick
        self.clients = clients
        self.rate = rate
        self.rng = random.Random(seed)
        self.calls: list[Call] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.max_in_flight = max_in_flight
        self.skipped = 0
        self.numbers = itertools.count()
        self.stop = asyncio.Event()

    def _new(self, kind: str, tier: str, key: str) -> tuple[Call, str] | None:
        chosen = self.pick()
        if chosen is None:
            self.skipped += 1
            return None
        replica, gen, base = chosen
        call = Call(next(self.numbers), kind, tier, key, replica, gen, time.monotonic())
        self.calls.append(call)
        return call, base

    def _spawn(self, call: Call, base: str, body: bytes, **kw: Any) -> asyncio.Task[None]:
        session = self.clients.session(call.replica, call.gen)
        task = asyncio.ensure_future(send(call, session, base, body, **kw))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def one(self) -> None:
        rng = self.rng
        kind = rng.choices(("json", "stream", "cancel_queue", "cancel_stream", "bad"),
                           (47, 38, 5, 5, 5))[0]
        tier = rng.choices(TIERS, (10, 20, 35, 35))[0]
        key = rng.choices(("k-a", "k-b", "k-c"), (40, 35, 25))[0]
        made = self._new(kind, tier, key)
        if made is None:
            return
        call, base = made
        if kind == "bad":
            call.code, body = rng.choice(BAD_BODIES)
            self._spawn(call, base, body)
            return
        model = rng.choices(("chat", "chat-b"), (60, 40))[0]
        stream = kind in ("stream", "cancel_stream")
        body = orjson.dumps(chat_body(call, rng, stream, rng.randint(4, 16), model))
        if kind == "cancel_queue":
            self._spawn(call, base, body, cancel_after_s=rng.uniform(0.05, 1.5))
        elif kind == "cancel_stream":
            self._spawn(call, base, body, cancel_after_events=rng.randint(1, 3))
        else:
            self._spawn(call, base, body)

    async def arrivals(self) -> None:
        while not self.stop.is_set():
            with_timeout = self.rng.expovariate(self.rate)
            try:
                await asyncio.wait_for(self.stop.wait(), with_timeout)
                return
            except TimeoutError:
                pass
            if len(self.tasks) >= self.max_in_flight:
                self.skipped += 1
                continue
            self.one()

    async def budget_key(self, every_s: float) -> None:
        """The budget key's calls, one at a time: its spend may pass the budget by one."""
        while not self.stop.is_set():
            made = self._new("budget", "normal", "k-budget")
            if made is not None:
                call, base = made
                stream = self.rng.random() < 0.5
                body = orjson.dumps(chat_body(call, self.rng, stream, 8, "chat"))
                await self._spawn(call, base, body)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
