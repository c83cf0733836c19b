"""A logical op of the model program, and the work it does on one chip."""
from __future__ import annotations

import attrs


@attrs.frozen
class LogicalOp:
    """One logical op of the model program: ``kind`` in one ``layer``.

    ``inputs`` are the ids of the logical ops whose output it consumes. ``layer`` is -1 for
    the embedding and ``n_layers`` for the final norm and LM head.
    """

    kind: str
    layer: int
    inputs: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: which copy of the program it belongs to when the step runs as micro-batches
    #: (g5core.lower.microbatch: side ``t`` of pipeline part ``j`` in cycle ``c`` is copy
    #: ``(c * m + j) * s + t``); -1: the whole step
    micro: int = attrs.field(default=-1, kw_only=True)
    id: str = attrs.field(init=False, eq=False,
                          default=attrs.Factory(lambda self: f"{layer_tag(self.layer)}{micro_tag(self.micro)}"
                                                             f".{self.kind}", takes_self=True))

    @property
    def prefix(self) -> str:
        """Every concrete op key of this logical op starts with this prefix."""
        return self.id

    def key(self, chip: int, part: str = "") -> str:
        """Stable op key: ``L003.qkv_proj@c12`` or ``L003.attention.step02@c12``."""
        return f"{self.id}.{part}@c{chip}" if part else f"{self.id}@c{chip}"


def micro_tag(micro: int) -> str:
    """``.m0``, ``.m1``... in the ids of a micro-batch's ops; nothing for the whole step."""
    return "" if micro < 0 else f".m{micro}"


def layer_tag(layer: int) -> str:
    if layer < 0:
        return "E"
    return f"L{layer:03d}"


@attrs.frozen(kw_only=True)
class Work:
    op_class: str        # gemm | attention | elementwise
    flops: float
    hbm_bytes: float
    weight_class: str    # which dtypes.weights entry sets the compute dtype ("" = activations)
    weight_elements: float  # weight elements resident on the chip for this op
    kernels: tuple = attrs.field(converter=tuple)  # the kernels it runs, with shapes (g5core.lower.kernels)
