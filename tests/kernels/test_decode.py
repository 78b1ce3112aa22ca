"""Every impl against the float64 oracle on the curated, named cases (issue 2).

Outputs are poisoned with NaN before the call; unused cache slots hold NaN and block-table
padding holds -1 and out-of-range ids (``make_paged_inputs``), so a kernel that reads past a
length, dereferences padding, or leaves an element unwritten fails.
"""

import pytest
import torch

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

IMPLS = list(pagedattn.IMPLS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# name -> (context_lens, num_q_heads, num_kv_heads, head_dim, page_size)
CASES = {
    "batch1-group1-hd64-page16": ([37], 2, 2, 64, 16),
    "batch17-ragged-page3": ([0, 1, 3, 4, 2, 5, 6, 7, 9, 1, 3, 12, 0, 8, 2, 4, 10], 3, 1, 64, 3),
    "page1-group3-hd80": ([0, 1, 5, 2], 6, 2, 80, 1),
    "group4-hd128-page-boundaries": ([0, 1, 16, 17], 8, 2, 128, 16),
    "group7-hd80-page16": ([1, 16, 17, 33], 7, 1, 80, 16),
    "page-nonpow2-5-hd64": ([4, 5, 6, 11], 4, 1, 64, 5),
}


def _run(impl, inputs, **kw):
    out = torch.full_like(inputs.query, float("nan"))
    result = pagedattn.paged_decode(*inputs, impl=impl, out=out, **kw)
    assert result is out
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_impl_matches_oracle(impl, case, device):
    lens, hq, hkv, hd, ps = CASES[case]
    dtype = DTYPES[list(CASES).index(case) % len(DTYPES)]  # every dtype meets every impl
    inputs = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=hd,
                               page_size=ps, dtype=dtype, seed=len(lens), device=device)
    out = _run(impl, inputs)
    ref = paged_decode_reference(*inputs).out
    assert rel_l2_error(out, ref) <= tolerance_for(dtype)
    empty = torch.tensor(lens) == 0
    assert (out.cpu()[empty] == 0).all()  # a length-0 row is exactly zero, never NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_dtypes(impl, dtype, device):
    inputs = make_paged_inputs([0, 1, 17, 23], num_q_heads=4, num_kv_heads=2, head_dim=64,
                               page_size=8, dtype=dtype, seed=3, device=device)
    out = _run(impl, inputs)
    assert out.dtype == dtype
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= tolerance_for(dtype)


@pytest.mark.parametrize("impl", ["split_kv_v4", "auto"])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_forced_splits(impl, num_splits, device):
    inputs = make_paged_inputs([1, 2, 3, 40, 0], num_q_heads=4, num_kv_heads=1, head_dim=64,
                               page_size=4, dtype=torch.float16, seed=num_splits, device=device)
    out = _run(impl, inputs, num_splits=num_splits)
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= 2e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_query_and_out(impl, device):
    """A query sliced from a packed QKV tensor and a strided ``out`` are honoured."""
    inputs = make_paged_inputs([5, 19], num_q_heads=4, num_kv_heads=2, head_dim=64,
                               page_size=8, dtype=torch.float16, seed=11, device=device)
    qkv = torch.randn(2, 8, 64, dtype=torch.float16, device=device)
    qkv[:, :4] = inputs.query
    query = qkv[:, :4]  # strides (512, 64, 1): not contiguous over the batch
    out_buf = torch.full((2, 4, 128), float("nan"), dtype=torch.float16, device=device)
    out = out_buf[:, :, ::2]
    pagedattn.paged_decode(query, *inputs[1:], impl=impl, out=out)
    ref = paged_decode_reference(*inputs).out
    assert rel_l2_error(out, ref) <= 2e-3
    assert torch.isnan(out_buf[:, :, 1::2]).all()  # nothing written outside the view


def test_default_scale_and_explicit_scale(device):
    inputs = make_paged_inputs([9, 30], num_q_heads=4, num_kv_heads=4, head_dim=64,
                               page_size=16, dtype=torch.float32, device=device)
    for scale in (None, 0.3):
        out = pagedattn.paged_decode(*inputs, scale=scale)
        ref = paged_decode_reference(*inputs, scale=scale).out
        assert rel_l2_error(out, ref) <= 1e-4


def test_empty_batch(device):
    inputs = make_paged_inputs([], num_q_heads=4, num_kv_heads=2, device=device)
    out = pagedattn.paged_decode(*inputs)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_auto_small_tiles_many_splits(dtype, device, monkeypatch):
    """The production kernel with 16-token tiles and 16-token splits (several units per
    sequence, every merge path) matches the oracle."""
    from dataclasses import replace

    from pagedattn.launch import policy

    base = policy.choose_config
    monkeypatch.setattr(policy, "choose_config", lambda *a, **k: replace(
        base(*a, **k), block_n=16, min_chunk=16))
    inputs = make_paged_inputs([0, 3, 70, 129, 17], num_q_heads=6, num_kv_heads=2, head_dim=64,
                               page_size=16, dtype=dtype, seed=5, device=device)
    out = _run("auto", inputs)
    assert rel_l2_error(out, paged_decode_reference(*inputs).out) <= tolerance_for(dtype)


@pytest.mark.gpu
def test_repeat_runs_launch_the_bound_kernels(monkeypatch):
    """Repeats of one binding launch the compiled kernels directly and stay correct with new
    lengths, queries, float scales and a new ``out``; a pointer that loses 16-byte alignment
    is a new binding (Triton's own launch path), never a wrong specialization; the direct path
    gives the same bits as Triton's launch path."""

    inputs = make_paged_inputs([5, 40, 0, 77], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, dtype=torch.bfloat16, seed=1, device="cuda",
                               max_pages=5)
    plan = pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, num_q_heads=8,
                                 num_kv_heads=2, head_dim=128, page_size=16,
                                 q_dtype=torch.bfloat16)
    first = plan.run(*inputs[:3], scale=0.3).clone()
    engine = plan._engine()
    assert engine._direct and len(engine._records) == 1
    for seed, lens, scale in ((2, [77, 1, 30, 64], 0.3), (3, [0, 0, 9, 3], 1.7)):
        new = make_paged_inputs(lens, num_q_heads=8, num_kv_heads=2, head_dim=128,
                                page_size=16, dtype=torch.bfloat16, seed=seed, device="cuda",
                                max_pages=5)
        plan.block_tables.copy_(new.block_tables)
        plan.context_lens.copy_(new.context_lens)
        out = torch.full_like(new.query, float("nan"))
        plan.run(new.query, *new[1:3], scale=scale, out=out)
        ref = paged_decode_reference(*new, scale=scale).out
        assert rel_l2_error(out, ref) <= tolerance_for(torch.bfloat16)
    assert len(engine._records) == 1
    buf = torch.empty(new.query.numel() + 1, dtype=new.query.dtype, device="cuda")
    shifted = buf[1:].view_as(new.query).copy_(new.query)
    out = torch.full_like(new.query, float("nan"))
    plan.run(shifted, *new[1:3], out=out, scale=1.7)
    assert rel_l2_error(out, ref) <= tolerance_for(torch.bfloat16)
    assert len(engine._records) == 2
    # Triton's own launch path (no direct launches) gives the same bits
    direct = plan.run(new.query, *new[1:3], scale=1.7)
    monkeypatch.setattr(engine, "_direct", False)
    assert torch.equal(plan.run(new.query, *new[1:3], scale=1.7), direct)
    del first


def test_c_launch_passes_what_triton_passes():
    """The fast path of a recorded launch (the C launch itself: ``c_launch``/``launch_c`` of
    the version seam) and its fallback (``CompiledKernel.run``, which is
    ``CudaLauncher.__call__``) hand the installed Triton's C launch the same arguments, with
    the launch flags passed through; a kernel that needs scratch memory keeps Triton's own
    call (``None``). On the CPU: Triton's driver is a stand-in for the call."""
    from types import SimpleNamespace

    from pagedattn.launch import _triton_compat as tc

    for cooperative, pdl in ((False, True), (True, False)):
        seen: list = []
        run = tc.recording_launcher(seen, cooperative=cooperative, pdl=pdl)
        compiled = SimpleNamespace(run=run, function=1234, packed_metadata=(4, 1, 0))
        args = [11, 2.5, None, 7, torch.zeros(4)]
        c = tc.c_launch(compiled)
        assert c is not None or tc.VERSION not in tc.LAUNCH_FORMS
        if c is None:
            continue
        with tc.cpu_driver():
            tc.launch_compiled(compiled, (5, 2, 1), 99, args, None, None)
        tc.launch_c(c, (5, 2, 1), 99, args)
        tc.launch_c(c, (5, 2, 1), 99, args[:-1] + [3])  # another argument: another call
        assert len(seen) == 3 and seen[0] == seen[1] and seen[2] != seen[1]
        assert seen[0][:7] == [5, 2, 1, 99, 1234, cooperative, pdl]
    for scratch in (dict(global_scratch=64), dict(profile_scratch=8)):
        compiled = SimpleNamespace(run=tc.recording_launcher([], **scratch), function=1,
                                   packed_metadata=())
        assert tc.c_launch(compiled) is None


def test_the_seam_names_every_read_triton(monkeypatch):
    """The recorded launch is on for the Tritons whose launch path was read (3.6-3.9), in the
    form each takes; an unread Triton takes every fallback (each launch binds through
    ``kernel[grid]``, no C launch, an unpatched interpreter); versions parse with local and
    dev suffixes; an empty hook chain reads as no hook, a set hook as itself."""
    from types import SimpleNamespace

    from pagedattn.launch import _triton_compat as tc

    assert tc._minor("3.7.1+git1234") == (3, 7) and tc._minor("3.10.0.dev0") == (3, 10)
    assert tc.LAUNCH_FORMS == {(3, 6): "spread", (3, 7): "packed", (3, 8): "packed",
                               (3, 9): "packed"}
    assert tc.launch_hooks() == (None, None)
    with tc.launch_hook(print):
        assert tc.launch_hooks()[0] is not None
    assert tc.launch_hooks() == (None, None)
    compiled = SimpleNamespace(run=tc.recording_launcher([]), function=1, packed_metadata=())
    assert (tc.c_launch(compiled) is not None) is (tc.VERSION in tc.LAUNCH_FORMS)
    monkeypatch.setattr(tc, "VERSION", (3, 10))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not tc.direct_launch_supported() and tc.c_launch(compiled) is None
    assert tc.patch_interpreter_lang() is False


def test_recorded_launch_binds_what_triton_binds_for_every_compiled_case():
    """For every case ``scripts/compile_sm90.py`` compiles for sm_90, the recorded launch
    (the C launch without a hook, ``CompiledKernel.run`` with one) hands the installed
    Triton's C launch exactly what ``kernel[grid](**kwargs)`` hands it: Triton binds and
    specializes the arguments itself (interpreter off, in a subprocess), and a recording
    ``CudaLauncher`` stands in for the compiled binary. No GPU, no compile."""
    from _scripts import run_script

    run = run_script("compile_sm90.py", "--bindings", interpret=False, timeout=300)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    same = [line for line in run.stdout.splitlines() if line.endswith(": same C launch arguments")]
    # the decode kernel's cases (18 since the split MLA path's 11 went; prefill and MLA record
    # nothing)
    assert len(same) >= 18 and f"bindings: 0 of {len(same)} case(s) differ" in run.stdout, \
        run.stdout


@pytest.mark.parametrize("per_group", [True, False])
def test_both_merge_grids(per_group, device, monkeypatch):
    """Either merge grid (per kv head, per query head; chosen by batch x kv heads against the
    SM count) merges forced splits, empty rows and the LSE exactly like the oracle."""
    from pagedattn.launch import policy

    monkeypatch.setattr(policy, "merge_per_group", lambda *a: per_group)
    inputs = make_paged_inputs([0, 45, 3, 130], num_q_heads=6, num_kv_heads=2, head_dim=64,
                               page_size=16, dtype=torch.float16, seed=11, device=device)
    out = torch.full_like(inputs.query, float("nan"))
    res = pagedattn.paged_decode(*inputs, out=out, num_splits=3, return_lse=True)
    ref = paged_decode_reference(*inputs)
    assert rel_l2_error(res.out, ref.out) <= tolerance_for(torch.float16)
    finite = torch.isfinite(ref.lse)
    assert torch.isneginf(res.lse.cpu()[~finite.cpu()]).all()
    torch.testing.assert_close(res.lse.double()[finite], ref.lse[finite].to(res.lse.device),
                               rtol=1e-3, atol=1e-3)


def test_pdl_only_for_a_launched_per_group_merge(device):
    """The merge is a programmatic dependent launch only for a per-group merge that is
    launched (not folded) on a GPU of sm_90+: never under the interpreter, never for the
    per-head merge, a one-unit plan or a folded merge (no merge kernel), whose kernels then
    compile exactly as without the flag. A plan of a 16-bit cache folds its per-group merge;
    the one-shot launcher of the same shapes (a fresh workspace per call) launches it."""
    from pagedattn.launch.decode import AutoLauncher
    from pagedattn.spec import LaunchSpec

    kw = dict(max_pages=1024, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
              q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device=torch.device(device))
    gpu = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    # 256 or 2 pairs (H200: 132 SMs); the two pairs split 40 ways (the table holds 256 tiles
    # or more): more rows than a per-head plan folds
    for batch, per_group, splits in ((128, True, None), (1, False, 40)):
        plan_launcher = AutoLauncher(LaunchSpec(batch=batch, num_splits=splits, **kw))
        assert plan_launcher.fold_merge is per_group
        assert plan_launcher.launches_merge is not per_group
        assert plan_launcher.pdl is False  # folded, or a per-head merge
        launcher = AutoLauncher(LaunchSpec(batch=batch, num_splits=splits, **kw), workspace=False)
        assert not launcher.fold_merge and launcher.launches_merge
        assert (launcher.merge_grid[1] == 2) is per_group
        assert launcher.pdl is (gpu and per_group)
        assert launcher.flags.PDL is launcher.pdl
        assert launcher.merge_constexprs.get("PDL", False) is launcher.pdl
    fp32 = AutoLauncher(LaunchSpec(batch=128, **dict(kw, q_dtype=torch.float32,
                                                     kv_dtype=torch.float32)))
    assert not fp32.fold_merge and fp32.pdl is gpu  # fp32 and fp8 plans launch the merge
    one_unit = AutoLauncher(LaunchSpec(batch=128, **dict(kw, max_pages=8)))
    assert one_unit.pdl is False and not one_unit.fold_merge and not one_unit.launches_merge


def test_few_pairs_fold_their_merge_when_their_rows_are_few(device):
    """Where the (sequence, kv head) pairs do not fill the SMs the merge is per query head,
    unless the plan can fold it: a 16-bit plan whose sequences hold at most
    ``fold_max_rows`` split rows (from shapes: the table's capacity over ``min_chunk``, the
    grid's rows, or the forced count) merges per group in its last units, so it launches
    one kernel; more rows (on the H200 a 4,096-token table at batch 1: 16) and a one-shot
    call (a fresh workspace per call) launch the per-head merge."""
    from pagedattn.launch.decode import AutoLauncher
    from pagedattn.spec import LaunchSpec

    kw = dict(batch=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
              q_dtype=torch.float16, kv_dtype=torch.float16, device=torch.device(device))
    short = AutoLauncher(LaunchSpec(max_pages=19, **kw))  # 304 tokens
    assert short.config.fold_max_rows == 4
    assert short.fold_merge and not short.launches_merge and not short.pdl
    assert short.plan.per_group_merge and short.merge_grid == (1, 2, 1)
    # a 16,384-token table: 64 rows on the H200 (five under the interpreter's 4 SMs)
    wide = AutoLauncher(LaunchSpec(max_pages=1024, **kw))
    assert not wide.fold_merge and wide.launches_merge and wide.merge_grid == (1, 8, 1)
    many = AutoLauncher(LaunchSpec(max_pages=1024, num_splits=5, **kw))  # five rows, forced
    assert not many.fold_merge and many.launches_merge and many.merge_grid == (1, 8, 1)
    forced = AutoLauncher(LaunchSpec(max_pages=1024, num_splits=3, **kw))  # three rows, any table
    assert forced.fold_merge and not forced.launches_merge
    one_shot = AutoLauncher(LaunchSpec(max_pages=19, **kw), workspace=False)
    assert not one_shot.fold_merge and one_shot.merge_grid == (1, 8, 1)
    fp8 = AutoLauncher(LaunchSpec(max_pages=19, **dict(kw, kv_dtype=torch.float8_e4m3fn)))
    assert not fp8.fold_merge and fp8.merge_grid == (1, 8, 1)


def test_few_pairs_folded_merge_matches_the_oracle(device, monkeypatch):
    """A batch of two sequences x 2 kv heads (fewer pairs than SMs, a short table) folds
    its merge: out and LSE (a sink per head, NaN-poisoned scratch, an empty sequence) match
    the oracle, every arrival counter is back at 0 after each run, and a second run gives
    the same bits."""
    from _hardening import poison_scratch

    inputs = make_paged_inputs([300, 0], num_q_heads=8, num_kv_heads=2, head_dim=64,
                               page_size=16, dtype=torch.float16, seed=29, device=device)
    sinks = torch.linspace(-1.0, 2.0, 8, device=device)
    poison_scratch(monkeypatch)
    plan = pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, num_q_heads=8,
                                 num_kv_heads=2, head_dim=64, page_size=16,
                                 q_dtype=torch.float16)
    launcher = plan._engine()
    assert launcher.fold_merge and launcher.plan.per_group_merge
    runs = [plan.run(*inputs[:3], sinks=sinks, return_lse=True) for _ in range(2)]
    assert (launcher.seq_rows == 0).all(), launcher.seq_rows.tolist()
    assert torch.equal(runs[0].out, runs[1].out) and torch.equal(runs[0].lse, runs[1].lse)
    ref = paged_decode_reference(*inputs, sinks=sinks)
    assert rel_l2_error(runs[0].out, ref.out) <= tolerance_for(torch.float16)
    torch.testing.assert_close(runs[0].lse.double(), ref.lse.to(device), rtol=1e-3, atol=1e-3)
    assert (runs[0].out[1] == 0).all()


def _check_folded_merge(lens, q_len, dtype, device, monkeypatch):
    from _hardening import poison_scratch

    batch = len(lens)
    inputs = make_paged_inputs(lens, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                               dtype=dtype, seed=23, device=device)
    query = inputs.query
    if q_len > 1:  # [batch, q_len, heads, dim]
        g = torch.Generator().manual_seed(5)
        query = torch.randn(batch, q_len, 8, 64, generator=g).to(device, dtype)
    sinks = torch.linspace(-1.0, 2.0, 8, device=device)
    poison_scratch(monkeypatch)
    plan = pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, num_q_heads=8,
                                 num_kv_heads=2, head_dim=64, page_size=16, q_dtype=dtype,
                                 num_splits=3, q_len=q_len)
    launcher = plan._engine()
    assert launcher.fold_merge and not launcher.launches_merge
    counters = launcher.seq_rows  # the arrival counters, in seq_rows' place
    assert counters.numel() == batch * 2 and (counters == 0).all()
    runs = [plan.run(query, inputs.key_cache, inputs.value_cache, sinks=sinks,
                     return_lse=True) for _ in range(2)]
    assert (counters == 0).all(), counters.tolist()
    one_shot = pagedattn.paged_decode(query, *inputs[1:], num_splits=3, sinks=sinks,
                                      return_lse=True)
    for out, lse in runs:
        assert torch.equal(out, one_shot.out) and torch.equal(lse, one_shot.lse)
    ref = paged_decode_reference(query, *inputs[1:], sinks=sinks)
    assert rel_l2_error(runs[0][0], ref.out) <= tolerance_for(dtype)
    torch.testing.assert_close(runs[0][1].double(), ref.lse.to(device), rtol=1e-3, atol=1e-3)
    empty = torch.tensor(lens, device=device) == 0
    assert (runs[0][0][empty] == 0).all()


@pytest.mark.parametrize("q_len", [1, 2])
def test_folded_merge_matches_the_merge_kernel_bit_for_bit(q_len, device, monkeypatch):
    """A plan of a 16-bit cache merges a sequence's split rows in the last unit of each
    (sequence, kv head) to arrive (``FOLD_MERGE``), the one-shot call of the same inputs in
    the per-group merge kernel: both sum the rows in the same order through the same helper,
    so out and LSE agree bit for bit, and both match the oracle. Empty sequences (no unit of
    their own: out 0, LSE the sink), a sink per head, three forced splits, NaN-poisoned
    scratch; every arrival counter is back at 0 after each run (a graph replay finds them
    zeroed), and a second run gives the same bits."""
    _check_folded_merge([70, 0, 45, 130, 0, 3], q_len, torch.float16, device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
def test_folded_merge_bit_for_bit_on_the_gpu(q_len, monkeypatch):
    """The check above on the GPU, where units arrive concurrently (the acq_rel counters'
    ordering is real) and bf16 dots run on tensor cores: 72 sequences x 2 kv heads fill the
    H200's 132 SMs (the merge per group), every fourth one empty."""
    lens = [0 if i % 4 == 1 else 17 + 53 * i for i in range(72)]
    _check_folded_merge(lens, q_len, torch.bfloat16, "cuda", monkeypatch)


@pytest.mark.gpu
def test_recorded_launches_key_on_every_dtype():
    """Recorded launches are keyed on each tensor's dtype too: the same shapes and strides
    with another query dtype, fp8 format or index dtype get their own binary, never a
    recorded one that reads the bytes as the wrong type."""
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    for q_dtype in (torch.bfloat16, torch.float32, torch.float16):
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for index in (torch.int32, torch.int64):
                x = make_paged_inputs([5, 70, 33], dtype=q_dtype, cache_dtype=fp8, seed=3,
                                      device="cuda", **shape)
                x = x._replace(block_tables=x.block_tables.to(index),
                               context_lens=x.context_lens.to(index))
                out = _run("auto", x, k_scale=0.5)
                ref = paged_decode_reference(*x, k_scale=0.5).out
                assert rel_l2_error(out, ref) <= tolerance_for(fp8), (q_dtype, fp8, index)


@pytest.mark.parametrize("batch", [3, 130, 257], ids=["one-block", "fits-256", "scan-loop"])
def test_split_planner_batch_sizes(batch, device):
    """The device-side split planner reads every length in one vector load up to 256
    sequences and loops over blocks beyond; both plan the same rows (ragged lengths, empty
    sequences, forced splits included)."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(0, 40 if batch < 256 else 9, (batch,), generator=g).tolist()
    lens[-1] = 0
    inputs = make_paged_inputs(lens, num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=4,
                               dtype=torch.float16, seed=batch, device=device)
    ref = paged_decode_reference(*inputs).out
    for num_splits in (None, 3) if batch < 256 else (None,):
        out = _run("auto", inputs, num_splits=num_splits)
        assert rel_l2_error(out, ref) <= tolerance_for(torch.float16)
        assert (out[-1] == 0).all()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_value_pairs_match_the_byte_path(layout, device, monkeypatch):
    """fp8 value caches are read as 16-bit pairs of dims where the layout allows (perf-notes
    step 28): NHD and HND caches take that path (e4m3 and e5m2), a head_dim whose strides are
    not multiples of 16 bytes falls back to bytes, and both paths give the same outputs
    (exact conversions; bit for bit in the interpreter) within the fp8 tolerance of the
    oracle on the dequantized cache, a bf16 query range-scaled as before."""
    import pagedattn.launch.decode as launch

    kw = dict(kv_layout=layout) if layout == "HND" else {}
    for fp8, head_dim in ((torch.float8_e4m3fn, 128), (torch.float8_e5m2, 80),
                          (torch.float8_e4m3fn, 72)):
        x = make_paged_inputs([0, 5, 70, 33], num_q_heads=8, num_kv_heads=2,
                              head_dim=head_dim, page_size=16, dtype=torch.bfloat16,
                              cache_dtype=fp8, seed=head_dim, device=device, kv_layout=layout)
        view = x.value_cache.transpose(1, 2) if layout == "HND" else x.value_cache
        want = 0 if head_dim == 72 else (1 if fp8 == torch.float8_e4m3fn else 2)
        assert launch.fp8_v_pairs(view, head_dim) == want
        out = _run("auto", x, k_scale=0.7, v_scale=1.3, **kw)
        with monkeypatch.context() as m:
            m.setattr(launch, "fp8_v_pairs", lambda value_cache, head_dim: 0)
            out_bytes = _run("auto", x, k_scale=0.7, v_scale=1.3, **kw)
        ref = paged_decode_reference(*x, k_scale=0.7, v_scale=1.3, **kw).out
        assert rel_l2_error(out, ref) <= 1e-2, (fp8, head_dim)
        assert rel_l2_error(out_bytes, ref) <= 1e-2, (fp8, head_dim)
        if device == "cpu":
            assert torch.equal(out, out_bytes), (fp8, head_dim)
        else:
            assert rel_l2_error(out, out_bytes) <= 1e-3, (fp8, head_dim)


@pytest.mark.parametrize("batch, kv_heads, dtype, few", [
    (1, 8, torch.float8_e4m3fn, True), (16, 8, torch.float8_e5m2, True),
    (17, 8, torch.float8_e4m3fn, False), (64, 8, torch.float8_e4m3fn, False),
    (1, 8, torch.bfloat16, False)])
def test_fp8_split_target_by_pairs(batch, kv_heads, dtype, few):
    """fp8 plans of one token whose (sequence, kv head) pairs are fewer than the SMs split for
    four units per SM, others keep the fp8 default of three (perf-notes step 28: b1-c32k
    38.6 µs at four against 41.6; b64-c8k 308.4 at three against 312.8)."""
    import pagedattn.launch.policy as launch

    assert launch.fp8_few_pairs(batch=batch, num_kv_heads=kv_heads, sms=132, kv_dtype=dtype,
                                head_dim=128) is few
    assert launch.heuristic_config(128, 4, torch.float8_e4m3fn).ctas_per_sm == 3


def test_lean_loop_and_int32_slot_offsets_where_they_apply(device):
    """The token loop's lean online softmax (``LEAN_SOFTMAX``, perf-notes step 38) needs
    every row of every tile to see a key and scores that end in the exact product: one query
    token without a window or soft-cap takes it (16-bit and fp8 caches); several query
    tokens (causal rows), a window and a soft-cap do not, nor fp32 caches (their kernel ran
    slower with it). A token's in-page offset is int32 where ``(page_size - 1)·stride_tok +
    (num_kv_heads - 1)·stride_head`` fits below 2^31, for both caches."""
    from pagedattn.launch import policy
    from pagedattn.launch.decode import AutoLauncher, slot_offsets_fit_int32
    from pagedattn.options import plan_options
    from pagedattn.spec import LaunchSpec

    kw = dict(batch=4, max_pages=64, num_q_heads=8, num_kv_heads=2, head_dim=128,
              page_size=16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
              device=torch.device(device))

    def lean(**over):
        options = over.pop("options", {})
        spec = LaunchSpec(**{**kw, **over}, options=plan_options(options))
        return AutoLauncher(spec).flags.LEAN_SOFTMAX

    assert lean() and lean(kv_dtype=torch.float8_e4m3fn) and lean(kv_dtype=torch.float16)
    assert lean(options=dict(batch_invariant=True))
    assert not lean(q_len=2)
    assert not lean(options=dict(window_left=100))
    assert not lean(options=dict(logits_soft_cap=30.0))
    assert not lean(q_dtype=torch.float32, kv_dtype=torch.float32)
    assert lean(options=dict(window_left=64 * 16))  # a window the table fits in: none
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        cfg = policy.heuristic_config(128, 4, dtype)
        assert cfg.lean_softmax is cfg.slot_offsets_i32 is (dtype != torch.float32)

    class View:  # strides of an NHD-shaped view
        def __init__(self, *strides):
            self._s = strides

        def stride(self, dim):
            return self._s[dim]

    assert slot_offsets_fit_int32(View(16 * 1024, 1024, 128, 1), 16, 8)
    # (16 - 1) * 2^27 + 7 * 2^20 = 2^31 - 2^27 + 7 * 2^20 < 2^31; one head more does not fit
    assert slot_offsets_fit_int32(View(1 << 32, 1 << 27, 1 << 20, 1), 16, 8)
    assert not slot_offsets_fit_int32(View(1 << 32, 1 << 27, 1 << 20, 1), 16, 129)
    assert not slot_offsets_fit_int32(View(1 << 33, 1 << 28, 1, 1), 16, 1)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_lean_loop_gives_the_bits_of_the_full_loop(cache_dtype, device, monkeypatch):
    """The lean online softmax and int32 slot offsets change no result: with exactly
    rounded scores ``s - max`` is 0 at the max and below it elsewhere, and a masked score
    (-inf) still weighs 0, so the clamp and the selects they drop were no-ops; the offsets
    address the same elements. In the interpreter (no FMA contraction) a plan gives the same
    bits with both flags off; on a GPU, where the full loop's product may be contracted into
    the subtraction, both stay within rounding of each other and match the oracle. Split
    and unsplit sequences, an empty one, a one-token page tail, NaN-poisoned cache slots and
    scratch, LSE."""
    from dataclasses import replace

    from _hardening import poison_scratch

    from pagedattn.launch import policy

    fp8 = cache_dtype == torch.float8_e4m3fn
    x = make_paged_inputs([0, 1, 17, 200, 333], num_q_heads=8, num_kv_heads=2, head_dim=64,
                          page_size=16, dtype=torch.bfloat16 if fp8 else cache_dtype,
                          cache_dtype=cache_dtype, seed=38, device=device)
    scales = dict(k_scale=0.7, v_scale=1.3) if fp8 else {}
    poison_scratch(monkeypatch)

    def run():
        plan = pagedattn.plan_decode(x.block_tables, x.context_lens, num_q_heads=8,
                                     num_kv_heads=2, head_dim=64, page_size=16,
                                     q_dtype=x.query.dtype, kv_dtype=cache_dtype)
        lean = plan._engine().flags.LEAN_SOFTMAX
        return plan.run(*x[:3], return_lse=True, **scales), lean

    (lean_out, lean_lse), lean_on = run()
    heuristic = policy.heuristic_config
    monkeypatch.setattr(policy, "heuristic_config", lambda *a, **k: replace(
        heuristic(*a, **k), lean_softmax=False, slot_offsets_i32=False))
    (full_out, full_lse), full_on = run()
    assert lean_on and not full_on
    ref = paged_decode_reference(*x, **scales)
    tol = 1e-2 if fp8 else tolerance_for(cache_dtype)
    assert rel_l2_error(lean_out, ref.out) <= tol
    assert (lean_out[0] == 0).all() and torch.isneginf(lean_lse[0]).all()
    if device == "cpu":
        assert torch.equal(lean_out, full_out) and torch.equal(lean_lse, full_lse)
    else:
        assert rel_l2_error(lean_out, full_out) <= 1e-3
        torch.testing.assert_close(lean_lse, full_lse, rtol=1e-5, atol=1e-5)
