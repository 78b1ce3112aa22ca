"""The profiling lab on the CPU: ncu CSV parsing, the table/report/charts, and the fallback.

Test data (``tests/data/``):

* ``ncu_h200_raw.csv`` (``--page raw --csv --print-units base``: a header of metric names, a
  units row, one row per launch) and ``ncu_h200_details.csv`` (``--page details --csv``: one row
  per launch/section/metric): real exports captured on the H200 by ``pagedattn profile``
  (session 1: ``git show 4a206de:scripts/gpu_check.sh``), one report per impl (baseline,
  gqa_reuse_v3, split_kv_v4, auto) with the rows of the four put under one header and the
  launch IDs renumbered 0-5, as one report of six launches prints them (the four files of each
  page are in ``git show 4a206de:tests/data/``).
* ``ncu_synthetic_details.csv``, ``ncu_synthetic_raw.csv``: **synthetic**, no measurement: ncu's
  documented layouts filled with the study's split_kv_v4 / gqa_reuse_v3 figures, registers and
  occupancy partly invented. Their first line says so; the parser skips it.

The fallback runs the real impls under the Triton interpreter on tiny shapes; nothing is timed."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedattn.bench import ncu
from pagedattn.bench.ncu import METRIC_KEYS, KernelCounters, parse_ncu_csv, read_ncu_csv

DATA = Path(__file__).parents[1] / "data"
REAL = [DATA / "ncu_h200_raw.csv", DATA / "ncu_h200_details.csv"]
SYNTHETIC = sorted(DATA.glob("ncu_synthetic_*.csv"))
# the interpreter fallback; on a GPU these would time (never in pytest) and run ncu
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter path")


@pytest.mark.parametrize("path", REAL + SYNTHETIC, ids=lambda p: p.name)
def test_every_capture_parses_to_sane_kernels(path):
    kernels = read_ncu_csv(path)
    assert kernels, "no kernel parsed"
    for k in kernels:
        v = k.values
        assert k.name and set(METRIC_KEYS) <= set(v)
        assert v["duration_us"] is not None and 0 < v["duration_us"] < 10e6  # µs
        for key in ("dram_pct", "l1_pct", "l2_pct", "sm_pct", "occ_achieved",
                    "occ_theoretical"):
            assert v[key] is not None and 0 <= v[key] <= 100.5, key
        assert v["regs"] is not None and 1 <= v["regs"] <= 255
        assert v["grid"] is not None and v["grid"] >= 1
        assert v["block"] is not None and v["block"] % 32 == 0
        assert v["waves"] is not None and v["waves"] >= 0  # a 1-block kernel prints 0.00
        assert v["smem_static"] is not None and v["smem_dynamic"] is not None
        if k.grid:  # "(x, y, z)" agrees with the block count
            dims = [int(d) for d in k.grid.strip("()").split(",")]
            assert math.prod(dims) == v["grid"]


def test_the_real_raw_and_details_pages_agree_launch_by_launch():
    raw, details = (read_ncu_csv(p) for p in REAL)
    assert [k.name for k in raw] == [k.name for k in details] == [
        "_baseline_kernel", "_gqa_reuse_v3_kernel", "_split_kv_v4_kernel",
        "_split_kv_v4_merge_kernel", "_paged_decode_kernel", "_paged_decode_merge_kernel"]
    for r, d in zip(raw, details, strict=True):
        assert r.launches == d.launches == 1 and (r.grid, r.block) == (d.grid, d.block)
        for key in METRIC_KEYS:  # the details page prints 3-4 significant digits
            assert d.values[key] == pytest.approx(r.values[key], rel=2e-3), (r.name, key)


def test_synthetic_details_split_and_merge_in_canonical_units():
    split, merge = read_ncu_csv(DATA / "ncu_synthetic_details.csv")
    assert (split.name, merge.name) == ("_split_kv_v4_kernel", "_split_kv_v4_merge_kernel")
    assert split.launches == merge.launches == 2
    assert split.values["duration_us"] == pytest.approx((3920 + 4000) / 2)  # ms -> µs, median
    assert merge.values["duration_us"] == pytest.approx(22.56)  # us stays us
    assert split.values["dram_pct"] == pytest.approx(73.41)
    assert split.values["grid"] == 16384 and split.grid == "(32, 64, 8)"  # "16,384" parsed
    assert merge.values["occ_achieved"] == pytest.approx(40.25)


def test_synthetic_raw_page_units_row_and_dynamic_smem():
    gqa, merge = read_ncu_csv(DATA / "ncu_synthetic_raw.csv")
    assert gqa.values["duration_us"] == pytest.approx(3920.0)  # nsecond -> µs
    assert gqa.values["smem_dynamic"] == 16384 and gqa.values["smem_static"] == 0
    assert gqa.values["occ_theoretical"] == pytest.approx(41.67)
    assert merge.values["grid"] == 2048 and merge.block == "(32, 1, 1)"


def test_parser_skips_log_lines_and_reports_na_as_missing():
    text = ('==PROF== Connected to process 1\n'
            '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name",'
            '"Metric Unit","Metric Value"\n'
            '"0","1","p","h","k","1","7","(64, 1, 1)","(2, 1, 1)","0","9.0",'
            '"GPU Speed Of Light Throughput","Duration","usecond","1,234.5"\n'
            '"0","1","p","h","k","1","7","(64, 1, 1)","(2, 1, 1)","0","9.0",'
            '"GPU Speed Of Light Throughput","DRAM Throughput","%","n/a"\n'
            '"0","1","p","h","k","1","7","(64, 1, 1)","(2, 1, 1)","0","9.0",'
            '"Launch Statistics","Dynamic Shared Memory Per Block","Kbyte/block","16.38"\n')
    (k,) = parse_ncu_csv(text)
    assert k.values["duration_us"] == pytest.approx(1234.5)
    assert k.values["dram_pct"] is None  # never invented
    assert k.values["smem_dynamic"] == pytest.approx(16380.0)  # ncu's Kbyte is 1000 bytes
    with pytest.raises(ValueError):
        parse_ncu_csv("not,a,report\n1,2,3\n")


def test_raw_gaps_are_filled_from_the_details_export():
    raw = (DATA / "ncu_synthetic_raw.csv").read_text()
    renamed = raw.replace("gpu__dram_throughput", "gpu__renamed_dram_throughput")  # unknown
    details = (DATA / "ncu_synthetic_details.csv").read_text().replace(
        "_split_kv_v4_kernel", "_gqa_like_kernel").replace(
        '"DRAM Throughput","%","73.41"', '"DRAM Throughput","%","66.6"')
    assert parse_ncu_csv(renamed)[0].values["dram_pct"] is None
    gqa = ncu.parse_ncu_exports(renamed, details)[0]
    assert gqa.name == "_gqa_like_kernel"
    assert gqa.values["dram_pct"] == pytest.approx(66.6)  # from the details page
    assert gqa.values["duration_us"] == pytest.approx(3920.0)  # the raw page's own value


def test_ncu_command_lines():
    cmd = ncu.profile_command("ncu", Path("/o/r.ncu-rep"), ["python", "-m", "x"])
    assert cmd[:5] == ["ncu", "--clock-control", "none", "--profile-from-start", "off"]
    assert cmd[cmd.index("--export") + 1] == "/o/r"  # ncu adds .ncu-rep itself
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--section"] == list(ncu.SECTIONS)
    assert cmd[-3:] == ["python", "-m", "x"]
    assert ncu.export_command("ncu", Path("r.ncu-rep")) == [
        "ncu", "--import", "r.ncu-rep", "--csv", "--page", "raw", "--print-units", "base"]


def test_run_profile_reports_refused_counters(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, "", "==ERROR== ERR_NVGPUCTRPERM - The user "
                                           "does not have permission to access counters\n")
    monkeypatch.setattr(ncu.subprocess, "run", fake_run)
    with pytest.raises(ncu.NcuError, match="ERR_NVGPUCTRPERM"):
        ncu.run_profile("ncu", tmp_path / "r.ncu-rep", ["python"])


FAKE_NCU = """#!{python}
import sys, pathlib
args = sys.argv[1:]
if "--import" in args:  # export: print the synthetic capture for the page asked
    page = args[args.index("--page") + 1]
    print(pathlib.Path({data!r}, "ncu_synthetic_" + page + ".csv").read_text(), end="")
else:  # profile: record the command line, write the report, do not run the target
    pathlib.Path(args[args.index("--export") + 1] + ".ncu-rep").write_bytes(b"NCU")
    pathlib.Path({log!r}).write_text(" ".join(args))
"""


def test_profile_with_ncu_end_to_end_with_a_stand_in_ncu(tmp_path):
    import sys

    from pagedattn.bench.profile import profile_with_ncu

    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, data=str(DATA),
                                    log=str(tmp_path / "cmd.txt")))
    fake.chmod(0o755)
    p = profile_with_ncu(str(fake), "split_kv_v4", "seed-fp32-b64-c2048", tmp_path)
    assert p.is_ncu and p.total_us == pytest.approx(3920.0 + 22.56)  # the raw page's kernels
    assert [Path(f).name for f in p.files] == [
        "seed-fp32-b64-c2048_split_kv_v4.ncu-rep", "seed-fp32-b64-c2048_split_kv_v4.raw.csv",
        "seed-fp32-b64-c2048_split_kv_v4.details.csv"]
    cmd = (tmp_path / "cmd.txt").read_text()
    assert "--clock-control none --profile-from-start off" in cmd
    assert "pagedattn.bench.profile --impl split_kv_v4 --shape seed-fp32-b64-c2048" in cmd


def test_profile_impls_uses_ncu_and_falls_back_per_impl(tmp_path, monkeypatch):
    from pagedattn.bench import profile as profiling

    raw = (DATA / "ncu_synthetic_raw.csv").read_text()
    details = (DATA / "ncu_synthetic_details.csv").read_text()
    targets = []

    def fake_run_profile(ncu_path, stem, target, **kw):
        targets.append(target)
        if target[target.index("--impl") + 1] == "baseline":
            raise ncu.NcuError("==ERROR== ERR_NVGPUCTRPERM")
        return raw, details

    def fake_fallback(impl, shape, note=""):
        return profiling.ImplProfile(impl, shape.name, profiling.SOURCE_EVENTS, note=note)

    monkeypatch.setattr(profiling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ncu, "find_ncu", lambda: "/opt/ncu")
    monkeypatch.setattr(ncu, "run_profile", fake_run_profile)
    monkeypatch.setattr(profiling, "profile_fallback", fake_fallback)
    base, split = profiling.profile_impls(["baseline", "split_kv_v4"], "seed-fp32-b64-c2048",
                                          tmp_path, log=lambda *_: None)
    assert base.source == profiling.SOURCE_EVENTS and "ERR_NVGPUCTRPERM" in base.note
    assert split.is_ncu and [k.name for k in split.kernels] == ["_gqa_like_kernel",
                                                                "_merge_like_kernel"]
    assert split.total_us == pytest.approx(3920.0 + 22.56)
    assert (tmp_path / "seed-fp32-b64-c2048_split_kv_v4.raw.csv").read_text() == raw
    assert targets[1][1:3] == ["-m", "pagedattn.bench.profile"]
    assert "--small" not in targets[1] and "--meta-out" in targets[1]


# --- table, report and charts, from the synthetic capture -------------------------------------

def _ncu_profiles(shape: str):
    from pagedattn.bench.profile import SOURCE_NCU, ImplProfile

    split, merge = read_ncu_csv(DATA / "ncu_synthetic_details.csv")
    (gqa, _) = read_ncu_csv(DATA / "ncu_synthetic_raw.csv")
    out = []
    for impl, scale in (("baseline", 30.0), ("fused_v1", 2.0), ("vectorized_v2", 1.3),
                        ("gqa_reuse_v3", 1.0), ("auto", 0.5)):
        k = KernelCounters(f"_{impl}_kernel", {**gqa.values,
                                                "duration_us": gqa.values["duration_us"] * scale},
                           gqa.grid, gqa.block)
        out.append(ImplProfile(impl, shape, SOURCE_NCU, [k], k.values["duration_us"], 10**9))
    total = split.values["duration_us"] + merge.values["duration_us"]
    out.insert(4, ImplProfile("split_kv_v4", shape, SOURCE_NCU, [split, merge], total, 10**9))
    return out


def test_table_has_the_study_rows_and_split_merge_cells():
    from pagedattn.bench.profile import table, to_text

    rows = table(_ncu_profiles("seed-fp32-b64-c2048"), roofline_gbps=4400.0)
    labels = [r[0] for r in rows]
    for want in ("Duration (per kernel)", "Duration (total, one call)", "DRAM throughput",
                 "L1/TEX throughput", "L2 throughput", "Compute (SM) throughput",
                 "Registers/thread", "Shared memory/block (static+dynamic)",
                 "Theoretical occupancy", "Achieved occupancy", "Waves per SM", "Grid size",
                 "Block size"):
        assert want in labels
    split = rows[0].index("split_kv_v4")
    row = {r[0]: r for r in rows}
    assert row["Duration (per kernel)"][split] == "3.96 ms / 22.56 us"
    assert row["Duration (total, one call)"][split] == "3.98 ms"
    assert row["Grid size"][split] == "(32, 64, 8) = 16384 / (32, 64, 1) = 2048"
    gqa = rows[0].index("gqa_reuse_v3")
    assert row["Shared memory/block (static+dynamic)"][gqa] == "16.0 KiB"
    assert row["Achieved bandwidth"][gqa] == f"{1e9 / 3920e3:.0f} GB/s"
    md = to_text(rows, "github").splitlines()
    assert md[0].startswith("|") and "split_kv_v4" in md[0] and set(md[1]) <= set("|-: ")
    assert "split_kv_v4" in to_text(rows).splitlines()[0]


def test_ladder_report_commentary_follows_the_numbers(tmp_path):
    from pagedattn.bench.ladder import write_report

    by_shape = {s: _ncu_profiles(s) for s in ("seed-fp32-b64-c2048", "azure-conv-b64-llama8b")}
    out = write_report(tmp_path / "ladder.md", by_shape, {s: s for s in by_shape}, 4400.0,
                       {"gpu": "test"}, small=False)
    md = out.read_text()
    for png in ("duration", "bandwidth", "occupancy"):
        path = tmp_path / f"ladder-{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({path.name})" in md
    assert (tmp_path / "ladder.csv").exists()
    # fused_v1 is 15x faster than baseline in these profiles; the study measured 16.0x
    assert "**fused_v1** vs baseline: 15.0x faster" in md and "the study measured 16.0x" in md
    # split (3.96 ms + 22.56 us) against gqa (3.92 ms): slower, in the study's direction
    assert "**split_kv_v4** vs gqa_reuse_v3: 1.02x slower" in md
    assert "the same direction as the study" in md
    assert "Fastest stage: **gqa_reuse_v3**" in md and "**auto** (the production kernel)" in md
    assert "| fused_v1 | 7.50 ms | 7.84 ms | 37.92 % | 73.41 % | 16.0x | 15.0x |" in md
    assert "Dry run" not in md and "did not run" not in md  # a full ncu page: no warning
    # every figure of ours in the commentary comes from the profiles: scale them, text follows
    for p in by_shape["seed-fp32-b64-c2048"]:
        if p.impl == "fused_v1":
            p.total_us *= 2
    md2 = write_report(tmp_path / "l2.md", by_shape, {s: s for s in by_shape}, 4400.0,
                       {"gpu": "test"}, small=False).read_text()
    assert "**fused_v1** vs baseline: 7.50x faster" in md2


# --- the fallback, for real, on the CPU interpreter --------------------------------------------

@cpu_only
def test_fallback_profile_runs_impls_and_reports_no_counters(tmp_path):
    from pagedattn.bench.profile import SOURCE_DRY_RUN, profile_impls, table, verdict

    profiles = profile_impls(["gqa_reuse_v3", "split_kv_v4"], "llama8b-b1-c1k", tmp_path,
                             small=True, log=lambda *_: None)
    assert [p.source for p in profiles] == [SOURCE_DRY_RUN] * 2
    assert all(p.total_us is None and p.note == "no CUDA GPU" for p in profiles)
    assert [p.status for p in profiles] == ["ok", "ok"]  # checked against the oracle
    assert len(profiles[1].kernels) == 2  # split + merge both recorded by the launcher
    row = {r[0]: r for r in table(profiles)}
    assert row["Source"][1:] == ["dry run (interpreter)"] * 2
    assert set(row["DRAM throughput"][1:]) <= {"n/a", "n/a / n/a"}
    assert verdict(profiles, dry_run=False, no_ncu=False) == "nothing was measured"
    assert verdict(profiles, dry_run=True, no_ncu=False) is None


@cpu_only
def test_profile_cli_main_writes_report_and_csv(tmp_path, capsys):
    from pagedattn.bench import profile

    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    argv = ["--impl", "vectorized_v2", "--shape", "hd64-smollm-b64-c2k", "--out-dir",
            str(tmp_path)]
    assert profile.main(parser.parse_args(argv)) == 2  # no GPU: nothing measured, no page
    assert "nothing was measured" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert profile.main(parser.parse_args([*argv, "--dry-run"])) == 0
    printed = capsys.readouterr().out
    assert "dry run (interpreter)" in printed and "Registers/thread" in printed
    md = (tmp_path / "profile_hd64-smollm-b64-c2k-small.md").read_text()
    assert "Dry run: nothing was measured" in md and "not measured in this run" in md
    assert "compile metadata only" not in md and "H200" not in md
    assert (tmp_path / "profile_hd64-smollm-b64-c2k-small.csv").exists()


@cpu_only
def test_ladder_on_cpu_refuses_then_dry_runs_honestly(tmp_path, capsys):
    from pagedattn.bench import ladder

    parser = argparse.ArgumentParser()
    ladder.add_arguments(parser)
    out = tmp_path / "docs" / "ladder.md"
    argv = ["--out", str(out), "--out-dir", str(tmp_path / "o")]
    assert ladder.main(parser.parse_args(argv)) == 2
    assert "nothing was measured" in capsys.readouterr().err and not out.exists()
    assert ladder.main(parser.parse_args([*argv, "--dry-run"])) == 0
    md = out.read_text()
    assert "Dry run: nothing was measured" in md
    assert "## seed-fp32-b64-c2048-small" in md and "## azure-conv-b64-llama8b-small" in md
    assert "| fused_v1 | 7.50 ms | n/a | 37.92 % | n/a | 16.0x | n/a |" in md  # study's, labelled
    assert "figures come from the H200 run" not in md and "compile metadata only" not in md
    assert "Nothing was measured for this shape" in md and "No chart: nothing was measured" in md
    assert not list(out.parent.glob("ladder-*.png"))  # no chart without data


# --- scripts/ncu_prefill_mla.py ---------------------------------------------------------------
NCU_RANGE = Path(__file__).resolve().parents[2] / "scripts" / "ncu_prefill_mla.py"


@pytest.mark.parametrize("argv, says", [
    (["prefill", "--row", "prompt-9k"], "unknown prefill row 'prompt-9k'"),
    (["mla", "--rows", "ds-tp1-b64-c4k,ds-tp3"], "unknown mla row 'ds-tp3'"),
    (["prefill"], "needs a CUDA GPU"),
    (["mla"], "needs a CUDA GPU"),
])
def test_the_ncu_range_driver_refuses_in_one_line(argv, says):
    """Without a GPU (or for a row the lab lacks) the ncu driver says why in one line and
    exits 2, before building anything."""
    r = subprocess.run([sys.executable, str(NCU_RANGE), *argv], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
