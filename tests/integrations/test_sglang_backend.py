"""pagedattn's SGLang attention backend (``pagedattn.integrations.sglang``) on stand-ins of
SGLang's objects: its layer (``RadixAttention``'s attributes), its batch (``ForwardBatch``'s
fields), its pools (``ReqToTokenPool.req_to_token``, ``MHATokenToKVPool`` / ``MLATokenToKVPool``
with their ``set_kv_buffer`` semantics: token slots, fp8 stored as bytes after dividing by the
layer's scale). SGLang 0.5.23 could not serve on this CPU (docs/compat.md, "SGLang").

Where SGLang is installed (``.venv-sglang``: ``pip install --no-deps sglang==0.5.23`` and its
Python dependencies), the backend runs over SGLang's own ``AttentionBackend`` (its
``forward`` dispatch), ``KVWriteLoc``, ``ForwardMode`` and registry, with only SGLang's
compiled kernel package ``sgl_kernel`` stubbed (its registry wheels are CUDA builds; SGLang's
KV pool module imports it); elsewhere those three classes and the registry are stand-ins too.

Every output is compared with the float64 oracle over each request's keys and values as
written, held apart from SGLang's pool (one dense page per request), so the backend's block
tables, offsets and views are checked, not assumed.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from dataclasses import dataclass
from enum import Enum

import pytest
import torch

import pagedattn
from pagedattn.integrations import sglang as plugin
from pagedattn.integrations.sglang.layer import (
    batch_tables,
    cache_views,
    layer_options,
    mla_options,
    query_starts,
)
from pagedattn.testing import rel_l2_error, tolerance_for

SGLANG = importlib.util.find_spec("sglang") is not None


class _CudaKernels(types.ModuleType):
    """``sgl_kernel`` where it cannot be installed: any kernel called raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel.{name}: a CUDA kernel, not on this machine")
        return kernel


if SGLANG and importlib.util.find_spec("sgl_kernel") is None:
    for _name in ("sgl_kernel", "sgl_kernel.kvcacheio", "sgl_kernel.elementwise"):
        sys.modules.setdefault(_name, _CudaKernels(_name))


# --- stand-ins of SGLang's objects ----------------------------------------------------------


class Mode(Enum):
    """SGLang's ``ForwardMode``, the predicates the backend asks."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5

    def is_extend(self):
        return self in (Mode.EXTEND, Mode.MIXED, Mode.TARGET_VERIFY)

    def is_decode(self):
        return self is Mode.DECODE

    def is_idle(self):
        return self is Mode.IDLE

    def is_target_verify(self):
        return self is Mode.TARGET_VERIFY

    def is_draft_extend(self):
        return False


if SGLANG:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc as SGLangWriteLoc
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as Mode  # noqa: F811


@dataclass
class WriteLoc:
    """SGLang's ``KVWriteLoc``: the batch's ``out_cache_loc``."""

    loc: torch.Tensor

    @classmethod
    def for_layer(cls, forward_batch, layer):
        return cls(forward_batch.out_cache_loc)


class AttentionBackendBase:
    """SGLang's ``AttentionBackend``: ``forward`` dispatches by the batch's mode."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


@pytest.fixture(scope="module")
def backend_cls():
    """The backend class, imported over SGLang's modules, or over stand-ins of the two names
    it imports where SGLang is not installed (removed again afterwards)."""
    added = []
    if not SGLANG:
        for name, attrs in (
                ("sglang", {}), ("sglang.srt", {}), ("sglang.srt.layers", {}),
                ("sglang.srt.layers.attention", {}),
                ("sglang.srt.layers.attention.base_attn_backend",
                 {"AttentionBackend": AttentionBackendBase}),
                ("sglang.srt.mem_cache", {}),
                ("sglang.srt.mem_cache.memory_pool", {"KVWriteLoc": WriteLoc})):
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
            added.append(name)
    sys.modules.pop("pagedattn.integrations.sglang.backend", None)
    from pagedattn.integrations.sglang.backend import PagedAttnSGLangBackend

    yield PagedAttnSGLangBackend
    for name in added:
        del sys.modules[name]
    sys.modules.pop("pagedattn.integrations.sglang.backend", None)


@dataclass
class Layer:
    """SGLang's ``RadixAttention``: the attributes the backend reads."""

    tp_q_head_num: int = 4
    tp_k_head_num: int = 2
    qk_head_dim: int = 32
    v_head_dim: int = 32
    scaling: float = 0.2
    layer_id: int = 0
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    attn_type: str = "decoder"
    use_irope: bool = False
    pos_encoding_mode: str = "NONE"
    logit_capping_method: str = "tanh"
    xai_temperature_len: int = -1
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_scale_float: float | None = None
    v_scale_float: float | None = None


class MHAPool:
    """SGLang's ``MHATokenToKVPool``: per layer ``[slots, kv_heads, head_dim]`` buffers (slot
    0 to ``page_size - 1`` padding), fp8 stored as bytes; ``set_kv_buffer`` divides by the
    scale it is given when the dtypes differ, as SGLang's does."""

    def __init__(self, slots, page_size, dtype, heads, dim, layers=1):
        self.page_size, self.dtype = page_size, dtype
        self.store_dtype = torch.uint8 if dtype.itemsize == 1 else dtype
        nan = torch.full((slots + page_size, heads, dim), float("nan")).to(dtype)
        self.k_buffer = [nan.view(self.store_dtype).clone() for _ in range(layers)]
        self.v_buffer = [nan.view(self.store_dtype).clone() for _ in range(layers)]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None):
        if cache_k.dtype != self.dtype:
            cache_k = (cache_k / k_scale if k_scale is not None else cache_k).to(self.dtype)
            cache_v = (cache_v / v_scale if v_scale is not None else cache_v).to(self.dtype)
        self.k_buffer[layer.layer_id][loc_info.loc] = cache_k.view(self.store_dtype)
        self.v_buffer[layer.layer_id][loc_info.loc] = cache_v.view(self.store_dtype)

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id].view(self.dtype)

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id].view(self.dtype)


class MLAPool:
    """SGLang's ``MLATokenToKVPool``: per layer ``[slots, 1, kv_lora_rank + rope]``."""

    def __init__(self, slots, page_size, dtype, kv_lora_rank, rope):
        self.page_size, self.dtype = page_size, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, rope
        self.kv_buffer = [torch.full((slots + page_size, 1, kv_lora_rank + rope), float("nan"),
                                     dtype=dtype)]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
        self.kv_buffer[layer.layer_id][loc_info.loc] = cache_k.to(self.dtype)

    def set_mla_kv_buffer(self, layer, loc_info, k_nope, k_rope):
        rows = torch.cat([k_nope, k_rope], dim=-1)
        self.kv_buffer[layer.layer_id][loc_info.loc] = rows.to(self.dtype)

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]


@dataclass
class Batch:
    """SGLang's ``ForwardBatch``: the fields the backend reads."""

    forward_mode: Mode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    encoder_lens: torch.Tensor | None = None
    out_cache_loc_is_physical: bool = False


class Runner:
    """SGLang's ``ModelRunner``: the pools, the page size, the dtype, MLA or not."""

    def __init__(self, pool, req_to_token, page_size, dtype, use_mla=False):
        self.device = torch.device("cpu")
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
        self.token_to_kv_pool, self.page_size, self.dtype = pool, page_size, dtype
        self.use_mla_backend = use_mla


class Scene:
    """A batch of requests over SGLang's pools: each request's earlier tokens already in the
    pool (written through ``set_kv_buffer`` too), the new ones to come. Pages are shuffled
    and requests sit at shuffled rows of ``req_to_token``; every request's keys and values
    are also kept apart, dense, for the oracle."""

    def __init__(self, prefix_lens, new_lens, *, page_size, heads=(4, 2), dim=32,
                 dtype=torch.float32, kv_dtype=None, seed=0, mla=None, scales=(None, None),
                 capacity=None):
        g = torch.Generator().manual_seed(seed)
        self.g, self.page_size, self.dtype = g, page_size, dtype
        self.prefix, self.new = list(prefix_lens), list(new_lens)
        self.lens = [p + n for p, n in zip(self.prefix, self.new, strict=True)]
        batch, max_len = len(self.lens), max(self.lens)
        pages_needed = [-(-n // page_size) for n in self.lens]
        num_pages = sum(pages_needed) + 3
        num_rows, width = batch + 3, -(-max_len // page_size) * page_size + 8
        if capacity is not None:  # (rows, token slots a row, pages): pools of a fixed size
            num_rows, width, num_pages = capacity
        order = (torch.randperm(num_pages, generator=g) + 1).tolist()  # page 0: padding
        self.req_to_token = torch.full((num_rows, width), -(10**6), dtype=torch.int32)
        self.rows = torch.randperm(num_rows, generator=g)[:batch]
        for b, n in enumerate(pages_needed):
            pages = torch.tensor([order.pop() for _ in range(n)])
            slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
            self.req_to_token[self.rows[b], :slots.numel()] = slots.int()
        slots = (num_pages + 1) * page_size - page_size
        kv_dtype = kv_dtype or dtype
        self.mla = mla
        if mla is None:
            hq, hkv = heads
            self.layer = Layer(tp_q_head_num=hq, tp_k_head_num=hkv, qk_head_dim=dim,
                               v_head_dim=dim, scaling=dim ** -0.5, k_scale=scales[0],
                               v_scale=scales[1])
            self.pool = MHAPool(slots, page_size, kv_dtype, hkv, dim)
            self.k = [torch.randn(n, hkv, dim, generator=g).to(dtype) for n in self.lens]
            self.v = [torch.randn(n, hkv, dim, generator=g).to(dtype) for n in self.lens]
        else:
            latent, rope, hq = mla
            self.layer = Layer(tp_q_head_num=hq, tp_k_head_num=1, qk_head_dim=latent + rope,
                               v_head_dim=latent, scaling=(128 + rope) ** -0.5)
            self.pool = MLAPool(slots, page_size, kv_dtype, latent, rope)
            self.k = [torch.randn(n, 1, latent + rope, generator=g).to(dtype)
                      for n in self.lens]
        self.runner = Runner(self.pool, self.req_to_token, page_size, dtype,
                             use_mla=mla is not None)
        if any(self.prefix):  # the earlier steps' writes
            self._write(lambda b: range(self.prefix[b]))

    def slots(self, b, positions):
        return self.req_to_token[self.rows[b], list(positions)].long()

    def _write(self, which):
        for b in range(len(self.lens)):
            pos = list(which(b))
            if pos:
                loc = (SGLangWriteLoc if SGLANG else WriteLoc)(self.slots(b, pos))
                if self.mla is None:
                    self.pool.set_kv_buffer(self.layer, loc, self.k[b][pos].clone(),
                                            self.v[b][pos].clone(), self.layer.k_scale,
                                            self.layer.v_scale)
                else:
                    self.pool.set_kv_buffer(self.layer, loc, self.k[b][pos], None)

    def batch(self, mode):
        new = [list(range(p, p + n)) for p, n in zip(self.prefix, self.new, strict=True)]
        lens = torch.tensor(self.lens, dtype=torch.int64)
        extend = None if mode is Mode.DECODE else torch.tensor(self.new, dtype=torch.int32)
        return Batch(forward_mode=mode, batch_size=len(self.lens),
                     req_pool_indices=self.rows.clone(), seq_lens=lens, seq_lens_cpu=lens,
                     out_cache_loc=torch.cat([self.slots(b, p) for b, p in enumerate(new)]),
                     extend_seq_lens=extend,
                     extend_seq_lens_cpu=None if extend is None else list(self.new))

    def new_kv(self):
        k = torch.cat([kb[p:] for kb, p in zip(self.k, self.prefix, strict=True)])
        if self.mla is not None:
            return k, None
        return k, torch.cat([vb[p:] for vb, p in zip(self.v, self.prefix, strict=True)])

    def dense(self, x, fp8):
        """Request ``b``'s keys or values as the kernels read them (through the pool's
        dtype and scale), one page per request, padded with NaN."""
        width = max(self.lens)
        out = torch.full((len(self.lens), width, *x[0].shape[1:]), float("nan"),
                         dtype=torch.float64)
        for b, t in enumerate(x):
            out[b, :t.shape[0]] = t.double() if fp8 is None else fp8(t)
        return out


def run(backend_cls, scene, mode, q, **kwargs):
    backend = backend_cls(scene.runner)
    fb = scene.batch(mode)
    backend.init_forward_metadata(fb)
    k, v = scene.new_kv()
    out = backend.forward(q, k.clone(), None if v is None else v.clone(), scene.layer, fb,
                          **kwargs)
    return backend, out


def check_mha(scene, q, out, *, window_left=-1, cap=None, sinks=None, fp8=None, scales=(1, 1)):
    hq, dim = scene.layer.tp_q_head_num, scene.layer.qk_head_dim
    assert out.shape == (q.shape[0], hq * dim) and out.dtype == scene.dtype

    def through(scale):
        return None if fp8 is None else (
            lambda t: ((t / scale).to(fp8).double() * scale))

    keys = scene.dense(scene.k, through(scales[0]))
    values = scene.dense(scene.v, through(scales[1]))
    tables = torch.arange(len(scene.lens), dtype=torch.int32)[:, None]
    qsl = query_starts(torch.tensor(scene.new), len(scene.lens), torch.device("cpu"))
    ref = pagedattn.paged_attention_reference(
        q.view(-1, hq, dim), keys, values, tables, torch.tensor(scene.lens), qsl,
        scale=scene.layer.scaling, window_left=window_left, logits_soft_cap=cap, sinks=sinks)
    err = rel_l2_error(out.view(-1, hq, dim), ref.out)
    assert err <= tolerance_for(fp8 or scene.dtype), err


def check_mla(scene, q, out):
    """``out`` ``[batch, heads * latent]`` against the float64 MLA oracle; ``q`` is
    ``[batch, heads, latent + rope]``."""
    latent_dim, _, hq = scene.mla
    assert out.shape == (q.shape[0], hq * latent_dim) and out.dtype == scene.dtype
    latent = scene.dense(scene.k, None)[:, :, 0]
    ref = pagedattn.reference.mla_decode_reference(
        q[..., :latent_dim], q[..., latent_dim:], latent[..., :latent_dim],
        latent[..., latent_dim:], torch.arange(len(scene.lens), dtype=torch.int32)[:, None],
        torch.tensor(scene.lens), scale=scene.layer.scaling)
    err = rel_l2_error(out.view(-1, hq, latent_dim), ref.out)
    assert err <= tolerance_for(scene.dtype), err


# --- the pure mapping ------------------------------------------------------------------------


def test_layer_attributes_map_to_pagedattns():
    opts = layer_options(Layer(sliding_window_size=63, logit_cap=30.0), torch.bfloat16,
                         torch.float8_e4m3fn)
    assert (opts.num_q_heads, opts.num_kv_heads, opts.head_dim, opts.scale) == (4, 2, 32, 0.2)
    assert opts.window_left == 63 and opts.logits_soft_cap == 30.0 and opts.fp8
    plain = layer_options(Layer(), torch.float32, torch.float32)
    assert plain.variant == (-1, None) and not plain.fp8
    mla = mla_options(Layer(tp_q_head_num=16, tp_k_head_num=1, qk_head_dim=576, v_head_dim=512),
                      512, 64, torch.bfloat16, torch.bfloat16)
    assert (mla.num_q_heads, mla.latent_dim, mla.rope_dim) == (16, 512, 64)


REFUSED = [
    (dict(is_cross_attention=True), ValueError, "is_cross_attention"),
    (dict(attn_type="encoder_only"), ValueError, "attn_type"),
    (dict(use_irope=True), ValueError, "use_irope"),
    (dict(pos_encoding_mode="ALIBI"), ValueError, "pos_encoding_mode"),
    (dict(xai_temperature_len=8), ValueError, "xai_temperature_len"),
    (dict(logit_capping_method="other"), ValueError, "logit_capping_method"),
    (dict(qk_head_dim=8, v_head_dim=8), ValueError, "qk_head_dim"),
    (dict(v_head_dim=64), ValueError, "v_head_dim"),
    (dict(tp_k_head_num=3), ValueError, "tp_k_head_num"),
    (dict(scaling=1e39), ValueError, "scaling"),  # the kernels' limit (issue 64)
    (dict(scaling=float("nan")), ValueError, "scaling"),
    (dict(logit_cap=1e-45), ValueError, "logit_cap"),
    (dict(logit_cap=-2.0), ValueError, "logit_cap"),
    (dict(sliding_window_size=-2), ValueError, "sliding_window_size"),
]


@pytest.mark.parametrize("change,exc,name", REFUSED,
                         ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(REFUSED)])
def test_what_the_backend_does_not_run_is_refused_by_name(change, exc, name):
    with pytest.raises(exc, match=f"pagedattn's SGLang attention backend: {name}: expected"):
        layer_options(Layer(**change), torch.float32, torch.float32)


def test_a_pool_of_another_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype: expected"):
        layer_options(Layer(), torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="qk_head_dim, v_head_dim, tp_k_head_num: expected"):
        mla_options(Layer(), 512, 64, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("page_size", [1, 4])
def test_block_tables_come_from_req_to_token(page_size):
    scene = Scene([5, 0, 9], [1, 3, 2], page_size=page_size)
    tables = batch_tables(scene.req_to_token, scene.rows, max(scene.lens), page_size)
    assert tables.dtype == torch.int32
    for b, n in enumerate(scene.lens):
        for p in range(n):  # position p lives in page tables[b, p // P] at offset p % P
            assert int(tables[b, p // page_size]) * page_size + p % page_size == int(
                scene.req_to_token[scene.rows[b], p])
    key_cache, _, layout = cache_views(scene.pool.get_key_buffer(0),
                                       scene.pool.get_value_buffer(0), page_size)
    assert layout == "NHD" and key_cache.shape[1:] == (page_size, 2, 32)
    assert key_cache.data_ptr() == scene.pool.k_buffer[0].data_ptr()


# --- the backend on stand-ins, against the oracle -------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(backend_cls, page_size):
    scene = Scene([7, 40, 0, 130], [1, 1, 1, 1], page_size=page_size)
    q = torch.randn(4, 4 * 32, generator=scene.g)
    backend, out = run(backend_cls, scene, Mode.DECODE, q)
    check_mha(scene, q, out)
    step = next(iter(backend.forward_metadata.plans.values()))
    assert step.decode is not None and step.varlen is None  # pagedattn's decode plan


@pytest.mark.parametrize("page_size", [1, 8])
def test_extend_mixes_prompts_chunks_and_decodes(backend_cls, page_size):
    """A prompt, a chunk over a cached prefix, a decode in the extend batch (SGLang's mixed
    chunked prefill), an empty extend: one varlen plan, the leading decode through the
    decode plan."""
    scene = Scene([0, 20, 33, 5], [9, 12, 1, 4], page_size=page_size)
    q = torch.randn(sum(scene.new), 4 * 32, generator=scene.g)
    _, out = run(backend_cls, scene, Mode.EXTEND, q)
    check_mha(scene, q, out)


def test_gqa_window_softcap_and_sinks(backend_cls):
    scene = Scene([3, 50], [1, 6], page_size=1, heads=(8, 2))
    scene.layer.sliding_window_size, scene.layer.logit_cap = 16, 5.0
    sinks = torch.linspace(-1, 2, 8)
    q = torch.randn(sum(scene.new), 8 * 32, generator=scene.g)
    _, out = run(backend_cls, scene, Mode.MIXED, q, sinks=sinks)
    check_mha(scene, q, out, window_left=16, cap=5.0, sinks=sinks)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_with_the_layers_scales(backend_cls, fp8):
    scales = (torch.tensor(0.5), torch.tensor(2.0))
    scene = Scene([12, 30], [4, 1], page_size=4, dtype=torch.bfloat16, kv_dtype=fp8,
                  scales=scales)
    q = torch.randn(5, 4 * 32, generator=scene.g).bfloat16()
    _, out = run(backend_cls, scene, Mode.EXTEND, q)
    check_mha(scene, q, out, fp8=fp8, scales=(0.5, 2.0))


@pytest.mark.parametrize("split_rope", [False, True])
def test_mla_decode_of_a_deepseek_shaped_model(backend_cls, split_rope):
    """DeepSeek's absorbed MLA (kv_lora_rank 512, rope 64; 16 heads as at TP 8): the query
    and key as one ``[..., 576]`` row, or with ``q_rope`` / ``k_rope`` apart."""
    scene = Scene([10, 70, 0], [1, 1, 1], page_size=1, mla=(512, 64, 16),
                  dtype=torch.bfloat16)
    q = torch.randn(3, 16, 576, generator=scene.g).bfloat16()
    backend = backend_cls(scene.runner)
    fb = scene.batch(Mode.DECODE)
    backend.init_forward_metadata(fb)
    k, _ = scene.new_kv()
    if split_rope:
        out = backend.forward(q[..., :512].reshape(3, -1), k[..., :512], None, scene.layer, fb,
                              q_rope=q[..., 512:].reshape(3, -1), k_rope=k[..., 512:])
    else:
        out = backend.forward(q.reshape(3, -1), k, None, scene.layer, fb)
    check_mla(scene, q, out)


def test_what_the_backend_refuses_at_run(backend_cls):
    scene = Scene([4], [2], page_size=1, mla=(512, 64, 16), dtype=torch.bfloat16)
    backend = backend_cls(scene.runner)
    fb = scene.batch(Mode.EXTEND)
    backend.init_forward_metadata(fb)
    q = torch.randn(2, 16 * 576).bfloat16()
    with pytest.raises(ValueError, match="forward_extend: expected decode batches only"):
        backend.forward(q, scene.new_kv()[0], None, scene.layer, fb)
    with pytest.raises(ValueError, match="forward_mode: expected a decode or extend batch"):
        backend.init_forward_metadata(scene.batch(Mode.TARGET_VERIFY))
    mha = Scene([4], [1], page_size=1)
    backend = backend_cls(mha.runner)
    fb = mha.batch(Mode.DECODE)
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="window: expected no such argument"):
        backend.forward(torch.randn(1, 128), *mha.new_kv(), mha.layer, fb, window=3)


# --- CUDA graphs: SGLang's decode graph runner, its capture and its replays ------------------


class GraphRunner:
    """SGLang 0.5.23's decode graph runner (``DecodeCudaGraphRunner``) as the backend meets
    it: static input buffers (``req_pool_indices`` zeros, ``seq_lens`` the backend's fill
    value, ``out_cache_loc``), ``init_cuda_graph_state``, a capture of one batch size (the
    out-graph hook with ``in_capture=True``, the in-graph hook, the forward over the static
    tensors) and replays: this step's batch written into the buffers in place, padding rows
    after it, the replay view (``build_replay_fb_view``'s fields), the out-graph hook, and the
    captured forward again. The CPU has no graphs: a replay calls the capture's forward again
    with the capture's objects, and anything planned then fails the test (a graph replays
    the captured launches: it cannot plan)."""

    def __init__(self, backend_cls, base: Scene, max_bs: int, bs: int):
        self.base, self.bs = base, bs
        base.req_to_token.zero_()  # SGLang captures before any request: every row slot 0
        self.backend = backend_cls(base.runner)
        self.backend.init_cuda_graph_state(max_bs, max_bs)
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        self.seq_lens = torch.full((max_bs,), fill, dtype=torch.int64)
        self.seq_lens_cpu = self.seq_lens.clone()
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64)
        layer = base.layer
        if base.mla is None:
            width = layer.tp_q_head_num * layer.qk_head_dim
            self.k = torch.zeros(max_bs, layer.tp_k_head_num, layer.qk_head_dim)
            self.v = torch.zeros_like(self.k)
        else:
            width = layer.tp_q_head_num * layer.qk_head_dim
            self.k, self.v = torch.zeros(max_bs, 1, layer.qk_head_dim), None
        self.q = torch.zeros(max_bs, width, dtype=base.dtype)
        self.k = self.k.to(base.dtype)
        self.v = None if self.v is None else self.v.to(base.dtype)
        fb = self.view()
        self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self.backend.init_forward_metadata_in_graph(fb)
        self.captured = self.backend.forward_metadata
        self.graph = lambda: self.backend.forward(  # the captured forward
            self.q[:bs], self.k[:bs], None if self.v is None else self.v[:bs], layer, fb)
        self.out = self.graph()
        assert self.captured.plans  # planned at capture, once

    def view(self):
        bs = self.bs
        return types.SimpleNamespace(
            batch_size=bs, forward_mode=Mode.DECODE, req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=self.seq_lens_cpu[:bs],
            out_cache_loc=self.out_cache_loc[:bs], encoder_lens=None, spec_info=None)

    def replay(self, scene: Scene, q: torch.Tensor, monkeypatch) -> torch.Tensor:
        """``scene``'s decode step (its requests' earlier tokens and pages copied into the
        base scene's pools and ``req_to_token``, in place) through the graph: its first
        ``len(scene.lens)`` output rows."""
        base, n = self.base, len(scene.lens)
        base.req_to_token.copy_(scene.req_to_token)
        idle = torch.ones(base.req_to_token.shape[0], dtype=torch.bool)
        idle[scene.rows] = False
        base.req_to_token[idle] = 0  # SGLang's rows start zeroed: slot 0 (padding)
        for name in ("k_buffer", "v_buffer", "kv_buffer"):
            for dst, src in zip(getattr(base.pool, name, []), getattr(scene.pool, name, []),
                                strict=True):
                dst.copy_(src)
        fb = scene.batch(Mode.DECODE)
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        for buf, value, pad in ((self.req_pool_indices, fb.req_pool_indices, 0),
                                (self.seq_lens, fb.seq_lens, fill),
                                (self.seq_lens_cpu, fb.seq_lens_cpu, fill),
                                (self.out_cache_loc, fb.out_cache_loc, 0)):
            buf[:n] = value
            buf[n:] = pad
        k, v = scene.new_kv()
        self.q[:n], self.q[n:] = q.reshape(n, -1), 0
        self.k[:n], self.k[n:] = k, 0
        if v is not None:
            self.v[:n], self.v[n:] = v, 0
        self.backend.init_forward_metadata_out_graph(self.view())
        assert self.backend.forward_metadata is self.captured
        backend_module = sys.modules["pagedattn.integrations.sglang.backend"]
        with monkeypatch.context() as m:
            for module, name in ((backend_module, "plan_step"), (pagedattn, "plan_mla_decode")):
                m.setattr(module, name, lambda *a, **k: pytest.fail("planned at replay"))
            out = self.graph()
        return out[:n]


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_replays_read_the_metadata_written_in_place(backend_cls, page_size,
                                                               monkeypatch):
    """GQA decode captured at batch size 4, replayed for three steps of other lengths, pages
    and requests (3 of them, then 4, then 2: padding rows after them): each as the eager
    path gives and as the oracle says."""
    cap = (8, 160, 400 if page_size == 1 else 26)  # rows, token slots a row, pages
    base = Scene([5, 9, 2, 4], [1] * 4, page_size=page_size, heads=(8, 2), capacity=cap)
    runner = GraphRunner(backend_cls, base, max_bs=6, bs=4)
    for seed, prefix in enumerate(([30, 0, 140], [3, 77, 12, 1], [150, 64]), start=1):
        scene = Scene(prefix, [1] * len(prefix), page_size=page_size, heads=(8, 2),
                      capacity=cap, seed=seed)
        q = torch.randn(len(prefix), 8 * 32, generator=scene.g)
        out = runner.replay(scene, q, monkeypatch)
        check_mha(scene, q, out)
        _, eager = run(backend_cls, scene, Mode.DECODE, q)
        assert rel_l2_error(out, eager) <= tolerance_for(torch.float32)


def test_cuda_graph_replays_of_mla_decode(backend_cls, monkeypatch):
    """Absorbed-MLA decode (a small latent: 64 + 16, 4 heads, bf16) captured at batch size
    3 and replayed for two steps of other lengths and pages."""
    mla, cap = (64, 16, 4), (6, 96, 200)
    base = Scene([1, 2, 3], [1] * 3, page_size=1, mla=mla, dtype=torch.bfloat16,
                 capacity=cap)
    runner = GraphRunner(backend_cls, base, max_bs=3, bs=3)
    for seed, prefix in enumerate(([40, 7], [0, 90, 25]), start=1):
        scene = Scene(prefix, [1] * len(prefix), page_size=1, mla=mla, dtype=torch.bfloat16,
                      capacity=cap, seed=seed)
        q = torch.randn(len(prefix), 4, 80, generator=scene.g).bfloat16()
        out = runner.replay(scene, q, monkeypatch)
        check_mla(scene, q, out)
        _, eager = run(backend_cls, scene, Mode.DECODE, q.reshape(len(prefix), -1))
        assert rel_l2_error(out, eager) <= tolerance_for(torch.bfloat16)


def test_cuda_graph_sizes_and_modes_are_checked_by_name(backend_cls):
    scene = Scene([4, 6], [1, 1], page_size=4)
    backend = backend_cls(scene.runner)
    view = types.SimpleNamespace(batch_size=2, forward_mode=Mode.DECODE,
                                 req_pool_indices=scene.rows, seq_lens=torch.tensor([5, 7]),
                                 seq_lens_cpu=torch.tensor([5, 7]), encoder_lens=None,
                                 spec_info=None)
    with pytest.raises(ValueError, match="init_cuda_graph_state: expected a call before"):
        backend.init_forward_metadata_out_graph(view, in_capture=True)
    with pytest.raises(ValueError, match="max_bs: expected an int >= 1"):
        backend.init_cuda_graph_state(0, 8)
    with pytest.raises(TypeError, match="max_num_tokens: expected an int"):
        backend.init_cuda_graph_state(2, 2.0)
    backend.init_cuda_graph_state(2, 2)
    assert backend.graph.block_table.shape == (2, -(-scene.req_to_token.shape[1] // 4))
    with pytest.raises(ValueError, match="batch_size: expected a captured batch size"):
        backend.init_forward_metadata_out_graph(view)  # a replay before its capture
    view.batch_size = 3
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[1, max_bs=2\]"):
        backend.init_forward_metadata_out_graph(view, in_capture=True)
    view.batch_size, view.forward_mode = 2, Mode.EXTEND
    with pytest.raises(ValueError, match="forward_mode: expected a decode graph"):
        backend.init_forward_metadata_out_graph(view, in_capture=True)
    view.forward_mode, view.spec_info = Mode.DECODE, object()
    with pytest.raises(ValueError, match="spec_info: expected None"):
        backend.init_forward_metadata_out_graph(view, in_capture=True)
    view.spec_info, view.seq_lens_cpu = None, torch.tensor([5, 10**4])
    with pytest.raises(ValueError, match="seq_lens: expected lengths within req_to_token's"):
        backend.init_forward_metadata_out_graph(view, in_capture=True)


# --- registration ----------------------------------------------------------------------------


@pytest.mark.skipif(not SGLANG, reason="SGLang is not installed")
def test_register_in_sglangs_own_registry():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    plugin.register()
    assert ATTENTION_BACKENDS["pagedattn"] is plugin.create_backend
    assert ATTENTION_BACKEND_CHOICES.count("pagedattn") == 1


@pytest.fixture
def fake_sglang(monkeypatch):
    """SGLang's registry and choices (stand-ins), at version 0.5.23 unless changed."""
    registry, choices = {}, ["triton", "torch_native"]

    def register_attention_backend(name):
        def decorator(fn):
            registry[name] = fn
            return fn
        return decorator

    modules = {
        "sglang": types.SimpleNamespace(__version__="0.5.23"),
        "sglang.srt.arg_groups.choices": types.SimpleNamespace(
            ATTENTION_BACKEND_CHOICES=choices, add_attention_backend_choices=choices.extend),
        "sglang.srt.layers.attention.attention_registry": types.SimpleNamespace(
            ATTENTION_BACKENDS=registry, register_attention_backend=register_attention_backend),
    }
    for name in ("sglang.srt", "sglang.srt.arg_groups", "sglang.srt.layers",
                 "sglang.srt.layers.attention"):
        modules[name] = types.ModuleType(name)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["sglang"], registry, choices


@pytest.mark.skipif(SGLANG, reason="stands in for SGLang's registry")
def test_register_adds_the_name_once(fake_sglang):
    _, registry, choices = fake_sglang
    plugin.register()
    plugin.register()
    assert registry == {"pagedattn": plugin.create_backend}
    assert choices.count("pagedattn") == 1


@pytest.mark.skipif(SGLANG, reason="stands in for SGLang's registry")
def test_another_version_is_refused_by_name(fake_sglang, caplog):
    sglang, registry, choices = fake_sglang
    sglang.__version__ = "0.5.30"
    with caplog.at_level(logging.WARNING, logger="sglang.plugins.pagedattn"):
        plugin.register()
    assert not registry and "pagedattn" not in choices
    assert "supports SGLang 0.5.23, not SGLang 0.5.30" in caplog.text


def test_versions_and_the_entry_point():
    assert plugin.version_key("0.5.23") == (0, 5, 23) == plugin.version_key("0.5.23.post1")
    assert plugin.version_key("0.5.23+cpu") == (0, 5, 23) and plugin.version_key("x") is None
    assert plugin.supported("0.5.23") and not plugin.supported("0.5.22")
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["sglang.srt.plugins"]["pagedattn"] == (
        "pagedattn.integrations.sglang:register")
