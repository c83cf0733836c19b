"""Parallel dimensions as plugins register them."""
from __future__ import annotations

import math
import re
from typing import Optional

import attrs

from g5core.api.errors import PluginError
from g5core.api.plugins import Hooks

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@attrs.frozen(kw_only=True)
class Dimension:
    """One parallel dimension.

    ``factor``: the dimension is a factor of the chip count (dp x pp x cp x tp = chips).
    ``rank_order``: place in the rank order, outermost first (a larger value is nearer the
    innermost, fastest-varying coordinate); factor dimensions only.
    ``regroups``: for a non-factor dimension (ep), the factor dimensions whose rank space
    its groups are carved from, e.g. ``("dp", "tp")``.
    ``default``: the value when the configuration omits the key, or ``None`` when the key
    is required; ``missing_hint``: then what the error for an omitted key says (the fix),
    instead of the core's "add `NAME: 1` for none".
    ``replicas``: the slices of chips along this (factor) dimension are independent replicas
    running the same work, so the core may simulate one and replicate its results where
    it proves that exact (:mod:`g5core.lower.symmetry`).
    ``moe_only``: the dimension splits routed experts, so a model without MoE layers has
    nothing for it to split: the layout search does not enumerate it, and leaves it out of
    what it prints, for a dense model.
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(_NAME))
    factor: bool
    rank_order: int = 0
    regroups: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    default: Optional[int] = None
    doc: str = ""
    owner: str = ""
    replicas: bool = False
    moe_only: bool = False
    missing_hint: str = ""

    def __attrs_post_init__(self):
        if self.factor and self.regroups:
            raise ValueError(f"dimension {self.name}: a factor dimension cannot regroup others")
        if self.replicas and not self.factor:
            raise ValueError(f"dimension {self.name}: only a factor dimension can declare replicas")
        if not self.factor and not self.regroups:
            raise ValueError(f"dimension {self.name}: a non-factor dimension must name what it regroups")


@attrs.frozen
class DimensionRegistry:
    dims: tuple[Dimension, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def get(self, name: str) -> Dimension:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(name)

    @property
    def factors(self) -> tuple[Dimension, ...]:
        """Factor dimensions, outermost first."""
        return tuple(sorted((d for d in self.dims if d.factor), key=lambda d: (d.rank_order, d.name)))

    def chips(self, parallel) -> int:
        """The chips a layout spans: the product of its factor dimensions' sizes (1 where
        ``parallel`` leaves one out; a non-factor dimension, ep, regroups those chips)."""
        return math.prod(parallel.get(d.name, 1) for d in self.factors)


def collect_dimensions(hooks: Hooks) -> DimensionRegistry:
    """Ask every plugin to register its dimensions; duplicates and bad specs are errors."""
    found: dict[str, Dimension] = hooks.collect_named("g5_register_dimensions", Dimension, "dimension")
    registry = DimensionRegistry(tuple(found[name] for name in sorted(found)))
    for d in registry.dims:
        for other in d.regroups:
            # a regrouped dimension that no enabled plugin registers has size 1: nothing to carve
            if other in found and not found[other].factor:
                raise PluginError(d.owner, f"dimension '{d.name}' regroups '{other}', which is not a factor dimension")
    return registry
