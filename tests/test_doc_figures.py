"""``scripts/check_doc_figures.py``: the figures README.md and DESIGN.md quote come from the
results files, and the check fails when one does not (planted in a temporary copy)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_doc_figures.py"


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    for name in ("README.md", "DESIGN.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def test_quoted_figures_have_a_source():
    result = _run(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    count = int(result.stdout.split("ok: ")[1].split()[0])
    assert count >= 30  # the table's rows and the prose figures were found


def _first_table_figure(readme: str) -> tuple[str, str, str]:
    """``(old cell, planted cell, expected message)`` for the first number of the README
    results table's first data row."""
    rows = [line for line in readme.split("## Results", 1)[1].splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]
    shape, cell = (c.strip() for c in rows[1].strip("|").split("|")[:2])  # rows[0]: header
    number = re.search(r"\d[\d,]*\.\d+", cell).group(0)
    planted = f"{float(number.replace(',', '')) + 0.7:.1f}"
    where = f"{shape.split(' (')[0]}: {planted}"
    return f"| {cell} |", f"| {cell.replace(number, planted)} |", where


def _first_prose_figure(readme: str) -> tuple[str, str, str]:
    """The same for the first ``GB/s`` figure of the Results prose."""
    number = re.search(r"(\d[\d,]*) GB/s", readme.split("## Results", 1)[1]).group(1)
    planted = f"{int(number.replace(',', '')) + 7:,}"
    return f"{number} GB/s", f"{planted} GB/s", planted


@pytest.mark.parametrize("pick", [_first_table_figure, _first_prose_figure],
                         ids=["table-cell", "prose-figure"])
def test_a_planted_wrong_figure_fails(tmp_path, pick):
    root = _copy(tmp_path)
    readme = (root / "README.md").read_text(encoding="utf-8")
    old, new, where = pick(readme)
    assert old in readme
    (root / "README.md").write_text(readme.replace(old, new, 1), encoding="utf-8")
    result = _run(root)
    assert result.returncode == 1, result.stdout
    assert where in result.stdout


def test_a_figure_of_an_older_run_is_no_source(tmp_path):
    """A figure only the runs CSV holds (an older run's time) does not pass as a source: the
    docs quote the current pages."""
    root = _copy(tmp_path)
    readme = (root / "README.md").read_text(encoding="utf-8")
    old, _, _ = _first_prose_figure(readme)
    with (root / "docs" / "results" / "bench-runs.csv").open("a", encoding="utf-8") as f:
        f.write("0000000,2026-01-01,NVIDIA H200,,,old,auto,bf16,bf16,one,9876.54,,,,,,,,,,ok,old\n")
    (root / "README.md").write_text(readme.replace(old, "9,877 GB/s", 1), encoding="utf-8")
    result = _run(root)
    assert result.returncode == 1 and "9,877" in result.stdout
