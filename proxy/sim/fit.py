"""The latency model of each provider, fitted from the proxy's JSON access log: the median
time to first token (streams) and the median output rate after it, as the ``simulate:``
block the simulator replays with."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path

from ..config import ConfigError


def fit(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    """provider -> {"calls", "ttft_s", "tokens_per_s"} from answered calls (status 200,
    not cache hits) with an upstream; providers with too little to go on are left out."""
    ttfts: dict[str, list[float]] = {}
    whole: dict[str, list[tuple[float, int, float | None]]] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or row.get("status") != 200 or not row.get("upstream"):
            continue
        upstream_ms, tokens = row.get("upstream_ms"), row.get("completion_tokens")
        if not isinstance(upstream_ms, int | float) or not isinstance(tokens, int):
            continue
        provider = str(row["upstream"]).split("/")[0]
        ttft = row.get("ttft_ms")
        ttft_s = ttft / 1000 if isinstance(ttft, int | float) else None
        if ttft_s is not None:
            ttfts.setdefault(provider, []).append(ttft_s)
        whole.setdefault(provider, []).append((upstream_ms / 1000, tokens, ttft_s))
    fitted = {}
    for provider, calls in whole.items():
        first = statistics.median(ttfts[provider]) if provider in ttfts else None
        rates = []
        for took, tokens, ttft in calls:
            generating = took - (ttft if ttft is not None else first or 0.0)
            if tokens > 0 and generating > 0:
                rates.append(tokens / generating)
        if first is None or not rates:
            continue
        fitted[provider] = {"calls": len(calls), "ttft_s": round(first, 3),
                            "tokens_per_s": round(statistics.median(rates), 1)}
    return fitted


def fit_command(log: str) -> int:
    try:
        with Path(log).open(encoding="utf-8") as f:
            fitted = fit(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{log}: cannot read ({type(exc).__name__})") from None
    if not fitted:
        print(f"{log}: no answered streams to fit a latency model from")
        return 1
    print(f"# fitted from {log}: paste into each provider of routing.yaml")
    for provider, model in fitted.items():
        print(f"# {provider}: {int(model['calls'])} calls")
        print(f"- name: {provider}\n  simulate: {{ttft_s: {model['ttft_s']}, "
              f"tokens_per_s: {model['tokens_per_s']}}}")
    return 0
