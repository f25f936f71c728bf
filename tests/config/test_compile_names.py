"""config/ is the bottom layer: `accelrun validate` checks compile.passes and compile.executors from
``accelrun.config.compile_names`` without importing the compiler (or torch), and the compiler's
registries hold exactly the names and option schemas declared there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from accelrun.config import ConfigError
from accelrun.config.compile_names import (
    BUILTIN_EXECUTORS,
    BUILTIN_PASSES,
    PRESETS,
    RematOptions,
    parse_passes,
)

REPO = Path(__file__).resolve().parents[2]

# Runs `accelrun validate` in a fresh interpreter and reports whether torch (or the compiler) got imported.
VALIDATE_AND_REPORT = """
import runpy, sys
sys.argv = ["accelrun", "validate", "configs/llama.yaml", *sys.argv[1:]]
try:
    runpy.run_module("accelrun.cli.main", run_name="__main__")
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "accelrun.compile") if m in sys.modules)
print("EXIT", code, "HEAVY", ",".join(heavy) or "-")
"""


def _validate_in_subprocess(*overrides: str) -> str:
    done = subprocess.run([sys.executable, "-c", VALIDATE_AND_REPORT, *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_validate_checks_compile_names_without_importing_torch():
    ok = _validate_in_subprocess("compile.backend=accelrun", "compile.passes=max",
                                 "compile.executors=[cpp,triton,aten]")
    assert "EXIT 0 HEAVY -" in ok, ok
    bad = _validate_in_subprocess("compile.backend=accelrun", "compile.passes=[dce,{remat: {budget_mbb: 1}}]",
                                  "compile.executors=[cpp,tritn,aten]")
    assert "EXIT 2 HEAVY -" in bad, bad
    assert "option 'budget_mbb': unknown option (did you mean 'budget_mb'?); options of remat:" in bad, bad
    assert "unknown executor 'tritn'" in bad and "did you mean 'triton'" in bad


def test_compiler_registries_match_the_declared_names():
    from accelrun.compile.executors.base import registered_executors
    from accelrun.compile.passes.base import registered_passes

    builtin = {name: spec for name, spec in registered_passes().items() if name in BUILTIN_PASSES}
    assert set(builtin) == set(BUILTIN_PASSES)
    for name, spec in builtin.items():
        assert (spec.stage, spec.options) == BUILTIN_PASSES[name], name
    assert tuple(registered_executors())[:len(BUILTIN_EXECUTORS)] == BUILTIN_EXECUTORS
    for names in PRESETS.values():
        assert set(names) <= set(BUILTIN_PASSES)


def test_compiler_refuses_a_builtin_name_with_other_options():
    from accelrun.compile.passes.base import PassOptions, register_pass

    with pytest.raises(ValueError, match="declared in accelrun.config.compile_names"):
        register_pass("remat", "partition", PassOptions)
    with pytest.raises(ValueError, match="declared in accelrun.config.compile_names"):
        register_pass("remat", "post_grad", RematOptions)


def test_parse_passes_reads_options_and_points_at_the_item():
    (name, options), = parse_passes([{"remat": {"budget_mb": 64}}])
    assert name == "remat" and options == RematOptions(budget_mb=64)
    with pytest.raises(ValueError) as e:
        parse_passes(["dce", "dcee"])
    assert e.value.index == 1 and "did you mean 'dce'" in str(e.value)


def test_validate_error_points_at_the_pass_line(write):
    from accelrun.config import load_config

    path = write("r.yaml", """
        compile:
          backend: accelrun
          passes:
            - dce
            - fuse_atention
        """)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), [])
    assert f"{path}:5" in str(e.value) and "did you mean 'fuse_attention'" in str(e.value)


def test_a_preset_less_some_of_its_passes():
    """``default-remat``: leaving one pass out of a preset took its whole list, written out."""
    from accelrun.config.compile_names import PRESETS, pass_names

    names = [name for name, _ in parse_passes("default-remat-cpu_dropout")]
    assert names == [n for n in PRESETS["default"] if n not in ("remat", "cpu_dropout")]
    assert pass_names("max-remat") == [n for n in PRESETS["max"] if n != "remat"]
    for spec, said in [("default-remt", "did you mean 'remat'"), ("none-remat", "not a pass of the 'none' preset"),
                       ("default-remat-remat", "leaves 'remat' out twice"), ("defalt-remat", "did you mean 'default'")]:
        with pytest.raises(ValueError, match=said):
            parse_passes(spec)
        assert pass_names(spec) == []  # the readers that do not validate: nothing, as for any bad preset
