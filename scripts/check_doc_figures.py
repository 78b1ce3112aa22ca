"""Check that the figures README.md, DESIGN.md and docs/ quote come from the results files.

Two kinds of quoted figure:

* **Results table rows** (README's ``## Results`` table): every number in a row's cells must
  appear, as printed (thousands separators ignored), in a row of ``docs/results/bench-<gpu>.md``
  (the run's full table) that starts with the same shape name; ``<gpu>`` comes from the
  section's heading (``## Results (NVIDIA H100, ...)``: ``h100``; ``h200`` if it names none).
* **Prose figures**: in README.md, DESIGN.md and the pages of ``PROSE_DOCS``, every number followed
  by a unit (``µs``, ``GB/s``, ``tokens/s``, ``×``) must match some number in a file under
  ``docs/results/`` (not counting ``bench-runs.csv``, the lines of past runs) once that
  number is rounded to the figure's printed precision (1,349 tokens/s matches 1348.95 in a
  JSON record).

Usage: ``python scripts/check_doc_figures.py [--root DIR]``. Prints each figure without a
source and exits 1 if there is one, else prints a one-line summary and exits 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

NUMBER = r"\d[\d,]*(?:\.\d+)?"
UNIT_FIGURE = re.compile(rf"({NUMBER})\s*(?:µs|us\b|GB/s|tokens/s|×)")
RESULT_SUFFIXES = {".md", ".csv", ".json", ".log", ".txt"}
#: every past run, one line per row: a figure of an older run is no source for the docs
HISTORY_FILES = {"bench-runs.csv"}
#: the pages under docs/ that quote results (perf-notes keeps every run's figures, past ones
#: included, so it is no quote of the current pages)
PROSE_DOCS = ("usage.md", "compat.md", "models.md")


def _plain(number: str) -> str:
    return number.replace(",", "")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading...`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1) if match else ""


def _table_rows(text: str) -> list[list[str]]:
    """Data rows of the markdown tables in ``text`` (header and rule rows dropped)."""
    rows = []
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        is_rule = all(set(c) <= set("-: ") for c in cells)
        next_is_rule = i + 1 < len(lines) and lines[i + 1].startswith("|") and all(
            set(c.strip()) <= set("-: ") for c in lines[i + 1].strip("|").split("|"))
        if not is_rule and not next_is_rule:  # a header row is followed by the rule row
            rows.append(cells)
    return rows


def _shape(cell: str) -> str:
    return cell.replace("*", "").split(" (")[0].strip()


def check_table(readme: str, bench_md: str) -> tuple[list[str], int]:
    """Problems in README's results table against the bench table's rows; figures checked."""
    by_shape: dict[str, set[str]] = {}
    for cells in _table_rows(bench_md):
        by_shape.setdefault(_shape(cells[0]), set()).update(
            _plain(n) for c in cells[1:] for n in re.findall(NUMBER, c))
    problems, count = [], 0
    for cells in _table_rows(_section(readme, "Results")):
        shape = _shape(cells[0])
        source = by_shape.get(shape)
        if source is None:
            problems.append(f"README results table: shape {shape!r} has no row in the bench table")
            continue
        for cell in cells[1:]:
            for number in re.findall(NUMBER, cell.replace("*", "")):
                count += 1
                if _plain(number) not in source:
                    problems.append(f"README results table, {shape}: {number} is in no row of "
                                    f"{shape} in the bench table")
    return problems, count


def _result_numbers(results_dir: Path) -> list[float]:
    numbers = []
    for path in sorted(results_dir.glob("*")):  # the current files: not an A/B's subfolder
        if path.is_file() and path.suffix in RESULT_SUFFIXES and path.name not in HISTORY_FILES:
            text = path.read_text(encoding="utf-8", errors="replace")
            numbers.extend(float(_plain(n)) for n in re.findall(NUMBER, text))
    return numbers


def _matches(figure: str, numbers: list[float]) -> bool:
    plain = _plain(figure)
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    value = float(plain)
    return any(round(x, decimals) == value for x in numbers)


def check_prose(name: str, text: str, numbers: list[float]) -> tuple[list[str], int]:
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    problems, count = [], 0
    for figure in UNIT_FIGURE.findall(prose):
        count += 1
        if not _matches(figure, numbers):
            problems.append(f"{name}: the figure {figure} matches no number under docs/results/")
    return problems, count


def results_gpu(readme: str) -> str:
    """The GPU slug of README's results table, from its heading (``h200`` if it names none)."""
    match = re.search(r"^## Results \(NVIDIA (H\d+)", readme, re.M)
    return match.group(1).lower() if match else "h200"


def check(root: Path) -> tuple[list[str], int]:
    readme = (root / "README.md").read_text(encoding="utf-8")
    design = (root / "DESIGN.md").read_text(encoding="utf-8")
    results = root / "docs" / "results"
    bench_md = results / f"bench-{results_gpu(readme)}.md"
    problems, count = check_table(readme, bench_md.read_text(encoding="utf-8"))
    numbers = _result_numbers(results)
    prose = [("README.md", readme), ("DESIGN.md", design)]
    prose += [(f"docs/{doc}", (root / "docs" / doc).read_text(encoding="utf-8"))
              for doc in PROSE_DOCS if (root / "docs" / doc).is_file()]
    for name, text in prose:
        more, n = check_prose(name, text, numbers)
        problems += more
        count += n
    return problems, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    problems, count = check(args.root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} of {count} quoted figures have no source", file=sys.stderr)
        return 1
    print(f"ok: {count} quoted figures found in docs/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
