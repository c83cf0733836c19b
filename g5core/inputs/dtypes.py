"""Numeric formats: the one place that knows how many bytes an element takes."""
from __future__ import annotations

from g5core.api.errors import ConfigError, suggest

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(name: str, field: str = "dtype") -> int:
    try:
        return BYTES_PER_ELEMENT[name]
    except (KeyError, TypeError):
        raise ConfigError(
            field,
            f"unknown dtype {name!r}{suggest(str(name), BYTES_PER_ELEMENT)}; "
            f"use one of {', '.join(BYTES_PER_ELEMENT)}",
        ) from None
