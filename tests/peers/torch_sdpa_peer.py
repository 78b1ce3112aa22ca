"""A measuring peer in plain torch, for the ``pagedattn bench --peer-file`` protocol's tests.

Each sequence's pages are gathered through its block table and attended with
``torch.nn.functional.scaled_dot_product_attention`` in float32 (fp8 caches are dequantized
with their scales first). Slow, and not graph-safe (it reads the lengths on the host); its
point is a peer file inside the repository that runs on any device::

    pagedattn bench --dry-run --shapes llama8b-b1-c1k --peers none \
        --peer-file tests/peers/torch_sdpa_peer.py
"""

import torch
import torch.nn.functional as F

PEER_NAME = "torch-sdpa"


def _scaled(cache: torch.Tensor, scale) -> torch.Tensor:
    """``cache`` [tokens, num_kv_heads, head_dim] in float32, times its dequantization scale
    (a float, or a tensor of one value or of one value per kv head)."""
    x = cache.float()
    if scale is None:
        return x
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
    return x * (s.view(1, -1, 1) if s.numel() > 1 else s)


def make_runner(query, key_cache, value_cache, block_tables, context_lens, scale,
                k_scale=None, v_scale=None):
    """Runner factory: query [batch, num_q_heads, head_dim]; caches [num_pages, page_size,
    num_kv_heads, head_dim] (NHD); int32 block_tables [batch, max_pages] and context_lens
    [batch]. The runner returns out [batch, num_q_heads, head_dim] in the query's dtype."""
    page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    lens = context_lens.tolist()

    def run() -> torch.Tensor:
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        for b, length in enumerate(lens):
            if length == 0:
                continue  # an empty sequence attends to nothing: zeros
            pages = block_tables[b, : -(-length // page_size)].long()
            k = _scaled(key_cache[pages].flatten(0, 1)[:length], k_scale)
            v = _scaled(value_cache[pages].flatten(0, 1)[:length], v_scale)
            q = query[b].float().unsqueeze(1)  # [num_q_heads, 1, head_dim]
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), scale=scale,
                                               enable_gqa=query.shape[1] != num_kv_heads)
            out[b] = o[0, :, 0]
        return out.to(query.dtype)

    return run
