"""``state:``: where what replicas share lives (``proxy.state``)."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from .reader import Node, fail

BACKENDS = ("memory", "redis")
ON_ERROR = ("local", "reject")


@dataclass(frozen=True)
class StateSettings:
    backend: str = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "triage"
    lease_ttl_s: float = 10.0  # a dead replica's slots come back within this
    on_error: str = "local"  # Redis unreachable: a per-replica share of each limit, or 503

    @property
    def shown_url(self) -> str:
        """The URL without its password, for status pages and logs."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return urllib.parse.urlunsplit((parts.scheme, host + port, parts.path, "", ""))


def parse_state(node: Node) -> StateSettings:
    backend = node.choice("backend", BACKENDS, "memory")
    url = node.string("url", StateSettings.url)
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        fail(node.sub("url"), "must be a redis://, rediss:// or unix:// URL")
    prefix = node.string("prefix", "triage")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", prefix):
        fail(node.sub("prefix"), "must be 1-64 letters, digits, '.', '_' or '-'")
    settings = StateSettings(
        backend=backend, url=url, prefix=prefix,
        lease_ttl_s=node.number("lease_ttl_s", 10.0, minimum=1.0, maximum=3600.0),
        on_error=node.choice("on_error", ON_ERROR, "local"),
    )
    node.check_unknown()
    return settings
