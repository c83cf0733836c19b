"""What a plugin reads while it contributes to a run: the build context.

The annotations name the core's input records (``Deployment``, ``ModelSpec``,
``SystemSpec``, ``RankMap``, ``LocalShape``, ``Topology``) by their public names, each
exported from ``g5core`` (``tests/test_plugin_api.py`` resolves every one there), without
importing them: the plugin contract imports no implementation module (tests/test_layout.py).
"""
from __future__ import annotations

import abc
from typing import Iterable, Optional

import attrs

from g5core.api.dimensions import DimensionRegistry
from g5core.api.errors import PluginError
from g5core.api.ops import CommOp, ComputeOp
from g5core.api.plugins import Hooks
from g5core.api.work import LogicalOp, Work


@attrs.define(eq=False, kw_only=True)
class BuildContext(abc.ABC):
    """Everything a plugin may read while contributing to a run. Plugins must not mutate it.

    The core makes it (:func:`g5core.lower.builder.plan_deployment`) as a subclass that answers the
    four questions asked of the core's formulas, abstract here: :meth:`work`,
    :meth:`hidden_states_bytes`, :meth:`logits_bytes` and :attr:`kv_bytes_per_token_local`.
    """

    deployment: "Deployment"
    model: "ModelSpec"
    system: "SystemSpec"
    dims: DimensionRegistry
    rankmap: "RankMap"
    shape: "LocalShape"
    topology: "Topology"
    hooks: Hooks = attrs.field(repr=False)
    _layer_chips: dict = attrs.field(factory=dict, repr=False)
    #: when set, the only chips ops are placed on (one replica of a symmetric run:
    #: g5core.lower.symmetry); every other field still describes the whole cluster
    replica_chips: Optional[tuple[int, ...]] = attrs.field(default=None, repr=False)

    def restricted(self, chips: tuple[int, ...]) -> "BuildContext":
        """The same context with ops placed on ``chips`` only."""
        return attrs.evolve(self, layer_chips={}, replica_chips=tuple(chips))

    @property
    def phase(self) -> str:
        return self.deployment.phase

    def size(self, dim: str) -> int:
        return self.deployment.size(dim)

    @property
    def all_chips(self) -> tuple[int, ...]:
        chips = self._layer_chips.get("all")
        if chips is None:
            chips = self._layer_chips["all"] = tuple(range(self.rankmap.chips))
        return chips

    def layer_chips(self, layer: int) -> tuple[int, ...]:
        """Chips holding ``layer`` (intersection of every plugin's answer). Layers with the
        same answers (the same objects: a plugin that answers each stage with one tuple)
        share one result, so the chips are gone through once per distinct answer, not per layer."""
        if layer not in self._layer_chips:
            answers = self.hooks.call_each("g5_layer_chips", ctx=self, layer=layer)
            key = ("answers",) + tuple((plugin, id(answer)) for plugin, answer in answers)
            known = self._layer_chips.get(key)
            if known is None or any(a is not b for (_, a), b in zip(answers, known[0])):
                if not answers and self.replica_chips is None:
                    chips = self.all_chips
                else:
                    base = set(self.all_chips if self.replica_chips is None else self.replica_chips)
                    for plugin, answer in answers:
                        base &= _chip_set(plugin, "g5_layer_chips", answer, self.rankmap.chips)
                    chips = tuple(sorted(base))
                known = self._layer_chips[key] = (tuple(a for _, a in answers), chips)
            self._layer_chips[layer] = known[1]
        return self._layer_chips[layer]

    def place(self, lop: LogicalOp) -> tuple[int, ...]:
        """Chips that run ``lop``: the layer's chips, restricted by g5_place_op answers."""
        chips = set(self.layer_chips(lop.layer))
        for plugin, answer in self.hooks.call_each("g5_place_op", ctx=self, lop=lop):
            chips &= _chip_set(plugin, "g5_place_op", answer, self.rankmap.chips)
        return tuple(sorted(chips))

    @abc.abstractmethod
    def work(self, kind: str, layer: Optional[int] = None) -> Optional[Work]:
        """The core's work of one logical op of ``kind`` on one chip (``None`` for a
        synchronisation point); ``layer`` sets a windowed layer's attention (sliding or
        chunked: :meth:`g5core.inputs.models.ModelSpec.kv_window`)."""

    @abc.abstractmethod
    def hidden_states_bytes(self, tokens: float) -> float:
        """Bytes of ``tokens`` hidden-state rows (``tokens x hidden x activation dtype``)."""

    @abc.abstractmethod
    def logits_bytes(self) -> float:
        """Bytes of the logits over the whole vocabulary of the rows the LM head computes
        (``rows x vocab x activation dtype``): what a vocabulary split gathers."""

    @property
    @abc.abstractmethod
    def kv_bytes_per_token_local(self) -> float:
        """c_kv as one chip stores it (GQA heads split by TP; the MLA latent is whole)."""

    def compute_dtype(self, work_or_class) -> str:
        weight_class = work_or_class.weight_class if isinstance(work_or_class, Work) else work_or_class
        d = self.deployment.dtypes
        return d.gemm_dtype(weight_class) if weight_class else d.activations

    def compute_op(self, lop: LogicalOp, chip: int, work: Work, owner: str, part: str = "",
                   flops: float | None = None, hbm_bytes: float | None = None) -> ComputeOp:
        """A compute op of ``lop`` on ``chip``; ``flops``/``hbm_bytes`` override the work's."""
        return ComputeOp(
            key=lop.key(chip, part), chip=chip, op_class=work.op_class,
            flops=work.flops if flops is None else flops,
            hbm_bytes=work.hbm_bytes if hbm_bytes is None else hbm_bytes,
            layer=lop.layer, name=lop.kind, dtype=self.compute_dtype(work), owner=owner, kernels=work.kernels,
        )

    def comm_op(self, lop: LogicalOp, primitive: str, group: Iterable[int], bytes_per_rank: float,
                reason: str, owner: str, part: str) -> CommOp:
        group = tuple(group)
        return CommOp(
            key=f"{lop.prefix}.{part}@g{'-'.join(map(str, group))}" if len(group) > 2 or primitive != "p2p"
            else f"{lop.prefix}.{part}@c{group[0]}->c{group[1]}",
            primitive=primitive, group=group, bytes_per_rank=bytes_per_rank, reason=reason,
            layer=lop.layer, name=lop.kind, owner=owner,
        )


def _chip_set(plugin: str, hook: str, answer, chips: int) -> set[int]:
    try:
        out = {int(c) for c in answer}
    except TypeError:
        raise PluginError(plugin, f"{hook} must return chip ids or None, got {answer!r}") from None
    bad = [c for c in out if not 0 <= c < chips]
    if bad:
        raise PluginError(plugin, f"{hook} returned chips outside 0..{chips - 1}: {sorted(bad)[:5]}")
    return out
