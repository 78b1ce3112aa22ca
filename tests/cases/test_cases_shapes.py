"""Cases B06-B10, B16-B18 and B21 of the first series of cases (public bug reports): GQA groups
that are not powers of two, head dims and page sizes of every kind, the online-softmax
sentinel, fp8 scales, strides and long contexts.

Each case is a test named after its id, for every impl it applies to, at two sizes: ``cpu``
(tiny, keeping the trigger) and ``natural`` (the case's own sizes, ``gpu``-marked). Outputs
are NaN-poisoned before every call and unused cache slots hold NaN.
"""

import math

import pytest
import torch
from _hardening import IMPLS, NAN, STAGES, check, check_lse, fp8_quantize, run, sizes

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import PagedInputs, make_paged_inputs, rel_l2_error, tolerance_for

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP8 = torch.float8_e4m3fn


def _token_walker(impl, size):
    """On the CPU the stages that walk one token at a time (about 4 ms per token and query
    head in the interpreter) get one query head where the case's trigger is not the group."""
    return impl in ("baseline", "fused_v1", "vectorized_v2", "split_kv_v4") and size["cpu"]


@pytest.mark.parametrize("size", sizes(
    dict(lens=[5], shapes=[(12, 2, FP32), (3, 1, BF16), (5, 1, FP32), (7, 1, BF16)]),
    dict(lens=[4096], shapes=[(h, k, d) for h, k in ((12, 2), (24, 8), (20, 4), (28, 4))
                              for d in (FP32, BF16)])))
@pytest.mark.parametrize("impl", IMPLS)
def test_B06_gqa_group_not_power_of_two(impl, size, device):
    """torch #151359: Hq 12 / Hkv 2 (group 6), D 16, page 16, fp32 and bf16; also groups 3
    (24/8), 5 (20/4) and 7 (28/4). Compiles and matches; no compiler error."""
    for hq, hkv, dtype in size["shapes"]:
        inputs = make_paged_inputs(size["lens"], num_q_heads=hq, num_kv_heads=hkv, head_dim=16,
                                   page_size=16, dtype=dtype, seed=hq, device=device)
        check(run(impl, inputs), inputs)


@pytest.mark.parametrize("size", sizes(dict(lens=[1, 3], dim=32), dict(lens=[1, 333], dim=128)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B07_group7_head_mapping(impl, size, device):
    """aprender #559: Hq 28 / Hkv 4 (group 7), bf16, ctx [1, 333]; V carries +10·kv_head so a
    wrong head mapping cannot hide. Head h reads kv head h // 7: checked explicitly at the
    boundaries h = 6 → 0, 7 → 1, 27 → 3 against a per-head float64 attention."""
    inputs = make_paged_inputs(size["lens"], num_q_heads=28, num_kv_heads=4,
                               head_dim=size["dim"], page_size=16, dtype=BF16, seed=7,
                               device=device)
    offset = 10.0 * torch.arange(4, device=device).view(1, 1, 4, 1)
    inputs = inputs._replace(value_cache=(inputs.value_cache.float() + offset).to(BF16))
    out = run(impl, inputs)
    check(out, inputs)
    q, k_cache, v_cache, tables, _ = inputs
    for b, n in enumerate(size["lens"]):
        pages = tables[b, : math.ceil(n / 16)].long()
        k = k_cache[pages].double().flatten(0, 1)[:n]  # [n, 4, D]
        v = v_cache[pages].double().flatten(0, 1)[:n]
        for h, kv in ((0, 0), (6, 0), (7, 1), (13, 1), (14, 2), (27, 3)):
            p = torch.softmax(k[:, kv] @ q[b, h].double() * size["dim"] ** -0.5, dim=0)
            want = p @ v[:, kv]
            assert rel_l2_error(out[b, h], want) <= 1e-2, f"head {h} is not on kv head {kv}"
            assert abs(out[b, h].double().mean().item() - 10 * kv) < 3  # the offset shows


def _widen(t, wide):
    """``t`` as the first ``head_dim`` lanes of a buffer ``wide`` lanes wide, the rest NaN."""
    buf = torch.full((*t.shape[:-1], wide), NAN, dtype=t.dtype, device=t.device)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


@pytest.mark.parametrize("size", sizes(dict(lens=[2, 17], heads=(2, 1)),
                                       dict(lens=[7, 300], heads=(16, 2))))
@pytest.mark.parametrize("impl", IMPLS)
def test_B08_head_dim_not_power_of_two(impl, size, device):
    """Triton-distributed #200: D ∈ {80, 96, 112, 192, 256} (controls 64, 128), bf16, page 16.
    Every D compiles and matches. Padded lanes are masked in the Q, K, V loads (the tensors
    are views of wider buffers whose extra lanes hold NaN) and in the store (``out`` is a view
    whose extra lanes must stay NaN)."""
    hq, hkv = size["heads"] if not _token_walker(impl, size) else (1, 1)
    for dim in (80, 96, 112, 192, 256, 64, 128):
        inputs = make_paged_inputs(size["lens"], num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=dim, page_size=16, dtype=BF16, seed=dim,
                                   device=device)
        wide = 1 << dim.bit_length()  # past the kernels' power-of-two padding of D
        strided = PagedInputs(*(_widen(t, wide) for t in inputs[:3]), *inputs[3:])
        out_buf = torch.full((len(size["lens"]), hq, wide), NAN, dtype=BF16, device=device)
        pagedattn.paged_decode(*strided, impl=impl, out=out_buf[..., :dim])
        check(out_buf[..., :dim], inputs)
        assert torch.isnan(out_buf[..., dim:]).all(), f"D={dim}: store past head_dim"


@pytest.mark.parametrize("head_dim", [8, 15, 257, 512])
def test_B08_unsupported_head_dim_raises(head_dim):
    """D outside [16, 256] is a ValueError naming head_dim, before any launch."""
    inputs = make_paged_inputs([3], num_q_heads=2, num_kv_heads=1, head_dim=head_dim)
    with pytest.raises(ValueError, match="head_dim"):
        pagedattn.paged_decode(*inputs)


def _far_apart_tables(lens, page_size, extra=3, seed=0):
    """Tables whose neighbouring entries jump between the lowest and highest page ids;
    ``extra`` unused (NaN) pages in the middle; the highest id num_pages - 1 is used."""
    need = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(need) + extra
    order = [i // 2 if i % 2 == 0 else num_pages - 1 - i // 2 for i in range(sum(need))]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(lens), generator=g).tolist()  # which row gets which ids
    tables = [[-1] * max(need) for _ in lens]
    nxt = 0
    for b in rows:
        tables[b][: need[b]] = order[nxt: nxt + need[b]]
        nxt += need[b]
    return tables, num_pages


def _paged_from_tables(lens, page_size, *, hq, hkv, dim, dtype, device, seed):
    from _hardening import paged_batch
    tables, num_pages = _far_apart_tables(lens, page_size, seed=seed)
    return paged_batch(lens, tables, num_pages, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                       page_size=page_size, dtype=dtype, seed=seed, device=device)


@pytest.mark.parametrize("size", sizes(dict(batch=0, heads=(2, 1), dim=32),
                                       dict(batch=40, heads=(32, 8), dim=128)))
@pytest.mark.parametrize("page_size", [1, 8, 16, 48, 100, 256])
@pytest.mark.parametrize("impl", IMPLS)
def test_B09_small_and_odd_page_sizes(impl, page_size, size, device):
    """FA2 #824/#828: page_size ∈ {1, 8, 16, 48, 100, 256}, fp16, neighbouring table entries
    jumping between page 0 and num_pages - 1. Natural: B 40 (> 32), ctx drawn from 1..1000,
    Hq 32 / Hkv 8, D 128. CPU: ctx [1, page_size + 1] (one page crossing; the token-walking
    stages get one query head)."""
    if size["batch"]:
        g = torch.Generator().manual_seed(page_size)
        lens = torch.randint(1, 1001, (size["batch"],), generator=g).tolist()
    else:
        lens = [1, page_size + 1] if page_size <= 16 or impl not in STAGES else [page_size + 1]
    hq, hkv = size["heads"] if not _token_walker(impl, size) else (1, 1)
    inputs = _paged_from_tables(lens, page_size, hq=hq, hkv=hkv, dim=size["dim"], dtype=FP16,
                                device=device, seed=page_size)
    check(run(impl, inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [127, 128, 129, 300])
@pytest.mark.parametrize("impl", IMPLS)
def test_B09_batch_across_the_length_scan_block(impl, batch):
    """B09's batch > 32, carried to ``auto``'s own boundary: it scans ``context_lens`` in
    slices of BLOCK_B = 128 to map split rows to sequences, so batches of 127..129 and 300
    (lengths 0..64, page 16, group 4) must map every row right. GPU only: the interpreter
    needs about 50 ms per sequence here."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(0, 65, (batch,), generator=g).tolist()
    inputs = make_paged_inputs(lens, num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, dtype=BF16, seed=batch, device="cuda")
    for num_splits in ([None, 3] if impl in ("split_kv_v4", "auto") else [None]):
        check(run(impl, inputs, num_splits=num_splits), inputs)


@pytest.mark.parametrize("size", sizes(dict(lens=lambda p: [p + 1], dim=32, heads=(2, 1)),
                                       dict(lens=lambda p: [300, 1100], dim=256, heads=(16, 2))))
@pytest.mark.parametrize("impl", IMPLS)
def test_B10_large_page_sizes(impl, size, device):
    """FlashInfer #1796/#4347: page_size ∈ {128, 192, 256, 544}, D 256, bf16, ctx [300, 1100]:
    matches (no silent wrong result for an accepted page size). CPU: ctx page_size + 1 at
    D 32; the token-walking stages get page 192 only and one head, gqa_reuse_v3 and auto
    (whose tiles depend on the page) every page size."""
    walker = _token_walker(impl, size)
    hq, hkv = (1, 1) if walker else size["heads"]
    for page_size in [192] if walker else [128, 192, 256, 544]:
        inputs = _paged_from_tables(size["lens"](page_size), page_size, hq=hq, hkv=hkv,
                                    dim=size["dim"], dtype=BF16, device=device, seed=page_size)
        check(run(impl, inputs), inputs)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_B16_all_logits_very_negative(impl, dtype, device):
    """Online-softmax sentinel: q = +128, k = -128, D 128, so every scaled logit is about
    -1.85e5, and V = 1. Output all ones, LSE correct (auto, also through the split merge):
    a finite 'minus large' sentinel for the running max would give zeros or NaN."""
    inputs = make_paged_inputs([5, 17], num_q_heads=2, num_kv_heads=1, head_dim=128,
                               page_size=16, dtype=dtype, device=device)
    used = ~torch.isnan(inputs.key_cache)
    k = torch.where(used, torch.full_like(inputs.key_cache, -128.0), inputs.key_cache)
    v = torch.where(used, torch.ones_like(inputs.value_cache), inputs.value_cache)
    inputs = inputs._replace(query=torch.full_like(inputs.query, 128.0), key_cache=k,
                             value_cache=v)
    ref = paged_decode_reference(*inputs)
    assert (ref.lse.cpu() < -1.8e5).all()  # the trigger is in place
    for num_splits in ([None, 2] if impl == "auto" else [None]):
        if impl == "auto":
            out, lse = run(impl, inputs, num_splits=num_splits, return_lse=True)
            check_lse(lse, ref)
        else:
            out = run(impl, inputs)
        torch.testing.assert_close(out.float(), torch.ones_like(out, dtype=FP32), rtol=0,
                                   atol=tolerance_for(dtype))


def _fp8_inputs(lens, hq, hkv, dim, k_scale, v_scale, fp8_dtype, device):
    inputs = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                               page_size=16, dtype=BF16, seed=17, device=device)
    return inputs._replace(key_cache=fp8_quantize(inputs.key_cache, k_scale, fp8_dtype),
                           value_cache=fp8_quantize(inputs.value_cache, v_scale, fp8_dtype))


B17_SCALES = {
    "floats": (0.25, 0.5),
    "0d-tensors": (torch.tensor(0.25), torch.tensor(0.5)),
    "per-kv-head": (torch.tensor([0.25, 0.75]), torch.tensor([0.5, 2.0])),
}


@pytest.mark.parametrize("fp8_dtype", [FP8, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", list(B17_SCALES))
@pytest.mark.parametrize("size", sizes(dict(heads=(4, 2), dim=64), dict(heads=(32, 8), dim=128)))
def test_B17_fp8_scales_applied(size, scales, fp8_dtype, device):
    """vLLM #42580: fp8 K/V storing K/k_scale and V/v_scale with k_scale 0.25, v_scale 0.5
    (non-unit, different), ctx [50, 300], bf16 query: matches the float64 oracle on the
    dequantized cache (fp8 tolerance), LSE included. Dropping either scale would fail: the
    oracle without scales is checked to be far off."""
    hq, hkv = size["heads"]
    k_scale, v_scale = B17_SCALES[scales]
    if isinstance(k_scale, torch.Tensor) and k_scale.dim() == 1:  # [num_kv_heads]
        k_scale, v_scale = k_scale.repeat(hkv // 2), v_scale.repeat(hkv // 2)
    k_scale, v_scale = ((s.to(device) if isinstance(s, torch.Tensor) else s)
                        for s in (k_scale, v_scale))
    inputs = _fp8_inputs([50, 300], hq, hkv, size["dim"], k_scale, v_scale, fp8_dtype, device)
    out, lse = run("auto", inputs, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    ref = check(out, inputs, k_scale=k_scale, v_scale=v_scale)
    check_lse(lse, ref, rtol=1e-4)
    for dropped in (dict(k_scale=k_scale), dict(v_scale=v_scale)):
        wrong = paged_decode_reference(*inputs, **dropped).out
        assert rel_l2_error(wrong, ref.out) > 10 * tolerance_for(fp8_dtype)


@pytest.mark.parametrize("shape", [(2, 1), (3,), (1, 2), (2, 2, 1)], ids=str)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_B17_unsupported_scale_shapes_raise(name, shape):
    """Per-token or otherwise shaped scales: ValueError naming k_scale/v_scale."""
    inputs = _fp8_inputs([5], 4, 2, 64, 0.25, 0.5, FP8, "cpu")
    with pytest.raises(ValueError, match=name):
        pagedattn.paged_decode(*inputs, **{name: torch.ones(shape)})


def test_B17_fp8_query_raises_type_error():
    """An fp8 query (the case's variant) is out of scope: TypeError naming query."""
    inputs = _fp8_inputs([5], 4, 2, 64, 0.25, 0.5, FP8, "cpu")
    with pytest.raises(TypeError, match="query"):
        pagedattn.paged_decode(inputs.query.to(FP8), *inputs[1:], k_scale=0.25, v_scale=0.5)


@pytest.mark.parametrize("impl", STAGES)
def test_B17_stages_reject_fp8(impl):
    """The study's stages serve no fp8 cache: ValueError naming key_cache and the impl."""
    inputs = _fp8_inputs([5], 4, 2, 64, 1.0, 1.0, FP8, "cpu")
    with pytest.raises(ValueError, match=f"key_cache.*{impl}"):
        pagedattn.paged_decode(*inputs, impl=impl)


@pytest.mark.parametrize("size", sizes(dict(heads=(2, 1), dim=64), dict(heads=(32, 8), dim=128)))
@pytest.mark.parametrize("impl", IMPLS)
def test_B18_strided_inputs_equal_contiguous(impl, size, device):
    """The query is a slice of a packed QKV tensor (natural strides (6144, 128, 1)); K and V
    are the two halves of one combined [num_pages, 2, ...] cache (HND too, for auto); the
    block table and lengths are every-other-element views; ``out`` is strided. The result
    is bitwise the contiguous one."""
    hq, hkv = size["heads"]
    dim = size["dim"]
    inputs = make_paged_inputs([5, 19, 33], num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                               page_size=8, dtype=FP16, seed=18, device=device)
    want = run(impl, inputs)
    check(want, inputs)
    qkv = torch.randn(3, hq + 2 * hkv, dim, dtype=FP16, device=device)
    qkv[:, :hq] = inputs.query
    query = qkv[:, :hq]
    assert query.stride() == ((hq + 2 * hkv) * dim, dim, 1)
    tables = inputs.block_tables.repeat_interleave(2, dim=1)[:, ::2]
    lens = inputs.context_lens.repeat_interleave(2)[::2]
    layouts = ["NHD", "HND"] if impl == "auto" else ["NHD"]
    for layout in layouts:
        kv = torch.stack([inputs.key_cache, inputs.value_cache], dim=1)  # [P, 2, page, H, D]
        if layout == "HND":
            kv = kv.transpose(2, 3).contiguous()  # [P, 2, H, page, D]
        out_buf = torch.full((3, hq, 2 * dim), NAN, dtype=FP16, device=device)
        out = out_buf[:, :, ::2]
        pagedattn.paged_decode(query, kv[:, 0], kv[:, 1], tables, lens, impl=impl, out=out,
                               kv_layout=layout)
        assert torch.equal(out, want), layout
        assert torch.isnan(out_buf[:, :, 1::2]).all()


@pytest.mark.parametrize("size", sizes(dict(lens=[256, 4096], impls=["auto"], heads=(2, 1)),
                                       dict(lens=[1024, 16384, 131072], impls=IMPLS,
                                            heads=(8, 1))))
def test_B21_long_context_bf16_precision(size, device):
    """bf16 over 131072 tokens against float64: relative L2 ≤ 1e-2 and no growth with the
    length (error at the longest ≤ 2× the shortest + 1e-3). CPU: auto only (the stages walk
    tokens one at a time) at 4096."""
    hq, hkv = size["heads"]
    for impl in size["impls"]:
        errors = []
        for n in size["lens"]:
            inputs = make_paged_inputs([n], num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                       page_size=16, dtype=BF16, seed=21, device=device)
            out = run(impl, inputs)
            errors.append(rel_l2_error(out, check(out, inputs).out))
        assert errors[-1] <= 2 * errors[0] + 1e-3, f"{impl}: error grows with length {errors}"
