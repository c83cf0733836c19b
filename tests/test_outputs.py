"""Output files (issue 10): checked before the simulation, atomic, all or none, nothing
clobbered; every refusal is one line with exit status 2."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import g5core.session.run as run_mod
from g5core.inputs import outputs
from g5core.inputs.outputs import OutputError, check_outputs

from test_cli import error_line, invoke

REPO = Path(__file__).resolve().parent.parent
CONFIG_TEXT = (REPO / "examples" / "llama-3.1-8b-prefill.yaml").read_text().replace("seq_len: 32768", "seq_len: 1024")


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG_TEXT)
    return p


@pytest.fixture
def no_simulation(monkeypatch):
    """Fail the test if a refused output would still let the simulation start."""
    def boom(*a, **k):
        raise AssertionError("the simulation started before the output paths were checked")
    monkeypatch.setattr(run_mod, "simulate_plan", boom)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_missing_folder_is_refused_before_the_simulation(cfg, tmp_path, no_simulation):
    line = error_line("run", cfg, "--trace", tmp_path / "nodir" / "t.json")
    assert "--trace" in line and "does not exist" in line


def test_path_under_a_regular_file_is_refused(cfg, tmp_path, no_simulation):
    line = error_line("run", cfg, "--timeline", tmp_path / "c.yaml" / "ops.csv")
    assert "--timeline" in line and "is not a folder" in line


def test_unwritable_folder_is_refused(cfg, no_simulation):
    # /proc takes no new files, for root too (permission bits alone would not tell)
    line = error_line("run", cfg, "--trace", "/proc/g5-trace.json")
    assert "not writable" in line


@pytest.mark.parametrize("special", ["/dev/null", "/dev/full"])
def test_device_is_refused_and_left_alone(cfg, special, no_simulation):
    before = os.stat(special)
    line = error_line("run", cfg, "--trace", special)
    assert "is a device" in line
    after = os.stat(special)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_folder_and_fifo_are_refused(cfg, tmp_path, no_simulation):
    assert "is a folder" in error_line("run", cfg, "--trace", tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "named pipe" in error_line("run", cfg, "--timeline", fifo)


def test_output_equal_to_the_config_is_refused(cfg, no_simulation):
    before = cfg.read_text()
    line = error_line("run", cfg, "--trace", cfg)
    assert "is the input configuration" in line
    assert cfg.read_text() == before


def test_output_linking_to_the_config_is_refused(cfg, tmp_path, no_simulation):
    link = tmp_path / "alias.json"
    link.symlink_to(cfg)
    assert "is the input configuration" in error_line("run", cfg, "--timeline", link)
    hard = tmp_path / "hard.json"
    os.link(cfg, hard)
    assert "is the input configuration" in error_line("run", cfg, "--timeline", hard)
    assert cfg.read_text() == CONFIG_TEXT


def test_output_equal_to_a_system_file_is_refused(tmp_path, no_simulation):
    system = tmp_path / "sys.yaml"
    system.write_text((REPO / "g5core" / "data" / "systems" / "h100-sxm.yaml").read_text())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG_TEXT.replace("system: h100-sxm", f"system: {system}"))
    assert "is the input system file" in error_line("run", cfg, "--trace", system)


def test_two_outputs_on_one_path_are_refused(cfg, tmp_path, no_simulation):
    line = error_line("run", cfg, "--trace", tmp_path / "same", "--timeline", tmp_path / "same")
    assert "also the --trace file" in line
    link = tmp_path / "other"
    link.symlink_to(tmp_path / "same")  # dangling: resolves to the same new file
    line = error_line("run", cfg, "--trace", tmp_path / "same", "--timeline", link)
    assert "also the --trace file" in line
    assert _files(tmp_path) == ["c.yaml", "other"]


def test_writing_through_a_symlink_writes_the_target_and_keeps_the_link(cfg, tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    result = invoke("run", cfg, "--trace", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "traceEvents" in json.loads(target.read_text())
    assert (target.stat().st_mode & 0o777) == 0o640  # an existing file keeps its mode
    assert _files(tmp_path) == ["c.yaml", "link.json", "real.json"]  # no temporary file left


def test_a_failed_write_leaves_that_output_unchanged_writes_the_other_and_still_prints_the_summary(
        cfg, tmp_path, monkeypatch):
    # issue 25: the outputs are independent; each is written atomically on its own
    trace, timeline = tmp_path / "t.json", tmp_path / "ops.csv"
    timeline.write_text("old timeline")

    def full_disk(sim, fh, *system_and_phase):
        fh.write("partial")
        raise OSError(28, "No space left on device")

    import g5core.present.cli as cli_mod   # the CLI's own name for the writer (imported at module level)
    monkeypatch.setattr(cli_mod, "dump_timeline", full_disk)
    result = invoke("run", cfg, "--trace", trace, "--timeline", timeline)
    assert result.exit_code == 2
    assert "TTFT:" in result.stdout and "fits on every chip" in result.stdout
    assert f"trace written to {trace}" in result.stdout and "timeline written" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--timeline" in lines[0] and "No space left" in lines[0]
    assert "--trace was written" in lines[0]
    assert timeline.read_text() == "old timeline"              # the failed one was not replaced
    assert json.loads(trace.read_text())["traceEvents"]        # the other one was written
    assert _files(tmp_path) == ["c.yaml", "ops.csv", "t.json"]  # and no temporary file is left


def test_a_trace_too_large_for_the_disk_still_lets_the_timeline_be_written(cfg, tmp_path, monkeypatch):
    trace, timeline = tmp_path / "t.json", tmp_path / "ops.csv"

    def full_disk(sim, topo, fh, layers=None):
        fh.write('{"traceEvents":[')
        raise OSError(28, "No space left on device")

    import g5core.present.cli as cli_mod   # the CLI's own name for the writer (imported at module level)
    monkeypatch.setattr(cli_mod, "dump_trace", full_disk)
    result = invoke("run", cfg, "--trace", trace, "--timeline", timeline)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("g5: error: --trace: cannot write")
    assert "No space left on device" in lines[0] and "--timeline was written" in lines[0]
    assert "Traceback" not in result.output
    assert timeline.read_text().startswith("key,kind,name")
    assert not trace.exists() and _files(tmp_path) == ["c.yaml", "ops.csv"]
    assert f"per-op timeline written to {timeline}" in result.stdout and "trace written" not in result.stdout


def test_both_outputs_written_on_success(cfg, tmp_path):
    trace, timeline = tmp_path / "t.json", tmp_path / "ops.csv"
    result = invoke("run", cfg, "--trace", trace, "--timeline", timeline)
    assert result.exit_code == 0, result.output
    assert json.loads(trace.read_text())["traceEvents"]
    assert timeline.read_text().startswith("key,kind,name")
    assert f"trace written to {trace}" in result.stdout


def test_math_path_with_trace_is_refused_before_running(cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(run_mod, "math_estimate", lambda *a: pytest.fail("ran the Math path"))
    line = error_line("run", cfg, "--set", "path=math", "--trace", tmp_path / "t.json")
    assert "need the G5 path" in line
    assert _files(tmp_path) == ["c.yaml"]


def test_check_outputs_api_for_other_commands(tmp_path):
    db = tmp_path / "scan.db"
    targets = check_outputs({"--db": db, "--unused": None})
    assert targets.path("--db") == str(db) and targets.path("--unused") is None
    targets.write({"--db": lambda fh: fh.write("x")})
    assert db.read_text() == "x"
    with pytest.raises(OutputError, match="--out: empty path"):
        check_outputs({"--out": ""})
    outputs.write_atomically(tmp_path / "one.txt", lambda fh: fh.write("y"))
    assert (tmp_path / "one.txt").read_text() == "y"
