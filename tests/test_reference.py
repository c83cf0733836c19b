"""The numerical reference: four ways to compute causal attention agree, and the merge is a
commutative monoid, so pass-KV and pass-Q may merge partials in any order and grouping."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from g5core.testing import reference as R

TOL = 1e-9


def qkv(seed, seq, heads, kv_heads, d_qk=8, d_v=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((seq, heads, d_qk)), rng.standard_normal((seq, kv_heads, d_qk)),
            rng.standard_normal((seq, kv_heads, d_v)))


def naive(q, k, v):
    """Textbook softmax(QK^T / sqrt(d) + causal mask) V, one query at a time."""
    seq, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros((seq, heads, v.shape[2]))
    for t in range(seq):
        for h in range(heads):
            s = k[: t + 1, h // group] @ q[t, h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[: t + 1, h // group]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_monolithic_matches_the_textbook_formula(heads, kv_heads):
    q, k, v = qkv(0, 12, heads, kv_heads)
    assert np.max(np.abs(R.causal_attention(q, k, v) - naive(q, k, v))) < TOL


@pytest.mark.parametrize("cp,seq,heads,kv_heads", [(2, 16, 4, 2), (4, 32, 8, 2), (3, 24, 4, 4)])
def test_passkv_ring_with_balanced_chunks_matches(cp, seq, heads, kv_heads):
    q, k, v = qkv(cp, seq, heads, kv_heads)
    assert np.max(np.abs(R.passkv_ring(q, k, v, cp) - R.causal_attention(q, k, v))) < TOL


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_balanced_chunks_give_every_rank_the_same_work_in_every_ring_step(cp):
    """The spec's F_step = F_attn / cp^2: off the diagonal step every rank computes exactly
    (S^2 / 2) / cp^2 causal pairs; step 0 adds the diagonal's S / (2 cp)."""
    seq = 2 * cp * 5
    pairs = R.ring_step_pairs(seq, cp)
    c = seq // (2 * cp)
    assert (pairs[:, 1:] == seq * seq // 2 // (cp * cp)).all()
    assert (pairs[:, 0] == seq * seq // 2 // (cp * cp) + c).all()
    assert pairs.sum() == seq * (seq + 1) // 2


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 2), (4, 8, 1), (5, 4, 4)])
def test_passq_partials_merge_to_the_last_row(cp, heads, kv_heads):
    q, k, v = qkv(7, 20, heads, kv_heads)
    full = R.causal_attention(q, k, v)[-1:]
    assert np.max(np.abs(R.passq_decode(q[-1:], k, v, cp) - full)) < TOL


@pytest.mark.parametrize("sp,heads,kv_heads", [(2, 4, 4), (4, 8, 8), (4, 8, 2), (4, 8, 1), (2, 8, 1)])
def test_ulysses_head_sharding_matches(sp, heads, kv_heads):
    q, k, v = qkv(sp, 16, heads, kv_heads)
    out, _ = R.ulysses_attention(q, k, v, sp)
    assert np.max(np.abs(out - R.causal_attention(q, k, v))) < TOL


def test_four_ways_agree_on_one_input():
    q, k, v = qkv(42, 32, 8, 2)
    a = R.causal_attention(q, k, v)
    b = R.passkv_ring(q, k, v, 4)
    c = np.concatenate([R.passq_decode(q[t:t + 1], k[: t + 1], v[: t + 1], 2) for t in range(1, 32)])
    d, _ = R.ulysses_attention(q, k, v, 4)
    for other in (b, d):
        assert np.max(np.abs(a - other)) < TOL
    assert np.max(np.abs(a[1:] - c)) < TOL


# ---------------------------------------------------------------------- the merge, as algebra


def _parts(seed, n, heads=3, d_v=4, queries=2):
    """Partials of the same queries over ``n`` disjoint key sets (some may see no key)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((queries, heads, 5)) * 3
    k = rng.standard_normal((4 * n, heads, 5)) * 3
    v = rng.standard_normal((4 * n, heads, d_v))
    pos_q = np.array([2 * n, 4 * n - 1])[:queries]
    keys = np.array_split(rng.permutation(4 * n), n)
    return [R.partial_attention(q, k[s], v[s], pos_q, s) for s in keys], R.partial_attention(
        q, k, v, pos_q, np.arange(4 * n))


def _close(a: R.Partial, b: R.Partial) -> bool:
    return np.max(np.abs(a.result() - b.result())) < TOL and np.array_equal(a.m, b.m)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31), n=st.integers(2, 6), data=st.data())
def test_merge_is_associative_and_order_independent(seed, n, data):
    parts, whole = _parts(seed, n)
    order = data.draw(st.permutations(range(n)))
    shuffled = [parts[i] for i in order]
    assert _close(R.merge_all(shuffled), whole)
    # any grouping: merge a random split point's halves separately, then together
    cut = data.draw(st.integers(1, n - 1))
    assert _close(R.merge(R.merge_all(shuffled[:cut]), R.merge_all(shuffled[cut:])), whole)
    a, b, c = parts[0], parts[1], R.merge_all(parts[2:]) if n > 2 else parts[1]
    assert _close(R.merge(R.merge(a, b), c), R.merge(a, R.merge(b, c)))
    assert _close(R.merge(a, b), R.merge(b, a))


def test_a_partial_that_saw_no_key_is_the_identity():
    parts, _ = _parts(3, 2)
    empty = R.partial_attention(np.ones((2, 3, 5)), np.ones((0, 3, 5)), np.ones((0, 3, 4)),
                                np.array([0, 1]), np.array([], dtype=int))
    merged = R.merge(parts[0], empty)
    assert np.array_equal(merged.m, parts[0].m) and np.array_equal(merged.o, parts[0].o)


def test_all_three_quantities_are_needed():
    """Without the denominators (averaging normalised outputs) the answer is wrong. Without
    the maxima (rescaling numerators by exp(m) directly) it is right in exact arithmetic but
    overflows once scores reach ~710: float64 needs the max to stay in range."""
    parts, whole = _parts(11, 3)
    no_l = sum(p.result() for p in parts) / len(parts)
    assert np.max(np.abs(no_l - whole.result())) > 1e-3
    big = [R.Partial(m=p.m + 800.0, l=p.l, o=p.o) for p in parts]
    with np.errstate(over="ignore", invalid="ignore"):
        no_max = sum(p.o * np.exp(p.m)[..., None] for p in big) / sum(p.l * np.exp(p.m) for p in big)[..., None]
    assert not np.isfinite(no_max).all()
    assert np.max(np.abs(R.merge_all(big).result() - whole.result())) < TOL


# ------------------------------------------------------------- what a pass-Q partial carries


def test_gqa_partial_carries_heads_times_head_dim_plus_two_per_head():
    heads, kv_heads, d = 8, 2, 16
    q, k, v = qkv(1, 24, heads, kv_heads, d_qk=d, d_v=d)
    part = R.passq_partials(q[-1:], k, v, 3)[0]
    assert part.elements_per_query() == heads * d + 2 * heads == R.passq_reduce_elements(heads, d)


def test_mla_partial_can_be_up_projected_before_the_merge():
    """Absorbed MLA attends every head to one latent of width r: a raw partial carries
    ``H * r + 2 H`` numbers. ``W_UV`` is linear per head, so each rank may up-project its
    numerator to ``v_head_dim`` first: merging up-projected partials equals up-projecting the
    merged one. The minimum a partial carries is ``H * v_head_dim + 2 H``, which is not the
    hidden size (the old ``d + 2 n_h`` reading)."""
    rng = np.random.default_rng(5)
    heads, r, dr, d_nope, d_v, seq, cp = 4, 12, 3, 5, 7, 18, 3
    latent, k_rope = rng.standard_normal((seq, r)), rng.standard_normal((seq, dr))
    h_q, q_rope = rng.standard_normal((1, heads, d_nope)), rng.standard_normal((1, heads, dr))
    w_uk, w_uv = rng.standard_normal((heads, d_nope, r)), rng.standard_normal((heads, r, d_v))
    q, k, v = R.mla_absorbed_qkv(h_q, latent, k_rope, w_uk, q_rope)
    scale = 1.0 / np.sqrt(d_nope + dr)
    # the reference MLA: decompressed keys and values per head
    k_full = np.concatenate([np.einsum("sr,hnr->shn", latent, w_uk), np.repeat(k_rope[:, None], heads, 1)], axis=2)
    v_full = np.einsum("sr,hrd->shd", latent, w_uv)
    q_full = np.concatenate([h_q, q_rope], axis=2)
    want = R.partial_attention(q_full, k_full, v_full, np.array([seq - 1]), np.arange(seq), scale).result()

    parts = R.passq_partials(q, k, v, cp, scale)
    assert parts[0].elements_per_query() == heads * r + 2 * heads
    latent_merged = R.up_project(R.merge_all(parts), w_uv).result()
    projected = [R.up_project(p, w_uv) for p in parts]
    assert projected[0].elements_per_query() == R.passq_reduce_elements(heads, d_v)
    assert np.max(np.abs(latent_merged - want)) < TOL
    assert np.max(np.abs(R.merge_all(projected).result() - want)) < TOL


# ----------------------------------------------------------------------- Ulysses' byte counts


@pytest.mark.parametrize("sp,heads,kv_heads", [(4, 8, 8), (4, 8, 2), (2, 8, 2), (4, 8, 1)])
def test_ulysses_all_to_all_elements_follow_the_formula(sp, heads, kv_heads):
    """Each rank sends (sp-1)/sp of its local tensor: ``(S/sp) * heads * d * (sp-1)/sp`` for Q
    and the output; K and V carry the KV heads each destination holds (GQA shrinks them;
    replication when kv_heads < sp sends one head to each destination)."""
    seq, d_qk, d_v = 16, 8, 6
    q, k, v = qkv(9, seq, heads, kv_heads, d_qk, d_v)
    _, sent = R.ulysses_attention(q, k, v, sp)
    local = seq // sp
    assert sent["q"] == local * heads * d_qk * (sp - 1) // sp
    assert sent["out"] == local * heads * d_v * (sp - 1) // sp
    kv_per_dst = max(kv_heads // sp, 1)
    assert sent["k"] == local * kv_per_dst * d_qk * (sp - 1)
    assert sent["v"] == local * kv_per_dst * d_v * (sp - 1)
    if kv_heads == heads:   # MHA: about 4 N h / P per rank in all (Q, K, V in, output back), in rows of one head
        rows = sent["q"] / d_qk + sent["k"] / d_qk + sent["v"] / d_v + sent["out"] / d_v
        assert rows == 4 * seq * heads / sp * (sp - 1) / sp
