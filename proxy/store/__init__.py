"""Durable storage for work that can wait: files, batches, their lines, background
responses (SQLite, the embedded default)."""
