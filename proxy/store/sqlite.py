"""The embedded store: one SQLite file (WAL) holding uploaded files, batches, their lines
with each line's result, and background responses.

A line moves pending → running → done | failed (or expired / cancelled); its result is
written only while it is running, so it is answered exactly once. One process at a time
runs the work (``hold_runner``: the runner's lease, in the file, so ``serve --workers``
share one store); when the lease changes hands, or the process that held it died, ``recover`` sends
the lines it left running back to pending (they run again).
Nothing here runs on the event loop (``proxy.store.offloop.AsyncStore`` calls it from
worker threads): the small statements (sub-millisecond in WAL mode) from one thread, on the
store's connection; what may be large — a new batch's insert, a file's content, a batch's
finalization — on a connection of its own (``thread_connection``), in one transaction each.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from ..core.formats.batchdoc import FINISHED, request_counts

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT,
    body BLOB, status TEXT NOT NULL, result BLOB, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, idx);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, request BLOB NOT NULL, result BLOB);
CREATE TABLE IF NOT EXISTS runner (
    id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL, until REAL NOT NULL);
"""
MAX_FILES_LISTED = 10_000


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class Store:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                             timeout=30.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def thread_connection(self) -> Iterator[sqlite3.Connection]:
        """A connection for a worker thread (``:memory:`` has only the one)."""
        if self.path == ":memory:":
            yield self._db
            return
        with contextlib.closing(self._connect()) as db:
            yield db

    def size_bytes(self) -> int:
        """Pages in use: free ones are reused before the file grows, so what is deleted
        makes room at once. (The WAL beside it is reused too, its size bounded by SQLite's
        checkpoints.)"""
        used = self._db.execute("PRAGMA page_count").fetchone()[0] - self._db.execute(
            "PRAGMA freelist_count").fetchone()[0]
        return int(used * self._db.execute("PRAGMA page_size").fetchone()[0])

    def hold_runner(self, holder: str, now: float, ttl_s: float) -> bool:
        """Take or keep the lease on running the work; True if ``holder`` has it."""
        self._db.execute(
            "INSERT INTO runner VALUES (1, ?, ?) ON CONFLICT (id) DO UPDATE SET "
            "holder = excluded.holder, until = excluded.until "
            "WHERE runner.holder = excluded.holder OR runner.until < ?",
            (holder, now + ttl_s, now))
        found = self._db.execute("SELECT holder FROM runner").fetchone()
        return found is not None and found[0] == holder

    # --- files ---------------------------------------------------------------------------

    def add_file(self, row: dict[str, Any], content: bytes) -> None:
        """In a worker thread: up to ``max_file_bytes``."""
        with self.thread_connection() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (row["id"], row["owner"], row["purpose"], row["filename"],
                        len(content), row["created_at"], content))

    def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        found = self._db.execute(
            "SELECT id, purpose, filename, bytes, created_at FROM files "
            "WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        if found is None:
            return None
        keys = ("id", "purpose", "filename", "bytes", "created_at")
        return dict(zip(keys, found, strict=True))

    def file_content(self, file_id: str, owner: str) -> bytes | None:
        """In a worker thread: up to ``max_file_bytes``."""
        with self.thread_connection() as db:
            found = db.execute("SELECT content FROM files WHERE id = ? AND owner = ?",
                               (file_id, owner)).fetchone()
        return None if found is None else bytes(found[0])

    def files(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s files, newest first (at most ``MAX_FILES_LISTED``)."""
        keys = ("id", "purpose", "filename", "bytes", "created_at")
        return [dict(zip(keys, row, strict=True)) for row in self._db.execute(
            "SELECT id, purpose, filename, bytes, created_at FROM files WHERE owner = ? "
            "ORDER BY created_at DESC, id DESC LIMIT ?", (owner, MAX_FILES_LISTED))]

    def delete_file(self, file_id: str, owner: str) -> bool:
        return self._db.execute("DELETE FROM files WHERE id = ? AND owner = ?",
                                (file_id, owner)).rowcount > 0

    # --- batches ------------------------------------------------------------------------

    def add_batch(self, batch_id: str, owner: str, created_at: int, status: str, doc: str,
                  lines: Iterable[tuple[int, str | None, bytes | None, str, bytes | None]]
                  ) -> None:
        """In a worker thread: the batch and its lines (index, custom_id, body, status,
        result), in one transaction: a batch is there with all its lines, or not at all."""
        with self.thread_connection() as db, _transaction(db):
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                       (batch_id, owner, created_at, status, doc))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?)",
                           ((batch_id, *line) for line in lines))

    def batch(self, batch_id: str, owner: str | None = None) -> tuple[str, str, str] | None:
        """(status, doc, owner) of a batch (of ``owner``'s, if given)."""
        query = "SELECT status, doc, owner FROM batches WHERE id = ?"
        args: tuple[str, ...] = (batch_id,)
        if owner is not None:
            query, args = query + " AND owner = ?", (batch_id, owner)
        found = self._db.execute(query, args).fetchone()
        return None if found is None else (found[0], found[1], found[2])

    def batches(self, owner: str, after: str | None, limit: int) -> list[str]:
        """Docs of ``owner``'s batches, newest first, after the batch ``after``."""
        if after is None:
            rows = self._db.execute(
                "SELECT doc FROM batches WHERE owner = ? ORDER BY created_at DESC, id DESC "
                "LIMIT ?", (owner, limit)).fetchall()
        else:
            rows = self._db.execute(
                "SELECT doc FROM batches WHERE owner = ? AND (created_at, id) < "
                "(SELECT created_at, id FROM batches WHERE id = ?) "
                "ORDER BY created_at DESC, id DESC LIMIT ?", (owner, after, limit)).fetchall()
        return [row[0] for row in rows]

    def batches_with_status(self, statuses: Sequence[str]) -> list[str]:
        marks = ", ".join("?" for _ in statuses)
        return [row[0] for row in self._db.execute(
            f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at",
            tuple(statuses)).fetchall()]

    def cancel_batch(self, batch_id: str, doc: str) -> bool:
        """Mark an in-progress batch cancelling (False: it had ended meanwhile)."""
        return self._db.execute(
            "UPDATE batches SET status = 'cancelling', doc = ? WHERE id = ? AND "
            "status = 'in_progress'", (doc, batch_id)).rowcount > 0

    # --- lines --------------------------------------------------------------------------

    def take_lines(self, batch_id: str, limit: int) -> list[tuple[int, str, bytes]]:
        """Up to ``limit`` pending lines, in order, now marked running."""
        with _transaction(self._db) as db:
            rows = db.execute(
                "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND "
                "status = 'pending' ORDER BY idx LIMIT ?", (batch_id, limit)).fetchall()
            db.executemany("UPDATE lines SET status = 'running' WHERE batch_id = ? AND idx = ?",
                           ((batch_id, row[0]) for row in rows))
        return [(row[0], row[1], bytes(row[2])) for row in rows]

    def finish_line(self, batch_id: str, index: int, status: str, result: bytes) -> bool:
        """Record a running line's result; False if it was not running (answered once)."""
        return self._db.execute(
            "UPDATE lines SET status = ?, result = ?, body = NULL WHERE batch_id = ? "
            "AND idx = ? AND status = 'running'",
            (status, result, batch_id, index)).rowcount > 0

    def finalize(self, batch_id: str, outcome: str, now: int, new_file_id: Callable[[], str],
                 unanswered_line: Callable[[str | None, str], bytes]) -> bool:
        """In a worker thread, one transaction: the batch ends as ``outcome`` (completed,
        expired, cancelled). Lines not answered end too (``unanswered_line(custom_id,
        status)`` is their error line; as ``failed`` if the batch completed without them);
        the output (2xx) and error files are written; the saved document gets its counts and
        times. False if the batch had ended already (it is finalized once)."""
        with self.thread_connection() as db, _transaction(db):
            found = db.execute("SELECT status, doc, owner FROM batches WHERE id = ?",
                               (batch_id,)).fetchone()
            if found is None or found[0] in FINISHED:
                return False
            status = "failed" if outcome == "completed" else outcome
            rows = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id = ? AND "
                              "status IN ('pending', 'running')", (batch_id,)).fetchall()
            db.executemany(
                "UPDATE lines SET status = ?, result = ?, body = NULL WHERE batch_id = ? "
                "AND idx = ?", ((status, unanswered_line(row[1], status), batch_id, row[0])
                                for row in rows))
            doc = orjson.loads(found[1])
            doc["finalizing_at"] = doc["finalizing_at"] or now
            for field, statuses, suffix in (("output_file_id", "('done')", "output"), (
                    "error_file_id", "('failed', 'expired', 'cancelled')", "error")):
                results = [bytes(row[0]) for row in db.execute(
                    f"SELECT result FROM lines WHERE batch_id = ? AND status IN {statuses} "
                    "AND result IS NOT NULL ORDER BY idx", (batch_id,))]
                if results:
                    content = b"\n".join(results) + b"\n"
                    doc[field] = new_file_id()
                    db.execute("INSERT INTO files VALUES (?, ?, 'batch_output', ?, ?, ?, ?)",
                               (doc[field], found[2], f"{batch_id}_{suffix}.jsonl",
                                len(content), now, content))
            counts = dict(db.execute("SELECT status, COUNT(*) FROM lines WHERE batch_id = ? "
                                     "GROUP BY status", (batch_id,)).fetchall())
            doc["request_counts"] = request_counts(doc["request_counts"]["total"], counts)
            doc["status"] = outcome
            doc[f"{outcome}_at"] = now
            db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?",
                       (outcome, orjson.dumps(doc).decode(), batch_id))
        return True

    def counts(self, batch_id: str) -> dict[str, int]:
        return {row[0]: row[1] for row in self._db.execute(
            "SELECT status, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY status",
            (batch_id,)).fetchall()}

    def recover(self, batch_id: str) -> int:
        """The batch's lines left running (by a runner that stopped) go back to pending."""
        return self._db.execute(
            "UPDATE lines SET status = 'pending' WHERE batch_id = ? AND status = 'running'",
            (batch_id,)).rowcount

    # --- background responses -----------------------------------------------------------

    def add_response(self, response_id: str, owner: str, created_at: int,
                     request: bytes, doc: bytes) -> None:
        self._db.execute("INSERT INTO responses VALUES (?, ?, ?, 'queued', ?, ?)",
                         (response_id, owner, created_at, request, doc))

    def response(self, response_id: str, owner: str | None = None) -> tuple[str, bytes] | None:
        query = "SELECT status, result FROM responses WHERE id = ?"
        args: tuple[str, ...] = (response_id,)
        if owner is not None:
            query, args = query + " AND owner = ?", (response_id, owner)
        found = self._db.execute(query, args).fetchone()
        return None if found is None else (found[0], bytes(found[1]))

    def response_request(self, response_id: str) -> tuple[str, int, bytes] | None:
        """(owner, created_at, request body) of a background response."""
        found = self._db.execute(
            "SELECT owner, created_at, request FROM responses WHERE id = ?",
            (response_id,)).fetchone()
        return None if found is None else (found[0], found[1], bytes(found[2]))

    def set_response(self, response_id: str, status: str, doc: bytes,
                     only_if: Sequence[str] = ()) -> bool:
        query = "UPDATE responses SET status = ?, result = ? WHERE id = ?"
        args: tuple[Any, ...] = (status, doc, response_id)
        if only_if:
            query += f" AND status IN ({', '.join('?' for _ in only_if)})"
            args += tuple(only_if)
        return self._db.execute(query, args).rowcount > 0

    def responses_with_status(self, statuses: Sequence[str]) -> list[str]:
        marks = ", ".join("?" for _ in statuses)
        return [row[0] for row in self._db.execute(
            f"SELECT id FROM responses WHERE status IN ({marks}) ORDER BY created_at",
            tuple(statuses)).fetchall()]

    def summary(self) -> dict[str, dict[str, int]]:
        """Batches and background responses by status, and the lines of the batches in
        progress by status."""
        shown = {table: {row[0]: row[1] for row in self._db.execute(
                     f"SELECT status, COUNT(*) FROM {table} GROUP BY status").fetchall()}
                 for table in ("batches", "responses")}
        shown["lines"] = dict(self._db.execute(
            "SELECT status, COUNT(*) FROM lines WHERE batch_id IN (SELECT id FROM batches "
            "WHERE status IN ('in_progress', 'cancelling')) GROUP BY status").fetchall())
        return shown

    # --- retention ----------------------------------------------------------------------

    def forget_before(self, created_at: int) -> int:
        """Delete files, finished batches (and their lines) and finished responses created
        before ``created_at``; returns how many rows went."""
        done = str(FINISHED)
        db = self._db
        gone = db.execute(
            f"DELETE FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE "
            f"created_at < ? AND status IN {done})", (created_at,)).rowcount
        gone += db.execute(f"DELETE FROM batches WHERE created_at < ? AND status IN {done}",
                           (created_at,)).rowcount
        gone += db.execute("DELETE FROM files WHERE created_at < ?", (created_at,)).rowcount
        gone += db.execute(
            f"DELETE FROM responses WHERE created_at < ? AND status IN {done}",
            (created_at,)).rowcount
        return gone
