"""Peers in the bench harness, on the CPU: the ``--peer-file`` protocol, unsupported and
failing peers as cells, the "to beat" column, and ``bench --dry-run`` end to end. Nothing is
timed here (fake timers where a time is needed)."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest
import torch

from pagedattn import cli
from pagedattn.bench import harness
from pagedattn.bench.peers import PeerUnsupported, load_peer_file
from pagedattn.bench.shapes import build_batch, make_shape
from pagedattn.bench.timing import Timing

SDPA_PEER = Path(__file__).parents[1] / "peers" / "torch_sdpa_peer.py"
FLOOR = Path(__file__).resolve().parents[2] / "scripts" / "peers" / "plain_floor.py"

PEER_FILE = '''
import torch
from pagedattn.reference import paged_decode_reference

BUILT = []


def make_runner(query, key_cache, value_cache, block_tables, context_lens, scale):
    BUILT.append(scale)
    if query.shape[0] == 3:
        raise NotImplementedError("toy: no batch of 3")
    if query.shape[0] == 4:
        raise RuntimeError("toy: broken on batch 4")
    out = paged_decode_reference(query, key_cache, value_cache, block_tables, context_lens,
                                 scale=scale).out.to(query.dtype)
    return lambda: out


def tuned(query, key_cache, value_cache, block_tables, context_lens, scale, k_scale=None,
          v_scale=None):
    out = paged_decode_reference(query, key_cache, value_cache, block_tables, context_lens,
                                 scale=scale, k_scale=k_scale, v_scale=v_scale).out
    return (lambda: out.to(query.dtype)), {"block_n": 64, "waves": 4}


def not_a_runner(*args):
    return 42


def returns_none(query, key_cache, value_cache, block_tables, context_lens, scale):
    return lambda: None


def returns_a_wrong_shape(query, key_cache, value_cache, block_tables, context_lens, scale):
    return lambda: torch.zeros(3)
'''


@pytest.fixture
def peer_path(tmp_path) -> Path:
    path = tmp_path / "toy_peer.py"
    path.write_text(textwrap.dedent(PEER_FILE))
    return path


def _rows(shape, peers, timers=harness.UNTIMED):
    return {r["impl"]: r for r in harness.measure_shape(
        shape, harness.entries([], [], peers), "cpu", timers=timers)}


def test_peer_file_names_and_errors(peer_path):
    assert load_peer_file(str(peer_path)).name == "toy_peer"
    assert load_peer_file(f"{peer_path}:tuned").name == "toy_peer.tuned"
    assert load_peer_file(f"mine={peer_path}:tuned").name == "mine"
    named = peer_path.with_name("named.py")
    named.write_text(peer_path.read_text() + "\nPEER_NAME = 'toy-v2'\n")
    assert load_peer_file(str(named)).name == "toy-v2"
    with pytest.raises(ValueError, match="no such file"):
        load_peer_file(str(peer_path.with_name("absent.py")))
    with pytest.raises(ValueError, match="no function 'nope'.*make_runner, tuned"):
        load_peer_file(f"{peer_path}:nope")
    broken = peer_path.with_name("broken.py")
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="import failed: ModuleNotFoundError"):
        load_peer_file(str(broken))
    quits = peer_path.with_name("quits.py")
    quits.write_text("import sys\nsys.exit(0)\n")  # ended `bench` silently with status 0
    with pytest.raises(ValueError, match="import failed: SystemExit"):
        load_peer_file(str(quits))


def test_peer_file_rows_are_checked_against_the_oracle(peer_path):
    shape = make_shape("t", "smollm2-135m", [5, 17], dtype=torch.float32)
    fake = lambda fn: Timing(10.0, 9.0, 11.0, 3)  # noqa: E731
    by = _rows(shape, [load_peer_file(str(peer_path)), load_peer_file(f"{peer_path}:tuned"),
                       load_peer_file(f"{peer_path}:not_a_runner")],
               harness.Timers(fake, fake, None))
    toy, tuned, bad = by["toy_peer"], by["toy_peer.tuned"], by["toy_peer.not_a_runner"]
    assert toy["status"] == tuned["status"] == "ok" and toy["rel_l2_error"] < 1e-6
    assert toy["kind"] == "peer" and toy["graph_median_us"] == 10.0
    assert json.loads(tuned["peer_info"]) == {"block_n": 64, "waves": 4}
    assert bad["status"] == "error" and "not a callable" in bad["error"]


def test_peer_file_unsupported_and_failing_shapes_are_cells(peer_path):
    peer = load_peer_file(str(peer_path))
    assert _rows(make_shape("b3", "smollm2-135m", [1, 2, 3]), [peer])["toy_peer"]["status"] \
        == "unsupported"
    row = _rows(make_shape("b4", "smollm2-135m", [1, 2, 3, 4]), [peer])["toy_peer"]
    assert row["status"] == "error" and "broken on batch 4" in row["error"]
    fp8 = make_shape("fp8", "llama-3-8b", [20, 5], fp8=True)
    by = _rows(fp8, [peer, load_peer_file(f"{peer_path}:tuned")])
    assert by["toy_peer"]["status"] == "unsupported" and "k_scale" in by["toy_peer"]["error"]
    assert by["toy_peer.tuned"]["status"] == "ok"  # takes the scales: checked like ours


@pytest.mark.parametrize("func, got", [("returns_none", "NoneType"),
                                       ("returns_a_wrong_shape", "(3,)")])
def test_a_runner_returning_no_output_is_an_error_cell(peer_path, func, got):
    """The output check ran outside the harness's try: a runner returning None or a tensor of
    another shape ended the whole benchmark with a traceback instead of making a row."""
    peer = load_peer_file(f"{peer_path}:{func}")
    row = _rows(make_shape("b2", "smollm2-135m", [1, 2]), [peer])[f"toy_peer.{func}"]
    assert row["status"] == "error" and f"the runner returned {got}" in row["error"], row


def test_peer_file_runner_is_built_once_per_batch(peer_path):
    peer = load_peer_file(str(peer_path))
    shape = make_shape("t", "smollm2-135m", [5])
    b = build_batch(shape, "cpu", poison=False)
    first = peer.factory(shape, b, False)
    assert peer.factory(shape, b, True) is first  # graph capture reuses the tuned runner
    assert peer.factory(shape, build_batch(shape, "cpu", poison=False), False) is not first


def test_the_repository_peer_file_runs_as_a_passing_row():
    """tests/peers/torch_sdpa_peer.py (plain torch SDPA over the gathered pages) loads by its
    PEER_NAME and passes the float64 oracle check on bf16, fp8 (its scales) and an empty
    sequence, beside auto, as any --peer-file peer does."""
    peer = load_peer_file(str(SDPA_PEER))
    assert peer.name == "torch-sdpa"
    for shape in (make_shape("t", "llama-3-8b", [0, 5, 17, 40]),
                  make_shape("t8", "llama-3-8b", [9, 33], fp8=True)):
        row = _rows(shape, [peer])["torch-sdpa"]
        assert row["status"] == "ok", row
        assert row["rel_l2_error"] <= row["tolerance"]


def test_a_broken_repository_peer_fails_its_check(tmp_path):
    """The same file with its softmax scale doubled gives a FAIL cell (the check is real)."""
    broken = tmp_path / "sdpa_broken.py"
    broken.write_text(SDPA_PEER.read_text().replace("scale=scale,", "scale=2 * scale,"))
    peer = load_peer_file(f"broken={broken}")
    row = _rows(make_shape("t", "llama-3-8b", [5, 17, 40]), [peer])["broken"]
    assert row["status"] == "FAIL" and row["rel_l2_error"] > row["tolerance"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the CPU the floor cannot run")
def test_the_plain_floor_loads_and_fails_as_a_cell_on_the_cpu():
    peer = load_peer_file(f"floor={FLOOR}:best_floor_runner")
    row = _rows(make_shape("t", "llama-3-8b", [5, 17]), [peer])["floor"]
    assert row["status"] == "error" and "no config ran" in row["error"]


def test_flashinfer_peers_are_unsupported_without_cuda():
    from pagedattn.bench.peers import flashinfer_tc, flashinfer_xqa

    shape = make_shape("t", "llama-3-8b", [5])
    b = build_batch(shape, "cpu", poison=False)
    for factory in (flashinfer_tc, flashinfer_xqa):
        with pytest.raises(PeerUnsupported, match="needs CUDA"):
            factory(shape, b)


def _row(shape, impl, kind, status="ok", us=None, graph_us=None):
    return {"shape": shape, "impl": impl, "kind": kind, "status": status, "median_us": us,
            "graph_median_us": graph_us}


def test_to_beat_is_the_fastest_passing_peer_of_the_same_shape():
    rows = [_row("a", "auto", "ours", us=100.5, graph_us=99.0),  # within 2 % of 99.0
            _row("a", "floor", "peer", "FAIL", us=50.0),  # wrong output: not a target
            _row("a", "fi-tc", "peer", us=100.0, graph_us=98.5),
            _row("a", "eager-only", "peer", us=99.0),  # no graph time: its eager time counts
            _row("b", "auto", "ours", us=80.0),
            _row("b", "naive", "peer", us=70.0)]
    harness.add_to_beat(rows)
    a, b = rows[0], rows[4]
    assert (a["to_beat_us"], a["to_beat_peer"], a["beats"]) == (99.0, "eager-only", "yes")
    assert (a["graph_to_beat_us"], a["graph_to_beat_peer"]) == (98.5, "fi-tc")
    assert a["graph_beats"] == "yes"  # 99.0 <= 1.02 * 98.5
    assert (b["to_beat_us"], b["beats"]) == (70.0, "no")
    assert "beats" not in rows[2]  # only our rows get a verdict


def test_bench_dry_run_with_a_peer_file(peer_path, tmp_path, capsys):
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--dry-run", "--shapes", "llama8b-b1-c1k", "--impls",
                   "gqa_reuse_v3", "--peers", "none", "--peer-file", f"toy={peer_path}",
                   "--out-dir", str(out)])
    assert rc == 0, capsys.readouterr()
    rows = list(csv.DictReader((out / "bench.csv").open(newline="")))
    assert [(r["impl"], r["status"]) for r in rows] == [("gqa_reuse_v3", "ok"), ("toy", "ok")]
    assert rows[0]["median_us"] == "" and rows[0]["host_us"] == ""  # nothing timed
    md = (out / "bench.md").read_text()
    assert "not measured in this run" in md and "git_commit" in md
    assert "nothing was timed" in md and "median over cold-L2" not in md
    assert not (out / "bench_roofline.png").exists()  # no chart without data


def test_a_peer_named_like_another_row_is_refused_in_one_line(peer_path, tmp_path, capsys):
    """``--peer-file auto=...`` made two rows named auto (the table keys on the name)."""
    rc = cli.main(["bench", "--dry-run", "--shapes", "llama8b-b1-c1k", "--impls", "auto",
                   "--peers", "none", "--peer-file", f"auto={peer_path}",
                   "--out-dir", str(tmp_path / "bench")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--peer-file: the row name 'auto' is taken twice" in err


def test_sass_beside_floor_counts_both_token_loops():
    """scripts/sass_beside_floor.py compiles auto's decode kernel as an H100 plans b1-c32k and
    the floor's split kernel at the same tile for sm_90 (no GPU), and counts each one's
    instructions in its token loop (tensor-core instructions in both) and outside it; a bad
    argument is one line and exit 2."""
    import re

    from _scripts import run_script

    run = run_script("sass_beside_floor.py", interpret=False, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(re.findall(r"^(auto|floor): \w+, \d+ instructions, (\d+) in the token loop",
                             run.stdout, re.M))
    assert set(counts) == {"auto", "floor"} and all(int(n) > 0 for n in counts.values())
    loops = re.findall(r"^  loop: (.*)$", run.stdout, re.M)
    assert len(loops) == 2 and all("HMMA" in line for line in loops), run.stdout
    bad = run_script("sass_beside_floor.py", "--batch", "0", interpret=False, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
