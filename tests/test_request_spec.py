"""Bodies OpenAI's API spec allows are accepted as it reads them; the rest are 400s that
name the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.call.tokens import TokenCounter
from proxy.core.errors import InvalidRequest
from proxy.core.formats.request import BodyLimits, Kind, parse_call

COUNTER = TokenCounter(None)


def parsed(kind: Kind, **body: Any) -> Any:
    return parse_call(orjson.dumps({"model": "m", **body}), kind, BodyLimits(), COUNTER)


@pytest.mark.parametrize(("body", "choices", "max_tokens"), [
    ({"prompt": "hi", "max_tokens": 0}, 1, 0),  # with echo: the prompt's logprobs only
    ({"prompt": "hi", "n": 100.0}, 100, None),  # JSON Schema's integer: 100.0 is one
    ({"prompt": None}, 1, None),  # nullable: the model's own start of text
    ({"prompt": ["a", "b"], "max_tokens": 3.0}, 1, 3),
])
def test_completions_the_spec_allows(body: dict[str, Any], choices: int,
                                     max_tokens: int | None) -> None:
    call = parsed("completions", **body)
    assert (call.choices, call.max_tokens) == (choices, max_tokens)


def test_chat_reads_integer_valued_numbers_as_integers() -> None:
    call = parsed("chat", messages=[{"role": "user", "content": "hi"}], n=2.0,
                  max_completion_tokens=16.0)
    assert (call.choices, call.max_tokens) == (2, 16)


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("completions", {}, "prompt"),  # required, even if it may be null
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 3}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 2.5}, "n"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 129}, "n"),
    ("completions", {"prompt": "hi", "n": 1e300}, "n"),
    ("completions", {"prompt": "hi", "n": True}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_what_the_spec_refuses_is_a_400_naming_the_field(
        kind: Kind, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parsed(kind, **body)
    assert refused.value.param == param
