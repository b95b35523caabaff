"""``@value``: an immutable dataclass to the type checker, a plain slotted one at run time.

A frozen dataclass sets each field through ``object.__setattr__``, which makes one slower
to build than a plain one, and a proxied call builds a dozen such values (its plan,
classification, commands, results). mypy still refuses
any assignment to a field (``frozen_default``); equality and hashing are a frozen one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def value(cls: type[T]) -> type[T]:
    return dataclass(slots=True, unsafe_hash=True)(cls)
