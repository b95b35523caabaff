"""Durable storage for work that can wait: files, batches, their lines, background
responses (SQLite, the embedded default; Redis with the redis state backend), reached from
the event loop only through ``AsyncStore`` (``proxy.store.offloop``): every call in a
worker thread."""

from __future__ import annotations

import sqlite3

from ..config import Config
from .offloop import AsyncStore, StoreClosed
from .sqlite import Store

__all__ = ["AsyncStore", "Errors", "StoreClosed", "open_store", "store_errors"]

Errors = tuple[type[BaseException], ...]
REDIS_THREADS = 4  # a slow call (a summary, a retention sweep) leaves three for the runner
BULK_THREADS = 3  # the two uploads, batch creations or file reads at once, a finalization


def open_store(config: Config) -> AsyncStore:
    """SQLite at ``storage.path``, or Redis with the redis state backend (its client is
    imported only by a proxy that uses it); opened in a worker thread on the first call."""
    if config.state.backend == "redis":
        from .redis_store import RedisStore

        settings = config.state
        return AsyncStore(lambda: RedisStore(settings), settings.shown_url,
                          threads=REDIS_THREADS, bulk_threads=BULK_THREADS)
    path = config.storage.path
    # One thread for the small statements: they share one connection, whose transactions
    # must not interleave. Bulk ones have connections of their own (not in ``:memory:``).
    return AsyncStore(lambda: Store(path), path, threads=1,
                      bulk_threads=0 if path == ":memory:" else BULK_THREADS)


def store_errors(redis_backend: bool) -> Errors:
    """What a store's operations raise when it cannot be used (Redis away, disk trouble,
    closed). Redis' client is imported only by a proxy that uses it."""
    if not redis_backend:
        return (sqlite3.Error, OSError, StoreClosed)
    from redis.exceptions import RedisError

    return (RedisError, sqlite3.Error, OSError, StoreClosed)
