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

from typing import Callable, Mapping, Optional, Sequence

import attrs

from g5core import ConfigError
from g5core.api.records import SweepPreset
from g5core.study.sweep import run_preset

PRESET_NAME = "cp"
DEFAULT_CP_VALUES = (1, 2, 4, 8, 16)
DEFAULT_SEQ_LENS = (32768, 65536, 131072, 262144, 524288, 1048576)
DEFAULT_HIDDEN_THRESHOLD = 0.9


@attrs.frozen
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


@attrs.frozen
class ScanReport:
    scan_id: int
    cells: tuple[Cell, ...]
    violations: tuple[str, ...]
    phase: str

    @property
    def ok(self) -> bool:
        return any(c.status == "ok" for c in self.cells) and not self.violations


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


def _ints(values, field: str) -> Optional[tuple[int, ...]]:
    if values is None:
        return None
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(field, f"must be positive whole numbers, got {v!r}")
        out.append(v)
    if not out:
        raise ConfigError(field, "needs at least one value")
    return tuple(sorted(set(out)))


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


def run_scan(raw: Mapping, db_path, cp_values: Optional[Sequence[int]] = DEFAULT_CP_VALUES,
             seq_lens: Optional[Sequence[int]] = DEFAULT_SEQ_LENS, disabled: Sequence[str] = (),
             hidden_threshold: float = DEFAULT_HIDDEN_THRESHOLD, progress: Callable[[str], None] | None = None,
             runner: Callable | None = None, **sweep_kwargs) -> ScanReport:
    """Run the grid through the sweep machinery, writing each cell as it finishes; return the check."""
    if not 0.0 < hidden_threshold <= 1.0:
        raise ConfigError("--hidden-threshold", f"must be in (0, 1], got {hidden_threshold}")
    axes = {"parallel.cp": _ints(cp_values, "--cp"), "seq_len": _ints(seq_lens, "--seq-len")}
    report = run_preset(PRESET_NAME, raw, db_path, axes=axes, options={"hidden_threshold": hidden_threshold},
                        disabled=disabled, progress=progress, runner=runner, **sweep_kwargs)
    return ScanReport(scan_id=report.sweep.sweep_id, cells=tuple(Cell.from_row(r) for r in report.sweep.rows),
                      violations=report.violations, phase=raw.get("phase", ""))
