"""Micro-benchmark: microseconds per scheduling decision with 10,000 calls queued.

One cycle = one arrival (``submit``, queued behind the backlog) plus one completion
(``release``, which hands the slot to the best waiting call). Time moves 1 ms per cycle, so
aging, promotions, floors, the headroom estimate and the keys' shares are all exercised;
each call comes from one of ``--keys`` keys (weights 1 to 4). Goal: <= 50 us per cycle
with 10,000 queued and 1,000 keys.

    .venv/bin/python scripts/bench_decision.py [--queued 10000] [--cycles 50000] [--keys 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from proxy.core.scheduling.scheduler import Scheduler, SchedulerSettings, Ticket, TierSpec

PROVIDERS = {"openai": 16, "azure": 8, "sim": 4}
CANDIDATE_SETS = [("openai",), ("azure",), ("openai", "azure"), ("azure", "openai", "sim"),
                  ("sim",)]
TIERS = (TierSpec("critical", 8, max_wait_s=1e9), TierSpec("high", 4, max_wait_s=1e9),
         TierSpec("normal", 2, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))


def random_ticket(rng: random.Random, keys: int) -> Ticket:
    key = rng.randrange(keys)
    return Ticket(tier=rng.choice((0, 1, 1, 2, 2, 2, 3, 3, 3, 3)),
                  candidates=rng.choice(CANDIDATE_SETS),
                  est_service_s=rng.choice((0.3, 0.8, 2.0, 6.0, 20.0, 45.0)),
                  key=f"key{key}", key_weight=1.0 + key % 4)


def run(queued: int, cycles: int, seed: int, keys: int = 1000) -> list[float]:
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerSettings(tiers=TIERS, max_queue=queued + 1_000), PROVIDERS)
    now = 0.0
    running: list[Ticket] = []
    while sum(scheduler.depth(tier) for tier in range(len(TIERS))) < queued:
        scheduler.submit(random_ticket(rng, keys), now)
        running += [d.ticket for d in scheduler.take().dispatches]
    samples: list[float] = []
    batch = 1_000
    for _ in range(cycles // batch):
        fresh = [random_ticket(rng, keys) for _ in range(batch)]
        picks = [rng.randrange(1 << 30) for _ in range(batch)]
        started = time.perf_counter()
        for new, pick in zip(fresh, picks, strict=True):
            now += 0.001
            scheduler.submit(new, now)
            running += [d.ticket for d in scheduler.take().dispatches]
            pick %= len(running)
            done = running[pick]
            running[pick] = running[-1]
            running.pop()
            scheduler.release(done, now, done.est_service_s)
            running += [d.ticket for d in scheduler.take().dispatches]
        samples.append((time.perf_counter() - started) / batch * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    samples = run(args.queued, args.cycles, args.seed, args.keys)
    print(f"queued={args.queued} keys={args.keys} cycles={len(samples) * 1000} "
          "(submit + release/dispatch)")
    print(f"us per cycle: median {statistics.median(samples):.1f}  "
          f"worst batch {max(samples):.1f}  goal <= 50")


if __name__ == "__main__":
    main()
