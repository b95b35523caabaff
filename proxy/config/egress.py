"""The egress proxy, from ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` (either case), read
as ``urllib.request`` reads them: a lowercase variable wins over its uppercase twin, and one
set but empty turns the scheme off. ``NO_PROXY`` is matched by ``urllib.request``'s own
``proxy_bypass_environment``: ``*``, host names, domain suffixes (``.corp`` or ``corp``), and
``host:port`` for one port only.

Only an ``http://`` proxy is spoken to (a scheme-less ``proxy.corp:3128`` is one); its port
defaults to 80, as ``urllib`` has it. Messages name the variable, never its value (it may
carry a password).
"""

from __future__ import annotations

import base64
import urllib.parse
import urllib.request
from collections.abc import Mapping

from ..core.health.provider import EgressProxy
from .reader import fail


def environment_proxies(env: Mapping[str, str]) -> dict[str, str]:
    """``urllib.request.getproxies_environment()``, of ``env`` rather than ``os.environ``:
    ``{"https": url, "http": url, "no": "host,.domain"}`` for what is set."""
    proxies: dict[str, str] = {}
    for name, value in env.items():
        name = name.lower()
        if value and name.endswith("_proxy"):
            proxies[name[:-6]] = value
    if "REQUEST_METHOD" in env:  # a CGI's HTTP_PROXY may come from a client's header
        proxies.pop("http", None)
    for name, value in env.items():
        if name.endswith("_proxy"):
            name = name.lower()
            if value:
                proxies[name[:-6]] = value
            else:
                proxies.pop(name[:-6], None)
    return proxies


def egress_for(base_url: str, proxies: Mapping[str, str]) -> EgressProxy | None:
    """The proxy calls to ``base_url`` go through; None when they go directly."""
    parts = urllib.parse.urlsplit(base_url)
    url = proxies.get(parts.scheme)
    if url is None:
        return None
    # The stdlib's own NO_PROXY matching (public in urllib.request, absent from typeshed).
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if bypass(parts.netloc.rpartition("@")[2], proxies):
        return None
    return parse_proxy(f"{parts.scheme}_proxy (environment)", url)


def parse_proxy(path: str, url: str) -> EgressProxy:
    text = url.strip()
    parts = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme.lower() != "http":
        fail(path, f"the egress proxy must be an http:// URL, not {parts.scheme[:16]}://")
    try:
        port = parts.port
    except ValueError:
        fail(path, "the egress proxy's port is not a number from 1 to 65535")
    if not parts.hostname or port == 0:
        fail(path, "the egress proxy's URL names no host, or port 0")
    authorization = None
    if parts.username is not None:
        credentials = (f"{urllib.parse.unquote(parts.username)}:"
                       f"{urllib.parse.unquote(parts.password or '')}")
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
    return EgressProxy(parts.hostname, port or 80, authorization)
