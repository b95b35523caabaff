"""Every test is ``unit`` or ``e2e``, and ``redis`` or ``browser`` besides where it needs one
(the markers are defined in pyproject.toml). The conftest applies them at collection:

1. a marker written on the test (or on a ``pytest.param``) stays;
2. a test that uses a fixture serving on real sockets is ``e2e`` (pytest lists every fixture
   a test uses, through other fixtures too, so a module's own ``start`` built on
   ``aiohttp_server`` counts);
3. ``MODULES`` says what fixtures cannot tell (raw servers, ``serve`` in a subprocess, Redis);
4. ``redis`` and ``browser`` need sockets, so they are ``e2e``; anything else is ``unit``.

A ``unit`` test that opens a socket or starts a process fails, saying so: the table cannot
drift from what the tests do.

A run whose ``-m`` selects unit tests only (``scripts/test -m unit``) is the fast subset:
Hypothesis tries a fifth of the examples each property asks for (at least 10; a failure it
found before is still replayed first from ``.hypothesis/``). Every other run tries them all."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

KINDS = ("unit", "e2e")
NEEDS = ("redis", "browser")

SOCKET_FIXTURES = frozenset({
    "aiohttp_client", "aiohttp_server", "aiohttp_raw_server", "aiohttp_unused_port",
    "unused_tcp_port", "unused_tcp_port_factory", "unused_udp_port", "unused_udp_port_factory",
    "free_tcp_port", "free_tcp_port_factory", "free_udp_port", "free_udp_port_factory",
})

# What fixtures cannot tell, by module: markers every test of it gets, and why.
MODULES: dict[str, tuple[tuple[str, ...], str]] = {
    "test_wire": (("e2e",), "the upstream client against raw asyncio servers on loopback"),
    "test_tracing": (("e2e",), "a fresh interpreter proves OpenTelemetry stays unimported"),
    "test_serve": (("e2e",), "the real `serve` in a subprocess"),
    "test_scaleout": (("e2e", "redis"), "replicas of `serve` sharing one Redis"),
    "test_state_shared": (("e2e", "redis"), "the redis state backend, on a real Redis"),
    "test_semantic_shared": (("e2e", "redis"), "the semantic cache's entries shared through "
                             "a real Redis (and one the test stops); the real `serve`"),
    "test_state_scripts": (("e2e", "redis"), "the Lua scripts, run by a real Redis"),
    "test_handover": (("e2e", "redis"), "leases handed from call to call, on a real Redis"),
    "test_shared_answers": (("e2e", "redis"), "replicas of `serve` sharing cached answers "
                            "and response homes through one Redis"),
    "test_budgets_shared": (("e2e", "redis"), "budgets on a real Redis, and `serve` replicas"),
    "test_egress": (("e2e",), "a CONNECT proxy and TLS providers of the test's own"),
    "test_lane_smoke": (("e2e",), "the real `serve` in a subprocess"),
    "test_fidelity": (("e2e",), "the real `serve` in a subprocess, against the simulator"),
    "test_wire_reuse": (("e2e",), "the upstream client against raw asyncio servers"),
    "test_node_sdk": (("e2e",), "the Node openai SDK against the real `serve`"),
    "test_anthropic_serve": (("e2e",), "Anthropic's SDKs and Claude Code against the real `serve`"),
    "test_conformance": (("e2e",), "requests from OpenAI's spec against the real `serve`"),
    "test_langchain": (("e2e",), "langchain-openai against the real `serve`"),
    "test_llama_server": (("e2e",), "llama.cpp's servers and the real `serve` in subprocesses"),
    "test_llama_engines": (("e2e",), "llama.cpp's llama-servers read by the real `serve`"),
    "test_soak": (("e2e", "redis"), "scripts/soak.py: three `serve` replicas, a private "
                                    "redis-server and fake providers, in subprocesses"),
}


def classify(items: list[pytest.Item]) -> None:
    """Mark each item as the module docstring says; a UsageError if one ends up with both
    or neither kind, or needs Redis or a browser as a unit test."""
    here = Path(__file__).parent
    stale = sorted(name for name in MODULES if not (here / f"{name}.py").exists())
    if stale:
        raise pytest.UsageError(f"tests/markers.py MODULES names no test module: {stale}")
    wrong = []
    for item in items:
        module = item.path.stem
        for name in MODULES.get(module, ((), ""))[0]:
            item.add_marker(name)
        has = {m.name for m in item.iter_markers() if m.name in (*KINDS, *NEEDS)}
        if "unit" not in has and "e2e" not in has:
            fixtures = set(getattr(item, "fixturenames", ()))
            on_sockets = bool(fixtures & SOCKET_FIXTURES) or bool(has & set(NEEDS))
            item.add_marker("e2e" if on_sockets else "unit")
            has.add("e2e" if on_sockets else "unit")
        if len(has & set(KINDS)) != 1 or ("unit" in has and has & set(NEEDS)):
            wrong.append(f"{item.nodeid}: {sorted(has)}")
    if wrong:
        raise pytest.UsageError("each test must be exactly one of unit or e2e (redis and "
                                "browser only with e2e):\n  " + "\n  ".join(wrong))


FEWER = 5
AT_LEAST = 10
GIVEN = "_hypothesis_internal_use_settings"  # where @given keeps them (@seed rewrites it so)


def fewer_examples(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a ``-m`` run of unit tests only, a fifth of each property's examples."""
    if not config.getoption("markexpr") or not items or any(
            item.get_closest_marker("unit") is None for item in items):
        return
    done: set[int] = set()
    for item in items:
        case, test = getattr(item, "cls", None), getattr(item, "function", None)
        # A stateful machine's settings are its TestCase's; a property's, its function's.
        owner, name = (case, "settings") if hasattr(case, "settings") else (test, GIVEN)
        found = getattr(owner, name, None)
        if not isinstance(found, settings):
            if getattr(test, "is_hypothesis_test", False):
                raise pytest.UsageError(f"{item.nodeid}: Hypothesis no longer keeps a "
                                        "test's settings where tests/markers.py looks")
            continue
        if id(owner) not in done:  # once for all of a parametrized test's items
            done.add(id(owner))
            fewer = min(found.max_examples, max(AT_LEAST, found.max_examples // FEWER))
            setattr(owner, name, settings(found, max_examples=fewer))


class StaysInProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def unit_stays_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``unit`` test may not open a socket or start a process."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(*_: Any, **__: Any) -> None:
        raise StaysInProcess(
            f"{request.node.nodeid} is marked unit but opened a socket or started a process: "
            "mark it e2e (on the test, or in tests/markers.py MODULES)")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("connect", "connect_ex", "bind"):
            patch.setattr(socket.socket, name, refuse)
        patch.setattr(subprocess.Popen, "__init__", refuse)
        yield
