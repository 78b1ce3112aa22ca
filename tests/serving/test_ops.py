"""torch.library integration: opcheck of the custom ops, fake-tensor shapes, trace-time
validation, and torch.compile(fullgraph=True) of a decode step (CPU: aot_eager backend, the
kernels still run through the interpreter; GPU: inductor)."""

import pytest
import torch

from pagedattn.reference import paged_decode_reference
from pagedattn.serving import ops
from pagedattn.serving.cache import PagedKVCache
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

# opcheck's checks: schema, fake tensors, AOT dispatch (static and dynamic shapes). Autograd
# registration is trivially satisfied (no input requires grad) and is skipped for time.
TEST_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_static",
              "test_aot_dispatch_dynamic")


def tiny_inputs(device, dtype=torch.float32, **kw):
    return make_paged_inputs([5, 0, 9], num_q_heads=4, num_kv_heads=2, head_dim=16,
                             page_size=4, dtype=dtype, device=device, **kw)


def test_ops_are_registered():
    for name in ("paged_decode", "paged_decode_lse", "append_kv"):
        assert hasattr(torch.ops.pagedattn, name)
    schema = str(torch.ops.pagedattn.append_kv.default._schema)
    assert "!) key_cache" in schema and "!) value_cache" in schema  # declared as mutated
    assert "!) key," not in schema and "!) slot_mapping" not in schema


def test_op_schemas_come_from_the_options():
    """The decode ops' schemas end with every field of ``pagedattn.options.DecodeOptions``,
    in field order, with its default and a type matching it (a new option needs no edit of
    ``serving/ops.py``)."""
    from pagedattn import options

    for op in (torch.ops.pagedattn.paged_decode, torch.ops.pagedattn.paged_decode_lse):
        args = op.default._schema.arguments
        tail = args[len(args) - len(options.OPTIONS):]
        assert [a.name for a in tail] == list(options.OPTIONS)
        for a in tail:
            assert a.default_value == options.DEFAULTS[a.name]
            assert str(a.type).replace("Optional[", "").rstrip("]").lower() in \
                options.OPTIONS[a.name].schema.lower()
        assert [a.name for a in args[:5]] == ["query", "key_cache", "value_cache",
                                              "block_tables", "context_lens"]


def test_opcheck_paged_decode(device):
    inp = tiny_inputs(device, poison=False)  # opcheck compares runs; NaN-free inputs
    torch.library.opcheck(torch.ops.pagedattn.paged_decode.default, tuple(inp),
                          {"impl": "auto"}, test_utils=TEST_UTILS)


def test_opcheck_paged_decode_lse_fp8(device):
    inp = tiny_inputs(device, cache_dtype=torch.float8_e4m3fn, poison=False)
    k_scale = torch.tensor(0.5, device=device)
    v_scale = torch.tensor([1.0, 0.25], device=device)
    torch.library.opcheck(torch.ops.pagedattn.paged_decode_lse.default, tuple(inp),
                          {"k_scale": k_scale, "v_scale": v_scale},
                          # test_schema's checker multiplies the inputs, which fp8 lacks on the
                          # CPU; the schema is the same as paged_decode's (checked above)
                          test_utils=("test_faketensor", "test_aot_dispatch_static"))


def test_opcheck_append_kv(device):
    key = torch.randn(3, 2, 16, device=device)
    value = torch.randn(3, 2, 16, device=device)
    kc = torch.zeros(4, 4, 2, 16, device=device)
    vc = torch.zeros(4, 4, 2, 16, device=device)
    slots = torch.tensor([1, -1, 13], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.pagedattn.append_kv.default, (key, value, kc, vc, slots),
                          test_utils=TEST_UTILS)


def test_wrappers_match_the_oracle_and_take_float_scales(device):
    inp = tiny_inputs(device, cache_dtype=torch.float8_e4m3fn)
    out, lse = ops.paged_decode(*inp, k_scale=0.5, v_scale=2.0, return_lse=True)
    ref = paged_decode_reference(*inp, k_scale=0.5, v_scale=2.0)
    assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float8_e4m3fn)
    assert lse.shape == (3, 4) and lse.dtype == torch.float32
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()
    plain = ops.paged_decode(*tiny_inputs(device))
    assert rel_l2_error(plain, paged_decode_reference(*tiny_inputs(device)).out) <= 1e-4


def test_fake_kernels_give_shapes_and_validate_at_trace_time(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    inp = tiny_inputs(device)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in inp]
        out = torch.ops.pagedattn.paged_decode(*fake)
        assert out.shape == inp.query.shape and out.dtype == inp.query.dtype
        out, lse = torch.ops.pagedattn.paged_decode_lse(*fake)
        assert lse.shape == inp.query.shape[:2] and lse.dtype == torch.float32
        with pytest.raises(TypeError, match="context_lens"):
            torch.ops.pagedattn.paged_decode(*fake[:4], fake[4].float())
        with pytest.raises(ValueError, match="slot_mapping"):
            torch.ops.pagedattn.append_kv(fake[1][:2, 0], fake[1][:2, 0], fake[1], fake[2],
                                          mode.from_tensor(torch.zeros(3, dtype=torch.int32)))


def _decode_step(query, key, value, cache: PagedKVCache, slot_mapping, block_tables,
                 context_lens):
    """The attention half of a decode step: append the new K/V, attend, a torch epilogue."""
    ops.append_kv(key, value, cache.key_cache(0), cache.value_cache(0), slot_mapping)
    out = ops.paged_decode(query, cache.key_cache(0), cache.value_cache(0), block_tables,
                           context_lens)
    return torch.nn.functional.silu(out) * 2


def _compile_case(device):
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 2, 16, num_pages=8, page_size=4, dtype=torch.float32, device=device)
    seqs = [0, 1, 2]
    for s, n in zip(seqs, (6, 1, 9), strict=True):
        cache.add_sequence(s)
        meta = cache.prepare_step([s], [n])
        k = torch.randn(n, 2, 16, generator=g).to(device)
        ops.append_kv(k, -k, cache.key_cache(0), cache.value_cache(0), meta.slot_mapping)
    meta = cache.prepare_step(seqs, [1, 1, 1])
    q = torch.randn(3, 4, 16, generator=g).to(device)
    k = torch.randn(3, 2, 16, generator=g).to(device)
    v = torch.randn(3, 2, 16, generator=g).to(device)
    return cache, (q, k, v, cache, meta.slot_mapping, meta.block_tables, meta.context_lens)


def _check_compiled(device, backend):
    torch._dynamo.reset()
    cache, args = _compile_case(device)
    snapshot = cache.kv.clone()
    eager = _decode_step(*args)
    eager_kv = cache.kv.clone()
    cache.kv.copy_(snapshot)
    compiled = torch.compile(_decode_step, fullgraph=True, backend=backend)
    got = compiled(*args)  # fullgraph=True: any graph break raises
    assert rel_l2_error(got, eager) <= 1e-6
    assert torch.equal(cache.kv, eager_kv)  # the cache mutation happened exactly once


def test_torch_compile_fullgraph_decode_step_cpu(device):
    if device != "cpu":
        pytest.skip("the GPU variant is test_torch_compile_fullgraph_decode_step_inductor")
    _check_compiled(device, "aot_eager")


@pytest.mark.gpu
def test_torch_compile_fullgraph_decode_step_inductor():
    _check_compiled("cuda", "inductor")


def test_torch_compile_fullgraph_model_decode_step(device):
    """A whole (tiny, random) Llama decode step traced with fullgraph=True equals eager, and
    the cache is written exactly once (aot_eager on the CPU, inductor on the GPU)."""
    from test_engine import tiny_model

    torch._dynamo.reset()
    model = tiny_model(device)
    cache = model.make_cache(16, page_size=4)
    for s, n in ((0, 5), (1, 11)):
        cache.add_sequence(s)
        meta = cache.prepare_step([s], [n])
        model.prefill(torch.randint(0, 97, (n,)).to(device), meta, cache)
    snapshot = cache.kv.clone()
    meta = cache.prepare_step([0, 1], [1, 1])
    tokens = torch.tensor([3, 7], device=device)
    eager = model.decode(tokens, meta, cache)
    eager_kv = cache.kv.clone()
    cache.kv.copy_(snapshot)
    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(model.decode, fullgraph=True, backend=backend)(tokens, meta, cache)
    assert rel_l2_error(got, eager) <= 1e-4
    assert rel_l2_error(cache.kv, eager_kv) <= 1e-5  # inductor may round K/V differently
    assert int((cache.kv != snapshot).sum()) == int((eager_kv != snapshot).sum())


@pytest.mark.parametrize("kw, exc, name", [
    (dict(k_scale=float("nan")), ValueError, "k_scale"),
    (dict(k_scale=0.0), ValueError, "k_scale"),
    (dict(k_scale=-2.0), ValueError, "k_scale"),
    (dict(k_scale=True), TypeError, "k_scale"),
    (dict(k_scale=1e300), ValueError, "k_scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(num_splits=True), TypeError, "num_splits"),
    (dict(batch_invariant=1), TypeError, "batch_invariant"),
])
def test_wrappers_check_the_callers_values_before_making_tensors(device, kw, exc, name):
    """The wrappers turned float scales into tensors before any check: a NaN scale gave NaN
    output, 0 ran, 1e300 raised a bare RuntimeError, and bools passed the op's schema. The
    eager API's errors come first now, as the module promises."""
    inp = tiny_inputs(device, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(exc, match=f"^{name}: expected"):
        ops.paged_decode(*inp, **kw)


@pytest.mark.parametrize("k_scale", [0.0, float("nan"), True])
def test_append_kv_wrapper_checks_float_scales(device, k_scale):
    """``ops.append_kv(..., k_scale=0.0)`` filled the cache with 448 (e4m3's saturation)."""
    kc = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn, device=device)
    vc = kc.clone()
    key = torch.randn(2, 2, 16, device=device)
    with pytest.raises((ValueError, TypeError), match="^k_scale: expected"):
        ops.append_kv(key, key, kc, vc, torch.tensor([0, 1], device=device), k_scale=k_scale)
    assert (kc.float() == 0).all()
