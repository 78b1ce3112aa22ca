"""CUDA graphs (GPU only): a decode step captured once at a maximum batch replays correctly
for new lengths and block tables, because nothing on the host depends on their values."""

import pytest
import torch

from pagedattn import paged_decode
from pagedattn.bench.timing import capture_graph
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


def test_fused_rms_norm_matches_eager_in_fewer_kernels():
    """The serving model's norm on a GPU (``torch.compile`` of :func:`rms_norm`): the eager
    math within one bf16 rounding (inductor may sum the squares in another order), in one or
    two kernels where eager takes eight (a decode step runs 61 of them on SmolLM2)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedattn.serving.model import fused_rms_norm, rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    fused = fused_rms_norm()
    for n in (1, 5, 64):
        x = (torch.randn(n, 576, device="cuda", generator=g) * 3).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(576, device="cuda", generator=g)).to(torch.bfloat16)
        want, got = rms_norm(x, w, 1e-5), fused(x, w, 1e-5)
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=0), n
    counts = {}
    for name, fn in (("eager", rms_norm), ("fused", fused)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x, w, 1e-5)
            torch.cuda.synchronize()
        counts[name] = sum(1 for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA)
    assert counts["fused"] <= 2 < counts["eager"], counts
