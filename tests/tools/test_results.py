"""``scripts/results.py``: a harness run appended to the runs CSV (a fake run written by the
harness's own report functions, on the CPU), and the current page and README's Results table
regenerated from the committed results files. ``scripts/check_doc_figures.py``: the figures
README.md and DESIGN.md quote come from the results files, and the check fails when one does
not (planted in a temporary copy)."""

from __future__ import annotations

import csv
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedattn.bench import report

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results.py"
CHECK = ROOT / "scripts" / "check_doc_figures.py"
_spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)
_fspec = importlib.util.spec_from_file_location("check_doc_figures_script", CHECK)
figures = importlib.util.module_from_spec(_fspec)
_fspec.loader.exec_module(figures)


def _fake_run(commit: str, date: str) -> list[dict]:
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
            "git_commit": commit, "src_dirty": "unknown", "date": date}
    rows = []
    for shape, us in (("llama8b-b64-c2k", 143.912), ("ragged-b64-llama8b", 157.03)):
        for impl, scale in (("auto", 1.0), ("floor", 0.99)):
            rows.append({"shape": shape, "impl": impl, "kind": "ours" if impl == "auto" else
                         "peer", "dtype": "bfloat16", "cache_dtype": "bfloat16", "batch": 64,
                         "median_us": us * scale, "graph_median_us": us * scale - 0.6,
                         "gbps": 3738.41, "pct_roofline": 83.71, "roofline_gbps": 4466.33,
                         "rel_l2_error": 2.25e-3, "status": "ok", **meta})
    return rows


def _lines(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_run_appends_once(tmp_path):
    bench = report.write_csv(_fake_run("a" * 40, "2026-12-02T10:01:29+00:00"),
                             tmp_path / "bench-h200.csv")
    runs = tmp_path / "bench-runs.csv"
    rc = subprocess.run([sys.executable, str(SCRIPT), "append", str(bench), "--runs", str(runs),
                         "--source", "out/bench"], capture_output=True, text=True, timeout=60)
    assert rc.returncode == 0, rc.stderr
    lines = _lines(runs)
    assert list(lines[0]) == list(results.RUN_COLUMNS)
    assert [(r["shape"], r["impl"]) for r in lines] == [
        ("llama8b-b64-c2k", "auto"), ("llama8b-b64-c2k", "floor"),
        ("ragged-b64-llama8b", "auto"), ("ragged-b64-llama8b", "floor")]
    first = lines[0]
    assert first["commit"] == "a" * 40 and first["gpu"] == "NVIDIA H200"
    assert first["median_us"] == "143.91" and first["graph_median_us"] == "143.31"
    assert first["rel_l2_error"] == "2.250e-03" and first["source"] == "out/bench"
    # the same run again adds nothing; a later run of the same commit adds its four rows
    rows, meta = results.read_bench(bench)
    assert results.append_runs(rows, runs, meta) == 0
    later = _fake_run("a" * 40, "2026-12-03T08:00:00+00:00")
    assert results.append_runs(later, runs) == 4
    assert len(_lines(runs)) == 8


def test_a_run_without_a_commit_takes_the_given_one(tmp_path):
    runs = tmp_path / "runs.csv"
    doc = tmp_path / "bench.json"
    report.write_json(_fake_run("unknown", "2026-12-02T10:00:00+00:00"), {}, doc)
    rows, meta = results.read_bench(doc)
    assert results.append_runs(rows, runs, meta, commit="718df37") == 4
    assert {r["commit"] for r in _lines(runs)} == {"718df37"}


def test_what_is_not_a_run_is_refused(tmp_path):
    page = tmp_path / "bench.md"
    page.write_text("# pagedattn benchmark\n")
    rc = subprocess.run([sys.executable, str(SCRIPT), "append", str(page), "--runs",
                         str(tmp_path / "runs.csv")], capture_output=True, text=True, timeout=60)
    assert rc.returncode == 2 and "not a bench CSV or JSON" in rc.stderr
    assert not (tmp_path / "runs.csv").exists()
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        results.append_runs(_fake_run("b" * 40, "d"), other)
    untimed = [{**r, "median_us": None, "graph_median_us": None} for r in _fake_run("c", "d")]
    with pytest.raises(ValueError, match="nothing was timed"):
        results.append_runs(untimed, tmp_path / "runs.csv")
    assert not (tmp_path / "runs.csv").exists()


def _clean_run(commit: str, date: str) -> list[dict]:
    """A run timed after the clean flush: the yardstick's columns filled."""
    rows = _fake_run(commit, date)
    for r in rows:
        r.update(flush="clean", dirty_median_us=r["median_us"] + 7.9, limit_us=120.4,
                 pct_limit=100 * 120.4 / r["median_us"],
                 graph_pct_limit=100 * 120.4 / r["graph_median_us"],
                 step_us_per_layer=r["median_us"] - 3.1, step_layers=32, step_caches=32,
                 to_beat_us=143.912 * 0.99, to_beat_peer="floor", graph_to_beat_us=142.0,
                 graph_to_beat_peer="floor", graph_pct_roofline=84.2)
    return rows


def test_an_older_runs_csv_takes_the_new_columns(tmp_path):
    """A runs CSV of the header before the yardstick: rewritten with the new columns, its
    lines kept with those cells empty; a clean run's lines fill them."""
    old_header = results.RUN_COLUMNS[:results.RUN_COLUMNS.index("flush")]
    runs = tmp_path / "runs.csv"
    with runs.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_header)
        writer.writeheader()
        writer.writerow({**{k: "" for k in old_header}, "commit": "0a80df7", "shape": "s",
                         "impl": "auto", "median_us": "281.60", "status": "ok"})
    assert results.append_runs(_clean_run("d" * 40, "2026-12-06T00:00:00+00:00"), runs) == 4
    lines = _lines(runs)
    assert list(lines[0]) == list(results.RUN_COLUMNS) and len(lines) == 5
    assert lines[0]["median_us"] == "281.60" and lines[0]["flush"] == lines[0]["limit_us"] == ""
    new = lines[1]
    assert (new["flush"], new["limit_us"], new["step_layers"]) == ("clean", "120.40", "32")
    assert new["dirty_median_us"] == "151.81" and new["pct_limit"] == "83.66"
    assert results.upgrade_runs(runs) is False  # already current


def test_the_pages_put_a_clean_run_in_its_columns(tmp_path):
    """README's table and the page of a clean run: the clean and dirty columns, the limit,
    % of it, the step per layer; a run without a flush (every run before) has its times in
    the dirty column (the committed page: see the test above)."""
    rows = _clean_run("e" * 40, "2026-12-06T00:00:00+00:00")
    report.write_json(rows, {"git_commit": "e" * 40, "flush": "clean", "gpu": "NVIDIA H200",
                             "roofline_gbps": 4466.33}, tmp_path / "bench-h200.json")
    table = results.readme_table(tmp_path, "h200").splitlines()
    assert "clean flush" in table[0] and "size-matched limit" in table[0]
    first = [c.strip() for c in table[2].strip("|").split("|")]
    us = 143.912  # auto's eager median; bold: within 1.02 x the floor's (0.99 x it)
    assert first[:7] == ["llama8b-b64-c2k", f"**{us:.1f}** / {us - 0.6:.1f}",
                         f"{us + 7.9:.1f} / —", "120.4", f"{100 * 120.4 / us:.1f}", "83.7",
                         f"{us - 3.1:.1f}"]
    page = results.page(tmp_path, "h200")
    assert "Every time and % follows a clean L2 flush" in page
    floor = us * 0.99
    assert (f"| llama8b-b64-c2k | floor | {floor:.1f} / {floor - 0.6:.1f} | {floor + 7.9:.1f} | "
            f"120.4 | {100 * 120.4 / floor:.1f} / {100 * 120.4 / (floor - 0.6):.1f} | "
            f"83.7 / 84.2 | {floor - 3.1:.1f} (32) |") in page


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_runs_csv_holds_the_current_run(gpu):
    """Every (shape, impl) of a GPU's current bench page is a line of bench-runs.csv."""
    rows, meta = results.read_bench(ROOT / "docs" / "results" / f"bench-{gpu}.json")
    lines = _lines(ROOT / "docs" / "results" / "bench-runs.csv")
    have = {(r["commit"], r["date"], r["shape"], r["impl"]) for r in lines}
    want = {(meta["git_commit"], r["date"], r["shape"], r["impl"]) for r in rows}
    assert want and want <= have


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_each_gpu_page_is_regenerated_from_the_results(gpu):
    """docs/results/<gpu>.md is what ``results.py page`` makes from the files beside it."""
    results_dir = ROOT / "docs" / "results"
    page = results.page(results_dir, gpu)
    assert (results_dir / f"{gpu}.md").read_text(encoding="utf-8") == page
    _, meta = results.read_bench(results_dir / f"bench-{gpu}.json")
    assert page.splitlines()[2].startswith(f"> Measured on commit {meta['git_commit'][:7]}")


def test_the_readme_table_is_regenerated_from_the_gpu_its_heading_names():
    """README's Results table is what ``results.py readme-table`` prints for the GPU the
    section's heading names (``check_doc_figures.results_gpu``), and only for that one."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    gpu = figures.results_gpu(readme)
    assert gpu in ("h100", "h200")
    section = readme.split("## Results", 1)[1]
    assert results.readme_table(ROOT / "docs" / "results", gpu) in section
    other = "h200" if gpu == "h100" else "h100"
    assert results.readme_table(ROOT / "docs" / "results", other) not in section


def test_the_results_gpu_comes_from_the_heading():
    assert figures.results_gpu("x\n## Results (NVIDIA H100, one run)\n") == "h100"
    assert figures.results_gpu("x\n## Results (NVIDIA H200, one run)\n") == "h200"
    assert figures.results_gpu("x\n## Results\n") == "h200"


# --- scripts/check_doc_figures.py ------------------------------------------------------------
def _check_figures(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def _copy_docs(tmp_path: Path) -> Path:
    for name in ("README.md", "DESIGN.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def test_quoted_figures_have_a_source():
    result = _check_figures(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    count = int(result.stdout.split("ok: ")[1].split()[0])
    assert count >= 30  # the table's rows and the prose figures were found


def _first_table_figure(readme: str) -> tuple[str, str, str]:
    """``(old cell, planted cell, expected message)`` for the first number of the README
    results table's first data row (in its first cell holding one: a column the run did not
    measure holds —)."""
    rows = [line for line in readme.split("## Results", 1)[1].splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]
    shape, *cells = (c.strip() for c in rows[1].strip("|").split("|"))  # rows[0]: header
    cell = next(c for c in cells if re.search(r"\d[\d,]*\.\d+", c))
    number = re.search(r"\d[\d,]*\.\d+", cell).group(0)
    planted = f"{float(number.replace(',', '')) + 0.7:.1f}"
    where = f"{shape.split(' (')[0]}: {planted}"
    return f"| {cell} |", f"| {cell.replace(number, planted)} |", where


def _first_prose_figure(readme: str) -> tuple[str, str, str]:
    """The same for the first ``GB/s`` figure of the Results prose, planted as a number that
    no results file holds (a nearby one may: another run's roofline)."""
    number = re.search(r"(\d[\d,]*) GB/s", readme.split("## Results", 1)[1]).group(1)
    held = " ".join(f.read_text(encoding="utf-8", errors="replace")
                    for f in (ROOT / "docs" / "results").iterdir() if f.is_file())
    base = int(number.replace(",", ""))
    wrong = next(n for n in range(base + 7, base + 1000, 7) if str(n) not in held)
    planted = f"{wrong:,}"
    return f"{number} GB/s", f"{planted} GB/s", planted


@pytest.mark.parametrize("pick", [_first_table_figure, _first_prose_figure],
                         ids=["table-cell", "prose-figure"])
def test_a_planted_wrong_figure_fails(tmp_path, pick):
    root = _copy_docs(tmp_path)
    readme = (root / "README.md").read_text(encoding="utf-8")
    old, new, where = pick(readme)
    assert old in readme
    (root / "README.md").write_text(readme.replace(old, new, 1), encoding="utf-8")
    result = _check_figures(root)
    assert result.returncode == 1, result.stdout
    assert where in result.stdout


def test_a_figure_of_an_older_run_is_no_source(tmp_path):
    """A figure only the runs CSV holds (an older run's time) does not pass as a source: the
    docs quote the current pages."""
    root = _copy_docs(tmp_path)
    readme = (root / "README.md").read_text(encoding="utf-8")
    old, _, _ = _first_prose_figure(readme)
    with (root / "docs" / "results" / "bench-runs.csv").open("a", encoding="utf-8") as f:
        f.write("0000000,2026-01-01,NVIDIA H200,,,old,auto,bf16,bf16,one,9876.54,,,,,,,,,,ok,old\n")
    (root / "README.md").write_text(readme.replace(old, "9,877 GB/s", 1), encoding="utf-8")
    result = _check_figures(root)
    assert result.returncode == 1 and "9,877" in result.stdout


def test_the_since_file_bans_only_the_run_it_names(tmp_path):
    """``src-since-run.md`` counts from one bench run: that run's page says "older", a page of
    another GPU's run of another commit does not."""
    (tmp_path / results.SINCE).write_text("`src/` has changed since abcdef1 (this bench run) "
                                          "by one refactor.\n", encoding="utf-8")
    assert results._since_file(tmp_path, "abcdef1") is not None
    assert results._since(results._since_file(tmp_path, "abcdef1"))[2].startswith(
        "> `src/` has changed since")
    assert results._since_file(tmp_path, "1234567") is None
    assert results._since(results._since_file(tmp_path, "1234567")) == []
    # a run's own file, src-since-<commit>.md, speaks for that run
    (tmp_path / "src-since-1234567.md").write_text("`src/` has changed since 1234567 by an "
                                                   "opt-in flag.\n", encoding="utf-8")
    assert results._since_file(tmp_path, "1234567").name == "src-since-1234567.md"
    assert results._since(results._since_file(tmp_path, "1234567"))[2:] == [
        "> `src/` has changed since 1234567 by an opt-in flag.", ""]
    assert results._since_file(tmp_path, "abcdef1").name == results.SINCE


def test_a_partial_run_names_the_rows_it_lacks():
    from pagedattn.bench.shapes import PEER_SHAPES

    rows = [{"shape": PEER_SHAPES[0], "impl": "auto"}]
    assert results._missing_rows(rows) == list(PEER_SHAPES[1:])
    assert results._missing_rows([{"shape": s, "impl": "auto"} for s in PEER_SHAPES]) == []
