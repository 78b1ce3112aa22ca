"""FlashAttention-3's own ``test_flash_attn_kvcache``, run against
``pagedattn.compat.flash_attn_with_kvcache``.

Upstream: Dao-AILab/flash-attention, commit 0251105a2fb19d2957484b7f023cd8c115286ced,
``hopper/test_flash_attn.py::test_flash_attn_kvcache`` and ``_generate_block_kvcache``, with
the reference ``attention_ref`` / ``construct_local_mask`` from ``hopper/test_util.py``.
License: BSD 3-Clause ("Copyright (c) 2022, the respective contributors, as shown by the
AUTHORS file. All rights reserved."; redistribution with this notice is permitted).

Adaptations (semantics, references and tolerances unchanged):
- einops' ``rearrange``/``repeat`` written as torch reshapes (einops is not a dependency);
  the parts of the reference for features skipped below are dropped.
- ``device="cuda"`` is the suite's ``device`` fixture; the function under test is ours.
- The upstream body is one function run by three parametrizations: the upstream grid at
  full size, marked ``gpu`` and run only with ``PAGEDATTN_PEER_SUITES=full`` (6,336 cases:
  more than the GPU-test phase's budget); ``GPU_CASES``, 120 of its cases at full size,
  marked ``gpu``; and a CPU subset (Triton's interpreter) at shrunken sizes (batch 2
  instead of 5, head dim 32 instead of 128, the shrunken ``(seqlen_q, seqlen_k)`` pairs and
  page sizes in ``CPU_CASES``), each case one combination of the upstream parameters.

Skipped parametrizations, with the reason (the function raises a ValueError naming the
argument for each):
- ``rotary_fraction`` 0.5 and 1.0 (``rotary_cos``/``rotary_sin``: no rotary embedding here)
  and ``rotary_interleaved=True`` (only meaningful with rotary; with ``rotary_fraction=0``
  it is the same case as ``False``); ``has_rotary_seqlens`` is ``[False]`` upstream too.
- ``has_leftpad=True`` (``cache_leftpad``), ``varlen_q=True`` (``cu_seqlens_q``,
  ``cu_seqlens_k_new``, ``max_seqlen_q``).
- the inner loop's random ``attention_chunk`` value (``attention_chunk``); the ``0`` value runs.
- the inner loop's ``precompute_metadata=True`` (``get_scheduler_metadata`` is FA3's own
  scheduler; our function accepts and ignores ``scheduler_metadata``).
- ``dv != d`` and ``qv`` (only for ``d <= 64`` or ``128 < d <= 192`` upstream; ``d`` is 128).
- ``causal=False, local=True`` with ``seqlen_q > 1`` (a random right window on multi-token
  queries): no kernel here; the case checks that the call raises ValueError instead.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedattn.compat import flash_attn_with_kvcache


def _repeat_heads(x, g):  # einops: repeat(x, "b s h d -> b s (h g) d", g=g)
    return x.repeat_interleave(g, dim=2)


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), sink_token_length=0,
                         query_padding_mask=None, key_padding_mask=None, key_leftpad=None,
                         device=None):
    row_idx = torch.arange(seqlen_q, device=device, dtype=torch.long).view(-1, 1)
    col_idx = torch.arange(seqlen_k, device=device, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    else:
        sk = torch.full_like(col_idx, seqlen_k) if key_padding_mask is None else sk
        return torch.logical_or(
            col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk),
            torch.logical_and(col_idx < row_idx + sk - sq - window_size[0],
                              col_idx >= sink_token_length),
        )


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, upcast=True, reorder_ops=False,
                  intermediate_dtype=None):
    """FA3's ``attention_ref`` (hopper/test_util.py) without the skipped features (qv,
    descales, attention_chunk, leftpad, dropout, bias)."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = _repeat_heads(k, q.shape[2] // k.shape[2])
    v = _repeat_heads(v, q.shape[2] // v.shape[2])
    d = q.shape[-1]
    softmax_scale = 1.0 / math.sqrt(d)
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask.view(key_padding_mask.shape[0], 1, 1, -1),
                            float("-inf"))
    local_mask = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, 0,
                                          query_padding_mask, key_padding_mask,
                                          device=q.device)
    if local_mask is not None:
        scores.masked_fill_(local_mask, float("-inf"))
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    if key_padding_mask is not None:
        attention = attention.masked_fill(
            ~key_padding_mask.view(key_padding_mask.shape[0], 1, 1, -1), 0.0)
    if local_mask is not None:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    if intermediate_dtype is not None:
        attention = attention.to(intermediate_dtype).to(attention.dtype)
    output = torch.einsum("bhts,bshd->bthd", attention, v)
    return output.to(dtype=dtype_og), attention.to(dtype=dtype_og)


def _generate_block_kvcache(seqlen_k, page_size, batch_size, nheads_k, d, dv, device, dtype,
                            dtype_ref):
    num_blocks = math.ceil(seqlen_k / page_size) * batch_size * 3
    k_cache_paged = torch.randn(num_blocks, page_size, nheads_k, d, device=device,
                                dtype=dtype_ref).to(dtype).to(dtype_ref)
    v_cache_paged = torch.randn(num_blocks, page_size, nheads_k, dv, device=device,
                                dtype=dtype_ref).to(dtype).to(dtype_ref)
    page_table = torch.randperm(num_blocks, dtype=torch.int32, device=device).view(
        batch_size, -1)
    # rearrange(paged[table.flatten()], "(b nblocks) block_size ... -> b (nblocks block_size) ...")
    rows = page_table.flatten()
    k_cache = k_cache_paged[rows].reshape(batch_size, -1, nheads_k, d)[:, :seqlen_k]
    v_cache = v_cache_paged[rows].reshape(batch_size, -1, nheads_k, dv)[:, :seqlen_k]
    return k_cache, v_cache, page_table, k_cache_paged, v_cache_paged, num_blocks


def run_kvcache_case(device, seqlen_q, seqlen_k, d, has_batch_idx, page_size,
                     seqlen_new_eq_seqlen_q, causal, local, new_kv, mha_type, dtype, *,
                     batch_size=5, num_splits_vals=(1, 3, 0)):
    """The upstream test body (its skipped features removed, see the module docstring)."""
    if page_size is not None and seqlen_k % page_size != 0:
        pytest.skip()
    if seqlen_q > seqlen_k and new_kv:
        pytest.skip()
    torch.random.manual_seed(0)
    batch_size_cache = batch_size if not has_batch_idx else batch_size * 2
    nheads = 6
    nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 3)
    assert nheads % nheads_k == 0
    dtype_ref = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    dv = d
    q = torch.randn(batch_size, seqlen_q, nheads, d, device=device,
                    dtype=dtype_ref).to(dtype).to(dtype_ref)
    # Put window_size after QKV randn so that window_size changes from test to test
    window_size = (-1, -1) if not local else torch.randint(0, seqlen_k, (2,))
    seqlen_new = seqlen_q if seqlen_new_eq_seqlen_q else torch.randint(1, seqlen_q + 1,
                                                                       (1,)).item()
    if new_kv:
        k = torch.randn(batch_size, seqlen_new, nheads_k, d, device=device,
                        dtype=dtype_ref).to(dtype).to(dtype_ref)
        v = torch.randn(batch_size, seqlen_new, nheads_k, dv, device=device,
                        dtype=dtype_ref).to(dtype).to(dtype_ref)
    else:
        k, v = None, None
    if page_size is None:
        k_cache = torch.randn(batch_size_cache, seqlen_k, nheads_k, d, device=device,
                              dtype=dtype_ref).to(dtype).to(dtype_ref)
        v_cache = torch.randn(batch_size_cache, seqlen_k, nheads_k, dv, device=device,
                              dtype=dtype_ref).to(dtype).to(dtype_ref)
        page_table = None
    else:
        (k_cache, v_cache, page_table, k_cache_paged, v_cache_paged,
         num_blocks) = _generate_block_kvcache(seqlen_k, page_size, batch_size_cache,
                                               nheads_k, d, dv, device, dtype, dtype_ref)
    cache_seqlens = torch.randint(0 if new_kv else 1,
                                  (seqlen_k - seqlen_new + 1) if new_kv else (seqlen_k + 1),
                                  (batch_size,), dtype=torch.int32, device=device)
    if has_batch_idx:
        cache_batch_idx = torch.randperm(batch_size_cache, dtype=torch.int32,
                                         device=device)[:batch_size]
    else:
        cache_batch_idx = None
    arange = torch.arange(seqlen_k, device=device).view(1, -1)
    cache_seqlens_expanded = cache_seqlens.view(-1, 1)
    if not new_kv:
        key_padding_mask = arange < cache_seqlens_expanded
    else:
        key_padding_mask = arange < cache_seqlens_expanded + seqlen_new
    k_cache_ref = (k_cache if not has_batch_idx else k_cache[cache_batch_idx]).clone()
    v_cache_ref = (v_cache if not has_batch_idx else v_cache[cache_batch_idx]).clone()
    if new_kv:
        update_mask = torch.logical_and(cache_seqlens_expanded <= arange,
                                        arange < cache_seqlens_expanded + seqlen_new)
        k_cache_ref[update_mask] = k.reshape(-1, *k.shape[2:])
        v_cache_ref[update_mask] = v.reshape(-1, *v.shape[2:])
    k_cache_rep = _repeat_heads(k_cache_ref, nheads // nheads_k)
    v_cache_rep = _repeat_heads(v_cache_ref, nheads // nheads_k)
    out_ref, _ = attention_ref(q, k_cache_rep, v_cache_rep, None, key_padding_mask,
                               causal=causal, window_size=window_size)
    out_pt, _ = attention_ref(q, k_cache_rep, v_cache_rep, None, key_padding_mask,
                              causal=causal, window_size=window_size, upcast=False,
                              reorder_ops=True,
                              intermediate_dtype=dtype if dtype == torch.float8_e4m3fn else None)
    q = q.to(dtype)
    k_cache = k_cache.to(dtype)
    v_cache = v_cache.to(dtype)
    k_cache_paged = k_cache_paged.to(dtype) if page_size is not None else None
    v_cache_paged = v_cache_paged.to(dtype) if page_size is not None else None
    k = k.to(dtype) if k is not None else None
    v = v.to(dtype) if v is not None else None
    k_cache_saved = k_cache.clone() if page_size is None else k_cache_paged.clone()
    v_cache_saved = v_cache.clone() if page_size is None else v_cache_paged.clone()
    for num_splits in num_splits_vals:
        if page_size is None:
            k_cache.copy_(k_cache_saved)
            v_cache.copy_(v_cache_saved)
        else:
            k_cache_paged.copy_(k_cache_saved)
            v_cache_paged.copy_(v_cache_saved)
        call = dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                    page_table=page_table, causal=causal, window_size=window_size,
                    rotary_interleaved=False, num_splits=num_splits, return_softmax_lse=True)
        args = (q, k_cache if page_size is None else k_cache_paged,
                v_cache if page_size is None else v_cache_paged, k, v)
        if local and not causal and seqlen_q > 1:  # see the module docstring
            with pytest.raises(ValueError, match="window_size"):
                flash_attn_with_kvcache(*args, **call)
            return
        out, lse, *rest = flash_attn_with_kvcache(*args, **call)
        # Check that FlashAttention's numerical error is at most twice the numerical error
        # of a Pytorch implementation.
        if new_kv:
            if page_size is None:
                k_cache_select = (k_cache.to(dtype_ref) if not has_batch_idx
                                  else k_cache.to(dtype_ref)[cache_batch_idx])
                v_cache_select = (v_cache.to(dtype_ref) if not has_batch_idx
                                  else v_cache.to(dtype_ref)[cache_batch_idx])
            else:
                rows = page_table if not has_batch_idx else page_table[cache_batch_idx]
                k_cache_select = k_cache_paged.to(dtype_ref)[rows.flatten()].reshape(
                    batch_size, -1, nheads_k, d)[:, :seqlen_k].to(dtype_ref)
                v_cache_select = v_cache_paged.to(dtype_ref)[rows.flatten()].reshape(
                    batch_size, -1, nheads_k, dv)[:, :seqlen_k].to(dtype_ref)
            k_cache_ref = k_cache_ref.to(dtype).to(dtype_ref)
            v_cache_ref = v_cache_ref.to(dtype).to(dtype_ref)
            if dtype is not torch.float8_e4m3fn:
                assert torch.equal(v_cache_select, v_cache_ref)
            else:
                assert torch.allclose(v_cache_select, v_cache_ref, rtol=1e-3, atol=1e-3)
            assert torch.equal(k_cache_select, k_cache_ref)  # rotary_dim == 0
        mult = 4 if dtype == torch.float8_e4m3fn else 2
        assert (out - out_ref).abs().max().item() <= \
            mult * (out_pt - out_ref).abs().max().item() + 1e-5
        mult_mean = 3 if dtype == torch.float8_e4m3fn else 1.5
        assert (out - out_ref).abs().mean().item() <= \
            mult_mean * (out_pt - out_ref).abs().mean().item()


#: the whole upstream grid (6,336 cases x 3 split counts; 5,184 run, the rest skip on a page
#: size that does not divide seqlen_k) runs only when asked for: it would take the GPU-test
#: phase's whole budget; GPU_CASES below runs by default at full size.
#: PAGEDATTN_PEER_SUITES=sample runs every combination of the other parameters at two of its
#: runnable (seqlen_q, seqlen_k) pairs (conftest's _peer_sample): 1,152 cases
FULL_GRID = pytest.mark.skipif(
    os.environ.get("PAGEDATTN_PEER_SUITES") not in ("full", "sample"),
    reason="the full upstream grid: set PAGEDATTN_PEER_SUITES=full (or sample)")


@pytest.mark.gpu
@FULL_GRID
@pytest.mark.peer_grid("seqlen_q", "seqlen_k", runs=lambda p: (
    p["page_size"] is None or p["seqlen_k"] % p["page_size"] == 0)
    and not (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mha_type", ["mha", "mqa", "gqa"])
@pytest.mark.parametrize("new_kv", [False, True])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("seqlen_new_eq_seqlen_q", [True, False])
@pytest.mark.parametrize("page_size", [None, 1, 4, 128])
@pytest.mark.parametrize("has_batch_idx", [False, True])
@pytest.mark.parametrize("d", [128])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [
    (1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
    (128, 128), (256, 512), (2048, 3577)])
def test_flash_attn_kvcache(device, seqlen_q, seqlen_k, d, has_batch_idx, page_size,
                            seqlen_new_eq_seqlen_q, causal, local, new_kv, mha_type, dtype):
    run_kvcache_case(device, seqlen_q, seqlen_k, d, has_batch_idx, page_size,
                     seqlen_new_eq_seqlen_q, causal, local, new_kv, mha_type, dtype)


#: the default GPU subset at upstream's full sizes (batch 5, d 128): (seqlen_q, seqlen_k,
#: has_batch_idx, page_size, seqlen_new_eq_seqlen_q, causal, local, new_kv, mha_type, dtype)
GPU_CASES = [(sq, sk, False, ps, True, c, lo, nk, mt, dt)
             for sq, sk in [(1, 128), (1, 339), (3, 1024), (64, 800), (16, 20000)]
             for ps in (None, 4) for c, lo in [(True, False), (False, False), (False, True)]
             for nk in (False, True) for mt, dt in [("gqa", torch.bfloat16),
                                                    ("mqa", torch.float8_e4m3fn)]]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_flash_attn_kvcache_gpu_subset(device, case):
    seqlen_q, seqlen_k, has_batch_idx, page_size, eq, causal, local, new_kv, mha, dtype = case
    run_kvcache_case(device, seqlen_q, seqlen_k, 128, has_batch_idx, page_size, eq, causal,
                     local, new_kv, mha, dtype)


#: the CPU subset: (seqlen_q, seqlen_k, has_batch_idx, page_size, seqlen_new_eq_seqlen_q,
#: causal, local, new_kv, mha_type, dtype), upstream's values with the sizes shrunk
CPU_CASES = [
    (1, 24, False, 4, True, True, False, True, "gqa", torch.bfloat16),      # decode + append
    (1, 20, False, None, True, False, False, False, "mha", torch.bfloat16),  # contiguous
    (1, 20, True, None, True, False, True, True, "mqa", torch.bfloat16),     # batch idx, local
    (1, 24, True, 4, False, True, False, True, "gqa", torch.bfloat16),       # paged batch idx
    (3, 24, False, 1, False, True, False, True, "gqa", torch.bfloat16),      # page 1, sq 3
    (4, 24, False, 4, True, False, False, False, "gqa", torch.bfloat16),     # non-causal sq 4
    (3, 24, False, 4, True, True, False, True, "gqa", torch.float8_e4m3fn),  # fp8
    (3, 24, False, 4, True, False, True, False, "mha", torch.bfloat16),      # refused
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_flash_attn_kvcache_cpu_subset(device, case):
    seqlen_q, seqlen_k, has_batch_idx, page_size, eq, causal, local, new_kv, mha, dtype = case
    run_kvcache_case(device, seqlen_q, seqlen_k, 32, has_batch_idx, page_size, eq, causal,
                     local, new_kv, mha, dtype, batch_size=2,
                     num_splits_vals=(1, 3, 0) if case is CPU_CASES[0] else (0,))


def test_the_per_call_bench_checks_every_pattern_on_the_cpu():
    """``scripts/fa_dropin_per_call.py --dry-run``: four rows by three calling patterns
    (the same tensors, fresh views, fresh tensors), interpreter-sized, each output against the
    float64 oracle (exit 0, twelve errors within the dtype's tolerance); a bad ``--rows``
    exits 2 with one line."""
    from _scripts import assert_unknown_row_exits_2, run_script

    from pagedattn.testing import tolerance_for

    run = run_script("fa_dropin_per_call.py", "--dry-run", interpret=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if " err " in line]
    assert {line.split(" | ")[1] for line in lines} == {
        "pattern same", "pattern views", "pattern fresh"}
    errs = [float(line.split(" err ")[1].split()[0]) for line in lines]
    assert len(errs) == 12 and max(errs) <= tolerance_for(torch.bfloat16)
    assert_unknown_row_exits_2("fa_dropin_per_call.py")
