"""The support matrix as declared: the version bounds (pyproject.toml, ``import pagedattn``'s
check), README's table and CI's pins name the same Tritons as the version seam, the package
data and license are what the wheel ships, and the lab's tools are found as the seam says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedattn import _env
from pagedattn.launch import _triton_compat as tc

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_below_the_bounds_import_stops_naming_the_version(tmp_path):
    """A triton 3.5.0 installed ahead of the real one (its metadata first on the path): ``import
    pagedattn`` raises one ``ImportError`` that names the version found and the bound."""
    info = tmp_path / "triton-3.5.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.5.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    done = subprocess.run([sys.executable, "-c", "import pagedattn"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: pagedattn needs triton >= 3.6 (found triton 3.5.0): pip install -U "
        "'triton>=3.6'")


def test_version_problem_names_each_low_version():
    assert _env.version_problem("2.13.0+cpu", "3.9.0") is None
    assert _env.version_problem("2.11.0+cu130", "3.6.0") is None
    assert _env.version_problem("2.13.0", None) is None  # no triton: the oracle still imports
    assert _env.version_problem("2.12.0.dev20261101", "3.10.0+git1a2b") is None
    both = _env.version_problem("2.10.0", "3.5.1")
    assert "torch >= 2.11 (found torch 2.10.0)" in both
    assert "triton >= 3.6 (found triton 3.5.1)" in both
    assert _env._release("2.13.0+cpu") == (2, 13, 0) and _env._release("3.6.0rc1") == (3, 6, 0)


def test_pyproject_bounds_are_the_checked_ones():
    deps = dict(re.fullmatch(r"(\w+)>=([\d.]+)", d).groups()
                for d in _project()["project"]["dependencies"])
    assert deps == {"torch": "{}.{}".format(*_env.MIN_TORCH),
                    "triton": "{}.{}".format(*_env.MIN_TRITON)}
    # the lowest Triton declared is the lowest the seam has read
    assert min(tc.LAUNCH_FORMS) == _env.MIN_TRITON


def test_readme_table_and_ci_name_every_read_triton():
    """Each Triton whose internals the seam read has a row in README's support table and a
    pin in ``.ci/run``; the rows that never ran on a GPU say CPU-only."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### What has run where", 1)[1].split("\n\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| 2.")]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for major, minor in tc.LAUNCH_FORMS:
        mine = [r for r in rows if re.search(rf"\b{major}\.{minor}\.\d", r.split("|")[2])]
        assert mine, (major, minor)
        assert re.search(rf"\b{major}\.{minor}\.\d", ci), (major, minor)
        if (major, minor) != (3, 6):
            assert all("CPU-only" in r for r in mine), mine


def test_the_wheel_ships_a_license_and_no_stale_entries():
    """The license is the Apache-2.0 text and pyproject names it; every package-data pattern
    and ruff per-file entry names files that exist (the tuned tables' pattern excepted: the
    launcher reads a GPU's table there once one is written)."""
    project = _project()
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
    package = ROOT / "src" / "pagedattn"
    tables = "launch/tuned/*.json"  # a GPU's tuned table ships once written (test_tuning.py)
    for pattern in project["tool"]["setuptools"]["package-data"]["pagedattn"]:
        assert list(package.glob(pattern)) or pattern == tables, pattern
    for path in project["tool"]["ruff"]["lint"]["per-file-ignores"]:
        assert list(ROOT.glob(path)), path


def test_ptxas_is_tritons_own_then_the_named_then_the_systems(tmp_path, monkeypatch):
    """The ``ptxas`` the lab's scripts run is the one the installed Triton assembles sm_90
    with (3.9: its ``ptxas-blackwell``; the bundled ``ptxas`` refuses 3.9's PTX); where
    Triton has none (a wheel stripped of its tools), ``TRITON_PTXAS_PATH`` when it names a
    file, else one on ``PATH``, else none."""
    own = tc.ptxas(90)
    if own is not None and own.parent.name == "bin" and "triton" in own.parts:
        assert own.name == ("ptxas-blackwell" if tc.VERSION >= (3, 9) else "ptxas")

    def stripped():
        raise RuntimeError("Cannot find ptxas")

    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(fake))
    assert tc._tool("TRITON_PTXAS_PATH", stripped, "ptxas") == fake
    assert tc._tool("TRITON_PTXAS_PATH", lambda: str(own or fake), "ptxas") == (own or fake)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tmp_path / "missing"))
    assert tc._tool("TRITON_PTXAS_PATH", stripped, "ptxas") is None
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tc._tool("TRITON_PTXAS_PATH", stripped, "ptxas") == fake


def test_every_admitted_triton_has_its_sm90_bounds(monkeypatch):
    """The sm_90 register and spill tests hold each Triton that pagedattn admits (the seam's,
    README's table's) to 3.6's bounds or to its own measured counts (``_scripts.SM90_OVER``:
    Triton 3.8, pip's pick for README's command 1, takes 138 registers for the fp8 tile and
    spills in the fp32 token loop); a newer Triton skips them rather than fail."""
    import _scripts

    assert set(_scripts.SM90_OVER) == set(tc.LAUNCH_FORMS)
    monkeypatch.setattr(tc, "VERSION", (3, 6))
    assert _scripts.sm90_bound("plain-fp8", "registers", 128) == 128
    monkeypatch.setattr(tc, "VERSION", (3, 8))
    assert _scripts.sm90_bound("plain-fp8", "registers", 128) == 138
    assert _scripts.sm90_bound("plain-bf16", "registers", 128) == 128  # 3.8 measured 103
    monkeypatch.setattr(tc, "VERSION", (3, 10))
    with pytest.raises(pytest.skip.Exception, match="never measured"):
        _scripts.sm90_bound("plain-fp8", "registers", 128)
