"""The yardstick of the harness, on the CPU (issue 46, item 1): the minimal-bytes formula, the
size-matched limit's buffer, the clean flush (it reads its buffer and writes nothing there),
the timers every % comes from and the serving-condition step's distinct caches. Nothing is
timed: the timers are fakes or record what they would run."""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

from pagedattn import cli
from pagedattn.bench import harness, step, timing
from pagedattn.bench.shapes import FP8_E4M3, build_batch, get_shape, make_shape, minimal_bytes
from pagedattn.bench.timing import Timing
from pagedattn.testing import make_paged_inputs

# --- minimal bytes: one formula, checked against the bytes of real tensors ------------------


def _bytes_of_tensors(lens, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                      cache_dtype, q_len, table_dtype) -> int:
    """Independent count: build the batch and add up what a decode call must read of it,
    sequence by sequence: every valid token's K and V slots, the used block-table entries,
    the whole query."""
    inputs = make_paged_inputs(lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, page_size=page_size, dtype=dtype,
                               poison=False)
    k = inputs.key_cache.to(cache_dtype)
    table = inputs.block_tables.to(table_dtype)
    query = torch.empty(len(lens), q_len, num_q_heads, head_dim, dtype=dtype)
    total = query.numel() * query.element_size()
    for b, n in enumerate(lens):
        for t in range(n):  # token t of sequence b: its page, its slot
            page = int(table[b, t // page_size])
            total += 2 * k[page, t % page_size].numel() * k.element_size()  # K and V
        used = table[b, :math.ceil(n / page_size)]
        total += used.numel() * used.element_size()
    return total


CASES = {  # name: (lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, cache,
    #          q_len, table dtype)
    "gqa-bf16": ([1, 17, 40], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, 1, torch.int32),
    "fp8-cache": ([5, 33], 8, 2, 64, 16, torch.bfloat16, FP8_E4M3, 1, torch.int32),
    "int64-table": ([16, 0, 3], 9, 3, 64, 16, torch.float16, torch.float16, 1, torch.int64),
    "q_len-4": ([9, 30], 12, 4, 80, 8, torch.float32, torch.float32, 4, torch.int32),
    "page-1-fp8-int64-q3": ([3, 1], 4, 1, 32, 1, torch.bfloat16, FP8_E4M3, 3, torch.int64),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_minimal_bytes_are_exact(case):
    lens, qh, kvh, hd, ps, dtype, cache, q_len, table = CASES[case]
    got = minimal_bytes(lens, num_q_heads=qh, num_kv_heads=kvh, head_dim=hd, page_size=ps,
                        q_dtype=dtype, cache_dtype=cache, q_len=q_len, table_dtype=table)
    want = _bytes_of_tensors(lens, num_q_heads=qh, num_kv_heads=kvh, head_dim=hd,
                             page_size=ps, dtype=dtype, cache_dtype=cache, q_len=q_len,
                             table_dtype=table)
    assert got.total == want
    assert got.kv == 2 * sum(lens) * kvh * hd * (1 if cache == FP8_E4M3 else
                                                 torch.empty((), dtype=cache).element_size())


def test_every_byte_count_of_the_bench_is_the_one_formula():
    """The registry's rows, the harness's ``minimal_bytes`` column and the GB/s divide by
    the same number; an fp8 row by hand: 1-byte K/V, int32 table, bf16 query."""
    s = get_shape("fp8-llama8b-b64-c8k")
    assert s.minimal_bytes == 64 * 8192 * 8 * 128 * 2 + 64 * 512 * 4 + 64 * 32 * 128 * 2
    assert s.byte_counts.total == s.minimal_bytes and s.kv_bytes == s.byte_counts.kv
    ragged = get_shape("ragged-b64-llama8b")
    m = ragged.model
    assert ragged.minimal_bytes == minimal_bytes(
        ragged.context_lens, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, page_size=16, q_dtype=torch.bfloat16,
        cache_dtype=torch.bfloat16).total
    assert harness.base_row(ragged, "auto", "ours")["minimal_bytes"] == ragged.minimal_bytes
    with pytest.raises(ValueError, match="context_lens"):
        minimal_bytes([3, -1], num_q_heads=1, num_kv_heads=1, head_dim=16, page_size=16,
                      q_dtype=torch.float16, cache_dtype=torch.float16)


# --- the size-matched limit's buffer and read --------------------------------------------

@pytest.mark.parametrize("nbytes", [2, 1026, 4097, get_shape("smollm-b1-c2k").minimal_bytes])
def test_the_limit_buffer_holds_exactly_the_bytes(nbytes):
    x = timing.read_buffer(nbytes)
    assert x.is_contiguous() and x.numel() * x.element_size() == nbytes
    assert x.untyped_storage().nbytes() == nbytes
    assert x.dtype == (torch.bfloat16 if nbytes % 2 == 0 else torch.uint8)
    assert bool((x == 1).all())


def test_the_limit_reads_every_byte_of_a_row():
    """The streaming read over a shrunk row's buffer (interpreter) sums every element once,
    in each tile shape the limit tries."""
    nbytes = make_shape("t", "smollm2-135m", [1, 17, 40]).minimal_bytes
    x = timing.read_buffer(nbytes)
    for chunk, block, warps in timing.read_configs(x.numel(), num_sms=4)[-2:]:
        partial = timing.stream_read(x, chunk=chunk, block=block, num_warps=warps)
        assert partial.double().sum().item() == x.numel()
    with pytest.raises(ValueError, match="nbytes"):
        timing.read_buffer(0)


@pytest.mark.parametrize("numel", [1, 786_432, 2**30])
def test_read_configs_fill_the_sms(numel):
    """Besides the fixed tile shapes, one per programs-per-SM target: at most that many
    programs and more than half of it, unless the chunk is already one tile (the buffer is
    too short to cut finer)."""
    sms = 132
    configs = timing.read_configs(numel, sms)
    assert set(timing.READ_CONFIGS) <= set(configs) and len(set(configs)) == len(configs)
    for chunk, block, _ in configs:
        assert chunk % block == 0 and chunk & (chunk - 1) == 0  # power of two, whole tiles
    fitted = configs[len(timing.READ_CONFIGS):]
    for per_sm in timing.READ_PROGRAMS_PER_SM:
        target = per_sm * sms
        assert any(-(-numel // chunk) <= target
                   and (2 * -(-numel // chunk) > target or chunk == block)
                   for chunk, block, _ in fitted), (per_sm, fitted)


# --- the flushes ---------------------------------------------------------------------------

def test_the_flush_plans():
    clean = timing.flush_plan("clean", 60 * 2**20)
    assert clean.op == "read" and clean.nbytes >= 2 * 60 * 2**20
    assert clean.nbytes >= timing.MIN_FLUSH_BYTES
    big = timing.flush_plan("clean", 300 * 2**20)  # an L2 past half the floor: twice the L2
    assert big.nbytes == 600 * 2**20
    assert timing.flush_plan("dirty", 60 * 2**20) == ("dirty", "write", clean.nbytes)
    assert timing.FLUSHES[0] == "clean"
    with pytest.raises(ValueError, match="^flush: expected one of clean, dirty"):
        timing.flush_plan("warm")


def test_the_clean_flush_reads_its_buffer_and_writes_nothing_there():
    l2 = 48 * 1024
    f = timing.make_flush("clean", "cpu", l2_bytes=l2, min_bytes=0)
    assert f.plan.op == "read" and f.buffer.numel() * f.buffer.element_size() >= 2 * l2
    g = torch.Generator().manual_seed(0)
    f.buffer.copy_(torch.randint(-4, 5, f.buffer.shape, generator=g).to(f.buffer.dtype))
    before = f.buffer.clone()
    f.sink.fill_(math.nan)
    f()
    assert torch.equal(f.buffer, before)  # read, not written
    assert f.sink.double().sum().item() == before.double().sum().item()  # every element read
    assert f.sink.numel() * 4 <= f.buffer.numel() * f.buffer.element_size() / 1000  # tiny sink
    dirty = timing.make_flush("dirty", "cpu", l2_bytes=l2, min_bytes=0)
    dirty.buffer.fill_(7)
    dirty()
    assert dirty.plan.op == "write" and dirty.sink is None and not dirty.buffer.any()


class _FakeEvent:
    """A CUDA event on the CPU: records the order of what ran."""

    log: list[str] = []

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = len(self.log)
        self.log.append("event")

    def elapsed_time(self, other):
        return float(other.at - self.at) / 1000


def test_time_cold_flushes_clean_before_every_timed_call(monkeypatch):
    """``time_cold`` with the CUDA pieces mocked: each repetition is flush, event, call,
    event; the flush is the clean one (a read of at least twice the L2) unless asked."""
    from types import SimpleNamespace

    log = _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(L2_cache_size=16 * 1024))
    monkeypatch.setattr(timing, "WARMUP_S", 0.0)
    made = []
    real_call = timing.Flush.__call__

    def spy(self):
        made.append(self)
        log.append(f"flush:{self.plan.op}:{self.plan.nbytes}")
        real_call(self)

    monkeypatch.setattr(timing.Flush, "__call__", spy)
    monkeypatch.setattr(timing, "make_flush", functools.partial(timing.make_flush,
                                                                min_bytes=0))
    t = timing.time_cold(lambda: log.append("call"), reps=3, warmup=1, device="cpu")
    assert t.reps == 3
    timed = log[log.index("event") - 1:]
    assert timed == ["flush:read:32768", "event", "call", "event"] * 3
    assert all(torch.equal(f.buffer, torch.ones_like(f.buffer)) for f in made)
    log.clear()
    timing.time_cold(lambda: log.append("call"), reps=2, warmup=1, device="cpu", flush="dirty")
    assert log[log.index("event") - 1:] == ["flush:write:32768", "event", "call", "event"] * 2


def test_every_timer_behind_a_percent_uses_the_clean_flush(monkeypatch):
    """The harness's timers: eager, graph, the limit and the step after the clean flush (the
    module's default), the dirty column alone after the zeroing one; the read rate too."""
    from types import SimpleNamespace

    for fn in (timing.time_cold, timing.time_graph, timing.time_read,
               timing.measure_read_bandwidth):
        assert inspect.signature(fn).parameters["flush"].default == "clean", fn
    monkeypatch.setattr(timing, "measure_read_bandwidth", lambda device: 4000.0)
    monkeypatch.setattr(harness.report, "environment_meta", lambda device: {"gpu": "fake"})
    args = SimpleNamespace(reps=5, warmup=1, host_calls=3, graph=True, layers=32)
    timers, roof, meta = harness._gpu_timers(args, torch.device("cpu"))
    assert roof == 4000.0 and meta["flush"] == "clean"

    def flush_of(timer):
        default = inspect.signature(timer.func).parameters["flush"].default
        return timer.keywords.get("flush", default)

    assert {name: flush_of(getattr(timers, name)) for name in
            ("eager", "graph", "limit", "step", "dirty")} == {
        "eager": "clean", "graph": "clean", "limit": "clean", "step": "clean",
        "dirty": "dirty"}
    assert timers.limit.func is timing.time_read and timers.step.func is timing.time_graph
    no_step = harness._gpu_timers(SimpleNamespace(**{**vars(args), "layers": 0}),
                                  torch.device("cpu"))[0]
    assert no_step.step is None


# --- the serving-condition step --------------------------------------------------------------

def test_the_step_gives_every_layer_a_cache_of_its_own():
    shape = make_shape("t", "smollm2-135m", [5, 17], fp8=True)
    b = build_batch(shape, "cpu", poison=False)
    layers = step.layer_batches(b, step.STEP_LAYERS)
    assert len(layers) == 32 and step.count_caches(layers) == 32
    keys = {lb.key_cache.untyped_storage().data_ptr() for lb in layers}
    values = {lb.value_cache.untyped_storage().data_ptr() for lb in layers}
    queries = {lb.query.untyped_storage().data_ptr() for lb in layers}
    assert len(keys) == len(values) == len(queries) == 32 and not keys & values
    assert layers[0].key_cache is b.key_cache  # the batch's own cache is layer 0's
    for lb in layers:  # one table and lengths for the step, as in serving
        assert lb.block_tables is b.block_tables and lb.context_lens is b.context_lens
        assert lb.scales == b.scales and lb.key_cache.dtype == FP8_E4M3
        assert torch.equal(lb.key_cache.view(torch.uint8), b.key_cache.view(torch.uint8))
    shared = step.layer_batches(b, 8, num_caches=3)
    assert step.count_caches(shared) == 3
    assert shared[4].key_cache is shared[1].key_cache is not shared[2].key_cache
    with pytest.raises(ValueError, match="num_caches"):
        step.layer_batches(b, 4, num_caches=5)


def test_the_step_takes_the_caches_that_fit():
    per_layer, reserve = 2 * 2**30, step.STEP_RESERVE_BYTES
    assert step.distinct_caches(32, per_layer, reserve + 31 * per_layer) == 32
    assert step.distinct_caches(32, per_layer, reserve + 31 * per_layer - 1) == 31
    assert step.distinct_caches(32, per_layer, reserve + 10 * per_layer + 5) == 11
    assert step.distinct_caches(32, per_layer, 1024) == 1  # the batch's own cache only
    b = build_batch(make_shape("t", "smollm2-135m", [5, 17]), "cpu")
    assert step.cache_bytes(b) == 2 * b.key_cache.numel() * b.key_cache.element_size()
    with pytest.raises(ValueError, match="num_layers"):
        step.distinct_caches(0, per_layer, 2**40)


def test_the_harness_times_one_graph_of_every_layer(monkeypatch):
    """``measure_shape`` with fake timers: the step timer gets one callable running every
    layer (our plan: one plan for the step, run per layer), the row reports per layer, the
    limit goes on every row of the shape, and finalize makes % of it."""
    import pagedattn.api as api

    shape = make_shape("tiny", "smollm2-135m", [5, 17], dtype=torch.float32)
    plans, calls = [], []
    real_plan = api.plan_decode

    def counting_plan(*a, **k):
        plans.append(k["num_q_heads"])
        return real_plan(*a, **k)

    monkeypatch.setattr(api, "plan_decode", counting_plan)

    def fake_step(fn):
        outs = fn()  # the step runs here once: every layer, in order
        calls.append(len(outs))
        assert all(torch.allclose(o, outs[0]) for o in outs)  # same data in every cache
        return Timing(400.0, 390.0, 410.0, 3)

    fake = lambda fn: Timing(10.0, 9.0, 11.0, 3)  # noqa: E731
    limit_bytes = []
    timers = harness.Timers(fake, fake, None, dirty=lambda fn: Timing(12.0, 11.0, 13.0, 3),
                            limit=lambda n: limit_bytes.append(n) or Timing(8.0, 8.0, 8.0, 3),
                            step=fake_step)
    rows = harness.measure_shape(shape, harness.entries(["auto", "gqa_reuse_v3"], ["naive"]),
                                 "cpu", timers=timers, layers=4)
    harness.finalize(rows, {"flush": "clean"}, 1000.0)
    assert calls == [4, 4, 4] and limit_bytes == [shape.minimal_bytes]
    assert plans == [9, 9, 9]  # auto: eager, graph, and ONE for the 4-layer step
    for r in rows:
        assert r["status"] == "ok" and r["error"] == ""
        assert r["step_us_per_layer"] == 100.0 and (r["step_layers"], r["step_caches"]) == (4, 4)
        assert r["limit_us"] == 8.0 and r["dirty_median_us"] == 12.0
        assert r["pct_limit"] == pytest.approx(80.0) and r["graph_pct_limit"] == pytest.approx(80.0)
        assert r["pct_roofline"] == pytest.approx(100 * shape.minimal_bytes / 10e-6 / 1e9 / 1000)
        assert r["flush"] == "clean"


def test_a_limit_that_raises_is_an_error_of_every_row():
    shape = make_shape("tiny", "smollm2-135m", [5], dtype=torch.float32)

    def broken(n):
        raise RuntimeError("time_read: the streaming read missed elements")

    fake = lambda fn: Timing(10.0, 9.0, 11.0, 3)  # noqa: E731
    rows = harness.measure_shape(shape, harness.entries([], ["naive"]), "cpu",
                                 timers=harness.Timers(fake, limit=broken))
    assert "limit timing: RuntimeError: time_read" in rows[0]["error"]
    assert harness.errored(rows[0]) and "limit_us" not in rows[0]


# --- the command line -------------------------------------------------------------------------

def test_dry_run_shows_the_new_columns_as_na(tmp_path, capsys):
    rc = cli.main(["bench", "--dry-run", "--shapes", "llama8b-b1-c1k", "--impls", "auto",
                   "--peers", "none", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    table = out[out.index("shape "):]
    header, _, row = table.splitlines()[:3]
    for column in ("clean µs", "dirty µs", "limit µs", "% limit", "% 2 GiB rate",
                   "step µs/layer"):
        assert column in header
    assert row.split().count("n/a") >= 6
    md = (tmp_path / "bench.md").read_text(encoding="utf-8")
    assert "| clean µs" in md and "step µs/layer" in md


@pytest.mark.parametrize("argv,says", [
    (["--layers", "-1"], "argument --layers: expected a non-negative integer, got '-1'"),
])
def test_bad_yardstick_options_are_one_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--dry-run", "--out-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1
