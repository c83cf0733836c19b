"""Number formats: the one place that knows how many bytes an element takes, scales included,
and which of a chip's peak rates a format's GEMMs run at.

Block-scaled formats store one scale per block of elements; its bytes are spread over the
block (``bytes_per_element = bits / 8 + scale_bytes / block``):

- ``nvfp4``: FP4 (E2M1) elements with one FP8 (E4M3) scale per 16 (NVIDIA, "Introducing NVFP4
  for Efficient and Accurate Low-Precision Inference", developer blog, 2025; plus one FP32 scale
  per tensor, not counted): 0.5 + 1/16 = 0.5625 bytes.
- ``mxfp4``: FP4 (E2M1) elements with one E8M0 scale per 32 (OCP Microscaling Formats (MX)
  Specification v1.0, 2023; GPT-OSS ships its experts so): 0.5 + 1/32 = 0.53125 bytes.
- ``int4``: weight-only INT4 with groups of 128 (AWQ/GPTQ style, group_size 128): per group an
  FP16 scale and a 4-bit zero point (AWQ's ``scales`` fp16 and ``qzeros`` packed eight to an
  int32): 0.5 + (2 + 0.5)/128 = 0.51953125 bytes. Its GEMMs dequantize to, and run at, the
  activations' dtype (W4A16).

FP4 GEMMs run at the chip's ``fp4`` peak (Blackwell: B200, GB200, GB300), with the
activations quantized to FP4 too; a chip without that peak refuses them (``peak_flops``).
"""
from __future__ import annotations

import attrs

from g5core.api.errors import ConfigError, suggest


@attrs.frozen(kw_only=True)
class NumberFormat:
    name: str
    element_bits: int
    block_elements: int = 0        # elements that share one scale; 0 = no block scale
    scale_bytes_per_block: float = 0.0   # the scale (and zero point) of one block
    #: the peak_flops_per_s key its GEMMs run at; "" = the activations' dtype (weight-only)
    peak: str = ""
    weights_only: bool = False     # a storage format for weights, not for activations or KV

    @property
    def bytes_per_element(self) -> float:
        b = self.element_bits / 8 + (self.scale_bytes_per_block / self.block_elements if self.block_elements else 0.0)
        return int(b) if b == int(b) else b


FORMATS = {f.name: f for f in (
    NumberFormat(name="fp32", element_bits=32, peak="fp32"),
    NumberFormat(name="bf16", element_bits=16, peak="bf16"),
    NumberFormat(name="fp16", element_bits=16, peak="fp16"),
    NumberFormat(name="fp8", element_bits=8, peak="fp8"),
    NumberFormat(name="nvfp4", element_bits=4, block_elements=16, scale_bytes_per_block=1, peak="fp4",
                 weights_only=True),
    NumberFormat(name="mxfp4", element_bits=4, block_elements=32, scale_bytes_per_block=1, peak="fp4",
                 weights_only=True),
    NumberFormat(name="int4", element_bits=4, block_elements=128, scale_bytes_per_block=2.5, peak="",
                 weights_only=True),
)}
#: formats activations and the KV cache may take (whole bytes per element)
BYTES_PER_ELEMENT = {n: f.bytes_per_element for n, f in FORMATS.items() if not f.weights_only}
#: the peak rates a system file may list (dense FLOP/s per number format of the tensor cores)
PEAK_DTYPES = ("fp32", "bf16", "fp16", "fp8", "fp4")


def number_format(name: str, field: str = "dtype", weights: bool = True) -> NumberFormat:
    """The format ``name``; ``weights=False`` refuses the weight-only ones."""
    choices = FORMATS if weights else BYTES_PER_ELEMENT
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None or name not in choices:
        if fmt is not None:
            raise ConfigError(field, f"{name} is a weight format (block-scaled, weights only); "
                                     f"use one of {', '.join(choices)} here")
        raise ConfigError(
            field,
            f"unknown dtype {name!r}{suggest(str(name), choices)}; use one of {', '.join(choices)}",
        )
    return fmt


def dtype_bytes(name: str, field: str = "dtype", weights: bool = False) -> float:
    """Bytes per element of ``name``, block scales included."""
    return number_format(name, field, weights).bytes_per_element
