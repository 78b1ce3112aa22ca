"""The benchmark's data and plumbing on the CPU: traces, shapes, bytes, batches, reports,
the harness loop with fake timers. No timing happens here (API.md: never in pytest)."""

import csv
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedattn.bench import harness, report
from pagedattn.bench.shapes import (
    FP8_E4M3,
    MODELS,
    PEER_SHAPES,
    SHAPES,
    build_batch,
    get_shape,
    make_shape,
    ragged_lognormal_lens,
    resolve_shape,
    select_shapes,
    shrink,
    shrink_lengths,
)
from pagedattn.bench.timing import Timing, _summarize, gb_per_s, pct_of
from pagedattn.reference import paged_decode_reference
from pagedattn.traces import load_trace, sample_context_lens

#: the current H200 run of the peers preset (docs/results/), whose rows are the peers' table
BENCH_H200 = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench-h200.json"
#: the rows of the peers' table (the numbers to beat), in its order
PEER_TABLE = (
    "seed-fp32-b64-c2048", "llama8b-b1-c32k", "llama8b-b8-c8k", "llama8b-b64-c2k",
    "llama8b-b64-c8k", "llama8b-b256-c1k", "qwen7b-b64-c4k", "mha-b32-c4k", "tp8-70b-b128-c8k",
    "hd256-b32-c4k", "hd64-smollm-b64-c2k", "fp8-llama8b-b64-c8k", "fp8-llama8b-b1-c32k",
    "ragged-b64-llama8b", "azure-conv-b64-llama8b", "mooncake-b16-llama8b",
)


# --- traces -------------------------------------------------------------------------------

def test_traces_load_every_row():
    azure, mooncake = load_trace("azure"), load_trace("mooncake")
    assert len(azure) == 19_366 and azure[0] == (374, 44)  # CRLF file, no final newline
    assert len(mooncake) == 12_031 and mooncake[0] == (6758, 500)
    with pytest.raises(ValueError, match="trace"):
        load_trace("burstgpt")


def _recipe(rows, batch, g):
    """API.md's recipe, written out independently."""
    idx = torch.randint(0, len(rows), (batch,), generator=g)
    out = []
    for i in idx.tolist():
        ctx, gen = rows[i]
        out.append(ctx + int(torch.randint(0, max(gen, 1), (1,), generator=g)))
    return out


@pytest.mark.parametrize("trace,batch,seed", [("azure", 64, 0), ("mooncake", 16, 0),
                                              ("azure", 5, 3)])
def test_sampling_follows_the_recipe(trace, batch, seed):
    expect = _recipe(load_trace(trace), batch, torch.Generator().manual_seed(seed))
    assert sample_context_lens(trace, batch, seed) == expect


def test_sampling_totals():
    azure = sample_context_lens("azure", 64, 0)
    assert (sum(azure), max(azure)) == (81_465, 6_791)  # peers/README.md
    mooncake = sample_context_lens("mooncake", 16, 0)
    assert (sum(mooncake), max(mooncake)) == (180_464, 35_355)  # API.md's recipe
    # peers/README.md's quoted 190,524 / 62,572 is a draw continued after azure b64:
    g = torch.Generator().manual_seed(0)
    sample_context_lens("azure", 64, generator=g)
    continued = sample_context_lens("mooncake", 16, generator=g)
    assert (sum(continued), max(continued)) == (190_524, 62_572)
    assert sample_context_lens("azure", 64, 1) != azure


# --- shapes and bytes ---------------------------------------------------------------------

def test_registry_holds_every_peers_row():
    assert PEER_SHAPES == PEER_TABLE
    assert set(PEER_SHAPES) <= set(SHAPES)
    # the committed H200 run of the preset holds the same rows, in the same order
    run = json.loads(BENCH_H200.read_text())["rows"]
    assert list(dict.fromkeys(r["shape"] for r in run)) == list(PEER_TABLE)
    assert [s.name for s in select_shapes("peers")] == list(PEER_TABLE)
    assert [s.name for s in select_shapes("all")] == list(SHAPES)
    assert [s.name for s in select_shapes("mha-b32-c4k, hd256-b32-c4k")] == [
        "mha-b32-c4k", "hd256-b32-c4k"]
    with pytest.raises(ValueError, match="shape"):
        get_shape("nope")


def test_shape_helpers_refuse_what_they_cannot_honour():
    """Found by an adversarial pass: an empty selection gave no shapes silently, "all,peers"
    called "all" unknown, and negative lengths or a page size of 0 failed later (or never)."""
    from pagedattn.bench.shapes import shrink_lengths
    from pagedattn.traces import sample_context_lens

    assert [s.name for s in select_shapes(["peers", "mha-b32-c4k "])] == [
        *PEER_TABLE, "mha-b32-c4k"]
    assert len(select_shapes("all,peers")) == len(SHAPES) + len(PEER_TABLE)
    for empty in ("", " , ", []):
        with pytest.raises(ValueError, match="^shapes: expected"):
            select_shapes(empty)
    with pytest.raises(ValueError, match="^context_lens: expected lengths >= 0"):
        make_shape("x", "smollm2-135m", [3, -1])
    with pytest.raises(ValueError, match="^page_size: expected >= 1"):
        make_shape("x", "smollm2-135m", [3], page_size=0)
    assert shrink_lengths([0, 5, 100], 10) == [0, 1, 10]  # a non-empty sequence keeps a token
    for bad in (0, -3):
        with pytest.raises(ValueError, match="^max_context: expected >= 1"):
            shrink_lengths([5, 100], bad)
    with pytest.raises(ValueError, match="^batch: expected an int >= 0"):
        sample_context_lens("azure", -1)
    with pytest.raises(ValueError, match="^seed: expected an int in"):
        sample_context_lens("azure", 2, seed=1 << 64)


@pytest.mark.parametrize("name,heads,batch,ctx,dtype,cache", [
    ("seed-fp32-b64-c2048", (32, 8, 128), 64, 2048, torch.float32, torch.float32),
    ("llama8b-b1-c32k", (32, 8, 128), 1, 32768, torch.bfloat16, torch.bfloat16),
    ("qwen7b-b64-c4k", (28, 4, 128), 64, 4096, torch.bfloat16, torch.bfloat16),
    ("mha-b32-c4k", (32, 32, 128), 32, 4096, torch.bfloat16, torch.bfloat16),
    ("tp8-70b-b128-c8k", (8, 1, 128), 128, 8192, torch.bfloat16, torch.bfloat16),
    ("hd256-b32-c4k", (16, 8, 256), 32, 4096, torch.bfloat16, torch.bfloat16),
    ("hd64-smollm-b64-c2k", (9, 3, 64), 64, 2048, torch.bfloat16, torch.bfloat16),
    ("fp8-llama8b-b64-c8k", (32, 8, 128), 64, 8192, torch.bfloat16, FP8_E4M3),
])
def test_uniform_shapes(name, heads, batch, ctx, dtype, cache):
    s = get_shape(name)
    m = s.model
    assert (m.num_q_heads, m.num_kv_heads, m.head_dim) == heads
    assert s.context_lens == (ctx,) * batch and s.page_size == 16
    assert (s.dtype, s.cache_dtype) == (dtype, cache)
    fp8 = cache == FP8_E4M3
    assert (s.k_scale is not None) == fp8 and (not fp8 or s.k_scale != 1.0 != s.v_scale)


def test_ragged_and_trace_shapes():
    ragged = get_shape("ragged-b64-llama8b").context_lens
    assert len(ragged) == 64 and ragged[:2] == (1, 17)
    assert all(1 <= n <= 16384 for n in ragged) and ragged == tuple(ragged_lognormal_lens())
    assert sum(ragged) == 127_851
    assert get_shape("azure-conv-b64-llama8b").num_tokens == 81_465
    assert get_shape("mooncake-b16-llama8b").num_tokens == 180_464
    assert set(MODELS) >= {"llama-3-8b", "qwen2.5-7b", "smollm2-135m", "mha", "tp8-70b",
                           "hd256", "seed"}


def test_byte_counts_by_hand():
    s = make_shape("t", "smollm2-135m", [1, 17, 40])  # bf16, 9/3 heads, head_dim 64
    kv = 2 * 58 * 3 * 64 * 2
    assert s.kv_bytes == kv
    assert s.minimal_bytes == kv + 3 * 9 * 64 * 2 + 4 * (1 + 2 + 3)  # K/V, q, table (read)
    assert make_shape("t", "llama-3-8b", [16], fp8=True).kv_bytes == 2 * 16 * 8 * 128
    assert get_shape("llama8b-b64-c8k").kv_bytes == 2 * 64 * 8192 * 8 * 128 * 2


@pytest.mark.parametrize("name,us,pct", [  # FlashInfer tensor-core cells of peers/README.md
    ("llama8b-b64-c8k", 503.3, 98), ("qwen7b-b64-c4k", 138.1, 89),
    ("hd64-smollm-b64-c2k", 44.0, 53), ("fp8-llama8b-b64-c8k", 423.1, 58),
    ("ragged-b64-llama8b", 265.5, 45), ("azure-conv-b64-llama8b", 149.4, 51),
    ("mooncake-b16-llama8b", 197.4, 86),
])
def test_minimal_bytes_match_the_peers_table(name, us, pct):
    """time x % x 4366 GB/s recovers our byte count within the table's rounding."""
    implied = pct / 100 * 4366e9 * us * 1e-6
    ours = get_shape(name).minimal_bytes
    assert abs(ours - implied) / ours <= 0.5 / pct + 0.05 / us + 0.002


def test_build_batch_is_paged_shuffled_and_poisoned():
    shape = make_shape("t", "smollm2-135m", [1, 17, 40, 0], dtype=torch.float32)
    b = build_batch(shape, "cpu", seed=1)
    num_pages = b.key_cache.shape[0]
    assert b.key_cache.shape == (6 + 2, 16, 3, 64) and b.block_tables.dtype == torch.int32
    used = [b.block_tables[i, :p].tolist() for i, p in enumerate(shape.pages_per_seq)]
    flat = [p for row in used for p in row]
    assert sorted(flat) == sorted(set(flat)) and all(0 <= p < num_pages for p in flat)
    assert flat != sorted(flat)  # fragmented order
    assert (b.block_tables[3] == -1).any() and (b.block_tables[3] >= num_pages).any()
    page17 = used[1][1]  # sequence 1's second page holds one token
    assert not b.key_cache[page17, 0].isnan().any() and b.key_cache[page17, 1:].isnan().all()
    ref = paged_decode_reference(*b.tensors).out
    assert torch.isfinite(ref).all() and (ref[3] == 0).all()
    clean = build_batch(shape, "cpu", seed=1, poison=False)
    assert not clean.key_cache.isnan().any()


def test_build_batch_fp8_scales():
    shape = make_shape("t", "llama-3-8b", [20, 5], fp8=True)
    b = build_batch(shape, "cpu", poison=False)
    assert b.key_cache.dtype == FP8_E4M3 and b.query.dtype == torch.bfloat16
    assert b.scales == {"k_scale": shape.k_scale, "v_scale": shape.v_scale}
    k = b.key_cache.float() * shape.k_scale  # dequantized: about N(0, 1)
    assert 0.7 < k.std().item() < 1.3
    assert torch.isfinite(paged_decode_reference(*b.tensors, **b.scales).out).all()


# --- timing helpers (pure arithmetic; nothing is timed) -------------------------------------

def test_timing_summary_and_units():
    t = _summarize([x / 1000 for x in range(1, 102)])  # ms -> µs 1..101
    assert (t.median_us, t.reps) == (51.0, 101) and t.p20_us == 21.0 and t.p80_us == 81.0
    assert gb_per_s(2_000_000, 1.0) == pytest.approx(2000.0)
    assert gb_per_s(2_000_000, None) is None  # untimed: no bandwidth, never 0 or inf
    assert pct_of(2000.0, 4000.0) == 50.0 and pct_of(None, 4000.0) is None
    assert pct_of(2000.0, None) is None


def test_shrinking_keeps_raggedness_and_empty_rows():
    assert shrink_lengths([10, 20], 48) == [10, 20]  # never scales up
    assert shrink_lengths([100, 1000, 3, 0], 50) == [5, 50, 1, 0]  # >= 1 token; 0 stays 0
    assert shrink_lengths([], 8) == []
    small = shrink(get_shape("qwen7b-b64-c4k"))
    assert small.name == "qwen7b-b64-c4k-small" and small.context_lens == (17, 17)
    assert (small.model.num_q_heads, small.model.num_kv_heads) == (7, 1)  # group 7 kept
    assert resolve_shape("ragged-b64-llama8b", small=True).context_lens == (1, 17)
    assert resolve_shape("mha-b32-c4k") is get_shape("mha-b32-c4k")


def test_stream_read_kernel_reads_everything():
    from pagedattn.bench.timing import stream_read

    x = torch.arange(3 * 1024 + 5, dtype=torch.float32).to(torch.bfloat16)
    partial = stream_read(x, chunk=2048, block=512)
    assert partial.shape == (2,)
    assert partial.double().sum().item() == pytest.approx(x.double().sum().item(), rel=1e-6)


# --- reports ------------------------------------------------------------------------------

def _fake_rows():
    rows = []
    for shape in ("llama8b-b1-c32k", "ragged-b64-llama8b"):
        for impl, us in (("auto", 50.0), ("flashinfer-tc", 60.0)):
            r = harness.base_row(get_shape(shape), impl, "ours" if impl == "auto" else "peer")
            r["status"] = "ok"
            r.update(median_us=us, p20_us=us - 1, p80_us=us + 1, graph_median_us=us - 5,
                     gbps=r["minimal_bytes"] / us / 1e3, graph_gbps=r["minimal_bytes"] / (us - 5)
                     / 1e3, rel_l2_error=2e-3, tolerance=1e-2, status="ok")
            rows.append(r)
    rows.append({**harness.base_row(get_shape("seed-fp32-b64-c2048"), "flashinfer-tc", "peer"),
                 "status": "unsupported", "error": "flashinfer-tc: no fp32"})
    return rows


def test_reports_csv_json_md_png(tmp_path):
    rows = _fake_rows()
    meta = {"gpu": "FakeGPU", "torch": "2.x", "triton": "3.6.0", "git_commit": "abc",
            "src_dirty": "yes", "date": "2026-12-01T00:00:00+00:00"}
    paths = harness.write_reports(rows, meta, 4000.0, tmp_path)
    with paths["csv"].open(newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 5 and got[0]["gpu"] == "FakeGPU" and got[0]["git_commit"] == "abc"
    assert got[0]["roofline_gbps"] == "4000.0" and got[0]["src_dirty"] == "yes"
    for col in ("median_us", "gbps", "pct_roofline", "graph_pct_roofline", "kv_bytes"):
        assert col in got[0]
    assert float(got[0]["pct_roofline"]) == pytest.approx(100 * float(got[0]["gbps"]) / 4000)
    doc = json.loads(paths["json"].read_text())
    assert doc["meta"]["roofline_gbps"] == 4000.0 and len(doc["rows"]) == 5
    md = paths["md"].read_text()
    assert "| shape" in md and "4,000 GB/s" in md and "unsupported" in md
    assert "- git_commit: abc" in md and "src/ had uncommitted changes" in md
    # the to-beat column: flashinfer-tc (60 us) is the only peer; auto at 50 us beats it
    auto = next(r for r in got if r["impl"] == "auto")
    assert auto["to_beat_us"] == "60.0" and auto["to_beat_peer"] == "flashinfer-tc"
    assert auto["beats"] == "yes" and auto["graph_beats"] == "yes"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.terminal_table(rows)
    assert "ragged-b64-llama8b" in text and "graph µs" in text


def test_compile_metadata():
    assert report.compile_metadata(None) == {}
    kernel = SimpleNamespace(name="_k", n_regs=96, n_spills=0,
                             metadata=SimpleNamespace(shared=16384, num_warps=4, num_stages=2))
    md = report.compile_metadata(kernel)
    assert md == {"name": "_k", "n_regs": 96, "n_spills": 0, "shared_bytes": 16384,
                  "num_warps": 4, "num_stages": 2}
    assert "regs=96" in report.format_kernels({"_k": md})
    dict_md = report.compile_metadata(SimpleNamespace(metadata={"shared": 0, "num_warps": 8}))
    assert dict_md["num_warps"] == 8 and dict_md["n_regs"] is None


def test_a_pipe_in_an_error_stays_in_its_markdown_cell(tmp_path):
    """A peer's error (or peer info) holding ``|`` split the markdown row into extra cells:
    each ``|`` in a cell is ``\\|`` now. The terminal table and the CSV keep the text as is."""
    rows = [{"shape": "s", "impl": "peer", "status": "error", "error": "shape a | b",
             "peer_info": "fa3|v2"},
            {"shape": "s", "impl": "auto", "status": "ok", "median_us": 1.0}]
    md = report.write_markdown(rows, {"gpu": "g"}, None, tmp_path / "b.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table]
    assert len(table) == 4 and len(set(cells)) == 1, table
    assert "error: shape a \\| b" in md and "fa3\\|v2" in md
    assert "error: shape a | b" in report.terminal_table(rows)


def test_compiled_kernels_attributes_one_call(device):
    """The one reader of the launch layer's compile record: only this call's kernels."""
    from pagedattn.bench.profile import compiled_kernels

    b = build_batch(make_shape("t", "smollm2-135m", [5, 17], dtype=torch.float32), device)
    out, kernels = compiled_kernels("split_kv_v4", b)
    assert len(kernels) == 2  # split + merge
    ref = paged_decode_reference(*b.tensors).out
    assert torch.allclose(out.double().cpu(), ref.cpu(), atol=1e-4)
    _, again = compiled_kernels("gqa_reuse_v3", b)
    assert len(again) == 1  # the split pair's kernels are not attributed to gqa_reuse_v3


def test_environment_meta_on_cpu():
    meta = report.environment_meta(None)
    assert meta["gpu"].startswith("cpu") and meta["torch"] == torch.__version__
    assert set(report.META_KEYS) <= set(meta)
    assert meta["src_dirty"] in ("yes", "no", "unknown")
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", meta["git_commit"])
    assert "not measured" in report.roofline_line(None)
    assert "4,321 GB/s" in report.roofline_line(4321.0)


# --- the harness loop, with fake timers ---------------------------------------------------

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_bench_shape_with_fake_timers():
    shape = make_shape("tiny", "smollm2-135m", [5, 17, 33], dtype=torch.float32)
    fake = lambda fn: Timing(10.0, 9.0, 11.0, 3)  # noqa: E731
    timers = harness.Timers(fake, fake, lambda fn: 7.5)
    columns = harness.entries(["auto", "gqa_reuse_v3"], ["naive", "flex-paged", "flex-gathered",
                                                        "flashinfer-tc", "flashinfer-xqa"])
    rows = harness.measure_shape(shape, columns, "cpu", timers=timers)
    by = {r["impl"]: r for r in rows}
    for name in ("auto", "gqa_reuse_v3", "naive", "flex-paged", "flex-gathered"):
        assert by[name]["status"] == "ok", by[name]
        assert by[name]["rel_l2_error"] < 1e-4 and by[name]["median_us"] == 10.0
        assert by[name]["gbps"] == pytest.approx(shape.minimal_bytes / 10e-6 / 1e9)
        assert by[name]["graph_median_us"] == 10.0 and by[name]["host_us"] == 7.5
    assert by["flashinfer-tc"]["status"] == by["flashinfer-xqa"]["status"] == "unsupported"
    assert by["auto"]["kernels"] == "" and "_compiled" in by["auto"]  # interpreter: no metadata
    harness.finalize(rows, {"gpu": "cpu"}, 1000.0)
    assert by["auto"]["pct_roofline"] == pytest.approx(100 * by["auto"]["gbps"] / 1000)
    assert by["auto"]["to_beat_us"] == 10.0 and by["auto"]["beats"] == "yes"


def test_bench_shape_reports_failures_and_unsupported(monkeypatch):
    import pagedattn.api as api

    shape = make_shape("tiny8", "llama-3-8b", [3, 20], fp8=True)
    monkeypatch.setattr(api, "_decode", lambda *a, **k: (torch.zeros_like(a[0]), {}))
    rows = harness.measure_shape(shape, harness.entries(["auto", "split_kv_v4"], ["naive"]),
                                 "cpu")
    by = {r["impl"]: r for r in rows}
    assert by["auto"]["status"] == "FAIL" and by["auto"]["rel_l2_error"] == pytest.approx(1.0)
    assert by["split_kv_v4"]["status"] == "unsupported"
    assert by["naive"]["status"] == "unsupported"


def test_bench_main_without_gpu(capsys, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)
    if not torch.cuda.is_available():
        assert harness.main(parser.parse_args(["--out-dir", str(tmp_path)])) == 2
        assert "nothing was measured: no CUDA GPU" in capsys.readouterr().err
        assert not tmp_path.joinpath("bench.md").exists()
    assert harness.main(parser.parse_args(["--list"])) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in PEER_TABLE)
    assert not math.isnan(get_shape("llama8b-b1-c1k").kv_bytes)
