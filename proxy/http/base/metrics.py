"""Prometheus metrics, one registry per app; values without locks (see ``_LoopValue``)."""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values


class _LoopValue(values.MutexValue):
    """A metric's value without its lock: every update and every read of the proxy's
    metrics happens on the event loop's thread (worker threads only parse and store), so
    the lock is a cost every call would pay for nothing."""

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value


if values.ValueClass is values.MutexValue:  # not prometheus-client's multiprocess mode
    values.ValueClass = _LoopValue


class ChildCounter(Counter):
    """``inc`` without the checks only a parent or an exemplar needs: ``Family.get`` hands
    out children, and a call increments about five of them."""

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if not self._labelvalues or exemplar is not None or not amount >= 0:
            super().inc(amount, exemplar)
            return
        self._value.inc(amount)


class ChildHistogram(Histogram):
    """``observe`` by bisection, without the checks only a parent or an exemplar needs."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if not self._labelvalues or exemplar is not None:
            super().observe(amount, exemplar)
            return
        self._sum.inc(amount)
        bounds = self._upper_bounds
        i = bisect.bisect_left(bounds, amount)
        if i < len(bounds) and amount <= bounds[i]:  # NaN falls in no bucket, as upstream
            self._buckets[i].inc(1)


M = TypeVar("M", Counter, Gauge, Histogram)


class Family(Generic[M]):
    """A labelled metric whose children are looked up once. Label values come from the
    config and from small fixed sets (statuses, codes), so the cache stays small."""

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def clear(self) -> None:
        """Drop every child (their label values are no longer configured)."""
        self.metric.clear()
        self._children.clear()

    def get(self, *labels: str) -> M:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels)
        return child


WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
ERROR_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8)
# Fine below 5 ms, where admission through Redis is: 1 ms (the goal's p99) is a bound, no
# bound there is more than twice the one below, and 0.1 ms sets the hand-overs apart (no
# round trip); coarse above, where a call waited for a slot.
SHARED_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
                  0.01, 0.025, 0.1, 1, 10, 120)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Family(ChildCounter(
            "proxy_requests", "Calls answered, by tier and HTTP status.",
            ["tier", "status"], registry=r,
        ))
        self.queue_wait = Family(ChildHistogram(
            "proxy_queue_wait_seconds", "Time calls waited for an upstream slot.",
            ["tier"], buckets=WAIT_BUCKETS, registry=r,
        ))
        self.predicted_wait = Family(ChildHistogram(
            "proxy_queue_wait_predicted_seconds", "The wait foreseen for each call when it "
            "arrived (x-proxy-queue-predicted-ms), beside proxy_queue_wait_seconds.",
            ["tier"], buckets=WAIT_BUCKETS, registry=r,
        ))
        self.forecast_error = Family(ChildHistogram(
            "proxy_queue_wait_forecast_error_seconds", "|foreseen - real| queue wait of each "
            "call, by tier.", ["tier"], buckets=WAIT_BUCKETS, registry=r,
        ))
        self.key_wait = Family(ChildHistogram(
            "proxy_key_queue_wait_seconds", "Time calls waited for an upstream slot, by key "
            "(its configured name; anonymous without keys).", ["key"], buckets=WAIT_BUCKETS,
            registry=r,
        ))
        self.key_served = Family(ChildCounter(
            "proxy_key_served_seconds", "Upstream slot-seconds served, by key and tier: a "
            "key's share of its tier is its part of the tier's sum.", ["key", "tier"],
            registry=r,
        ))
        self.queue_depth = Family(Gauge(
            "proxy_queue_depth", "Calls waiting, by tier.", ["tier"], registry=r,
        ))
        self.rejections = Family(ChildCounter(
            "proxy_rejections", "Calls refused (429, 503), by tier and code.",
            ["tier", "code"], registry=r,
        ))
        self.inflight = Family(Gauge(
            "proxy_upstream_inflight", "Calls in flight, by provider.", ["provider"], registry=r,
        ))
        self.limit = Family(Gauge(
            "proxy_upstream_limit", "Effective concurrency limit, by provider.",
            ["provider"], registry=r,
        ))
        self.limit_source = Family(Gauge(
            "proxy_upstream_limit_source", "What holds each provider's limit now (1 for the "
            "source in force: configured, 429, engine, latency).", ["provider", "source"],
            registry=r,
        ))
        self.engine_readable = Family(Gauge(
            "proxy_engine_readable", "A self-hosted server's own figures can be read (1) or "
            "not (0: its limit fell back), by provider.", ["provider"], registry=r,
        ))
        self.engine_waiting = Family(Gauge(
            "proxy_engine_waiting", "Calls waiting in a self-hosted server's own queue, as it "
            "last said, by provider.", ["provider"], registry=r,
        ))
        self.attempts = Family(ChildCounter(
            "proxy_upstream_attempts", "Upstream attempts, by provider and outcome.",
            ["provider", "outcome"], registry=r,
        ))
        self.breaker_state = Family(Gauge(
            "proxy_breaker_state", "Breaker state by deployment (0 closed, 1 half-open, 2 open).",
            ["provider", "deployment"], registry=r,
        ))
        self.breaker_transitions = Family(ChildCounter(
            "proxy_breaker_transitions", "Breaker transitions, by deployment and new state.",
            ["deployment", "state"], registry=r,
        ))
        self.upstream_latency = Family(ChildHistogram(
            "proxy_upstream_latency_seconds",
            "Upstream attempts from send to the end of the answer, by provider, deployment "
            "and public model.", ["provider", "deployment", "model"],
            buckets=LATENCY_BUCKETS, registry=r,
        ))
        self.ttft = Family(ChildHistogram(
            "proxy_upstream_ttft_seconds",
            "Streams' time to the first byte from the upstream, by provider, deployment and "
            "public model.", ["provider", "deployment", "model"],
            buckets=LATENCY_BUCKETS, registry=r,
        ))
        self.tokens = Family(ChildCounter(
            "proxy_tokens", "Tokens, by provider and kind (prompt, completion).",
            ["provider", "kind"], registry=r,
        ))
        self.cost = Family(ChildCounter(
            "proxy_cost_usd", "Estimated spend in dollars, by key and tier.",
            ["key", "tier"], registry=r,
        ))
        self.estimate_error = Family(ChildHistogram(
            "proxy_estimate_relative_error", "|predicted - actual| / actual, by quantity.",
            ["quantity"], buckets=ERROR_BUCKETS, registry=r,
        ))
        self.cache_lookups = Family(ChildCounter(
            "proxy_cache_lookups", "Response cache lookups, by public model and result "
            "(hit, miss).", ["model", "result"], registry=r,
        ))
        self.cache_entries = Family(Gauge(
            "proxy_cache_entries", "Answers held in the response cache, by public model.",
            ["model"], registry=r,
        ))
        self.cache_shared_errors = Family(ChildCounter(
            "proxy_cache_shared_errors", "Redis commands of the shared response cache and "
            "response homes that failed or were too slow (redis backend; each a miss or a "
            "write dropped), by operation (lookup, store, home_lookup, home_store).",
            ["operation"], registry=r,
        ))
        self.semantic_shared_errors = Family(ChildCounter(
            "proxy_semantic_cache_shared_errors", "Redis commands of the shared semantic cache "
            "that failed (redis backend; each an entry kept on this replica only, or a read "
            "tried again a second later), by operation (store, read).",
            ["operation"], registry=r,
        ))
        self.semantic_lookups = Family(ChildCounter(
            "proxy_semantic_cache_lookups", "Semantic cache lookups, by public model and "
            "result (hit, miss, bypass, error).", ["model", "result"], registry=r,
        ))
        self.semantic_nearest = Family(ChildCounter(
            "proxy_semantic_cache_nearest", "Semantic cache lookups that found a neighbour, "
            "by public model and the band of its similarity (near misses: the bands below "
            "the threshold).", ["model", "band"], registry=r,
        ))
        self.semantic_entries = Family(Gauge(
            "proxy_semantic_cache_entries", "Answers held in the semantic cache, by public "
            "model.", ["model"], registry=r,
        ))
        self.semantic_seconds = Family(ChildHistogram(
            "proxy_semantic_cache_lookup_seconds", "What a semantic lookup took (the "
            "embedding and the search), by public model: what a miss adds.", ["model"],
            buckets=WAIT_BUCKETS, registry=r,
        ))
        self.budget_spent = Family(Gauge(
            "proxy_budget_spent_usd", "Spend of keys with a budget_usd in the current period.",
            ["key"], registry=r,
        ))
        self.budget_amount = Family(Gauge(
            "proxy_budget_usd", "The budget_usd amount of each key that has one.", ["key"],
            registry=r,
        ))
        self.reloads = Family(ChildCounter(
            "proxy_config_reloads", "Config reloads, by result (ok, error).", ["result"],
            registry=r,
        ))
        self.stream_errors = Family(ChildCounter(
            "proxy_stream_errors", "Streams ended with an error event after the first byte.",
            ["provider", "reason"], registry=r,
        ))

        self.shared_wait = Histogram(
            "proxy_shared_admission_seconds", "Time a call granted a local slot took to "
            "lease its provider slot across replicas (redis backend: a Redis round trip, "
            "plus the wait when every slot is taken).", buckets=SHARED_BUCKETS, registry=r,
        )
        self.shared_mode = Family(Gauge(
            "proxy_shared_state_mode", "1 for the shared-state mode in force (shared, local, "
            "reject; memory: local).", ["mode"], registry=r,
        ))
        self.replicas = Gauge(
            "proxy_replicas_alive", "Replicas that sent a heartbeat within the lease TTL "
            "(memory: 1).", registry=r,
        )
        self.shared_errors = Gauge(
            "proxy_shared_state_errors", "Redis operations that failed since start.",
            registry=r,
        )
        self.shared_entered = Family(Gauge(
            "proxy_shared_state_entered", "Times the shared-state mode was entered since start "
            "(local, reject: Redis lost; shared: back).", ["mode"], registry=r,
        ))
        self.shared_fallback = Gauge(
            "proxy_shared_state_fallback_seconds", "Seconds spent out of shared mode since "
            "start (redis backend).", registry=r,
        )
        self.shared_rebuilds = Gauge(
            "proxy_shared_state_rebuilds", "Times Redis had lost this replica's state (an "
            "empty restart, a flush, a failover to an older copy) and it was written back.",
            registry=r,
        )

        self.batch_lines = Family(ChildCounter(
            "proxy_batch_lines", "Batch lines answered, by outcome (done: 2xx; failed: the "
            "upstream refused it).", ["outcome"], registry=r,
        ))
        self.storage_bytes = Gauge(
            "proxy_storage_bytes", "Size of the store of work that can wait (storage.path).",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
