"""Combining a sequence's split units: ``@triton.jit`` helpers of the per-group merge kernel
and of the merge folded into the main kernel (``FOLD_MERGE``).

* ``_arrive``: a folded merge's arrival counter; the unit that arrives last merges.
* ``_merge_group_rows``: a (sequence, kv head)'s split rows folded in row order
  (:func:`~pagedattn.kernels.softmax._merge_row`), then ``_store_merged``; ``_store_empty``
  for a sequence without keys.
* ``_seq_rows`` / ``_empty_seq_rows`` / ``_empty_seq_result``: the split rows the main kernel
  records per sequence for the merge, and the result of an empty sequence, which has no unit.
* ``_pdl_launch_dependents`` / ``_pdl_wait``: programmatic dependent launch between the main
  kernel and its merge (below).

Builds on :mod:`pagedattn.kernels.steps`; nothing there imports this module.
"""

import triton
import triton.language as tl

from pagedattn.kernels.paging import _clamped_context_len, _dim_mask
from pagedattn.kernels.softmax import _merge_row, _natural_lse
from pagedattn.kernels.steps import _add_sink, _lse_ptrs, _tile_ptrs, _tile_rows


@triton.jit
def _arrive(arrivals_ptr, b, kv_head, num_kv_heads, n_rows):
    """A folded merge's arrival (``FOLD_MERGE``), after a unit has stored its partial: the
    CTA barrier orders every thread's stores before one ``acq_rel`` atomic increment of the
    (sequence, kv head)'s counter at GPU scope (the release publishes the partial to the
    other programs; the acquire, in the last arrival, makes theirs visible to it). Returns
    whether this unit arrived last; that unit also resets the counter to 0, so the next
    launch (a graph replay too) finds it zeroed and needs no fill."""
    tl.debug_barrier()
    counter = arrivals_ptr + b * num_kv_heads + kv_head
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_rows - 1
    if last:  # every other unit of the pair has arrived: nothing else touches it this launch
        tl.store(counter, 0)
    return last


@triton.jit
def _merge_group_rows(part_ml_ptr, part_acc_ptr, start, n_rows, q_tok, heads, mask_h, offs_d,
                      num_q_heads, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      Q_LEN: tl.constexpr, CACHE: tl.constexpr):
    """The merge of one (sequence, kv head): split rows ``[start, start + n_rows)`` of the
    tile's rows, in row order, folded by :func:`_merge_row` (one ``[BLOCK_H, BLOCK_D]`` tile
    per row; their loads do not depend on each other, so they pipeline). The per-group merge
    kernel and a folded merge (``FOLD_MERGE``) both run it, so their sums are the same, term
    for term. ``CACHE``: the loads' cache modifier (``".cg"``: from L2, past this SM's L1,
    for rows other programs wrote during this launch)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for r in range(start, start + n_rows):
        if Q_LEN > 1:
            row = (q_tok + r * Q_LEN).to(tl.int64) * num_q_heads + heads
        else:
            row = r * num_q_heads + heads.to(tl.int64)  # [BLOCK_H], 64-bit
        m_r = tl.load(part_ml_ptr + row * 2, mask=mask_h, other=0.0, cache_modifier=CACHE)
        l_r = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_h, other=0.0, cache_modifier=CACHE)
        acc_r = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                        mask=mask_h[:, None], other=0.0,
                        cache_modifier=CACHE)  # [BLOCK_H, BLOCK_D]
        # several tokens: a row may have seen no key of this split (m_r = -inf)
        m, l, acc = _merge_row(m, l, acc, m_r, l_r, acc_r, Q_LEN > 1)
    return m, l, acc


@triton.jit
def _store_merged(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, m, l, acc,
                  Q_LEN: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr):
    """The epilogue of a merge (:func:`_merge_group_rows`): the sink folded in (once, after
    every row), ``out = acc / l`` and the LSE. Padding rows of the tile stay finite (never
    stored); with several query tokens, a token that saw no key gets 0."""
    if HAS_SINKS:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, mask_h)
    l = tl.where(mask_h & (l > 0), l, 1.0) if Q_LEN > 1 else tl.where(mask_h, l, 1.0)
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptrs.dtype.element_ty), mask=mask_hd)
    if HAS_LSE:
        tl.store(lse_ptrs, _natural_lse(m, l), mask=mask_h)


@triton.jit
def _store_empty(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr):
    """The result of a sequence without keys for the tile's rows: out 0, and LSE ``-inf``
    (the sink's logit with ``HAS_SINKS``: the denominator is the sink alone)."""
    tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptrs.dtype.element_ty),
             mask=mask_hd)
    if HAS_LSE:
        if HAS_SINKS:
            tl.store(lse_ptrs, tl.load(sinks_ptr + heads, mask=mask_h, other=0.0), mask=mask_h)
        else:
            tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=mask_h)


@triton.jit
def _empty_seq_result(out_ptr, lse_ptr, sinks_ptr, context_lens_ptr, u, batch, num_kv_heads,
                      group, num_q_heads, stride_ctx, capacity, stride_o_b, stride_o_t,
                      stride_o_h, stride_o_d, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr, Q_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
                      HAS_LSE: tl.constexpr):
    """A folded merge's empty sequences (``FOLD_MERGE``: no merge kernel runs, and an empty
    sequence has no unit): program ``u < batch · num_kv_heads`` writes the result of
    (sequence ``u // num_kv_heads``, kv head ``u % num_kv_heads``) when that sequence is
    empty (:func:`_store_empty`), as the merge kernel would."""
    if u < batch * num_kv_heads:  # noqa: SIM102 (the length is loaded for a real pair only)
        b = u // num_kv_heads
        if _clamped_context_len(context_lens_ptr, b, stride_ctx, capacity) == 0:
            offs_d = tl.arange(0, BLOCK_D)
            q_tok, heads, mask_h, _ = _tile_rows(tl.arange(0, BLOCK_H), u % num_kv_heads,
                                                 group, 0, Q_LEN)
            mask_hd = mask_h[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
            out_ptrs = _tile_ptrs(out_ptr, b, q_tok, heads, offs_d, stride_o_b, stride_o_t,
                                  stride_o_h, stride_o_d, Q_LEN)
            lse_ptrs = _lse_ptrs(lse_ptr, b, q_tok, heads, num_q_heads, Q_LEN)
            _store_empty(out_ptrs, lse_ptrs, sinks_ptr, heads, mask_h, mask_hd, BLOCK_H,
                         BLOCK_D, HAS_SINKS, HAS_LSE)


@triton.jit
def _seq_rows(seq_rows_ptr, b):
    """A merge's split rows of sequence ``b``: ``(start, n_rows)``, which the main kernel
    writes for every sequence (:func:`_empty_seq_rows` for an empty one)."""
    start = tl.load(seq_rows_ptr + b * 2)
    n_rows = tl.load(seq_rows_ptr + b * 2 + 1)
    return start, n_rows


@triton.jit
def _empty_seq_rows(seq_rows_ptr, context_lens_ptr, u, batch, stride_ctx, capacity):
    """Program ``u < batch`` of a split launch writes ``(0, 0)`` as sequence ``u``'s merge
    rows when the sequence is empty: no unit of its own writes that entry, and the merges
    load every sequence's entry beside its length (one round of loads), so the entry is
    never uninitialized memory (initcheck) and a fresh workspace needs no fill kernel."""
    if u < batch:  # noqa: SIM102 (the length is loaded only for a real sequence)
        if _clamped_context_len(context_lens_ptr, u, stride_ctx, capacity) == 0:
            tl.store(seq_rows_ptr + u * 2, 0)
            tl.store(seq_rows_ptr + u * 2 + 1, 0)



# --- programmatic dependent launch (PDL) -------------------------------------------------------
# A per-group merge is launched with ``launch_pdl=True``: its programs may start while the main
# kernel's last programs still run (once every main program has signalled), load their length,
# and wait on ``griddepcontrol.wait`` (the main grid complete, its writes visible) before their
# first read of the workspace. Both helpers compile to nothing when ``PDL`` is off (the
# interpreter, pre-Hopper GPUs, one-unit plans, the per-head merge), so the kernels' code is
# unchanged there.


@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    """The main kernel: let the next kernel of the stream (its merge) launch early."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """The merge kernel: wait until the main kernel has finished and its partials are visible
    (a no-op when the kernel was launched without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
