"""Self-hosted servers in the core: what their figures allow (``EngineView``), a limit
learned from latency (``LatencyLimit``), a pool's room, the fleet that joins them, the
priority a call is sent with, and the figures read off each server's own pages."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import orjson
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy.config import parse_config
from proxy.core.call.route import Deployment, DeploymentStats, ModelRoute, rank
from proxy.core.health.engines import START, EngineView, Figures
from proxy.core.health.fleet import GRACE_MIN_S, UNREADABLE_S, Fleet
from proxy.core.health.gradient import LatencyLimit
from proxy.core.health.provider import Provider, SimSettings, Timeouts
from proxy.core.scheduling.capacity import Pool
from proxy.core.scheduling.scheduler import Scheduler, SchedulerSettings, Ticket, TierSpec
from proxy.http.upstream.engines import Unreadable, parse_metrics, parse_props, parse_slots
from proxy.http.upstream.simulated import SimulatedUpstream
from proxy.http.upstream.upstream import UpstreamRequest
from proxy.sim import scenarios, workloads
from proxy.sim.results import Outcome
from proxy.sim.run import simulate

# --- EngineView: (now, figures or "fail", the proxy's calls there, expected room) -----

VIEW_STEPS = {
    "llama.cpp says its slots: all free to the proxy when only its calls run": [
        (0.0, Figures(2, 0, slots=4), 2, 4.0)],
    "others' calls there are not the proxy's to use": [
        (0.0, Figures(3, 1, slots=4), 1, 1.0), (0.5, Figures(4, 2, slots=4), 0, 0.0)],
    "figures older than the grace count as full, never as free": [
        (0.0, Figures(0, 0, slots=4), 0, 4.0), (2.0, None, 0, 4.0), (2.01, None, 0, 0.0)],
    "a server unread for long falls back (None)": [
        (0.0, Figures(0, 0, slots=4), 0, 4.0), (14.9, "fail", 0, 0.0), (15.0, "fail", 0, None)],
    "a read after falling back counts at once": [
        (0.0, "fail", 0, 0.0), (15.0, "fail", 0, None), (16.0, Figures(1, 0, slots=2), 1, 2.0)],
    "never read: full, then unreadable": [(0.0, None, 0, 0.0), (15.0, None, 0, None)],
    "learned: calls waiting inside mean it runs all it can, for a while": [
        (0.0, Figures(6, 3), 9, 6.0), (0.5, Figures(6, 0), 6, 6.0),
        (10.0, Figures(6, 0), 6, 7.0)],
    "learned: all used and nothing waiting, KV mostly free: half again": [
        (0.0, Figures(4, 0, kv_use=0.2), 4, 6.0), (0.5, Figures(6, 0, kv_use=0.3), 6, 9.0)],
    "learned: all used, KV not mostly free: an eighth (at least one)": [
        (0.0, Figures(4, 0, kv_use=0.6), 4, 5.0), (0.5, Figures(5, 0), 5, 6.0)],
    "learned: one read of calls waiting, the cache mostly free, cuts nothing (a burst)": [
        (0.0, Figures(8, 0, kv_use=0.1), 8, 12.0), (0.5, Figures(8, 4, kv_use=0.3), 12, 12.0),
        (1.0, Figures(12, 0), 12, 12.0)],
    "learned: two reads of calls waiting cut to what runs": [
        (0.0, Figures(8, 0, kv_use=0.1), 8, 12.0), (0.5, Figures(9, 3, kv_use=0.3), 12, 12.0),
        (1.0, Figures(9, 3, kv_use=0.3), 12, 9.0)],
    "learned: calls waiting with the cache nearly full cut at once": [
        (0.0, Figures(8, 0, kv_use=0.1), 8, 12.0), (0.5, Figures(9, 3, kv_use=0.95), 12, 9.0)],
    "learned: KV nearly full, it takes no more than it runs": [
        (0.0, Figures(4, 0, kv_use=0.95), 4, 4.0), (0.5, Figures(4, 0, kv_use=0.95), 4, 4.0)],
    "learned: not all used, no growth": [(0.0, Figures(1, 0, kv_use=0.1), 1, float(START))],
    "absurd figures are clamped": [(0.0, Figures(-5, -2, slots=-1), 0, float(START))],
}


@pytest.mark.parametrize("steps", VIEW_STEPS.values(), ids=VIEW_STEPS.keys())
def test_engine_view(steps: list[tuple[float, Figures | str | None, int, float | None]]) -> None:
    view = EngineView(grace_s=2.0, unreadable_s=15.0)
    for index, (now, figures, inflight, expected) in enumerate(steps):
        if isinstance(figures, Figures):
            view.read(figures, inflight, now)
        elif figures == "fail":
            view.failed("refused", now)
        assert view.room(now) == expected, f"step {index}"


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(-3, 50), st.integers(-3, 50),
                          st.one_of(st.none(), st.integers(-2, 64)),
                          st.one_of(st.none(), st.floats(0, 1)), st.integers(0, 64))),
       st.floats(0, 30))
def test_a_room_is_never_negative_nor_above_what_the_server_has(
        reads: list[tuple[float, int, int, int | None, float | None, int]],
        later: float) -> None:
    view = EngineView(grace_s=2.0, unreadable_s=15.0)
    now = 0.0
    for gap, running, waiting, slots, kv, inflight in reads:
        now += gap
        view.read(Figures(running, waiting, slots, kv), inflight, now)
        room = view.room(now)
        assert room is not None and 0 <= room <= (view.capacity or 0)
        if slots is not None and slots > 0:
            assert room <= slots
    stale = view.room(now + later)
    assert stale is None or stale == 0.0 or later <= 2.0


# --- LatencyLimit -----------------------------------------------------------------------


def test_latency_limit_grows_while_latency_holds_and_shrinks_when_it_climbs() -> None:
    limit = LatencyLimit(cap=64, start=8)
    for _ in range(40):
        limit.sample(1.0, 92, inflight=limit.limit)  # 0.01 s a token, flat
    grown = limit.limit
    assert grown > 8
    for _ in range(40):
        limit.sample(4.0, 92, inflight=limit.limit)  # four times slower
    assert limit.limit < grown / 2


def test_latency_limit_does_not_grow_when_unused_and_stays_within_its_cap() -> None:
    idle = LatencyLimit(cap=64, start=8)
    for _ in range(100):
        idle.sample(1.0, 92, inflight=1)
    assert idle.limit == 8
    busy = LatencyLimit(cap=10, start=8)
    for _ in range(100):
        busy.sample(1.0, 92, inflight=busy.limit)
    assert busy.limit == 10


@given(st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6),
                          st.integers(0, 2000))))
def test_latency_limit_stays_between_one_and_its_cap_whatever_it_is_told(
        samples: list[tuple[float, int, int]]) -> None:
    limit = LatencyLimit(cap=32)
    for seconds, tokens, inflight in samples:
        assert 1 <= limit.sample(seconds, tokens, inflight) <= 32


def test_latency_per_token_compares_short_and_long_calls() -> None:
    limit = LatencyLimit(cap=64, start=16)
    for index in range(60):  # the same speed, calls of 10 and 1000 tokens in turn
        tokens = 10 if index % 2 else 1000
        limit.sample(0.01 * (tokens + 8), tokens, inflight=16)
    assert limit.limit >= 16


# --- the pool's room -------------------------------------------------------------------


def test_a_room_caps_the_limit_and_says_so() -> None:
    pool = Pool("p", 8)
    assert (pool.limit, pool.limit_source) == (8, "configured")
    pool.set_room(6, "engine", 0.0)
    assert (pool.limit, pool.limit_source) == (6, "engine")
    pool.cut(0.0, 1)  # a 429: half the limit in force (at most), and the 429 holds it
    assert (pool.limit, pool.limit_source) == (3, "429")
    pool.set_room(0, "latency", 0.0)
    assert (pool.limit, pool.limit_source, pool.free(0.0)) == (0, "latency", 0)
    pool.set_room(math.inf, "engine", 0.0)
    assert (pool.limit, pool.limit_source) == (3, "429")


def scheduler(limit: int = 8) -> Scheduler:
    return Scheduler(SchedulerSettings(tiers=(TierSpec("high"), TierSpec("low"))), {"p": limit},
                     {"p/m": "p"})


def test_a_raised_room_hands_out_slots_to_waiting_calls_in_tier_order() -> None:
    sched = scheduler()
    sched.set_room("p", 0, "engine", 0.0)
    low = [Ticket(tier=1, candidates=("p/m",), est_service_s=1.0) for _ in range(3)]
    high = Ticket(tier=0, candidates=("p/m",), est_service_s=1.0)
    for ticket in [*low, high]:
        sched.submit(ticket, 0.0)
    assert not sched.take().dispatches
    sched.set_room("p", 2, "engine", 1.0)
    granted = [d.ticket for d in sched.take().dispatches]
    assert granted == [high, low[0]]


# --- the fleet: figures and latency into the scheduler's room ---------------------------


def fleet_of(engine: str | None, auto: bool, cap: int = 1024) -> tuple[Fleet, Scheduler]:
    provider = Provider("p", "openai", cap, engine=engine, auto=auto)
    sched = Scheduler(SchedulerSettings(tiers=(TierSpec("only"),)), {"p": cap}, {"p/m": "p"})
    return Fleet(sched, {"p": provider}, [Deployment("p", "m")], [], 0.2,
                 random.Random(0)), sched


def test_an_engine_provider_takes_nothing_before_its_first_read() -> None:
    fleet, sched = fleet_of("llama.cpp", auto=True)
    assert (sched.capacity("p"), sched.limit_source("p")) == (0, "engine")
    fleet.engine_read("p", Figures(0, 0, slots=3), 0.0)
    assert sched.capacity("p") == 3


def test_an_unreadable_engine_falls_back_to_its_latency_limit_or_its_number() -> None:
    auto, sched = fleet_of("vllm", auto=True)
    auto.engine_failed("p", "refused", 0.0)
    assert sched.capacity("p") == 0  # within the grace: full
    auto.engine_failed("p", "refused", UNREADABLE_S)
    assert (sched.capacity("p"), sched.limit_source("p")) == (8, "latency")
    capped, sched = fleet_of("vllm", auto=False, cap=5)
    capped.engine_failed("p", "refused", GRACE_MIN_S)
    capped.engine_failed("p", "refused", UNREADABLE_S + GRACE_MIN_S)
    assert (sched.capacity("p"), sched.limit_source("p")) == (5, "configured")


def test_a_number_caps_what_the_server_says() -> None:
    fleet, sched = fleet_of("llama.cpp", auto=False, cap=2)
    fleet.engine_read("p", Figures(0, 0, slots=8), 0.0)
    assert (sched.capacity("p"), sched.limit_source("p")) == (2, "configured")


def test_latency_samples_set_an_auto_providers_limit() -> None:
    fleet, sched = fleet_of(None, auto=True, cap=64)
    assert (sched.capacity("p"), sched.limit_source("p")) == (8, "latency")
    for _ in range(30):
        fleet.answered("p", 1.0, 92, 0.0)
    assert sched.capacity("p") == 8  # nothing in flight: no proof it can take more
    for _ in range(8):  # every slot in use
        sched.submit(Ticket(tier=0, candidates=("p/m",), est_service_s=1.0), 0.0)
    for _ in range(30):
        fleet.answered("p", 1.0, 92, 0.0)
    grown = sched.capacity("p")
    assert grown > 8 and sched.limit_source("p") == "latency"
    for _ in range(30):
        fleet.answered("p", 4.0, 92, 0.0)  # four times slower per token
    assert sched.capacity("p") < grown / 2


def test_a_429_cuts_an_auto_providers_limit_from_the_one_in_force() -> None:
    _, sched = fleet_of(None, auto=True, cap=1024)
    assert sched.capacity("p") == 8
    sched.cut("p", 0.0, bore=1)
    assert (sched.capacity("p"), sched.limit_source("p")) == (4, "429")


def test_a_reload_to_another_server_forgets_the_first_ones_figures() -> None:
    fleet, sched = fleet_of("vllm", auto=True)
    fleet.engine_read("p", Figures(0, 0, slots=6), 0.0)
    fleet.refuse_priority("p")
    moved = Provider("p", "openai", 1024, base_url="http://other:8000/v1", engine="sglang",
                     auto=True)
    fleet.reconfigure({"p": moved}, [Deployment("p", "m")], [], 0.2)
    fleet.settle_room("p", 0.5)
    assert (fleet.engines["p"].capacity, sched.capacity("p")) == (None, 0)
    assert fleet.priority_refused == set()


def test_a_refused_priority_is_said_once() -> None:
    fleet, _ = fleet_of("vllm", auto=True)
    assert fleet.refuse_priority("p") is True
    assert fleet.refuse_priority("p") is False
    assert fleet.priority_refused == {"p"}


# --- priority numbers -----------------------------------------------------------------------


@pytest.mark.parametrize(("order", "expected"), [("lower", [0, 1, 2]), ("higher", [2, 1, 0])])
def test_priority_follows_the_tier_order(order: str, expected: list[int]) -> None:
    deployment = Deployment("p", "m")
    assert [deployment.priority(name, i, 3, order)
            for i, name in enumerate(("critical", "high", "low"))] == expected


def test_a_candidates_own_priority_wins() -> None:
    deployment = Deployment("p", "m", priorities=(("low", 100),))
    assert deployment.priority("low", 2, 3, "lower") == 100
    assert deployment.priority("critical", 0, 3, "lower") == 0


# --- what each server's pages say ---------------------------------------------------------

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.17
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_sum{model_name="m"} 0.0
"""

VLLM_V0 = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="0"} 7.0
sglang:num_running_reqs{model_name="m",tp_rank="1",pp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0",pp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",tp_rank="1",pp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0",pp_rank="0"} 0.28
"""

LLAMA = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


@pytest.mark.parametrize(("engine", "text", "expected"), [
    ("vllm", VLLM, Figures(5, 1, kv_use=0.42)),
    ("vllm", VLLM_V0, Figures(4, 0, kv_use=0.5)),
    ("sglang", SGLANG, Figures(7, 2, kv_use=0.28)),
    ("llama.cpp", LLAMA, Figures(2, 5)),
])
def test_figures_from_each_servers_metrics(engine: str, text: str, expected: Figures) -> None:
    assert parse_metrics(engine, text) == expected


@pytest.mark.parametrize("text", ["", "garbage {{{", VLLM.replace("waiting", "idle"),
                                  "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n"])
def test_metrics_without_the_gauges_are_unreadable(text: str) -> None:
    with pytest.raises((Unreadable, ValueError)):
        parse_metrics("vllm", text)


def test_llama_slots_and_props() -> None:
    slots = (b'[{"id":0,"is_processing":true},{"id":1,"is_processing":false},'
             b'{"id":2,"is_processing":true}]')
    assert parse_slots(slots) == (3, 2)
    assert parse_props(b'{"total_slots": 4, "n_ctx": 512}') == 4
    for bad in (b'{"total_slots": 0}', b'{"total_slots": true}', b"[]"):
        with pytest.raises(Unreadable):
            parse_props(bad)
    with pytest.raises(Unreadable):
        parse_slots(b'{"slots": 2}')


# --- the emptiest server first ---------------------------------------------------------------


def test_equal_self_hosted_candidates_go_emptiest_first() -> None:
    a, b, c = Deployment("a", "m"), Deployment("b", "m"), Deployment("c", "m", input_cost=1.0)
    route = ModelRoute("m", (a, b, c))
    stats = {"a/m": DeploymentStats(True, 3, 4, None, self_hosted=True),
             "b/m": DeploymentStats(True, 0, 2, None, self_hosted=True),
             "c/m": DeploymentStats(True, 0, 9, None, self_hosted=True)}
    ranked = rank(route, "t", 10, 10, stats, random.Random(0))
    assert ranked == [b, a, c]  # c is of another standing: it keeps its place
    stats["b/m"] = DeploymentStats(True, 2, 2, None, self_hosted=True)
    assert rank(route, "t", 10, 10, stats, random.Random(0)) == [a, b, c]


def test_hosted_candidates_keep_their_order_whatever_is_free() -> None:
    a, b = Deployment("a", "m"), Deployment("b", "m")
    stats = {"a/m": DeploymentStats(True, 3, 4, None), "b/m": DeploymentStats(True, 0, 9, None)}
    assert rank(ModelRoute("m", (a, b)), "t", 10, 10, stats, random.Random(0)) == [a, b]


# --- the simulator's self-hosted servers -------------------------------------------------------


def test_the_simulator_keeps_calls_out_of_a_read_servers_queue() -> None:
    """The engine-slots scenario: read, nothing waits inside the server; the same calls
    with max_concurrency guessed too high wait inside it, first come first served, and
    the critical tier's tail with them."""
    read = scenarios.scenario("engine-slots")
    sim = simulate(read.config, read.calls)
    assert all(o.inside_s == 0 for o in sim.outcomes)
    guessed = workloads.self_hosted({"p": {"max_concurrency": 16, "slots": 6}})
    blind = simulate(parse_config(guessed, {}), read.calls)
    assert sum(o.inside_s > 0 for o in blind.outcomes) > 20

    def p99(outcomes: list[Outcome]) -> float:
        waits = sorted(o.wait_s for o in outcomes if o.tier == "critical")
        return waits[int(0.99 * (len(waits) - 1))]

    assert p99(sim.outcomes) < p99(blind.outcomes) / 2


def test_the_simulator_splits_load_by_the_servers_room() -> None:
    unequal = scenarios.scenario("engine-unequal")
    sim = simulate(unequal.config, unequal.calls)
    served = {name: sum(o.provider == name for o in sim.outcomes) for name in ("p", "q")}
    # Learning a vLLM's capacity, the proxy probes above it now and then: a call of those
    # waits inside until the next read says so.
    assert sum(o.inside_s > 0 for o in sim.outcomes) <= 0.01 * len(sim.outcomes)
    assert 8 / 3 * 0.7 < served["p"] / served["q"] < 8 / 3 * 1.3, served


def test_a_server_that_slows_is_held_below_a_guess() -> None:
    slows = scenarios.scenario("engine-slows")
    learned = simulate(slows.config, slows.calls)
    guessed = workloads.self_hosted({"p": {"max_concurrency": 16, "slows_past": 4}})
    blind = simulate(parse_config(guessed, {}), slows.calls)
    # The same work in fewer slot-seconds: calls ran less slowed.
    assert learned.busy_s["p"] < 0.75 * blind.busy_s["p"]


async def test_the_live_simulated_server_queues_inside_and_says_so() -> None:
    upstream = SimulatedUpstream("p", SimSettings(ttft_s=0.0, tokens_per_s=1000.0, slots=2))
    request = UpstreamRequest(path="/chat/completions", body=orjson.dumps(
        {"model": "x", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}),
        model="x", stream=False, headers={})
    responses = [await upstream.send(request, Timeouts()) for _ in range(3)]
    reads = [asyncio.create_task(r.read()) for r in responses]
    await asyncio.sleep(0.01)
    assert upstream.figures("llama.cpp") == Figures(2, 1, 2, None)
    assert upstream.figures("vllm") == Figures(2, 1, None, 1.0)
    await asyncio.gather(*reads)
    assert upstream.figures("vllm") == Figures(0, 0, None, 0.0)


def test_the_self_hosted_pages_example_is_valid_config() -> None:
    """docs/self-hosted.md's example (fenced ``yml``: the merged ``yaml`` examples of the
    other pages keep their own providers)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "self-hosted.md").read_text()
    example = yaml.safe_load(page.split("```yml\n", 1)[1].split("```", 1)[0])
    config = parse_config(example, {})
    assert {name: (p.engine, p.auto) for name, p in config.providers.items()} == {
        "gpu-a": ("vllm", True), "gpu-b": ("llama.cpp", True)}
