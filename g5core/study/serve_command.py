"""``g5 serve``: flags to workload, simulation, outputs (the click command in
:mod:`g5core.present.cli` only parses). Output files are checked before the simulation and
written atomically afterwards; the results database row is added last."""
from __future__ import annotations

import json
import os
import sys
from typing import Mapping

from tqdm import tqdm

from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.serving import split_config, workload_spec
from g5core.serve.api import simulate_serving
from g5core.serve.present import dump_trace, render_summary, write_requests_csv
from g5core.serve.metrics import series
from g5core.study.serve_db import open_serving_db


def _progress_bar():
    bar = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, unit="req", file=sys.stderr, leave=False, desc="serving")
        bar["bar"].update(done - bar["bar"].n)
        if done == total:
            bar["bar"].close()
    return update


def serve_command(raw: Mapping, disabled, targets, db_path, inputs, *, as_json: bool, progress: bool, workload=None,
                  requests=None, rate=None, concurrency=None, isl=None, osl=None, slo=None, seed=None,
                  exact: bool = False, max_work=None) -> str:
    """Run ``g5 serve``; returns the text to print (the summary or the JSON object)."""
    db = None
    if db_path:
        for option in ("--requests-csv", "--trace"):
            other = targets.path(option)
            if other and os.path.realpath(other) == os.path.realpath(db_path):
                raise ConfigError("--db", f"{db_path} is also {option}'s file; give each output its own file")
        db = open_serving_db(db_path, inputs)
    _, block = split_config(raw)
    spec = workload_spec(block.get("workload"), workload, requests, rate, concurrency, isl, osl, seed)
    result = simulate_serving(raw, spec, disabled=disabled, slo=slo, exact=exact,
                              progress=_progress_bar() if progress else None, max_work=max_work)
    out = result.to_json_dict()
    write_error = None
    if targets:
        try:
            targets.write({"--requests-csv": lambda fh: write_requests_csv(result.loop, fh),
                           "--trace": lambda fh: dump_trace(result.loop, fh)})
        except G5Error as exc:
            write_error = exc
    if db is not None:
        db.add(raw, disabled, spec, out, series(result.loop))
        db.close()
    text = (json.dumps(out, indent=2, sort_keys=True, allow_nan=False) if as_json
            else render_summary(out, {} if write_error else {o: targets.path(o) for o in ("--requests-csv", "--trace")}))
    if write_error is not None:
        print(text)
        raise G5Error(f"{write_error}; nothing was written")
    return text
