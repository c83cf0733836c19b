"""Rank map properties over many layouts (hypothesis), with dimensions from the real plugins."""
from __future__ import annotations

import pytest

from plugin_sets import builtin_plugin_manager
from hypothesis import given, settings
from hypothesis import strategies as st

from g5core.api.dimensions import collect_dimensions
from g5core.api.plugins import Hooks
from g5core.lower.rankmap import RankMap

FACTORS = ("dp", "pp", "cp", "tp")  # rank order of the built-in plugins, outermost first


@pytest.fixture(scope="module")
def dims():
    return collect_dimensions(Hooks(builtin_plugin_manager()))


@st.composite
def layouts(draw):
    sizes = {
        "dp": draw(st.integers(1, 3)),
        "pp": draw(st.integers(1, 3)),
        "cp": draw(st.integers(1, 4)),
        "tp": draw(st.sampled_from([1, 2, 3, 4, 8])),
    }
    space = sizes["dp"] * sizes["tp"]
    sizes["ep"] = draw(st.sampled_from([d for d in range(1, space + 1) if space % d == 0]))
    chips_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    return sizes, chips_per_node


def _chips(sizes):
    n = 1
    for name in FACTORS:
        n *= sizes[name]
    return n


def test_registry_from_plugins(dims):
    assert tuple(d.name for d in dims.factors) == FACTORS
    ep = dims.get("ep")
    assert not ep.factor and set(ep.regroups) == {"dp", "sp", "tp"}


LAYOUT_SETTINGS = settings(max_examples=60, deadline=None)


@LAYOUT_SETTINGS
@given(layouts())
def test_groups_partition_the_chips(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    chips = _chips(sizes)
    assert rm.chips == chips
    assert set(rm.dims) == {"dp", "pp", "cp", "tp", "ep"}
    for dim in rm.dims:
        groups = rm.groups(dim)
        members = sorted(c for g in groups for c in g)
        assert members == list(range(chips)), dim
        assert {len(g) for g in groups} == {sizes[dim]}, dim
        assert len(groups) == chips // sizes[dim]
        assert rm.size(dim) == sizes[dim]
        for g in groups:
            assert list(g) == sorted(g)
            for r, c in enumerate(g):
                assert rm.group_of(dim, c) == g
                assert rm.rank_in(dim, c) == r


@LAYOUT_SETTINGS
@given(layouts())
def test_coords_round_trip(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    seen = set()
    for chip in range(rm.chips):
        co = rm.coords(chip)
        assert set(co) == set(FACTORS)
        assert all(0 <= co[n] < sizes[n] for n in FACTORS)
        assert rm.chip_of(**co) == chip
        # independent closed form: mixed radix dp, pp, cp, tp (tp fastest)
        expect = ((co["dp"] * sizes["pp"] + co["pp"]) * sizes["cp"] + co["cp"]) * sizes["tp"] + co["tp"]
        assert expect == chip
        seen.add(tuple(co[n] for n in FACTORS))
    assert len(seen) == rm.chips
    with pytest.raises(IndexError):
        rm.coords(rm.chips)
    with pytest.raises(IndexError):
        rm.chip_of(tp=sizes["tp"])


@LAYOUT_SETTINGS
@given(layouts())
def test_factor_group_is_chips_sharing_the_other_coords(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    for dim in FACTORS:
        others = [n for n in FACTORS if n != dim]
        for g in rm.groups(dim):
            cos = [rm.coords(c) for c in g]
            assert len({tuple(co[n] for n in others) for co in cos}) == 1
            assert [co[dim] for co in cos] == list(range(sizes[dim]))
        # and every chip with the same other coords is in the group
        by_key: dict[tuple, list[int]] = {}
        for chip in range(rm.chips):
            by_key.setdefault(tuple(rm.coords(chip)[n] for n in others), []).append(chip)
        for same in by_key.values():
            for chip in same:
                assert rm.group_of(dim, chip) == tuple(same)


@LAYOUT_SETTINGS
@given(layouts())
def test_cp_group_shares_dp_pp_tp(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    for g in rm.groups("cp"):
        keys = {(rm.coords(c)["dp"], rm.coords(c)["pp"], rm.coords(c)["tp"]) for c in g}
        assert len(keys) == 1
        assert len(g) == sizes["cp"]
        # consecutive CP ranks are tp chips apart
        assert all(b - a == sizes["tp"] for a, b in zip(g, g[1:]))


@LAYOUT_SETTINGS
@given(layouts())
def test_tp_groups_consecutive_and_inside_a_node(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    tp = sizes["tp"]
    for g in rm.groups("tp"):
        assert g == tuple(range(g[0], g[0] + tp))
        assert g[0] % tp == 0
        if tp <= cpn and cpn % tp == 0:
            assert not rm.crosses_nodes(g)
            assert len({rm.node_of(c) for c in g}) == 1
        if tp > cpn:
            assert rm.crosses_nodes(g)


@LAYOUT_SETTINGS
@given(layouts())
def test_ep_groups_inside_dp_tp_of_one_pp_cp(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    ep = sizes["ep"]
    for g in rm.groups("ep"):
        assert len(g) == ep
        assert len({(rm.coords(c)["pp"], rm.coords(c)["cp"]) for c in g}) == 1
    # the EP groups at one (pp, cp) coordinate cover exactly its dp x tp chips
    by_pp_cp: dict[tuple, set] = {}
    for g in rm.groups("ep"):
        co = rm.coords(g[0])
        by_pp_cp.setdefault((co["pp"], co["cp"]), set()).update(g)
    assert len(by_pp_cp) == sizes["pp"] * sizes["cp"]
    for (pp, cp), chips in by_pp_cp.items():
        expect = {rm.chip_of(dp=d, pp=pp, cp=cp, tp=t) for d in range(sizes["dp"]) for t in range(sizes["tp"])}
        assert chips == expect


@LAYOUT_SETTINGS
@given(layouts())
def test_nodes(dims, layout):
    sizes, cpn = layout
    rm = RankMap.build(sizes, dims, cpn)
    assert rm.nodes == -(-rm.chips // cpn)
    for chip in range(rm.chips):
        assert rm.node_of(chip) == chip // cpn
    for dim in rm.dims:
        for g in rm.groups(dim):
            assert rm.crosses_nodes(g) == (len({c // cpn for c in g}) > 1)


def test_ep_not_dividing_dp_tp_is_rejected(dims):
    with pytest.raises(ValueError, match="ep=3"):
        RankMap.build({"dp": 2, "pp": 1, "cp": 1, "tp": 2, "ep": 3}, dims, 8)


def test_unregistered_dimension_has_singleton_groups(dims):
    rm = RankMap.build({"dp": 1, "pp": 1, "cp": 2, "tp": 2}, dims, 8)
    assert rm.groups("sp") == tuple((c,) for c in range(4))
    assert rm.group_of("sp", 3) == (3,)


def test_known_layout_70b_decode(dims):
    # the shipped example: tp=8 in a node, pp=2 across two nodes
    rm = RankMap.build({"dp": 1, "pp": 2, "cp": 1, "tp": 8}, dims, 8)
    assert rm.groups("tp") == (tuple(range(8)), tuple(range(8, 16)))
    assert rm.groups("pp") == tuple((c, c + 8) for c in range(8))
    assert all(rm.crosses_nodes(g) for g in rm.groups("pp"))
    assert not any(rm.crosses_nodes(g) for g in rm.groups("tp"))
