"""The results of ``docs/results/``: the runs CSV every harness run is appended to, and the
current page of one GPU, built from that GPU's results files.

    python scripts/results.py append BENCH.(csv|json) [--runs CSV] [--source TEXT] [--commit C]
    python scripts/results.py page [--gpu h200] [--dir docs/results]      # writes DIR/GPU.md
    python scripts/results.py readme-table [--gpu h200] [--dir docs/results]

``append`` adds one ``pagedattn bench`` run (its ``bench-*.csv`` or ``.json``) to
``docs/results/bench-runs.csv``, one line per (shape, impl), in the manner of Liger-Kernel's
``benchmark/data/all_benchmark_data.csv``: the commit measured, the date, the GPU, the versions,
the timings and the roofline of that run. A run already in the file (same commit, date, shape
and impl) is not added again. The columns from ``flush`` on came with the clean flush: a line
with an empty ``flush`` was timed after the zeroing flush (``triton.testing.do_bench``'s,
"dirty"; every run before them), a line with ``flush`` ``clean`` after a read of twice the L2,
its zeroing-flush time in ``dirty_median_us``, its size-matched limit in ``limit_us`` (a
contiguous read of its minimal bytes, same run), ``pct_limit`` = ``100 * limit_us /
median_us``, and its decode step of ``step_layers`` layers over ``step_caches`` distinct caches
in ``step_us_per_layer``; ``pct_roofline`` is the % of the 2 GiB read rate. A runs CSV of the
older header is rewritten with the new columns (empty on its lines) when a run is appended.
``page`` writes the current page of a GPU (``h200.md``) from
``bench-<gpu>.json``, ``host-time-<gpu>.log``, ``variants-<gpu>.json`` and ``fa3-<gpu>.log``
(each optional but the first). ``readme-table`` prints README's Results table from the same
run. ``scripts/check_doc_figures.py`` checks the figures README and DESIGN quote against these
files.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RUNS_CSV = RESULTS / "bench-runs.csv"

#: columns of the runs CSV (units in the names: µs, GB/s, % of the run's read roofline)
RUN_COLUMNS = (
    "commit", "date", "gpu", "torch", "triton", "shape", "impl", "dtype", "cache_dtype",
    "batch", "median_us", "p20_us", "p80_us", "graph_median_us", "gbps", "pct_roofline",
    "graph_pct_roofline", "roofline_gbps", "host_us", "rel_l2_error", "status", "source",
    # the yardstick (issue 46): empty on the lines of earlier runs
    "flush", "dirty_median_us", "limit_us", "pct_limit", "graph_pct_limit",
    "step_us_per_layer", "step_layers", "step_caches",
)
_FORMATS = {"median_us": ".2f", "p20_us": ".2f", "p80_us": ".2f", "graph_median_us": ".2f",
            "gbps": ".1f", "pct_roofline": ".2f", "graph_pct_roofline": ".2f",
            "roofline_gbps": ".1f", "host_us": ".1f", "rel_l2_error": ".3e",
            "dirty_median_us": ".2f", "limit_us": ".2f", "pct_limit": ".2f",
            "graph_pct_limit": ".2f", "step_us_per_layer": ".2f"}
#: how the pages name a peer
PEER_NAMES = {"floor": "floor", "flashinfer-tc": "FI TC", "flashinfer-xqa": "FI XQA",
              "fa3": "FA3"}
#: README's labels of the shapes whose name does not say what they are
SHAPE_NOTES = {"ragged-b64-llama8b": "lognormal", "azure-conv-b64-llama8b":
               "Azure conversation trace", "mooncake-b16-llama8b": "Mooncake trace",
               "fp8-llama8b-b1-c32k": "e4m3 cache", "fp8-llama8b-b64-c8k": "e4m3 cache",
               "seed-fp32-b64-c2048": "the study's"}
#: the fast-kernel issue's roofline targets: (shape, % of roofline); each must hold in eager
#: and in graph mode (plan.run), the same run
TARGETS = (
    ("azure-conv-b64-llama8b", 80), ("ragged-b64-llama8b", 85), ("llama8b-b1-c32k", 70),
    ("llama8b-b8-c8k", 80), ("hd64-smollm-b64-c2k", 65), ("mooncake-b16-llama8b", 90),
)
#: its time targets: (shape, µs), eager and graph
US_TARGETS = (("fp8-llama8b-b64-c8k", 290), ("fp8-llama8b-b1-c32k", 40),
              ("seed-fp32-b64-c2048", 300))
#: the sections whose file measured another commit than the bench run (file -> commit)
OLDER = "measured-on.json"
#: what changed in src/ since the bench run, quoted under the page's header (absent: nothing)
SINCE = "src-since-run.md"
SLACK = 1.02  # the contract's "at least as fast": <= 1.02 x the peer's median
LEAD = 1.00  # the fast-kernel issue's target for every row: <= the peer's median


def _float(v) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return None


def read_bench(path: str | Path) -> tuple[list[dict], dict]:
    """The rows and run metadata of a ``pagedattn bench`` CSV or JSON file."""
    path = Path(path)
    if path.suffix == ".json":
        doc = json.loads(path.read_text(encoding="utf-8"))
        rows, meta = doc.get("rows"), doc.get("meta", {})
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            rows, meta = list(csv.DictReader(f)), {}
    else:
        raise ValueError(f"{path}: not a bench CSV or JSON file (.csv or .json)")
    if not isinstance(rows, list) or not rows or \
            any(not isinstance(r, dict) or not r.get("shape") or not r.get("impl") for r in rows):
        raise ValueError(f"{path}: not a pagedattn bench run (rows with a shape and an impl)")
    return rows, meta


def run_rows(rows: list[dict], meta: dict | None = None, *, commit: str | None = None,
             source: str = "") -> list[dict[str, str]]:
    """One runs-CSV line per harness row. ``commit`` fills rows that recorded none (a copy of
    the tree without its history records ``unknown`` unless ``PAGEDATTN_GIT_SHA`` named it)."""
    meta = meta or {}
    out = []
    for r in rows:
        line = {}
        for col in RUN_COLUMNS:
            v = r.get(col, meta.get(col))
            if col == "commit":
                v = r.get("git_commit") or meta.get("git_commit")
                if not v or v == "unknown":
                    v = commit or "unknown"
            elif col == "source":
                v = source
            elif col in _FORMATS and _float(v) is not None:
                v = format(_float(v), _FORMATS[col])
            line[col] = "" if v is None else str(v)
        out.append(line)
    return out


def _key(line: dict) -> tuple:
    return line["commit"], line["date"], line["shape"], line["impl"]


def upgrade_runs(runs_csv: str | Path = RUNS_CSV) -> bool:
    """Rewrite a runs CSV whose header is an earlier one (a prefix of :data:`RUN_COLUMNS`)
    with the current header, its lines' new cells empty; returns whether it did. Raises
    ValueError for a CSV of another header."""
    runs_csv = Path(runs_csv)
    with runs_csv.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        if header == RUN_COLUMNS:
            return False
        if not header or header != RUN_COLUMNS[:len(header)]:
            raise ValueError(f"{runs_csv}: header is not the runs CSV's {RUN_COLUMNS}")
        lines = list(reader)
    with runs_csv.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(lines)
    return True


def append_runs(rows: list[dict], runs_csv: str | Path = RUNS_CSV, meta: dict | None = None,
                *, commit: str | None = None, source: str = "") -> int:
    """Append a harness run's rows to the runs CSV (created with its header if absent, its
    header brought up to date by :func:`upgrade_runs`); rows already there (same commit,
    date, shape, impl) are skipped. Returns how many were added. Raises ValueError for a run
    that timed nothing (a dry run) or a CSV of another header."""
    if not any(_float(r.get(k)) is not None for r in rows for k in ("median_us",
                                                                     "graph_median_us")):
        raise ValueError("nothing was timed in this run (a dry run or no GPU): not a measurement")
    runs_csv = Path(runs_csv)
    have = set()
    if runs_csv.exists():
        upgrade_runs(runs_csv)
        with runs_csv.open(newline="", encoding="utf-8") as f:
            have = {_key(line) for line in csv.DictReader(f)}
    new = [line for line in run_rows(rows, meta, commit=commit, source=source)
           if _key(line) not in have]
    new = list({_key(line): line for line in new}.values())
    runs_csv.parent.mkdir(parents=True, exist_ok=True)
    write_header = not runs_csv.exists()
    with runs_csv.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_COLUMNS)
        if write_header:
            writer.writeheader()
        writer.writerows(new)
    return len(new)


# --- the current page ---------------------------------------------------------------------

def _us(v) -> str:
    v = _float(v)
    return "—" if v is None else f"{v:.1f}"


def _pair(a, b) -> str:
    return f"{_us(a)} / {_us(b)}"


def _by_shape(rows: list[dict]) -> dict[str, dict[str, dict]]:
    shapes: dict[str, dict[str, dict]] = {}
    for r in rows:
        shapes.setdefault(r["shape"], {})[r["impl"]] = r
    return shapes


def _fastest(row: dict, graph: bool) -> tuple[float | None, str]:
    prefix = "graph_" if graph else ""
    return _float(row.get(f"{prefix}to_beat_us")), row.get(f"{prefix}to_beat_peer") or ""


def _peer_cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if r.get("status") == "unsupported" or (r.get("median_us") is None
                                             and r.get("status") != "FAIL"):
        return "unsupported" if r.get("status") == "unsupported" else (r.get("status") or "—")
    cell = _pair(r.get("median_us"), r.get("graph_median_us"))
    if r.get("status") == "FAIL":
        cell += f" (fails its check: rel. L2 {float(r['rel_l2_error']):.2e})"
    return cell


def ranked(rows: list[dict], impl: str = "auto") -> list[dict]:
    """``impl``'s rows with the fastest passing peer of the run, eager and graph, and their
    ratios, in the order README shows them (nearest the peer first; no peer last)."""
    out = []
    for shape, impls in _by_shape(rows).items():
        r = impls.get(impl)
        if r is None or _float(r.get("median_us")) is None:
            continue
        fast, peer = _fastest(r, False)
        gfast, gpeer = _fastest(r, True)
        ratio = fast and _float(r["median_us"]) / fast
        gratio = gfast and _float(r.get("graph_median_us")) and \
            _float(r["graph_median_us"]) / gfast
        out.append({"shape": shape, "row": r, "fast": fast, "peer": peer, "gfast": gfast,
                    "gpeer": gpeer, "ratio": ratio, "gratio": gratio, "impls": impls})
    return sorted(out, key=lambda x: (x["ratio"] is None, x["ratio"] or 0.0))


def _peer_table(rows: list[dict], impl: str = "auto") -> list[str]:
    peers = sorted({r["impl"] for r in rows} - {impl})
    head = ["shape", f"{impl} µs (eager / graph)", "% roof (eager / graph)",
            *(f"{PEER_NAMES.get(p, p)} (eager / graph)" for p in peers),
            "fastest peer, same run (eager / graph)", f"{impl} ≤ it × {SLACK} (eager / graph)",
            f"{impl} / fastest (eager / graph)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in sorted(ranked(rows, impl), key=lambda x: list(_by_shape(rows)).index(x["shape"])):
        r = x["row"]
        roof = f"{float(r['pct_roofline']):.1f} / {float(r['graph_pct_roofline']):.1f}"
        if x["fast"] is None:
            fastest, beats, ratio = "— (no peer passes)", "—", "—"
        else:
            name = PEER_NAMES.get
            fastest = (f"{x['fast']:.1f} ({name(x['peer'], x['peer'])}) / "
                       f"{x['gfast']:.1f} ({name(x['gpeer'], x['gpeer'])})")
            beats = " / ".join("yes" if q <= SLACK else "no" for q in (x["ratio"], x["gratio"]))
            ratio = f"{x['ratio']:.3f} / {x['gratio']:.3f}"
        cells = [x["shape"], _pair(r["median_us"], r.get("graph_median_us")), roof,
                 *(_peer_cell(x["impls"].get(p)) for p in peers), fastest, beats, ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _reached_line(rows: list[dict]) -> str:
    rk = [x for x in ranked(rows) if x["fast"] is not None]
    hit = [x for x in rk if x["ratio"] <= SLACK and x["gratio"] <= SLACK]
    miss = [x for x in rk if x not in hit]
    fmt = ", ".join
    lead = [x for x in rk if x["ratio"] <= LEAD and x["gratio"] <= LEAD]
    return (f"**Within × {SLACK}** of the fastest passing peer in eager and graph: {len(hit)} of "
            f"the {len(rk)} rows that have one: "
            + fmt(f"{x['shape']} ({x['ratio']:.3f} / {x['gratio']:.3f})" for x in hit)
            + ". **Behind**: "
            + fmt(f"{x['shape']} ({x['ratio']:.3f} / {x['gratio']:.3f})" for x in miss) + ". "
            f"**At × {LEAD:.2f}** (the fast-kernel issue's target: every row): {len(lead)} of "
            f"{len(rk)}" + (": " + fmt(x["shape"] for x in lead) if lead else "") + ".")


def _targets_table(rows: list[dict]) -> list[str]:
    shapes = _by_shape(rows)
    lines = ["| target (eager and graph) | shape | measured (eager / graph) | result |",
             "|---|---|---|---|"]
    # (shape, bound, the row's columns, unit, the target's words, is the bound reached)
    checks = [(shape, pct, "pct_roofline", "%", f"≥ {pct} % of the roofline", min, float.__ge__)
              for shape, pct in TARGETS]
    checks += [(shape, us, "median_us", "µs", f"≤ {us} µs", max, float.__le__)
               for shape, us in US_TARGETS]
    for shape, bound, col, unit, words, worst, holds in checks:
        r = shapes.get(shape, {}).get("auto")
        if r is None or _float(r.get(col)) is None:
            continue
        e, g = float(r[col]), float(r[f"graph_{col}"])
        lines.append(f"| {words} | {shape} | {e:.1f} / {g:.1f} {unit} | "
                     f"{'reached' if holds(worst(e, g), float(bound)) else 'missed'} |")
    return lines


def run_flush(rows: list[dict], meta: dict | None = None) -> str:
    """The L2 flush a run's times and % follow: its ``flush`` (``clean``), or ``dirty`` for a
    run that recorded none (every run before the clean flush zeroed a buffer)."""
    return (meta or {}).get("flush") or next((r["flush"] for r in rows if r.get("flush")),
                                             "dirty")


#: what the pages say of a run's flush
FLUSH_WORDS = {
    "clean": "Every time and % follows a clean L2 flush (a read of twice the L2); the dirty "
             "µs, do_bench's zeroing flush.",
    "dirty": "Every time and % of this run follows the zeroing L2 flush of "
             "`triton.testing.do_bench` (the timed call writes the L2's dirty lines back): it "
             "predates the clean flush, the size-matched limit and the decode step.",
}


def _yardstick_table(rows: list[dict]) -> list[str]:
    """Every impl and peer against the size-matched limit and the 2 GiB read rate, with the
    dirty-flush time and the decode step per layer; one line for a run without them."""
    if not any(_float(r.get("limit_us")) is not None for r in rows):
        return ["This run measured no size-matched limit, dirty-flush time or decode step "
                "(it predates them): `pagedattn bench` on a GPU writes this table."]
    lines = ["| shape | impl | clean µs (eager / graph) | dirty µs | size-matched limit µs | "
             "% of limit (eager / graph) | % of 2 GiB rate (eager / graph) | 32 layers, "
             "µs/layer (distinct caches) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if _float(r.get("median_us")) is None:
            continue
        caches = r.get("step_caches")
        layer = _us(r.get("step_us_per_layer")) + (f" ({caches})" if caches else "")
        lines.append(f"| {r['shape']} | {PEER_NAMES.get(r['impl'], r['impl'])} | "
                     f"{_pair(r['median_us'], r.get('graph_median_us'))} | "
                     f"{_us(r.get('dirty_median_us'))} | {_us(r.get('limit_us'))} | "
                     f"{_pair(r.get('pct_limit'), r.get('graph_pct_limit'))} | "
                     f"{_pair(r.get('pct_roofline'), r.get('graph_pct_roofline'))} | {layer} |")
    return lines


def _host_table(path: Path) -> list[str]:
    keys = ("plan_run_us", "plan_run_out_us", "paged_decode_us", "flashinfer_run_us")
    lines = ["| batch | plan.run | plan.run with `out` | paged_decode | FlashInfer `run()` |",
             "|---|---|---|---|---|"]
    rows: dict[str, list[list[str]]] = {}  # a log of several runs: a batch's rows together
    for text in path.read_text(encoding="utf-8").splitlines():
        kv = dict(re.findall(r"(\w+)=(\S+)", text))
        if "batch" in kv:
            rows.setdefault(kv["batch"], []).append(
                [f"{kv[k]} ({kv[k + '_min']})" if k + "_min" in kv else kv.get(k, "—")
                 for k in keys])
    for batch, runs in rows.items():
        for run, cells in enumerate(runs, 1):
            label = f"{batch} (run {run})" if len(runs) > 1 else batch
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _variants_table(path: Path) -> list[str]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    plain = {r["shape"]: r for r in rows if r["row"].startswith("plain-")}
    lines = ["| row | auto µs (eager / graph) | FlashInfer µs (eager / graph) | "
             f"auto ≤ FlashInfer × {SLACK} (eager / graph; ratio) | auto vs plain auto, same "
             "shape (eager / graph) | rel. L2 |", "|---|---|---|---|---|---|"]
    for r in rows:
        fi = r.get("flashinfer_us")
        if fi is None:
            fi_cell, vs = r.get("flashinfer", "—"), "—"
        else:
            fi_cell = _pair(fi, r.get("flashinfer_graph_us"))
            q, gq = r["auto_us"] / fi, r["auto_graph_us"] / r["flashinfer_graph_us"]
            vs = " / ".join("yes" if x <= SLACK else "no" for x in (q, gq)) + \
                f" ({q:.3f} / {gq:.3f})"
        p = plain.get(r["shape"])
        rel = "—" if p is None or p is r else \
            f"{r['auto_us'] / p['auto_us']:.2f}× / {r['auto_graph_us'] / p['auto_graph_us']:.2f}×"
        ok = f"{r['rel_l2']:.2e}" + ("" if r.get("ok") else " FAIL")
        lines.append(f"| {r['row']} | {_pair(r['auto_us'], r['auto_graph_us'])} | {fi_cell} | "
                     f"{vs} | {rel} | {ok} |")
    return lines


FA3_LINE = re.compile(r"^(\S+)\s+(fa3|pagedattn_plan|floor)\s+([\d.]+) ms .*?err (\S+) graph\s+"
                      r"([\d.]+) us")


def _fa3_roofline(path: Path) -> str:
    m = re.search(r"read bandwidth \(streaming Triton read\): (\d+) GB/s", path.read_text())
    return f" (its read roofline: {int(m.group(1)):,} GB/s)" if m else ""


def _fa3_table(path: Path) -> list[str]:
    cells: dict[str, dict[str, str]] = {}
    for text in path.read_text(encoding="utf-8").splitlines():
        m = FA3_LINE.match(text)
        if m:
            shape, impl, ms, err, graph = m.groups()
            cells.setdefault(shape, {})[impl] = f"{float(ms) * 1e3:.1f} / {graph} ({err})"
    lines = ["| shape | FA3 µs (eager / graph; rel. L2) | plan.run | floor |", "|---|---|---|---|"]
    for shape, c in cells.items():
        lines.append(f"| {shape} | " + " | ".join(c.get(k, "—") for k in
                                                   ("fa3", "pagedattn_plan", "floor")) + " |")
    return lines


#: the page's optional sections: (file, heading, what the file is, its table)
_SECTIONS = (
    ("host-time-{gpu}.log", "Host time",
     " (`scripts/host_time.py`: 2,000 back-to-back calls of a tiny batch, one sync, µs per call; "
     "median of the timings, their minimum in brackets; FlashInfer's `run()` planned once, in the "
     "same process). Targets: `plan.run` ≤ 20 µs, `paged_decode` ≤ 40 µs, both ≤ FlashInfer's "
     "`run()`.", _host_table),
    ("variants-{gpu}.json", "Attention variants beside FlashInfer",
     " (`scripts/bench_variants.py`, every default row): µs, cold-L2 median, eager / graph; "
     "FlashInfer with the same variant where its paged decode has it. Ratios from the "
     "unrounded medians.", _variants_table),
    ("fa3-{gpu}.log", "FlashAttention-3 beside plan.run and the floor",
     ": FlashAttention-3 (`flash_attn_with_kvcache` on the paged cache through `page_table`, the "
     "`--peer-file` runner of the peers folder) beside `plan.run` and the floor in one call, µs "
     "eager / graph (rel. L2 against the oracle). A separate call from the benchmark "
     "above{roofline}: compare within this table.", _fa3_table),
)


#: the peer files the bench phase passes, by row name
PEER_FILE_ARGS = {"floor": "floor=PEERS/plain_floor.py:best_floor_runner",
                  "fa3": "fa3=PEERS/fa3_peer.py"}


def _command(rows: list[dict]) -> str:
    """The ``pagedattn bench`` command of the bench phase that gives these rows' peers."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    builtin = [i for i in impls if i.startswith("flashinfer")]
    files = "".join(f" --peer-file {PEER_FILE_ARGS[i]}" for i in impls if i in PEER_FILE_ARGS)
    return (f"pagedattn bench --shapes peers --impls auto --peers {','.join(builtin) or 'none'}"
            + f"{files} --graph --reps 40")


def _missing_rows(rows: list[dict]) -> list[str]:
    """The rows of the peers set (``pagedattn bench --shapes peers``) this run does not hold:
    a run the call's time limit stopped, or one given fewer shapes."""
    try:
        from pagedattn.bench.shapes import PEER_SHAPES  # noqa: PLC0415 (torch: only here)
    except ImportError:  # a results folder read without the package
        return []
    have = {r["shape"] for r in rows}
    return [s for s in PEER_SHAPES if s not in have]


def _older(results: Path) -> dict[str, str]:
    """The files of ``results`` that measured another commit than its bench run (older, or
    newer where a section was re-measured after it)."""
    path = results / OLDER
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _since_file(results: Path, short: str) -> Path | None:
    """What says how ``src/`` changed since the bench run of commit ``short``, or None (the
    run measured the shipped code): ``src-since-<short>.md`` if there is one, else
    :data:`SINCE` where its first line names that run ("`src/` has changed since 61af690
    ..."); a run of another commit takes no "older" banner from it."""
    own = results / f"src-since-{short}.md"
    if own.exists():
        return own
    path = results / SINCE
    if not path.exists():
        return None
    first = re.search(r"changed since ([0-9a-f]{7})", path.read_text(encoding="utf-8"))
    return path if first is None or first.group(1) == short else None


def _since(path: Path | None) -> list[str]:
    """The "older" banner and the quoted lines of a :func:`_since_file`, each followed by a
    blank line, or nothing (``None``: the run measured the shipped code)."""
    if path is None:
        return []
    lines = path.read_text(encoding="utf-8").strip().splitlines()
    return [f"> **Older than the shipped `src/`.** This page measured the commit it names; "
            f"`src/` has changed since (`{path.name}`, quoted below, lists the changes and "
            "whether any touches what was measured here).", "",
            *(f"> {line}".rstrip() for line in lines), ""]


def page(results: Path, gpu: str) -> str:
    """The current page of ``gpu`` from its results files in ``results``."""
    rows, meta = read_bench(results / f"bench-{gpu}.json")
    commit = (meta.get("git_commit") or "unknown")
    short = commit[:7]
    roof = _float(meta.get("roofline_gbps"))
    peers = sorted({PEER_NAMES.get(r["impl"], r["impl"]) for r in rows} - {"auto"})
    missing = _missing_rows(rows)
    out = [f"# {meta.get('gpu', gpu)} results (commit {short})", "",
           f"> Measured on commit {short} (`{commit}`): the figures are those of that commit's "
           "`src/`. Made by `scripts/results.py page` from the files named below; "
           f"every harness run is also a line of `bench-runs.csv`."
           + (" Sections made from files of other commits say so: "
              + ", ".join(f"`{f}` ({c})" for f, c in _older(results).items()) + "."
              if _older(results) else ""), "",
           *_since(_since_file(results, short)),
           f"One {meta.get('gpu', gpu)}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
           f"run of {meta.get('date')}. Read roofline measured in the same run by a "
           f"streaming-read kernel: {roof:,.0f} GB/s (the % columns use it). "
           + FLUSH_WORDS[run_flush(rows, meta)] if roof else "",
           "",
           f"Command (`scripts/gpu_check.sh bench`): `{_command(rows)}`. "
           "`auto` is planned once per batch and timed on "
           "`plan.run`; medians of cold-L2 repetitions, eager and CUDA-graph replay; every "
           f"output checked against the float64 oracle. Peers in the same run: {', '.join(peers)}"
           " (floor: the plain-Triton measuring peer, best of its config sweep per batch, not "
           "graph-safe). A peer whose output fails its accuracy check is not counted as "
           f"fastest. Full table: `bench-{gpu}.md` (errors, host µs; CSV and JSON beside it; "
           f"chart `bench-{gpu}-roofline.png`)."
           + (f" **Partial:** {len(missing)} rows of the peers set are not in this"
              f" run ({', '.join(missing)})." if missing else ""), "",
           "## Every row against the fastest peer of the same run", "",
           *_peer_table(rows), "", _reached_line(rows), "",
           "## Roofline targets (% of the read roofline, same run)", "", *_targets_table(rows),
           "", "## Against the size-matched limit (a contiguous read of the row's minimal bytes, "
           "same run)", "", *_yardstick_table(rows)]
    older = _older(results)
    for name, title, intro, table in _SECTIONS:
        path = results / name.format(gpu=gpu)
        if path.exists():
            note = [f"> Measured on commit {older[path.name]}, not this page's bench run "
                    "(see the note at the top).", ""] if path.name in older else []
            out += ["", f"## {title}", "", *note, f"`{path.name}`" + intro.format(
                roofline=_fa3_roofline(path) if table is _fa3_table else ""), "", *table(path)]
    pages = [f"`{name}`" for name in (f"gpu-tests-{gpu}.md", f"sanitizer-{gpu}.md",
                                       f"serving-{gpu}.md") if (results / name).exists()]
    out += ["", "## GPU tests, sanitizers, serving", "",
            f"{', '.join(pages) or 'None on this GPU'}: each names the commit it measured. "
            "The correctness gate and the sanitizers over every kernel family: "
            + (", ".join(f"`{p.name}`" for p in sorted(results.glob("gpu-correctness-*.md")))
               or "none yet") + "."]
    return "\n".join(out) + "\n"


def readme_table(results: Path, gpu: str) -> str:
    """README's Results table: ``auto`` eager and graph after the clean flush and after the
    dirty one (a run before the clean flush has its times in the dirty column), the
    size-matched limit, % of it and of the 2 GiB read rate, the decode step per layer, the
    fastest peer."""
    rows, meta = read_bench(results / f"bench-{gpu}.json")
    clean = run_flush(rows, meta) == "clean"
    fails = {(r["shape"], r["impl"]): r for r in rows if r.get("status") == "FAIL"}
    lines = ["| shape (bf16 unless named) | auto µs, clean flush (eager / graph) | auto µs, "
             "dirty flush (eager / graph) | size-matched limit µs | % of limit | % of 2 GiB "
             "rate | 32 layers, µs/layer | fastest peer µs, same run |",
             "|---|---|---|---|---|---|---|---|"]
    for x in ranked(rows):
        r = x["row"]
        note = SHAPE_NOTES.get(x["shape"])
        name = x["shape"] + (f" ({note})" if note else "")
        us = _us(r["median_us"])
        if x["ratio"] is not None and x["ratio"] <= SLACK:
            us = f"**{us}**"
        timed = f"{us} / {_us(r.get('graph_median_us'))}"
        dirty = _pair(r.get("dirty_median_us"), None) if clean else timed
        if x["fast"] is None:
            peer = "— (no peer at fp32 accuracy)"
        else:
            peer = f"{x['fast']:.1f} ({PEER_NAMES.get(x['peer'], x['peer'])})"
        for (shape, impl), f in fails.items():
            if shape == x["shape"] and impl != "floor":
                peer += f"; {PEER_NAMES.get(impl, impl)} {_us(f['median_us'])} fails its check"
        lines.append(f"| {name} | {timed if clean else '—'} | {dirty} | "
                     f"{_us(r.get('limit_us'))} | {_us(r.get('pct_limit'))} | "
                     f"{float(r['pct_roofline']):.1f} | {_us(r.get('step_us_per_layer'))} | "
                     f"{peer} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("append", help="append a pagedattn bench run to the runs CSV")
    a.add_argument("bench", type=Path, help="a bench-*.csv or bench-*.json of pagedattn bench")
    a.add_argument("--runs", type=Path, default=RUNS_CSV)
    a.add_argument("--source", default="", help="where the run's full files are (text)")
    a.add_argument("--commit", default=None, help="commit for rows that recorded none")
    for name in ("page", "readme-table"):
        p = sub.add_parser(name)
        p.add_argument("--gpu", default="h200", help="the results files' GPU slug")
        p.add_argument("--dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "append":
            rows, meta = read_bench(args.bench)
            n = append_runs(rows, args.runs, meta, commit=args.commit,
                            source=args.source or str(args.bench))
            print(f"{args.runs}: {n} rows appended")
        elif args.cmd == "page":
            path = args.dir / f"{args.gpu}.md"
            path.write_text(page(args.dir, args.gpu), encoding="utf-8")
            print(f"wrote {path}")
        else:
            sys.stdout.write(readme_table(args.dir, args.gpu))
    except (OSError, ValueError, KeyError) as e:
        print(f"results.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
