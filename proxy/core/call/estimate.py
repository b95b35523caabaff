"""Learned expectations: output tokens per (key, model) and service time per deployment.

Both are exponentially weighted moving averages that start from a prior. The first few
observations are averaged with the prior as if it were one more sample, so a fresh model
converges in a handful of calls instead of ``1 / alpha`` calls. Memory is bounded by LRU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lru import Lru

DEFAULT_OUTPUT_PRIOR = 256
DEFAULT_TTFT_PRIOR_S = 0.5
DEFAULT_SECONDS_PER_TOKEN_PRIOR = 0.02
# Prefill speed is not learned separately (one observation cannot split it from queueing
# at the provider); a typical hosted model prefills about 10k tokens a second.
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 0.0001


@dataclass(frozen=True)
class EstimateSettings:
    """Priors of the estimators, until they have learned from completed calls. They are
    also the fixed yardstick of a call's size (``size_s``), so identical calls always join
    the same scheduler level whatever the estimators have learned since."""

    output_tokens: int = DEFAULT_OUTPUT_PRIOR
    ttft_s: float = DEFAULT_TTFT_PRIOR_S
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN_PRIOR
    prefill_seconds_per_token: float = DEFAULT_PREFILL_SECONDS_PER_TOKEN  # not learned

    def size_s(self, prompt_tokens: int, output_tokens: int) -> float:
        # Conditions, not max(): a builtin call costs more on this hot path.
        return (self.ttft_s + (prompt_tokens if prompt_tokens > 0 else 0)
                * self.prefill_seconds_per_token
                + (output_tokens if output_tokens > 0 else 0) * self.seconds_per_token)


@dataclass
class Ewma:
    """A moving average that treats its prior as one sample while young."""

    value: float
    samples: int = 0

    def update(self, observed: float, alpha: float) -> None:
        self.samples += 1
        young = 1.0 / (self.samples + 1)
        weight = young if young > alpha else alpha
        self.value += weight * (observed - self.value)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")


class OutputEstimator:
    """Expected output tokens of a call.

    ``max_tokens`` (or ``max_completion_tokens``) when the client sent it, as issue 3
    asks; with ``trust_max_tokens=False`` the learned average capped by it instead, which
    predicts better when clients send a generous limit. Otherwise the average for the
    (key, model) pair, falling back to the model's average across keys, then the prior.
    """

    def __init__(
        self,
        prior: int = DEFAULT_OUTPUT_PRIOR,
        alpha: float = 0.2,
        max_entries: int = 10_000,
        trust_max_tokens: bool = True,
    ) -> None:
        _check_alpha(alpha)
        self._prior = prior
        self._alpha = alpha
        self._trust_max_tokens = trust_max_tokens
        self._by_pair: Lru[tuple[str, str], Ewma] = Lru(max_entries)
        self._by_model: Lru[str, Ewma] = Lru(max_entries)

    def expect(self, key: str, model: str, max_tokens: int | None) -> int:
        limit = max_tokens if max_tokens is not None and max_tokens > 0 else None
        if limit is not None and self._trust_max_tokens:
            return limit
        learned = self._by_pair.get((key, model))
        if learned is None:
            learned = self._by_model.get(model)
        expected = round(self._prior if learned is None else learned.value)
        if expected < 1:
            expected = 1
        return expected if limit is None or limit >= expected else limit

    def observe(self, key: str, model: str, output_tokens: int) -> None:
        observed = float(output_tokens) if output_tokens > 0 else 0.0
        pair = self._by_pair.get((key, model))
        if pair is None:
            pair = self._by_pair[(key, model)] = Ewma(float(self._prior))
        per_model = self._by_model.get(model)
        if per_model is None:
            per_model = self._by_model[model] = Ewma(float(self._prior))
        pair.update(observed, self._alpha)
        per_model.update(observed, self._alpha)


@dataclass
class _Deployment:
    ttft_s: Ewma
    seconds_per_token: Ewma


class LatencyModel:
    """Expected time to first token and per output token, per deployment.

    Service time = time to first token (plus prefill of prompt tokens beyond what the
    learned average already holds) + output tokens x seconds per token.
    """

    def __init__(
        self,
        ttft_prior_s: float = DEFAULT_TTFT_PRIOR_S,
        seconds_per_token_prior: float = DEFAULT_SECONDS_PER_TOKEN_PRIOR,
        prefill_seconds_per_token: float = DEFAULT_PREFILL_SECONDS_PER_TOKEN,
        alpha: float = 0.2,
        max_entries: int = 1_000,
    ) -> None:
        _check_alpha(alpha)
        self._ttft_prior_s = ttft_prior_s
        self._seconds_per_token_prior = seconds_per_token_prior
        self._prefill = prefill_seconds_per_token
        self._alpha = alpha
        self._deployments: Lru[str, _Deployment] = Lru(max_entries)

    def expect_ttft_s(self, deployment: str) -> float | None:
        """Learned base time to first token, or None before any observation."""
        learned = self._deployments.get(deployment)
        if learned is None or learned.ttft_s.samples == 0:
            return None
        return learned.ttft_s.value

    def expect_seconds_per_token(self, deployment: str) -> float:
        learned = self._deployments.get(deployment)
        return learned.seconds_per_token.value if learned else self._seconds_per_token_prior

    def expect_service_s(self, deployment: str, prompt_tokens: int, output_tokens: int) -> float:
        learned = self._deployments.get(deployment)
        ttft = learned.ttft_s.value if learned else self._ttft_prior_s
        per_token = learned.seconds_per_token.value if learned else self._seconds_per_token_prior
        prefill = (prompt_tokens if prompt_tokens > 0 else 0) * self._prefill
        return ttft + prefill + (output_tokens if output_tokens > 0 else 0) * per_token

    def observe(
        self,
        deployment: str,
        ttft_s: float | None,
        output_tokens: int,
        total_s: float,
        prompt_tokens: int = 0,
    ) -> None:
        """Learn from one completed call.

        ``ttft_s`` is None when it is unknown (a non-streamed response); then only the
        per-token time is learned, from the part of ``total_s`` beyond the expected TTFT.
        """
        learned = self._deployments.get(deployment)
        if learned is None:
            learned = _Deployment(
                Ewma(self._ttft_prior_s), Ewma(self._seconds_per_token_prior)
            )
            self._deployments[deployment] = learned
        prefill = (prompt_tokens if prompt_tokens > 0 else 0) * self._prefill
        if not total_s > 0.0:
            total_s = 0.0
        if ttft_s is not None:
            first_token_at = ttft_s if ttft_s > 0.0 else 0.0
            if total_s < first_token_at:
                first_token_at = total_s
            ttft = first_token_at - prefill
            learned.ttft_s.update(ttft if ttft > 0.0 else 0.0, self._alpha)
            # The first token arrives at ttft; the rest stream after it.
            streamed = output_tokens - 1
        else:
            first_token_at = learned.ttft_s.value + prefill
            streamed = output_tokens
        # A non-streamed call faster than the expected TTFT cannot be split; skip it
        # rather than teach a per-token time of zero.
        if streamed > 0 and total_s > first_token_at:
            learned.seconds_per_token.update((total_s - first_token_at) / streamed, self._alpha)


def relative_error(predicted: float, actual: float, min_actual: float = 1.0) -> float:
    """Signed relative error ``(predicted - actual) / actual``; positive means over-estimate.

    ``min_actual`` bounds the denominator from below (e.g. 1 token, or 0.01 s) so a zero
    actual does not produce an infinity in a histogram.
    """
    return (predicted - actual) / (min_actual if min_actual > actual else actual)
