"""Every module the docstrings and comments under proxy/ name exists: a dotted
``proxy.core.call.retry`` (and what follows it, ``proxy.core.errors.UpstreamTimeout``) imports and
resolves, and a ``proxy/…/x.py`` path (or ``tests/``, ``scripts/``, ``docs/``) is a file, so
a module that moves cannot leave its old name behind in the prose."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "proxy").rglob("*.py"))

# ``proxy.core.call.retry``, not a host name such as ``proxy.corp:3128`` nor the end of a sentence.
DOTTED = re.compile(r"(?<![\w./-])proxy(?:\.[A-Za-z_]\w*)+(?!\w|\.\w|:\d)")
PATH = re.compile(r"(?<![\w./-])(?:proxy|tests|scripts|docs)/[\w./-]*\w\.(?:py|js|md)\b")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string that stands alone as a statement
    (docstrings of modules, classes and functions, and those under constants)."""
    found = [(tok.start[0], tok.string)
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    found += [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return found


def resolves(dotted: str) -> bool:
    """The longest importable prefix of ``dotted`` is a module, the rest its attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def references(path: Path) -> list[tuple[int, str]]:
    return [(line, m.group(0)) for line, text in prose(path.read_text())
            for pattern in (DOTTED, PATH) for m in pattern.finditer(text)]


def stale(path: Path) -> list[str]:
    where = path.relative_to(ROOT)
    return [f"{where}:{line}: {name}" for line, name in references(path)
            if not (resolves(name) if name.startswith("proxy.") else (ROOT / name).exists())]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_docstring_or_comment_names_exists(path: Path) -> None:
    assert not stale(path), "names that no longer exist (moved or renamed?)"


def test_the_check_sees_the_references_and_the_stale_ones() -> None:
    seen = sum(len(references(path)) for path in SOURCES)
    assert seen > 40  # the scan reads the prose at all
    assert resolves("proxy.core.call.retry.RetryAllowance") and resolves("proxy.state")
    assert not resolves("proxy.retry") and not resolves("proxy.core.call.retry.Missing")
    text = ('"""Old homes: ``proxy.middleware`` and proxy/scheduler.py; not proxy.corp:3128,\n'
            'nor the proxy. Also ``proxy.core.scheduling.floors``."""\n# see proxy.errors\n')
    assert sorted(name for _, t in prose(text) for p in (DOTTED, PATH)
                  for name in (m.group(0) for m in p.finditer(t))) == [
        "proxy.core.scheduling.floors", "proxy.errors", "proxy.middleware", "proxy/scheduler.py"]
