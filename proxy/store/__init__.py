"""Durable storage for work that can wait: files, batches, their lines, background
responses (SQLite, the embedded default; Redis with the redis state backend)."""

from __future__ import annotations

import sqlite3

import redis

# What a store's operations raise when the store cannot be used (Redis away, disk trouble).
STORE_ERRORS = (redis.RedisError, sqlite3.Error, OSError)
