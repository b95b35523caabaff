"""The command line as a newcomer meets it: every subcommand ends quietly when its reader
has gone (``python -m proxy simulate ... | head``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.__main__ import STDOUT_CLOSED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e  # the command line, in subprocesses
def test_every_subcommand_ends_quietly_when_its_reader_has_gone(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 0.1, "prompt_tokens": 10,
                                         "output_tokens": 50, "tier": t}) + "\n"
                             for i, t in enumerate(["low", "normal", "critical"] * 20)))
    log = tmp_path / "access.log"
    log.write_text(json.dumps({"status": 200, "upstream": "sim/s", "upstream_ms": 900,
                               "ttft_ms": 100, "completion_tokens": 80}) + "\n")
    commands = [["--help"], ["--version"], ["check"],
                ["simulate", "--trace", str(trace), "--compare", "fcfs,priority"],
                ["scoreboard", "--only", "noisy-neighbour"], ["fit", "--log", str(log)],
                ["serve", "--port", "0", "--host", "127.0.0.1"]]
    # Buffered, the broken pipe shows when stdout is flushed (at exit, before); unbuffered
    # (PYTHONUNBUFFERED, as where the traceback was seen) at the first print.
    quiet = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    runs = [(args, quiet) for args in commands]
    runs.append((commands[3], {**quiet, "PYTHONUNBUFFERED": "1"}))
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line
    try:
        started = [(args, subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT,
                                           env=env, stdout=write, stderr=subprocess.PIPE,
                                           text=True)) for args, env in runs]
    finally:
        os.close(write)
    for args, process in started:
        _, err = process.communicate(timeout=60)
        assert (process.returncode, err) == (STDOUT_CLOSED, ""), args
