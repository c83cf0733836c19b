"""``g5 collective``: one collective alone on a system, size by size, as nccl-tests reports it.

Each size is one communication op over chips ``0..n-1`` (a node fills before the next),
lowered by the enabled plugins and run by the engine on otherwise idle links, so the time
is the one a run would see for that op without contention. Bus bandwidth follows
nccl-tests (doc/PERFORMANCE.md): ``algbw = size / time``; ``busbw = algbw x 2(n-1)/n`` for
all_reduce, ``x (n-1)/n`` for all_gather, reduce_scatter and all_to_all, ``x 1`` otherwise.
``size`` is nccl-tests' size: the buffer of all_reduce and all_to_all, the gathered output
of all_gather, the input of reduce_scatter.
"""
from __future__ import annotations

import re
from typing import Iterable

from g5core.api.errors import ConfigError

#: nccl-tests names accepted as aliases
ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "alltoall": "all_to_all"}
_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "KB": 2 ** 10, "KIB": 2 ** 10, "M": 2 ** 20, "MB": 2 ** 20, "MIB": 2 ** 20,
          "G": 2 ** 30, "GB": 2 ** 30, "GIB": 2 ** 30}
MAX_SIZE_BYTES = 2 ** 50


def bus_factor(primitive: str, n: int) -> float:
    if primitive == "all_reduce":
        return 2.0 * (n - 1) / n
    if primitive in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str, field: str = "--sizes") -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(field, f"cannot read size {text!r}; write bytes with an optional unit, e.g. 8B, 64K, 1MiB, 8GiB")
    return int(m.group(1)) * _UNITS[unit]


def size_range(spec: str, factor: int = 2) -> list[int]:
    """Sizes from ``MIN:MAX``, each ``factor`` times the last (nccl-tests -b/-e/-f)."""
    parts = spec.split(":")
    if len(parts) != 2:
        raise ConfigError("--sizes", f"expected MIN:MAX such as 8B:8GiB, got {spec!r}")
    lo, hi = parse_size(parts[0]), parse_size(parts[1])
    if not 0 < lo <= hi <= MAX_SIZE_BYTES:
        raise ConfigError("--sizes", f"need 0 < MIN <= MAX <= 1 PiB, got {lo} and {hi} bytes")
    if factor < 2:
        raise ConfigError("--factor", f"need an integer factor >= 2, got {factor}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def collective_rows(primitive: str, system_name: str, chips: int, sizes: Iterable[int],
                    disabled: Iterable[str] = ()) -> list[dict]:
    """One row per size: ``size_bytes, time_s, algbw_bytes_per_s, busbw_bytes_per_s,
    algorithm, protocol, channels``."""
    from g5core.sim.engine import Engine

    primitive = ALIASES.get(primitive, primitive)
    compile_one = collective_compiler(primitive, system_name, chips, disabled)
    rows = []
    for size in sizes:
        compiled = compile_one(size)
        time_s = Engine(dag=compiled).run().makespan_s
        algorithm, protocol, channels = compiled.comm_algo[0]
        algbw = size / time_s if time_s > 0 else 0.0
        rows.append({"size_bytes": int(size), "time_s": time_s, "algbw_bytes_per_s": algbw,
                     "busbw_bytes_per_s": algbw * bus_factor(primitive, chips), "algorithm": algorithm,
                     "protocol": protocol, "channels": channels})
    return rows


def collective_compiler(primitive: str, system_name: str, chips: int, disabled: Iterable[str] = ()):
    """A function of the size in bytes per rank: the compiled DAG of one ``primitive`` over
    chips ``0 .. chips - 1`` of ``system_name``, lowered by the enabled plugins."""
    from g5core.build.builder import make_topology
    from g5core.sim.collective import collect_primitives
    from g5core.api.ops import CommOp
    from g5core.build.dag import OpDag
    from g5core.sim.engine import compile_ops
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.inputs.systems import SystemSpec, get_system

    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 2:
        raise ConfigError("--chips", f"a collective needs at least 2 chips, got {chips!r}")
    if primitive == "p2p" and chips != 2:
        raise ConfigError("--chips", "p2p runs between 2 chips; give --chips 2 (or run sendrecv, which runs "
                                     "nccl-tests' sendrecv_perf over any number of chips)")
    hooks = Hooks(make_plugin_manager(disabled=tuple(disabled)))
    primitives = collect_primitives(hooks)
    if primitive not in primitives:
        from g5core.api.errors import suggest

        raise ConfigError("OP", f"unknown collective {primitive!r}{suggest(primitive, primitives)}; "
                                f"the enabled plugins lower {', '.join(primitives) or 'none'}")
    system = system_name if isinstance(system_name, SystemSpec) else get_system(system_name)
    topo = make_topology(hooks, system, chips)
    group = tuple(range(chips))

    def compile_one(size: float):
        dag = OpDag()
        dag.add_op(CommOp(key="collective", primitive=primitive, group=group, bytes_per_rank=float(size),
                          reason="collective", layer=0, name="collective", owner="g5"))
        return compile_ops(dag, topology=topo, primitives=primitives, hooks=hooks, system=system, deployment=None)

    return compile_one


