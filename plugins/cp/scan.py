"""The CP validation scan, a sweep preset of the ``cp`` plugin: a cp x S grid with chips fixed.

Every cell sets ``parallel.cp`` and ``seq_len``; ``dp`` is ``auto`` so it absorbs the
change (``dp = chips / (tp x pp x cp)``). A cell whose layout is invalid (dp not whole,
ep not dividing dp x tp, seq_len not divisible by 2 cp...) is recorded with its error, not
adjusted. The sweep machinery (``g5core.study.sweep``) writes each row as it finishes.

The check (spec: "TTFT does not increase with cp where communication is hidden"): for each
S, over the successful cells in increasing cp, TTFT must not increase between two cells
whose ring traffic is hidden (``cp_passkv`` hidden fraction >= ``hidden_threshold``;
cp = 1 has no ring traffic and counts as hidden). Cells where it increases are named.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import attrs

from g5core import SweepPreset

PRESET_NAME = "cp"
DEFAULT_CP_VALUES = (1, 2, 4, 8, 16)
DEFAULT_SEQ_LENS = (32768, 65536, 131072, 262144, 524288, 1048576)
DEFAULT_HIDDEN_THRESHOLD = 0.9


@attrs.frozen(kw_only=True)
class Cell:
    cp: int
    seq_len: int
    status: str
    error: str = ""
    dp: Optional[int] = None
    latency_s: Optional[float] = None
    hidden_fraction: Optional[float] = None

    @classmethod
    def from_row(cls, row: Mapping) -> "Cell":
        par = row.get("parallel") or {}
        ring = ((row.get("overlap") or {}).get("by_reason") or {}).get("cp_passkv")
        return cls(cp=row["point"]["parallel.cp"], seq_len=row["point"]["seq_len"], status=row["status"],
                   error=row["error"] or "", dp=par.get("dp") if row["status"] == "ok" else None,
                   latency_s=row["latency_s"], hidden_fraction=ring["hidden_fraction"] if ring else None)



def check_monotone(cells: Sequence[Cell], hidden_threshold: float) -> tuple[str, ...]:
    """Cells where TTFT rises with cp although the ring traffic is hidden on both sides."""
    violations = []
    by_seq: dict[int, list[Cell]] = {}
    for c in cells:
        if c.status == "ok":
            by_seq.setdefault(c.seq_len, []).append(c)
    for seq_len, row in sorted(by_seq.items()):
        row.sort(key=lambda c: c.cp)
        hidden = [c for c in row if c.cp == 1 or (c.hidden_fraction is not None and c.hidden_fraction >= hidden_threshold)]
        for a, b in zip(hidden, hidden[1:]):
            if b.latency_s > a.latency_s:
                violations.append(f"seq_len={seq_len}: TTFT rises from cp={a.cp} ({a.latency_s:.6g} s) "
                                  f"to cp={b.cp} ({b.latency_s:.6g} s) with the ring traffic hidden")
    return tuple(violations)


def check_rows(rows: Sequence[Mapping], options: Mapping) -> tuple[str, ...]:
    """The preset's check over the sweep's rows."""
    return check_monotone([Cell.from_row(r) for r in rows], options["hidden_threshold"])


PRESET = SweepPreset(
    name=PRESET_NAME,
    doc="CP validation scan: cp x seq_len with chips fixed (dp auto); TTFT must not rise with cp "
        "where the ring traffic is hidden (prefill)",
    grid=(("seq_len", DEFAULT_SEQ_LENS), ("parallel.cp", DEFAULT_CP_VALUES)),
    fixed=("parallel.dp=auto",),
    check=check_rows,
    check_phases=("prefill",),
    options={"hidden_threshold": DEFAULT_HIDDEN_THRESHOLD},
)
