"""``scripts/check_doc_figures.py``: the figures README.md and DESIGN.md quote come from the
results files, and the check fails when one does not (planted in a temporary copy)."""

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


@pytest.mark.parametrize(("old", "new", "where"), [
    ("| **121.2** |", "| **119.5** |", "azure-conv-b64-llama8b: 119.5"),  # a table cell
    ("4,467 GB/s", "4,471 GB/s", "4,471"),  # a prose figure
])
def test_a_planted_wrong_figure_fails(tmp_path, old, new, where):
    root = _copy(tmp_path)
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert old in readme, "the figure to plant over is no longer in README.md"
    (root / "README.md").write_text(readme.replace(old, new, 1), encoding="utf-8")
    result = _run(root)
    assert result.returncode == 1
    assert where in result.stdout
