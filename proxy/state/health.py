"""Open breakers and 429 cuts told to every replica through Redis, and told again when Redis
loses them (``SharedHealth.resend``): each replica remembers what it told, until it lapses."""

from __future__ import annotations

import time

from . import scripts
from .link import Link


class SharedHealth:
    def __init__(self, link: Link) -> None:
        self._link = link
        self._cut = link.client.register_script(scripts.CUT)
        self.remote_open: dict[str, float] = {}  # deployment → until, as heard from Redis
        self._opened: dict[str, float] = {}  # deployment → until, as told by this replica
        self._cuts: dict[str, tuple[int, float]] = {}  # provider → (limit, until), told here

    def breaker_opened(self, deployment: str, open_for_s: float) -> None:
        """Tell every replica (unless the news came from them)."""
        until = time.monotonic() + open_for_s
        if self._link.mode != "shared" or self.remote_open.get(deployment, 0.0) >= until - 0.5:
            return
        self._opened[deployment] = until
        self._send_breaker(deployment, open_for_s)

    def limit_cut(self, provider: str, limit: int, for_s: float) -> None:
        if self._link.mode == "shared":
            self._cuts[provider] = (limit, time.monotonic() + for_s)
            self._send_cut(provider, limit, for_s)

    def resend(self) -> tuple[int, int]:
        """Redis lost them: what is left of each breaker and cut this replica told, told
        again. Answers (breakers, cuts)."""
        now = time.monotonic()
        self._opened = {d: until for d, until in self._opened.items() if until > now}
        for deployment, until in self._opened.items():
            self._send_breaker(deployment, until - now)
        self._cuts = {p: cut for p, cut in self._cuts.items() if cut[1] > now}
        for provider, (limit, until) in self._cuts.items():
            self._send_cut(provider, limit, until - now)
        return len(self._opened), len(self._cuts)

    def _send_breaker(self, deployment: str, open_for_s: float) -> None:
        ms = max(int(open_for_s * 1000), 1)
        self._link.spawn(self._link.call(
            self._link.client.set(self._link.prefix + "breaker:" + deployment, 1, px=ms)))

    def _send_cut(self, provider: str, limit: int, for_s: float) -> None:
        self._link.spawn(self._link.call(self._cut(
            args=[self._link.prefix, provider, limit, max(int(for_s * 1000), 1)])))
