"""Trace files: each built-in format (the shipped samples), and bad lines named by file,
line and field."""
from __future__ import annotations

import pathlib

import pytest

from g5core.api.errors import ConfigError
from g5core.serve.traces import TraceError, read_trace

SAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "traces"


def test_the_four_samples_describe_the_same_requests():
    g5 = read_trace(SAMPLES / "sample-g5.jsonl").requests
    azure = read_trace(SAMPLES / "sample-azure.csv").requests
    mooncake = read_trace(SAMPLES / "sample-mooncake.jsonl").requests
    prefixed = read_trace(SAMPLES / "sample-g5.csv").requests
    assert len(g5) == len(azure) == len(mooncake) == len(prefixed) == 40
    for a, b, c, d in zip(g5, azure, mooncake, prefixed):
        assert (a.input_tokens, a.output_tokens) == (b.input_tokens, b.output_tokens) == (c.input_tokens,
                                                                                          c.output_tokens)
        assert b.arrival_s == pytest.approx(a.arrival_s, abs=1e-6)
        assert c.arrival_s == pytest.approx(a.arrival_s, abs=1e-3)      # Mooncake counts milliseconds
        assert d.input_tokens == a.input_tokens + 512 and d.prefix[0][1] == 512
    assert azure[0].arrival_s == 0.0
    assert mooncake[1].prefix[0] == ("mc:0", 512)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name,text,line,field", [
    ("t.csv", "arrival_s,input_tokens,output_tokens\n0,10,5\n0.5,ten,5\n", 3, "input_tokens"),
    ("t.csv", "arrival_s,input_tokens,output_tokens\n0,10,5\n-1,10,5\n", 3, "arrival_s"),
    ("t.csv", "arrival_s,input_tokens,output_tokens\n0,10,0\n", 2, "output_tokens"),
    ("t.csv", "arrival_s,input_tokens,output_tokens\n0,10\n", 2, "columns"),
    ("t.csv", "arrival_s,input_tokens,output_tokens,cached_tokens\n0,10,5,10\n", 2, "cached_tokens"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n2023-13-16 1:1,4,4\n", 3,
     "TIMESTAMP"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 1,\n', 2,
     "json"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 3, "input_length": 2.5, '
                '"output_length": 2}\n', 2, "input_length"),
    ("t.csv", "when,in,out\n0,1,1\n", 1, "columns"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, name, text, line, field):
    p = write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        read_trace(p)
    assert (info.value.line, info.value.field) == (line, field)
    assert str(p) in str(info.value) and f"line {line}" in str(info.value)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(ConfigError, match=r"\.csv or \.jsonl"):
        read_trace(write(tmp_path, "t.txt", "x"))


def test_arrivals_are_sorted_and_given_times_kept(tmp_path):
    p = write(tmp_path, "t.csv", "arrival_s,input_tokens,output_tokens\n5,10,5\n2,20,5\n")
    reqs = read_trace(p).requests
    assert [(r.arrival_s, r.input_tokens, r.id) for r in reqs] == [(2.0, 20, 0), (5.0, 10, 1)]


def test_synthetic_arrivals_and_lengths_follow_their_distributions():
    import numpy as np

    from g5core.serve.workload import synthetic

    def gaps(arrival):
        w = synthetic({"requests": 40_000, "arrival": arrival, "input_tokens": "lognormal:1000:0.5@1:100000",
                       "output_tokens": "hist:10=1,30=3", "seed": 7})
        t = np.array([r.arrival_s for r in w.requests])
        return np.diff(t), w
    g, w = gaps({"kind": "poisson", "rate_per_s": 5})
    assert np.mean(g) == pytest.approx(0.2, rel=0.02) and np.std(g) / np.mean(g) == pytest.approx(1.0, rel=0.03)
    g, _ = gaps({"kind": "gamma", "rate_per_s": 5, "cv": 3})
    assert np.mean(g) == pytest.approx(0.2, rel=0.05) and np.std(g) / np.mean(g) == pytest.approx(3.0, rel=0.05)
    isl = np.array([r.input_tokens for r in w.requests])
    osl = np.array([r.output_tokens for r in w.requests])
    assert np.median(isl) == pytest.approx(1000, rel=0.02)
    assert set(osl) == {10, 30} and np.mean(osl == 30) == pytest.approx(0.75, abs=0.01)
