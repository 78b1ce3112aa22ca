"""FlashMLA's own decode test (``tests/test_flash_mla.py``), run against
``pagedattn.compat.flash_mla_with_kvcache`` / ``get_mla_metadata``.

Upstream: vllm-project/FlashMLA (FlashMLA's fork that vLLM builds; deepseek-ai/FlashMLA, MIT
License, "Copyright (c) 2025 DeepSeek"), commit 625531b6b6cd0fecf42fcf66df728f85252c349a,
``tests/test_flash_mla.py``. Modified from the original: the functions under test are ours;
the changes are listed here.

The reference and the bound are upstream's: ``scaled_dot_product_attention`` in float32
torch per sequence (causal bottom-right aligned), compared by ``cal_diff`` (``1 - cos`` of
output and LSE under 1e-5); the cache past each length is NaN, as upstream poisons it.
Upstream's script (``main``) runs batch 128 at 4k-16k tokens, 16-128 heads, ``s_q`` 1 and 2,
causal, bf16 and fp16, on a GPU, and times each call; here the same parameters at CPU sizes
(Triton's interpreter: batch 2, about 100 tokens, 16 and 64 heads, eight combinations that
take each value in both dtypes), causal and not, and no timing.
``torch.set_default_device``/``set_default_dtype`` of the script become explicit arguments.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedattn.compat import flash_mla_with_kvcache, get_mla_metadata


def scaled_dot_product_attention(query, key, value, h_q, h_kv, is_causal=False):
    query, key, value = query.float(), key.float(), value.float()
    key = key.repeat_interleave(h_q // h_kv, dim=0)
    value = value.repeat_interleave(h_q // h_kv, dim=0)
    attn_weight = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    if is_causal:
        s_q, s_k = query.shape[-2], key.shape[-2]
        attn_bias = torch.zeros(s_q, s_k, dtype=query.dtype)
        temp_mask = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)
        attn_bias.masked_fill_(temp_mask.logical_not(), float("-inf"))
        attn_weight += attn_bias.to(attn_weight.device)
    lse = attn_weight.logsumexp(dim=-1)
    attn_weight = torch.softmax(attn_weight, dim=-1, dtype=torch.float32)
    return attn_weight @ value, lse


def cal_diff(x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    x, y = x.double(), y.double()
    cos_diff = 1 - 2 * (x * y).sum().item() / max((x * x + y * y).sum().item(), 1e-12)
    assert cos_diff < 1e-5, (name, cos_diff)


#: (dtype, h_q, s_q, causal, varlen): upstream's grid at CPU sizes, each value in both
#: dtypes, TP8 and TP2 head counts (128 heads run in test_mla.py)
CASES = [(torch.bfloat16, 16, 1, True, False), (torch.bfloat16, 64, 2, True, True),
         (torch.bfloat16, 64, 2, False, False), (torch.bfloat16, 16, 1, False, True),
         (torch.float16, 16, 2, True, True), (torch.float16, 64, 1, False, False),
         (torch.float16, 16, 2, False, True), (torch.float16, 64, 2, True, False)]


@pytest.mark.parametrize("dtype, h_q, s_q, causal, varlen", CASES)
def test_flash_mla(device, dtype, s_q, h_q, causal, varlen, b=2, mean_sk=100):
    h_kv, d, dv = 1, 576, 512
    torch.manual_seed(0)
    random.seed(0)
    cache_seqlens = torch.full((b,), mean_sk, dtype=torch.int32)
    if varlen:
        for i in range(b):
            cache_seqlens[i] = max(random.normalvariate(mean_sk, mean_sk / 2), s_q)
    max_seqlen = cache_seqlens.max().item()
    max_seqlen_pad = -(-max_seqlen // 256) * 256
    q = torch.randn(b, s_q, h_q, d, dtype=dtype, device=device)
    block_size = 64
    block_table = torch.arange(b * max_seqlen_pad // block_size, dtype=torch.int32,
                               device=device).view(b, max_seqlen_pad // block_size)
    blocked_k = torch.randn(block_table.numel(), block_size, h_kv, d, dtype=dtype,
                            device=device)
    for i in range(b):
        blocked_k.view(b, max_seqlen_pad, h_kv, d)[i, cache_seqlens[i].item():] = float("nan")
    blocked_v = blocked_k[..., :dv]
    cache_seqlens = cache_seqlens.to(device)

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv,
                                                           h_kv)
    out_flash, lse_flash = flash_mla_with_kvcache(q, blocked_k, block_table, cache_seqlens, dv,
                                                  tile_scheduler_metadata, num_splits,
                                                  causal=causal)
    out_torch = torch.empty(b, s_q, h_q, dv, dtype=torch.float32)
    lse_torch = torch.empty(b, h_q, s_q, dtype=torch.float32)
    for i in range(b):
        begin = i * max_seqlen_pad
        end = begin + cache_seqlens[i]
        o, lse = scaled_dot_product_attention(
            q[i].transpose(0, 1).cpu(),
            blocked_k.view(-1, h_kv, d)[begin:end].transpose(0, 1).cpu(),
            blocked_v.reshape(-1, h_kv, dv)[begin:end].transpose(0, 1).cpu(),
            h_q=h_q, h_kv=h_kv, is_causal=causal)
        out_torch[i] = o.transpose(0, 1)
        lse_torch[i] = lse
    assert out_flash.shape == out_torch.shape and lse_flash.shape == lse_torch.shape
    cal_diff(out_flash.cpu(), out_torch, "out")
    cal_diff(lse_flash.cpu(), lse_torch, "lse")
    # the metadata serves the same shapes again, and refuses others
    again, _ = flash_mla_with_kvcache(q, blocked_k, block_table, cache_seqlens, dv,
                                      tile_scheduler_metadata, num_splits, causal=causal)
    assert torch.equal(again, out_flash)
    with pytest.raises(ValueError, match="^tile_scheduler_metadata"):
        flash_mla_with_kvcache(q[:1], blocked_k, block_table[:1], cache_seqlens[:1], dv,
                               tile_scheduler_metadata, None, causal=causal)


def test_fp8_cache_with_descale_k(device):
    """An fp8 ``k_cache`` tensor with its ``descale_k`` against the same call on the
    dequantized cache."""
    torch.manual_seed(1)
    b, s_q, h_q, d, dv = 2, 1, 16, 576, 512
    q = torch.randn(b, s_q, h_q, d, dtype=torch.bfloat16, device=device)
    k = torch.randn(4, 64, 1, d, device=device)
    k8 = (k / 0.05).to(torch.float8_e4m3fn)
    table = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    lens = torch.tensor([70, 128], dtype=torch.int32, device=device)
    meta, _ = get_mla_metadata()
    out8, lse8 = flash_mla_with_kvcache(q, k8, table, lens, dv, meta,
                                        descale_k=torch.tensor([0.05], device=device))
    ref, lse_ref = flash_mla_with_kvcache(q, (k8.float() * 0.05).to(torch.bfloat16), table,
                                          lens, dv, get_mla_metadata()[0])
    cal_diff(out8.cpu(), ref.cpu(), "out")
    cal_diff(lse8.cpu(), lse_ref.cpu(), "lse")


@pytest.mark.parametrize("kw, name", [
    (dict(is_fp8_kvcache=True), "is_fp8_kvcache"), (dict(attn_sink=1), "attn_sink"),
    (dict(indices=1), "indices"), (dict(num_splits=torch.zeros(1)), "num_splits"),
    (dict(tile_scheduler_metadata=object()), "tile_scheduler_metadata"),
    (dict(k_cache="two heads"), "k_cache"), (dict(head_dim_v=600), "head_dim_v"),
    (dict(block_table="float"), "block_table"), (dict(softmax_scale=math.inf),
                                                 "softmax_scale")])
def test_refusals_name_flash_mlas_arguments(device, kw, name):
    q = torch.randn(1, 1, 16, 576, dtype=torch.bfloat16, device=device)
    args = dict(q=q, k_cache=torch.randn(2, 64, 1, 576, dtype=torch.bfloat16, device=device),
                block_table=torch.zeros(1, 2, dtype=torch.int32, device=device),
                cache_seqlens=torch.tensor([9], dtype=torch.int32, device=device),
                head_dim_v=512, tile_scheduler_metadata=get_mla_metadata()[0])
    if kw.get("k_cache") == "two heads":
        kw = dict(k_cache=torch.randn(2, 64, 2, 576, dtype=torch.bfloat16, device=device))
    if kw.get("block_table") == "float":
        kw = dict(block_table=args["block_table"].float())
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        flash_mla_with_kvcache(**{**args, **kw})
