"""FlashInfer's own MLA tests (``tests/attention/test_deepseek_mla.py``), run against
``pagedattn.compat.BatchMLAPagedAttentionWrapper``.

Upstream: flashinfer-ai/flashinfer, commit 00c6ba87b4426f9882c8b9f67f33c06dc724cf15,
``tests/attention/test_deepseek_mla.py``. License: Apache License 2.0 ("Copyright (c) 2023 by
FlashInfer team. Licensed under the Apache License, Version 2.0";
http://www.apache.org/licenses/LICENSE-2.0). Modified from the original: the wrapper under
test is ours; the changes are listed here.

References and tolerances are upstream's: ``attention_ref`` (float32 torch, FlashInfer's
base-2 LSE) at ``rtol=atol=1e-3`` (``2e-3`` for the varlen test), the fp8 tests against the
same wrapper on the bf16 dequantization of the fp8 data. The parametrizations are shrunk for
the CPU (Triton's interpreter): batch, lengths and query lengths smaller, one value of
``backend`` a test (accepted and ignored: one kernel serves them), the page-attention test
through its ``use_cuda_graph`` branch only (its plan, run, re-plan in place and run cover
the plain branch) at 16-token pages (one-token pages: the varlen test), DeepSeek-V3's 512 +
64 dims kept; the GPU runs the same grid.

Skipped or changed, with the reason:
- ``test_single_prefill_with_kv_cache``, ``test_batch_prefill_with_ragged_kv_cache``: not
  the MLA wrapper (FlashInfer's prefill kernels at head_dim 192/128).
- ``test_batch_mla_varlen_page_attention``: upstream's query lengths are equal per request,
  so it runs; a ragged ``qo_indptr`` is refused (``test_ragged_query_lengths_are_refused``).
- ``test_cutlass_mla``: sm100 only (``backend="cutlass"`` is refused here).
- ``test_batch_mla_fp8_nope_group_scales_matches_bf16_reference``: per-group fp8 scales
  (``ckv_scale_arr``) are refused, which the test checks instead.
- ``test_fp8_kv_plan_rejects_fp16_q``: pagedattn's fp8 path takes fp16 queries too (range-
  scaled into fp16), so the test runs the fp16 query against the reference instead.
- ``test_fp8_kv_run_rejects_dtype_mismatch``: the mismatch raises a ``TypeError`` naming
  ``q_nope`` / ``ckv_cache`` (pagedattn's type errors), not a ``ValueError``.
- The ``warmup_jit`` fixture and ``clear_cuda_cache`` (FlashInfer's JIT and memory helpers).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from pagedattn.compat import BatchMLAPagedAttentionWrapper

HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64


def attention_ref(batch_size, q, k, v, causal, sm_scale):
    """Upstream's reference: ``q [batch·qo_len, heads, dim_qk]``, ``k``/``v`` per head;
    returns the output and the base-2 LSE ``[batch, qo_len, heads]``."""
    qo_len = q.shape[0] // batch_size
    kv_len = k.shape[0] // batch_size
    num_qo_heads = q.shape[1]
    head_dim_qk = q.shape[2]
    head_dim_vo = v.shape[2]
    logits = torch.einsum("bmhd,bnhd->bhmn",
                          q.view(batch_size, qo_len, num_qo_heads, head_dim_qk).float(),
                          k.view(batch_size, kv_len, num_qo_heads, head_dim_qk).float()) \
        * sm_scale
    if causal:
        mask = torch.arange(kv_len - qo_len, kv_len, device=q.device).unsqueeze(1) \
            >= torch.arange(0, kv_len, device=q.device).unsqueeze(0)
    else:
        mask = torch.ones(qo_len, kv_len, device=q.device)
    logits = logits.masked_fill(mask.unsqueeze(0).unsqueeze(0) == 0, float("-inf"))
    lse_ref = torch.logsumexp(logits, -1).transpose(-1, -2)
    p = torch.softmax(logits, dim=-1)
    o_ref = (torch.einsum("bhmn,bnhd->bmhd", p,
                          v.view(batch_size, kv_len, num_qo_heads, head_dim_vo).float())
             .contiguous().view(batch_size * qo_len, num_qo_heads, head_dim_vo).to(q))
    return o_ref, lse_ref * math.log2(math.e)


def generate_kv_from_cache(ckv, kpe, kv_len, batch_size, num_heads):
    bs_page_num, page_size, ckv_dim = ckv.shape
    page_num = bs_page_num // batch_size
    _, _, kpe_dim = kpe.shape
    ckv = ckv.view(batch_size, page_num * page_size, ckv_dim)[:, :kv_len, :]
    kpe = kpe.view(batch_size, page_num * page_size, kpe_dim)[:, :kv_len, :]
    k = torch.cat([ckv, kpe], dim=-1).view(-1, 1, ckv_dim + kpe_dim) \
        .repeat_interleave(num_heads, dim=1)
    v = ckv.repeat_interleave(num_heads, dim=1)
    return k, v


def _wrapper(device, **kw):
    return BatchMLAPagedAttentionWrapper(torch.empty(1024, dtype=torch.int8, device=device),
                                         **kw)


def _uniform_inputs(device, batch_size, kv_len, qo_len, num_heads, page_size, dtype):
    """Upstream's opening of its uniform-length tests, seeded (42) and drawn in its order:
    ``q_nope [batch·qo_len, heads, 512]``, ``q_pe [batch·qo_len, heads, 64]``, ``ckv``
    ``[batch·pages_num, page_size, 512]``, ``kpe [batch·pages_num, page_size, 64]`` of
    ``dtype``, and ``pages_num = ceil(kv_len / page_size)`` (each request's pages)."""
    torch.manual_seed(42)
    q_nope = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_CKV, dtype=dtype,
                         device=device)
    q_pe = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_KPE, dtype=dtype,
                       device=device)
    pages_num = math.ceil(kv_len / page_size)
    ckv = torch.randn(batch_size * pages_num, page_size, HEAD_DIM_CKV, dtype=dtype,
                      device=device)
    kpe = torch.randn(batch_size * pages_num, page_size, HEAD_DIM_KPE, dtype=dtype,
                      device=device)
    return q_nope, q_pe, ckv, kpe, pages_num


def _uniform_meta(device, batch_size, kv_len, qo_len, pages_num):
    """The plan's int32 metadata for ``batch_size`` requests of ``qo_len`` queries and
    ``kv_len`` keys each, request ``b`` on pages ``[b·pages_num, (b + 1)·pages_num)``:
    ``(qo_indptr, kv_indptr [batch + 1], kv_indices [batch·pages_num], kv_len_arr [batch])``."""
    q_indptr = torch.arange(0, batch_size + 1, device=device, dtype=torch.int32) * qo_len
    kv_indptr = torch.arange(0, batch_size + 1, device=device, dtype=torch.int32) * pages_num
    kv_indices = torch.arange(0, batch_size * pages_num, device=device, dtype=torch.int32)
    kv_lens = torch.full((batch_size,), kv_len, dtype=torch.int32, device=device)
    return q_indptr, kv_indptr, kv_indices, kv_lens


def test_batch_mla_without_kpe(device):
    torch.manual_seed(42)
    batch_size, qo_len, kv_len, num_heads = 2, 3, 97, 16
    head_dim_ckv, head_dim_kpe, page_size = 512, 0, 16
    dtype = torch.float16
    pages_num = math.ceil(kv_len / page_size)
    q_nope = torch.randn(batch_size * qo_len, num_heads, head_dim_ckv, dtype=dtype,
                         device=device)
    q_pe = torch.empty(batch_size * qo_len, num_heads, head_dim_kpe, dtype=dtype, device=device)
    ckv = torch.randn(batch_size * pages_num, page_size, head_dim_ckv, dtype=dtype,
                      device=device)
    kpe = torch.empty(batch_size * pages_num, page_size, head_dim_kpe, dtype=dtype,
                      device=device)
    sm_scale = 1.0 / math.sqrt(128)
    wrapper = _wrapper(device, backend="fa2")
    q_indptr, kv_indptr, kv_indices, kv_lens = _uniform_meta(device, batch_size, kv_len,
                                                             qo_len, pages_num)
    wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, num_heads, head_dim_ckv,
                 head_dim_kpe, page_size, False, sm_scale, dtype, dtype)
    output, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    key, value = generate_kv_from_cache(ckv, kpe, kv_len, batch_size, num_heads)
    output_ref, lse_ref = attention_ref(batch_size, q_nope, key, value, False, sm_scale)
    torch.testing.assert_close(output, output_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, lse_ref.flatten(0, 1), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("batch_size", [2])
@pytest.mark.parametrize("kv_len_0", [3])
@pytest.mark.parametrize("kv_len_1", [17])
@pytest.mark.parametrize("kv_len_2", [100])
@pytest.mark.parametrize("qo_len", [1, 3])
@pytest.mark.parametrize("num_heads", [16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [1])
@pytest.mark.parametrize("dtype", [torch.half])
def test_batch_mla_varlen_page_attention(device, batch_size, kv_len_0, kv_len_1, kv_len_2,
                                         qo_len, num_heads, causal, page_size, dtype):
    if causal and qo_len > min(kv_len_0, kv_len_1, kv_len_2):
        pytest.skip("qo_len > kv_len not supported for causal attention")
    num_different_kv_len = 3
    kv_lens = torch.tensor([kv_len_0, kv_len_1, kv_len_2], dtype=torch.int32)
    torch.manual_seed(42)
    q_nope = torch.randn(num_different_kv_len * batch_size * qo_len, num_heads, HEAD_DIM_CKV,
                         dtype=dtype, device=device)
    q_pe = torch.randn(num_different_kv_len * batch_size * qo_len, num_heads, HEAD_DIM_KPE,
                       dtype=dtype, device=device)
    pages_nums = torch.tensor([math.ceil(kv_len / page_size) for kv_len in kv_lens],
                              dtype=torch.int32)
    pages_nums_indptr = torch.zeros(num_different_kv_len + 1, dtype=torch.int32)
    pages_nums_indptr[1:] = pages_nums.cumsum(0)
    pages_nums_sum = pages_nums_indptr[-1]
    ckv = torch.randn(batch_size * pages_nums_sum, page_size, HEAD_DIM_CKV, dtype=dtype,
                      device=device)
    kpe = torch.randn(batch_size * pages_nums_sum, page_size, HEAD_DIM_KPE, dtype=dtype,
                      device=device)
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    wrapper = _wrapper(device, backend="fa3")
    q_indptr = torch.arange(0, num_different_kv_len * batch_size + 1, device=device,
                            dtype=torch.int32) * qo_len
    page_counts = pages_nums.repeat(batch_size).to(device)
    kv_indptr = torch.cat((torch.zeros(1, device=device, dtype=torch.int32),
                           page_counts.cumsum(0, dtype=torch.int32)))
    kv_indices = torch.arange(0, batch_size * pages_nums_sum, device=device, dtype=torch.int32)
    kv_lens = kv_lens.clone().to(device).repeat(batch_size)
    wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, num_heads, HEAD_DIM_CKV,
                 HEAD_DIM_KPE, page_size, causal, sm_scale, q_nope.dtype, ckv.dtype,
                 lse_mode="base2")
    o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)

    q_rows = (torch.arange(0, num_different_kv_len * qo_len)[None, :]
              + torch.arange(0, batch_size)[:, None] * num_different_kv_len * qo_len).int()
    kv_rows = (torch.arange(0, pages_nums_sum)[None, :]
               + torch.arange(0, batch_size)[:, None] * pages_nums_sum).int()
    q_rows_arr = [q_rows[:, i * qo_len:(i + 1) * qo_len].flatten()
                  for i in range(num_different_kv_len)]
    kv_rows_arr = [kv_rows[:, pages_nums_indptr[i]:pages_nums_indptr[i + 1]].flatten()
                   for i in range(num_different_kv_len)]
    for i in range(num_different_kv_len):
        k, v = generate_kv_from_cache(ckv[kv_rows_arr[i]], kpe[kv_rows_arr[i]], kv_lens[i],
                                      batch_size, num_heads)
        q = torch.cat([q_nope, q_pe], dim=-1)[q_rows_arr[i]]
        o_ref, lse_ref = attention_ref(batch_size, q, k, v, causal, sm_scale)
        lse_ref = lse_ref.flatten(0, 1)
        torch.testing.assert_close(o[q_rows_arr[i]], o_ref, rtol=1e-3, atol=2e-3)
        if kv_lens[i] != 0:  # pagedattn: -inf for no key (upstream's reference: -inf too)
            torch.testing.assert_close(lse[q_rows_arr[i]], lse_ref, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("batch_size", [3])
@pytest.mark.parametrize("kv_len", [17, 75])
@pytest.mark.parametrize("qo_len", [3])
@pytest.mark.parametrize("num_heads", [16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [32])
@pytest.mark.parametrize("dtype", [torch.half])
def test_batch_mla_oob_kv_nan(device, batch_size, kv_len, qo_len, num_heads, causal,
                              page_size, dtype):
    if causal and qo_len > kv_len:
        pytest.skip("qo_len > kv_len not supported for causal attention")
    q_nope, q_pe, ckv, kpe, pages_num = _uniform_inputs(device, batch_size, kv_len, qo_len,
                                                        num_heads, page_size, dtype)
    for i in range(batch_size):  # the out-of-bounds slots of each last page: NaN
        last_page_len = kv_len - (pages_num - 1) * page_size
        ckv[(i + 1) * pages_num - 1, last_page_len:, :] = float("nan")
        kpe[(i + 1) * pages_num - 1, last_page_len:, :] = float("nan")
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    wrapper = _wrapper(device, backend="fa2")
    q_indptr, kv_indptr, kv_indices, kv_lens = _uniform_meta(device, batch_size, kv_len,
                                                             qo_len, pages_num)
    wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, num_heads, HEAD_DIM_CKV,
                 HEAD_DIM_KPE, page_size, causal, sm_scale, q_nope.dtype, ckv.dtype)
    o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    k, v = generate_kv_from_cache(ckv, kpe, kv_len, batch_size, num_heads)
    q = torch.cat([q_nope, q_pe], dim=-1)
    o_ref, lse_ref = attention_ref(batch_size, q, k, v, causal, sm_scale)
    torch.testing.assert_close(o, o_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, lse_ref.flatten(0, 1), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("batch_size", [3])
@pytest.mark.parametrize("kv_len", [0, 17, 40])
@pytest.mark.parametrize("qo_len", [1, 3])
@pytest.mark.parametrize("num_heads", [16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [16])
@pytest.mark.parametrize("use_cuda_graph", [True])
@pytest.mark.parametrize("dtype", [torch.half])
def test_batch_mla_page_attention(device, batch_size, kv_len, qo_len, num_heads, causal,
                                  page_size, use_cuda_graph, dtype):
    """Upstream's test with its graph branch: the wrapper planned for a warm-up step (every
    length 0), run, then re-planned in place for the real step; on a GPU the run is captured
    and replayed, on the CPU the warm-up run's plan is run again after the re-plan (what a
    replay reads: the same buffers)."""
    if causal and qo_len > kv_len:
        pytest.skip("qo_len > kv_len not supported for causal attention")
    q_nope, q_pe, ckv, kpe, pages_num = _uniform_inputs(device, batch_size, kv_len, qo_len,
                                                        num_heads, page_size, dtype)
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    wrapper = _wrapper(
        device, backend="fa3", use_cuda_graph=True,
        qo_indptr=torch.empty(batch_size + 1, dtype=torch.int32, device=device),
        kv_indptr=torch.empty(batch_size + 1, dtype=torch.int32, device=device),
        kv_indices=torch.empty(4096, dtype=torch.int32, device=device),
        kv_len_arr=torch.empty(batch_size, dtype=torch.int32, device=device))
    q_indptr, kv_indptr, kv_indices, kv_lens = _uniform_meta(device, batch_size, kv_len,
                                                             qo_len, pages_num)
    args = (num_heads, HEAD_DIM_CKV, HEAD_DIM_KPE, page_size, causal, sm_scale, q_nope.dtype,
            ckv.dtype)
    graph = None
    if use_cuda_graph:
        wrapper.plan(q_indptr, torch.zeros(batch_size + 1, device=device, dtype=torch.int32),
                     torch.arange(0, batch_size, device=device, dtype=torch.int32),
                     torch.zeros(batch_size, dtype=torch.int32, device=device), *args,
                     lse_mode="base2")
        o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)  # warm-up
        if torch.cuda.is_available():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, *args, lse_mode="base2")
    if graph is not None:
        o.fill_(0)
        lse.fill_(0)
        graph.replay()
    else:
        o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    k, v = generate_kv_from_cache(ckv, kpe, kv_len, batch_size, num_heads)
    q = torch.cat([q_nope, q_pe], dim=-1)
    o_ref, lse_ref = attention_ref(batch_size, q, k, v, causal, sm_scale)
    lse_ref = lse_ref.flatten(0, 1)
    torch.testing.assert_close(o, o_ref, rtol=1e-3, atol=1e-3)
    if kv_len != 0:
        torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-3)
    # with a pre-allocated output
    o_buffer = torch.empty_like(o)
    lse_buffer = torch.empty_like(lse)
    wrapper.run(q_nope, q_pe, ckv, kpe, out=o_buffer, lse=lse_buffer)
    torch.testing.assert_close(o, o_buffer, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, lse_buffer, rtol=1e-3, atol=1e-3)


def _per_tensor_symmetric_quant_fp8(x, fp8_max=448.0):
    amax = x.abs().max().item()
    scale = amax / fp8_max if amax > 0 else 1.0
    return (x / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def _ref_dequant_to_bf16(fp8, scale):
    scale_bf16 = torch.tensor(scale, dtype=torch.bfloat16).to(fp8.device)
    return (fp8.to(torch.bfloat16) * scale_bf16).to(torch.bfloat16)


def _run_mla(device, q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
             num_heads, page_size, causal, sm_scale, q_dtype, kv_dtype, **kwargs):
    wrapper = _wrapper(device, backend="fa3")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads=num_heads,
                 head_dim_ckv=HEAD_DIM_CKV, head_dim_kpe=q_pe.shape[-1], page_size=page_size,
                 causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
    return wrapper.run(q_nope, q_pe, ckv, kpe, **kwargs)


def _bf16_and_fp8(device, q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta,
                  num_heads, page_size, causal, sm_scale):
    """Upstream's comparison of its fp8 tests: the bf16 query run on the bf16 dequantization
    of the fp8 caches (the reference), then on the fp8 caches with their per-tensor scales;
    ``meta``: ``(qo_indptr, kv_indptr, kv_indices, kv_len_arr)``. Returns ``(o_bf16, o_fp8)``,
    ``[batch·qo_len, num_heads, 512]`` bf16 each."""
    common = (*meta, num_heads, page_size, causal, sm_scale, torch.bfloat16)
    o_bf16 = _run_mla(device, q_nope, q_pe, _ref_dequant_to_bf16(ckv_fp8, ckv_scale),
                      _ref_dequant_to_bf16(kpe_fp8, kpe_scale), *common, torch.bfloat16)
    o_fp8 = _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *common, torch.float8_e4m3fn,
                     ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    return o_bf16, o_fp8


def _fp8_case(device, batch_size, kv_len, qo_len, page_size, num_heads, ckv_mag, kpe_mag,
              q_scale, q_dtype=torch.bfloat16):
    q_nope = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_CKV, device=device,
                         dtype=q_dtype) * q_scale
    q_pe = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_KPE, device=device,
                       dtype=q_dtype) * q_scale
    num_pages = (batch_size * kv_len + page_size - 1) // page_size
    ckv_fp8, ckv_scale = _per_tensor_symmetric_quant_fp8(
        torch.randn(num_pages, page_size, HEAD_DIM_CKV, device=device) * ckv_mag)
    kpe_fp8, kpe_scale = _per_tensor_symmetric_quant_fp8(
        torch.randn(num_pages, page_size, HEAD_DIM_KPE, device=device) * kpe_mag)
    meta = (torch.arange(0, batch_size + 1, dtype=torch.int32, device=device) * qo_len,
            torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
            * (kv_len // page_size),
            torch.arange(0, num_pages, dtype=torch.int32, device=device),
            torch.full((batch_size,), kv_len, dtype=torch.int32, device=device))
    return q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta


@pytest.mark.parametrize("batch_size", [2])
@pytest.mark.parametrize("kv_len", [128])
@pytest.mark.parametrize("qo_len", [1, 4])
@pytest.mark.parametrize("page_size", [64])
@pytest.mark.parametrize("num_heads", [16])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_mla_fp8_kv_matches_bf16_reference(device, batch_size, kv_len, qo_len,
                                                 page_size, num_heads, causal):
    if causal and qo_len > kv_len:
        pytest.skip("invalid causal config (qo_len > kv_len)")
    torch.manual_seed(0xCAFE)
    q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta = _fp8_case(
        device, batch_size, kv_len, qo_len, page_size, num_heads, 0.1, 0.1, 0.1)
    sm_scale = 1.0 / math.sqrt(HEAD_DIM_CKV + HEAD_DIM_KPE)
    o_bf16, o_fp8 = _bf16_and_fp8(device, q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale,
                                  meta, num_heads, page_size, causal, sm_scale)
    assert o_bf16.shape == o_fp8.shape
    assert (o_fp8.float() - o_bf16.float()).abs().max().item() < 1.5e-2


@pytest.mark.parametrize("ckv_magnitude", [0.01, 1.0])
@pytest.mark.parametrize("kpe_magnitude", [0.01, 1.0])
def test_batch_mla_fp8_kv_scale_sensitivity(device, ckv_magnitude, kpe_magnitude):
    torch.manual_seed(7)
    batch_size, qo_len, kv_len, num_heads, page_size = 2, 1, 128, 64, 64
    q_scale = 0.1 / max(ckv_magnitude, kpe_magnitude)
    q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta = _fp8_case(
        device, batch_size, kv_len, qo_len, page_size, num_heads, ckv_magnitude,
        kpe_magnitude, q_scale)
    sm_scale = 1.0 / math.sqrt(HEAD_DIM_CKV + HEAD_DIM_KPE)
    o_bf16, o_fp8 = _bf16_and_fp8(device, q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale,
                                  meta, num_heads, page_size, False, sm_scale)
    assert (o_fp8.float() - o_bf16.float()).abs().max().item() < 5e-2


def test_batch_mla_fp8_kv_zero_kv_gives_zero_output(device):
    torch.manual_seed(0)
    batch_size, qo_len, kv_len, num_heads, page_size = 2, 1, 128, 128, 64
    q_nope = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_CKV, device=device,
                         dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(batch_size * qo_len, num_heads, HEAD_DIM_KPE, device=device,
                       dtype=torch.bfloat16) * 0.1
    num_pages = (batch_size * kv_len + page_size - 1) // page_size
    ckv_fp8 = torch.zeros(num_pages, page_size, HEAD_DIM_CKV, device=device,
                          dtype=torch.float8_e4m3fn)
    kpe_fp8 = torch.zeros(num_pages, page_size, HEAD_DIM_KPE, device=device,
                          dtype=torch.float8_e4m3fn)
    meta = (torch.arange(0, batch_size + 1, dtype=torch.int32, device=device) * qo_len,
            torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
            * (kv_len // page_size),
            torch.arange(0, num_pages, dtype=torch.int32, device=device),
            torch.full((batch_size,), kv_len, dtype=torch.int32, device=device))
    o = _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *meta, num_heads, page_size, False,
                 1.0 / math.sqrt(HEAD_DIM_CKV + HEAD_DIM_KPE), torch.bfloat16,
                 torch.float8_e4m3fn, ckv_scale=1.0, kpe_scale=1.0)
    assert o.abs().max().item() == 0.0


def test_fp8_kv_kpe_dominant_no_row_aliasing(device):
    torch.manual_seed(0)
    B, ql, kl, H, P = 1, 1, 64, 16, 64
    q_nope = torch.zeros(B * ql, H, HEAD_DIM_CKV, device=device, dtype=torch.bfloat16)
    q_pe = torch.ones(B * ql, H, HEAD_DIM_KPE, device=device, dtype=torch.bfloat16)
    nps = (B * kl + P - 1) // P
    ckv_fp32 = torch.zeros(nps, P, HEAD_DIM_CKV, device=device)
    kpe_fp32 = torch.zeros(nps, P, HEAD_DIM_KPE, device=device)
    kpe_fp32[0, 4, :] = 1.0
    kpe_fp32[0, 8, :] = -1.0
    ckv_fp32[0, 4, 0] = 100.0
    ckv_fp32[0, 8, 0] = -100.0
    ckv_fp8, ckv_scale = _per_tensor_symmetric_quant_fp8(ckv_fp32)
    kpe_fp8, kpe_scale = _per_tensor_symmetric_quant_fp8(kpe_fp32)
    meta = (torch.arange(0, B + 1, dtype=torch.int32, device=device) * ql,
            torch.arange(0, B + 1, dtype=torch.int32, device=device) * (kl // P),
            torch.arange(0, nps, dtype=torch.int32, device=device),
            torch.full((B,), kl, dtype=torch.int32, device=device))
    o_bf16, o_fp8 = _bf16_and_fp8(device, q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale,
                                  meta, H, P, False, 1.0)
    assert o_bf16[0, 0, 0].item() > 50.0
    assert (o_fp8.float() - o_bf16.float()).abs().max().item() < 1e-3


def test_fp8_kv_with_fp16_query(device):
    """Upstream refuses an fp16 query with an fp8 cache at plan(); pagedattn runs it (the
    query range-scaled into fp16): it matches the bf16 path at upstream's fp8 bound."""
    torch.manual_seed(3)
    q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta = _fp8_case(
        device, 1, 64, 1, 64, 16, 0.1, 0.1, 0.1, q_dtype=torch.float16)
    common = (*meta, 16, 64, False, 1.0 / math.sqrt(576))
    o_fp8 = _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *common, torch.float16,
                     torch.float8_e4m3fn, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    o_ref = _run_mla(device, q_nope, q_pe,
                     _ref_dequant_to_bf16(ckv_fp8, ckv_scale).half(),
                     _ref_dequant_to_bf16(kpe_fp8, kpe_scale).half(), *common, torch.float16,
                     torch.float16)
    assert (o_fp8.float() - o_ref.float()).abs().max().item() < 1.5e-2


def test_fp8_kv_scales_are_keyword_only():
    params = inspect.signature(BatchMLAPagedAttentionWrapper.run).parameters
    for name in ("ckv_scale", "kpe_scale", "ckv_scale_arr"):
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("wrong_input, wrong_dtype, name", [
    ("query", torch.float16, "q_nope"), ("kv_cache", torch.bfloat16, "ckv_cache")])
def test_fp8_kv_run_rejects_dtype_mismatch(device, wrong_input, wrong_dtype, name):
    q_nope, q_pe, ckv_fp8, _, kpe_fp8, _, meta = _fp8_case(device, 1, 64, 1, 64, 16, 0.1, 0.1,
                                                          0.1)
    if wrong_input == "query":
        q_nope, q_pe = q_nope.to(wrong_dtype), q_pe.to(wrong_dtype)
    else:
        ckv_fp8, kpe_fp8 = ckv_fp8.to(wrong_dtype), kpe_fp8.to(wrong_dtype)
    with pytest.raises(TypeError, match=rf"^{name}\b"):
        _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *meta, 16, 64, False, 0.1,
                 torch.bfloat16, torch.float8_e4m3fn)


def test_group_scales_and_cutlass_are_refused(device):
    """Per-group fp8 scales (``ckv_scale_arr``, DeepSeek's FP8 format) and the cutlass
    backend's run-time page table are refused, naming the argument."""
    with pytest.raises(ValueError, match="^backend"):
        _wrapper(device, backend="cutlass")
    q_nope, q_pe, ckv_fp8, _, kpe_fp8, _, meta = _fp8_case(device, 1, 64, 1, 64, 16, 0.1, 0.1,
                                                          0.1)
    for kw in (dict(ckv_scale_arr=torch.ones(4, device=device)),
               dict(page_table=meta[2][None]), dict(kv_len=meta[3])):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}"):
            _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *meta, 16, 64, False, 0.1,
                     torch.bfloat16, torch.float8_e4m3fn, **kw)


def test_fp8_kv_one_scale_without_the_other_is_refused(device):
    """FlashInfer's run takes an fp8 cache's ``ckv_scale`` and ``kpe_scale`` together: one
    without the other is refused naming the missing one (it dequantized the rope cache with
    ``ckv_scale``, or the latent cache with 1.0)."""
    q_nope, q_pe, ckv_fp8, ckv_scale, kpe_fp8, kpe_scale, meta = _fp8_case(
        device, 1, 64, 1, 64, 16, 0.1, 10.0, 0.1)
    for given, missing in ((dict(ckv_scale=ckv_scale), "kpe_scale"),
                           (dict(kpe_scale=kpe_scale), "ckv_scale")):
        with pytest.raises(ValueError, match=f"^{missing}: expected a scale with"):
            _run_mla(device, q_nope, q_pe, ckv_fp8, kpe_fp8, *meta, 16, 64, False, 0.1,
                     torch.bfloat16, torch.float8_e4m3fn, **given)


def test_ragged_query_lengths_are_refused(device):
    wrapper = _wrapper(device)
    with pytest.raises(ValueError, match="^qo_indptr"):
        wrapper.plan(torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
                     torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                     torch.arange(2, dtype=torch.int32, device=device),
                     torch.tensor([5, 9], dtype=torch.int32, device=device), 16, 512, 64, 16,
                     True, 0.1, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="^kv_len_arr"):  # more tokens than its pages hold
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32, device=device),
                     torch.tensor([0, 1], dtype=torch.int32, device=device),
                     torch.arange(1, dtype=torch.int32, device=device),
                     torch.tensor([17], dtype=torch.int32, device=device), 16, 512, 64, 16,
                     True, 0.1, torch.bfloat16, torch.bfloat16)
