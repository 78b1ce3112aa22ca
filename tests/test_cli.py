"""The ``pagedattn`` command line: every numeric argument is range-checked by argparse (one line,
exit status 2, no traceback), and ``profile``/``ladder`` without a GPU say that nothing was
measured and exit non-zero. Charts label their axis by its scale."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedattn import _cli_types as T
from pagedattn import cli

SRC = Path(__file__).resolve().parents[1] / "src"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")

#: (argv, what the one-line error must mention)
BAD = [
    (["run", "--batch", "-3"], "argument --batch: expected a positive integer, got '-3'"),
    (["run", "--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["run", "--max-context", "-5"], "argument --max-context: expected a positive integer"),
    (["run", "--max-context", "0"], "argument --max-context"),
    (["run", "--seed", "-1"], "argument --seed: expected a non-negative integer"),
    (["run", "--reps", "0"], "argument --reps"),
    (["run", "--warmup", "x"], "argument --warmup: expected a non-negative integer, got 'x'"),
    (["run", "--host-calls", "2.5"], "argument --host-calls"),
    (["run", "--impls", "fastest"], "unknown impl 'fastest'"),
    (["run", "--model", "gpt5"], "argument --model: invalid choice"),
    (["bench", "--reps", "0"], "argument --reps: expected a positive integer"),
    (["bench", "--warmup", "-1"], "argument --warmup"),
    (["bench", "--host-calls", "0"], "argument --host-calls"),
    (["bench", "--seed", "-2"], "argument --seed"),
    (["bench", "--shapes", "nope"], "unknown shape 'nope'"),
    (["bench", "--peers", "vllm"], "unknown peer 'vllm'"),
    (["bench", "--impls", ""], "argument --impls"),
    (["bench", "--peer-file", "/no/such/peer.py"], "peer file: no such file"),
    (["profile", "--warmup", "-1"], "argument --warmup"),
    (["profile", "--repeat", "0"], "argument --repeat: expected a positive integer"),
    (["profile", "--impl", "nope"], "unknown impl 'nope'"),
    (["profile", "--shape", "nope"], "argument --shape: invalid choice"),
    (["ladder", "--warmup", "-2"], "argument --warmup"),
    (["ladder", "--shapes", "a,b"], "unknown shape 'a', 'b'"),
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedattn"), err
    assert message in err and "(see --help)" in err and "Traceback" not in err


def test_a_bad_value_in_a_real_process_prints_no_traceback():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "pagedattn.cli", "run", "--batch", "-3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "pagedattn run: error: argument --batch: expected a positive integer, got '-3' "
        "(see --help)"]


def test_type_functions():
    assert T.positive_int("7") == 7 and T.nonneg_int("0") == 0
    assert T.positive_float("0.5") == 0.5 and T.nonneg_float("0") == 0.0
    for fn, text in ((T.positive_int, "0"), (T.positive_int, "1.5"), (T.nonneg_int, "-1"),
                     (T.positive_float, "0"), (T.positive_float, "nan"),
                     (T.nonneg_float, "inf"), (T.nonneg_float, "-0.1")):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            fn(text)
    parse = T.name_list(("a", "b", "c"), what="thing", presets={"all": ("a", "b", "c")},
                        allow_none=True)
    assert parse("c, a") == ["c", "a"] and parse("all") == ["a", "b", "c"] and parse("none") == []
    with pytest.raises(argparse.ArgumentTypeError, match="unknown thing 'd'.*all, none, a, b, c"):
        parse("a,d")


@cpu_only
@pytest.mark.parametrize("command", ["profile", "ladder"])
def test_profile_and_ladder_without_a_gpu_measure_nothing_and_say_so(command, tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "o")] + (["--out", str(tmp_path / "l.md")]
                                                if command == "ladder" else [])
    assert cli.main([command, *out]) == 1
    err = capsys.readouterr().err
    assert f"pagedattn {command}: nothing was measured: no CUDA GPU" in err
    assert "--dry-run" in err and not (tmp_path / "o").exists() and not (tmp_path / "l.md").exists()


@cpu_only
def test_an_unwritable_output_is_one_line(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    import pagedattn.api as api
    from pagedattn.reference import paged_decode_reference

    monkeypatch.setattr(api, "_decode", lambda *a, impl="auto", **k: (
        paged_decode_reference(*a).out.to(a[0].dtype), {}))
    rc = cli.main(["run", "--batch", "1", "--max-context", "3", "--impls", "auto",
                   "--csv", str(blocker / "x.csv")])
    assert rc == 1
    err = capsys.readouterr().err  # the progress bar also writes to stderr, on its own line
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("pagedattn run: error: [Errno")
    assert "Traceback" not in err


# --- chart axes say the scale they have ----------------------------------------------------------

def _profiles(shape: str):
    from pagedattn.bench.ncu import KernelCounters
    from pagedattn.bench.profile import SOURCE_EVENTS, ImplProfile

    return [ImplProfile(impl, shape, SOURCE_EVENTS,
                        [KernelCounters("_k", {"regs": 40.0, "occ_theoretical": 50.0})], us, 10**8)
            for impl, us in (("baseline", 5000.0), ("fused_v1", 400.0), ("auto", 90.0))]


def test_chart_labels_match_their_scale(tmp_path, monkeypatch):
    from pagedattn.bench import ladder

    axes = {}

    def keep(fig, path):
        axes[Path(path).stem] = fig.axes[0]
        return Path(path)

    monkeypatch.setattr(ladder, "_save", keep)
    by_shape = {"seed-fp32-b64-c2048": _profiles("seed-fp32-b64-c2048")}
    ladder.plot_durations(by_shape, tmp_path / "d.png")
    ladder.plot_bandwidth(by_shape, 4000.0, tmp_path / "b.png")
    ladder.plot_occupancy(by_shape, tmp_path / "o.png")
    for ax in axes.values():
        assert ("log scale" in ax.get_ylabel()) == (ax.get_yscale() == "log"), ax.get_ylabel()
    assert axes["d"].get_yscale() == "log" and axes["b"].get_yscale() == "linear"
    # nothing timed and no counters: no chart at all
    empty = {"s": [p.__class__(p.impl, "s", p.source) for p in by_shape["seed-fp32-b64-c2048"]]}
    assert ladder.plot_durations(empty, tmp_path / "e.png") is None
    assert ladder.plot_bandwidth(empty, None, tmp_path / "e.png") is None
    assert ladder.plot_occupancy(empty, tmp_path / "e.png") is None
