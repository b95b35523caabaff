"""Proxy keys → principals, looked up by SHA-256 digest (no text comparison of secrets)."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import ApiKey
from ..core.classify import ANONYMOUS, Principal
from ..core.errors import InvalidApiKey
from .edge import secret_digest


class Authenticator:
    def __init__(self, keys: tuple[ApiKey, ...], required: bool) -> None:
        """With no keys configured any caller is accepted (local use); with keys configured
        but every one disabled (its variable unset), nobody is."""
        self._by_digest = {k.sha256: k.principal for k in keys}
        self._required = required or bool(keys)

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        if not self._required:
            return ANONYMOUS
        token = bearer(headers.get("Authorization", "")) or headers.get("api-key", "")
        if not token:
            raise InvalidApiKey(
                "Missing proxy key: send it as 'Authorization: Bearer <key>'."
            )
        principal = self._by_digest.get(secret_digest(token))
        if principal is None:
            raise InvalidApiKey("Incorrect proxy key provided.")
        return principal


def bearer(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
