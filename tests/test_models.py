"""Model shapes: published parameter counts, c_kv, HF config.json parsing, errors."""
from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from g5core.api.errors import ConfigError
from g5core.inputs.models import CATALOG, ModelSpec, catalog_names, get_model

HF_DIR = Path(__file__).parent / "data" / "hf"

# Published figures (model cards / papers), in billions: (total, active). Not tuned to the code.
PUBLISHED = {
    "llama-3.1-8b": (8.03, 8.03),
    "llama-3.1-70b": (70.6, 70.6),
    "llama-3.1-405b": (405.9, 405.9),
    "qwen2.5-72b": (72.7, 72.7),
    "qwen3-235b-a22b": (235.0, 22.0),
    "mixtral-8x7b": (46.7, 12.9),
    "deepseek-v3": (671.0, 37.0),
}

# c_kv in bytes per token per layer at bf16 (2 bytes).
C_KV_BF16 = {
    "llama-3.1-8b": 2 * 8 * 128 * 2,
    "llama-3.1-70b": 2 * 8 * 128 * 2,
    "llama-3.1-405b": 2 * 8 * 128 * 2,
    "qwen2.5-72b": 2 * 8 * 128 * 2,
    "qwen3-235b-a22b": 2 * 4 * 128 * 2,
    "mixtral-8x7b": 2 * 8 * 128 * 2,
    "deepseek-v3": (512 + 64) * 2,
}


def test_catalog_is_the_seven_models_and_the_data_configs():
    from g5core.inputs.models import MODELS_DIR
    data = {p.stem for p in MODELS_DIR.glob("*.json")}
    assert set(catalog_names()) == set(PUBLISHED) | data == set(CATALOG)
    assert all(CATALOG[n].name == n for n in CATALOG)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_match_published(name):
    total, active = PUBLISHED[name]
    counts = CATALOG[name].param_counts()
    assert counts.total / 1e9 == pytest.approx(total, rel=0.02)
    assert counts.active / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name", sorted(C_KV_BF16))
def test_c_kv_exact(name):
    m = CATALOG[name]
    assert m.kv_bytes_per_token_per_layer(2) == C_KV_BF16[name]
    assert m.kv_bytes_per_token_per_layer(1) * 2 == C_KV_BF16[name]


def test_c_kv_rejects_bad_dtype_bytes():
    with pytest.raises(ValueError):
        CATALOG["llama-3.1-8b"].kv_bytes_per_token_per_layer(0)


def test_gqa_projection_shapes():
    assert CATALOG["llama-3.1-70b"].projection_shapes() == (
        ("q_proj", 8192, 8192),
        ("k_proj", 8192, 1024),
        ("v_proj", 8192, 1024),
        ("o_proj", 8192, 8192),
    )
    # Qwen3: head_dim 128 is explicit, so 64 heads project to 8192 from hidden 4096.
    assert CATALOG["qwen3-235b-a22b"].projection_shapes()[0] == ("q_proj", 4096, 8192)


def test_mla_projection_shapes():
    assert CATALOG["deepseek-v3"].projection_shapes() == (
        ("q_a_proj", 7168, 1536),
        ("q_b_proj", 1536, 128 * 192),
        ("kv_a_proj", 7168, 512 + 64),
        ("kv_b_proj", 512, 128 * (128 + 128)),
        ("o_proj", 128 * 128, 7168),
    )
    no_q_lora = attrs.evolve(CATALOG["deepseek-v3"].attention, q_lora_rank=0)
    m = attrs.evolve(CATALOG["deepseek-v3"], attention=no_q_lora)
    assert m.projection_shapes()[0] == ("q_proj", 7168, 128 * 192)
    assert [s[0] for s in m.projection_shapes()][1:] == ["kv_a_proj", "kv_b_proj", "o_proj"]


def test_moe_layers():
    ds = CATALOG["deepseek-v3"]
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert sum(ds.is_moe_layer(i) for i in range(ds.n_layers)) == 58
    assert all(CATALOG["qwen3-235b-a22b"].is_moe_layer(i) for i in range(94))
    assert not any(CATALOG["llama-3.1-8b"].is_moe_layer(i) for i in range(32))
    with pytest.raises(ValueError):
        ds.is_moe_layer(61)


def test_layer_params_parts():
    ds = CATALOG["deepseek-v3"]
    dense, moe = ds.layer_params(0), ds.layer_params(3)
    assert dense.dense_ffn == 3 * 7168 * 18432 and dense.routed_experts == 0
    assert moe.dense_ffn == 0
    assert moe.router == 7168 * 256
    assert moe.routed_experts == 256 * 3 * 7168 * 2048
    assert moe.shared_experts == 3 * 7168 * 2048
    assert moe.total - moe.active == (256 - 8) * 3 * 7168 * 2048
    # two RMSNorms plus MLA's q_a / kv_a layernorms
    assert moe.attention_norms == 2 * 7168 + 1536 + 512
    # Qwen3 adds q_norm and k_norm (head_dim each); Qwen2.5 adds q/k/v biases.
    assert CATALOG["qwen3-235b-a22b"].layer_params(0).attention_norms == 2 * 4096 + 2 * 128
    q25 = CATALOG["qwen2.5-72b"].layer_params(0).attention
    assert q25 == sum(i * o for _, i, o in CATALOG["qwen2.5-72b"].projection_shapes()) + 8192 + 2 * 1024
    assert CATALOG["llama-3.1-8b"].ffn_params(14336) == 3 * 4096 * 14336


def test_tied_embeddings_count_once():
    m = CATALOG["llama-3.1-8b"]
    tied = attrs.evolve(m, tie_word_embeddings=True)
    assert m.param_counts().total - tied.param_counts().total == 128256 * 4096


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hf_json_equals_catalog(name):
    path = HF_DIR / f"{name}.json"
    assert ModelSpec.from_hf_file(path, name=name) == CATALOG[name]
    assert ModelSpec.from_hf_file(path) == CATALOG[name]  # name from the file stem
    assert get_model(str(path)) == CATALOG[name]


def test_hf_dir_with_config_json_takes_dir_name(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text((HF_DIR / "mixtral-8x7b.json").read_text())
    m = get_model(str(d / "config.json"))
    assert m.name == "my-model"
    assert attrs.evolve(m, name="mixtral-8x7b") == CATALOG["mixtral-8x7b"]
    assert get_model(str(d)) == m


def test_qwen3_dense_config():
    data = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}
    m = ModelSpec.from_hf_config(data, "qwen3-8b")
    assert m.moe is None and m.attention.qk_norm and not m.attention.qkv_bias
    assert m.param_counts().total / 1e9 == pytest.approx(8.2, rel=0.02)


def test_catalog_values_are_frozen():
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        CATALOG["llama-3.1-8b"].n_layers = 1


def test_unknown_model_suggests_close_name():
    with pytest.raises(ConfigError) as e:
        get_model("llama-3.1-8")
    assert e.value.field == "model"
    msg = str(e.value)
    assert "did you mean 'llama-3.1-8b'" in msg and "config.json" in msg and "deepseek-v3" in msg


def test_missing_hf_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        get_model(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        get_model(str(bad))


def _cfg(name):
    return json.loads((HF_DIR / f"{name}.json").read_text())


def test_unsupported_model_type():
    data = dict(_cfg("llama-3.1-8b"), model_type="gpt2")
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(data, "x")
    assert e.value.field == "model_type"
    assert "gpt2" in str(e.value) and "deepseek_v3" in str(e.value) and "qwen3_moe" in str(e.value)
    with pytest.raises(ConfigError, match="model_type"):
        ModelSpec.from_hf_config({k: v for k, v in data.items() if k != "model_type"}, "x")


@pytest.mark.parametrize(
    "name, field",
    [("llama-3.1-8b", "hidden_size"), ("qwen2.5-72b", "num_hidden_layers"),
     ("mixtral-8x7b", "num_local_experts"), ("qwen3-235b-a22b", "moe_intermediate_size"),
     ("deepseek-v3", "kv_lora_rank")],
)
def test_missing_field_is_named(name, field):
    data = {k: v for k, v in _cfg(name).items() if k != field}
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(data, name)
    assert e.value.field == field
    assert "missing" in str(e.value)


@pytest.mark.parametrize("value", [0, -8, "8", 8.5, True])
def test_invalid_field_is_named(value):
    data = dict(_cfg("llama-3.1-70b"), num_key_value_heads=value)
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(data, "x")
    assert e.value.field == "num_key_value_heads"


def test_inconsistent_shapes_are_config_errors():
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(dict(_cfg("llama-3.1-70b"), num_key_value_heads=7), "x")
    assert e.value.field == "num_key_value_heads"
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(dict(_cfg("mixtral-8x7b"), num_experts_per_tok=9), "x")
    assert e.value.field == "num_experts_per_tok"
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(dict(_cfg("qwen3-235b-a22b"), mlp_only_layers=[5]), "x")
    assert e.value.field == "mlp_only_layers"
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(dict(_cfg("deepseek-v3"), tie_word_embeddings="no"), "x")
    assert e.value.field == "tie_word_embeddings"
