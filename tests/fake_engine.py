"""A fake self-hosted inference server: vLLM's, SGLang's or llama.cpp's figures, as their
docs give them, over a server that queues calls inside past its slots.

It runs at most ``slots`` calls at once (less ``others``: calls of clients the proxy does not
see); the rest wait in its own queue, first come first served, or by ``priority`` where it
schedules by it (vLLM: lower first; SGLang: higher first). It records the ``priority`` each
call came with and the most calls ever waiting inside. Its pages:

- vLLM: ``/metrics`` with ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (labels ``engine`` and ``model_name``, as v0.10 and later);
- SGLang: ``/metrics`` with ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and
  ``sglang:token_usage`` (labels ``model_name``, ``tp_rank``, ``pp_rank``);
- llama.cpp: ``/props`` (``total_slots``), ``/slots`` and ``/metrics``
  (``llamacpp:requests_processing``, ``llamacpp:requests_deferred``).

A server started without priority scheduling refuses the field with a 400, as vLLM does; a
call whose message says "bad request" gets a 400 that quotes the whole request, as vLLM's
validation errors do.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from .fakes import completion, sse_events


@dataclass
class FakeEngine:
    engine: str  # vllm | sglang | llama.cpp
    slots: int = 2
    service_s: float = 0.1
    priority_scheduling: bool = True
    others: int = 0  # slots taken by clients the proxy does not see
    metrics: bool = True  # False: /metrics answers 404 (llama-server without --metrics)
    broken: bool = False  # True: every page answers 500
    padding: int = 0  # bytes of comment lines after the figures on /metrics
    chunked: bool = False  # True: /metrics streamed, its length not said
    slow_per_running_s: float = 0.0  # each call is this much slower per call running
    received: list[tuple[int | None, str]] = field(default_factory=list)  # (priority, text)
    started: list[int | None] = field(default_factory=list)  # priorities, in start order
    running: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    reads: int = 0
    _queue: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.page_metrics)
        app.router.add_get("/props", self.props)
        app.router.add_get("/slots", self.page_slots)
        return app

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        priority = body.get("priority")
        text = str(body["messages"][-1]["content"])
        self.received.append((priority, text))
        if "bad request" in text:  # a validation error quoting the request, as vLLM's do
            return web.json_response({"object": "error", "type": "BadRequestError",
                                      "code": 400, "message": f"1 validation error: {body}",
                                      "param": None}, status=400)
        if priority is not None and not self.priority_scheduling:
            return web.json_response({"object": "error", "type": "BadRequestError", "code": 400,
                                      "message": f"Got priority {priority} but Priority "
                                                 "scheduling is not enabled.", "param": None},
                                     status=400)
        await self._admit(priority if isinstance(priority, int) else 0)
        self.started.append(priority)
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await asyncio.sleep(self.service_s + self.slow_per_running_s * self.running)
            model = body["model"]
            if not body.get("stream"):
                return web.json_response(completion(model, text))
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for event in sse_events(model, ["Hello", " there"], usage):
                await response.write(event)
            await response.write_eof()
            return response
        finally:
            self.running -= 1
            self._start_next()

    async def _admit(self, priority: int) -> None:
        if self.running + self.others < self.slots and not self._queue:
            return
        rank = priority if self.engine != "sglang" else -priority
        if not self.priority_scheduling:
            rank = 0
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (rank, next(self._order), waiter))
        self.peak_waiting = max(self.peak_waiting, len(self._queue))
        await waiter

    def _start_next(self) -> None:
        while self._queue and self.running + self.others < self.slots:
            _, _, waiter = heapq.heappop(self._queue)
            if not waiter.done():
                waiter.set_result(None)
                return

    # --- the server's own pages ----------------------------------------------------------

    def _check(self) -> None:
        self.reads += 1
        if self.broken:
            raise web.HTTPInternalServerError(text="broken")

    async def page_metrics(self, request: web.Request) -> web.Response:
        self._check()
        running, waiting = self.running + self.others, self.waiting
        kv = round(min(1.0, running / max(self.slots, 1)) * 0.8, 3)
        if self.engine == "vllm":
            labels = 'engine="0",model_name="m"'
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution "
                "batches.\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
                "# TYPE vllm:prompt_tokens_total counter\n"
                f'vllm:prompt_tokens_total{{{labels}}} {float(len(self.received) * 9)}\n')
        elif self.engine == "sglang":
            text = ""
            for rank in ("0", "1"):  # two tensor-parallel ranks report the same scheduler
                labels = f'model_name="m",tp_rank="{rank}",pp_rank="0"'
                text += (f"sglang:num_running_reqs{{{labels}}} {float(running)}\n"
                         f"sglang:num_queue_reqs{{{labels}}} {float(waiting)}\n"
                         f"sglang:token_usage{{{labels}}} {kv}\n")
            text = ("# HELP sglang:num_running_reqs The number of running requests.\n"
                    "# TYPE sglang:num_running_reqs gauge\n" + text)
        else:
            if not self.metrics:
                raise web.HTTPNotFound(text="metrics disabled")
            text = ("# HELP llamacpp:requests_processing Number of requests processing.\n"
                    "# TYPE llamacpp:requests_processing gauge\n"
                    f"llamacpp:requests_processing {running}\n"
                    "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                    "# TYPE llamacpp:requests_deferred gauge\n"
                    f"llamacpp:requests_deferred {waiting}\n")
        if self.padding:
            text += ("# " + "x" * 1021 + "\n") * (self.padding // 1024)
        if not self.chunked:
            return web.Response(text=text, content_type="text/plain")
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        data = text.encode()
        with contextlib.suppress(ConnectionError):  # the reader may stop reading
            for at in range(0, len(data), 1024 * 1024):
                await response.write(data[at:at + 1024 * 1024])
        return response

    async def props(self, request: web.Request) -> web.Response:
        self._check()
        if self.engine != "llama.cpp":
            raise web.HTTPNotFound()
        return web.json_response({"total_slots": self.slots, "default_generation_settings": {
            "n_ctx": 512}, "model_path": "tiny.gguf"})

    async def page_slots(self, request: web.Request) -> web.Response:
        self._check()
        if self.engine != "llama.cpp":
            raise web.HTTPNotFound()
        busy = self.running + self.others
        return web.json_response([{"id": i, "n_ctx": 512, "is_processing": i < busy}
                                  for i in range(self.slots)])

