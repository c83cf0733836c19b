"""``g5 collective``: one collective alone on a system, size by size, as nccl-tests reports it.

Each size is one communication op over chips ``0..n-1`` (a node fills before the next),
lowered by the enabled plugins and run by the engine on otherwise idle links, so the time
is the one a run would see for that op without contention. Bus bandwidth follows
nccl-tests (doc/PERFORMANCE.md): ``algbw = size / time``; ``busbw = algbw x 2(n-1)/n`` for
all_reduce, ``x (n-1)/n`` for all_gather, reduce_scatter and all_to_all, ``x 1`` otherwise.
``size`` is nccl-tests' size: the buffer of all_reduce and all_to_all, the gathered output
of all_gather, the input of reduce_scatter.

The table has nccl-tests' columns (size, count, type, redop, root, then time, algbw, busbw
and #wrong out-of-place and in-place), so a user's nccl-tests output compares line for
line. ``count`` is ``size`` over the element size of ``--dtype`` (nccl-tests -d, default
float); ``redop`` (-o, default sum) is printed for the reducing collectives and ``none``
for the others, as nccl-tests does; root is -1 (nccl-tests' value for rootless ops; the
rooted broadcast and gather run from chip 0). G5 moves the same bytes either way and does
not model the data type's or the reduction's arithmetic, nor an in-place buffer: the
in-place columns repeat the out-of-place ones, and #wrong (a correctness check of real
data) is "-".
"""
from __future__ import annotations

import re
from typing import Iterable

from g5core.api.errors import ConfigError
from g5core.api.errors import suggest
from g5core.api.ops import CommOp
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.systems import SystemSpec, get_system
from g5core.lower.builder import make_topology
from g5core.lower.collective import collect_primitives
from g5core.lower.dag import OpDag
from g5core.sim.compile import compile_ops
from g5core.sim.engine import Engine

#: nccl-tests names accepted as aliases
ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "alltoall": "all_to_all"}
_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "KB": 2 ** 10, "KIB": 2 ** 10, "M": 2 ** 20, "MB": 2 ** 20, "MIB": 2 ** 20,
          "G": 2 ** 30, "GB": 2 ** 30, "GIB": 2 ** 30}
MAX_SIZE_BYTES = 2 ** 50
#: nccl-tests' data types (-d) and their bytes per element
NCCL_TYPES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2, "float": 4,
              "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}
#: nccl-tests' reduction operations (-o)
NCCL_REDOPS = ("sum", "prod", "max", "min", "avg")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


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
                    disabled: Iterable[str] = (), dtype: str = "float", redop: str = "sum") -> list[dict]:
    """One row per size: ``size_bytes, count, type, redop, root, time_s, algbw_bytes_per_s,
    busbw_bytes_per_s, in_place_time_s, algorithm, protocol, channels``."""
    primitive = ALIASES.get(primitive, primitive)
    if dtype not in NCCL_TYPES:
        raise ConfigError("--dtype", f"unknown type {dtype!r}{suggest(dtype, NCCL_TYPES)}; nccl-tests' -d takes "
                                     f"{', '.join(NCCL_TYPES)}")
    if redop not in NCCL_REDOPS:
        raise ConfigError("--redop", f"unknown reduction {redop!r}{suggest(redop, NCCL_REDOPS)}; nccl-tests' -o "
                                     f"takes {', '.join(NCCL_REDOPS)}")
    element = NCCL_TYPES[dtype]
    compile_one = collective_compiler(primitive, system_name, chips, disabled)
    rows = []
    for size in sizes:
        compiled = compile_one(size)
        time_s = Engine(dag=compiled).run().makespan_s
        algorithm, protocol, channels = compiled.comm_algo[0]
        algbw = size / time_s if time_s > 0 else 0.0
        rows.append({"size_bytes": int(size), "count": int(size) // element, "type": dtype,
                     "redop": redop if primitive in REDUCING else "none", "root": -1,
                     "time_s": time_s, "algbw_bytes_per_s": algbw,
                     "busbw_bytes_per_s": algbw * bus_factor(primitive, chips), "in_place_time_s": time_s,
                     "algorithm": algorithm, "protocol": protocol, "channels": channels})
    return rows


def collective_compiler(primitive: str, system_name: str, chips: int, disabled: Iterable[str] = ()):
    """A function of the size in bytes per rank: the compiled DAG of one ``primitive`` over
    chips ``0 .. chips - 1`` of ``system_name``, lowered by the enabled plugins."""
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 2:
        raise ConfigError("--chips", f"a collective needs at least 2 chips, got {chips!r}")
    if primitive == "p2p" and chips != 2:
        raise ConfigError("--chips", "p2p runs between 2 chips; give --chips 2 (or run sendrecv, which runs "
                                     "nccl-tests' sendrecv_perf over any number of chips)")
    hooks = Hooks(make_plugin_manager(disabled=tuple(disabled)))
    primitives = collect_primitives(hooks)
    if primitive not in primitives:
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


# ------------------------------------------------------------------------------ multi-op benchmarks
def bench_rows(name: str, system_name: str, chips: int, tokens: Iterable[int], params: dict,
               disabled: Iterable[str] = ()) -> list[dict]:
    """``g5 collective NAME`` for a name a plugin answers through ``g5_bench_ops`` (EP
    dispatch and combine): one row per token count, ``tokens, time_s, <column>_bytes_per_s``
    for every logical-bytes column the plugin gives (bytes per rank / time), ``algorithm``."""
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 2:
        raise ConfigError("--chips", f"an exchange needs at least 2 chips, got {chips!r}")
    hooks = Hooks(make_plugin_manager(disabled=tuple(disabled)))
    primitives = collect_primitives(hooks)
    system = get_system(system_name)
    topo = make_topology(hooks, system, chips)
    rows = []
    for n_tokens in tokens:
        answers = hooks.call_each("g5_bench_ops", name=name, topology=topo, params={**params, "tokens": n_tokens})
        if not answers:
            raise ConfigError("OP", f"no enabled plugin offers the benchmark {name!r}")
        _plugin, (fragment, logical) = answers[0]
        dag = OpDag()
        for op in fragment.ops:
            dag.add_op(op)
        for a, b in fragment.edges:
            dag.add_edge(a, b)
        compiled = compile_ops(dag, topology=topo, primitives=primitives, hooks=hooks, system=system,
                               deployment=None)
        time_s = Engine(dag=compiled).run().makespan_s
        row = {"tokens": int(n_tokens), "time_s": time_s}
        for column, nbytes in logical.items():
            row[f"{column}_bytes_per_s"] = nbytes / time_s if time_s > 0 else 0.0
        row["algorithm"] = "+".join(dict.fromkeys(a[0] for a in compiled.comm_algo))
        rows.append(row)
    return rows

