from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import proxy
from proxy.config import ConfigError, load_config, parse_config
from proxy.core.health.provider import Provider

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = {
    "providers": [{"name": "sim", "kind": "simulated", "max_concurrency": 2}],
    "models": {"m": [{"provider": "sim", "model": "small"}]},
}


def with_(**changes: object) -> dict[str, object]:
    return {**MINIMAL, **changes}


def test_shipped_routing_yaml_is_valid() -> None:
    config = load_config(ROOT / "routing.yaml", env={})
    assert config.tier_names == ("critical", "high", "normal", "low")
    assert set(config.models) == {"gpt-4o-mini", "chat"}
    assert all(p.kind == "simulated" for p in config.providers.values())


def test_defaults_for_a_minimal_file() -> None:
    config = parse_config(MINIMAL, {})
    assert config.listen.host == "127.0.0.1" and config.listen.port == 8080
    assert config.tier_names == ("critical", "high", "normal", "low")
    assert config.classify.default_tier == 2
    assert config.models["m"].candidates[0].id == "sim/small"
    assert config.keys == ()


def test_env_interpolation_and_defaults() -> None:
    data = with_(
        listen={"host": "${HOST:-0.0.0.0}", "port": "${PORT}"},
        providers=[{"name": "up", "base_url": "http://127.0.0.1:9/v1", "api_key": "${K}"}],
        models={"m": [{"provider": "up", "model": "x"}]},
    )
    config = parse_config(data, {"PORT": "9001", "K": "sk-secret"})
    assert config.listen.host == "0.0.0.0" and config.listen.port == 9001
    assert config.providers["up"].api_key == "sk-secret"
    assert "sk-secret" not in repr(config.providers["up"])


def test_unset_provider_key_disables_provider_with_one_warning() -> None:
    data = with_(
        providers=[
            {"name": "openai", "base_url": "https://api.openai.com/v1",
             "api_key": "${OPENAI_API_KEY}"},
            {"name": "sim", "kind": "simulated"},
        ],
        models={"m": [{"provider": "openai", "model": "gpt"}, {"provider": "sim", "model": "s"}]},
    )
    config = parse_config(data, {})
    assert list(config.providers) == ["sim"]
    assert [d.id for d in config.models["m"].candidates] == ["sim/s"]
    assert len(config.warnings) == 1 and "OPENAI_API_KEY" not in config.warnings[0]
    assert "providers[0].api_key" in config.warnings[0]


def test_an_empty_key_variable_disables_the_provider() -> None:
    data = with_(
        providers=[{"name": "openai", "base_url": "https://api.openai.com/v1",
                    "api_key": "${OPENAI_API_KEY}"}, {"name": "sim", "kind": "simulated"}],
        models={"m": [{"provider": "openai", "model": "g"}, {"provider": "sim", "model": "s"}]},
    )
    config = parse_config(data, {"OPENAI_API_KEY": ""})
    assert list(config.providers) == ["sim"] and len(config.warnings) == 1


def test_provider_headers_expand_variables() -> None:
    data = with_(providers=[{"name": "a", "base_url": "http://127.0.0.1:1/v1",
                             "headers": {"X-Team": "${TEAM:-search}", "X-Id": "${ID}"}}],
                 models={"m": [{"provider": "a", "model": "x"}]})
    config = parse_config(data, {"ID": "42"})
    assert config.providers["a"].headers == {"X-Team": "search", "X-Id": "42"}


@pytest.mark.parametrize("provider, where", [
    ({"headers": {"X-Team": "a\r\nX-Evil: 1"}}, "headers.X-Team"),
    ({"headers": {"X-Id": "${ID}"}}, "headers.X-Id"),
    ({"headers": {"Bad Name": "x"}}, "headers.Bad Name"),
    ({"api_key": "${KEY}"}, "api_key"),
])
def test_what_cannot_be_sent_as_a_header_is_a_config_error(provider: dict[str, object],
                                                           where: str) -> None:
    data = with_(providers=[{"name": "a", "base_url": "http://127.0.0.1:1/v1", **provider}],
                 models={"m": [{"provider": "a", "model": "x"}]})
    with pytest.raises(ConfigError, match=f"{re.escape(where)}: .*(line break|header name)"):
        parse_config(data, {"ID": "4\n2", "KEY": "k\r\n"})


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"listen: {host: \xff}\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad, env={})


def test_keys_are_stored_as_digests() -> None:
    digest = hashlib.sha256(b"batch-key").hexdigest()
    data = with_(classify={"keys": [
        {"name": "app", "key": "${APP_KEY}", "tier": "high", "max_tier": "high"},
        {"name": "batch", "key_sha256": digest, "tier": "low", "max_tier": "normal"},
    ]})
    config = parse_config(data, {"APP_KEY": "app-key"})
    assert [k.name for k in config.keys] == ["app", "batch"]
    assert config.keys[0].sha256 == hashlib.sha256(b"app-key").hexdigest()
    assert config.keys[1].principal.max_tier == 2 and config.keys[1].principal.tier == 3


def documentation() -> str:
    """The README and every page under docs/, as one text."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


@pytest.mark.e2e  # bash in a subprocess
def test_the_readme_recipe_for_a_key_digest_gives_what_the_proxy_looks_up() -> None:
    readme = documentation()
    recipe = next(line.split("#")[0] for line in readme.splitlines()
                  if line.startswith('printf %s "$KEY"'))
    key = "tp-a key with spaces"
    digest = subprocess.run(["bash", "-c", recipe], env={"KEY": key, "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, check=True).stdout.strip()
    config = parse_config(with_(classify={"keys": [{"name": "k", "key_sha256": digest}]}), {})
    assert config.keys[0].sha256 == hashlib.sha256(key.encode()).hexdigest()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_(providers=[{"name": "sim", "kind": "simulated", "max_concurrency": 0}]),
         "providers[0].max_concurrency: must be a positive integer or auto"),
        (with_(providers=[{"name": "sim", "kind": "simulated", "max_concurrency": "x"}]),
         "providers[0].max_concurrency: must be a positive integer or auto"),
        (with_(providers=[{"name": "sim", "kind": "warp"}]),
         "providers[0].kind: must be one of openai, azure, anthropic, simulated"),
        (with_(providers=[{"name": "a", "base_url": "ftp://x"}]),
         "providers[0].base_url: must be an http:// or https:// URL"),
        (with_(providers=[{"name": "a", "base_url": "http://127.0.0.1:80800/v1"}]),
         "providers[0].base_url: has a port that is not a number from 1 to 65535"),
        (with_(providers=[{"name": "a", "base_url": "http://127.0.0.1:0/v1"}]),
         "providers[0].base_url: has a port that is not a number from 1 to 65535"),
        (with_(providers=[{"name": "a", "kind": "simulated"}, {"name": "a", "kind": "simulated"}]),
         "providers[1].name: duplicate provider 'a'"),
        (with_(models={"m": [{"provider": "nope", "model": "x"}]}),
         "models.m[0].provider: unknown provider 'nope'"),
        (with_(models={"m": {"strategy": "fastest", "candidates": [
            {"provider": "sim", "model": "x"}]}}),
         "models.m.strategy: must be one of"),
        (with_(models={}), "models: must name at least one model"),
        (with_(tiers=[{"name": "a"}, {"name": "A"}]), "tiers[1].name: duplicate tier 'A'"),
        (with_(classify={"default_tier": "urgent"}),
         "classify.default_tier: unknown tier 'urgent'"),
        (with_(classify={"rules": [{"tier": "high", "match": {"last_user_regex": "("}}]}),
         "classify.rules[0].match.last_user_regex: invalid regular expression"),
        (with_(classify={"keys": [{"name": "k"}]}),
         "classify.keys[0]: needs exactly one of 'key' or 'key_sha256'"),
        (with_(classify={"keys": [{"name": "k", "key_sha256": "abc"}]}),
         "classify.keys[0].key_sha256: must be 64 hex digits"),
        (with_(listen={"port": "${PORT}"}), "listen.port: environment variable PORT is not set"),
        (with_(colour="blue"), "colour: unknown key"),
        (with_(providers=[{"name": "sim", "kind": "simulated", "max_concurency": 2}]),
         "providers[0].max_concurency: unknown key"),
        (with_(schedules={"timezone": "Mars/Olympus"}),
         "schedules.timezone: unknown time zone"),
        (with_(schedules={"windows": [{"hours": "25-3"}]}),
         "schedules.windows[0].hours: must be START-END hours"),
        (with_(retry={"budget": 2}), "retry.budget: must be <= 1.0"),
        (with_(tiers=[{"name": "a", "weight": float("inf")}]),
         "tiers[0].weight: must be a finite number"),
        (with_(providers=[{"name": "sim", "kind": "simulated",
                           "timeouts": {"idle_s": float("nan")}}]),
         "providers[0].timeouts.idle_s: must be a finite number"),
        (with_(classify={"rules": [{"tier": "high", "match": {"header": {"X-A": []}}}]}),
         "invalid value: rule header 'x-a' needs at least one value"),
        (with_(providers=[{"name": "a", "base_url": "http://127.0.0.1:1/v1",
                           "headers": {"X-Team": "${TEAM}"}}],
               models={"m": [{"provider": "a", "model": "x"}]}),
         "providers[0].headers.X-Team: uses an environment variable that is not set"),
        ([1, 2], "<root>: must be a mapping"),
        (with_(state={"backend": "etcd"}), "state.backend: must be one of memory, redis"),
        (with_(state={"backend": "redis", "url": "http://x"}),
         "state.url: must be a redis://, rediss:// or unix:// URL"),
        (with_(state={"prefix": "a b"}), "state.prefix: must be 1-64 letters"),
        (with_(state={"lease_ttl_s": 0.1}), "state.lease_ttl_s: must be >= 1.0"),
        (with_(state={"on_error": "ignore"}), "state.on_error: must be one of local, reject"),
        (with_(scheduler={"lend_s": 100}), "scheduler.lend_s: is no longer a setting: a tier's "
         "floor (tiers[].weight) is never lent"),
        (with_(scheduler={"quantum_s": 5}), "scheduler.quantum_s: is no longer a setting: a "
         "tier's weight is now its floor"),
        (with_(scheduler={"headroom_scale": 0.5}), "scheduler.headroom_scale: is no longer a "
         "setting: the adaptive headroom is sized by scheduler.headroom_spread"),
        (with_(tiers=[{"name": "a", "weight": -1}]), "tiers[0].weight: must be >= 0"),
        (with_(classify={"keys": [{"name": "k", "key": "s", "weight": 0}]}),
         "classify.keys[0].weight: must be a positive number"),
        (with_(scheduler={"headroom_budget": 2}), "scheduler.headroom_budget: must be <= 1.0"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "anthropic_version": "1"}]),
         "providers[0].anthropic_version: only applies to kind anthropic"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "engine": "tgi"}]),
         "providers[0].engine: must be one of vllm, sglang, llama.cpp"),
        (with_(providers=[{"name": "p", "kind": "anthropic", "engine": "vllm"}]),
         "providers[0].engine: only applies to kinds openai and simulated"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "engine": "llama.cpp",
                           "priority": True}]),
         "providers[0].priority: only applies to engine vllm or sglang"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "read_every_s": 1}]),
         "providers[0].read_every_s: only applies with an engine"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "engine": "vllm",
                           "read_every_s": 0.01}]),
         "providers[0].read_every_s: must be >= 0.1"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "max_concurrency": True}]),
         "providers[0].max_concurrency: must be a positive integer or auto"),
        (with_(providers=[{"name": "p", "base_url": "http://x"}],
               models={"m": [{"provider": "p", "model": "x", "priority": {"low": 1}}]}),
         "models.m[0].priority: provider 'p' is not sent priority"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "engine": "vllm",
                           "priority": False}],
               models={"m": [{"provider": "p", "model": "x", "priority": {"low": 1}}]}),
         "models.m[0].priority: provider 'p' is not sent priority"),
        (with_(providers=[{"name": "p", "base_url": "http://x", "engine": "vllm"}],
               models={"m": [{"provider": "p", "model": "x", "priority": {"low": "1"}}]}),
         "models.m[0].priority.low: must be a whole number"),
    ],
)
def test_invalid_configs_name_the_yaml_path(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, {})
    assert str(info.value).startswith(message), str(info.value)


def test_an_engine_learns_its_limit_unless_a_number_caps_it() -> None:
    def provider(**settings: object) -> Provider:
        config = parse_config(with_(providers=[{"name": "p", "base_url": "http://x/v1",
                                                **settings}],
                                    models={"m": [{"provider": "p", "model": "x"}]}), {})
        return config.providers["p"]

    learned = provider(engine="vllm")
    assert (learned.auto, learned.max_concurrency, learned.priority_order) == (True, 1024,
                                                                               "lower")
    capped = provider(engine="sglang", max_concurrency=6)
    assert (capped.auto, capped.max_concurrency, capped.priority_order) == (False, 6, "higher")
    assert provider(engine="llama.cpp").priority_order is None
    assert provider(engine="vllm", priority=False).priority_order is None
    latency = provider(max_concurrency="auto")
    assert (latency.auto, latency.engine, latency.max_concurrency) == (True, None, 1024)


def test_unwritten_tier_weights_halve_down_the_list_and_zero_is_background() -> None:
    config = parse_config(with_(tiers=[{"name": "a"}, {"name": "b"}, {"name": "c"},
                                       {"name": "idle", "weight": 0}]), {})
    assert [t.weight for t in config.tiers] == [8.0, 4.0, 2.0, 0.0]
    spread_off = parse_config(with_(scheduler={"headroom_spread": False}), {})
    assert spread_off.scheduler.headroom_spread is None


@pytest.mark.e2e  # the command line, in a subprocess
def test_cli_check_prints_summary_and_exits_0() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--config", str(ROOT / "routing.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and "gpt-4o-mini" in result.stdout


@pytest.mark.e2e  # the command line, in a subprocess
@pytest.mark.parametrize("command", ["check", "serve"])
def test_cli_exits_2_on_a_bad_config(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("providers:\n  - {name: sim, kind: simulated, max_concurrency: -1}\n"
                   "models: {m: [{provider: sim, model: x}]}\n")
    result = subprocess.run(
        [sys.executable, "-m", "proxy", command, "--config", str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert f"{bad}: providers[0].max_concurrency: must be a positive integer" in result.stderr


@pytest.mark.parametrize(("text", "message"), [
    (None, "cannot read"),
    ("models: [unclosed\n", "not valid YAML"),
    ("tiers: []\n", "tiers: must list at least one tier"),
])
def test_every_config_error_names_the_file(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "routing.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize("text", [
    'providers:\n  - name: p\n    api_key: "sk-secret-123\n',
    "providers:\n  - {name: p, api_key: sk-secret-123, x: [}\n",
    "providers: [{name: p, api_key: sk-secret-123}]\n\tbad: 1\n",
])
def test_a_yaml_error_says_where_but_never_quotes_the_file(tmp_path: Path, text: str) -> None:
    """The message reaches logs and /admin/status: the line it quotes may hold a key."""
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "not valid YAML: line " in str(info.value)
    assert "sk-secret" not in str(info.value) and info.value.__cause__ is None


@pytest.mark.parametrize(("text", "message"), [
    ("providers:\n  - {name: p, kind: simulated, api_key:upstream-SECRET4}\n"
     "models: {m: [{provider: p, model: x}]}\n", "providers[0]: an unknown key (not shown"),
    ("providers:\n  - {name: p, kind: simulated, api_key: !sk-extra-SECRET3 x}\n",
     "a YAML tag this file may not use"),
    ("tiers: [{name: a}]\nclassify: {default_tier: sk-live-SECRET5}\nproviders: "
     "[{name: p, kind: simulated}]\nmodels: {m: [{provider: p, model: x}]}\n",
     "classify.default_tier: unknown tier (not shown"),
    ("providers:\n  - {name: p, kind: simulated, max_concurrency: 2, max_concurrency: 3}\n",
     "a key is written twice in one mapping ('max_concurrency')"),
])
def test_errors_quote_only_what_looks_like_a_name(tmp_path: Path, text: str,
                                                   message: str) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert message in str(info.value), str(info.value)
    assert "SECRET" not in str(info.value)


def test_the_version_is_a_digest_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    text = (ROOT / "routing.yaml").read_text()
    path.write_text(text)
    first = load_config(path, env={}).version
    assert first == hashlib.sha256(text.encode()).hexdigest()[:12]
    path.write_text(text + "\n# a comment\n")
    assert load_config(path, env={}).version != first


@pytest.mark.e2e  # the command line, in a subprocess
def test_cli_prints_its_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--version"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"triage-proxy {proxy.__version__}"


def test_the_version_is_the_one_the_package_is_built_as() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'version = "{proxy.__version__}"' in pyproject


def test_the_documented_examples_are_valid_config() -> None:
    readme = documentation()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    merged: dict[str, object] = {}
    for block in blocks:
        merged.update(yaml.safe_load(block))
    env = {"OPENAI_API_KEY": "sk-1", "AZURE_OPENAI_KEY": "az-1"}
    config = parse_config(merged, env)
    assert set(config.providers) == {"premium", "budget", "azure", "sim"}
    assert config.models["chat"].degradation is not None
    assert [s.name for s in config.schedules] == ["evening-peak", "night"]
    assert config.scheduler.promote_after_s[0] == float("inf")


def test_the_state_section_and_its_url_shown_without_the_password() -> None:
    config = parse_config(with_(state={"backend": "redis", "url": "${REDIS_URL}",
                                       "lease_ttl_s": 5}),
                          {"REDIS_URL": "redis://:hunter2@redis.internal:6380/1"})
    state = config.state
    assert (state.backend, state.prefix, state.lease_ttl_s, state.on_error) == (
        "redis", "triage", 5.0, "local")
    assert state.shown_url == "redis://redis.internal:6380/1"
    assert parse_config(MINIMAL, {}).state.backend == "memory"


def test_an_anthropic_provider_defaults_to_anthropics_api_and_version() -> None:
    config = parse_config({
        "providers": [{"name": "claude", "kind": "anthropic", "api_key": "sk-ant"},
                      {"name": "pinned", "kind": "anthropic", "base_url": "http://127.0.0.1:9/",
                       "anthropic_version": "2024-01-01"}],
        "models": {"m": [{"provider": "claude", "model": "claude-haiku-4-5"}]}}, {})
    claude, pinned = config.providers["claude"], config.providers["pinned"]
    assert claude.base_url == "https://api.anthropic.com"
    assert claude.headers["anthropic-version"] == "2023-06-01"
    assert pinned.base_url == "http://127.0.0.1:9"
    assert pinned.headers["anthropic-version"] == "2024-01-01"
