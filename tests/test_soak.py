"""The chaos soak's short form (scripts/soak.py, run as ``scripts/soak``): three real
``serve`` replicas on a private ``redis-server``, the throttling fake providers, 84 s of
mixed load and one fault of each kind 12 s apart; every check must hold, the budget's
too (one replica SIGKILLed before Redis restarts empty: the others write its spend back)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .redis_server import NO_SERVER

ROOT = Path(__file__).resolve().parents[1]
FAULTS = {"kill_replica", "redis_restart_empty", "redis_pause", "storm_429",
          "slow_upstream", "term_replica"}
WALL_S = 240  # the soak takes about 100 s; a hang shows as this timeout
# In 84 s only about 15 critical calls fall outside the faults, so their p99 is their
# longest wait; now and then one waits for a slot a little over 1 s (1,003 and 1,004 ms
# seen; nothing is pre-empted, and in shared mode a call waits for a slot of its replica
# and then for one in Redis). The long soak keeps the default, 1 s, on hundreds of calls.
CRITICAL_P99_MS = "2000"


def test_a_short_soak_with_one_fault_of_each_kind_passes_its_checks(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(NO_SERVER)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "1.4",
         "--fault-every", "12", "--batch-lines", "30", "--critical-p99-ms", CRITICAL_P99_MS,
         "--json",
         "--quiet", "--logs", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=WALL_S, check=False)
    print(result.stdout)  # the soak's figures, shown when this test fails
    print(result.stderr[-4000:], file=sys.stderr)
    assert result.stdout.strip(), f"the soak printed nothing (exit {result.returncode})"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {f["kind"] for f in report["faults"]} == FAULTS
    checks = report["checks"]
    failed = {name for name, check in checks.items() if check["passed"] is False}
    assert not failed, {name: checks[name] for name in failed}
    assert result.returncode == 0
    # What each check stands on happened: calls of every kind, batches answered whole,
    # replicas restarted, Redis restarted, and each provider used up to its limit.
    assert checks["answered"]["outcomes"]["ok"] > 300
    assert {"json", "stream", "cancel_queue", "cancel_stream", "bad", "budget"} <= set(
        checks["answered"]["by_kind"])
    assert checks["batches"]["results"].get("whole", 0) >= 1
    assert len(checks["drains"]["drains"]) == 4  # one SIGTERMed mid-run, three at the end
    for provider in checks["limits"]["providers"].values():
        assert provider["most_outside_windows"] == provider["limit"]
