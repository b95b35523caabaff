"""The import contract: the arrows between the folders point one way.

- ``proxy.core`` is pure: nothing of asyncio, aiohttp or redis, nothing from the drivers
  or the config reader, directly or through a dependency.
- ``proxy.config`` reads YAML into ``core``'s value types: it imports ``core`` only.
- ``proxy.state`` (what replicas share: memory or Redis) and ``proxy.store`` (the durable
  SQLite store of work that can wait) import ``core`` and ``config``.
- The drivers (``proxy.http``, and ``proxy.sim`` on a virtual clock, itself free of I/O
  libraries) import ``core`` and ``config`` (``http`` also ``state`` and ``store``), never
  each other.
- Inside ``proxy.http`` the rooms stack (``ROOMS``, top first): each imports only itself
  and the rooms below it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "proxy"
IO_LIBRARIES = ("asyncio", "aiohttp", "redis", "uvloop")
# Which proxy folders each folder may import from.
ALLOWED = {
    "core": {"core"},
    "config": {"core", "config"},
    "state": {"core", "config", "state"},
    "store": {"core", "config", "store"},
    "http": {"core", "config", "state", "store", "http"},
    "sim": {"core", "config", "sim"},
}


# proxy.http's rooms, the composition root first: a room imports only the rooms after it.
ROOMS = ("server", "lane", "ops", "work", "call", "upstream", "base")


def proxy_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join((*base, node.module)) if node.module else ".".join(base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "proxy" and len(parts) > 1 else None


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folders_import_only_what_they_may(folder: str) -> None:
    wrong = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, module in proxy_imports(path):
            target = folder_of(module)
            top = module.split(".")[0]
            if target is not None and target not in ALLOWED[folder]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if folder in ("core", "sim") and top in IO_LIBRARIES:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert wrong == []


@pytest.mark.parametrize("room", ROOMS)
def test_the_drivers_rooms_import_only_downwards(room: str) -> None:
    below = set(ROOMS[ROOMS.index(room):])
    wrong = []
    for path in sorted((PACKAGE / "http" / room).rglob("*.py")):
        for line, module in proxy_imports(path):
            parts = module.split(".")
            if parts[:2] == ["proxy", "http"] and len(parts) > 2 and parts[2] not in below:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert wrong == []


def test_only_the_call_path_ops_and_the_root_reach_into_the_service() -> None:
    """``call.service.Service`` is the call path's own object; ``ops`` shows and reloads
    all of it. Work that can wait is handed what it uses (``Work(owner_of=, serves=)``)."""
    reaching = sorted(
        str(path.relative_to(ROOT)) for path in (PACKAGE / "http").rglob("*.py")
        if any(module == "proxy.http.call.service" for _, module in proxy_imports(path))
        and path.parent.name not in ("call", "ops", "server"))
    assert reaching == []


# What the optional extras install (pyproject.toml: semantic, otel): never imported by the
# pure core, which every command and the simulator load.
OPTIONAL = ("numpy", "usearch", "opentelemetry")


def test_the_core_imports_nothing_optional() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((PACKAGE / "core").rglob("*.py"))
             for line, module in proxy_imports(path) if module.split(".")[0] in OPTIONAL]
    assert wrong == []


def test_only_the_server_imports_the_lane() -> None:
    """The lane reads aiohttp's private parts: one room holds it, and only the composition
    root above it knows it is there."""
    reaching = sorted(
        str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
        if path.parent.name not in ("lane", "server")
        and any(module.startswith("proxy.http.lane") for _, module in proxy_imports(path)))
    assert reaching == []


def test_no_room_reaches_another_by_an_attribute_name() -> None:
    """What one room hands another goes by a typed key or an argument, not a ``getattr``
    of a name the other room happens to define."""
    found = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}" for path in (PACKAGE / "http").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "getattr" and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[0], ast.Name)
        and node.args[0].id == "request")
    assert found == []


def test_every_module_of_the_driver_is_in_a_room() -> None:
    loose = [p.name for p in (PACKAGE / "http").glob("*.py") if p.name != "__init__.py"]
    rooms = {p.name for p in (PACKAGE / "http").iterdir() if p.is_dir()} - {"__pycache__"}
    assert loose == [] and rooms == set(ROOMS)


def test_the_static_check_resolves_relative_imports(tmp_path: Path) -> None:
    path = PACKAGE / "core" / "scheduling" / "scheduler.py"
    modules = {module for _, module in proxy_imports(path)}
    assert "proxy.core.scheduling.capacity" in modules


# The pure core's packages by concern, and the few plain modules every one of them uses.
CORE_PACKAGES = ("scheduling", "call", "health", "formats", "caching")
CORE_PLAIN = ("clock", "engine", "errors", "lru", "quantile", "value")


def test_the_core_is_packages_by_concern() -> None:
    packages = {p.name for p in (PACKAGE / "core").iterdir()
                if p.is_dir() and p.name != "__pycache__"}
    plain = {p.stem for p in (PACKAGE / "core").glob("*.py") if p.name != "__init__.py"}
    assert packages == set(CORE_PACKAGES) and plain == set(CORE_PLAIN)
    for package in CORE_PACKAGES:
        assert (PACKAGE / "core" / package / "__init__.py").read_text().startswith('"""')


def test_scheduling_needs_nothing_of_a_calls_life() -> None:
    """Scheduling is the bottom of the core: a call's life, health and formats use it, not
    the other way round (what the scheduler is told comes in as tickets and numbers)."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((PACKAGE / "core" / "scheduling").rglob("*.py"))
             for line, module in proxy_imports(path)
             if module.startswith("proxy.core.") and module.split(".")[2] in (
                 "call", "health", "formats", "caching", "engine")]
    assert wrong == []


# A fresh interpreter: the test process itself has long since imported asyncio.
PROBE = """
import importlib, json, pkgutil, sys
import proxy.core
for info in pkgutil.iter_modules(proxy.core.__path__, "proxy.core."):
    importlib.import_module(info.name)
print(json.dumps(sorted(
    name for name in sys.modules
    if name.split(".")[0] in sys.argv[1:] or name.startswith(("proxy.http", "proxy.config"))
)))
"""


@pytest.mark.e2e  # a fresh interpreter, in a subprocess
def test_core_pulls_in_no_io_library_even_indirectly() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *IO_LIBRARIES], capture_output=True, text=True,
        timeout=60, cwd=ROOT, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.e2e  # a fresh interpreter, in a subprocess
def test_the_probe_would_see_a_forbidden_import() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.replace("import proxy.core", "import proxy.core, asyncio"),
         *IO_LIBRARIES], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )
    assert "asyncio" in json.loads(result.stdout)


def test_every_proxied_path_is_spelled_once() -> None:
    """The endpoints' table (``core/formats/endpoints.py``) is the only place a proxied
    path is written: every other module derives what it needs from it."""
    spelled = sorted(
        str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
        if path.name != "endpoints.py" and '"/v1/chat/completions"' in path.read_text())
    assert spelled == []


def type_only(path: Path) -> set[int]:
    """Lines of ``path``'s imports made for the type checker alone."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            lines |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
    return lines


@pytest.mark.parametrize("room", ROOMS)
def test_no_import_loop_inside_a_room(room: str) -> None:
    """Inside a room the modules import one another one way: a loop is a module that can
    only be understood with the whole room. The call path counts imports made for the type
    checker too; elsewhere (the lane's parts name each other's types) only those made at
    run time."""
    folder = PACKAGE / "http" / room
    prefix = f"proxy.http.{room}."
    graph = {}
    for path in folder.glob("*.py"):
        skip = set() if room == "call" else type_only(path)
        graph[path.stem] = {module.removeprefix(prefix).split(".")[0]
                            for line, module in proxy_imports(path)
                            if module.startswith(prefix) and line not in skip}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
