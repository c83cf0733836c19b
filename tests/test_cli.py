"""The ``g5`` command line (click CliRunner): models, systems, plugins, explain."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import g5core.api.plugins as plugins_mod
from g5core import hookimpl
from g5core.present.cli import main
from g5core.inputs.models import CATALOG
from g5core.api.plugins import available_plugin_names, make_plugin_manager
from g5core.inputs.systems import CATALOG_NAMES

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_70B_DECODE = REPO / "examples" / "llama-3.1-70b-decode.yaml"

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-72b", "qwen3-235b-a22b", "mixtral-8x7b",
          "deepseek-v3")
SYSTEMS = ("a100-80gb", "b200", "gb200-nvl72", "gb300-nvl72", "gh200-nvl32", "h100-sxm", "h20", "h200", "h800")
BUILTIN = ("collectives", "cp", "cp_passkv", "cp_passq", "dp", "ep", "math_guard", "pp", "roofline", "tp")


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def invoke(*args):
    return _runner().invoke(main, [str(a) for a in args])


def ok(*args):
    result = invoke(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def error_line(*args) -> str:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("g5: error: ")
    return lines[0]


def _table_rows(text: str) -> dict[str, list[str]]:
    """First column -> the other columns, for the rows after the dashed header rule."""
    lines = text.splitlines()
    rule = next(i for i, l in enumerate(lines) if l.startswith("---"))
    rows = {}
    for line in lines[rule + 1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


# ----------------------------------------------------------------------------------------
# Catalogs
# ----------------------------------------------------------------------------------------


def test_models_lists_the_catalog_models():
    rows = _table_rows(ok("models"))
    assert set(MODELS) <= set(rows) == set(CATALOG)
    assert rows["gpt-oss-120b"][-1] == "sliding window 128 on 18 of 36 layers, full on 18"
    assert rows["deepseek-v3"][0] == "mla"
    assert rows["llama-3.1-70b"][0] == "gqa"
    assert rows["llama-3.1-70b"][1] == "80"


def test_systems_lists_the_shipped_systems():
    rows = _table_rows(ok("systems"))
    assert set(rows) == set(SYSTEMS) == set(CATALOG_NAMES)
    assert rows["h100-sxm"][0] == "8"


# ----------------------------------------------------------------------------------------
# Plugins
# ----------------------------------------------------------------------------------------


def _declared_hooks(name: str) -> set[str]:
    """Hooks a built-in plugin implements, read from its module's hookimpl markers."""
    module = make_plugin_manager().get_plugin(name)   # the module its entry point names
    return {attr for attr in dir(module)
            if attr.startswith("g5_") and hasattr(getattr(module, attr), "g5_impl")}


def test_plugins_lists_every_builtin_with_its_hooks():
    rows = _table_rows(ok("plugins"))
    assert set(BUILTIN) <= set(rows)
    assert set(rows) == set(available_plugin_names())
    for name in BUILTIN:
        state, hooks = rows[name]
        assert state == "enabled", name
        expected = _declared_hooks(name)
        assert expected, name
        assert set(hooks.split(", ")) == expected, name


def test_plugins_disable_shows_disabled():
    rows = _table_rows(ok("plugins", "--disable", "tp"))
    assert rows["tp"] == ["disabled", "(not loaded while disabled)"]
    for name in set(BUILTIN) - {"tp"}:
        assert rows[name][0] == "enabled", name


def test_plugins_disable_several():
    rows = _table_rows(ok("plugins", "--disable", "cp_passkv", "--disable", "cp_passq"))
    assert rows["cp_passkv"][0] == rows["cp_passq"][0] == "disabled"
    assert rows["cp"][0] == "enabled"


def test_plugins_disable_unknown():
    line = error_line("plugins", "--disable", "tpp")
    assert "plugin 'tpp'" in line and "did you mean 'tp'" in line


def test_plugins_broken_entry_point_is_one_line(monkeypatch):
    class Broken:
        name, value = "broken", "g5broken.plugin"

        def load(self):
            raise ImportError("No module named 'g5broken'")

    real = plugins_mod._entry_points()
    monkeypatch.setattr(plugins_mod, "_entry_points", lambda: real + [Broken()])
    line = error_line("plugins")
    assert "plugin 'broken': failed to load" in line
    # and disabling it lets the listing through
    rows = _table_rows(ok("plugins", "--disable", "broken"))
    assert rows["broken"][0] == "disabled"


def test_plugins_invalid_hookimpl_from_entry_point_is_one_line(monkeypatch):
    @hookimpl
    def g5_validate_deployment(deployment, colour):
        return None

    class BadArgs:
        name, value = "badargs", "g5badargs.plugin"

        def load(self):
            return SimpleNamespace(g5_validate_deployment=g5_validate_deployment)

    real = plugins_mod._entry_points()
    monkeypatch.setattr(plugins_mod, "_entry_points", lambda: real + [BadArgs()])
    line = error_line("plugins")
    assert "plugin 'badargs'" in line


# ----------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------


def _group_sections(text: str) -> dict[str, tuple[str, list[str]]]:
    """'<dim> groups: ...' header -> (header, member lines)."""
    out = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^(\w+) groups: (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = (m.group(2), [])
        elif current and line.startswith("  "):
            out[current][1].append(line.strip())
        elif not line.strip():
            current = None
    return out


def test_explain_70b_decode_groups_and_node_crossing():
    text = ok("explain", EXAMPLE_70B_DECODE)
    assert "llama-3.1-70b" in text and "h100-sxm" in text
    assert "16 chips on 2 nodes" in text
    sections = _group_sections(text)
    assert {"tp", "pp", "cp", "dp"} <= set(sections)

    head, members = sections["tp"]
    assert head == "2 of 8; all inside one node"
    assert members == ["[0, 1, 2, 3, 4, 5, 6, 7]", "[8, 9, 10, 11, 12, 13, 14, 15]"]

    head, members = sections["pp"]
    assert head == "8 of 2; 8 cross node boundaries"  # the first and last group, and a count between
    assert members == ["[0, 8]  (crosses nodes)", "... 6 more groups (8 of all 8 cross nodes)",
                       "[7, 15]  (crosses nodes)"]

    for dim in ("cp", "dp"):
        head, members = sections[dim]
        assert head == "16 of 1; all inside one node"
        assert members == ["[0]", "... 14 more groups", "[15]"]


def test_explain_with_cp_override_shows_cp_groups_crossing_nodes():
    text = ok("explain", EXAMPLE_70B_DECODE, "--set", "parallel.cp=2", "--set", "chips=32")
    sections = _group_sections(text)
    head, members = sections["cp"]
    assert head == "16 of 2; 16 cross node boundaries"
    # rank order dp, pp, cp, tp: CP neighbours are tp = 8 chips apart, in the next node
    assert members[0] == "[0, 8]  (crosses nodes)"
    assert sections["tp"][0] == "4 of 8; all inside one node"


@pytest.mark.parametrize("value,expected", [
    ("2", "dp=1 x pp=2 x cp=2 x tp=8 = 32, but chips = 16"),
    ("0", "parallel.cp: must be a positive whole number, got 0"),
    ("two", "parallel.cp: must be a positive whole number, got 'two'"),
    ("1.5", "parallel.cp: must be a positive whole number, got 1.5"),
    ("true", "parallel.cp: must be a positive whole number, got True"),
])
def test_explain_bad_cp_override(value, expected):
    line = error_line("explain", EXAMPLE_70B_DECODE, "--set", f"parallel.cp={value}")
    assert expected in line


def test_explain_cp_override_breaking_seq_len():
    line = error_line("explain", EXAMPLE_70B_DECODE, "--set", "parallel.cp=2", "--set", "chips=32",
                      "--set", "seq_len=32770")
    assert "seq_len" in line and "2 x cp = 4" in line


def test_explain_malformed_set():
    line = error_line("explain", EXAMPLE_70B_DECODE, "--set", "parallel.cp")
    assert "--set" in line and "dotted.key=value" in line


def test_explain_disable_tp_with_tp_in_config():
    line = error_line("explain", EXAMPLE_70B_DECODE, "--disable", "tp", "--disable", "ep")
    assert "parallel.tp" in line and "the plugin 'tp' is disabled" in line and "did you mean" not in line


def test_cli_version():
    assert "0.1.0" in ok("--version")


def test_run_as_a_script_every_command_is_registered():
    """``python -m g5core.present.cli`` registers every command before it runs (the
    ``__main__`` guard stands below the last one)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "g5core.present.cli", "--help"], capture_output=True, text=True,
                          check=True)
    listed = {line.split()[0] for line in proc.stdout.split("Commands:")[1].splitlines() if line.strip()}
    from g5core.present.cli import main

    assert listed == set(main.commands) and {"validate", "calibrate"} <= listed
