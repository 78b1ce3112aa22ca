"""Extreme values, limits and devices, cases N06-N19 of the second series (public bug
reports): ranges narrowed by casts, extreme logits, LSE base, grid limits, degenerate metadata
and output aliasing (N06-N16), and N19, the device guard: every tensor argument on another
device is named before any launch; every impl, the custom ops, ``append_kv`` and CUDA-graph
capture run on ``cuda:1`` while device 0 is current (``gpu2``); two processes all-gather
through NCCL inside graphs (``n19_distributed.py``).

Each case is a test named after its id, for every impl it applies to. ``cpu`` variants shrink
the sizes and keep the trigger; ``natural`` variants (and the cases only a GPU shows: N11's
grid limit, N15 at full size) are ``gpu``-marked; N19 needs two GPUs (``gpu2``). Outputs are
NaN-poisoned before every call and compared with the float64 reference.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hardening import IMPLS, NAN, SPLIT_IMPLS, check, check_lse, run, sizes

import pagedattn
from pagedattn.reference import paged_decode_reference
from pagedattn.testing import FP8_TOLERANCE, make_paged_inputs, rel_l2_error

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
FP8S = [torch.float8_e4m3fn, torch.float8_e5m2]


def _used(cache: torch.Tensor) -> torch.Tensor:
    """Slots some sequence attends to (``make_paged_inputs`` poisons the others with NaN)."""
    return ~torch.isnan(cache.float())


# -- N06: fp16 q·k that overflows before the scale --------------------------------------------

@pytest.mark.parametrize("trigger", ["raw-dot-5e5-scale-1e-4", "elements-300-default-scale"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", sizes(dict(lens=[5, 19], heads=(4, 2)),
                                       dict(lens=[7, 300, 2048], heads=(32, 8))))
def test_N06_fp16_dot_above_fp16_range(impl, trigger, size, device):
    """fp16, head_dim 128: raw q·k about 5e5 (62.5 ± 5 per element) with ``scale=1e-4``, and
    |q|, |k| about 300 per element with the default scale. A kernel that forms q·k in fp16
    and scales afterwards gets inf; ours stay finite and within the fp16 tolerance."""
    hq, hkv = size["heads"]
    base = make_paged_inputs(size["lens"], num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                             page_size=16, dtype=FP32, seed=6, device=device)
    if trigger.startswith("raw"):
        def shift(x):
            return 62.5 + 5.0 * x
        kw = {"scale": 1e-4}
    else:
        def shift(x):
            return 300.0 * torch.sign(x) * (0.5 + 0.5 * x.abs().clamp(max=1.0))
        kw = {}
    inputs = base._replace(query=shift(base.query).half(), key_cache=shift(base.key_cache).half(),
                           value_cache=base.value_cache.half())
    q64 = inputs.query.double()
    k64 = inputs.key_cache.double().nan_to_num()
    assert (q64.abs().amax() * k64.abs().amax() * 128 > 65504), "trigger not in place"
    check(run(impl, inputs, **kw), inputs, **kw)


# -- N07: fp8 cache, a query channel above the fp16 range -------------------------------------

@pytest.mark.parametrize("channel_value", [6e4, 8e4], ids=["6e4-control", "8e4"])
@pytest.mark.parametrize("query_dtype", [BF16, FP32], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8S, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("size", sizes(dict(lens=[5, 33], heads=(4, 2), dim=64),
                                       dict(lens=[7, 300, 1000], heads=(32, 8), dim=128)))
def test_N07_fp8_cache_query_channel_above_fp16_range(size, fp8_dtype, query_dtype,
                                                       channel_value, device):
    """fp8 cache with ``k_scale=1e-4``; query channel 3 holds 8e4 (above fp16's 65,504) and
    the stored keys of that channel are chosen so every logit stays within about [-2, 1].
    No cast may narrow the query's range: finite and within the fp8 tolerance of the
    dequantized float64 reference (the 6e4 control passes either way). ``auto`` is the
    only impl with fp8 caches."""
    hq, hkv = size["heads"]
    dim = size["dim"]
    base = make_paged_inputs(size["lens"], num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                             page_size=16, dtype=FP32, seed=7, device=device)
    channel = 3
    g = torch.Generator().manual_seed(7)
    # stored keys of the channel: logit = channel_value * stored * 1e-4 * dim**-0.5
    limit = dim**0.5 / (channel_value * 1e-4)
    stored = (torch.rand(base.key_cache.shape[:-1], generator=g) * 3 - 2) * limit / 2
    k = base.key_cache.clone()
    k[..., channel] = torch.where(torch.isnan(k[..., channel]), NAN, stored.to(device))
    q = base.query.clone()
    q[..., channel] = channel_value
    inputs = base._replace(query=q.to(query_dtype), key_cache=k.to(fp8_dtype),
                           value_cache=base.value_cache.to(fp8_dtype))
    ref = paged_decode_reference(*inputs, k_scale=1e-4)
    assert ref.lse.isfinite().all()
    out = run("auto", inputs, k_scale=1e-4)
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    err = rel_l2_error(out, ref.out)
    assert err <= FP8_TOLERANCE, f"relative L2 error {err:.3g} > {FP8_TOLERANCE}"


# -- N08: LSE base and empty rows -------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_N08_lse_natural_log_and_empty_rows(num_splits, device):
    """fp32, lengths [0, 5, 37, 300], ``return_lse``: the LSE is natural-log within 1e-5 of
    float64 (a base-2 LSE is off by a factor 1.44), -inf with a zero output for the empty
    row, whatever the split count. ``auto`` is the impl that returns the LSE."""
    inputs = make_paged_inputs([0, 5, 37, 300], num_q_heads=4, num_kv_heads=2, head_dim=32,
                               page_size=16, dtype=FP32, seed=8, device=device)
    out, lse = run("auto", inputs, num_splits=num_splits, return_lse=True)
    ref = check(out, inputs)
    check_lse(lse, ref, rtol=1e-5)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


# -- N11: more than 65,535 rows ---------------------------------------------------------------

@pytest.fixture(scope="module")
def n11_batch():
    """Batch 70,000, lengths 1-16, 8/2 heads, head_dim 64, bf16; its float64 reference once."""
    lens = [1 + (i * 7) % 16 for i in range(70_000)]
    inputs = make_paged_inputs(lens, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                               dtype=BF16, seed=11, device="cuda")
    return inputs, paged_decode_reference(*inputs).out


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_N11_batch_past_grid_limit(impl, n11_batch):
    """A grid dim past 65,535 (the y/z launch limit) must not leave rows unwritten: ``out``
    starts as NaN, and every row is finite and matches the reference."""
    inputs, ref = n11_batch
    out = run(impl, inputs)
    assert torch.isfinite(out).all(), "rows left unwritten (NaN) or non-finite"
    err = rel_l2_error(out, ref)
    assert err <= 1e-2, f"relative L2 error {err:.3g}"


# -- N14: degenerate metadata -----------------------------------------------------------------

def _degenerate(num_pages: int, max_pages: int, device) -> list:
    g = torch.Generator().manual_seed(14)
    q = torch.randn(3, 4, 32, generator=g).to(device)
    cache = torch.randn(num_pages, 8, 2, 32, generator=g).to(device)
    tables = torch.full((3, max_pages), -1, dtype=torch.int32, device=device)
    return [q, cache, cache.clone(), tables, torch.zeros(3, dtype=torch.int32, device=device)]


@pytest.mark.parametrize(("num_pages", "max_pages"), [(4, 0), (0, 2), (0, 0)],
                         ids=["zero-column-table", "zero-page-cache", "both"])
@pytest.mark.parametrize("impl", IMPLS)
def test_N14_all_lengths_zero_degenerate_metadata(impl, num_pages, max_pages, device):
    """The dummy batch of a graph warm-up: every length 0, with a zero-column block table
    and/or a zero-page cache. Zeros (from a NaN-poisoned ``out``), LSE -inf, no launch error."""
    inputs = _degenerate(num_pages, max_pages, device)
    for num_splits in ([None, 4] if impl in SPLIT_IMPLS else [None]):
        if impl == "auto":
            out, lse = run(impl, inputs, num_splits=num_splits, return_lse=True)
            assert torch.isneginf(lse).all()
        else:
            out = run(impl, inputs, num_splits=num_splits)
        assert (out == 0).all()
        assert torch.equal(out.double().cpu(), paged_decode_reference(*inputs).out.cpu())


# -- N15: huge equal values and extreme scales ------------------------------------------------

N15_VALUE = 133_120.0  # exact in bf16; q·k·scale about 2e11 at head_dim 128


def _all_equal_inputs(lens, heads, dim, device):
    hq, hkv = heads
    base = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                             page_size=16, dtype=BF16, seed=15, device=device)
    def fill(x):
        return torch.where(torch.isnan(x), x, torch.full_like(x, N15_VALUE))
    return base._replace(query=torch.full_like(base.query, N15_VALUE),
                         key_cache=fill(base.key_cache), value_cache=fill(base.value_cache))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", sizes(dict(lens=[1, 5, 0, 17], heads=(4, 2), dim=128),
                                       dict(lens=[1, 16, 100, 0, 1000], heads=(32, 8),
                                            dim=128)))
def test_N15_bf16_huge_equal_values(impl, size, device):
    """bf16 q = k = v = 133,120: every logit is about 2e11 and all are equal, so the output is
    V exactly (133,120; zero for an empty row). On the GPU ``baseline`` scaled each score
    after its reduction and the compiler fused that product into ``s - max`` (an FMA), giving
    ``exp2`` of the score's rounding error (~1e4): inf, then NaN. The interpreter never
    fuses; the GPU variant is the one that shows the fault."""
    inputs = _all_equal_inputs(size["lens"], size["heads"], size["dim"], device)
    for num_splits in ([None, 3] if impl in SPLIT_IMPLS else [None]):
        out = run(impl, inputs, num_splits=num_splits).cpu()
        nonempty = inputs.context_lens.cpu() > 0
        assert (out[nonempty] == N15_VALUE).all(), "not exactly V"
        assert (out[~nonempty] == 0).all()
        check(out, inputs)  # and the float64 oracle agrees


@pytest.mark.parametrize("scale", [0.0, -1.0, 30.0, 1e30], ids=["0", "-1", "30", "1e30"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", sizes(dict(lens=[1, 6, 23], heads=(4, 2), dim=64),
                                       dict(lens=[1, 300, 4000], heads=(32, 8), dim=128)))
def test_N15_fp32_extreme_scales(impl, scale, size, device):
    """fp32 with ``scale`` 0 (the mean of V), -1, 30 and 1e30 (the argmax): finite and within
    the fp32 tolerance of the float64 reference, also through the split merge."""
    hq, hkv = size["heads"]
    inputs = make_paged_inputs(size["lens"], num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=size["dim"], page_size=16, dtype=FP32, seed=16,
                               device=device)
    for num_splits in ([None, 2] if impl in SPLIT_IMPLS else [None]):
        check(run(impl, inputs, scale=scale, num_splits=num_splits), inputs, scale=scale)


# -- N16: out is the query itself -------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_N16_out_is_the_query(impl, device):
    """``out=query``: the query is read before any output is written, so the result in place
    equals the reference on the original query, with and without forced splits."""
    inputs = make_paged_inputs([5, 0, 40], num_q_heads=4, num_kv_heads=2, head_dim=32,
                               page_size=8, dtype=FP16, seed=16, device=device)
    for num_splits in ([None, 4] if impl in SPLIT_IMPLS else [None]):
        query = inputs.query.clone()
        result = pagedattn.paged_decode(query, *inputs[1:], impl=impl, out=query,
                                        num_splits=num_splits)
        assert result is query
        check(query, inputs)


@pytest.mark.parametrize("impl", ["auto", "split_kv_v4", "fused_v1"])
def test_N16_custom_op_result_written_over_the_query(impl, device):
    """Through the custom op ``torch.ops.pagedattn.paged_decode`` (functional): the result is
    a new tensor that does not alias the query, and writing it over the query is correct."""
    import pagedattn.serving.ops  # noqa: F401  (registers torch.ops.pagedattn)

    inputs = make_paged_inputs([5, 0, 40], num_q_heads=4, num_kv_heads=2, head_dim=32,
                               page_size=8, dtype=FP16, seed=161, device=device)
    query = inputs.query.clone()
    num_splits = 4 if impl in SPLIT_IMPLS else None
    result = torch.ops.pagedattn.paged_decode(query, *inputs[1:], None, impl, num_splits)
    assert result.data_ptr() != query.data_ptr()
    torch.testing.assert_close(query, inputs.query, rtol=0, atol=0)  # input untouched
    query.copy_(result)
    check(query, inputs)


# -- N19: device guard ------------------------------------------------------------------------

DECODE_TENSOR_ARGS = ["key_cache", "value_cache", "block_tables", "context_lens", "out",
                      "k_scale", "v_scale"]


@pytest.mark.parametrize("name", DECODE_TENSOR_ARGS)
def test_N19_decode_argument_on_another_device_names_it(name):
    """Every tensor argument off the query's device gives a ValueError naming it (a meta
    tensor stands in for a second device on the CPU; ``gpu2`` tests do cuda:0 vs cuda:1)."""
    inputs = make_paged_inputs([5, 9], num_q_heads=4, num_kv_heads=2, head_dim=32,
                               page_size=8, dtype=FP16)
    kw = dict(zip(["query", "key_cache", "value_cache", "block_tables", "context_lens"], inputs,
                  strict=True))
    kw["out"] = torch.empty_like(inputs.query)
    if name in ("k_scale", "v_scale"):
        kw["key_cache"] = inputs.key_cache.to(torch.float8_e4m3fn)
        kw["value_cache"] = inputs.value_cache.to(torch.float8_e4m3fn)
        kw[name] = torch.tensor(0.5)
    kw[name] = kw[name].to("meta")
    query = kw.pop("query")
    with pytest.raises(ValueError, match=rf"^{name}: .*device"):
        pagedattn.paged_decode(query, kw.pop("key_cache"), kw.pop("value_cache"),
                               kw.pop("block_tables"), kw.pop("context_lens"), **kw)


@pytest.mark.parametrize("name", ["value", "key_cache", "value_cache", "slot_mapping",
                                  "k_scale", "v_scale"])
def test_N19_append_kv_argument_on_another_device_names_it(name):
    from pagedattn.launch.append_kv import append_kv

    kw = dict(key=torch.randn(2, 2, 32), value=torch.randn(2, 2, 32),
              key_cache=torch.zeros(4, 8, 2, 32, dtype=torch.float8_e4m3fn),
              value_cache=torch.zeros(4, 8, 2, 32, dtype=torch.float8_e4m3fn),
              slot_mapping=torch.tensor([0, 9]), k_scale=torch.tensor(0.5),
              v_scale=torch.tensor(0.5))
    kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: .*device"):
        append_kv(**kw)


def _on_cuda1(inputs):
    return type(inputs)(*(t.to("cuda:1") for t in inputs))


@pytest.fixture
def current_device_0():
    """Current device 0 for the test (and checked to be 0 again after it)."""
    with torch.cuda.device(0):
        yield
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu2
@pytest.mark.parametrize("impl", IMPLS)
def test_N19_every_impl_on_cuda1_current_device_0(impl, current_device_0):
    """All tensors on cuda:1, current device 0: the launch runs on cuda:1 (device guard) and
    matches the reference; with forced splits too (the merge kernel), and the LSE for auto."""
    inputs = _on_cuda1(make_paged_inputs([1, 77, 300, 0], num_q_heads=32, num_kv_heads=8,
                                         head_dim=128, page_size=16, dtype=BF16, seed=19))
    for num_splits in ([None, 4] if impl in SPLIT_IMPLS else [None]):
        kw = {"return_lse": True} if impl == "auto" else {}
        result = run(impl, inputs, num_splits=num_splits, **kw)
        out = result.out if kw else result
        assert out.device == torch.device("cuda:1")
        ref = check(out, inputs)
        if kw:
            check_lse(result.lse, ref)


@pytest.mark.gpu2
def test_N19_fp8_hnd_on_cuda1(current_device_0):
    """The auto kernel's fp8 + HND path with tensor scales, all on cuda:1."""
    inputs = make_paged_inputs([33, 200], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, dtype=BF16, cache_dtype=torch.float8_e4m3fn,
                               kv_layout="HND", seed=191)
    inputs = _on_cuda1(inputs)
    k_scale = torch.tensor([0.5, 1.0], device="cuda:1")
    out = run("auto", inputs, kv_layout="HND", k_scale=k_scale, num_splits=2)
    check(out, inputs, dtype=torch.float8_e4m3fn, kv_layout="HND", k_scale=k_scale)


@pytest.mark.gpu2
@pytest.mark.parametrize("cache_dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_N19_append_kv_on_cuda1(cache_dtype, current_device_0):
    """append_kv with every tensor on cuda:1: the rows land in the cuda:1 caches (fp8:
    quantized as torch rounds ``x / scale``)."""
    from pagedattn.launch.append_kv import append_kv

    dev = torch.device("cuda:1")
    key = torch.randn(5, 2, 64, device=dev, dtype=BF16)
    value = torch.randn(5, 2, 64, device=dev, dtype=BF16)
    kc = torch.full((4, 8, 2, 64), NAN, device=dev).to(cache_dtype)
    vc = kc.clone()
    slots = torch.tensor([0, 9, -1, 31, 17], device=dev)
    scale = {"k_scale": 0.5, "v_scale": 2.0} if cache_dtype != BF16 else {}
    append_kv(key, value, kc, vc, slots, **scale)
    ks, vs = scale.get("k_scale", 1.0), scale.get("v_scale", 1.0)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        want_k = (key[i].float() / ks).to(cache_dtype)
        want_v = (value[i].float() / vs).to(cache_dtype)
        assert torch.equal(kc[s // 8, s % 8].float(), want_k.float())
        assert torch.equal(vc[s // 8, s % 8].float(), want_v.float())


@pytest.mark.gpu2
def test_N19_custom_ops_on_cuda1(current_device_0):
    """The custom ops (``torch.ops.pagedattn.*``) with every tensor on cuda:1."""
    import pagedattn.serving.ops  # noqa: F401  (registers torch.ops.pagedattn)

    inputs = _on_cuda1(make_paged_inputs([9, 40], num_q_heads=8, num_kv_heads=2, head_dim=64,
                                         page_size=16, dtype=BF16, seed=192))
    out = torch.ops.pagedattn.paged_decode(*inputs, None, "auto", 2)
    check(out, inputs)
    out, lse = torch.ops.pagedattn.paged_decode_lse(*inputs, None, "auto", None)
    check_lse(lse, check(out, inputs))
    kc = inputs.key_cache.clone()
    vc = inputs.value_cache.clone()
    new = torch.randn(2, 2, 64, device="cuda:1", dtype=BF16)
    slots = torch.tensor([3, -1], device="cuda:1")
    torch.ops.pagedattn.append_kv(new, new, kc, vc, slots, "NHD", None, None)
    assert torch.equal(kc[0, 3], new[0]) and torch.equal(vc[0, 3], new[0])


@pytest.mark.gpu2
@pytest.mark.parametrize("impl", IMPLS)
def test_N19_graph_capture_on_cuda1(impl, current_device_0):
    """CUDA-graph capture on a cuda:1 stream while the process's device is 0 outside it:
    eager warm-up (through the guard), capture, replay at new lengths; replay matches the
    reference and the current device stays 0."""
    dev = torch.device("cuda:1")
    # the table holds the replay's lengths; capture runs at shorter ones
    inputs = _on_cuda1(make_paged_inputs([100, 1, 128], num_q_heads=8, num_kv_heads=2,
                                         head_dim=128, page_size=16, dtype=BF16, seed=193))
    long_lens = inputs.context_lens.clone()
    inputs.context_lens.copy_(torch.tensor([16, 3, 40], dtype=torch.int32))
    out = torch.full_like(inputs.query, NAN)
    num_splits = 2 if impl in SPLIT_IMPLS else None

    def step():
        return pagedattn.paged_decode(*inputs, impl=impl, out=out, num_splits=num_splits)

    step()  # compile, current device 0
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    assert torch.cuda.current_device() == 0
    inputs.context_lens.copy_(long_lens)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize(dev)
    check(out, inputs)


@pytest.mark.gpu2
def test_N19_two_processes_nccl_graphs_all_gather(tmp_path):
    """Two processes (NCCL), each decoding on its own GPU under CUDA graphs for every impl,
    all-gather their outputs; rank 0 compares each rank's rows with a single-GPU run of the
    same inputs and with the reference. Runs ``n19_distributed.py`` with torchrun-free
    ``torch.multiprocessing.spawn``."""
    script = Path(__file__).parents[1] / "n19_distributed.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                         str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "N19 distributed: ok" in result.stdout
