"""The aiohttp application: routes, typed objects under AppKeys, one lifecycle for resources."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

import orjson
from aiohttp import web

from ...config import Config, Provider
from ...core.call.tokens import TokenCounter
from ...core.clock import Clock, SystemClock
from ...core.errors import ModelNotFound
from ..base.access import AccessLog
from ..base.appkeys import ACCESS_LOG, BACKGROUND, LANE, LIFECYCLE, LaneStatus
from ..base.drain import Lifecycle
from ..call import forward
from ..call.forward import FORWARDER
from ..call.middleware import REQUEST_IDS, RequestIds, errors_middleware
from ..call.service import SERVICE, Service
from ..call.tracing import Tracing
from ..ops import admin
from ..ops.reload import RELOADER, Reloader
from ..upstream.simulated import SimulatedUpstream
from ..upstream.upstream import HttpUpstream, Upstream
from ..work import batches
from ..work.runner import WORK, Work
from .janitor import sweeping

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

UpstreamFactory = Callable[[Provider], Upstream]


def default_upstream(provider: Provider) -> Upstream:
    if provider.sim is not None:
        return SimulatedUpstream(provider.name, provider.sim)
    if provider.kind == "azure":
        auth = {"api-key": provider.api_key} if provider.api_key else {}
    elif provider.kind == "anthropic":
        auth = {"x-api-key": provider.api_key} if provider.api_key else {}
    else:
        auth = {"authorization": f"Bearer {provider.api_key}"} if provider.api_key else {}
    return HttpUpstream(provider.base_url, {**provider.headers, **auth}, provider.query,
                        provider.max_response_bytes, provider.egress)


def build_app(
    config: Config,
    *,
    clock: Clock | None = None,
    counter: TokenCounter | None = None,
    upstream_factory: UpstreamFactory = default_upstream,
    access_stream: IO[str] | None = None,
    config_path: str | Path | None = None,
    internal_token: str | None = None,
    span_exporter: SpanExporter | None = None,
) -> web.Application:
    """``access_stream``: where the access log goes when the config turns it on (stdout);
    ``span_exporter``: where traces go when the config turns them on (OTLP/HTTP);
    ``config_path``: the file a reload reads again; ``internal_token``: what the proxy's
    own calls authenticate with (the same for every worker of ``serve --workers``). Work
    that can wait runs once ``app[WORK].start(url)`` says where the proxy listens."""
    app = web.Application(
        middlewares=[errors_middleware], client_max_size=config.limits.max_body_bytes
    )
    settings = config.access_log
    if settings.enabled:
        app[ACCESS_LOG] = AccessLog(settings.format, access_stream)
    app[LIFECYCLE] = Lifecycle()
    app[REQUEST_IDS] = RequestIds()
    app[RELOADER] = Reloader(config_path)
    app[LANE] = LaneStatus()
    app[BACKGROUND] = batches.create_background

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        upstreams: Mapping[str, Upstream] = {
            name: upstream_factory(p) for name, p in config.providers.items()
        }
        service = Service(config, upstreams, clock or SystemClock(),
                          counter or TokenCounter.load(), make_upstream=upstream_factory,
                          internal_token=internal_token)
        app[SERVICE] = service
        app[FORWARDER] = service.forwarder
        if config.telemetry.otlp_endpoint is not None:
            service.tracing = Tracing(config.telemetry, span_exporter)
        app[WORK] = Work(config, service.clock, service.internal_token, service.metrics,
                         owner_of=lambda headers: service.auth.authenticate(headers).name,
                         serves=lambda model: model in service.config.models)
        await service.start()
        service.apply_schedule()
        yield
        app[LIFECYCLE].draining = True
        await app[WORK].close()
        await service.close()
        if service.tracing is not None:  # what is still buffered goes out (bounded)
            service.tracing.close()

    async def drain(app: web.Application) -> None:
        # Runs once the listener has stopped and before aiohttp itself waits for handlers:
        # calls in flight finish, queued calls that still fit start, within the timeout.
        service = app[SERVICE]
        timeout = service.config.drain_timeout_s
        app[LIFECYCLE].draining = True
        service.admission.drain(service.clock.now() + timeout)
        await app[LIFECYCLE].drain(timeout)

    app.cleanup_ctx.append(lifecycle)
    app.cleanup_ctx.append(sweeping)
    app.on_shutdown.append(drain)
    for path, handler in forward.ROUTED.items():
        app.router.add_post(path, handler)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    batches.add_routes(app)
    admin.add_routes(app)
    return app


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triage-proxy"}


async def list_models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    service.auth.authenticate(request.headers)
    return _json({"object": "list", "data": [_model(name) for name in service.config.models]})


async def get_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    service.auth.authenticate(request.headers)
    name = request.match_info["model"]
    if name not in service.config.models:
        raise ModelNotFound(f"The model '{name[:256]}' does not exist on this proxy.",
                            param="model")
    return _json(_model(name))


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if request.app[LIFECYCLE].draining or SERVICE not in request.app:
        return _json({"status": "draining"}, status=503)
    return _json({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics.render()
    return web.Response(body=body, headers={"content-type": "text/plain; version=0.0.4"})

