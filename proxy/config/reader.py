"""Typed reading of parsed YAML with the path of every value, for errors that point at it.

``ConfigError`` messages always start with the YAML path (``providers[2].max_concurrency:
must be a positive integer``). ``${VAR}`` and ``${VAR:-default}`` are expanded in every
string; a variable that is unset and has no default leaves the value ``UNSET``, which the
schema either turns into a warning (secrets: the provider or key is disabled) or an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Final, NoReturn

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """An invalid configuration; the message names the YAML path."""


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


def interpolate(text: str, env: Mapping[str, str]) -> str | _Unset:
    """Expand ``${VAR}`` / ``${VAR:-default}``; UNSET if a variable without default is unset."""
    missing = False

    def substitute(match: re.Match[str]) -> str:
        nonlocal missing
        name, default = match.group(1), match.group(2)
        value = env.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                missing = True
                return ""
            return default
        return value

    expanded = _VAR.sub(substitute, text)
    return UNSET if missing else expanded


def unset_variables(text: str, env: Mapping[str, str]) -> list[str]:
    return [m.group(1) for m in _VAR.finditer(text) if m.group(2) is None and m.group(1) not in env]


class Node:
    """A mapping from the YAML document, with its path and the keys read so far."""

    def __init__(self, data: object, path: str, env: Mapping[str, str]) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            fail(path or "<root>", "must be a mapping")
        self.data: dict[object, object] = data
        self.path = path
        self.env = env
        self._read: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> object:
        """The value at ``key``, None if absent. An explicit null is an error: leaving a
        key out is how a default is asked for, so a null never silently means one."""
        self._read.add(key)
        value = self.data.get(key)
        if value is None and key in self.data:
            fail(self.sub(key), "must not be null (leave the key out for its default)")
        return value

    def node(self, key: str) -> Node:
        return Node(self.raw(key), self.sub(key), self.env)

    def items(self, key: str) -> Iterator[tuple[str, Node]]:
        """Sub-nodes of a list of mappings."""
        value = self.raw(key)
        if value is None:
            return
        if not isinstance(value, list):
            fail(self.sub(key), "must be a list")
        for i, item in enumerate(value):
            yield f"{self.sub(key)}[{i}]", Node(item, f"{self.sub(key)}[{i}]", self.env)

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str:
        value = self.secret(key, default, required=required)
        if isinstance(value, _Unset):
            fail(self.sub(key), f"environment variable {self._missing(key)} is not set")
        if not value.strip():
            fail(self.sub(key), "must not be empty")
        return value

    def secret(
        self, key: str, default: str | None = None, *, required: bool = False
    ) -> str | _Unset:
        value = self.raw(key)
        if value is None:
            if required or default is None:
                fail(self.sub(key), "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            fail(self.sub(key), "must be a string")
        return interpolate(str(value), self.env)

    def choice(self, key: str, options: tuple[str, ...], default: str) -> str:
        value = self.string(key, default)
        if value not in options:
            fail(self.sub(key), f"must be one of {', '.join(options)}")
        return value

    def optional_string(self, key: str) -> str | None:
        return self.string(key) if self.raw(key) is not None else None

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0,
                maximum: int | None = None) -> int:
        value = self._scalar(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            fail(self.sub(key), f"must be {rule}")
        if maximum is not None and value > maximum:
            fail(self.sub(key), f"must be at most {maximum}")
        return value

    def optional_integer(self, key: str, *, minimum: int = 0) -> int | None:
        return self.integer(key, minimum=minimum) if self.raw(key) is not None else None

    def number(self, key: str, default: float | None = None, *, minimum: float = 0.0,
               maximum: float | None = None, positive: bool = False,
               allow_infinite: bool = False) -> float:
        value = self._scalar(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(self.sub(key), "must be a number")
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and not allow_infinite):
            fail(self.sub(key), "must be a finite number")
        if number < minimum or (positive and number <= 0):
            rule = "a positive number" if positive else f">= {minimum}"
            fail(self.sub(key), f"must be {rule}")
        if maximum is not None and number > maximum:
            fail(self.sub(key), f"must be <= {maximum}")
        return number

    def optional_number(self, key: str, *, positive: bool = False) -> float | None:
        return self.number(key, positive=positive) if self.raw(key) is not None else None

    def boolean(self, key: str, default: bool) -> bool:
        value = self._scalar(key, default)
        if not isinstance(value, bool):
            fail(self.sub(key), "must be true or false")
        return value

    def mapping(self, key: str) -> dict[str, object]:
        value = self.raw(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            fail(self.sub(key), "must be a mapping")
        return {str(k): v for k, v in value.items()}

    def string_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail(self.sub(key), "must be a string or a list of strings")
        return tuple(value)

    def check_unknown(self) -> None:
        unknown = sorted(str(k) for k in self.data if str(k) not in self._read)
        if unknown:
            if _NAME.fullmatch(unknown[0]):
                fail(self.sub(unknown[0]), "unknown key")
            fail(self.path, f"an unknown key {safe_repr(unknown[0])}")

    def _scalar(self, key: str, default: object) -> object:
        value = self.raw(key)
        if value is None:
            if default is None:
                fail(self.sub(key), "is required")
            return default
        if isinstance(value, str):
            expanded = interpolate(value, self.env)
            if isinstance(expanded, _Unset):
                fail(self.sub(key), f"environment variable {self._missing(key)} is not set")
            return _parse_scalar(expanded)
        return value

    def _missing(self, key: str) -> str:
        return ", ".join(unset_variables(str(self.data.get(key)), self.env))


def _parse_scalar(text: str) -> object:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


# What a setting's name looks like. Anything else in the file may be a secret pasted in
# the wrong place (``api_key:sk-...`` without its space is a key, not a value), so error
# messages, which reach logs and /admin/status, quote only text of this shape.
_NAME = re.compile(r"[a-z][a-z0-9_]{0,23}")
_SHOWN = re.compile(r"(?:[A-Za-z][A-Za-z0-9_.\- ]{0,23})?")
_SECRETISH = re.compile(r"\d{4}|[A-Za-z0-9]{20}|^sk-|^key-", re.IGNORECASE)


def safe_repr(value: object) -> str:
    """``value`` quoted for an error message if it looks like a name, else a placeholder."""
    text = str(value)
    return repr(text) if _SHOWN.fullmatch(text) and not _SECRETISH.search(text) else (
        "(not shown: it does not look like a name)")



def fail(path: str, message: str) -> NoReturn:
    raise ConfigError(f"{path}: {message}")
