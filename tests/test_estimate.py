from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.estimate import Ewma, LatencyModel, OutputEstimator, relative_error


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        ([], 100.0),
        ([200.0], 150.0),
        ([200.0, 200.0], (100.0 + 200.0 + 200.0) / 3),
        ([0.0, 0.0, 0.0], 25.0),
        # Past the warm-up (weight 1/(n+1) < alpha) the weight is alpha.
        ([100.0, 100.0, 100.0, 100.0, 100.0, 200.0], 100.0 + 0.2 * 100.0),
    ],
)
def test_ewma_warm_up_then_alpha(observations: list[float], expected: float) -> None:
    average = Ewma(100.0)
    for observed in observations:
        average.update(observed, alpha=0.2)
    assert average.value == pytest.approx(expected)
    assert average.samples == len(observations)


@pytest.mark.parametrize(
    ("max_tokens", "observed", "trust", "expected"),
    [
        (None, [], True, 256),
        (None, [], False, 256),
        (0, [], True, 256),
        (-5, [], True, 256),
        (1000, [], True, 1000),
        (1000, [], False, 256),
        (100, [], False, 100),
        (None, [50], True, 153),
        (4096, [50] * 30, True, 4096),
        (4096, [50] * 30, False, 50),
        (20, [50] * 30, False, 20),
        (None, [0] * 30, True, 1),
    ],
)
def test_output_expectation(
    max_tokens: int | None, observed: list[int], trust: bool, expected: int
) -> None:
    estimator = OutputEstimator(prior=256, trust_max_tokens=trust)
    for tokens in observed:
        estimator.observe("app", "gpt", tokens)
    assert estimator.expect("app", "gpt", max_tokens) == expected


def test_output_pairs_are_separate_and_fall_back_to_the_model() -> None:
    estimator = OutputEstimator(prior=256)
    for _ in range(30):
        estimator.observe("chat", "gpt", 40)
        estimator.observe("batch", "gpt", 2000)
    assert estimator.expect("chat", "gpt", None) < 60
    assert estimator.expect("batch", "gpt", None) > 1900
    unseen_key = estimator.expect("new", "gpt", None)
    assert 40 < unseen_key < 2000
    assert estimator.expect("chat", "other-model", None) == 256


def test_output_converges_after_a_shift() -> None:
    estimator = OutputEstimator(prior=256, alpha=0.2)
    for _ in range(50):
        estimator.observe("k", "m", 100)
    assert estimator.expect("k", "m", None) == 100
    for _ in range(25):
        estimator.observe("k", "m", 500)
    assert abs(estimator.expect("k", "m", None) - 500) <= 2


def test_output_memory_is_bounded() -> None:
    estimator = OutputEstimator(prior=256, max_entries=3)
    for index in range(10):
        estimator.observe(f"key{index}", f"model{index}", 10)
    assert estimator.expect("key9", "model9", None) == 133
    assert estimator.expect("key0", "model0", None) == 256


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_alpha_is_checked(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        OutputEstimator(alpha=alpha)
    with pytest.raises(ValueError, match="alpha"):
        LatencyModel(alpha=alpha)


def model() -> LatencyModel:
    return LatencyModel(
        ttft_prior_s=0.5, seconds_per_token_prior=0.02, prefill_seconds_per_token=0.0001
    )


@pytest.mark.parametrize(
    ("prompt_tokens", "output_tokens", "expected_s"),
    [(0, 0, 0.5), (0, 100, 2.5), (10_000, 0, 1.5), (10_000, 100, 3.5), (-5, -5, 0.5)],
)
def test_service_time_priors(prompt_tokens: int, output_tokens: int, expected_s: float) -> None:
    latency = model()
    assert latency.expect_service_s("dep", prompt_tokens, output_tokens) == pytest.approx(
        expected_s
    )
    assert latency.expect_ttft_s("dep") is None


def test_streamed_calls_teach_ttft_and_per_token_time() -> None:
    latency = model()
    for _ in range(40):
        # 0.2 s to the first token, then 99 more tokens at 10 ms each.
        latency.observe("fast", ttft_s=0.2, output_tokens=100, total_s=0.2 + 0.99)
    assert latency.expect_ttft_s("fast") == pytest.approx(0.2, rel=1e-3)
    assert latency.expect_seconds_per_token("fast") == pytest.approx(0.01, rel=1e-3)
    assert latency.expect_service_s("fast", 0, 300) == pytest.approx(0.2 + 3.0, rel=1e-3)
    assert latency.expect_ttft_s("slow") is None
    assert latency.expect_service_s("slow", 0, 300) == pytest.approx(0.5 + 6.0)


def test_prefill_is_removed_from_the_learned_ttft() -> None:
    latency = model()
    for _ in range(40):
        latency.observe("d", ttft_s=1.3, output_tokens=1, total_s=1.3, prompt_tokens=10_000)
    assert latency.expect_ttft_s("d") == pytest.approx(0.3, rel=1e-3)
    assert latency.expect_service_s("d", 0, 0) == pytest.approx(0.3, rel=1e-3)
    assert latency.expect_service_s("d", 10_000, 0) == pytest.approx(1.3, rel=1e-3)


@pytest.mark.parametrize(
    ("total_s", "output_tokens", "per_token_after"),
    [
        # ttft prior 0.5: 2.5 s total for 100 tokens -> 20 ms each, unchanged.
        (2.5, 100, 0.02),
        # 1.5 s for 100 tokens -> 10 ms each; the first sample weighs one half.
        (1.5, 100, 0.015),
        # Faster than the expected TTFT: cannot be split, nothing learned.
        (0.3, 100, 0.02),
        (5.0, 0, 0.02),
    ],
)
def test_non_streamed_calls_teach_only_per_token_time(
    total_s: float, output_tokens: int, per_token_after: float
) -> None:
    latency = model()
    latency.observe("d", ttft_s=None, output_tokens=output_tokens, total_s=total_s)
    assert latency.expect_seconds_per_token("d") == pytest.approx(per_token_after)
    assert latency.expect_ttft_s("d") is None


@pytest.mark.parametrize(
    ("ttft_s", "output_tokens", "total_s"),
    [(-1.0, 10, 1.0), (5.0, 10, 1.0), (0.1, -3, 1.0), (0.1, 10, -2.0), (0.0, 1, 0.0)],
)
def test_odd_observations_keep_estimates_non_negative(
    ttft_s: float, output_tokens: int, total_s: float
) -> None:
    latency = model()
    latency.observe("d", ttft_s=ttft_s, output_tokens=output_tokens, total_s=total_s)
    ttft = latency.expect_ttft_s("d")
    assert ttft is not None and ttft >= 0.0
    assert latency.expect_seconds_per_token("d") >= 0.0


@given(
    st.lists(
        st.tuples(
            st.none() | st.floats(-10, 100),
            st.integers(-10, 10_000),
            st.floats(-10, 1000),
            st.integers(-10, 200_000),
        ),
        max_size=30,
    ),
    st.integers(0, 200_000),
    st.integers(0, 10_000),
)
@settings(max_examples=200, deadline=None)
def test_service_time_is_finite_and_non_negative(
    observations: list[tuple[float | None, int, float, int]], prompt: int, output: int
) -> None:
    latency = model()
    for ttft_s, tokens, total_s, prompt_tokens in observations:
        latency.observe("d", ttft_s, tokens, total_s, prompt_tokens=prompt_tokens)
    expected = latency.expect_service_s("d", prompt, output)
    assert math.isfinite(expected)
    assert expected >= 0.0


@pytest.mark.parametrize(
    ("predicted", "actual", "min_actual", "expected"),
    [
        (100, 100, 1.0, 0.0),
        (150, 100, 1.0, 0.5),
        (50, 100, 1.0, -0.5),
        (10, 0, 1.0, 10.0),
        (0.5, 0.0, 0.01, 50.0),
        (0, 0, 1.0, 0.0),
    ],
)
def test_relative_error(predicted: float, actual: float, min_actual: float,
                        expected: float) -> None:
    assert relative_error(predicted, actual, min_actual) == pytest.approx(expected)


@given(
    observations=st.lists(st.integers(-100, 100_000), max_size=20),
    max_tokens=st.none() | st.integers(-10, 50_000),
    trust=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_output_expectation_is_positive_and_within_the_limit(
    observations: list[int], max_tokens: int | None, trust: bool
) -> None:
    estimator = OutputEstimator(prior=256, trust_max_tokens=trust)
    for tokens in observations:
        estimator.observe("k", "m", tokens)
    expected = estimator.expect("k", "m", max_tokens)
    assert expected >= 1
    if max_tokens is not None and max_tokens > 0:
        assert expected <= max_tokens
        if trust:
            assert expected == max_tokens
    if observations:
        assert expected <= max(256, *observations) or expected == max_tokens
