"""``pagedattn run`` (the main job) on the CPU: tiny batches, the oracle, the exit status.
The real kernels run through the interpreter on a tiny shape; the rest monkeypatches
``paged_decode``. No timing happens here."""

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedattn.api as api
from pagedattn.bench import harness
from pagedattn.reference import paged_decode_reference

SRC = Path(__file__).resolve().parents[2] / "src"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_run_arguments(parser)
    return parser.parse_args(list(argv))


def _oracle_decode(query, key_cache, value_cache, block_tables, context_lens, *, impl="auto",
                   k_scale=None, v_scale=None, **_):
    ref = paged_decode_reference(query, key_cache, value_cache, block_tables, context_lens,
                                 k_scale=k_scale, v_scale=v_scale)
    return ref.out.to(query.dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's shrinking and wording")
def test_main_with_the_oracle_as_every_impl(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(api, "_decode", lambda *a, **k: (_oracle_decode(*a, **k), {}))
    out_csv = tmp_path / "run.csv"
    rc = harness.run_main(_args("--model", "smollm2-135m", "--trace", "mooncake", "--batch",
                                "3", "--csv", str(out_csv)))
    text = capsys.readouterr().out
    assert rc == 0
    assert "Shrunk for the CPU interpreter" in text and "interpreter times are not" in text
    assert "mooncake trace, seed 0: 3 requests" in text
    rows = list(csv.DictReader(out_csv.open(newline="")))
    assert [r["impl"] for r in rows] == list(api.IMPLS)
    assert all(r["status"] == "ok" and float(r["rel_l2_error"]) < 1e-2 for r in rows)
    assert rows[0]["torch"] == torch.__version__
    # the file names what was measured: the commit, and (on the CPU) no roofline, no time
    assert rows[0]["git_commit"] and rows[0]["src_dirty"] in ("yes", "no", "unknown")
    assert rows[0]["roofline_gbps"] == "" and rows[0]["median_us"] == ""
    assert rows[0]["host_us"] == ""


def test_failing_or_raising_impls_exit_nonzero(monkeypatch, capsys):
    def broken(query, *args, impl="auto", **kw):
        if impl == "baseline":
            raise RuntimeError("boom")
        if impl == "fused_v1":
            return torch.zeros_like(query), {}
        return _oracle_decode(query, *args, **kw), {}

    monkeypatch.setattr(api, "_decode", broken)  # under paged_decode and compiled_kernels
    rc = harness.run_main(_args("--model", "smollm2-135m", "--batch", "2", "--max-context",
                                "20", "--impls", "baseline,fused_v1,auto"))
    text = capsys.readouterr().out
    assert rc == 1
    assert "RuntimeError: boom" in text and "FAILED: baseline, fused_v1" in text


def test_unknown_impl_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _args("--impls", "fastest", "--batch", "1", "--max-context", "4")
    assert exc.value.code == 2
    assert "unknown impl 'fastest'" in capsys.readouterr().err


def test_real_kernels_on_a_tiny_batch(capsys):
    """The real impls through Triton (the interpreter on the CPU), two cheap ones."""
    rc = harness.run_main(_args("--model", "smollm2-135m", "--batch", "3", "--max-context",
                                "33", "--dtype", "fp32", "--impls", "gqa_reuse_v3,auto"))
    assert rc == 0, capsys.readouterr().out


def test_cli_wiring_help():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    for cmd in ("run", "bench"):
        done = subprocess.run([sys.executable, "-m", "pagedattn.cli", cmd, "--help"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "--impls" in done.stdout
