"""The README's two-batch-overlap figures: DeepSeek-V3 on 16 x H800, EP16, each case once
as one batch and once split in two (``plugins.ep.two_batch_overlap``), the cases of
tests/test_ep_deepep.py. Usage: ``python tools/tbo_figures.py`` (a few seconds)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from test_ep_deepep import _tbo  # noqa: E402

CASES = (("prefill", 2, {"dispatch_dtype": "bf16"}), ("prefill", 2, {}), ("decode", 128, {}), ("decode", 256, {}))


def main() -> None:
    for phase, batch, options in CASES:
        one, two = _tbo(phase, batch, False, **options), _tbo(phase, batch, True, **options)
        compute_s = one.latency_s - one.overlap["exposed_comm_s"]
        print(f"{phase} batch {batch} {options or ''}: compute/comm {compute_s / one.overlap['comm_time_s']:.2f}, "
              f"latency {one.latency_s * 1e3:.1f} -> {two.latency_s * 1e3:.1f} ms, all-to-all hidden "
              f"{one.overlap['hidden_fraction'] * 100:.1f}% -> {two.overlap['hidden_fraction'] * 100:.1f}%")


if __name__ == "__main__":
    main()
