"""The Service's timers: time-of-day schedules and provider pauses."""

from __future__ import annotations

import asyncio
from datetime import datetime
from zoneinfo import ZoneInfo

from proxy.core.call.tokens import TokenCounter
from proxy.core.clock import FakeClock
from proxy.core.health.provider import SimSettings
from proxy.http.call.service import Service
from proxy.http.upstream.simulated import SimulatedUpstream

from .conftest import config_from

BERLIN = ZoneInfo("Europe/Berlin")


def service_at(local: datetime, counter: TokenCounter) -> tuple[Service, FakeClock]:
    config = config_from(
        [{"name": "sim", "kind": "simulated", "max_concurrency": 2}],
        {"m": [{"provider": "sim", "model": "s"}]},
        schedules={"timezone": "Europe/Berlin", "windows": [
            {"name": "evening", "hours": "18-23", "weights": {"low": 0.5},
             "reserves": {"high": 1}},
            {"name": "night", "hours": "23-7", "weights": {"low": 8}},
        ]},
    )
    clock = FakeClock(wall_start=local.timestamp())
    upstreams = {"sim": SimulatedUpstream("sim", SimSettings())}
    return Service(config, upstreams, clock, counter), clock


def weights(service: Service) -> list[object]:
    snapshot = service.scheduler.snapshot(service.clock.now())
    tiers = snapshot["tiers"]
    assert isinstance(tiers, list)
    return [t["weight"] for t in tiers]


async def test_schedule_in_force_is_applied_and_cleared(counter: TokenCounter) -> None:
    service, _ = service_at(datetime(2026, 11, 30, 19, 30, tzinfo=BERLIN), counter)
    service.apply_schedule()
    assert service.schedule is not None and service.schedule.name == "evening"
    assert weights(service) == [8.0, 4.0, 2.0, 0.5]
    assert service.status()["schedule"] == "evening"
    await service.close()

    service, _ = service_at(datetime(2026, 11, 30, 12, 0, tzinfo=BERLIN), counter)
    service.apply_schedule()
    assert service.schedule is None
    assert weights(service) == [8.0, 4.0, 2.0, 1.0]
    await service.close()


async def test_one_timer_moves_to_the_next_window(counter: TokenCounter) -> None:
    service, clock = service_at(datetime(2026, 11, 30, 22, 59, 59, 950000, tzinfo=BERLIN),
                                counter)
    service.apply_schedule()
    assert service.schedule is not None and service.schedule.name == "evening"
    clock.advance(0.06)  # the wall clock passes 23:00; the one timer fires within 1 s
    await asyncio.sleep(1.05)
    assert service.schedule is not None and service.schedule.name == "night"
    assert weights(service) == [8.0, 4.0, 2.0, 8.0]
    await service.close()
