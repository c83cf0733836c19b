"""``g5 validate`` on a collectives file: G5's collectives against measured microbenchmarks.

A collectives measurement file is a CSV whose header has these columns (``g5 validate``
takes it by its ``op`` column):

- ``op``: a collective ``g5 collective`` lowers (``all_reduce``, ``all_gather``, ...);
- ``system``: a catalogue name or a system file (relative to the CSV's folder);
- ``chips``: the group (chips 0..N-1, a node first, as ``g5 collective --chips``);
- ``size_bytes``: bytes per rank (> 0);
- ``framework``: the serving framework whose kernels the measurement ran (vllm, sglang,
  trtllm; ``generic`` or empty: NCCL alone), priced as ``g5 collective --framework`` prices
  it: the framework's own kernel where its code chooses it, NCCL above;
- ``kernel``: the kernel the measurement timed, as its source names it (free text, reported
  beside the algorithm G5 chose, so that a row priced on another kernel shows);
- ``measured_us``: the measured time in microseconds (> 0);
- ``source``: where the figure comes from (required).

The report has the shape of the configuration file's (:func:`g5core.study.validate.validate`):
each row's measured and predicted time (in milliseconds, and in microseconds), its error,
the MAPE, the worst row, and the error per framework and op."""
from __future__ import annotations

import csv
import math
import os
import pathlib

from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.framework import FRAMEWORK_NAMES
from g5core.session.collbench import collective_rows

COLUMNS = ("op", "system", "chips", "size_bytes", "framework", "kernel", "measured_us", "source")


def is_collectives_file(header) -> bool:
    """Whether a measurement file's header is a collectives file's (its ``op`` column)."""
    return "op" in (header or ())


def read_collective_rows(path: pathlib.Path, reader: csv.DictReader) -> list[dict]:
    """Parse and check a collectives file; a bad row is a one-line ConfigError naming it."""
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(str(path), f"missing column(s) {', '.join(missing)}; a collectives file needs "
                                     f"{', '.join(COLUMNS)}")
    rows = []
    for number, rec in enumerate(reader, start=1):
        where = f"{path} row {number}"
        values = {k: (rec.get(k) or "").strip() for k in COLUMNS}
        for key in ("op", "system", "kernel", "source"):
            if not values[key]:
                raise ConfigError(where, f"{key} is empty")
        system = values["system"]
        if not os.path.isabs(system) and (path.parent / system).is_file():
            system = str(path.parent / system)
        try:
            chips = int(values["chips"])
            size = int(values["size_bytes"])
            measured_us = float(values["measured_us"])
        except ValueError:
            raise ConfigError(where, "chips and size_bytes must be integers and measured_us a number, got "
                                     f"{values['chips']!r}, {values['size_bytes']!r}, {values['measured_us']!r}") from None
        if chips < 2 or size <= 0 or not math.isfinite(measured_us) or measured_us <= 0:
            raise ConfigError(where, "chips must be >= 2, size_bytes > 0 and measured_us a time > 0 us")
        framework = values["framework"] or "generic"
        if framework not in FRAMEWORK_NAMES:
            raise ConfigError(where, f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORK_NAMES)} "
                                     "or leave it empty")
        rows.append({"number": number, "where": where, "op": values["op"], "system": system,
                     "system_name": values["system"], "chips": chips, "size_bytes": size, "framework": framework,
                     "kernel": values["kernel"], "measured_us": measured_us, "source": values["source"]})
    if not rows:
        raise ConfigError(str(path), "no measurement rows")
    return rows


def validate_collectives(path: pathlib.Path, reader: csv.DictReader) -> dict:
    """Each row priced by ``g5 collective`` (the engine's time of the one collective alone)."""
    out = []
    for row in read_collective_rows(path, reader):
        fw = None if row["framework"] == "generic" else row["framework"]
        try:
            (got,) = collective_rows(row["op"], row["system"], row["chips"], [row["size_bytes"]], framework=fw)
        except G5Error as exc:
            raise ConfigError(row["where"], str(exc)) from None
        predicted_us = got["time_s"] * 1e6
        out.append({"row": row["number"], "metric": row["op"],
                    "config": f"{row['system_name']} x{row['chips']} {row['size_bytes']} B {row['kernel']}",
                    "measured_ms": row["measured_us"] / 1e3, "predicted_ms": predicted_us / 1e3,
                    "measured_us": row["measured_us"], "predicted_us": predicted_us,
                    "error_pct": 100.0 * (predicted_us - row["measured_us"]) / row["measured_us"],
                    "framework": row["framework"], "kernel": row["kernel"],
                    "algorithm": f"{got['algorithm']}/{got['protocol']}", "source": row["source"]})
    return out
