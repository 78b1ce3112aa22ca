"""The MLA lab's logic on the CPU (``pagedattn.bench.mla``): the rows' limits from their
shapes, a dry run of every row checked against the float64 oracle, the peer's
``unsupported`` cell, a failing impl failing the run, the columns' arithmetic with a stand-in
timer, and the command line's refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pagedattn.bench import mla as lab


def test_rows_are_the_issues():
    names = [s.name for s in lab.MLA_SHAPES]
    assert names[:5] == ["ds-tp1-b64-c4k", "ds-tp1-b128-c2k", "ds-tp1-b1-c32k",
                         "ds-tp8-b64-c4k", "ds-tp8-b128-c8k"]
    assert any(s.cache_dtype == torch.float8_e4m3fn for s in lab.MLA_SHAPES)
    assert {s.name for s in lab.MLA_SHAPES if s.soft_cap or s.sinks} == {
        "softcap-ds-tp8-b64-c4k", "sinks-ds-tp8-b64-c4k"}


def test_limits_from_the_shapes():
    """The issue's arithmetic: 1,152 bytes a bf16 token, 278.5 kFLOP a token at 128 heads
    (242 FLOP a byte), 34.8 kFLOP at 16."""
    tp1 = lab.MLAShape("t", 128, 1, 1000, page_size=64)
    assert lab.mla_flops(tp1) == 2 * 128 * (512 + 64 + 512) * 1000
    latent = 1000 * 576 * 2
    assert lab.mla_minimal_bytes(tp1) == latent + 4 * 16 + 128 * 576 * 2
    assert round(lab.mla_flops(tp1) / latent) == 242
    fp8 = lab.MLAShape("t", 16, 2, 65, page_size=64, cache_dtype=torch.float8_e4m3fn)
    assert lab.mla_minimal_bytes(fp8) == 130 * 576 + 4 * 4 + 2 * 16 * 576 * 2
    assert lab.mla_flops(fp8) / 130 == 2 * 16 * 1088


def test_dry_run_of_every_row(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert lab.main(["--dry-run", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == [s.name + "-small" for s in lab.MLA_SHAPES]
    for row in rows:
        assert row["ok"] and row["pagedattn err"] <= 3e-2
        assert row["pagedattn us"] == "n/a" and row["limit_us"] == "n/a"
        assert row["flashinfer-mla"].startswith("unsupported")  # no CUDA here
    assert "ds-tp1-b1-c32k-small" in capsys.readouterr().out


def test_a_wrong_output_fails_the_run(monkeypatch):
    real = lab.ours

    def wrong(shape, inputs, sinks):
        fn = real(shape, inputs, sinks)
        return lambda: fn() * 1.5

    monkeypatch.setattr(lab, "ours", wrong)
    assert lab.main(["--dry-run", "--rows", "ds-tp8-b64-c4k", "--no-peers"]) == 1


def test_columns_with_a_stand_in_timer():
    """Graph or eager, the faster counts: TFLOP/s, % of the size-matched limit and of the
    peak from it."""
    timing = SimpleNamespace(time_read=lambda n, reps: SimpleNamespace(median_us=10.0),
                             time_cold=lambda fn, reps: SimpleNamespace(median_us=25.0),
                             time_graph=lambda fn, reps: SimpleNamespace(median_us=20.0))
    shape = lab.MLAShape("ds-tp8-b64-c4k", 16, 64, 4096).small()
    row = lab.measure_row(shape, device="cpu", dry_run=False, reps=3, peak_tflops=100.0,
                          peers=(), timing=timing)
    flops = lab.mla_flops(shape)
    assert row["pagedattn us"] == 25.0 and row["pagedattn graph us"] == 20.0
    assert row["pagedattn tflops"] == pytest.approx(flops / 20.0 / 1e6)
    assert row["pagedattn % limit"] == pytest.approx(50.0)
    assert row["pagedattn % peak"] == pytest.approx(flops / 20.0 / 1e6)  # of 100 TFLOP/s
    assert row["ok"]


def test_command_line_refusals(capsys):
    assert lab.main(["--dry-run", "--rows", "nope"]) == 2
    assert "unknown row 'nope'" in capsys.readouterr().err
    assert lab.main(["--dry-run", "--reps", "0"]) == 2
    if not torch.cuda.is_available():
        assert lab.main([]) == 2
        assert "nothing measured" in capsys.readouterr().err
