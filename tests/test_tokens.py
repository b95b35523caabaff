from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.tokens import (
    EXACT_LIMIT_CHARS,
    OFFLINE_ENCODING,
    TOKENS_PER_IMAGE,
    TokenCounter,
    count_estimate,
)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    loaded = TokenCounter.load()
    assert loaded.exact
    return loaded


@pytest.fixture(scope="module")
def encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(OFFLINE_ENCODING)


class NetworkUsed(AssertionError):
    pass


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Fail any connection attempt; force tiktoken to build the encoding from scratch."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise NetworkUsed(f"network used: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    read_paths: list[str] = []
    real_read_file = tiktoken.load.read_file

    def local_only(blobpath: str) -> bytes:
        read_paths.append(blobpath)
        if "://" in blobpath:
            raise NetworkUsed(f"tiktoken tried to fetch {blobpath}")
        return real_read_file(blobpath)

    monkeypatch.setattr(tiktoken.load, "read_file", local_only)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    yield read_paths


def test_load_reads_the_bundled_file_without_network(no_network: list[str]) -> None:
    loaded = TokenCounter.load()
    assert loaded.exact
    assert loaded.count("hello world") == 2
    assert no_network, "the encoding was not built from its file"
    assert all("://" not in path for path in no_network)


def test_fallback_with_one_warning(
    no_network: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing(blobpath: str) -> bytes:
        raise FileNotFoundError(blobpath)

    monkeypatch.setattr(tiktoken.load, "read_file", missing)
    with caplog.at_level(logging.WARNING, logger="proxy.core.call.tokens"):
        fallback = TokenCounter.load()
        counts = [fallback.count("hello world " * 100) for _ in range(3)]
        messages = fallback.count_messages([{"role": "user", "content": "hi there"}])
    assert not fallback.exact
    assert counts == [count_estimate("hello world " * 100)] * 3
    assert messages == count_estimate("hi there") + 3 + 1 + 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert OFFLINE_ENCODING in warnings[0].getMessage()


def test_unknown_encoding_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="proxy.core.call.tokens"):
        assert not TokenCounter.load("no_such_encoding").exact
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("hello world", 2),
        ("<|endoftext|>", 7),
        ("hi <|endofprompt|> there", 8),
        ("\ud800 lone surrogate", 3),
    ],
)
def test_count(counter: TokenCounter, text: str, tokens: int) -> None:
    assert counter.count(text) == tokens


SAMPLES = {
    "english": (
        "The scheduler keeps a queue per tier and hands the next free slot to the most "
        "urgent call that can use it, while older calls slowly age upwards so that "
        "nothing waits forever. "
    )
    * 40,
    "code": "def f(x: int) -> int:\n    return sorted(range(x))[x // 2] + len(str(x))\n" * 40,
    "json": '{"role": "user", "content": [1, 2, 3], "ok": true, "id": "a1b2"}\n' * 40,
    "chinese": "人工智能是计算机科学的一个分支，它企图了解智能的实质。" * 40,  # noqa: RUF001
    "russian": "Все люди рождаются свободными и равными в своем достоинстве. " * 40,  # noqa: RUF001
    "emoji": "ship it 🚀🎉 now " * 40,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_estimate_is_within_half_of_exact(counter: TokenCounter, name: str) -> None:
    text = SAMPLES[name]
    ratio = counter.estimate(text) / counter.count(text)
    assert 0.5 <= ratio <= 1.5, f"{name}: {ratio:.2f}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", 0), ("a", 1), ("abcd", 2), ("x" * 38, 10), ("\ud800", 1), ("é", 1)],
)
def test_count_estimate(text: str, expected: int) -> None:
    assert count_estimate(text) == expected


def test_count_or_estimate_switches_at_the_limit(counter: TokenCounter) -> None:
    short = "word " * (EXACT_LIMIT_CHARS // 5)
    long = short + "word"
    assert counter.count_or_estimate(short) == counter.count(short)
    assert counter.count_or_estimate(long) == count_estimate(long)
    assert counter.count(short) != count_estimate(short)


def reference_count(encoding: tiktoken.Encoding, messages: list[dict[str, str]]) -> int:
    """The OpenAI cookbook's num_tokens_from_messages for string-only messages."""
    total = 3
    for message in messages:
        total += 3
        for key, value in message.items():
            total += len(encoding.encode(value))
            if key == "name":
                total += 1
    return total


COOKBOOK_MESSAGES = [
    {"role": "system", "content": "You are a helpful, pattern-following assistant."},
    {"role": "system", "name": "example_user", "content": "New synergies will help."},
    {"role": "system", "name": "example_assistant", "content": "Things working well."},
    {"role": "user", "content": "This late pivot means we don't have time to boil the ocean."},
    {"role": "assistant", "content": "Sure."},
    {"role": "tool", "content": "42"},
]


def test_count_messages_matches_the_cookbook(
    counter: TokenCounter, encoding: tiktoken.Encoding
) -> None:
    assert counter.count_messages(COOKBOOK_MESSAGES) == reference_count(
        encoding, COOKBOOK_MESSAGES
    )


def test_count_messages_content_parts(counter: TokenCounter) -> None:
    as_string = [{"role": "user", "content": "hello world"}]
    as_parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "text", "text": " world"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    parts = counter.count_messages(as_parts)
    assert parts == counter.count("hello") + counter.count(" world") + 7 + TOKENS_PER_IMAGE
    assert counter.count_messages(as_string) == counter.count("hello world") + 7


def test_count_messages_tool_calls(counter: TokenCounter) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Berlin"}'}
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"function": call}]}]
    expected = counter.count("get_weather") + counter.count('{"city": "Berlin"}') + 7
    assert counter.count_messages(messages) == expected


def test_count_messages_estimates_past_the_limit(counter: TokenCounter) -> None:
    messages = [{"role": "user", "content": "word " * 1000}]
    exact = counter.count_messages(messages)
    assert counter.count_messages(messages, max_exact_chars=10_000) == exact
    estimated = counter.count_messages(messages, max_exact_chars=100)
    assert estimated == count_estimate("word " * 1000) + 7
    assert estimated != exact


@pytest.mark.parametrize(
    "junk",
    [
        None,
        "hello",
        42,
        {"role": "user"},
        [None, 1, "x", []],
        [{"role": 5, "content": 7}],
        [{"content": [None, 3, {"type": "text", "text": None}, {"type": "text"}]}],
        [{"role": "user", "content": {"text": "not a list"}}],
        [{"role": "assistant", "tool_calls": "nope", "function_call": [1]}],
        [{"role": "assistant", "tool_calls": [None, {"function": "x"}]}],
        # An unhashable part type once raised TypeError (a 500 for the call).
        [{"role": "user", "content": [{"type": ["text"], "text": "x"}, {"type": {"a": 1}}]}],
    ],
)
def test_junk_never_raises(counter: TokenCounter, junk: object) -> None:
    assert counter.count_messages(junk) >= 0
    assert isinstance(TokenCounter.messages_text(junk), str)
    assert isinstance(TokenCounter.last_user_message(junk), str)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hello world", 2),
        (["hello world", "hello"], 3),
        ([15339, 1917], 2),
        ([[15339, 1917], [15339]], 3),
        (["hello", 7, [1, 2], None, {"x": 1}, True], 4),
        (None, 0),
        (42, 0),
        ({"input": "hello"}, 0),
        ([], 0),
    ],
)
def test_count_input(counter: TokenCounter, value: object, expected: int) -> None:
    assert counter.count_input(value) == expected


def test_count_input_estimates_past_the_limit(counter: TokenCounter) -> None:
    texts = ["word " * 1000, "word " * 10]
    exact = sum(map(counter.count, texts))
    estimated = sum(map(count_estimate, texts))
    assert exact != estimated
    assert counter.count_input(texts, max_exact_chars=10_000) == exact
    assert counter.count_input(texts, max_exact_chars=100) == estimated


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], ""),
        ([{"role": "system", "content": "s"}], ""),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "a"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "c"}], "c"),
        ([{"role": "user", "content": [{"type": "text", "text": "p"}, "q"]}], "p\nq"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": None}], ""),
    ],
)
def test_last_user_message(messages: object, expected: str) -> None:
    assert TokenCounter.last_user_message(messages) == expected


def test_messages_text_joins_every_piece() -> None:
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert TokenCounter.messages_text(messages) == "rules\nann\nhi\nf\n{}"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "name", "tool_calls", "function"]),
        children,
        max_size=4,
    ),
    max_leaves=20,
)


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_any_json_counts_without_raising(value: object) -> None:
    counter = TokenCounter(None)
    assert counter.count_messages(value) >= 0
    assert counter.count_input(value) >= 0
    TokenCounter.messages_text(value)
    TokenCounter.last_user_message(value)
