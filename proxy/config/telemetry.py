"""``telemetry:``: OpenTelemetry traces of the calls, sent over OTLP/HTTP (``proxy.http.call.
tracing``). Unset, nothing is traced and nothing of OpenTelemetry is imported."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from .reader import Node, fail


@dataclass(frozen=True)
class TelemetrySettings:
    otlp_endpoint: str | None = None  # OTLP/HTTP base URL: spans go to {endpoint}/v1/traces
    service_name: str = "triage-proxy"
    sample: float = 1.0  # the share of traces started here that are kept

    @property
    def traces_url(self) -> str | None:
        if self.otlp_endpoint is None:
            return None
        return self.otlp_endpoint.rstrip("/") + "/v1/traces"


def parse_telemetry(node: Node) -> TelemetrySettings:
    endpoint = node.optional_string("otlp_endpoint")
    if endpoint is not None:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            fail(node.sub("otlp_endpoint"), "must be an http:// or https:// URL")
        if parts.query or parts.fragment:
            fail(node.sub("otlp_endpoint"), "must have no query or fragment")
    name = node.string("service_name", "triage-proxy")
    if not re.fullmatch(r"[^\x00-\x1f]{1,128}", name):
        fail(node.sub("service_name"), "must be 1-128 printable characters")
    settings = TelemetrySettings(endpoint, name, node.number("sample", 1.0, maximum=1.0))
    node.check_unknown()
    return settings
