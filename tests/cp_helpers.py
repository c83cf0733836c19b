"""Shared helpers of the context-parallel test files (``tests/test_cp_*.py``).

Tiny Hugging Face models derived from ``tests/data/hf``, raw config dicts, the c_kv and
head-dimension formulas written out from the HF fields (independent of g5core), and the
check that the six conservation KPIs are zero. Imported as ``from cp_helpers import ...``
(pytest puts ``tests/`` on ``sys.path``, as for ``helpers_engine``).

A model *kind* is ``gqa`` (llama-3.1-8b) or ``mla`` (deepseek-v3, one dense layer and 8
routed experts, top 2), 2 layers unless a digit suffix says otherwise (``gqa3``, ``gqa1``).
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from g5core.api.ops import ComputeOp
from g5core.sim.results import KPI_NAMES
from g5core.session.run import make_plan, simulate_plan

HF_DIR = pathlib.Path(__file__).parent / "data" / "hf"
BF16_BYTES = 2

DEFAULT_LAYERS = 2
_KIND_RE = re.compile(r"^(gqa|mla)(\d*)$")


# ---------------------------------------------------------------------------- tiny models


def tiny_llama(n_layers: int) -> dict:
    cfg = json.loads((HF_DIR / "llama-3.1-8b.json").read_text())
    cfg["num_hidden_layers"] = n_layers
    return cfg


def tiny_deepseek(n_layers: int) -> dict:
    cfg = json.loads((HF_DIR / "deepseek-v3.json").read_text())
    cfg.update(num_hidden_layers=n_layers, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2)
    return cfg


def tiny_model(kind: str) -> dict:
    """The HF config dict of a model kind (``gqa``, ``mla3``, ...)."""
    m = _KIND_RE.match(kind)
    if m is None:
        raise ValueError(f"unknown tiny model kind {kind!r}: want gqa or mla, optionally followed by a layer count")
    family, layers = m.groups()
    make = tiny_llama if family == "gqa" else tiny_deepseek
    return make(int(layers) if layers else DEFAULT_LAYERS)


def write_tiny_models(directory: pathlib.Path, kinds) -> dict[str, tuple[str, dict]]:
    """Write ``<kind>.json`` per kind into ``directory``: kind -> (its path, the config dict)."""
    out = {}
    for kind in kinds:
        cfg = tiny_model(kind)
        path = directory / f"{kind}.json"
        path.write_text(json.dumps(cfg))
        out[kind] = (str(path), cfg)
    return out


def tiny_models_fixture(*kinds: str, paths_only: bool = False):
    """A module-scoped fixture: kind -> (path to a tiny HF config, the config dict), or
    kind -> path with ``paths_only``. Bind it to the fixture's name in the test module:
    ``models = tiny_models_fixture("gqa", "mla")``."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        written = write_tiny_models(tmp_path_factory.mktemp("cp_models"), kinds)
        return {kind: path for kind, (path, _) in written.items()} if paths_only else written
    return fixture


def tiny_model_path_fixture(kind: str):
    """A module-scoped fixture: the path to one tiny HF config (``tiny_llama = tiny_model_path_fixture("gqa1")``)."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        (path, _), = write_tiny_models(tmp_path_factory.mktemp("cp_model"), (kind,)).values()
        return path
    return fixture


# ------------------------------------------------------------------- literal formulas


def literal_c_kv_bytes(cfg: dict) -> int:
    """c_kv written out from the HF fields (bf16 KV cache), independent of g5core."""
    if "kv_lora_rank" in cfg:  # MLA: one compressed latent plus the shared rope key
        return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * BF16_BYTES
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * head_dim * BF16_BYTES


def literal_kv_cache_bytes(cfg: dict, *, batch: int, seq_len: int, cp: int, pp: int, stage: int) -> float:
    """Per-chip KV cache ``b * S * c_kv * L_local / cp`` written out, with the PP split rule
    (the first ``L mod pp`` stages hold one more layer)."""
    base, extra = divmod(cfg["num_hidden_layers"], pp)
    layers_local = base + (1 if stage < extra else 0)
    return batch * seq_len * literal_c_kv_bytes(cfg) * layers_local / cp


def literal_head_dims(cfg: dict, phase: str) -> tuple[int, int]:
    """(d_qk, d_v) of attention in ``phase``: MLA prefill runs on decompressed heads, MLA
    decode runs absorbed over the latent; GQA uses hidden / heads for both."""
    if "kv_lora_rank" in cfg:
        if phase == "prefill":
            return cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        if phase == "decode":
            return cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
        raise ValueError(f"unknown phase {phase!r}")
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return head_dim, head_dim


# ------------------------------------------------------------------------- configs, runs


def raw_config(model: str, *, cp: int = 1, seq_len: int = 4096, dp: int = 1, tp: int = 1, pp: int = 1,
               ep: int | None = None, batch: int = 1, phase: str = "prefill", system: str = "h100-sxm",
               chips: int | None = None, **extra) -> dict:
    """A raw config dict; ``chips`` defaults to the product of the parallel sizes, ``ep`` is
    written only when given, ``extra`` adds top-level fields (``path``, ``tp_sp``, ...)."""
    parallel = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    if ep is not None:
        parallel["ep"] = ep
    raw = {
        "model": model, "system": system,
        "chips": dp * tp * pp * cp if chips is None else chips,
        "parallel": parallel,
        "phase": phase, "batch": batch, "seq_len": seq_len,
    }
    raw.update(extra)
    return raw


def assert_kpis_zero(sim) -> None:
    """The run reports exactly the six conservation KPIs, each exactly 0."""
    assert set(sim.kpis) == set(KPI_NAMES)
    for name in KPI_NAMES:
        assert sim.kpis[name] == 0, f"conservation KPI {name} = {sim.kpis[name]}"


def simulate_raw(raw: dict):
    """(plan, sim) of a raw config, its conservation KPIs checked zero. Every chip is
    simulated (no symmetry): the structure tests inspect every replica's ops."""
    plan = make_plan(raw)
    sim = simulate_plan(plan, check=False, symmetry=False)
    assert_kpis_zero(sim)
    return plan, sim


def single_compute_key(dag, name: str, layer: int, chip: int) -> str:
    """The key of the one compute op called ``name`` in ``layer`` on ``chip``."""
    keys = [op.key for op in dag.ops if isinstance(op, ComputeOp) and op.name == name
            and op.layer == layer and op.chip == chip]
    assert len(keys) == 1, (name, layer, chip, keys)
    return keys[0]
