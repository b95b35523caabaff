"""Durable storage for work that can wait: files, batches, their lines, background
responses (SQLite, the embedded default; Redis with the redis state backend)."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from ..config import Config
from .sqlite import Store

if TYPE_CHECKING:
    from .redis_store import RedisStore

Errors = tuple[type[BaseException], ...]


def open_store(config: Config) -> Store | RedisStore:
    """SQLite at ``storage.path``, or Redis with the redis state backend (its client is
    imported only by a proxy that uses it)."""
    if config.state.backend == "redis":
        from .redis_store import RedisStore

        return RedisStore(config.state)
    return Store(config.storage.path)


def store_errors(redis_backend: bool) -> Errors:
    """What a store's operations raise when it cannot be used (Redis away, disk trouble).
    Redis' client is imported only by a proxy that uses it."""
    if not redis_backend:
        return (sqlite3.Error, OSError)
    from redis.exceptions import RedisError

    return (RedisError, sqlite3.Error, OSError)
