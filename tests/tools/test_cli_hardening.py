"""The command line of issue 28, on the CPU: ``TRITON_INTERPRET=0`` without a GPU is one line;
every output path a subcommand writes (defaults included) is resolved and checked before the
work; ``ladder`` writes under ``out/``; a peer's error is kept whole and makes ``bench`` exit 1;
long CPU jobs say how long they take (``bench-model`` refuses without ``--yes``); option names
agree across subcommands and every option has a help text."""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedattn import cli
from pagedattn._cli_types import OneLineParser

SRC = Path(__file__).resolve().parents[2] / "src"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")


def _rc(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse exits from inside parse_args
        return e.code


@pytest.fixture
def no_work(monkeypatch):
    """Any kernel launch, model load or benchmark body fails the test: the checks under test
    must come first."""
    import pagedattn.api as api
    from pagedattn.serving import bench_model
    from pagedattn.serving import model as model_module

    def fail(*a, **k):
        raise AssertionError("work started before the check")
    monkeypatch.setattr(api, "_decode", fail)
    monkeypatch.setattr(model_module.Transformer, "from_gguf", fail)
    monkeypatch.setattr(bench_model, "run_benchmark", fail)


# --- 1. TRITON_INTERPRET=0 without a GPU ------------------------------------------------------

def _every_command(tmp_path) -> list[list[str]]:
    return [["run"], ["bench", "--dry-run", "--out-dir", str(tmp_path / "b")],
            ["profile", "--dry-run", "--out-dir", str(tmp_path / "p")],
            ["ladder", "--dry-run", "--out-dir", str(tmp_path / "l")],
            ["generate", "Hi", "--max-new-tokens", "2"],
            ["bench-model", "--tiny", "--out", str(tmp_path / "s")]]


@cpu_only
@pytest.mark.parametrize("value", ["0", "false", ""])
def test_interpreter_turned_off_without_a_gpu_is_one_line_for_every_command(
        value, tmp_path, capsys, monkeypatch, no_work):
    """``generate`` printed a 62-line traceback, ``run`` reported every impl as an error row
    and exited 1; now every subcommand says what to do in one line, exit status 2."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    for argv in _every_command(tmp_path):
        assert _rc(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, (argv, captured)
        assert captured.err.startswith(f"pagedattn {argv[0]}: error: TRITON_INTERPRET="
                                       f"{value!r} turns Triton's interpreter off")
        assert "set TRITON_INTERPRET=1" in captured.err and "unset TRITON_INTERPRET" in \
            captured.err
    assert not any(tmp_path.iterdir())  # nothing written


@cpu_only
def test_interpreter_turned_off_leaves_bench_list_working(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert cli.main(["bench", "--list"]) == 0
    assert "llama8b-b1-c1k" in capsys.readouterr().out


def test_is_interpreter_reads_the_variable_as_triton_does(monkeypatch):
    from pagedattn._env import is_interpreter
    from pagedattn.launch._triton_compat import triton_reads_true

    for value in ("1", "0", "true", "false", "TRUE", "on", "off", "yes", "no", "y", "2", "",
                  " 1"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert is_interpreter() == triton_reads_true("TRITON_INTERPRET"), value


@cpu_only
def test_generate_with_the_interpreter_off_in_a_real_process():
    env = {**os.environ, "PYTHONPATH": str(SRC), "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "pagedattn.cli", "generate", "Hi",
                           "--max-new-tokens", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("pagedattn generate: error: TRITON_INTERPRET='0'")


# --- 2. output paths resolved and checked before the work -------------------------------------

def _bad_path(kind: str, tmp_path: Path, name: str) -> Path:
    """``tmp_path/<name>`` made unwritable the way ``kind`` says."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dangling":
        path.symlink_to(tmp_path / "gone" / "target")
    elif kind == "loop":
        path.symlink_to(tmp_path / "loop-b")
        (tmp_path / "loop-b").symlink_to(path)
    elif kind == "directory":
        path.mkdir()
    return path


_BENCH = ["bench", "--dry-run", "--impls", "auto", "--peers", "none", "--shapes",
          "llama8b-b1-c1k", "--out-dir", "{tmp}/b"]
_LADDER = ["ladder", "--dry-run", "--out-dir", "{tmp}/l"]
#: (argv, the path under tmp_path made bad, the option the error names, the kinds tried): the
#: path given, or a file the command writes inside it or beside it
WRITERS = [
    (["run", "--impls", "auto", "--csv", "{tmp}/rows.csv"], "rows.csv", "--csv",
     ("dangling", "loop")),
    (_BENCH, "b", "--out-dir", ("dangling", "loop")),
    (_BENCH, "b/bench.csv", "--out-dir", ("dangling", "directory")),
    (["profile", "--dry-run", "--out-dir", "{tmp}/p"], "p", "--out-dir", ("dangling", "loop")),
    (["profile", "--dry-run", "--out-dir", "{tmp}/p"], "p/profile_seed-fp32-b64-c2048-small.md",
     "--out-dir", ("dangling", "directory")),
    (_LADDER, "l", "--out-dir", ("dangling", "loop")),
    (_LADDER, "l/ladder-small.md", "--out-dir", ("dangling", "directory")),  # the default page
    ([*_LADDER, "--out", "{tmp}/page.md"], "page.md", "--out", ("dangling", "loop")),
    ([*_LADDER, "--out", "{tmp}/page.md"], "page-duration.png", "--out", ("directory",)),
    (["bench-model", "--tiny", "--out", "{tmp}/serving"], "serving.json", "--out",
     ("dangling", "loop", "directory")),
]
CASES = [pytest.param(argv, bad, option, kind, id=f"{argv[0]} {bad} {kind}")
         for argv, bad, option, kinds in WRITERS for kind in kinds]


@cpu_only
@pytest.mark.parametrize("argv,bad,option,kind", CASES)
def test_an_output_that_cannot_be_written_fails_before_the_work(argv, bad, option, kind,
                                                                tmp_path, capsys, no_work):
    """A dangling symlink, a symlink loop or a directory where the command writes (the path
    given, ``bench.csv`` in ``--out-dir``, ``ladder``'s default page, a chart beside
    ``--out``, ``PREFIX.json``) passed the check and failed after the work: now one line,
    exit status 2, before any kernel or model load."""
    target = _bad_path(kind, tmp_path, bad)
    rc = _rc([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{option}: cannot write" in err, err
    why = {"dangling": "which does not exist", "loop": "is a symlink loop",
           "directory": "is a directory"}[kind]
    assert why in err, err
    assert target.is_symlink() or target.is_dir()  # left as it was


def test_checked_output_follows_a_symlink_that_resolves(tmp_path):
    from pagedattn._cli_types import checked_output

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert checked_output(tmp_path / "link" / "a" / "x.csv", "--csv") == \
        tmp_path / "link" / "a" / "x.csv"
    assert checked_output(tmp_path / "link", "--out-dir", directory=True) == tmp_path / "link"
    (tmp_path / "file").write_text("")
    (tmp_path / "to-file").symlink_to(tmp_path / "file" / "below")  # a target under a file
    with pytest.raises(ValueError, match="--csv: cannot write .*cannot be reached"):
        checked_output(tmp_path / "to-file", "--csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "real", "to-file"]


@cpu_only
def test_bench_model_checks_its_default_output_before_the_work(tmp_path, capsys, monkeypatch,
                                                               no_work):
    """Without ``--out`` the files are ``docs/results/serving-cpu.{json,md}``: argparse never
    type-checks a default, so the command checks it itself."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results").symlink_to(tmp_path / "nowhere")
    assert _rc(["bench-model", "--tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedattn bench-model: error: --out: cannot write") and \
        "which does not exist" in err, err


# --- 3. ladder writes under out/ ----------------------------------------------------------------

def test_ladder_on_a_gpu_writes_under_its_out_dir_not_over_docs(tmp_path, capsys, monkeypatch):
    """The measured (not shrunken) page went to ``docs/ladder-h200.md``, the committed page:
    now ``<out-dir>/ladder.md`` (``out/ladder``), unless ``--out`` names a page. The GPU is
    faked (``torch.cuda.is_available``, the profiles and the roofline); the page is real."""
    from pagedattn.bench import ladder, profile, report
    from pagedattn.bench.ncu import KernelCounters

    def fake_profiles(impls, shape_name, out_dir, **kw):
        shape = profile.resolve_shape(shape_name, kw.get("small", False))
        return [profile.ImplProfile(i, shape.name, profile.SOURCE_EVENTS,
                                    [KernelCounters("_k", {"regs": 40.0})], 100.0 + n,
                                    shape.minimal_bytes) for n, i in enumerate(impls)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile, "profile_impls", fake_profiles)
    monkeypatch.setattr(profile, "measure_roofline", lambda: 4000.0)
    monkeypatch.setattr(report, "environment_meta", lambda device=None: {"gpu": "FakeGPU"})
    monkeypatch.setattr(ladder, "gpu_note", lambda env, roofline: "")  # reads the device
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "docs" / "ladder-h200.md"
    committed.parent.mkdir()
    committed.write_text("the committed page\n")
    parser = argparse.ArgumentParser()
    ladder.add_arguments(parser)
    args = parser.parse_args(["--no-ncu", "--shapes", "seed-fp32-b64-c2048"])
    ladder.main(args)
    assert committed.read_text() == "the committed page\n"
    page = tmp_path / "out" / "ladder" / "ladder.md"
    assert page.exists() and "seed-fp32-b64-c2048" in page.read_text()
    assert (tmp_path / "out" / "ladder" / "ladder.csv").exists()
    assert f"wrote {Path('out/ladder/ladder.md')}" in capsys.readouterr().out
    args = parser.parse_args(["--no-ncu", "--shapes", "seed-fp32-b64-c2048", "--out-dir",
                              str(tmp_path / "mine")])
    ladder.main(args)
    assert (tmp_path / "mine" / "ladder.md").exists()


# --- 4. a broken peer: its whole error, and exit status 1 ---------------------------------------

LONG = "toy: broken " + " ".join(f"part{i:03d}" for i in range(60)) + " END"  # ~500 characters
PEER = f'''
from pagedattn.reference import paged_decode_reference


def broken(query, key_cache, value_cache, block_tables, context_lens, scale):
    raise RuntimeError({LONG!r})


def unsupported(query, key_cache, value_cache, block_tables, context_lens, scale):
    raise NotImplementedError("toy: not this shape")
'''


@pytest.fixture
def peer_path(tmp_path) -> Path:
    path = tmp_path / "toy_peer.py"
    path.write_text(textwrap.dedent(PEER))
    return path


def _bench(peer_arg: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "--dry-run", "--shapes", "llama8b-b1-c1k", "--impls", "gqa_reuse_v3",
            "--peers", "none", "--peer-file", peer_arg, "--out-dir", str(out), *extra]


@cpu_only
def test_a_broken_peer_keeps_its_whole_error_and_fails_the_run(peer_path, tmp_path, capsys):
    out = tmp_path / "b"
    assert cli.main(_bench(f"toy={peer_path}:broken", out)) == 1
    printed = capsys.readouterr().out
    rows = list(csv.DictReader((out / "bench.csv").open(newline="")))
    toy = next(r for r in rows if r["impl"] == "toy")
    assert toy["status"] == "error" and toy["error"] == f"RuntimeError: {LONG}"
    doc = json.loads((out / "bench.json").read_text())
    assert next(r for r in doc["rows"] if r["impl"] == "toy")["error"] == f"RuntimeError: {LONG}"
    md = (out / "bench.md").read_text()
    assert "| error [1]" in md and f"- [1] llama8b-b1-c1k-small / toy: RuntimeError: {LONG}" in md
    assert "error [1]" in printed and " ".join(printed.split()).count(LONG) >= 1
    notes = [line for line in printed.splitlines() if "part0" in line]
    assert len(notes) > 1 and max(map(len, notes)) <= 100  # wrapped, not one long line
    assert "FAILED llama8b-b1-c1k-small / toy (peer): error (see its note)" in printed
    assert cli.main(_bench(f"toy={peer_path}:broken", out, "--allow-errors")) == 0


@cpu_only
def test_an_unsupported_peer_does_not_fail_the_run(peer_path, tmp_path, capsys):
    assert cli.main(_bench(f"toy={peer_path}:unsupported", tmp_path / "b")) == 0
    assert "unsupported: toy: not this shape" in capsys.readouterr().out


def test_a_timing_that_raises_is_an_error_and_an_unsupported_one_is_not():
    from pagedattn.bench import harness
    from pagedattn.bench.peers import PeerUnsupported
    from pagedattn.bench.shapes import make_shape
    from pagedattn.bench.timing import Timing

    def broken(fn):
        raise RuntimeError("capture failed " + "x" * 400)

    def no_graph(fn):
        raise PeerUnsupported("naive: no graph")
    shape = make_shape("t", "smollm2-135m", [5, 9], dtype=torch.float32)
    fine = lambda fn: Timing(10.0, 9.0, 11.0, 3)  # noqa: E731
    rows = harness.measure_shape(shape, harness.entries([], ["naive"]), "cpu",
                                 timers=harness.Timers(fine, no_graph))
    assert rows[0]["status"] == "ok" and rows[0]["error"] == "graph_timing unsupported: naive: " \
        "no graph"
    assert harness.bench_status(rows) == 0
    rows = harness.measure_shape(shape, harness.entries([], ["naive"]), "cpu",
                                 timers=harness.Timers(fine, broken, lambda fn: 1.0))
    assert rows[0]["error"] == "graph_timing: RuntimeError: capture failed " + "x" * 400
    assert harness.errored(rows[0]) and harness.bench_status(rows) == 1
    assert harness.bench_status(rows, allow_errors=True) == 0
    fail = [{**rows[0], "kind": "ours", "status": "FAIL", "_timing_error": False}]
    assert harness.bench_status(fail, allow_errors=True) == 1  # a wrong result of ours
    peer_fail = [{**rows[0], "status": "FAIL", "_timing_error": False}]
    assert harness.bench_status(peer_fail) == 0  # a peer's own wrong result: reported only


# --- 5. long CPU jobs say how long, bench-model refuses without --yes ---------------------------

SMOKE = ["bench-model", "--new-tokens", "2", "--batches", "1", "--trace-requests", "0",
         "--no-hf", "--out", "out/serving"]


@cpu_only
def test_bench_model_defaults_on_the_cpu_refuse_without_yes(tmp_path, capsys, monkeypatch,
                                                            no_work):
    from pagedattn.serving import bench_model

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.gguf"  # the magic bytes pass --gguf's check; nothing is loaded
    model.write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setenv("PAGEDATTN_GGUF", str(model))
    assert _rc(["bench-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedattn bench-model: error: --yes not "
                                                   "given: on the CPU these settings take about")
    assert " h in Triton's interpreter" in err  # hours
    assert err.rstrip().removesuffix(" (see --help)").endswith(" ".join(["pagedattn", *SMOKE]))
    assert " ".join(["pagedattn", *SMOKE]) == bench_model.SMOKE_RUN
    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    assert " ".join(bench_model.SMOKE_RUN.split()) in " ".join(usage.split())

    class Ran(Exception):
        pass

    def ran(*a, **k):
        raise Ran
    monkeypatch.setattr(bench_model, "run_benchmark", ran)
    with pytest.raises(Ran):  # --yes: it says how long, then starts
        cli.main(["bench-model", "--yes", "--out", str(tmp_path / "s")])
    assert "bench-model on the CPU: expect about" in capsys.readouterr().err
    with pytest.raises(Ran):  # docs/usage.md's smoke run needs no flag
        cli.main(SMOKE)
    assert "expect about" in capsys.readouterr().err


def test_bench_model_estimate_grows_with_the_work():
    from pagedattn.serving import bench_model

    parser = argparse.ArgumentParser()
    bench_model.add_arguments(parser)
    smoke = bench_model.cpu_seconds(parser.parse_args(SMOKE[1:]))
    defaults = bench_model.cpu_seconds(parser.parse_args([]))
    assert 0 < smoke < bench_model.CPU_LIMIT_S < defaults
    more = bench_model.cpu_seconds(parser.parse_args([*SMOKE[1:], "--new-tokens", "20"]))
    assert more > smoke
    # the engine's steps: 3 requests of 4, 2 and 1 tokens, two at a time, no warm-up
    from pagedattn.serving.runner import engine_steps

    assert engine_steps([4, 2, 1], 2, warm=False) == [2, 1, 1]


@cpu_only
def test_run_and_bench_dry_run_say_how_long_before_the_first_kernel(tmp_path, capsys,
                                                                    monkeypatch):
    import pagedattn.api as api

    seen = []

    def first_kernel(*a, **k):
        seen.append(capsys.readouterr().out)  # what was printed before the first launch
        raise RuntimeError("stop here")
    monkeypatch.setattr(api, "_decode", first_kernel)
    cli.main(["run", "--impls", "baseline,auto"])
    assert "pagedattn run: expect about" in seen[0]
    assert "in Triton's interpreter (2 impls;" in seen[0]
    seen.clear()
    cli.main(["bench", "--dry-run", "--shapes", "llama8b-b1-c1k", "--impls", "auto",
              "--peers", "none", "--out-dir", str(tmp_path)])
    assert "pagedattn bench --dry-run: expect about" in seen[0]


def test_the_run_estimate_scales_with_the_batch_and_the_impls():
    from pagedattn.bench.cpu_time import interpreter_seconds
    from pagedattn.bench.shapes import make_shape

    small = make_shape("s", "llama-3-8b", [3, 20, 32, 7, 11, 5])
    double = make_shape("d", "llama-3-8b", [3, 20, 32, 7, 11, 5] * 2)
    stages = ["baseline", "fused_v1", "vectorized_v2", "gqa_reuse_v3", "split_kv_v4"]
    one = interpreter_seconds(small, stages)
    assert 0 < one < interpreter_seconds(double, stages)
    assert interpreter_seconds(small, ["auto"]) < one
    assert interpreter_seconds(small, ["naive"]) == 0  # a peer: not estimated


# --- 6. consistent option names, every option with a help text ----------------------------------

def _parser(name: str) -> argparse.ArgumentParser:
    if name == "profile target":  # the process ncu profiles (python -m pagedattn.bench.profile)
        from pagedattn.bench.profile import target_parser

        return target_parser()
    parser = OneLineParser(prog=f"pagedattn {name}")
    cli._command(name).add_arguments(parser)
    return parser


NAMES = [*cli.COMMANDS, "profile target"]


def _parsers():
    return [(name, _parser(name)) for name in NAMES]


def _options(parser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", NAMES)
def test_every_option_has_a_help_text(name):
    """A hidden option (help SUPPRESS) is only an old spelling: its dest is a visible
    option's."""
    parser = _parser(name)
    visible = {a.dest for a in _options(parser) if a.help is not argparse.SUPPRESS}
    for action in _options(parser):
        if action.help is argparse.SUPPRESS:
            assert action.dest in visible, (name, action.option_strings)
            continue
        assert action.help and action.help.strip(), (name, action.option_strings or action.dest)


def test_option_names_agree_across_subcommands():
    """A comma list of impls is ``--impls`` everywhere (``profile --impl`` was the odd one),
    repetitions are ``--reps`` (``profile --repeat``); the old spellings still parse."""
    by_dest: dict[str, set[str]] = {}
    for _name, parser in _parsers():
        for a in _options(parser):
            if a.help is not argparse.SUPPRESS:
                by_dest.setdefault(a.dest, set()).update(a.option_strings)
    assert by_dest["impls"] == {"--impls"} and by_dest["reps"] == {"--reps"}
    assert by_dest["out_dir"] == {"--out-dir"} and by_dest["warmup"] == {"--warmup"}
    assert by_dest["impl"] == {"--impl"}  # one impl (generate, the ncu target)
    profile = dict(_parsers())["profile"]
    new = profile.parse_args(["--impls", "auto,baseline", "--reps", "3"])
    old = profile.parse_args(["--impl", "auto,baseline", "--repeat", "3"])
    assert new.impls == old.impls == ["auto", "baseline"] and new.reps == old.reps == 3
    assert profile.parse_args([]).impls == ["auto"] and profile.parse_args([]).reps == 1
    shown = profile.format_help()
    assert "--impls" in shown and "--impl " not in shown and "--repeat" not in shown
