"""Run configuration: one pydantic schema (no torch import) and YAML presets."""

from configs.schema import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config"]
