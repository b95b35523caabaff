"""Replaying a workload through the pure scheduler on a virtual clock, and through FCFS.

A job arrives at ``at``, is served for ``service_s`` once it gets a slot (the scheduler
sees only its estimate), and its wait is recorded, or the code it was refused with.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from proxy.core.scheduling.scheduler import Scheduler, SchedulerSettings, Ticket, TierSpec

SHIPPED_TIERS = (
    TierSpec("critical", 8, 10), TierSpec("high", 4, 30),
    TierSpec("normal", 2, 120), TierSpec("low", 1, 900),
)


@dataclass
class Job:
    at: float
    tier: int
    service_s: float
    est_s: float | None = None  # what the scheduler is told (default: the truth)
    size_s: float | None = None
    candidates: tuple[str, ...] = ("p",)
    ceiling: int = 0
    wait: float = math.nan
    code: str | None = None
    start: float = math.nan
    pool: str | None = None


@dataclass
class Replay:
    jobs: list[Job]
    makespan: float
    peak: dict[str, int] = field(default_factory=dict)
    idle_with_work: float = 0.0  # slot-seconds left free while a job that could use it waited

    def waits(self, tier: int | None = None) -> list[float]:
        return [j.wait for j in self.jobs if tier is None or j.tier == tier]


def replay(settings: SchedulerSettings, pools: Mapping[str, int], jobs: Sequence[Job],
           deployments: Mapping[str, str] | None = None) -> Replay:
    """Run ``jobs`` (sorted by ``at``) through a fresh scheduler; every job ends served or
    refused. A refused job's wait is its time until refused."""
    s = Scheduler(settings, pools, deployments)
    events: list[tuple[float, int, int, object]] = []  # (time, kind, seq, payload)
    seq = 0
    for job in jobs:
        events.append((job.at, 1, seq, job))
        seq += 1
    heapq.heapify(events)
    tickets: dict[int, Job] = {}
    inflight = dict.fromkeys(pools, 0)
    peak = dict.fromkeys(pools, 0)
    now = 0.0
    timer: float | None = None
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == 0:
            ticket = payload
            assert isinstance(ticket, Ticket)
            job = tickets[id(ticket)]
            inflight[ticket.pool or ""] -= 1
            s.release(ticket, now, job.service_s)
        elif kind == 1:
            job = payload  # type: ignore[assignment]
            assert isinstance(job, Job)
            ticket = Ticket(job.tier, job.candidates,
                            job.service_s if job.est_s is None else job.est_s,
                            size_s=job.size_s, ceiling=job.ceiling, payload=job)
            tickets[id(ticket)] = job
            s.submit(ticket, now)
        else:
            if payload != timer:
                continue
            timer = None
            s.advance(now)
        decisions = s.take()
        for rejection in decisions.rejections:
            job = tickets[id(rejection.ticket)]
            job.code = rejection.code
            job.wait = now - job.at
        for dispatch in decisions.dispatches:
            job = tickets[id(dispatch.ticket)]
            job.wait = now - job.at
            job.start = now
            job.pool = dispatch.pool
            inflight[dispatch.pool] += 1
            peak[dispatch.pool] = max(peak[dispatch.pool], inflight[dispatch.pool])
            heapq.heappush(events, (now + job.service_s, 0, seq, dispatch.ticket))
            seq += 1
        wake = s.next_wakeup(now)
        if wake is not None and wake != timer:
            timer = max(wake, now)
            heapq.heappush(events, (timer, 2, seq, timer))
            seq += 1
    makespan = max((j.start + j.service_s for j in jobs if j.code is None), default=0.0)
    return Replay(list(jobs), makespan, peak)


def fcfs(jobs: Sequence[Job], slots: int) -> Replay:
    """One queue, first come first served, ``slots`` at once; nothing is refused."""
    free_at = [0.0] * slots
    done = 0.0
    out = []
    for job in jobs:
        start = max(job.at, heapq.heappop(free_at))
        heapq.heappush(free_at, start + job.service_s)
        out.append(Job(job.at, job.tier, job.service_s, wait=start - job.at, start=start))
        done = max(done, start + job.service_s)
    return Replay(out, done)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# --- the shipped trace ----------------------------------------------------------------


def service_s(prompt: int, output: int) -> float:
    """The benchmark's simulated upstream: 0.2 s, 10k prompt tokens/s, 40 tokens/s."""
    return 0.2 + prompt / 10_000 + output / 40


def random_tiers(n: int, seed: int = 1,
                 shares: Sequence[float] = (0.1, 0.2, 0.4, 0.3)) -> list[int]:
    rng = random.Random(seed)
    return [rng.choices(range(len(shares)), shares)[0] for _ in range(n)]


def trace_jobs(rows: Sequence[tuple[float, int, int]], tiers: Sequence[int],
               speedup: float = 1.0) -> list[Job]:
    return [Job(t / speedup, tier, service_s(p, o) / speedup)
            for (t, p, o), tier in zip(rows, tiers, strict=True)]
