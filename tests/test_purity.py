"""The pure core never imports asyncio or aiohttp, directly or through a dependency."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PURE_MODULES = (
    "proxy.scheduler",
    "proxy.scheduler_types",
    "proxy.scheduler_queues",
    "proxy.headroom",
    "proxy.breaker",
    "proxy.retry",
    "proxy.route",
    "proxy.limits",
    "proxy.classify",
    "proxy.estimate",
    "proxy.schedules",
    "proxy.tokens",
)
FORBIDDEN = ("asyncio", "aiohttp")
ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter: the test process itself has long since imported asyncio.
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in sys.argv[2:])))
"""


def imported_forbidden(module: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, *FORBIDDEN],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    names: list[str] = json.loads(result.stdout)
    return names


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_does_not_import_asyncio_or_aiohttp(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    assert imported_forbidden(module) == []


def test_the_probe_detects_a_forbidden_import() -> None:
    assert "asyncio" in imported_forbidden("asyncio.events")
