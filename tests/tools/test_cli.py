"""The ``pagedattn`` command line: every numeric argument is range-checked by argparse (one line,
exit status 2, no traceback), so is every output path (before any work), and ``profile``/
``ladder``/``bench`` without a GPU say that nothing was measured and exit 2. Charts label their
axis by its scale.

Then ``pagedattn run`` (the main job) on the CPU: tiny batches, the oracle, the exit status.
The real kernels run through the interpreter on a tiny shape; the rest monkeypatches
``paged_decode``. No timing happens here."""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedattn.api as api
from pagedattn import _cli_types as T
from pagedattn import cli
from pagedattn.bench import harness
from pagedattn.reference import paged_decode_reference

SRC = Path(__file__).resolve().parents[2] / "src"
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
    # past 64 bits: "Overflow when unpacking long long" deep in torch, with a traceback
    (["run", "--batch", "99999999999999999999999"], "argument --batch: expected a positive "
     "integer below 2^63"),
    (["run", "--seed", "18446744073709551616"], "argument --seed: expected a non-negative "
     "integer below 2^63"),
    (["bench", "--seed", "18446744073709551616"], "argument --seed"),
    # the serving commands' parse errors end as every other's (they lacked "(see --help)")
    (["generate", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an "
     "integer in [1, 2^63 - 1], got 0"),
    (["bench-model", "--page-size", "0"], "argument --page-size"),
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


#: (subcommand, its option, the module whose table maps the parsed name to a torch dtype,
#: that table's name, extra argv the subcommand needs)
DTYPE_OPTIONS = [("run", "--dtype", "pagedattn.bench.harness", "DTYPES", []),
                 ("generate", "--dtype", "pagedattn.serving.generate", "DTYPES", ["hi"]),
                 ("generate", "--cache-dtype", "pagedattn.serving.generate", "CACHE_DTYPES",
                  ["hi"]),
                 ("bench-model", "--dtype", "pagedattn.serving.bench_model", "DTYPES", []),
                 ("bench-model", "--cache-dtype", "pagedattn.serving.bench_model",
                  "CACHE_DTYPES", [])]


@pytest.mark.parametrize("command, option, module, table, extra", DTYPE_OPTIONS,
                         ids=[f"{c} {o}" for c, o, *_ in DTYPE_OPTIONS])
def test_every_dtype_option_takes_both_spellings(command, option, module, table, extra):
    """``run --dtype`` took fp32/fp16/bf16, ``generate``/``bench-model`` float32/float16/bfloat16:
    each takes both now (one argparse type, ``_cli_types.dtype_name``), any case."""
    import importlib

    parser = T.OneLineParser(prog=f"pagedattn {command}")
    cli._command(command).add_arguments(parser)
    dtypes = getattr(importlib.import_module(module), table)
    for words, want in ((("fp32", "float32", "FP32"), torch.float32),
                        (("fp16", "float16", "Float16"), torch.float16),
                        (("bf16", "bfloat16", "BFloat16"), torch.bfloat16)):
        for word in words:
            assert dtypes[getattr(parser.parse_args([*extra, option, word]),
                                  option[2:].replace("-", "_"))] is want, word


@pytest.mark.parametrize("argv", [["run", "--dtype", "fp64"], ["generate", "x", "--dtype", "f8"],
                                  ["bench-model", "--cache-dtype", "int8"]])
def test_an_unknown_dtype_lists_both_spellings(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert f"unknown dtype {argv[-1]!r}" in err and "float16 (fp16)" in err, err


@cpu_only
@pytest.mark.parametrize("command", ["profile", "ladder", "bench"])
def test_without_a_gpu_profile_ladder_and_bench_exit_2_and_say_so(command, tmp_path, capsys):
    """The three measuring commands agree: no GPU and no --dry-run is exit status 2 and one
    line on stderr saying nothing was measured; nothing is written."""
    out = ["--out-dir", str(tmp_path / "o")] + (["--out", str(tmp_path / "l.md")]
                                                if command == "ladder" else [])
    assert cli.main([command, *out]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"pagedattn {command}: nothing was measured: no CUDA GPU")
    assert "--dry-run" in captured.err
    assert not (tmp_path / "o").exists() and not (tmp_path / "l.md").exists()


#: (argv before the path, the option named, the path under tmp_path)
OUTPUTS = [(["run", "--csv"], "--csv", "file/x.csv"),
           (["run", "--csv"], "--csv", "."),  # a directory where a file goes
           (["bench", "--out-dir"], "--out-dir", "file/o"),
           (["bench", "--out-dir"], "--out-dir", "file"),  # a file where a directory goes
           (["profile", "--out-dir"], "--out-dir", "file/o"),
           (["ladder", "--out"], "--out", "file/l.md"),
           (["ladder", "--out-dir"], "--out-dir", "file/o")]


@pytest.mark.parametrize("argv,option,path", OUTPUTS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else v)
def test_an_unwritable_output_is_an_argument_error_before_any_work(argv, option, path, tmp_path,
                                                                     capsys, monkeypatch):
    (tmp_path / "file").write_text("")  # "file/x.csv": under a regular file
    import pagedattn.api as api

    def no_work(*a, **k):
        raise AssertionError("a kernel ran before the output path was checked")
    monkeypatch.setattr(api, "_decode", no_work)
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, str(tmp_path / path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagedattn {argv[0]}: error: argument {option}: cannot write"), err


def test_an_output_write_that_fails_later_exits_2_in_one_line(capsys, monkeypatch):
    """A path that passed the check but fails at the write (e.g. /proc/x.csv as root, a full
    disk): still one line and exit status 2, never a traceback."""
    from pagedattn.bench import harness

    def fail(args):
        raise FileNotFoundError(2, "No such file or directory", "/proc/x.csv")
    monkeypatch.setattr(harness.RUN, "main", fail)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert err == "pagedattn run: error: [Errno 2] No such file or directory: '/proc/x.csv'\n"


def test_an_argument_error_after_parsing_exits_2_in_one_line(capsys, monkeypatch):
    """A value a subcommand finds bad only after parsing (T.ArgumentError: a model file, a
    device) is reported by the dispatcher for every subcommand: one line, exit status 2."""
    from pagedattn.bench import harness

    def bad(args):
        raise T.ArgumentError("--device: 'tpu' is not a device")
    monkeypatch.setattr(harness.RUN, "main", bad)
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err == ("pagedattn run: error: --device: 'tpu' is not a device "
                                       "(see --help)\n")


def test_output_path_types_accept_writable_paths(tmp_path):
    assert T.output_file(str(tmp_path / "new" / "deeper" / "x.csv")).endswith("x.csv")
    assert T.output_dir(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    assert T.output_dir(str(tmp_path)) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the check creates nothing
    for fn, bad in ((T.output_file, ""), (T.output_file, str(tmp_path))):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)


@cpu_only
def test_bench_dry_run_shows_no_interpreter_or_flex_warnings(tmp_path, capsys):
    """The interpreter's numpy RuntimeWarnings (log2 / divide of the discarded tl.where side
    on padding rows, fp8 shape) and torch's eager-flex_attention UserWarning are filtered
    while cli.main runs the subcommand (quiet_interpreter_warnings), and only there."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc = cli.main(["bench", "--dry-run", "--shapes", "llama8b-b1-c1k,fp8-llama8b-b64-c8k",
                       "--impls", "auto", "--peers", "flex-paged", "--out-dir",
                       str(tmp_path)])
    assert rc == 0
    noisy = [str(w.message) for w in seen if "divide by zero" in str(w.message)
             or "flex_attention called without torch.compile" in str(w.message)]
    assert noisy == []
    assert "flex_attention" not in capsys.readouterr().err


def test_the_interpreter_warning_filter_is_narrow(monkeypatch):
    import warnings

    from pagedattn._env import quiet_interpreter_warnings

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def emitted(message, category, module):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_interpreter_warnings():
                warnings.warn_explicit(message, category, "x.py", 1, module=module)
        return len(seen)

    interp = "triton.runtime.interpreter"
    assert emitted("divide by zero encountered in log2", RuntimeWarning, interp) == 0
    assert emitted("divide by zero encountered in divide", RuntimeWarning, interp) == 0
    assert emitted("invalid value encountered in log2", RuntimeWarning, interp) == 1
    assert emitted("divide by zero encountered in log2", RuntimeWarning, "mymodule") == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # on a GPU nothing is filtered
    assert emitted("divide by zero encountered in log2", RuntimeWarning, interp) == 1


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


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 799999999992 bytes"),
    MemoryError(),
    RuntimeError("Storage size calculation overflowed with sizes=[9223372036854775807]"),
])
def test_out_of_memory_exits_2_in_one_line(error, capsys, monkeypatch):
    """A batch too large for the machine (``run --batch 99999999999`` fails in the CPU
    allocator) is one line and exit status 2; any other RuntimeError is still raised."""
    from pagedattn.bench import harness

    def fail(args):
        raise error
    monkeypatch.setattr(harness.RUN, "main", fail)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedattn run: error: out of memory"), err

    def bug(args):
        raise RuntimeError("an unexpected failure")
    monkeypatch.setattr(harness.RUN, "main", bug)
    with pytest.raises(RuntimeError, match="unexpected"):
        cli.main(["run"])


def test_a_full_kv_cache_exits_2_in_one_line(capsys, monkeypatch):
    """The serving engine's CacheFullError (a RuntimeError) came out as a traceback."""
    from pagedattn.bench import harness
    from pagedattn.serving.cache import CacheFullError

    def fail(args):
        raise CacheFullError("request 0", 40, 3, 2)
    monkeypatch.setattr(harness.RUN, "main", fail)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedattn run: error: KV cache full: "), err
    assert err.rstrip().endswith("(--num-pages)")


# --- issue 49: settings past the limits, estimates, help -----------------------------------

class _Drawn(Exception):
    """Raised by a stand-in of a step that a refused run must never reach."""


@cpu_only
@pytest.mark.parametrize("argv", [
    ["run", "--batch", "100000000", "--max-context", "100000000"],  # nothing for minutes
    ["run", "--batch", "100000", "--impls", "auto"],  # "expect about 4.0 h" and started
])
def test_run_refuses_settings_past_15_minutes_before_drawing(argv, capsys, monkeypatch):
    """Estimated past 15 minutes of the interpreter: one line, exit 2, before the batch is
    drawn (the least the settings can cost, a token per sequence, decides)."""
    from pagedattn.bench import harness

    monkeypatch.setattr(harness, "sample_context_lens", lambda *a: (_ for _ in ()).throw(
        _Drawn()))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedattn run: error: --yes not given: on "
                                                   "the CPU these settings take about "), err
    assert err.endswith("ask for a smaller --batch or --max-context (see --help)\n")


def test_run_refuses_settings_past_the_memory_free_unless_yes(capsys, monkeypatch):
    """More memory than the machine has free (here: 10 kB free): refused before any
    allocation; with --yes it runs."""
    from pagedattn.bench import harness

    monkeypatch.setattr(harness, "free_memory", lambda device: 10 ** 4)
    argv = ["run", "--impls", "auto", "--batch", "2", "--max-context", "8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedattn run: error: --yes not given: these settings need about "
                          "0.") and "GB of memory (estimated), more than the 0.0 GB free" in err
    assert cli.main([*argv, "--yes"]) == 0


@cpu_only
def test_generate_says_how_long_before_it_loads(capsys, monkeypatch):
    """On the CPU, generate prints its estimate before the model loads (it printed none)."""
    from pagedattn.serving import tokenizer

    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: (_ for _ in ()).throw(
        _Drawn()))
    with pytest.raises(_Drawn):
        cli.main(["generate", "a", "b", "c", "--max-new-tokens", "5", "--max-batch-size", "2"])
    err = capsys.readouterr().err
    assert err.startswith("pagedattn generate: expect up to about ") and "then 8 decode steps" \
        in err  # two rounds of 4 steps (the first token comes from the prefill)


def test_top_level_help_has_no_rest_markup(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "pagedattn command line: a thin argparse shell" in out
    assert "``" not in out


# -- pagedattn run, the main job ----------------------------------------------------------

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
