"""Metadata the kernels cannot trust: lengths past the block table, negative lengths, page ids
outside the cache, ``query_start_loc`` out of order, ``seq_lens`` shorter than the new tokens,
append slots past the cache. With the value checks off (``validate=False``, as a GPU's
``validate=None``), every kernel reads and writes inside its tensors (it clamps) and reports
what it clamped in the device's error word: the next call on the device, or
``pagedattn.check_errors()``, raises one ``ValueError`` naming the argument and the row.
Plans also refuse metadata resized in place after planning (shapes are checked every run).

The interpreter cannot see an out-of-bounds access, so these check the clamped results
against the oracle on the clamped metadata and the reports; ``scripts/gpu_check.sh
sanitize`` runs the same calls under compute-sanitizer on a GPU.
"""

import contextlib

import pytest
import torch

import pagedattn
from pagedattn.testing import make_mla_inputs, make_paged_inputs, rel_l2_error, tolerance_for

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)


@pytest.fixture(autouse=True)
def _clear_word(device):
    """Each test starts and ends with no report pending on its device."""
    pagedattn.check_errors(device)
    yield
    with contextlib.suppress(ValueError):  # a test may leave its report
        pagedattn.check_errors(device)


def _raises(device, name):
    return pytest.raises(ValueError, match=rf"^{name}")


def test_no_report_no_error(device):
    inputs = make_paged_inputs([9, 3], dtype=torch.float32, device=device, **SHAPE)
    pagedattn.paged_decode(*inputs, validate=False)
    pagedattn.check_errors(device)  # nothing pending: returns


@pytest.mark.parametrize("bad_len", [10_000, -5])
def test_decode_length_outside_the_table_is_clamped_and_reported(device, bad_len):
    """Row 1 uses its whole table (4 pages of 4): its length clamps to 16, exactly."""
    inputs = make_paged_inputs([9, 16, 3], dtype=torch.float32, device=device, max_pages=4,
                               **SHAPE)
    lens = inputs.context_lens.clone()
    lens[1] = bad_len
    out = pagedattn.paged_decode(inputs.query, *inputs[1:4], lens, validate=False)
    clamped = lens.clamp(0, 4 * SHAPE["page_size"])
    ref = pagedattn.paged_decode_reference(inputs.query, *inputs[1:4], clamped).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    with _raises(device, r"context_lens\[1\]: expected a length within"):
        pagedattn.check_errors(device)
    pagedattn.check_errors(device)  # cleared


def test_a_report_raises_at_the_next_call(device):
    inputs = make_paged_inputs([9, 14], dtype=torch.float32, device=device, max_pages=4,
                               **SHAPE)
    lens = inputs.context_lens.clone()
    lens[0] = 99
    plan = pagedattn.plan_decode(inputs.block_tables, lens, q_dtype=torch.float32, **SHAPE)
    plan.run(inputs.query, *inputs[1:3], validate=False)
    if device == "cuda":
        torch.cuda.synchronize()
    with _raises(device, r"context_lens\[0\]"):
        plan.run(inputs.query, *inputs[1:3], validate=False)
    lens[0] = 9
    plan.run(inputs.query, *inputs[1:3], validate=False)  # fixed: runs, reports nothing
    pagedattn.check_errors(device)


def _prefill(device, seq_lens, q_lens, seed=0, **kw):
    inputs = make_paged_inputs(seq_lens, dtype=torch.float32, device=device, seed=seed,
                               **{**SHAPE, **kw})
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(q_lens), SHAPE["num_q_heads"], SHAPE["head_dim"],
                        generator=g).to(device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    return inputs, query, qsl


def test_prefill_seq_lens_shorter_than_the_new_tokens_are_reported(device):
    inputs, query, qsl = _prefill(device, [20, 9], [5, 7])
    lens = inputs.context_lens.clone()
    lens[1] = 3  # 7 new tokens in a sequence of 3
    out = torch.full_like(query, float("nan"))
    pagedattn.paged_attention(query, *inputs[1:4], lens, qsl, out=out, validate=False)
    assert torch.isfinite(out).all()  # rows before the sequence's start see no key: 0
    with _raises(device, r"seq_lens\[1\]: expected at least the sequence's new tokens"):
        pagedattn.check_errors(device)


def test_prefill_seq_lens_past_the_table_are_reported(device):
    """The length is the cause: the table's entries past the row's pages that the clamped
    length reads are not reported (on a GPU programs race to the word, so a consequence
    reported as well could win: the sanitizer driver's run on an H100 saw ``block_tables[0]``
    at b69eb46; the GPU repeats the call)."""
    inputs, query, qsl = _prefill(device, [20, 9], [5, 7], max_pages=6)
    lens = inputs.context_lens.clone()
    lens[0] = 1_000
    for _ in range(20 if torch.device(device).type == "cuda" else 1):
        pagedattn.paged_attention(query, *inputs[1:4], lens, qsl, validate=False)
        with _raises(device, r"seq_lens\[0\]: expected a length within"):
            pagedattn.check_errors(device)


@pytest.mark.parametrize("bad", ["decreasing", "past the rows", "not from 0"])
def test_prefill_query_start_loc_out_of_order_is_clamped_and_reported(device, bad):
    inputs, query, qsl = _prefill(device, [20, 9, 12], [5, 7, 4])
    qsl = qsl.clone()
    if bad == "decreasing":
        qsl[2] = 2
    elif bad == "past the rows":
        qsl[3] = 10_000
    else:
        qsl[0] = 3
    out = torch.full((query.shape[0] + 8, *query.shape[1:]), 7.0, device=device)
    pagedattn.paged_attention(query, *inputs[1:], qsl, validate=False, out=out[:16])
    assert (out[16:] == 7.0).all()  # nothing written past the query's rows
    with _raises(device, "query_start_loc"):
        pagedattn.check_errors(device)


@pytest.mark.parametrize("index_dtype, far", [(torch.int32, -(2**31)),
                                               (torch.int64, 2**33 + 1)])
def test_decode_page_ids_outside_the_cache_read_page_0(device, index_dtype, far):
    """The decode kernel clamps a used page id outside the cache to page 0 (it does not report
    it: a flag live across its token loop cost the register-capped kernels a spill), in
    int32 and int64 tables, the ids at their type's edges (the unsigned compare: an int64 id
    whose low 32 bits name a real page is still outside); the value checks (``validate=True``,
    ``PAGEDATTN_VALIDATE=1``) name it."""
    inputs = make_paged_inputs([9, 14, 3], dtype=torch.float32, device=device, poison=False,
                               **SHAPE)
    tables = inputs.block_tables.to(index_dtype)
    tables[2, 0] = -7  # a used entry
    tables[1, 2] = inputs.key_cache.shape[0] + 3
    tables[1, 0] = far
    out = pagedattn.paged_decode(inputs.query, *inputs[1:3], tables, inputs.context_lens,
                                 validate=False)
    as_read = tables.clone()
    as_read[2, 0] = as_read[1, 2] = as_read[1, 0] = 0
    ref = pagedattn.paged_decode_reference(inputs.query, *inputs[1:3], as_read,
                                           inputs.context_lens).out
    assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    with pytest.raises(ValueError, match="^block_tables"):
        pagedattn.paged_decode(inputs.query, *inputs[1:3], tables, inputs.context_lens,
                               validate=True)


def test_a_length_past_the_table_is_reported_before_the_entries_it_reads(device):
    """A length past the table makes the kernel read entries that hold no page: the length
    is the cause, and the report names it (a later page-id report does not replace it)."""
    inputs = make_paged_inputs([9, 14, 3], dtype=torch.float32, device=device, max_pages=6,
                               **SHAPE)
    lens = inputs.context_lens.clone()
    lens[0] = 500
    pagedattn.paged_decode(inputs.query, *inputs[1:4], lens, validate=False)
    with _raises(device, r"context_lens\[0\]"):
        pagedattn.check_errors(device)


@pytest.mark.parametrize("index_dtype, bad", [(torch.int32, None), (torch.int32, -(2**31)),
                                               (torch.int64, 2**33 + 1)])
def test_prefill_page_ids_outside_the_cache_are_reported(device, index_dtype, bad):
    """A used page id outside the cache (past it, negative, or an int64 whose low 32 bits
    name a real page) is reported by the prefill kernel."""
    inputs, query, qsl = _prefill(device, [20, 9], [5, 7])
    tables = inputs.block_tables.to(index_dtype)
    tables[1, 0] = inputs.key_cache.shape[0] + 50 if bad is None else bad  # a used entry
    pagedattn.paged_attention(query, *inputs[1:3], tables, inputs.context_lens, qsl,
                              validate=False)
    with _raises(device, r"block_tables\[1\]: expected page ids within"):
        pagedattn.check_errors(device)


def test_append_kv_drops_and_reports_a_slot_past_the_cache(device):
    pages, page_size, heads, dim = 3, 4, 2, 8
    big = torch.zeros(pages + 1, page_size, heads, dim, device=device)
    key_cache, value_cache = big[:pages], big.clone()[:pages]
    key = torch.randn(3, heads, dim, device=device)
    slots = torch.tensor([5, pages * page_size, -1], device=device)
    pagedattn.append_kv(key, key, key_cache, value_cache, slots, validate=False)
    assert (big[pages] == 0).all()  # the row past the cache is untouched
    assert torch.equal(key_cache[1, 1], key[0])  # slot 5 written
    with _raises(device, r"slot_mapping\[1\]: expected a slot below"):
        pagedattn.check_errors(device)


def test_mla_length_past_the_table_is_reported(device):
    inputs = make_mla_inputs([7, 30], num_q_heads=4, latent_dim=32, rope_dim=8, page_size=4,
                             dtype=torch.float32, device=device)
    lens = inputs.context_lens.clone()
    lens[1] = 10_000
    pagedattn.mla_decode(inputs.q_nope, inputs.q_pe, inputs.ckv_cache, inputs.kpe_cache,
                         inputs.block_tables, lens, scale=0.3, validate=False)
    with _raises(device, r"context_lens\[1\]"):
        pagedattn.check_errors(device)


def test_plans_refuse_metadata_resized_in_place(device):
    """A plan keeps references to its metadata: a tensor resized after planning is named at
    the next run, before any launch (the kernels would index past it)."""
    inputs = make_paged_inputs([9, 14, 3], dtype=torch.float32, device=device, **SHAPE)
    lens = inputs.context_lens.clone()
    plan = pagedattn.plan_decode(inputs.block_tables, lens, q_dtype=torch.float32, **SHAPE)
    lens.resize_(2)
    with pytest.raises(ValueError, match="^context_lens: expected the planned shape"):
        plan.run(inputs.query, *inputs[1:3])
    inputs2, query, qsl = _prefill(device, [20, 9, 12], [5, 7, 4])
    qsl = qsl.clone()
    plan = pagedattn.plan_attention(inputs2.block_tables, inputs2.context_lens, qsl,
                                    q_dtype=torch.float32, **SHAPE)
    qsl.resize_(3)
    with pytest.raises(ValueError, match="^query_start_loc: expected the planned shape"):
        plan.run(query, *inputs2[1:3])
    mla = make_mla_inputs([7, 30], num_q_heads=4, latent_dim=32, rope_dim=8, page_size=4,
                          dtype=torch.float32, device=device)
    tables = mla.block_tables.clone()
    plan = pagedattn.plan_mla_decode(tables, mla.context_lens, num_q_heads=4, latent_dim=32,
                                     rope_dim=8, page_size=4, q_dtype=torch.float32)
    tables.resize_(1, tables.shape[1])
    with pytest.raises(ValueError, match="^block_tables: expected the planned shape"):
        plan.run(mla.q_nope, mla.q_pe, mla.ckv_cache, mla.kpe_cache, scale=0.3)


def test_non_contiguous_query_start_loc_is_refused(device):
    inputs, query, qsl = _prefill(device, [20, 9, 12], [5, 7, 4])
    spread = torch.zeros(2 * qsl.shape[0], dtype=torch.int32, device=device)
    spread[::2] = qsl
    with pytest.raises(ValueError, match="^query_start_loc: expected a contiguous"):
        pagedattn.paged_attention(query, *inputs[1:], spread[::2])


def test_debug_switch_runs_the_value_checks_on_a_gpu(monkeypatch):
    """``PAGEDATTN_VALIDATE=1`` (read at import): ``validate=None`` runs the value checks on a
    GPU's tensors too; without it only on the CPU's."""
    from pagedattn import _validation as V

    gpu = torch.device("cuda", 0)
    assert V.value_checks_due(None, torch.device("cpu"))
    assert not V.value_checks_due(False, torch.device("cpu"))
    monkeypatch.setattr(V, "DEBUG_CHECKS", False)
    assert not V.value_checks_due(None, gpu)
    monkeypatch.setattr(V, "DEBUG_CHECKS", True)
    assert V.value_checks_due(None, gpu)
    assert V.value_checks_due(True, gpu)


def test_debug_switch_is_read_from_the_environment():
    import subprocess
    import sys

    code = "from pagedattn import _validation as V; print(V.DEBUG_CHECKS)"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {**__import__("os").environ, "PAGEDATTN_VALIDATE": value}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=120)
        assert run.stdout.strip() == expected, run.stderr[-500:]
