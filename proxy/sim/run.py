"""Replaying a trace through the proxy's own pure core on a virtual clock.

Each call goes the way a live one does: the real classifier (its ``tier`` as an
``X-Priority`` header, clamped to its key's ``max_tier``), estimator, router, attempt policy,
scheduler, breakers and rpm/tpm limits, all driven by ``now`` from an event heap instead of
a loop. A call sent upstream is served by its simulated provider (``servers``), producing
the trace's ``output_tokens`` (at most its ``max_tokens`` and the deployment's
``max_output_tokens``); its faults exercise the 429 handling, retries and breakers as live,
and a wait inside a self-hosted server counts in the call's wait. A provider with an
``engine`` is read as live reads it: every
``read_every_s`` from the first arrival and ``NUDGE_S`` after each answer (``Fleet.
engine_read``, the figures the live simulated provider gives).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from ..config import Config
from ..config.trace import TraceCall
from ..core.call import budgets
from ..core.call.attempts import LEASED, Attempts
from ..core.call.budgets import Budgets
from ..core.call.classify import ANONYMOUS, RequestFacts
from ..core.call.commands import (
    Command,
    Done,
    Fail,
    Hold,
    LeaseSlot,
    PassThrough,
    Queue,
    Reserve,
    Result,
    Send,
    Wait,
)
from ..core.call.route import Deployment
from ..core.engine import Engine
from ..core.errors import ModelNotFound
from ..core.formats.request import Call
from ..core.health.fleet import Verdict
from ..core.scheduling.scheduler import Ticket, TicketState
from .results import Outcome, Series, Simulation, Waiting, makespan
from .servers import Servers, service_s

REFUSAL_S = 0.05  # how soon a provider answers 429 or 500
NUDGE_S = 0.25  # an engine is read again this soon after an answer (live: NUDGE_GAP_S)
# The wall time the virtual clock starts at (2026-01-01 UTC), for the keys' budget periods.
WALL_EPOCH = 1_767_225_600.0


class _Replay:
    def __init__(self, config: Config, speed: float) -> None:
        self.config = config
        self.speed = speed
        self.engine = Engine(
            scheduler=config.scheduler, classify=config.classify, providers=config.providers,
            models=config.models, principals=[k.principal for k in config.keys],
            retry=config.retry, estimate=config.estimate)
        self.principals = {k.name: k.principal for k in config.keys}
        # The keys' spend budgets, as one process keeps them, on the virtual clock's wall
        # time; calls a budget holds, per key, waiting for one of its calls to settle.
        self.budgets = Budgets({k.name: k.principal.budget for k in config.keys
                                if k.principal.budget is not None}, config.timezone)
        self._held: dict[str, list[Callable[[float], None]]] = {}
        self.first_model = next(iter(config.models))
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        # One wake-up timer, as the live shell keeps (``Admission._rearm``): the time the
        # scheduler asked for and the order of its event; an event of a timer re-armed
        # since is skipped, as live cancels it (a pass it ran would book the headroom's
        # idle time, and so size holds, at an instant live has none).
        self._timer_at: float | None = None
        self._timer = -1
        self.busy_s = dict.fromkeys(config.providers, 0.0)
        self.waiting = Waiting(len(config.tiers))
        self._providers = {d.id: d.provider for route in config.models.values()
                           for d in route.candidates}
        self._queued: dict[Ticket, tuple[tuple[str, ...], int]] = {}
        self.series = Series(depth={t: [] for t in config.tier_names},
                             inflight={p: [] for p in config.providers})
        self._next_sample = math.nan
        self.servers = Servers(config)
        self._unfinished = 0  # calls not yet ended: engines are read while there are some
        self._read_due: dict[str, float] = {}  # engine providers: their next read

    def at(self, when: float, action: Callable[[float], None]) -> int:
        order = next(self._order)
        heapq.heappush(self._events, (when, order, action))
        return order

    def run(self, calls: Sequence[TraceCall]) -> list[Outcome]:
        outcomes = []
        for row in calls:
            outcome = Outcome(row.t / self.speed)
            outcomes.append(outcome)
            self.at(outcome.arrived, self._arrival(row, outcome))
        self._unfinished = len(outcomes)
        if outcomes:
            start = min(o.arrived for o in outcomes)
            for name, provider in self.config.providers.items():
                if provider.engine is not None:
                    self._read_at(name, start)
        while self._events:
            now, order, action = heapq.heappop(self._events)
            if action == self._wake and order != self._timer:
                continue  # disarmed
            self._sample(now)
            action(now)
            self._act_on_decisions(now)
        return outcomes

    def _read_at(self, provider: str, when: float) -> None:
        """Read ``provider``'s server at ``when`` (sooner than its next read only)."""
        if when >= self._read_due.get(provider, math.inf):
            return
        self._read_due[provider] = when
        self.at(when, lambda now: self._read(provider, now))

    def _read(self, provider: str, now: float) -> None:
        if self._read_due.get(provider) != now:
            return  # a sooner read replaced this one
        self.engine.fleet.engine_read(provider, self.servers.figures(provider), now)
        del self._read_due[provider]
        if self._unfinished:
            self._read_at(provider, now + self.config.providers[provider].read_every_s)

    def _wake(self, now: float) -> None:
        self._timer_at, self._timer = None, -1
        self.engine.scheduler.advance(now)

    def _sample(self, now: float) -> None:
        """Record the state that held until ``now`` at every whole step before it."""
        series, scheduler = self.series, self.engine.scheduler
        if math.isnan(self._next_sample):
            self._next_sample = math.floor(now)
        if self._next_sample >= now:
            return
        depth = {t: scheduler.depth(i) for i, t in enumerate(self.config.tier_names)}
        inflight = {p: scheduler.inflight(p) for p in series.inflight}
        while self._next_sample < now:
            series.add(self._next_sample, depth, inflight)
            self._next_sample = series.times[-1] + series.step_s

    def _arrival(self, row: TraceCall, outcome: Outcome) -> Callable[[float], None]:
        def arrive(now: float) -> None:
            model = row.model or self.first_model
            max_tokens = row.max_tokens
            call = Call({"model": model}, "chat", model, row.stream, max_tokens, None, False,
                        prompt_tokens=row.prompt_tokens)
            headers = {"x-priority": row.tier} if row.tier else {}
            facts = RequestFacts(headers, model, row.prompt_tokens, "", row.stream, None)
            principal = self.principals.get(row.key or "", ANONYMOUS)
            try:
                plan = self.engine.plan(call, facts, principal, now)
            except ModelNotFound as exc:  # refused, as live
                outcome.code, outcome.wait_s, outcome.done_at = exc.code, 0.0, now
                self._unfinished -= 1
                return
            outcome.tier, outcome.key = plan.tier_name, principal.name
            refusal = budgets.arrival(self.budgets, plan, WALL_EPOCH + now)
            if refusal is not None:
                outcome.code, outcome.wait_s, outcome.done_at = "budget_exceeded", 0.0, now
                self._unfinished -= 1
                return
            attempts = Attempts(self.engine, plan)
            self._do(attempts, attempts.start(now), row, outcome, now)

        return arrive

    def _do(self, attempts: Attempts, command: Command, row: TraceCall, outcome: Outcome,
            now: float) -> None:
        match command:
            case Queue(ticket=ticket):
                ticket.payload = (attempts, row, outcome)
                self.engine.scheduler.submit(ticket, now)
                if ticket.state is TicketState.QUEUED:
                    pools = tuple({self._providers[d] for d in ticket.candidates})
                    self._queued[ticket] = (pools, ticket.current_tier)
                    self.waiting.add(pools, ticket.current_tier)
            case Send(deployment=deployment):
                self._send(attempts, deployment, row, outcome, now)
            case Reserve(deployment=deployment, estimate=estimate, maximum=maximum):
                got = self.budgets.admit(attempts.plan.caller, estimate, maximum,
                                         WALL_EPOCH + now)
                after = attempts.reserved(deployment, got, now)
                if not isinstance(after, Send | LeaseSlot):
                    self._settle(attempts, None, 0.0, now)  # not sent after all
                self._do(attempts, after, row, outcome, now)
            case LeaseSlot(deployment=deployment):  # this process is the whole fleet
                after = attempts.leased(deployment, LEASED, now)
                if not isinstance(after, Send):
                    self._settle(attempts, None, 0.0, now)  # not sent after all
                self._do(attempts, after, row, outcome, now)
            case Hold(key=key, until=until):
                woken = False

                def over(t: float) -> None:
                    nonlocal woken
                    if not woken:
                        woken = True
                        self._do(attempts, attempts.held_over(t), row, outcome, t)

                self._held.setdefault(key, []).append(over)
                self.at(until, over)
            case Wait(until=until):
                self.at(until, lambda t: self._do(attempts, attempts.resume(t), row, outcome, t))
            case Fail(error=error):
                outcome.code = error.code
                self._finish(attempts, outcome, now)
            case PassThrough():
                outcome.code = "upstream_error"
                self._finish(attempts, outcome, now)
            case Done():
                self._finish(attempts, outcome, now)

    def _send(self, attempts: Attempts, deployment: Deployment, row: TraceCall,
              outcome: Outcome, now: float) -> None:
        timing = self.config.providers[deployment.provider].timing
        if timing is not None:  # the simulated provider's faults, as the live one has them
            refusal = self.servers.refusal(timing, deployment.provider)
            if refusal is not None:
                def refused(t: float) -> None:
                    after = attempts.finished(refusal, t)
                    self._settle(attempts, deployment if attempts.used is not None else None,
                                 None, t)
                    self._do(attempts, after, row, outcome, t)

                self.at(now + REFUSAL_S, refused)
                return
        output = row.output_tokens
        if row.max_tokens is not None:
            output = min(output, row.max_tokens)
        output = min(output, deployment.max_output_tokens)
        provider = deployment.provider
        ttft, took = service_s(self.config, deployment, row.prompt_tokens, output)
        outcome.provider = provider
        outcome.cost_usd = deployment.cost(row.prompt_tokens, output, attempts.service_tier)
        self.servers.serving[provider] += 1
        sent = now

        def start(t: float) -> None:
            outcome.inside_s += t - sent
            self.servers.running[provider] += 1
            slower = self.servers.slower(provider)
            outcome.service_s = took * slower
            self.busy_s[provider] = self.busy_s.get(provider, 0.0) + took * slower
            # Live knows a call's time to first token only when it streams, and its latency
            # model learns that apart from the output rate only then: learn as live does.
            result = Result(Verdict.SUCCESS, status=200, prompt_tokens=row.prompt_tokens,
                            completion_tokens=output,
                            ttft_s=(ttft * slower + t - sent) if row.stream else None)

            def done(end: float) -> None:
                self.servers.ended(provider, end)
                if provider in self.engine.fleet.engines:
                    self._read_at(provider, end + NUDGE_S)
                after = attempts.finished(result, end)
                self._settle(attempts, deployment, outcome.cost_usd, end)
                self._do(attempts, after, row, outcome, end)

            self.at(t + took * slower, done)

        if self.servers.full(provider):
            self.servers.inside[provider].append(start)
        else:
            start(now)

    def _settle(self, attempts: Attempts, deployment: Deployment | None, cost: float | None,
                now: float) -> None:
        """An attempt's cost against its key's budget, as live settles it; the key's held
        calls go again when a reservation settles."""
        reservation, attempts.reservation = attempts.reservation, None
        key = attempts.plan.caller
        if budgets.settle(self.budgets, attempts.plan, attempts.service_tier, reservation,
                          deployment, cost, WALL_EPOCH + now):
            for over in self._held.pop(key, ()):
                self.at(now, over)

    def _finish(self, attempts: Attempts, outcome: Outcome, now: float) -> None:
        outcome.wait_s = attempts.queue_s + outcome.inside_s
        outcome.done_at = now
        self._unfinished -= 1
        if attempts.ticket is not None:  # a reload never happens here: the name is current
            outcome.tier = self.engine.tier_names[attempts.ticket.tier]

    def _left(self, ticket: Ticket) -> None:
        """The ticket is no longer waiting (as it was counted when it queued)."""
        found = self._queued.pop(ticket, None)
        if found is not None:
            self.waiting.add(found[0], found[1], -1)

    @staticmethod
    def _payload(ticket: Ticket) -> tuple[Attempts, TraceCall, Outcome]:
        payload: tuple[Attempts, TraceCall, Outcome] = ticket.payload  # type: ignore[assignment]
        return payload

    def _act_on_decisions(self, now: float) -> None:
        """Act on the scheduler's decisions, then arm its next wake-up."""
        scheduler = self.engine.scheduler
        while decisions := scheduler.take():
            for rejection in decisions.rejections:
                self._left(rejection.ticket)
                attempts, row, outcome = self._payload(rejection.ticket)
                outcome.early = rejection.message is not None
                self._do(attempts, attempts.refused(rejection.code, rejection.retry_after_s,
                                                    now, rejection.message), row, outcome, now)
            for dispatch in decisions.dispatches:
                self._left(dispatch.ticket)
                self.waiting.started(dispatch.pool, dispatch.ticket.current_tier)
                attempts, row, outcome = self._payload(dispatch.ticket)
                self._do(attempts, attempts.granted(dispatch.deployment, now), row, outcome,
                         now)
        wakeup = scheduler.next_wakeup(now)
        if wakeup != self._timer_at:
            self._timer_at = wakeup
            self._timer = -1 if wakeup is None else self.at(
                wakeup if wakeup > now else now + 1e-6, self._wake)  # time always moves on


def simulate(config: Config, calls: Sequence[TraceCall], speed: float = 1.0) -> Simulation:
    """Every call of ``calls`` replayed through ``config`` (arrivals ``speed`` times as
    fast); each ends served or refused with a code."""
    if not speed > 0:
        raise ValueError("speed must be positive")
    replay = _Replay(config, speed)
    outcomes = replay.run(calls)
    return Simulation(outcomes, makespan(outcomes), replay.busy_s, replay.waiting.inversions,
                      replay.series)
