"""The command line as a newcomer meets it: help in plain text that says what each command
does, and every subcommand ending quietly when its reader has gone (``python -m proxy
simulate ... | head``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.__main__ import COMMANDS, STDOUT_CLOSED, main

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


def helped(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*args, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_help_is_plain_text_and_says_what_its_command_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    # The main help was the module's docstring, ``reST`` and all.
    top = helped(capsys)
    listed = re.search(r"\{(\w+(?:,\w+)+)\}", top)
    assert listed is not None
    names = listed[1].split(",")
    assert set(names) == {"serve", "check", "simulate", "scoreboard", "fit"}
    assert "``" not in top
    for name in names:
        text = helped(capsys, name)
        assert "``" not in text, name
        assert " ".join(COMMANDS[name].split()) in " ".join(text.split()), name
