"""Shared by the serving loop's tests: counting what its fast paths did. Imported as
``from serve_helpers import ...``."""
from __future__ import annotations

from g5core.serve import loop as serve_loop


def count_kept(monkeypatch) -> dict:
    """Counts, while the test runs, the runs of decode steps made on a kept decoding state
    (``runs``; ``chunks``: those beside a prompt's chunks) and the steps built on one
    (``steps``): ``loop._lazy_run`` and ``ServingLoop._lazy_step`` wrapped."""
    kept = {"runs": 0, "steps": 0, "chunks": 0}
    lazy, lazy_step = serve_loop._lazy_run, serve_loop.ServingLoop._lazy_step

    def counting(*args, **kwargs):
        out = lazy(*args, **kwargs)
        kept["runs"] += out[0] > 0
        kept["chunks"] += out[0] > 0 and len(args) > 5 and args[5] is not None
        return out

    def counting_steps(*args, **kwargs):
        out = lazy_step(*args, **kwargs)
        kept["steps"] += out
        return out
    monkeypatch.setattr(serve_loop, "_lazy_run", counting)
    monkeypatch.setattr(serve_loop.ServingLoop, "_lazy_step", counting_steps)
    return kept
