"""The markers every test gets at collection (``tests/markers.py``), and the guard that keeps
a unit test in its process."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .markers import StaysInProcess, classify


class Item:
    """What ``classify`` reads of a collected test."""

    def __init__(self, module: str, *marks: str, fixtures: tuple[str, ...] = ()) -> None:
        self.path = Path(__file__).with_name(f"{module}.py")
        self.nodeid = f"tests/{module}.py::test_x"
        self.fixturenames = fixtures
        self.marks = list(marks)

    def add_marker(self, name: str) -> None:
        self.marks.append(name)

    def iter_markers(self) -> list[Any]:
        return [SimpleNamespace(name=name) for name in self.marks]


def marked(item: Item) -> set[str]:
    classify([item])  # type: ignore[list-item]
    return set(item.marks)


@pytest.mark.parametrize(("item", "expected"), [
    (Item("test_breaker"), {"unit"}),                                   # nothing says more
    (Item("test_forward", fixtures=("counter", "aiohttp_client")), {"e2e"}),  # a server
    (Item("test_wire"), {"e2e"}),                                       # the module table
    (Item("test_state_shared"), {"e2e", "redis"}),
    (Item("test_batches", "redis"), {"e2e", "redis"}),                  # needs Redis: sockets
    (Item("test_dashboard", "browser", fixtures=("aiohttp_server",)), {"e2e", "browser"}),
    (Item("test_config", "e2e"), {"e2e"}),                              # written on the test
], ids=["nothing", "fixture", "table", "table-redis", "redis", "browser", "written"])
def test_each_test_is_unit_or_e2e_by_its_fixtures_the_table_or_its_own_marker(
        item: Item, expected: set[str]) -> None:
    assert marked(item) == expected


@pytest.mark.parametrize("marks", [("unit", "e2e"), ("unit", "redis")], ids="+".join)
def test_a_test_marked_both_ways_or_unit_with_redis_fails_collection(
        marks: tuple[str, ...]) -> None:
    with pytest.raises(pytest.UsageError, match="exactly one of unit or e2e"):
        marked(Item("test_breaker", *marks))


def test_every_test_of_this_run_is_exactly_one_of_unit_or_e2e(
        request: pytest.FixtureRequest) -> None:
    kinds = {item.nodeid: {m.name for m in item.iter_markers()} & {"unit", "e2e"}
             for item in request.session.items}
    assert [nodeid for nodeid, found in kinds.items() if len(found) != 1] == []


def test_a_unit_test_that_opens_a_socket_or_starts_a_process_fails() -> None:
    with pytest.raises(StaysInProcess):
        socket.create_connection(("127.0.0.1", 9))
    with socket.socket() as sock, pytest.raises(StaysInProcess):
        sock.bind(("127.0.0.1", 0))
    with pytest.raises(StaysInProcess):
        subprocess.run(["true"], check=False)
