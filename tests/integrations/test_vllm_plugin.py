"""pagedattn's vLLM plugin without vLLM: the pure-Python parts (``pagedattn.integrations.vllm``'s
``layer``, ``step`` and the registration decision) on fakes of what vLLM hands the backend,
against the float64 oracle. The same backend inside vLLM: ``test_vllm_backend.py``."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pagedattn
from pagedattn.integrations import vllm as plugin
from pagedattn.integrations.layer import LayerOptions
from pagedattn.integrations.step import PlanCache, num_decodes, plan_step, run_step
from pagedattn.integrations.vllm.layer import (
    cache_layout,
    config_refusals,
    layer_options,
    split_kv_cache,
)
from pagedattn.testing import rel_l2_error, tolerance_for

ROOT = Path(__file__).resolve().parents[2]
H, HKV, D, N = 4, 2, 32, 8  # query heads, kv heads, head_size, block_size


# --- the layer's arguments -----------------------------------------------------------------


def test_layer_arguments_map_to_pagedattns():
    opts = layer_options(8, 64, 0.125, 2, [0.5] * 8, 4096, "auto", 30.0, "decoder", None,
                         sinks=torch.zeros(8), model_dtype=torch.bfloat16)
    assert (opts.num_q_heads, opts.num_kv_heads, opts.head_dim, opts.scale) == (8, 2, 64, 0.125)
    assert opts.window_left == 4095  # vLLM's window counts the token itself
    assert opts.logits_soft_cap == 30.0 and opts.variant == (4095, 30.0)
    assert opts.alibi_slopes.dtype == torch.float32 and opts.alibi_slopes.shape == (8,)
    assert opts.q_dtype == opts.kv_dtype == torch.bfloat16 and not opts.fp8
    plain = layer_options(4, 32, 0.2, model_dtype=torch.float32, logits_soft_cap=0)
    assert plain.variant == (-1, None) and plain.num_kv_heads == 4 and plain.alibi_slopes is None
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("fp8_e5m2", torch.float8_e5m2), ("bfloat16", torch.bfloat16)):
        opts = layer_options(4, 32, 1.0, 2, kv_cache_dtype=name, model_dtype=torch.bfloat16)
        assert opts.kv_dtype == dtype and opts.fp8 == (name != "bfloat16")


class _Str(str):
    """vLLM's AttentionType: a str enum whose ``value`` is the name."""

    @property
    def value(self):
        return str(self)


REFUSED = [
    (dict(attn_type="encoder_only"), ValueError, "attn_type"),
    (dict(attn_type="encoder_decoder"), ValueError, "attn_type"),
    (dict(attn_type=_Str("encoder")), ValueError, "attn_type"),
    (dict(head_size=8), ValueError, "head_size"),
    (dict(head_size=512), ValueError, "head_size"),
    (dict(head_size=32.0), TypeError, "head_size"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=1e39), ValueError, "scale"),  # the kernels' limit: float32's range / log2(e)
    (dict(scale="0.1"), TypeError, "scale"),
    (dict(kv_cache_dtype="bfloat16"), ValueError, "kv_cache_dtype"),  # fp32 model
    (dict(kv_cache_dtype="int8_per_token_head"), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype="nvfp4"), ValueError, "kv_cache_dtype"),
    (dict(model_dtype=torch.float64), TypeError, "dtype"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=1e-45), ValueError, "logits_soft_cap"),  # ln 2 / cap overflows
    (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap"),
    (dict(alibi_slopes=[0.1, 1e39, 0.0, 0.2]), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.1, 0.2]), ValueError, "alibi_slopes"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (dict(block_m=64), ValueError, "block_m"),
]


@pytest.mark.parametrize("change,exc,name", REFUSED,
                         ids=[f"{name}-{i}" for i, (_, _, name) in enumerate(REFUSED)])
def test_what_the_backend_does_not_run_is_refused_by_name(change, exc, name):
    args = dict(num_heads=H, head_size=D, scale=0.2, num_kv_heads=HKV,
                model_dtype=torch.float32) | change
    with pytest.raises(exc, match=f"pagedattn's vLLM attention backend: {name}: expected"):
        layer_options(**args)


def _plan_and_run(option: str, value: float) -> None:
    """A one-token decode through a plan with ``option`` (the plan's soft-cap, or the run's
    scale) at ``value``."""
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    cap = {"logits_soft_cap": value} if option == "logits_soft_cap" else {}
    plan = pagedattn.plan_decode(table, lens, num_q_heads=H, num_kv_heads=HKV, head_dim=D,
                                 page_size=N, q_dtype=torch.float32, **cap)
    cache = torch.randn(1, N, HKV, D)
    # a small query: a scale near the limit keeps every score within float32 (the run's
    # value checks)
    out = plan.run(torch.randn(1, H, D) * 1e-3, cache, cache,
                   scale=value if option == "scale" else 0.2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("option,value,inside", [("scale", 1e39, 2e38),
                                                 ("logits_soft_cap", 1e-45, 3e-39),
                                                 ("logits_soft_cap", 1e39, 2e38)])
def test_what_layer_options_refuse_the_kernels_refuse_too(option, value, inside):
    """The values refused when vLLM configures the layer are ones a plan refuses at serving
    time (the early check moves the error), and a value just inside the kernels' limit is
    accepted by both (it refuses nothing that runs)."""
    with pytest.raises(ValueError, match=f"^{option}: expected"):
        _plan_and_run(option, value)
    opts = layer_options(H, D, inside if option == "scale" else 0.2, HKV,
                         logits_soft_cap=inside if option != "scale" else None,
                         model_dtype=torch.float32)
    assert (opts.scale if option == "scale" else opts.logits_soft_cap) == inside
    _plan_and_run(option, inside)


def _config(**change):
    parallel = SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    model = SimpleNamespace(use_mla=False, rswa_window=None)
    config = SimpleNamespace(parallel_config=parallel, model_config=model,
                             attention_config=SimpleNamespace(use_non_causal=False),
                             kv_transfer_config=None)
    for path, value in change.items():
        obj, _, attr = path.rpartition(".")
        setattr(getattr(config, obj) if obj else config, attr, value)
    return config


@pytest.mark.parametrize("path,value,name", [
    ("model_config.use_mla", True, "use_mla"),
    ("model_config.rswa_window", 512, "rswa_window"),
    ("attention_config.use_non_causal", True, "use_non_causal"),
    ("parallel_config.decode_context_parallel_size", 2, "decode_context_parallel_size"),
    ("parallel_config.prefill_context_parallel_size", 2, "prefill_context_parallel_size"),
    ("kv_transfer_config", object(), "kv_transfer_config"),
])
def test_configurations_the_backend_does_not_run_are_named(path, value, name):
    assert config_refusals(_config()) == []
    assert [r.split(":")[0] for r in config_refusals(_config(**{path: value}))] == [name]
    assert config_refusals(_config(), batch_invariant=True)[0].startswith("VLLM_BATCH_INVARIANT")


# --- the cache's bytes ---------------------------------------------------------------------


def vllm_cache(num_blocks, layout="HND"):
    """A layer's cache as vLLM hands it over: logically ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]``, physically head-major (``LBHNC``) or token-major
    (``LBNHC``) within a block, NaN in every slot."""
    if layout == "HND":
        raw = torch.empty(num_blocks, HKV, N, 2 * D)
    else:
        raw = torch.empty(num_blocks, N, HKV, 2 * D).permute(0, 2, 1, 3)
    return raw.fill_(float("nan"))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_the_cache_holds_each_tokens_key_then_value(layout):
    """``do_kv_cache_update``'s write (``append_kv`` through :func:`split_kv_cache`) puts
    token ``t``'s key in the first ``head_size`` entries of its slot and its value in the
    rest; the views are the one tensor, in either of vLLM's layouts."""
    options = layer_options(H, D, 0.2, HKV, model_dtype=torch.float32)
    cache = vllm_cache(6, layout)
    key_cache, value_cache = split_kv_cache(cache, options)
    assert key_cache.shape == value_cache.shape == (6, HKV, N, D)
    assert key_cache.data_ptr() == cache.data_ptr() and cache_layout(key_cache) == layout
    key, value = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    slots = torch.tensor([0, 9, 47, -1, 17])  # -1: vLLM's padding slot, skipped
    pagedattn.append_kv(key, value, key_cache, value_cache, slots, kv_layout="HND")
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            page, offset = divmod(slot, N)
            assert torch.equal(cache[page, :, offset, :D], key[t])
            assert torch.equal(cache[page, :, offset, D:], value[t])
    assert int(torch.isnan(cache).any(-1).sum()) == (6 * N - 4) * HKV  # nothing else written


def test_fp8_caches_are_viewed_from_vllms_bytes():
    options = layer_options(H, D, 0.2, HKV, kv_cache_dtype="fp8_e5m2",
                            model_dtype=torch.float16)
    cache = torch.zeros(3, HKV, N, 2 * D, dtype=torch.uint8)
    key_cache, _ = split_kv_cache(cache, options)
    assert key_cache.dtype == torch.float8_e5m2 and key_cache.data_ptr() == cache.data_ptr()


@pytest.mark.parametrize("bad,exc", [(torch.zeros(3, HKV, N, D), ValueError),
                                     (torch.zeros(3, 1, N, 2 * D), ValueError),
                                     (torch.zeros(3, HKV, N, 2 * D, dtype=torch.half), TypeError),
                                     ([1, 2], TypeError)])
def test_a_cache_of_another_shape_or_dtype_is_refused(bad, exc):
    options = layer_options(H, D, 0.2, HKV, model_dtype=torch.float32)
    with pytest.raises(exc, match="kv_cache: expected"):
        split_kv_cache(bad, options)


# --- a step: vLLM's metadata to plans, every layer against the oracle ----------------------


def vllm_step(q_lens, seq_lens, num_pages=40, pad=3, seed=0, dtype=torch.float32,
              layout="HND", fp8=None):
    """A step as vLLM's ``CommonAttentionMetadata`` gives it (decode rows first), a cache
    holding every sequence's keys and values (shuffled pages, garbage table padding), a
    query with ``pad`` padding rows."""
    g = torch.Generator().manual_seed(seed)
    cache = vllm_cache(num_pages, layout)
    pages = torch.randperm(num_pages, generator=g)
    max_pages = max(-(-s // N) for s in seq_lens) + 1
    table = torch.randint(0, 10**6, (len(seq_lens), max_pages), generator=g, dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        n = -(-s // N)
        table[b, :n] = pages[used:used + n]
        used += n
        cache[table[b, :n].long()] = torch.randn(n, HKV, N, 2 * D, generator=g)
    if fp8 is not None:
        cache = cache.to(fp8).view(torch.uint8)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]) + pad, H, D, generator=g).to(dtype)
    meta = dict(block_table=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), num_reqs=len(q_lens),
                num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), page_size=N)
    return meta, cache, query


def check_layer(meta, cache, query, options, step, **per_call):
    """``run_step`` into a NaN-poisoned output: the tokens within tolerance of the oracle
    over the whole batch, vLLM's padding rows untouched."""
    key_cache, value_cache = split_kv_cache(cache, options)
    out = torch.full_like(query, float("nan"))
    run_step(step, options, query, key_cache, value_cache, out, **per_call)
    n = meta["num_actual_tokens"]
    ref = pagedattn.paged_attention_reference(
        query[:n], key_cache, value_cache, meta["block_table"], meta["seq_lens"],
        meta["query_start_loc"], kv_layout="HND", scale=options.scale,
        window_left=options.window_left, logits_soft_cap=options.logits_soft_cap, **per_call)
    err = rel_l2_error(out[:n], ref.out)
    assert err <= tolerance_for(options.kv_dtype), err
    assert torch.isnan(out[n:]).all()


LAYERS = [layer_options(H, D, 0.15, HKV, model_dtype=torch.float32),
          layer_options(H, D, 0.15, HKV, sliding_window=7, logits_soft_cap=3.0,
                        alibi_slopes=[0.1, -0.05, 0.2, 0.0], model_dtype=torch.float32),
          layer_options(H, D, 0.3, HKV, model_dtype=torch.float32)]  # a third layer, 1st's plan


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_mixed_step_of_decodes_chunks_and_prompts(layout):
    """Two decodes first, then a chunk over a cached prefix, a chunk after it, a whole
    prompt: the decode part through the decode plan, the rest through one varlen plan, per
    variant; every layer of every variant against the oracle (sinks and ALiBi at run)."""
    meta, cache, query = vllm_step([1, 1, 9, 17, 5], [20, 7, 33, 40, 5], layout=layout)
    plans = plan_step(layers=LAYERS, **meta)
    assert set(plans) == {(-1, None), (6, 3.0)}  # layers 1 and 3 share a plan
    step = plans[(-1, None)]
    assert (step.num_decode_tokens, step.num_actual_tokens) == (2, 33)
    assert step.decode.batch == 2 and step.varlen.batch == 3
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0])
    for options in LAYERS:
        extra = dict(sinks=sinks, alibi_slopes=options.alibi_slopes) if (
            options.alibi_slopes is not None) else {}
        check_layer(meta, cache, query, options, plans[options.variant], **extra)
    assert step.decode._decode is not None  # the decode rows ran pagedattn's decode plan


def test_a_decode_only_step_and_a_prefill_only_step():
    meta, cache, query = vllm_step([1, 1, 1], [9, 30, 1])
    step = plan_step(layers=LAYERS[:1], **meta)[(-1, None)]
    assert step.varlen is None and step.decode.batch == 3
    check_layer(meta, cache, query, LAYERS[0], step)
    meta, cache, query = vllm_step([12, 3, 1], [12, 20, 6])  # a decode after a prefill: varlen
    step = plan_step(layers=LAYERS[:1], **meta)[(-1, None)]
    assert step.decode is None and step.num_decode_tokens == 0
    check_layer(meta, cache, query, LAYERS[0], step)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_with_the_layers_scales(fp8):
    options = layer_options(H, D, 0.2, HKV, model_dtype=torch.float16,
                            kv_cache_dtype={torch.float8_e4m3fn: "fp8",
                                            torch.float8_e5m2: "fp8_e5m2"}[fp8])
    meta, cache, query = vllm_step([1, 6, 11], [14, 6, 30], dtype=torch.float16, fp8=fp8)
    step = plan_step(layers=[options], **meta)[options.variant]
    scale = torch.tensor(0.75)  # vLLM's layer._k_scale: a 0-d float32 tensor
    check_layer(meta, cache, query, options, step, k_scale=scale, v_scale=torch.tensor(1.25))


def test_num_decodes_counts_the_leading_one_token_requests():
    qsl = lambda *q: torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
    assert num_decodes(qsl(1, 1, 1), 3) == 3
    assert num_decodes(qsl(1, 1, 5, 1), 4) == 2
    assert num_decodes(qsl(4, 1), 2) == 0
    assert num_decodes(qsl(1, 0, 0), 3) == 1  # padding requests (no token) are varlen rows
    assert num_decodes(qsl(), 0) == 0


def test_decode_plans_are_kept_across_steps_of_the_same_buffers():
    """vLLM's metadata tensors are views of persistent buffers: a decode step of the same
    batch size finds its plan again (and a capture's plan stays, pinned); other shapes or
    buffers get their own."""
    meta, cache, query = vllm_step([1, 1, 1], [9, 30, 1])
    cache_ = PlanCache(size=1)
    first = plan_step(layers=LAYERS[:1], cache=cache_, **meta)[(-1, None)].decode
    again = plan_step(layers=LAYERS[:1], cache=cache_, **meta)[(-1, None)].decode
    assert again is first and len(cache_) == 1
    meta["seq_lens"] += 1  # in place, as vLLM updates its buffers: the same plan, new lengths
    step = plan_step(layers=LAYERS[:1], cache=cache_, **meta)[(-1, None)]
    assert step.decode is first
    check_layer(meta, cache, query, LAYERS[0], step)
    sized = lambda reqs: {**meta, "num_reqs": reqs, "num_actual_tokens": reqs}
    pinned = plan_step(layers=LAYERS[:1], cache=cache_, pin=True, **sized(2))
    plan_step(layers=LAYERS[:1], cache=cache_, **sized(1))  # the LRU of 1 evicts batch 3's
    assert plan_step(layers=LAYERS[:1], cache=cache_, **sized(3))[(-1, None)].decode is not first
    assert plan_step(layers=LAYERS[:1], cache=cache_, **sized(2))[(-1, None)].decode is (
        pinned[(-1, None)].decode)
    assert len(cache_) == 2  # one in the LRU, one pinned


# --- registration --------------------------------------------------------------------------


def test_registration_on_each_platform(caplog):
    on = {"PAGEDATTN_VLLM_CPU": "1", "TRITON_INTERPRET": "1"}
    assert plugin.choose("cpu", "0.32.0", {}) is None  # installing pagedattn changes nothing
    assert plugin.choose("cpu", "0.32.0", {"PAGEDATTN_VLLM_CPU": "0"}) is None
    assert plugin.choose("cpu", "0.32.0", on) == ("CPU_ATTN", plugin.CPU_BACKEND)
    assert plugin.choose("cpu", "0.33.1+cpu", on) == ("CPU_ATTN", plugin.CPU_BACKEND)
    assert plugin.choose("cuda", "0.33.0", {}) == ("CUSTOM", plugin.BACKEND)
    assert plugin.choose("rocm", "0.33.0", on) is None
    assert plugin.choose("cpu", "0.34.0", on) == ("CPU_ATTN", plugin.CPU_BACKEND)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x, not "
                       r"vLLM 0\.35\.0$"):
        plugin.choose("cpu", "0.35.0", on)
    with pytest.raises(RuntimeError, match="not vLLM 0.31.9"):
        plugin.choose("cpu", "0.31.9", on)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        plugin.choose("cpu", "0.32.0", {"PAGEDATTN_VLLM_CPU": "1"})
    with pytest.raises(ValueError, match="PAGEDATTN_VLLM_CPU: expected '1'"):
        plugin.choose("cpu", "0.32.0", {"PAGEDATTN_VLLM_CPU": "yes"})
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.pagedattn"):
        assert plugin.choose("cuda", "0.31.2", {}) is None
    assert "not vLLM 0.31.2" in caplog.text


def test_version_keys():
    assert plugin.version_key("0.32.0") == (0, 32)
    assert plugin.version_key("0.32.1.dev3+gabc") == (0, 32)
    assert plugin.version_key("0.32.0+cpu") == (0, 32)
    assert plugin.version_key("dev") is None and not plugin.supported("dev")
    assert plugin.supported("0.33.0") and plugin.supported("0.34.0")
    assert not plugin.supported("0.35.0") and not plugin.supported("1.0.0")


def test_the_entry_point_names_the_registration():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["pagedattn"]
    module, _, name = target.partition(":")
    assert getattr(sys.modules[module], name) is plugin.register
    # the extra declares exactly the supported minors: 0.32 to 0.34
    assert project["optional-dependencies"]["vllm"] == ["vllm>=0.32,<0.35"]
    assert {plugin.version_key(v) for v in ("0.32.0", "0.33.0", "0.34.0")} == set(
        plugin.TESTED) | set(plugin.READ)


def test_neither_pagedattn_nor_the_plugins_pure_parts_import_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"  # any import of vllm now fails
            "import pagedattn, pagedattn.integrations.vllm.layer, "
            "pagedattn.integrations.step\n"
            "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules)\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_layer_options_is_hashable_by_variant():
    opts = LayerOptions(num_q_heads=4, num_kv_heads=2, head_dim=32, scale=1.0,
                        q_dtype=torch.float32, kv_dtype=torch.float32, window_left=5)
    assert opts.variant == (5, None) and {opts.variant: 1}[(5, None)] == 1
