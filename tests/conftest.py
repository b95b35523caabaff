from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from proxy.config import Config, parse_config
from proxy.core.tokens import TokenCounter


@pytest.fixture(scope="session")
def counter() -> TokenCounter:
    return TokenCounter.load()


def config_from(
    providers: list[dict[str, Any]],
    models: dict[str, Any],
    **sections: Any,
) -> Config:
    data: dict[str, Any] = {"providers": providers, "models": models, **sections}
    return parse_config(data, {})


@pytest.fixture
def make_config() -> Callable[..., Config]:
    return config_from
