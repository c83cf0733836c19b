"""The run summary's load on each network tier: NVLink, NIC, and the leaf uplink where a
fabric is given, so a user sees what an oversubscribed fabric does."""
from __future__ import annotations

import pytest
import yaml

from g5core.inputs.systems import get_system
from g5core.sim.results import network_load
from g5core.session.run import run

RAW = {"model": "llama-3.1-8b", "chips": 16, "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 2},
       "phase": "prefill", "batch": 1, "seq_len": 16384}


def _system(tmp_path, oversubscription):
    fields = get_system("h100-sxm").to_dict()
    fields.update(name=f"h100-{oversubscription:g}to1", fabric={"nodes_per_leaf": 1, "oversubscription": oversubscription})
    path = tmp_path / f"{fields['name']}.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def test_tiers_and_what_an_oversubscribed_fabric_does(tmp_path):
    flat = run(dict(RAW, system="h100-sxm"))
    tiers = {t["tier"]: t for t in network_load(flat.sim, flat.plan.ctx.topology)}
    assert set(tiers) == {"NVLink", "NIC"}  # no fabric given: no leaf tier
    over = run(dict(RAW, system=_system(tmp_path, 4.0)))
    topo = over.plan.ctx.topology
    tiers4 = {t["tier"]: t for t in network_load(over.sim, topo)}
    assert set(tiers4) == {"NVLink", "NIC", "leaf uplink"}
    for t in tiers4.values():
        cap = topo.capacities()[next(p for p in range(len(topo.capacities())) if topo.resource_name(p) == t["busiest_port"])]
        assert t["utilization"] == pytest.approx(t["busiest_bytes"] / (cap * over.sim.latency_s))
        assert 0 < t["utilization"] <= t["busy_fraction"] + 1e-9 <= 1 + 1e-9
    # the cp ring's node-crossing bytes go through the NICs and, between nodes, the leaf uplinks
    assert tiers4["NIC"]["bytes"] == pytest.approx(tiers["NIC"]["bytes"])
    assert tiers4["leaf uplink"]["bytes"] == pytest.approx(tiers4["NIC"]["bytes"])
    # a 4:1 uplink carries the same bytes at a quarter of the rate: its NICs are busy longer
    assert tiers4["NIC"]["busy_fraction"] > tiers["NIC"]["busy_fraction"]


def test_the_run_summary_prints_the_tiers(tmp_path):
    from click.testing import CliRunner
    from g5core.present.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(dict(RAW, system=_system(tmp_path, 2.0))))
    res = CliRunner().invoke(main, ["run", str(cfg)])
    assert res.exit_code == 0, res.output
    block = res.output.split("network load by tier")[1].splitlines()
    assert [line.split()[0] for line in block[3:6]] == ["NVLink", "NIC", "leaf"]
