"""FlashInfer's own ``tests/attention/test_batch_decode_kernels.py``, run against
``pagedattn.compat.BatchDecodeWithPagedKVCacheWrapper``.

Upstream: flashinfer-ai/flashinfer, commit fb28d7242b3506a2348265962041acc1fb56cca4,
``tests/attention/test_batch_decode_kernels.py``. License: Apache License 2.0
("Copyright (c) 2023 by FlashInfer team. Licensed under the Apache License, Version 2.0";
http://www.apache.org/licenses/LICENSE-2.0). Modified from the original: the wrapper under
test is ours; the changes are listed here.

References and tolerances are upstream's: each request's output against FlashInfer's
``single_decode_with_kv_cache`` at ``rtol=atol=1e-3`` (the multi-token case against its
``BatchPrefillWithPagedKVCacheWrapper``, causal, at ``1e-2``; the extreme-logits case against
torch at ``atol=0`` / ``1e-3``). When ``flashinfer`` imports (the GPU machine) those are
FlashInfer's own kernels; without it, ``single_decode_with_kv_cache`` and ``prefill_ref``
below are float32 torch transcriptions of their documented semantics (softmax of
``q·kᵀ / sqrt(head_dim)``, soft-capped, GQA by ``h // group``; causal bottom-right).

The upstream parametrizations run at full size under ``@pytest.mark.gpu`` when
``PAGEDATTN_PEER_SUITES=full`` (thousands of cases); by default the GPU runs ``GPU_CASES``
(64 of them at full size, half through each cache form) and the multi-token graph test; the
CPU runs
``CPU_CASES`` (Triton's interpreter): upstream's parameters with batch, kv_len and head_dim
shrunk, plus one HND and one non-contiguous case (branches of upstream's test body that its
parametrization does not select). ``test_paged_decode_extreme_negative_logits`` runs at its
upstream size on the CPU too.

Skipped, with the reason:
- ``pos_encoding_mode="ROPE_LLAMA"``: RoPE inside the kernel is not supported; those cases
  check that ``plan`` raises ValueError naming ``pos_encoding_mode`` instead.
- ``head_dim=512``: pagedattn's kernels take head_dim <= 256.
- ``test_batch_decode_with_paged_kv_cache_with_fast_plan`` (``fast_decode_plan`` is
  FlashInfer's internal planner), the NVFP4 tests (``kv_cache_sf``: refused), the
  ``single_decode_*`` and ``torch.compile`` tests (not the batch wrapper), and the second half
  of ``test_tensor_core_decode_rejects_mismatched_q_len`` (FlashInfer's CUDA-core kernel
  refuses ``q_len_per_req > 1`` without tensor cores; pagedattn runs it).
- The ``warmup_jit`` fixture (FlashInfer's JIT build).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedattn.compat import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
)

try:  # the peer's own reference kernels, where they import (the GPU machine)
    import flashinfer as _flashinfer
except Exception:  # noqa: BLE001 - absent or broken: the torch transcription below
    _flashinfer = None


def single_decode_with_kv_cache(q, k, v, pos_encoding_mode="NONE", logits_soft_cap=0.0):
    """FlashInfer's reference: ``q [num_qo_heads, head_dim]``, ``k``/``v`` ``[kv_len,
    num_kv_heads, head_dim]`` (NHD)."""
    if _flashinfer is not None and q.is_cuda:
        return _flashinfer.decode.single_decode_with_kv_cache(
            q, k, v, pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap)
    group = q.shape[0] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,khd->hk", q.float(), kf) / math.sqrt(q.shape[-1])
    if logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    return torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), vf).to(q.dtype)


def _gather_request(kv_data_fp32, kv_indptr, kv_last_page_len, i, which, kv_layout,
                    num_kv_heads, head_dim, kv_dtype):
    """Upstream's per-request key (``which=0``) / value (``1``) gather, from the 5-D cache."""
    perm_dims = [0, 2, 1, 3] if kv_layout == "HND" else [0, 1, 2, 3]
    perm_dims_last = [1, 0, 2] if kv_layout == "HND" else [0, 1, 2]
    return torch.cat(
        [
            kv_data_fp32[kv_indptr[i] : kv_indptr[i + 1] - 1, which]
            .permute(*perm_dims)
            .reshape(-1, num_kv_heads, head_dim),
            (
                kv_data_fp32[kv_indptr[i + 1] - 1, which, :, : kv_last_page_len[i]]
                if kv_layout == "HND"
                else kv_data_fp32[kv_indptr[i + 1] - 1, which, : kv_last_page_len[i], :]
            )
            .permute(*perm_dims_last)
            .reshape(-1, num_kv_heads, head_dim),
        ],
        dim=0,
    ).to(kv_dtype)


def _check_requests(o, q, kv_data_fp32, kv_indptr, kv_last_page_len, kv_layout, num_kv_heads,
                    head_dim, kv_dtype, pos_encoding_mode, logits_soft_cap=0.0):
    """Upstream's check: each request against the single-request reference."""
    for i in range(q.shape[0]):
        qi = q[i]
        ki = _gather_request(kv_data_fp32, kv_indptr, kv_last_page_len, i, 0, kv_layout,
                             num_kv_heads, head_dim, kv_dtype)
        vi = _gather_request(kv_data_fp32, kv_indptr, kv_last_page_len, i, 1, kv_layout,
                             num_kv_heads, head_dim, kv_dtype)
        o_ref_i = single_decode_with_kv_cache(
            qi, ki, vi, pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap,
        )
        torch.testing.assert_close(o[i], o_ref_i, rtol=1e-3, atol=1e-3)


def _plan_run_and_check(device, q, kv_data, kv_data_fp32, batch_size, kv_len, page_size,
                        num_kv_heads, num_qo_heads, head_dim, kv_layout, pos_encoding_mode,
                        logits_soft_cap, return_lse, q_dtype, kv_dtype, num_pages_per_seq,
                        total_num_pages):
    """Upstream's shared middle: one page run per sequence, plan, run, each request against
    the single-request reference (``kv_data_fp32``: the 5-D float32 cache, ``[pages, 2, ...]``).
    Returns ``(o, wrapper)``, or ``None`` when the plan is refused (ROPE_LLAMA, see the module
    docstring: checked to raise ValueError naming ``pos_encoding_mode``)."""
    kv_indptr = (
        torch.arange(0, batch_size + 1, device=device, dtype=torch.int32) * num_pages_per_seq
    )
    kv_indices = torch.arange(0, total_num_pages, device=device, dtype=torch.int32)
    kv_last_page_len = torch.full(
        (batch_size,), (kv_len - 1) % page_size + 1, dtype=torch.int32, device=device
    )

    workspace_buffer = torch.empty(32 * 1024 * 1024, dtype=torch.int8, device=device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace_buffer, kv_layout)
    plan_args = (kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads,
                 head_dim, page_size)
    plan_kwargs = dict(logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                       data_type=kv_dtype, q_data_type=q_dtype)
    if pos_encoding_mode == "ROPE_LLAMA":
        with pytest.raises(ValueError, match="pos_encoding_mode"):
            wrapper.plan(*plan_args, **plan_kwargs)
        return None
    wrapper.plan(*plan_args, **plan_kwargs)
    if return_lse:
        o, _ = wrapper.run(q, kv_data, return_lse=True)
    else:
        o = wrapper.run(q, kv_data)
    _check_requests(o, q, kv_data_fp32, kv_indptr, kv_last_page_len, kv_layout, num_kv_heads,
                    head_dim, kv_dtype, pos_encoding_mode, logits_soft_cap)
    return o, wrapper


def _query_and_cache_shape(device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads,
                           head_dim, kv_layout, q_dtype, contiguous_kv, planes):
    """Upstream's shared opening: the query ``[batch, num_qo_heads, head_dim]`` (drawn first),
    ``num_pages_per_seq``, ``total_num_pages``, and the shape of a cache of ``planes`` (``[2]``:
    K and V in one tensor, ``[]``: one of a tuple's two) in ``kv_layout``; not ``contiguous_kv``:
    a 2 before every dim but the first (the test keeps index 1 of each: strided data).
    Returns ``(q, num_pages_per_seq, total_num_pages, kv_shape)``."""
    q = torch.randn(batch_size, num_qo_heads, head_dim, device=device, dtype=q_dtype)
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total_num_pages = num_pages_per_seq * batch_size
    if kv_layout == "HND":
        kv_shape = [total_num_pages, *planes, num_kv_heads, page_size, head_dim]
    else:
        kv_shape = [total_num_pages, *planes, page_size, num_kv_heads, head_dim]
    if not contiguous_kv:
        tmp = [kv_shape[0]]
        for v in kv_shape[1:]:
            tmp.append(2)
            tmp.append(v)
        kv_shape = tmp
    return q, num_pages_per_seq, total_num_pages, kv_shape


def run_batch_decode_case(device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads,
                          head_dim, kv_layout, pos_encoding_mode, logits_soft_cap, return_lse,
                          q_dtype, kv_dtype, contiguous_kv):
    """Upstream's ``test_batch_decode_with_paged_kv_cache`` body."""
    q, num_pages_per_seq, total_num_pages, kv_shape = _query_and_cache_shape(
        device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads, head_dim, kv_layout,
        q_dtype, contiguous_kv, planes=[2])
    if not contiguous_kv:
        kv_data_fp32 = torch.randn(*kv_shape, dtype=torch.float32, device=device)
        kv_data = kv_data_fp32.to(kv_dtype)
        kv_data = kv_data[:, 1, :, 1, :, 1, :, 1, :]
        kv_data_fp32 = kv_data_fp32[:, 1, :, 1, :, 1, :, 1, :]
        # actual data is stored in non-contiguous memory
        assert (
            kv_data.stride(-4)
            != kv_data.shape[-3] * kv_data.shape[-2] * kv_data.shape[-1]
        )
    else:
        kv_data_fp32 = torch.randn(*kv_shape, dtype=torch.float32, device=device)
        kv_data = kv_data_fp32.to(kv_dtype)
    ran = _plan_run_and_check(device, q, kv_data, kv_data_fp32, batch_size, kv_len, page_size,
                              num_kv_heads, num_qo_heads, head_dim, kv_layout,
                              pos_encoding_mode, logits_soft_cap, return_lse, q_dtype,
                              kv_dtype, num_pages_per_seq, total_num_pages)
    if ran is None:
        return
    o, wrapper = ran

    # test user-allocated output
    o_buffer = torch.empty_like(o)
    wrapper.run(q, kv_data, out=o_buffer)
    torch.testing.assert_close(o, o_buffer, rtol=1e-3, atol=1e-3)


def run_tuple_case(device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads,
                   head_dim, kv_layout, pos_encoding_mode, logits_soft_cap, return_lse,
                   q_dtype, kv_dtype, contiguous_kv):
    """Upstream's ``test_batch_decode_with_tuple_paged_kv_cache`` body."""
    q, num_pages_per_seq, total_num_pages, kv_shape = _query_and_cache_shape(
        device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads, head_dim, kv_layout,
        q_dtype, contiguous_kv, planes=[])
    if not contiguous_kv:
        kv_data_fp32 = [torch.randn(*kv_shape, dtype=torch.float32, device=device)
                        for _ in range(2)]
        kv_data = [kv_data_fp32[i].to(kv_dtype) for i in range(2)]
        for i in range(2):
            kv_data_fp32[i] = kv_data_fp32[i][:, 1, :, 1, :, 1, :]
            kv_data[i] = kv_data[i][:, 1, :, 1, :, 1, :]
    else:
        kv_data_fp32 = [torch.randn(*kv_shape, dtype=torch.float32, device=device)
                        for _ in range(2)]
        kv_data = [kv_data_fp32[i].to(kv_dtype) for i in range(2)]
    kv_data = tuple(kv_data)
    # the 5-D view of the two caches, for the shared gather
    stacked = torch.stack([kv_data_fp32[0], kv_data_fp32[1]], dim=1)
    _plan_run_and_check(device, q, kv_data, stacked, batch_size, kv_len, page_size,
                        num_kv_heads, num_qo_heads, head_dim, kv_layout, pos_encoding_mode,
                        logits_soft_cap, return_lse, q_dtype, kv_dtype, num_pages_per_seq,
                        total_num_pages)


_FULL = [
    pytest.mark.parametrize("batch_size", [12, 17, 128]),
    pytest.mark.parametrize("kv_len", [54, 97, 512, 2048, 16384]),
    pytest.mark.parametrize("page_size", [1, 8, 16]),
    pytest.mark.parametrize("num_kv_heads", [4]),
    pytest.mark.parametrize("num_qo_heads", [4, 32]),
    pytest.mark.parametrize("head_dim", [128, 256]),
    pytest.mark.parametrize("kv_layout", ["NHD"]),
    pytest.mark.parametrize("pos_encoding_mode", ["NONE", "ROPE_LLAMA"]),
    pytest.mark.parametrize("logits_soft_cap", [0.0]),
    pytest.mark.parametrize("return_lse", [True]),
    pytest.mark.parametrize("q_dtype", [torch.float16]),
    pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn]),
    pytest.mark.parametrize("contiguous_kv", [True]),
]
#: the whole upstream grids run only when asked for (thousands of cases: more than the
#: GPU-test phase's budget); the ``*_gpu_subset`` tests run by default at full size.
#: PAGEDATTN_PEER_SUITES=sample runs each combination of the other parameters at two of its
#: (batch_size, kv_len) pairs (conftest's _peer_sample): 240 of the 1,656 cases
FULL_GRID = pytest.mark.skipif(
    os.environ.get("PAGEDATTN_PEER_SUITES") not in ("full", "sample"),
    reason="the full upstream grid: set PAGEDATTN_PEER_SUITES=full (or sample)")
PEER_GRID = pytest.mark.peer_grid("batch_size", "kv_len")


def _full(fn):
    for mark in reversed(_FULL):
        fn = mark(fn)
    return pytest.mark.gpu(FULL_GRID(PEER_GRID(fn)))


#: the default GPU subset at upstream's sizes, in the parameters' order
GPU_CASES = [(b, n, ps, 4, hq, hd, "NHD", "NONE", 0.0, True, torch.float16, kd, True)
             for b in (12, 128) for n in (54, 2048) for ps in (1, 16) for hq in (4, 32)
             for hd in (128, 256) for kd in (torch.float16, torch.float8_e4m3fn)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[::2], ids=lambda c: "-".join(map(str, c)))
def test_batch_decode_with_paged_kv_cache_gpu_subset(device, case):
    run_batch_decode_case(device, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[1::2], ids=lambda c: "-".join(map(str, c)))
def test_batch_decode_with_tuple_paged_kv_cache_gpu_subset(device, case):
    run_tuple_case(device, *case)


@_full
def test_batch_decode_with_paged_kv_cache(device, batch_size, kv_len, page_size, num_kv_heads,
                                          num_qo_heads, head_dim, kv_layout, pos_encoding_mode,
                                          logits_soft_cap, return_lse, q_dtype, kv_dtype,
                                          contiguous_kv):
    run_batch_decode_case(device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads,
                          head_dim, kv_layout, pos_encoding_mode, logits_soft_cap, return_lse,
                          q_dtype, kv_dtype, contiguous_kv)


@_full
def test_batch_decode_with_tuple_paged_kv_cache(device, batch_size, kv_len, page_size,
                                                num_kv_heads, num_qo_heads, head_dim,
                                                kv_layout, pos_encoding_mode, logits_soft_cap,
                                                return_lse, q_dtype, kv_dtype, contiguous_kv):
    run_tuple_case(device, batch_size, kv_len, page_size, num_kv_heads, num_qo_heads, head_dim,
                   kv_layout, pos_encoding_mode, logits_soft_cap, return_lse, q_dtype, kv_dtype,
                   contiguous_kv)


#: the CPU subset, in the parameters' order: upstream's values, batch/kv_len/head_dim shrunk
CPU_CASES = [
    (3, 13, 8, 4, 4, 32, "NHD", "NONE", 0.0, True, torch.float16, torch.float16, True),
    (2, 20, 1, 4, 32, 32, "NHD", "NONE", 0.0, True, torch.float16, torch.float8_e4m3fn, True),
    (3, 9, 16, 4, 32, 32, "NHD", "NONE", 0.0, True, torch.float16, torch.float16, True),
    (2, 13, 8, 4, 4, 32, "HND", "NONE", 0.0, True, torch.float16, torch.float16, True),
    (2, 13, 8, 4, 4, 32, "NHD", "NONE", 0.0, True, torch.float16, torch.float16, False),
    (2, 13, 8, 4, 4, 32, "NHD", "ROPE_LLAMA", 0.0, True, torch.float16, torch.float16, True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_batch_decode_with_paged_kv_cache_cpu_subset(device, case):
    torch.manual_seed(0)
    run_batch_decode_case(device, *case)


@pytest.mark.parametrize("case", CPU_CASES[:2] + CPU_CASES[3:5],
                         ids=lambda c: "-".join(map(str, c)))
def test_batch_decode_with_tuple_paged_kv_cache_cpu_subset(device, case):
    torch.manual_seed(0)
    run_tuple_case(device, *case)


def _warm_and_capture(warm, capture):
    """Upstream's warmup (3 runs on a side stream) and capture: ``(out, graph)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            o = warm()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = capture(o)
    return o, g


@pytest.mark.gpu
@FULL_GRID
@PEER_GRID
@pytest.mark.parametrize("batch_size", [12, 17, 128])
@pytest.mark.parametrize("kv_len", [54, 2048, 16384])
@pytest.mark.parametrize("page_size", [1, 8, 16])
@pytest.mark.parametrize("num_kv_heads", [4])
@pytest.mark.parametrize("num_qo_heads", [4, 32])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("kv_layout", ["NHD"])
@pytest.mark.parametrize("pos_encoding_mode", ["NONE"])  # ROPE_LLAMA: refused (above)
@pytest.mark.parametrize("q_dtype", [torch.float16])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("contiguous_kv", [True])
def test_cuda_graph_batch_decode_with_paged_kv_cache(batch_size, kv_len, page_size,
                                                     num_kv_heads, num_qo_heads, head_dim,
                                                     kv_layout, pos_encoding_mode, q_dtype,
                                                     kv_dtype, contiguous_kv):
    q = torch.randn(batch_size, num_qo_heads, head_dim, device="cuda:0", dtype=q_dtype)
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total_num_pages = num_pages_per_seq * batch_size
    kv_shape = [total_num_pages, 2, page_size, num_kv_heads, head_dim]
    kv_data_fp32 = torch.randn(*kv_shape, dtype=torch.float32, device="cuda:0")
    kv_data = kv_data_fp32.to(kv_dtype)
    kv_indptr_host_warmup = torch.arange(0, batch_size + 1, device="cuda:0", dtype=torch.int32)
    kv_indices_host_warmup = torch.arange(0, batch_size, device="cuda:0", dtype=torch.int32)
    kv_last_page_len_host_warmup = torch.full((batch_size,), page_size, dtype=torch.int32)

    # NOTE(Zihao): allocate more space than needed for testing
    kv_indptr_device_buffer = torch.empty(batch_size + 1, device="cuda:0", dtype=torch.int32)
    kv_indices_device_buffer = torch.empty(total_num_pages, device="cuda:0", dtype=torch.int32)
    kv_last_page_device_buffer = torch.empty(batch_size, device="cuda:0", dtype=torch.int32)

    workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device="cuda:0")
    wrapper = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        workspace_buffer, kv_indptr_device_buffer, kv_indices_device_buffer,
        kv_last_page_device_buffer, kv_layout,
    )

    def plan(indptr, indices, last):
        wrapper.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
                     data_type=kv_dtype, pos_encoding_mode=pos_encoding_mode,
                     q_data_type=q_dtype)

    plan(kv_indptr_host_warmup, kv_indices_host_warmup, kv_last_page_len_host_warmup)
    o, g = _warm_and_capture(lambda: wrapper.run(q, kv_data), lambda o: wrapper.run(q, kv_data))

    # replay multiple times
    for i in range(1, min(4, num_pages_per_seq)):
        plan(torch.arange(0, batch_size + 1).int() * i, torch.arange(0, i * batch_size).int(),
             torch.full((batch_size,), page_size, dtype=torch.int32))
        g.replay()

    # replay again
    kv_indptr_host = torch.arange(0, batch_size + 1).int() * num_pages_per_seq
    kv_indices_host = torch.arange(0, total_num_pages).int()
    kv_last_page_len_host = torch.full((batch_size,), (kv_len - 1) % page_size + 1,
                                       dtype=torch.int32)
    plan(kv_indptr_host, kv_indices_host, kv_last_page_len_host)
    g.replay()

    # compute ground truth and compare
    kv_indptr = kv_indptr_host.to(0)
    kv_last_page_len = kv_last_page_len_host.to(0)
    _check_requests(o, q, kv_data_fp32, kv_indptr, kv_last_page_len, kv_layout, num_kv_heads,
                    head_dim, kv_dtype, pos_encoding_mode)


def prefill_ref(q, kv_data, indptr, indices, last_len, q_len_per_req, page_size):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal) reference, or its torch
    transcription: request ``b``'s token ``j`` sits at ``kv_len - q_len + j``."""
    batch = last_len.shape[0]
    num_qo_heads, num_kv_heads = q.shape[1], kv_data.shape[3]
    if _flashinfer is not None and q.is_cuda:
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
        prefill = _flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=q.device) * q_len_per_req
        prefill.plan(qo_indptr, indptr, indices, last_len, num_qo_heads, num_kv_heads,
                     q.shape[-1], page_size, causal=True, q_data_type=q.dtype,
                     kv_data_type=kv_data.dtype)
        return prefill.run(q, kv_data)
    out = torch.empty_like(q)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_len[b])
        k = kv_data[pages, 0].reshape(-1, num_kv_heads, q.shape[-1])[:kv_len].float()
        v = kv_data[pages, 1].reshape(-1, num_kv_heads, q.shape[-1])[:kv_len].float()
        g = num_qo_heads // num_kv_heads
        qb = q[b * q_len_per_req:(b + 1) * q_len_per_req].float()
        s = torch.einsum("thd,khd->htk", qb, k.repeat_interleave(g, 1)) / math.sqrt(q.shape[-1])
        pos = kv_len - q_len_per_req + torch.arange(q_len_per_req, device=q.device)
        s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, None] > pos[None, :, None],
                          float("-inf"))
        out[b * q_len_per_req:(b + 1) * q_len_per_req] = torch.einsum(
            "htk,khd->thd", torch.softmax(s, -1), v.repeat_interleave(g, 1)).to(q.dtype)
    return out


def run_multi_token_case(device, batch_size, q_len_per_req, num_kv_heads, gqa_group_size,
                         head_dim=128, graph=True):
    """Upstream's ``test_cuda_graph_uniform_multi_token_decode_with_paged_kv_cache`` body
    (``graph=False`` on the CPU: plans and runs eagerly, the same re-plans)."""
    page_size = 16
    dtype = torch.bfloat16
    num_qo_heads = num_kv_heads * gqa_group_size
    capture_kv_lens = [129] * batch_size
    # tightest legal kv under the plan contract kv_len >= q_len_per_req
    replay_kv_lens_sets = [
        [[33, 17, 65, 129][i % 4] for i in range(batch_size)],
        [[q_len_per_req, 128, 64, 100][i % 4] for i in range(batch_size)],
    ]

    def build_kv_layout(kv_lens):
        pages_per = [(length + page_size - 1) // page_size for length in kv_lens]
        indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(pages_per), 0)),
                              dtype=torch.int32, device=device)
        indices = torch.arange(int(indptr[-1]), dtype=torch.int32, device=device)
        last_len = torch.tensor([(length - 1) % page_size + 1 for length in kv_lens],
                                dtype=torch.int32, device=device)
        return indptr, indices, last_len

    indptr, indices, last_len = build_kv_layout(capture_kv_lens)
    total_pages = int(indptr[-1])
    kv_data = torch.randn(total_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype,
                          device=device)
    q = torch.randn(batch_size * q_len_per_req, num_qo_heads, head_dim, dtype=dtype,
                    device=device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 * 1024 * 1024 if graph else 16, dtype=torch.uint8, device=device),
        "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.empty(batch_size + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.empty(total_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.empty(batch_size, dtype=torch.int32,
                                                  device=device),
    )

    def plan(plan_indptr, plan_indices, plan_last_len):
        wrapper.plan(plan_indptr, plan_indices, plan_last_len, num_qo_heads, num_kv_heads,
                     head_dim, page_size, q_data_type=dtype, kv_data_type=dtype,
                     q_len_per_req=q_len_per_req)

    plan(indptr, indices, last_len)
    if graph:
        o, g = _warm_and_capture(lambda: wrapper.run(q, kv_data),
                                 lambda o: wrapper.run(q, kv_data, out=o))
        replay = g.replay
    else:
        o = wrapper.run(q, kv_data)

        def replay():
            wrapper.run(q, kv_data, out=o)
    replay()
    if graph:
        torch.cuda.synchronize()
    torch.testing.assert_close(o, prefill_ref(q, kv_data, indptr, indices, last_len,
                                              q_len_per_req, page_size), rtol=1e-2, atol=1e-2)
    for kv_lens in replay_kv_lens_sets:
        new_indptr, new_indices, new_last_len = build_kv_layout(kv_lens)
        plan(new_indptr, new_indices, new_last_len)
        replay()
        if graph:
            torch.cuda.synchronize()
        torch.testing.assert_close(
            o, prefill_ref(q, kv_data, new_indptr, new_indices, new_last_len, q_len_per_req,
                           page_size), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [4, 8])
@pytest.mark.parametrize("q_len_per_req", [2, 3])
@pytest.mark.parametrize("num_kv_heads", [2, 8])
@pytest.mark.parametrize("gqa_group_size", [4, 8])
def test_cuda_graph_uniform_multi_token_decode_with_paged_kv_cache(
        batch_size, q_len_per_req, num_kv_heads, gqa_group_size):
    run_multi_token_case("cuda", batch_size, q_len_per_req, num_kv_heads, gqa_group_size)


def test_uniform_multi_token_decode_cpu_subset(device):
    """The multi-token case eagerly (no CUDA graph on the CPU), batch 2, q_len 3, 2 kv heads,
    group 4, head_dim 32 (upstream: 128)."""
    torch.manual_seed(0)
    run_multi_token_case(device, 2, 3, 2, 4, head_dim=32, graph=device == "cuda")


def test_tensor_core_decode_rejects_mismatched_q_len(device):
    batch_size = 4
    page_size = 16
    num_qo_heads, num_kv_heads, head_dim = 8, 2, 128
    dtype = torch.bfloat16
    indptr = torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
    indices = torch.arange(batch_size, dtype=torch.int32, device=device)
    last_len = torch.full((batch_size,), page_size, dtype=torch.int32, device=device)
    kv_data = torch.randn(batch_size, 2, page_size, num_kv_heads, head_dim, dtype=dtype,
                          device=device)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=dtype, kv_data_type=dtype, q_len_per_req=2)
    q = torch.randn(batch_size * 3, num_qo_heads, head_dim, dtype=dtype, device=device)
    with pytest.raises(ValueError, match="q_len_per_req"):
        wrapper.run(q, kv_data)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_extreme_negative_logits(device, dtype):
    # Deterministic #4450 fixture: classic (non-tensor-core) decode with two
    # valid keys whose raw scores (-524288) sit far below the historical -5e4
    # sentinel.
    num_qo_heads, num_kv_heads, head_dim = 32, 4, 128
    page_size, num_pages = 1, 17
    sm_scale = 1.0 / math.sqrt(head_dim)
    q = torch.full((1, num_qo_heads, head_dim), 64.0, dtype=dtype, device=device)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), -64.0, dtype=dtype,
                         device=device)
    v_cache = torch.ones_like(k_cache)

    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD",
                                                 use_tensor_cores=False)
    wrapper.plan(
        indptr=torch.tensor([0, 2], dtype=torch.int32, device=device),
        indices=torch.tensor([15, 16], dtype=torch.int32, device=device),
        last_page_len=torch.tensor([1], dtype=torch.int32, device=device),
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pos_encoding_mode="NONE", sm_scale=sm_scale,
        q_data_type=dtype, kv_data_type=dtype,
    )
    o, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)

    k_gqa = k_cache[[15, 16], 0].repeat_interleave(num_qo_heads // num_kv_heads, dim=1)
    logits = torch.einsum("hd,khd->hk", q[0].float(), k_gqa.float()) * sm_scale
    ref_lse = (torch.logsumexp(logits, dim=-1) / math.log(2.0)).unsqueeze(0)
    assert not o.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(o, torch.ones_like(o), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-3)
