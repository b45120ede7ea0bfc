"""What a config value the server cannot use raises, and the checks of resource
names every part of the config shares.

A leaf of `dp_core.config`: the entries (`entries`), the sections
(`sections`) and `Config` itself (`config`) all raise `ConfigError`, so it
lives below them.
"""

from __future__ import annotations

import attrs

from .names import resource_name_error

__all__ = ["ConfigError", "optional_resource_name", "valid_resource_name"]


class ConfigError(ValueError):
    """A config value the server cannot use; the message names the value."""


def valid_resource_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    error = resource_name_error(value)
    if error is not None:
        raise ConfigError(error)


def optional_resource_name(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None:
        valid_resource_name(instance, attribute, value)  # type: ignore[arg-type]
