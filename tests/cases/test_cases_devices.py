"""Case N19 of the second series of cases (public bug reports): the device guard. Every
tensor argument on another device is named before any launch; every impl, the custom ops,
``append_kv`` and CUDA-graph capture run on ``cuda:1`` while device 0 is current (``gpu2``);
two processes all-gather through NCCL inside graphs (``n19_distributed.py``). Outputs are
NaN-poisoned before every call and compared with the float64 reference.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hardening import IMPLS, NAN, SPLIT_IMPLS, check, check_lse, run

import pagedattn
from pagedattn.testing import make_paged_inputs

FP16, BF16 = torch.float16, torch.bfloat16

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
