"""routing.yaml → frozen, typed configuration; the only reader of YAML and the environment."""

from .load import ApiKey, Config, ConfigError, Provider, load_config, parse_config

__all__ = ["ApiKey", "Config", "ConfigError", "Provider", "load_config", "parse_config"]
