"""The real entry point, ``python -m proxy serve``, in a subprocess for a test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import IO


@contextlib.asynccontextmanager
async def serving(config: Path, *args: str, env: Mapping[str, str] | None = None,
                  stderr: IO[str] | None = None,
                  ) -> AsyncIterator[tuple[str, subprocess.Popen[str]]]:
    """``serve`` on ``config`` at a free port, once it says it listens: (its base URL, the
    process), killed on the way out if it is still running. ``env`` is added to this
    process's environment (``PYTHONUNBUFFERED`` always set); ``stderr`` takes the log (else
    it is the test's)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
         "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 30)
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.split()[-1].strip(), process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
