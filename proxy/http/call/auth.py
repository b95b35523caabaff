"""Proxy keys → principals, looked up by SHA-256 digest (no text comparison of secrets).
A key comes as ``Authorization: Bearer`` (OpenAI's SDKs), ``x-api-key`` (Anthropic's) or
``api-key`` (Azure's)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from ...config import ApiKey
from ...core.call.classify import ANONYMOUS, Principal
from ...core.errors import InvalidApiKey
from ..base.edge import secret_digest

# The proxy's own calls (a batch line, a background response) carry the internal token and
# the name of the key they run for.
ON_BEHALF = "x-triage-on-behalf-of"


class Authenticator:
    def __init__(self, keys: tuple[ApiKey, ...], required: bool,
                 internal_token: str | None = None) -> None:
        """With no keys configured any client is accepted (local use); with keys configured
        but every one disabled (its variable unset), nobody is. ``internal_token``: what
        the proxy's own calls authenticate with (never leaves the machine)."""
        self._by_digest = {k.sha256: k.principal for k in keys}
        self._by_name = {k.principal.name: k.principal for k in keys}
        self._required = required or bool(keys)
        self._internal = None if internal_token is None else secret_digest(internal_token)

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        token = (bearer(headers.get("Authorization", "")) or headers.get("x-api-key", "")
                 or headers.get("api-key", ""))
        if self._internal is not None and ON_BEHALF in headers and token and hmac.compare_digest(
                secret_digest(token), self._internal):
            principal = self._by_name.get(headers[ON_BEHALF])
            if principal is None and self._required:
                raise InvalidApiKey("The key this work belongs to is no longer configured.")
            return principal or ANONYMOUS
        if not self._required:
            return ANONYMOUS
        if not token:
            raise InvalidApiKey(
                "Missing proxy key: send it as 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>', as Anthropic's SDKs do)."
            )
        principal = self._by_digest.get(secret_digest(token))
        if principal is None:
            raise InvalidApiKey("Incorrect proxy key provided.")
        return principal


def bearer(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
