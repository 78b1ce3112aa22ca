"""pagedattn.compat against the float64 oracle: what the peers' own tests do not check (the
LSE in each peer's base, fp8 descales per batch, sinks, ALiBi, the plan reuse that keeps the
host time small, the refusals), on fresh random inputs with poisoned pages.

Then the drop-ins at their edges (issue 49): the FlashAttention drop-in re-plans only when what
decides a plan changes, refuses before it writes (naming FA's arguments), and keeps a wide
fp16 query through its fp8 path; the FlashInfer wrapper checks its CSR at ``plan``."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from _hardening import assert_same_bits  # NaN-poisoned pages compare by bits

from pagedattn.api import DecodePlan
from pagedattn.compat import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    flash_attn_with_kvcache,
)
from pagedattn.compat import flash_attn as fa_module
from pagedattn.compat.flashinfer import get_alibi_slopes
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

LENS = [0, 5, 17, 32]  # an empty sequence, a page boundary (page_size 8)


def _inputs(device, lens=LENS, dtype=torch.float16, **kw):
    kw.setdefault("num_q_heads", 6)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_dim", 32)
    kw.setdefault("page_size", 8)
    return make_paged_inputs(lens, dtype=dtype, device=device, **kw)


def _close_lse(lse, ref_lse, atol=2e-3):
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=atol)


# --- flash_attn_with_kvcache -------------------------------------------------------------

def test_fa_decode_out_and_natural_lse(device):
    inp = _inputs(device)
    sinks = torch.randn(6, device=device)
    out, lse = flash_attn_with_kvcache(
        inp.query.unsqueeze(1), inp.key_cache, inp.value_cache, cache_seqlens=inp.context_lens,
        block_table=inp.block_tables, causal=True, window_size=(9, 0), softcap=3.0,
        sinks=sinks, return_softmax_lse=True)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens, window_left=9, logits_soft_cap=3.0,
                                 sinks=sinks)
    assert out.shape == (4, 1, 6, 32) and lse.shape == (4, 6, 1)  # FA's layouts
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    _close_lse(lse[..., 0], ref.lse)


def test_fa_non_causal_multi_token_sees_every_key(device):
    """causal=False (FA's default): each of 3 query tokens attends to the whole cache."""
    inp = _inputs(device)
    q = torch.randn(4, 3, 6, 32, device=device, dtype=torch.float16)
    out, lse = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                       cache_seqlens=inp.context_lens,
                                       page_table=inp.block_tables, return_softmax_lse=True)
    for j in range(3):
        ref = paged_decode_reference(q[:, j], inp.key_cache, inp.value_cache,
                                     inp.block_tables, inp.context_lens)
        assert rel_l2_error(out[:, j], ref.out) <= tolerance_for(torch.float16)
        _close_lse(lse[..., j], ref.lse)


def test_fa_append_then_attend_and_the_plan_is_reused(device):
    """k/v land at cache_seqlens (in place) and are seen; a second call with the same tensors
    (cache_seqlens updated in place, as an engine does) reuses the cached plan."""
    plans, _ = fa_module._caches()
    plans.clear()
    inp = _inputs(device, lens=[3, 10, 14, 17], max_pages=3)
    before = torch.tensor([1, 8, 12, 15], dtype=torch.int32, device=device)
    k = torch.randn(4, 1, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    kc, vc = inp.key_cache, inp.value_cache
    q = inp.query.unsqueeze(1)
    args = dict(cache_seqlens=before, page_table=inp.block_tables, causal=True)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, **args)
    lens = before + 1
    ref = paged_decode_reference(inp.query, kc, vc, inp.block_tables, lens)
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    for b in range(4):  # the new key sits at position before[b]
        p = int(before[b])
        page = int(inp.block_tables[b, p // 8])
        assert torch.equal(kc[page, p % 8], k[b, 0]) and torch.equal(vc[page, p % 8], v[b, 0])
    assert len(plans) == 1
    before += 1  # the next step, in place
    out2 = flash_attn_with_kvcache(q, kc, vc, k, v, **args)
    assert len(plans) == 1
    ref2 = paged_decode_reference(inp.query, kc, vc, inp.block_tables, before + 1)
    assert rel_l2_error(out2[:, 0], ref2.out) <= tolerance_for(torch.float16)


def test_fa_repeated_decode_call_takes_the_short_path(device, monkeypatch):
    """The per-layer call: the second call finds its plan by its signature and runs FA's 4-D
    query as it is (the plan's ``run_4d``), reading the lengths updated in place; a call with
    another dtype plans anew, and calls alternating between the two plans stay right."""
    from pagedattn.api import DecodePlan

    plans, fast = fa_module._caches()
    plans.clear()
    fast.clear()
    inp = _inputs(device, lens=[4, 9, 30])
    lens = inp.context_lens.clone()
    call = dict(cache_seqlens=lens, page_table=inp.block_tables, causal=True,
                return_softmax_lse=True)
    q = inp.query.unsqueeze(1)
    flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, **call)
    assert len(fast) == 1 and len(plans) == 1
    runs = []
    real = DecodePlan.run_4d
    monkeypatch.setattr(DecodePlan, "run_4d",
                        lambda self, *a: runs.append(real(self, *a)) or runs[-1])
    lens -= 3  # the engine's next step, in place
    out, lse = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, **call)
    assert len(runs) == 1 and runs[0].out is out and out.shape == q.shape
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 lens)
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    assert lse.shape == (3, 6, 1)
    _close_lse(lse[..., 0], ref.lse)
    q32, k32, v32 = (t.float() for t in (q, inp.key_cache, inp.value_cache))
    ref32 = paged_decode_reference(q32[:, 0], k32, v32, inp.block_tables, lens).out
    for _ in range(2):  # each dtype's signature names its own plan
        out32 = flash_attn_with_kvcache(q32, k32, v32, cache_seqlens=lens,
                                        page_table=inp.block_tables, causal=True)
        assert len(plans) == 2 and out32.dtype == torch.float32
        assert rel_l2_error(out32[:, 0], ref32) <= tolerance_for(torch.float32)
        out16 = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, **call).out
        assert rel_l2_error(out16[:, 0], ref.out) <= tolerance_for(torch.float16)
    assert len(runs) == 4 and all(r is not None for r in runs)  # the first fp32 call plans


def test_fa_causal_multi_token_lse_layout(device):
    """causal=True, 3 query tokens: token j sits at len - 3 + j; lse [batch, heads, 3]."""
    inp = _inputs(device, lens=[2, 9, 30])
    q = torch.randn(3, 3, 6, 32, device=device, dtype=torch.float16)
    out, lse = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                       cache_seqlens=inp.context_lens,
                                       page_table=inp.block_tables, causal=True,
                                       return_softmax_lse=True)
    ref = paged_decode_reference(q, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens)  # 4-D: the same positions
    assert lse.shape == (3, 6, 3)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
    _close_lse(lse.transpose(1, 2), ref.lse)


@pytest.mark.parametrize("causal", [True, False])
def test_fa_long_multi_token_queries_run_in_chunks(device, monkeypatch, causal):
    """More query rows than one tile (here 4, patched down from 64): chunks with their own
    lengths give what one call gives (the oracle's 4-D positions; all keys non-causal)."""
    monkeypatch.setattr(fa_module, "_MAX_TILE_ROWS", 4)
    inp = _inputs(device, lens=[2, 9, 30], num_q_heads=4)
    q = torch.randn(3, 5, 4, 32, device=device, dtype=torch.float16)  # 10 rows, group 2
    out, lse = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                       cache_seqlens=inp.context_lens,
                                       page_table=inp.block_tables, causal=causal,
                                       return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (3, 4, 5)
    for j in range(5):
        ref = paged_decode_reference(q[:, :j + 1] if causal else q[:, j], inp.key_cache,
                                     inp.value_cache, inp.block_tables,
                                     (inp.context_lens - (4 - j)).clamp(min=0) if causal
                                     else inp.context_lens)
        ref_out = ref.out[:, -1] if causal else ref.out
        ref_lse = ref.lse[:, -1] if causal else ref.lse
        assert rel_l2_error(out[:, j], ref_out) <= tolerance_for(torch.float16)
        _close_lse(lse[..., j], ref_lse)


def test_fa_contiguous_cache_is_one_page_per_sequence(device):
    kc = torch.randn(3, 20, 2, 32, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.bfloat16)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, cache_batch_idx=idx, causal=True)
    ref = paged_decode_reference(q[:, 0], kc, vc, idx.view(2, 1),
                                 torch.tensor([7, 7], device=device))
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.bfloat16)


def test_fa_fp8_per_batch_descales(device):
    """FA3's [batch, heads_k] descales, differing per batch: exact by folding."""
    inp = _inputs(device, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                  lens=[5, 17, 32])
    kd = torch.rand(3, 2, device=device) + 0.5
    vd = torch.rand(3, 2, device=device) + 0.5
    out, lse = flash_attn_with_kvcache(
        inp.query.unsqueeze(1), inp.key_cache, inp.value_cache, cache_seqlens=inp.context_lens,
        page_table=inp.block_tables, k_descale=kd, v_descale=vd, return_softmax_lse=True)
    for b in range(3):
        ref = paged_decode_reference(inp.query[b:b + 1], inp.key_cache, inp.value_cache,
                                     inp.block_tables[b:b + 1], inp.context_lens[b:b + 1],
                                     k_scale=kd[b], v_scale=vd[b])
        assert rel_l2_error(out[b:b + 1, 0], ref.out) <= tolerance_for(torch.float8_e4m3fn)
        _close_lse(lse[b:b + 1, :, 0], ref.lse, atol=3e-2)


@pytest.mark.parametrize("name,value", [("rotary_cos", 1), ("cache_leftpad", 1),
                                        ("cu_seqlens_q", 1), ("qv", 1), ("attention_chunk", 8),
                                        ("max_seqlen_q", 4), ("cu_seqlens_k_new", 1)])
def test_fa_unsupported_arguments_are_named(name, value):
    q = torch.zeros(1, 1, 2, 16)
    kc = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match=name):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1, page_table=torch.zeros(1, 2,
                                dtype=torch.int32), **{name: value})


def test_fa_refusals_and_ignored_hints(device):
    inp = _inputs(device, lens=[5, 9])
    q = inp.query.unsqueeze(1)
    call = dict(cache_seqlens=inp.context_lens, page_table=inp.block_tables)
    with pytest.raises(TypeError, match="no_such_arg"):
        flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, no_such_arg=1, **call)
    with pytest.raises(ValueError, match="page_table, block_table"):
        flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                block_table=inp.block_tables.clone(), **call)
    q3 = q.expand(2, 3, 6, 32)
    with pytest.raises(ValueError, match="window_size"):  # a right bound inside the queries
        flash_attn_with_kvcache(q3, inp.key_cache, inp.value_cache, window_size=(-1, 1), **call)
    with pytest.raises(ValueError, match="k_descale"):
        flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                k_descale=torch.ones(2, 2), **call)
    out = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, pack_gqa=True,
                                  sm_margin=4, scheduler_metadata=torch.zeros(3), **call)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens)
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)


# --- BatchDecodeWithPagedKVCacheWrapper ----------------------------------------------------

def _csr(inp, page_size=8):
    """FlashInfer's (indptr, indices, last_page_len) of a batch from make_paged_inputs."""
    lens = inp.context_lens.tolist()
    pages = [max(math.ceil(n / page_size), 1) for n in lens]  # FlashInfer: >= 1 page each
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([inp.block_tables[b, :p].cpu() for b, p in enumerate(pages)])
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    dev = inp.query.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


def test_fi_lse_is_base_2_and_alibi_matches_flashinfer(device):
    inp = _inputs(device, lens=[5, 17, 32])
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device))
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16)
    out, lse = w.run(inp.query, (inp.key_cache, inp.value_cache), return_lse=True)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
    _close_lse(lse, ref.lse / math.log(2))
    # ALiBi: FlashInfer's default slopes; its decode LSE puts the query at position 0
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16, pos_encoding_mode="ALIBI")
    out, lse = w.run(inp.query, (inp.key_cache, inp.value_cache), return_lse=True)
    slopes = get_alibi_slopes(6, device)
    assert torch.allclose(slopes.cpu(), torch.tensor([2.0 ** (-8 * i / 4) for i in (1, 2, 3, 4)]
                                                     + [2.0 ** (-4 * i / 4) for i in (1, 3)]))
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens, alibi_slopes=slopes)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
    shift = (inp.context_lens.double() - 1)[:, None] * slopes.double()[None]
    _close_lse(lse, (ref.lse + shift) / math.log(2))


def test_fi_multi_token_lse_into_a_given_buffer(device):
    """q_len_per_req=2: q [batch * 2, heads, dim]; the base-2 LSE lands in ``lse=``."""
    inp = _inputs(device, lens=[5, 17, 32])
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device))
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16, q_len_per_req=2)
    q = torch.randn(6, 6, 32, device=device, dtype=torch.float16)
    lse = torch.full((6, 6), float("nan"), device=device)
    out, got = w.run(q, (inp.key_cache, inp.value_cache), return_lse=True, lse=lse)
    ref = paged_decode_reference(q.view(3, 2, 6, 32), inp.key_cache, inp.value_cache,
                                 inp.block_tables, inp.context_lens)
    assert got is lse and out.shape == q.shape
    assert rel_l2_error(out.view(3, 2, 6, 32), ref.out) <= tolerance_for(torch.float16)
    _close_lse(lse.view(3, 2, 6), ref.lse / math.log(2))
    with pytest.raises(ValueError, match="lse"):
        w.run(q, (inp.key_cache, inp.value_cache), return_lse=True, lse=torch.empty(6))


def test_fi_scales_sinks_and_the_combined_cache(device):
    """One [pages, 2, ...] tensor (HND); q_scale and k_scale multiply sm_scale, v_scale the
    output; sinks per head."""
    inp = _inputs(device, lens=[5, 17, 32], kv_layout="HND")
    cache = torch.stack([inp.key_cache, inp.value_cache], dim=1)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device),
                                           "HND")
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type="float16", sm_scale=0.1)
    sinks = torch.randn(6, device=device)
    out = w.run(inp.query, cache, q_scale=2.0, k_scale=1.5, v_scale=0.5, sinks=sinks)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens, kv_layout="HND", scale=0.3, sinks=sinks)
    assert rel_l2_error(out, 0.5 * ref.out) <= tolerance_for(torch.float16)


def test_fi_fp8_cache_with_tensor_scales(device):
    inp = _inputs(device, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                  lens=[5, 17, 32])
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device))
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.bfloat16,
           kv_data_type=torch.float8_e4m3fn)
    ks, vs = torch.tensor([0.5, 2.0], device=device), torch.tensor(0.75, device=device)
    out = w.run(inp.query, (inp.key_cache, inp.value_cache), k_scale=ks, v_scale=vs)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens, k_scale=ks, v_scale=vs)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float8_e4m3fn)


def test_fi_replan_reuses_the_plan_and_graph_mode_rewrites_in_place(device):
    """A re-plan with the same shapes keeps the DecodePlan (its recorded launches, hence the
    host time); in cudagraph mode the tables are the same tensors, rewritten in place."""
    inp = _inputs(device, lens=[5, 17, 30])
    inp2 = _inputs(device, lens=[12, 20, 31], seed=1)  # as ragged as the first (not)
    ws = torch.empty(16, dtype=torch.uint8, device=device)
    for graph in (False, True):
        if graph:
            w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                ws, torch.empty(4, dtype=torch.int32, device=device),
                torch.empty(12, dtype=torch.int32, device=device),
                torch.empty(3, dtype=torch.int32, device=device))
        else:
            w = BatchDecodeWithPagedKVCacheWrapper(ws)
        w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16)
        plan, table = w._plan, w._plan.block_tables
        w.plan(*_csr(inp2), 6, 2, 32, 8, q_data_type=torch.float16)
        assert w._plan is plan and w._plan.block_tables is table
        out = w.run(inp2.query, (inp2.key_cache, inp2.value_cache))
        ref = paged_decode_reference(inp2.query, inp2.key_cache, inp2.value_cache,
                                     inp2.block_tables, inp2.context_lens)
        assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
    with pytest.raises(ValueError, match="cudagraph"):  # graph mode: fixed options
        w.plan(*_csr(inp2), 6, 2, 32, 8, q_data_type=torch.float16, window_left=4)


def test_fi_refusals_are_named(device):
    inp = _inputs(device, lens=[5, 9])
    ws = torch.empty(16, dtype=torch.uint8, device=device)
    w = BatchDecodeWithPagedKVCacheWrapper(ws)
    with pytest.raises(ValueError, match="plan"):
        w.run(inp.query, (inp.key_cache, inp.value_cache))
    csr = _csr(inp)
    for kw, name in ((dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode"),
                     (dict(window_right=3), "window_right"),
                     (dict(fixed_split_size=4), "fixed_split_size"),
                     (dict(o_data_type=torch.float32), "o_data_type"),
                     (dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0), "logits_soft_cap")):
        with pytest.raises(ValueError, match=name):
            w.plan(*csr, 6, 2, 32, 8, q_data_type=torch.float16, **kw)
    with pytest.raises(ValueError, match="jit_args"):
        BatchDecodeWithPagedKVCacheWrapper(ws, jit_args=[1])
    w.plan(*csr, 6, 2, 32, 8, q_data_type=torch.float16, window_left=4)
    caches = (inp.key_cache, inp.value_cache)
    with pytest.raises(ValueError, match="window_left"):
        w.run(inp.query, caches, window_left=7)
    with pytest.raises(ValueError, match="kv_cache_sf"):
        w.run(inp.query, caches, kv_cache_sf=caches)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        w.run(inp.query, torch.zeros(4, 3, 8, 2, 32, device=device))


def test_compat_modules_import_neither_triton_nor_transformers():
    """``import pagedattn.compat`` stays light: its own modules import no Triton and no
    transformers (read from the source; the rest of the import graph is test_layers')."""
    root = Path(fa_module.__file__).parent
    for name in ("__init__.py", "flash_attn.py", "flashinfer.py"):
        for node in ast.walk(ast.parse((root / name).read_text(encoding="utf-8"))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [m for m in mods if m.split(".")[0] in ("triton", "transformers")]


# --- the drop-ins at their edges (issue 49) --------------------------------------------

@pytest.fixture
def counted(monkeypatch):
    """Counts of the expensive steps of a call: plans built, launchers built (each binds the
    kernel's configuration and owns a workspace), workspaces allocated."""
    from pagedattn.launch.decode import AutoLauncher

    counts = {"plans": 0, "launchers": 0, "workspaces": 0}

    def counting(cls, name, key):
        real = getattr(cls, name)

        def wrapper(self, *a, **kw):
            counts[key] += 1
            return real(self, *a, **kw)
        monkeypatch.setattr(cls, name, wrapper)

    counting(DecodePlan, "__init__", "plans")
    counting(AutoLauncher, "__init__", "launchers")
    counting(AutoLauncher, "new_workspace", "workspaces")
    plans, fast = fa_module._caches()
    plans.clear()
    fast.clear()
    return counts


# --- kind 6: fresh tensors cost a run and a metadata copy, never a plan ----------------------

def test_fa_fresh_tensors_every_call_build_one_plan(device, counted):
    """An eager engine building its page_table and cache_seqlens anew each step (and
    converting the lengths' dtype per call): 12 calls, each with new tensors holding new
    lengths and new page ids, build one plan and one launcher, and each reads its own."""
    torch.manual_seed(0)
    inp = _inputs(device, [40, 40, 40], max_pages=6, extra_pages=20, poison=False)
    num_pages = inp.key_cache.shape[0]
    q = inp.query.unsqueeze(1)
    for step in range(12):
        lens = torch.randint(0, 48, (3,)).tolist()
        table = torch.stack([torch.randperm(num_pages)[:6] for _ in range(3)]).to(
            device, torch.int64 if step % 2 else torch.int32)
        cache_seqlens = torch.tensor(lens, device=device,
                                     dtype=torch.int32 if step % 3 else torch.int64)
        out = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                      cache_seqlens=cache_seqlens, page_table=table,
                                      causal=True)
        ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, table,
                                     cache_seqlens)
        assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    assert counted == {"plans": 1, "launchers": 1, "workspaces": 1}


def test_fa_fresh_tensors_of_every_calling_form_reuse_their_plan(device, counted):
    """The other calls with fresh metadata: an append with new lengths each step, an int
    length (FA3's), a contiguous cache with new cache_batch_idx rows and a paged table's rows
    picked by cache_batch_idx: one plan per form, whatever the tensors."""
    inp = _inputs(device, [9, 20, 31], max_pages=5, extra_pages=12, poison=False)
    kc, vc, q = inp.key_cache, inp.value_cache, inp.query.unsqueeze(1)
    num_pages = kc.shape[0]
    for step in range(4):
        k = torch.randn(3, 1, 2, 32, device=device, dtype=torch.float16)
        v = torch.randn_like(k)
        before = torch.tensor([3 + step, 10 + step, 30 + step], device=device)
        table = torch.stack([torch.randperm(num_pages)[:5] for _ in range(3)]).to(device)
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=before.clone(),
                                      page_table=table.clone(), causal=True)
        ref = paged_decode_reference(inp.query, kc, vc, table, before + 1)
        assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7 + step,
                                      page_table=table.clone())
        ref = paged_decode_reference(inp.query, kc, vc, table,
                                     torch.full((3,), 7 + step, device=device))
        assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
        rows = torch.randperm(8)[:3].to(device)
        big = torch.cat([table, table.flip(0), table[:2]])  # 8 rows of a bigger batch
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=before.clone(), page_table=big,
                                      cache_batch_idx=rows)
        ref = paged_decode_reference(inp.query, kc, vc, big[rows], before)
        assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    contiguous = torch.randn(5, 24, 2, 32, device=device, dtype=torch.float16)
    for step in range(3):
        rows = torch.randperm(5)[:3].to(device)
        out = flash_attn_with_kvcache(q, contiguous, contiguous, cache_seqlens=20 - step,
                                      cache_batch_idx=rows.clone())
        ref = paged_decode_reference(inp.query, contiguous, contiguous, rows.view(3, 1),
                                     torch.full((3,), 20 - step, device=device))
        assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.float16)
    # one token sees the same keys causal or not: the paged table's plan, and the
    # contiguous cache's (one page of 24 tokens per sequence)
    assert counted["plans"] == counted["launchers"] == 2


def test_fa_plan_cache_is_bounded_per_thread(device, monkeypatch, counted):
    """The cache keeps the most recently used plans (here 2), each thread its own."""
    import threading

    monkeypatch.setattr(fa_module, "_PLAN_CACHE_SIZE", 2)
    inp = _inputs(device, [5, 9])
    for dim_batch in (1, 2, 1, 2):  # two keys alternating: both stay
        flash_attn_with_kvcache(inp.query[:dim_batch].unsqueeze(1), inp.key_cache,
                                inp.value_cache, cache_seqlens=inp.context_lens[:dim_batch],
                                page_table=inp.block_tables[:dim_batch])
    assert counted["plans"] == 2
    q3 = inp.query.float().unsqueeze(1)  # a third key pushes the least recent out
    k3, v3 = inp.key_cache.float(), inp.value_cache.float()
    flash_attn_with_kvcache(q3, k3, v3, cache_seqlens=inp.context_lens,
                            page_table=inp.block_tables)
    assert len(fa_module._caches()[0]) == 2 and counted["plans"] == 3
    seen = []
    worker = threading.Thread(target=lambda: seen.append(len(fa_module._caches()[0])))
    worker.start()
    worker.join()
    assert seen == [0]


@pytest.mark.gpu
def test_fa_fresh_tensors_bind_the_kernel_once_on_the_gpu(counted):
    """On the GPU the launcher records one binding for a stream of calls with fresh
    metadata tensors (they are copied into the plan's own: same dtypes, strides and
    alignment every call)."""
    inp = _inputs("cuda", [300, 1000, 17, 4000], num_q_heads=32, num_kv_heads=8,
                  head_dim=128, page_size=16, dtype=torch.bfloat16, extra_pages=64)
    q = inp.query.unsqueeze(1)
    for step in range(50):
        table = inp.block_tables.clone()[:, :]  # a new tensor each call
        lens = (inp.context_lens - step).to(torch.int64 if step % 2 else torch.int32)
        flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, cache_seqlens=lens,
                                page_table=table, causal=True)
    plan, = fa_module._caches()[0].values()
    assert counted["plans"] == 1 and len(plan._engine()._records) == 1
    out = flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache,
                                  cache_seqlens=inp.context_lens.clone(),
                                  page_table=inp.block_tables.clone(), causal=True)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens)
    assert rel_l2_error(out[:, 0], ref.out) <= tolerance_for(torch.bfloat16)


# --- kind 2: every check before any write, errors in FA's names ------------------------------

def _append_call(device):
    inp = _inputs(device, [5, 12, 20], max_pages=3)
    k = torch.randn(3, 2, 2, 32, device=device, dtype=torch.float16)
    call = dict(cache_seqlens=torch.tensor([5, 12, 20], dtype=torch.int32, device=device),
                page_table=inp.block_tables, causal=True)
    return inp, (inp.query.unsqueeze(1), inp.key_cache, inp.value_cache, k, k.clone()), call


REFUSED = [  # (call arguments, error type, the FA argument the message starts with)
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(softcap=math.nan), ValueError, "softcap"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(softcap=math.inf), ValueError, "softcap"),
    (dict(alibi_slopes=torch.ones(3, 6)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(5)), ValueError, "alibi_slopes"),
    (dict(sinks=torch.ones(6, dtype=torch.float64)), TypeError, "sinks"),
    (dict(window_size=(-1, 1), q_len=3, causal=False), ValueError, "window_size"),
    (dict(window_size=(2, -1), q_len=3, causal=False), ValueError, "window_size"),
    (dict(softmax_scale=math.nan), ValueError, "softmax_scale"),
    (dict(cache_seqlens=[5, 12, 23]), ValueError, "cache_seqlens"),  # 23 + 2 > 3 x 8
    (dict(cache_seqlens=[5, -1, 20]), ValueError, "cache_seqlens"),
    (dict(page_table="bad ids"), ValueError, "page_table"),
    (dict(block_table="bad ids", page_table=None), ValueError, "block_table"),
    (dict(q_dtype=torch.bfloat16), TypeError, "k_cache (kv_dtype)"),
    (dict(head_dim=300), ValueError, "q (head_dim)"),
    (dict(sinks=torch.tensor([0.0, math.nan, 0, 0, 0, 0])), ValueError, "sinks"),
]


@pytest.mark.parametrize("change,error,name", REFUSED,
                         ids=lambda x: x if isinstance(x, str) else None)
def test_fa_a_refused_call_writes_nothing(device, change, error, name):
    """Each refusal of an appending call names FA's argument and leaves both caches as they
    were (bitwise): the checks, the plan's included, run before the append."""
    inp, (q, kc, vc, k, v), call = _append_call(device)
    change = dict(change)
    if "cache_seqlens" in change:
        call["cache_seqlens"] = torch.tensor(change.pop("cache_seqlens"), dtype=torch.int32,
                                             device=device)
    for key in ("page_table", "block_table"):
        if change.get(key) == "bad ids":  # a page id past the cache in a used column
            bad = inp.block_tables.clone()
            bad[1, 1] = kc.shape[0] + 3
            call.pop("page_table")
            change[key] = bad
    if "q_len" in change:
        q = q.expand(3, change.pop("q_len"), 6, 32)
    if "q_dtype" in change:
        q = q.to(change.pop("q_dtype"))
    if "head_dim" in change:
        dim = change.pop("head_dim")
        q = torch.randn(3, 1, 6, dim, device=device, dtype=torch.float16)
        kc = torch.zeros(kc.shape[:3] + (dim,), device=device, dtype=torch.float16)
        vc, k, v = kc.clone(), torch.zeros(3, 2, 2, dim, device=device,
                                           dtype=torch.float16), None
        v = k.clone()
    change = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in change.items()}
    call.update(change)
    saved = kc.clone(), vc.clone()
    with pytest.raises(error) as caught:
        flash_attn_with_kvcache(q, kc, vc, k, v, **call)
    assert str(caught.value).startswith(f"{name}:"), caught.value
    assert torch.equal(kc.view(torch.uint8), saved[0].view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), saved[1].view(torch.uint8))


def test_fa_lengths_past_the_table_name_cache_seqlens(device):
    """A decode call (no append) whose lengths pass the table's capacity: the error names
    cache_seqlens, on the short path of a repeated call too."""
    inp = _inputs(device, [5, 9])
    q = inp.query.unsqueeze(1)
    lens = inp.context_lens.clone()
    for _ in range(2):  # the first call plans, the second takes the short path
        flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, cache_seqlens=lens,
                                page_table=inp.block_tables)
    lens[1] = inp.block_tables.shape[1] * 8 + 1
    for _ in range(2):
        with pytest.raises(ValueError, match="^cache_seqlens: "):
            flash_attn_with_kvcache(q, inp.key_cache, inp.value_cache, cache_seqlens=lens,
                                    page_table=inp.block_tables)


@pytest.mark.gpu
def test_fa_append_past_capacity_is_refused_on_the_gpu():
    """On the GPU an appending call past the table's capacity is refused (one host sync of
    the lengths, as FA2's mha_fwd_kvcache) before it writes: not dropped tokens over clamped
    lengths."""
    inp, (q, kc, vc, k, v), call = _append_call("cuda")
    call["cache_seqlens"] = torch.tensor([5, 12, 23], dtype=torch.int32, device="cuda")
    saved = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="^cache_seqlens: .*row 2"):
        flash_attn_with_kvcache(q, kc, vc, k, v, **call)
    assert_same_bits(kc, saved[0])  # the unused pages hold NaN: compare bits, not values
    assert_same_bits(vc, saved[1])


# --- kind 4: a wide fp16 query through the fp8 path ------------------------------------------

def _wide_fp16_query_case(device, lens, heads, kv_heads, head_dim, page_size):
    inp = make_paged_inputs(lens, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                            page_size=page_size, dtype=torch.float16,
                            cache_dtype=torch.float8_e4m3fn, device=device)
    q = inp.query.clone()
    q[..., 0] = 30000.0  # legal fp16; times k_descale 4 it is past fp16's 65,504
    batch = len(lens)
    kd = torch.full((batch, kv_heads), 4.0, device=device)
    kd[0] = 3.0
    vd = torch.rand(batch, kv_heads, device=device) + 0.5
    out = flash_attn_with_kvcache(q.unsqueeze(1), inp.key_cache, inp.value_cache,
                                  cache_seqlens=inp.context_lens, page_table=inp.block_tables,
                                  k_descale=kd, v_descale=vd, softmax_scale=2e-5)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    for b in range(batch):
        ref = paged_decode_reference(q[b:b + 1], inp.key_cache, inp.value_cache,
                                     inp.block_tables[b:b + 1], inp.context_lens[b:b + 1],
                                     k_scale=kd[b], v_scale=vd[b], scale=2e-5)
        assert rel_l2_error(out[b:b + 1, 0], ref.out) <= tolerance_for(torch.float8_e4m3fn)


def test_fa_fp16_query_times_k_descale_past_fp16_range(device):
    """|q| * k_descale > 65,504 with an fp16 query and an fp8 cache: k_descale is folded into
    the query in float32 (the kernel scales a wide query into fp16 by a power of two), so the
    legal input is neither refused nor NaN."""
    _wide_fp16_query_case(device, [5, 17, 30], 6, 2, 32, 8)


@pytest.mark.gpu
def test_fa_fp16_query_times_k_descale_past_fp16_range_on_the_gpu():
    """The same at Llama-8B's shapes on the GPU (there the fp16 fold returned NaN)."""
    _wide_fp16_query_case("cuda", [1, 300, 1000, 4097], 32, 8, 128, 16)


# --- kind 3: the FlashInfer wrapper checks its CSR at plan ---------------------------------

def _wrapper(device):
    from pagedattn.compat import BatchDecodeWithPagedKVCacheWrapper

    return BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device))


def test_fi_last_page_len_is_checked_and_0_is_an_empty_last_page(device):
    """9 or 16 tokens in a last page of 8 would read a padding page and -1 would drop a
    token: refused, naming the sequence. 0 (documented) is a last page of no token: the
    length is (pages - 1) x page_size, FlashInfer's formula."""
    inp = _inputs(device, [5, 17, 32])
    w = _wrapper(device)
    for bad in (9, 16, -1):
        indptr, indices, last = _csr(inp)
        last[1] = bad
        with pytest.raises(ValueError, match=r"^last_page_len: .* \(entry 1\), got -?\d+$"):
            w.plan(indptr, indices, last, 6, 2, 32, 8, q_data_type=torch.float16)
    indptr, indices, last = _csr(inp)
    last[2] = 0
    w.plan(indptr, indices, last, 6, 2, 32, 8, q_data_type=torch.float16)
    out = w.run(inp.query, (inp.key_cache, inp.value_cache))
    lens = torch.tensor([5, 17, 24], device=device)
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 lens)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)


def test_fi_a_short_indices_is_named(device):
    inp = _inputs(device, [5, 17, 32])
    indptr, indices, last = _csr(inp)
    with pytest.raises(ValueError, match="^indices: expected indptr"):
        _wrapper(device).plan(indptr, indices[:-2], last, 6, 2, 32, 8,
                              q_data_type=torch.float16)


def test_fi_seq_lens_without_block_tables_are_the_lengths(device):
    """plan(seq_lens=...) with the CSR pages: the lengths given are used (the docstring's
    promise), each checked against its sequence's pages."""
    inp = _inputs(device, [5, 17, 32])
    seq_lens = torch.tensor([3, 10, 30], dtype=torch.int32, device=device)
    w = _wrapper(device)
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16, seq_lens=seq_lens)
    out = w.run(inp.query, (inp.key_cache, inp.value_cache))
    ref = paged_decode_reference(inp.query, inp.key_cache, inp.value_cache, inp.block_tables,
                                 seq_lens)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
    with pytest.raises(ValueError, match=r"^seq_lens: .*\(entry 1\)"):
        w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16,
               seq_lens=torch.tensor([3, 25, 30], dtype=torch.int32, device=device))


def _flashinfer_alibi_lse(q, inp, lens, slopes, q_len):
    """FlashInfer's LSE of ALiBi by its definition, float64: query token ``j`` of a request
    sees keys ``p <= len - q_len + j`` with the bias ``slope * (p - j)`` (base e)."""
    batch, _, heads, dim = q.shape
    group = heads // inp.key_cache.shape[2]
    lse = torch.empty(batch, q_len, heads, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        pages = inp.block_tables[b, :math.ceil(n / 8)].long().cpu()
        k = inp.key_cache.cpu()[pages].reshape(-1, inp.key_cache.shape[2], dim)[:n].double()
        for j in range(q_len):
            seen = n - q_len + j + 1
            for h in range(heads):
                s = k[:seen, h // group] @ q[b, j, h].double().cpu() * dim ** -0.5
                s = s + slopes[h].double().cpu() * (torch.arange(seen) - j)
                lse[b, j, h] = torch.logsumexp(s, 0)
    return lse


@pytest.mark.parametrize("q_len", [2, 3])
def test_fi_alibi_lse_of_multi_token_requests(device, q_len):
    """ALiBi with q_len_per_req > 1: the base-2 LSE is FlashInfer's (it was off by
    slope * (q_len - 1) * log2(e) for every token)."""
    from pagedattn.compat.flashinfer import get_alibi_slopes

    inp = _inputs(device, [5, 17, 32])
    w = _wrapper(device)
    w.plan(*_csr(inp), 6, 2, 32, 8, q_data_type=torch.float16, pos_encoding_mode="ALIBI",
           q_len_per_req=q_len)
    q = torch.randn(3, q_len, 6, 32, device=device, dtype=torch.float16)
    out, lse = w.run(q.view(3 * q_len, 6, 32), (inp.key_cache, inp.value_cache),
                     return_lse=True)
    slopes = get_alibi_slopes(6, device)
    ref = paged_decode_reference(q, inp.key_cache, inp.value_cache, inp.block_tables,
                                 inp.context_lens, alibi_slopes=slopes)
    assert rel_l2_error(out.view(3, q_len, 6, 32), ref.out) <= tolerance_for(torch.float16)
    want = _flashinfer_alibi_lse(q, inp, inp.context_lens, slopes, q_len) / math.log(2)
    assert torch.allclose(lse.view(3, q_len, 6).double().cpu(), want, atol=3e-3)


def test_fi_a_page_id_past_the_cache_names_indices():
    """A used page id past the cache, found when the run checks its values (CPU): named as
    FlashInfer names it."""
    inp = _inputs("cpu", [5, 17, 32])
    indptr, indices, last = _csr(inp)
    indices[2] = inp.key_cache.shape[0] + 1
    w = _wrapper("cpu")
    w.plan(indptr, indices, last, 6, 2, 32, 8, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="^indices: expected used page ids"):
        w.run(inp.query, (inp.key_cache, inp.value_cache))
