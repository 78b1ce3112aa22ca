"""Cases B02-B05, B11-B14 and B22 of the first series of cases (public bug reports): garbage past
the length, partial last pages and tile boundaries, empty contexts, block-table padding, and
split-KV merges with empty or short splits.

Each case is a test named after its id, for every impl it applies to. Cases with sizes run
twice: ``cpu`` (tiny, keeping the trigger: the page boundary, context 0, poisoned pages, the
forced split count) and ``natural`` (the case's own sizes, ``gpu``-marked). Outputs are
poisoned with NaN before every call; cache slots no sequence attends to hold NaN (or Inf);
block-table padding holds -1, stale or out-of-range ids; launcher scratch is NaN-poisoned
where a case is about the split merge.
"""

import math

import pytest
import torch
from _hardening import (
    IMPLS,
    NAN,
    SPLIT_IMPLS,
    boundary_lengths,
    check,
    check_lse,
    paged_batch,
    poison_scratch,
    run,
    sizes,
)

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

BF16, FP16 = torch.bfloat16, torch.float16
INF = float("inf")


def _lse_kw(impl):
    return {"return_lse": True} if impl == "auto" else {}


def _split(result):
    """``run``'s result as ``(out, lse or None)``."""
    return (result.out, result.lse) if isinstance(result, tuple) else (result, None)


@pytest.mark.parametrize("fill", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("impl", IMPLS)
def test_B02_garbage_past_context(impl, fill, device):
    """FA3 #1745: ctx [1, 3], one head, D 64, fp16; every K/V slot past the length holds NaN
    (variant: ±Inf). Finite output equal to the reference; a 1-token row is exactly V[0]."""
    inputs = paged_batch([1, 3], [[0], [1]], 2, num_q_heads=1, num_kv_heads=1, head_dim=64,
                         page_size=16, dtype=FP16, fill=fill, device=device)
    assert not torch.isfinite(inputs.value_cache[0, 1:]).any()  # the trigger is in place
    out = run(impl, inputs)
    check(out, inputs)
    assert torch.equal(out[0, 0], inputs.value_cache[0, 0, 0])


@pytest.mark.parametrize("size", sizes(dict(lens=[3, 16, 17, 9], heads=2),
                                       dict(lens=[32, 64, 96, 48], heads=8)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B02_nan_past_context_multihead(impl, size, device):
    """FA3/FA4 #2374: bf16, Hq = Hkv, page 16, NaN after every length (P·V must not see it)."""
    h = size["heads"]
    inputs = make_paged_inputs(size["lens"], num_q_heads=h, num_kv_heads=h, head_dim=64,
                               page_size=16, dtype=BF16, seed=2, device=device)
    check(run(impl, inputs), inputs)


@pytest.mark.parametrize("size", sizes(dict(heads=(4, 2), dim=64), dict(heads=(8, 2), dim=128)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B03_partial_last_page_and_empty_row(impl, size, device):
    """vLLM #47305: ctx [17, 31, 0], tables [[5, 2], [7, 1], [3, 4]], bf16; page tails past
    the length are NaN and pages 3, 4 (used only by the empty row) wholly NaN. Rows 0, 1
    match; row 2 is exactly zero (LSE -inf); no NaN anywhere."""
    hq, hkv = size["heads"]
    inputs = paged_batch([17, 31, 0], [[5, 2], [7, 1], [3, 4]], 8, num_q_heads=hq,
                         num_kv_heads=hkv, head_dim=size["dim"], page_size=16, dtype=BF16,
                         seed=3, device=device)
    assert torch.isnan(inputs.key_cache[3]).all() and torch.isnan(inputs.value_cache[4]).all()
    out, lse = _split(run(impl, inputs, **_lse_kw(impl)))
    ref = check(out, inputs)
    assert (out[2] == 0).all()
    if lse is not None:
        check_lse(lse, ref)


def _auto_groups(lens, inputs_kw, device):
    """Pack lengths into batches small enough that ``auto`` keeps its minimum split chunk
    (``chunk = max(MIN_CHUNK, total·num_kv_heads / (programs·units))``), so its automatic
    split boundaries sit at multiples of MIN_CHUNK where ``boundary_lengths`` put them. The
    split target is SMs x ctas_per_sm units (``sm_count_for``: 4 on the CPU)."""
    from pagedattn._env import is_interpreter, sm_count_for
    from pagedattn.launch.policy import choose_config

    cfg = choose_config(inputs_kw["head_dim"], inputs_kw["num_q_heads"] // inputs_kw[
        "num_kv_heads"], inputs_kw["dtype"], inputs_kw["page_size"], is_interpreter())
    programs = sm_count_for(torch.empty(0, device=device))
    budget = programs * cfg.ctas_per_sm * cfg.min_chunk // inputs_kw["num_kv_heads"]
    groups, cur = [], []
    for n in sorted(lens):
        if cur and sum(cur) + n > budget:
            groups.append(cur)
            cur = []
        cur.append(n)
    return [*groups, cur]


@pytest.mark.parametrize("size", sizes(dict(multiples=(1, 2), extra=[], dtype=FP16),
                                       dict(multiples=(1, 2, 4), extra=[64, 255, 256, 257],
                                            dtype=BF16)))
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("impl", IMPLS)
def test_B04_tile_and_page_boundaries(impl, page_size, size, device):
    """B04 (ctx ∈ {1, 16, 64, 255, 256, 257}, page 16, q = 0 → mean of V) and its whole kind:
    every length k·size-1, k·size, k·size+1 for the page and each token tile of the impl
    (``auto``: BLOCK_N and the split chunk MIN_CHUNK; ``gqa_reuse_v3``: its page slice).
    With q = 0 the output is the mean of V over the context (ratio 1.0); with a random q it
    matches the oracle (a wrong rescale across tiles hides behind q = 0, so both run)."""
    dtype = size["dtype"]
    hq = 2 if impl in ("gqa_reuse_v3", "auto") else 1  # the group matters to their tiles only
    kw = dict(num_q_heads=hq, num_kv_heads=1, head_dim=64, page_size=page_size, dtype=dtype)
    lens = sorted(set(boundary_lengths(impl, group=2, multiples=size["multiples"],
                                       **{k: kw[k] for k in ("head_dim", "dtype", "page_size")})
                      + size["extra"]))
    groups = _auto_groups(lens, kw, device) if impl == "auto" else [lens]
    for i, group_lens in enumerate(groups):
        inputs = make_paged_inputs(group_lens, seed=page_size + i, device=device, **kw)
        check(run(impl, inputs), inputs)
        zero_q = inputs._replace(query=torch.zeros_like(inputs.query))
        out = run(impl, zero_q)
        check(out, zero_q)
        for b, n in enumerate(group_lens):
            pages = inputs.block_tables[b, : math.ceil(n / page_size)].long()
            v = inputs.value_cache[pages].double().reshape(-1, 1, 64)[:n]
            mean_v = v.mean(0).expand(hq, 64)  # every query head reads kv head 0
            err = rel_l2_error(out[b], mean_v)
            assert err <= tolerance_for(dtype), f"ctx {n}: out / mean(V) off by {err:.3g}"


B05_CONFIGS = sizes(dict(shapes=[(2, 2, 128), (4, 1, 256)]),
                    dict(shapes=[(8, 8, 128), (8, 8, 256), (32, 8, 128), (32, 8, 256)]))


@pytest.mark.parametrize("table", ["minus1", "nan_pages"])
@pytest.mark.parametrize("size", B05_CONFIGS)
@pytest.mark.parametrize("impl", IMPLS)
def test_B05_zero_length_rows(impl, size, table, device):
    """FA #2568: ctx [0, 5, 0, 16], bf16, D 128/256, group 1 and 4; the empty rows' tables
    hold -1 (variant: valid ids of NaN pages). Returns (no hang), empty rows exactly zero
    (LSE -inf), the others match, no NaN; with and without split-KV."""
    tables = [[-1], [0], [-1], [1]] if table == "minus1" else [[2], [0], [3], [1]]
    for hq, hkv, dim in size["shapes"]:
        inputs = paged_batch([0, 5, 0, 16], tables, 4, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=dim, page_size=16, dtype=BF16, seed=5, device=device)
        for num_splits in ([None, 4] if impl in SPLIT_IMPLS else [None]):
            out, lse = _split(run(impl, inputs, num_splits=num_splits, **_lse_kw(impl)))
            ref = check(out, inputs)
            assert (out[0] == 0).all() and (out[2] == 0).all()
            if lse is not None:
                check_lse(lse, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_B11_exact_page_multiple_ignores_extra_entries(impl, device):
    """ctx 32 is exactly 2 pages of 16; the table goes on with ids of NaN pages, -1 and
    out-of-range ids. Extra entries are never read: the output is bitwise the same as with
    those entries zeroed, and matches the oracle."""
    tables = [[0, 1, 4, 5, -1, 99], [2, 5, 4, -1, 1 << 30, 3]]
    inputs = paged_batch([32, 16], tables, 6, num_q_heads=2, num_kv_heads=1, head_dim=64,
                         page_size=16, dtype=FP16, seed=11, device=device)
    assert torch.isnan(inputs.key_cache[4]).all() and torch.isnan(inputs.key_cache[5]).all()
    out = run(impl, inputs)
    check(out, inputs)
    clean = inputs.block_tables.clone()
    clean[0, 2:] = 0
    clean[1, 1:] = 0
    assert torch.equal(run(impl, inputs._replace(block_tables=clean)), out)


def _b12_tables(variant, num_pages):
    """Real rows: ctx 40 (pages 4, 0, 6) and 17 (pages 2, 5), then padding rows. Pages 1 and
    3 hold only NaN. ``stale``: what a reused buffer keeps after the batch shrank."""
    real = [[4, 0, 6], [2, 5]]
    if variant == "stale":
        return [[4, 0, 6, 2], [2, 5, 4, 0], [6, 2, 5, 1], [3, 1, 4, 0]]
    pad = -1 if variant == "minus1" else num_pages + 5
    return [row + [pad] * (4 - len(row)) for row in real] + [[pad] * 4, [pad] * 4]


@pytest.mark.parametrize("size", sizes(dict(heads=(2, 1), dim=64), dict(heads=(16, 2), dim=128)))
@pytest.mark.parametrize("variant", ["stale", "minus1", "out_of_range"])
@pytest.mark.parametrize("impl", IMPLS)
def test_B12_stale_block_table_padding(impl, variant, size, device):
    """vLLM #39643: B 4 (2 real rows, 2 padding rows), ctx [40, 17, 0, 0], bf16. Unused
    columns and padding rows hold stale ids of other sequences (variants: -1, ids >=
    num_pages). Real rows match and are bitwise equal to a run with unused entries 0;
    padding rows are exactly zero; no out-of-bounds read (the value checks accept it: only
    used columns are checked)."""
    hq, hkv = size["heads"]
    inputs = paged_batch([40, 17, 0, 0], _b12_tables(variant, 7), 7, num_q_heads=hq,
                         num_kv_heads=hkv, head_dim=size["dim"], page_size=16, dtype=BF16,
                         seed=12, device=device)
    out = run(impl, inputs, validate=True)
    check(out, inputs)
    assert (out[2:] == 0).all()
    zeroed = torch.tensor(_b12_tables("minus1", 7)).clamp(min=0).to(inputs.block_tables)
    assert torch.equal(run(impl, inputs._replace(block_tables=zeroed))[:2], out[:2])


@pytest.mark.parametrize("validate", [None, True])
def test_B12_validator_rejects_bad_id_in_used_column(validate, device):
    """The debug validator: an out-of-range id *within* the needed columns is a ValueError
    naming block_tables and the row (on the CPU even with validate=None)."""
    if validate is None and device != "cpu":
        pytest.skip("validate=None skips value checks on CUDA (no host sync)")
    inputs = paged_batch([40, 17, 0, 0], _b12_tables("minus1", 7), 7, num_q_heads=4,
                         num_kv_heads=2, head_dim=64, page_size=16, dtype=BF16, device=device)
    inputs.block_tables[1, 1] = 7  # row 1 needs 2 pages: column 1 is used
    with pytest.raises(ValueError, match=r"block_tables.*row 1"):
        pagedattn.paged_decode(*inputs, validate=validate)


@pytest.mark.parametrize("size", sizes(dict(heads=(2, 1), dim=64, page=4),
                                       dict(heads=(32, 8), dim=128, page=16)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B13_many_splits_nan_scratch(impl, size, device, monkeypatch):
    """num_splits 16 with ctx [1, 5, 15, 17] (most splits empty) and NaN-filled scratch:
    matches the oracle and, within tolerance, the num_splits=1 result. The impls that do not
    split ignore num_splits: bitwise the same output as with num_splits=None."""
    hq, hkv = size["heads"]
    inputs = make_paged_inputs([1, 5, 15, 17], num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=size["dim"], page_size=size["page"], dtype=BF16,
                               seed=13, device=device)
    poison_scratch(monkeypatch)
    out16 = run(impl, inputs, num_splits=16)
    check(out16, inputs)
    if impl in SPLIT_IMPLS:
        out1 = run(impl, inputs, num_splits=1)
        assert rel_l2_error(out16, out1) <= tolerance_for(BF16)
    else:
        assert torch.equal(out16, run(impl, inputs))


@pytest.mark.parametrize("size", sizes(dict(heads=(8, 2), dim=64), dict(heads=(32, 8), dim=128)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B14_empty_splits_short_contexts(impl, size, device, monkeypatch):
    """pegainfer #21: num_splits 4 with ctx [1, 2, 3, 4, 5] (splits beyond the length are
    empty; scratch NaN-poisoned): no NaN/Inf, matches the oracle; the LSE too (auto)."""
    hq, hkv = size["heads"]
    inputs = make_paged_inputs([1, 2, 3, 4, 5], num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=size["dim"], page_size=16, dtype=BF16, seed=14,
                               device=device)
    poison_scratch(monkeypatch)
    out, lse = _split(run(impl, inputs, num_splits=4, **_lse_kw(impl)))
    ref = check(out, inputs)
    if lse is not None:
        check_lse(lse, ref)


@pytest.mark.parametrize("heads", [(4, 1), (8, 2)], ids=["per-head-merge", "kv2"])
def test_B05_empty_sequences_in_a_split_batch_fresh_workspace(heads, device, monkeypatch):
    """Empty sequences between split ones, in a fresh NaN-poisoned workspace that nothing
    fills: the main kernel writes an empty sequence's merge rows as (0, 0) (the merges load
    them beside the length: never uninitialized memory), every row matches the oracle, the
    empty ones are zeros with LSE -inf."""
    hq, hkv = heads
    lens = [0, 70, 0, 33, 0]
    inputs = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
                               page_size=16, dtype=torch.float32, seed=21, device=device)
    poison_scratch(monkeypatch)
    plan = pagedattn.plan_decode(inputs.block_tables, inputs.context_lens, num_q_heads=hq,
                                 num_kv_heads=hkv, head_dim=32, page_size=16,
                                 q_dtype=torch.float32, num_splits=2)
    launcher = plan._engine()  # built before the run, to see its workspace unfilled
    assert not launcher.one_unit and torch.isnan(launcher.workspace).all()  # not filled
    out, lse = plan.run(*inputs[:3], return_lse=True)
    check(out, inputs)
    check_lse(lse, paged_decode_reference(*inputs))
    rows = launcher.seq_rows.view(len(lens), 2).cpu()
    for b, n in enumerate(lens):
        if n == 0:
            assert rows[b].tolist() == [0, 0], f"sequence {b}: merge rows {rows[b].tolist()}"
            assert (out[b] == 0).all()
        else:
            assert rows[b, 1] == 2  # two split rows, written by the unit (b, 0, kv head 0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("size", sizes(dict(lens=[1, 2, 3, 7, 8, 9, 17], dim=32, heads=2),
                                       dict(lens=[1, 2, 3, 7, 8, 9, 63, 64], dim=128, heads=4)))
@pytest.mark.parametrize("impl", SPLIT_IMPLS)
def test_B22_forced_splits_short_contexts(impl, size, num_splits, page_size, device,
                                          monkeypatch):
    """SGLang #2465: forced num_splits 2/4/8, Hq 4 / Hkv 1 (CPU: 2 / 1), page 1 and 16,
    bf16, lengths shorter than the split count or granularity: every row matches."""
    inputs = make_paged_inputs(size["lens"], num_q_heads=size["heads"], num_kv_heads=1,
                               head_dim=size["dim"], page_size=page_size, dtype=BF16,
                               seed=num_splits, device=device)
    poison_scratch(monkeypatch)
    out = run(impl, inputs, num_splits=num_splits)
    ref = paged_decode_reference(*inputs).out
    for b, n in enumerate(size["lens"]):
        err = rel_l2_error(out[b], ref[b])
        assert err <= tolerance_for(BF16), f"ctx {n}: relative L2 error {err:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
def test_B05_B03_all_rows_empty(impl, device):
    """Every row empty (and a table of -1): all-zero output, LSE -inf, nothing launched
    reads a page."""
    inputs = paged_batch([0, 0], [[-1, -1], [-1, -1]], 1, num_q_heads=2, num_kv_heads=1,
                         head_dim=64, page_size=16, dtype=FP16, device=device)
    out, lse = _split(run(impl, inputs, **_lse_kw(impl)))
    assert (out == 0).all()
    if lse is not None:
        assert torch.isneginf(lse).all()
