"""CUDA graphs (GPU only): a decode step captured once at a maximum batch replays correctly
for new lengths and block tables, because nothing on the host depends on their values."""

import pytest
import torch

import pagedattn
from pagedattn import paged_decode
from pagedattn.bench.timing import capture_graph
from pagedattn.kernels.decode import _merge_per_group_kernel
from pagedattn.reference import paged_decode_reference
from pagedattn.serving import ops
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, None),
                                               (torch.float16, torch.float8_e4m3fn)])
def test_paged_decode_graph_replays_new_lengths(dtype, cache_dtype):
    """Capture at lengths [16, 16, 16, 1] and one page per row; replay at [8192, 20, 4000, 1]
    with the full block tables (poisoned padding and unused slots)."""
    lens = [8192, 20, 4000, 1]
    big = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                            dtype=dtype, cache_dtype=cache_dtype, device="cuda")
    max_pages = big.block_tables.shape[1]
    fp8 = cache_dtype is not None
    k_scale = torch.tensor(0.5, device="cuda") if fp8 else None
    v_scale = torch.tensor(0.25, device="cuda") if fp8 else None
    # the static buffers: same caches, tables padded to max_pages, short lengths at capture
    query = torch.randn_like(big.query)
    tables = torch.zeros_like(big.block_tables)
    tables[:, :1] = big.block_tables[:, :1]
    # 16 tokens (one page) per row at capture, 1 for the row whose page holds 1 valid token
    context_lens = big.context_lens.clamp(max=16)

    def step():
        return paged_decode(query, big.key_cache, big.value_cache, tables, context_lens,
                            k_scale=k_scale, v_scale=v_scale)

    graph, out = capture_graph(step, warmup=1)
    graph.replay()
    torch.cuda.synchronize()
    eager_short = step()
    assert rel_l2_error(out, eager_short) <= 1e-6

    query.copy_(big.query)
    tables.copy_(big.block_tables)
    context_lens.copy_(big.context_lens)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert rel_l2_error(out, eager) <= 1e-6
    ref = paged_decode_reference(*big, k_scale=k_scale, v_scale=v_scale).out
    assert rel_l2_error(out, ref) <= tolerance_for(cache_dtype or dtype)
    assert max_pages == 512


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "dependent-launch"])
def test_plan_graph_replays_per_group_merge(fold, monkeypatch):
    """A plan whose (sequence, kv head) pairs fill the SMs merges per group: in the last unit
    of each pair to arrive (a 16-bit cache's default: arrival counters in the workspace,
    reset by that unit, so every replay finds them zeroed) or, with the fold off, in a merge
    kernel that on sm_90+ is a programmatic dependent launch of the main kernel (it waits for
    the main grid in griddepcontrol.wait). Captured at 16 tokens a row, replayed twice with
    a ragged batch (one long sequence of many split rows, an empty one): each replay matches
    eager and the oracle, with the output poisoned before it."""
    from dataclasses import replace

    from pagedattn.launch import policy

    real = policy.heuristic_config
    monkeypatch.setattr(policy, "heuristic_config",
                        lambda *a: replace(real(*a), fold_merge=fold))
    lens = [16384, 0, 37] + [100 + 97 * i for i in range(21)]
    big = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                            dtype=torch.bfloat16, device="cuda")
    context_lens = big.context_lens.clamp(max=16)
    plan = pagedattn.plan_decode(big.block_tables, context_lens, num_q_heads=32,
                                 num_kv_heads=8, head_dim=128, page_size=16,
                                 q_dtype=torch.bfloat16)
    engine = plan._engine()
    assert engine.fold_merge is fold and engine.launches_merge is not fold
    assert engine.merge_kernel is _merge_per_group_kernel
    assert engine.pdl == (not fold and torch.cuda.get_device_capability()[0] >= 9)
    query = big.query.clone()

    def step():
        return plan.run(query, big.key_cache, big.value_cache)

    graph, out = capture_graph(step, warmup=1)
    context_lens.copy_(big.context_lens)
    ref = paged_decode_reference(*big).out
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2_error(out, step()) <= 1e-6
        assert rel_l2_error(out, ref) <= tolerance_for(torch.bfloat16)
        if fold:  # every pair's last unit reset its counter
            assert (engine.seq_rows == 0).all()


def test_model_decode_step_graph_replays_a_growing_ragged_batch():
    """A whole tiny-model decode step (append_kv + paged_decode per layer) captured with static
    metadata buffers, replayed step after step as the sequences grow; equals eager decoding
    on a twin cache."""
    from test_engine import tiny_model

    model = tiny_model("cuda")
    batch, max_pages, page_size = 4, 16, 4
    caches = [model.make_cache(64, page_size=page_size) for _ in range(2)]  # graph, eager
    seqs = list(range(batch))
    prompts = [torch.randint(0, 97, (n,), device="cuda") for n in (3, 9, 1, 14)]
    for cache in caches:
        for s, p in zip(seqs, prompts, strict=True):
            cache.add_sequence(s)
            meta = cache.prepare_step([s], [len(p)])
            model.prefill(p, meta, cache)
    meta = caches[0].prepare_step(seqs, [1] * batch, max_pages=max_pages)
    static = [t.clone() for t in meta[:4]]
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")

    def step():
        m = type(meta)(*static, meta.query_start)
        return model.decode(tokens, m, caches[0])

    graph, logits = capture_graph(step, warmup=1)
    caches[0].kv.copy_(caches[1].kv)  # the warm-up ran the step once: rewind that token
    caches[1].prepare_step(seqs, [1] * batch, max_pages=max_pages)
    next_tokens = torch.tensor([5, 6, 7, 8], device="cuda")
    for i in range(6):
        if i:
            meta = caches[0].prepare_step(seqs, [1] * batch, max_pages=max_pages)
            caches[1].prepare_step(seqs, [1] * batch, max_pages=max_pages)
            for dst, src in zip(static, meta[:4], strict=True):
                dst.copy_(src)
        tokens.copy_(next_tokens)
        graph.replay()
        want = model.decode(tokens, type(meta)(*[t.clone() for t in static], meta.query_start),
                            caches[1])
        assert rel_l2_error(logits, want) <= 1e-5
        next_tokens = want.argmax(-1)


def test_append_kv_graph_skips_padding_slots():
    """append_kv captured once; replays write new slots, and -1 padding slots nothing."""
    kc = torch.full((8, 4, 2, 64), float("nan"), device="cuda", dtype=torch.float16)
    vc = kc.clone()
    key = torch.randn(3, 2, 64, device="cuda", dtype=torch.float16)
    slots = torch.tensor([0, -1, 5], dtype=torch.int32, device="cuda")

    def step():
        ops.append_kv(key, -key, kc, vc, slots)

    graph, _ = capture_graph(step, warmup=1)
    slots.copy_(torch.tensor([31, 7, -1], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc[7, 3], key[0]) and torch.equal(vc[1, 3], -key[1])
    written = {(0, 0), (1, 1), (7, 3), (1, 3)}  # the warm-up run wrote the first two
    for p in range(8):
        for o in range(4):
            assert kc[p, o].isnan().all() != ((p, o) in written)


def _cuda_kernels(fn, *args) -> list[str]:
    """The names of the CUDA kernels one call ``fn(*args)`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_fused_layer_functions_match_eager_in_fewer_kernels():
    """The serving model's elementwise functions on a GPU (``torch.compile`` of each): the
    eager math within one bf16 rounding (inductor keeps intermediates in float32 and may sum
    the squares in another order), each in one or two kernels where eager takes two to eight."""
    from pagedattn.serving.model import EAGER, fused_functions

    g = torch.Generator(device="cuda").manual_seed(0)
    fused = fused_functions()
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(bf16)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device="cuda") / 64.0))
    for n in (1, 5, 64):
        x, r, w = randn(n, 576, scale=3), randn(n, 576), 1 + randn(576, scale=0.1)
        qkv = randn(n, 15 * 64 + 64)  # a strided view of Q and K, as the model passes it
        positions = torch.arange(n, device="cuda") * 37
        calls = {
            "rms_norm": (x, w, 1e-5), "add_rms_norm": (x, r, w, 1e-5),
            "silu_mul": (randn(n, 2 * 1536),), "rope_tables": (positions, inv_freq, bf16),
        }
        cos, sin = EAGER.rope_tables(positions, inv_freq, bf16)
        calls["apply_rope"] = (qkv[:, :15 * 64].view(n, 15, 64), cos, sin)
        for name, args in calls.items():
            want = getattr(EAGER, name)(*args)
            got = getattr(fused, name)(*args)
            for a, b in zip(got if isinstance(got, tuple) else (got,),
                            want if isinstance(want, tuple) else (want,), strict=True):
                assert a.dtype == b.dtype == bf16 and a.shape == b.shape, (name, n)
                assert torch.allclose(a.float(), b.float(), rtol=2**-6, atol=2**-6), (name, n)
            if n == 64:
                eager_k = len(_cuda_kernels(getattr(EAGER, name), *args))
                fused_k = len(_cuda_kernels(getattr(fused, name), *args))
                assert fused_k <= 2 and fused_k < eager_k, (name, fused_k, eager_k)


def test_decode_step_kernels_per_layer():
    """A decode step of the serving model on a GPU launches at most 11 kernels per layer
    (perf-notes step 19): two norms (each residual add folded into a norm), RoPE, SwiGLU's
    activation, the four GEMMs, ``append_kv`` and the attention's main and merge kernels (one
    plan per step: its workspace is zeroed once a step, not once a layer). Counted as the
    difference between a 4-layer and a 2-layer model, so per-step kernels cancel."""
    import dataclasses

    from pagedattn.serving.baselines import random_weights
    from pagedattn.serving.gguf_loader import LlamaConfig
    from pagedattn.serving.model import Transformer

    cfg2 = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_q_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                       rms_eps=1e-5, max_position=256, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None)
    counts = {}
    for layers in (2, 4):
        cfg = dataclasses.replace(cfg2, num_layers=layers)
        model = Transformer(cfg, random_weights(cfg), dtype=torch.bfloat16, device="cuda")
        cache = model.make_cache(8, page_size=16)
        cache.add_sequence(0)
        tokens = torch.tensor([3], device="cuda")
        with torch.inference_mode():
            for _ in range(2):  # compile the functions and bind the kernels first
                model.decode(tokens, cache.prepare_step([0], [1]), cache)
            meta = cache.prepare_step([0], [1])
            counts[layers] = _cuda_kernels(model.decode, tokens, meta, cache)
    per_layer = (len(counts[4]) - len(counts[2])) / 2
    assert per_layer <= 11, (per_layer, counts[4])
