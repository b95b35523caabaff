"""deploy/compose: the three-replica example holds together (this machine runs no
containers, so the files are checked against each other and against the proxy)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from proxy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "compose"


def services() -> dict[str, dict[str, object]]:
    data = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    found: dict[str, dict[str, object]] = data["services"]
    return found


def test_three_replicas_share_one_redis_behind_the_load_balancer() -> None:
    found = services()
    replicas = sorted(name for name in found if name.startswith("proxy-"))
    assert replicas == ["proxy-1", "proxy-2", "proxy-3"]
    config = load_config(COMPOSE / "replicas.yaml", env={"TRIAGE_ADMIN_KEY": "k"})
    assert config.state.backend == "redis"
    assert config.state.url.startswith("redis://redis:")  # the compose service's name
    assert "redis" in found
    mounted = found["proxy-1"]["volumes"]
    assert mounted == ["./replicas.yaml:/etc/triage-proxy/routing.yaml:ro"]
    assert "/etc/triage-proxy/routing.yaml" in (ROOT / "Dockerfile").read_text()
    assert config.admin_sha256 is not None  # admin reachable through the balancer, keyed


def test_the_balancer_sends_to_every_replica_and_never_buffers_or_retries_a_post() -> None:
    conf = (COMPOSE / "nginx.conf").read_text()
    servers = re.findall(r"^\s*server\s+([\w-]+):8080", conf, re.M)
    assert sorted(servers) == sorted(n for n in services() if n.startswith("proxy-"))
    assert "proxy_buffering off;" in conf
    assert "non_idempotent" not in conf.replace("never non_idempotent", "")
    assert services()["lb"]["ports"] == ["8080:8080"]
