"""`bounded`: a config field with numeric bounds that the loader checks and names in its errors."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["bounded"]


def bounded(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field whose numeric value must lie in the given bounds."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "lt": lt})
