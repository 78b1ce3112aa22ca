# ruff: noqa: E501, E741  (a measuring peer kept as measured: its names and lines as they ran)
"""The plain-Triton floor: a deliberately simple split-KV paged decode, kept as a benchmark PEER.

It is the floor that `impl="auto"` must beat in the same run (`docs/results/h200.md`).
It is not part of the product and is not graph-safe: it reads `context_lens` on the host to size
its chunks. With an fp32 cache its `tl.dot` runs in TF32 (rel-L2 error about 1.6e-3), so it does
NOT meet the fp32 tolerance of the API contract (README.md); it is a speed reference only.

Design (what makes it fast):
- one program per (sequence, kv head, chunk of tokens); programs past a sequence's end exit at once;
- the whole query group packed into one >=16-row tile, so `tl.dot` reads each K/V byte once;
- BLOCK_N-token tiles gathered through the block table (page id per token), online softmax in exp2;
- chunk = total tokens * kv heads / (SMs * waves), rounded to BLOCK_N: balanced by tokens, not by
  sequences, so one long sequence is cut into many chunks;
- a second small kernel merges the chunks with their (max, sum) pairs.

Use:
    from plain_floor import floor_runner, best_floor_runner
    run = floor_runner(query, key_cache, value_cache, block_tables, context_lens, scale)   # NHD
    out = run()
    run, cfg = best_floor_runner(...same args...)   # sweeps 18 configs, returns the fastest
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _floor_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, po_ptr, pm_ptr, pl_ptr,
                        scale_log2, chunk, max_splits,
                        s_qb, s_qh, s_kp, s_kt, s_kh, s_vp, s_vt, s_vh, s_bt,
                        G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    start = sp * chunk
    if start >= n:
        return
    end = tl.minimum(start + chunk, n)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < G
    q = tl.load(q_ptr + b * s_qb + (kvh * G + offs_h)[:, None] * s_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)  # [BLOCK_H, D]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        tmask = tok < end
        page = tl.load(bt_ptr + b * s_bt + tok // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = tok % PAGE
        k = tl.load(k_ptr + page[:, None] * s_kp + slot[:, None] * s_kt + kvh * s_kh + offs_d[None, :],
                    mask=tmask[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + page[:, None] * s_vp + slot[:, None] * s_vt + kvh * s_vh + offs_d[None, :],
                    mask=tmask[:, None], other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    row = (b * tl.num_programs(1) * G + kvh * G + offs_h) * max_splits + sp
    tl.store(pm_ptr + row, m, mask=hmask)
    tl.store(pl_ptr + row, l, mask=hmask)
    tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])


@triton.jit
def _floor_merge_kernel(po_ptr, pm_ptr, pl_ptr, lens_ptr, out_ptr, chunk, max_splits, num_qh,
                        D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    ns = tl.cdiv(n, chunk)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    smask = offs_s < ns
    row = (b * num_qh + h) * max_splits + offs_s
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(pl_ptr + row, mask=smask, other=0.0)
    mm = tl.max(m, 0)
    w = tl.where(smask, tl.exp2(m - mm), 0.0)
    o = tl.load(po_ptr + row[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    tot = tl.sum(w * l, 0)
    res = tl.sum(o * w[:, None], 0) / tot
    tl.store(out_ptr + (b * num_qh + h) * D + offs_d, res.to(out_ptr.dtype.element_ty))


def floor_runner(query, key_cache, value_cache, block_tables, context_lens, scale, *,
                 block_n=64, num_warps=4, num_stages=2, waves=4):
    """A callable that runs one decode. query [B, Hq, D] (contiguous), caches NHD
    [pages, page_size, Hkv, D], block_tables [B, max_pages] int32, context_lens [B] int32 (all > 0:
    the floor has no empty-sequence path), fp8 caches are read with scale 1.0 (no k/v scale)."""
    q, kc, vc, bt, lens = query, key_cache, value_cache, block_tables, context_lens
    B, hq, d = q.shape
    page, kvh = kc.shape[1], kc.shape[2]
    G = hq // kvh
    n_sm = torch.cuda.get_device_properties(q.device).multi_processor_count
    total, maxlen = int(lens.sum()), int(lens.max())  # host reads: not graph-safe
    chunk = max(block_n, triton.cdiv(triton.cdiv(total * kvh, n_sm * waves), block_n) * block_n)
    max_splits = triton.cdiv(maxlen, chunk)
    po = torch.empty(B * hq * max_splits * d, device=q.device, dtype=torch.float32)
    pm = torch.empty(B * hq * max_splits, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    out = torch.empty_like(q)
    BLOCK_H = max(16, triton.next_power_of_2(G))
    scale_log2 = scale * 1.4426950408889634

    def run():
        _floor_split_kernel[(B, kvh, max_splits)](
            q, kc, vc, bt, lens, po, pm, pl, scale_log2, chunk, max_splits,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0),
            G=G, BLOCK_H=BLOCK_H, D=d, PAGE=page, BLOCK_N=block_n, num_warps=num_warps,
            num_stages=num_stages)
        _floor_merge_kernel[(B, hq)](po, pm, pl, lens, out, chunk, max_splits, hq, D=d,
                                     BLOCK_S=max(2, triton.next_power_of_2(max_splits)))
        return out
    return run


#: the config each batch's sweep chose, by what the sweep depends on (shapes, dtypes, lengths,
#: scale, device): the layers of one decode step (`pagedattn bench`'s step builds a runner per
#: layer's cache) share their batch's sweep instead of repeating it 32 times
_SWEPT: dict = {}


def best_floor_runner(query, key_cache, value_cache, block_tables, context_lens, scale):
    """Sweep block_n {32,64,128} x num_stages {2,3} x waves {2,4,8} (num_warps 4) on this very
    batch and return (fastest runner, its config). The sweep is per batch: an oracle tuning that a
    production kernel cannot do per call, which makes the floor a demanding one. Another cache of
    the same batch (shapes, dtypes, lengths) reuses the batch's config."""
    key = (tuple(query.shape), query.dtype, tuple(key_cache.shape[1:]), key_cache.dtype,
           tuple(block_tables.shape), tuple(context_lens.tolist()), scale, query.device)
    if key in _SWEPT:
        cfg = _SWEPT[key]
        return floor_runner(query, key_cache, value_cache, block_tables, context_lens, scale,
                            **cfg), cfg
    best = None
    for bn in (32, 64, 128):
        for ns in (2, 3):
            for waves in (2, 4, 8):
                cfg = dict(block_n=bn, num_warps=4, num_stages=ns, waves=waves)
                try:
                    run = floor_runner(query, key_cache, value_cache, block_tables, context_lens, scale, **cfg)
                    run()
                    ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median")
                except Exception:  # a config that does not fit (shared memory) is skipped
                    continue
                if best is None or ms < best[0]:
                    best = (ms, run, cfg)
    if best is None:
        raise RuntimeError("plain floor: no config ran")
    _SWEPT[key] = best[2]
    return best[1], best[2]
