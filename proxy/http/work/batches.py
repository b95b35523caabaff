"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``) and background responses
(``POST /v1/responses`` with ``background: true``, ``GET``/``cancel`` by id), served from the
store and run by ``proxy.http.work.runner``. The key that created a file, batch or response owns
it: any other key gets 404."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from ...core.errors import InvalidRequest, NotFound, RequestTooLarge, StorageUnavailable
from ...core.formats.batchdoc import (
    CHAT_PREFIX,
    batch_doc,
    batch_view,
    error_line,
    file_doc,
    request_counts,
    response_doc,
    window_s,
)
from ...core.formats.batchfile import BATCH_PATHS, read_lines
from ...core.formats.endpoints import PATH_OF
from ...core.formats.request import Call
from ...store.sqlite import MAX_FILES_LISTED
from ..base import edge
from ..base.edge import Incoming
from .runner import WORK, Work, new_id

MAX_LIST = 100
log = logging.getLogger(__name__)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _owner(request: web.Request) -> tuple[str, Work]:
    work = request.app[WORK]
    return work.owner_of(request.headers), work


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        async with edge.arriving(edge.BODY_WAIT_S):
            raw = await request.read()
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return body


# --- files ------------------------------------------------------------------------------

async def create_file(request: web.Request) -> web.Response:
    owner, work = _owner(request)
    async with work.heavy:  # a few uploads at once, each up to max_file_bytes in memory
        return await _upload(request, owner, work)


async def _upload(request: web.Request, owner: str, work: Work) -> web.Response:
    try:
        async with edge.arriving(edge.UPLOAD_WAIT_S):
            purpose, filename, content = await _read_form(request,
                                                          work.config.batch.max_file_bytes)
    except (AssertionError, ValueError, LookupError, HttpProcessingError) as exc:
        # aiohttp's multipart reader refuses a wrong boundary, a truncated body or a bad
        # part header with these ("Could not find starting boundary", "Invalid HTTP header").
        reason = (exc.message if isinstance(exc, HttpProcessingError) else str(exc)) or "bad form"
        raise InvalidRequest(f"Send the file as multipart/form-data ({reason}).") from None
    if purpose != "batch":
        raise InvalidRequest("purpose: this proxy stores files for batches only (batch).",
                             param="purpose")
    if not content:
        raise InvalidRequest("file: missing or empty.", param="file")
    await work.check_room(len(content))
    row = {"id": new_id("file-"), "owner": owner, "purpose": purpose, "filename": filename,
           "created_at": int(work.clock.wall())}
    await work.store().add_file(row, bytes(content))
    return _json(file_doc({**row, "bytes": len(content)}))


async def _read_form(request: web.Request, max_bytes: int) -> tuple[str | None, str, bytearray]:
    """The ``purpose`` and ``file`` parts of an upload, read whole: (purpose, file name,
    content). Anything malformed in it raises from aiohttp's reader, to be answered 400."""
    reader = await request.multipart()
    purpose: str | None = None
    filename, content = "", bytearray()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "purpose":
            purpose = (await part.read(decode=True)).decode("utf-8", "replace").strip()
        elif part.name == "file":
            filename = (part.filename or "upload.jsonl")[:256]
            while chunk := await part.read_chunk():
                content += chunk
                if len(content) > max_bytes:
                    raise RequestTooLarge(f"The file is larger than {max_bytes} bytes "
                                          "(batch.max_file_bytes).")
    return purpose, filename, content


async def _file(request: web.Request) -> tuple[str, Work, dict[str, Any]]:
    owner, work = _owner(request)
    found = await work.store().file(request.match_info["file_id"], owner)
    if found is None:
        raise NotFound("No such file.")
    return owner, work, found


async def get_file(request: web.Request) -> web.Response:
    return _json(file_doc((await _file(request))[2]))


async def file_content(request: web.Request) -> web.Response:
    owner, work, found = await _file(request)
    async with work.heavy:
        content = await work.store().file_content(found["id"], owner)
    if content is None:
        raise NotFound("No such file.")
    return web.Response(body=content, content_type="application/octet-stream")


async def list_files(request: web.Request) -> web.Response:
    """OpenAI's list: ``purpose``, ``order`` (``desc``, newest first, or ``asc``),
    ``limit`` (1 to 10,000) and ``after`` (a file id: the ones after it in that order)."""
    owner, work = _owner(request)
    query = request.query
    purpose, order, after = query.get("purpose"), query.get("order", "desc"), query.get("after")
    limit = _limit(query.get("limit"), MAX_FILES_LISTED, MAX_FILES_LISTED)
    if order not in ("asc", "desc"):
        raise InvalidRequest("order: asc or desc.", param="order")
    rows = [row for row in await work.store().files(owner)
            if purpose in (None, row["purpose"])]
    if order == "asc":
        rows.reverse()
    if after is not None:
        at = next((i for i, row in enumerate(rows) if row["id"] == after), None)
        if at is None:
            raise InvalidRequest(f"after: no file {after[:64]!r} here.", param="after")
        rows = rows[at + 1:]
    data = [file_doc(row) for row in rows[:limit]]
    return _json({"object": "list", "data": data,
                  "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None,
                  "has_more": len(rows) > limit})


def _limit(given: str | None, default: int, most: int) -> int:
    if given is None:
        return default
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit: an integer from 1 to {most}.", param="limit")
    return limit


async def delete_file(request: web.Request) -> web.Response:
    owner, work, found = await _file(request)
    await work.store().delete_file(found["id"], owner)
    return _json({"id": found["id"], "object": "file", "deleted": True})


# --- batches ----------------------------------------------------------------------------

async def create_batch(request: web.Request) -> web.Response:
    owner, work = _owner(request)
    body = await _body(request)
    endpoint = body.get("endpoint")
    if endpoint not in BATCH_PATHS:
        raise InvalidRequest(f"endpoint: one of {', '.join(BATCH_PATHS)}.", param="endpoint")
    window = body.get("completion_window", "24h")
    try:
        seconds = window_s(window if isinstance(window, str) else "")
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="completion_window") from None
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
            not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise InvalidRequest("metadata: at most 16 string pairs (keys up to 64 characters, "
                             "values up to 512).", param="metadata")
    file_id = body.get("input_file_id")
    store = work.store()
    async with work.heavy:
        content = (await store.file_content(file_id, owner)
                   if isinstance(file_id, str) else None)
        if content is None or not isinstance(file_id, str):
            raise InvalidRequest("input_file_id: no such file.", param="input_file_id")
        await work.check_room(len(content))
        try:
            good, bad = await asyncio.to_thread(read_lines, content, endpoint,
                                                work.config.batch.max_lines)
        except ValueError as exc:
            raise InvalidRequest(f"input_file_id: {exc}.", param="input_file_id") from None
        del content
    batch_id = new_id("batch_")
    now = int(work.clock.wall())
    doc = batch_doc(batch_id, endpoint, file_id, window, now, now + seconds,
                    len(good) + len(bad), metadata)
    lines: list[tuple[int, str | None, bytes | None, str, bytes | None]] = [
        (line.index, line.custom_id, line.body, "pending", None) for line in good]
    lines += [(b.index, b.custom_id, None, "failed",
               error_line(new_id("batch_req_"), b.custom_id, "invalid_request",
                          f"line {b.index + 1}: {b.message}"))
              for b in bad]
    async with work.heavy:
        await store.add_batch(batch_id, owner, now, "in_progress", orjson.dumps(doc).decode(),
                              lines)
    work.run_batch(batch_id)
    return _json(await _with_counts(work, batch_id, doc))


async def _with_counts(work: Work, batch_id: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The batch as the API shows it, with its request counts as they are now."""
    if doc["status"] in ("in_progress", "cancelling"):
        counts = await work.store().counts(batch_id)
        doc["request_counts"] = request_counts(doc["request_counts"]["total"], counts)
    return batch_view(doc)


async def _batch(request: web.Request) -> tuple[Work, str, dict[str, Any]]:
    owner, work = _owner(request)
    batch_id = request.match_info["batch_id"]
    found = await work.store().batch(batch_id, owner)
    if found is None:
        raise NotFound("No such batch.")
    return work, batch_id, orjson.loads(found[1])


async def get_batch(request: web.Request) -> web.Response:
    work, batch_id, doc = await _batch(request)
    return _json(await _with_counts(work, batch_id, doc))


async def list_batches(request: web.Request) -> web.Response:
    owner, work = _owner(request)
    limit = _limit(request.query.get("limit"), 20, MAX_LIST)
    docs = await work.store().batches(owner, request.query.get("after"), limit + 1)
    data = [batch_view(orjson.loads(doc)) for doc in docs[:limit]]
    return _json({"object": "list", "data": data,
                  "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None,
                  "has_more": len(docs) > limit})


async def cancel_batch(request: web.Request) -> web.Response:
    work, batch_id, doc = await _batch(request)
    if doc["status"] == "in_progress":
        cancelling = {**doc, "status": "cancelling", "cancelling_at": int(work.clock.wall())}
        if await work.store().cancel_batch(batch_id, orjson.dumps(cancelling).decode()):
            doc = cancelling
            work.run_batch(batch_id)  # a running batch sees it within a second
        else:  # it ended meanwhile: as it is now
            found = await work.store().batch(batch_id)
            assert found is not None
            doc = orjson.loads(found[1])
    return _json(await _with_counts(work, batch_id, doc))


# --- background responses ---------------------------------------------------------------

async def create_background(request: Incoming, owner: str, call: Call) -> web.Response:
    """A checked ``POST /v1/responses`` with ``background: true`` (and, an extension, the
    same on ``/v1/chat/completions``): stored, answered at once with its id, run in the
    batch tier, fetched with ``GET`` on the same path and the id."""
    try:
        return await _background(request, owner, call)
    except request.app[WORK].errors:
        log.warning("work that can wait: the store failed", exc_info=True)
        raise StorageUnavailable() from None


async def _background(request: Incoming, owner: str, call: Call) -> web.Response:
    work = request.app[WORK]
    path = PATH_OF["chat" if call.kind == "chat" else "responses"]
    if call.stream:
        raise InvalidRequest(f"background calls cannot stream here; poll GET {path}/{{id}}.",
                             param="stream")
    if not work.serves(call.model):
        raise InvalidRequest("model: not served by this proxy.", param="model")
    encoded = orjson.dumps({k: v for k, v in call.body.items() if k != "background"})
    await work.check_room(len(encoded))
    response_id = new_id(CHAT_PREFIX if call.kind == "chat" else "resp_")
    now = int(work.clock.wall())
    doc = response_doc(response_id, now, "queued", call.body)
    await work.store().add_response(response_id, owner, now, encoded, orjson.dumps(doc))
    work.run_response(response_id)
    answer = _json(doc)
    answer.headers["x-proxy-background-id"] = response_id
    return answer


async def _response(request: web.Request) -> tuple[Work, str, str, bytes]:
    owner, work = _owner(request)
    response_id = request.match_info["response_id"]
    found = (await work.store().response(response_id, owner)
             if work.opened or work.exists() else None)
    if found is None:
        raise NotFound("No such background response.")
    return work, response_id, found[0], found[1]


async def get_response(request: web.Request) -> web.Response:
    return web.Response(body=(await _response(request))[3], content_type="application/json")


async def cancel_response(request: web.Request) -> web.Response:
    work, response_id, status, doc = await _response(request)
    if status in ("queued", "in_progress"):
        parsed = orjson.loads(doc)
        cancelled = orjson.dumps({**parsed, "status": "cancelled"})
        if await work.store().set_response(response_id, "cancelled", cancelled,
                                           only_if=("queued", "in_progress")):
            work.cancel_response(response_id)
            doc = cancelled
    return web.Response(body=doc, content_type="application/json")


def _guarded(handler: Handler) -> Handler:
    """The store's own failures (Redis away, a disk error) are a 503 the SDK retries."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except request.app[WORK].errors:
            log.warning("work that can wait: the store failed", exc_info=True)
            raise StorageUnavailable() from None

    return guarded


def add_routes(app: web.Application) -> None:
    for method, path, handler in (
            ("POST", "/v1/files", create_file), ("GET", "/v1/files", list_files),
            ("GET", "/v1/files/{file_id}", get_file),
            ("GET", "/v1/files/{file_id}/content", file_content),
            ("DELETE", "/v1/files/{file_id}", delete_file),
            ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
            ("GET", "/v1/batches/{batch_id}", get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch),
            ("GET", "/v1/responses/{response_id}", get_response),
            ("POST", "/v1/responses/{response_id}/cancel", cancel_response),
            ("GET", "/v1/chat/completions/{response_id}", get_response),
            ("POST", "/v1/chat/completions/{response_id}/cancel", cancel_response)):
        app.router.add_route(method, path, _guarded(handler))
