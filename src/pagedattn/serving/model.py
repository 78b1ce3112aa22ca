"""A small Llama forward in PyTorch (RMSNorm, RoPE, SwiGLU, GQA) over a paged KV cache.

Two attention paths share every other line of the model:

* **paged** (serving): :meth:`Llama.prefill` runs causal attention with torch SDPA over each
  prompt and writes the prompt's K/V into the :class:`PagedKVCache` with ``append_kv``;
  :meth:`Llama.decode` takes one token per sequence of a ragged batch, appends its K/V and
  attends with ``paged_decode`` (one kernel call per layer for the whole batch). Both go
  through the ``torch.library`` custom ops, so a decode step traces under ``torch.compile``.
* **dense** (the benchmark's baseline): :meth:`Llama.prefill_dense` / :meth:`Llama.decode_dense`
  keep K/V in a contiguous ``[num_layers, 2, batch, num_kv_heads, max_len, head_dim]`` tensor
  and attend with SDPA, for an equal-length batch.

Numerics follow Hugging Face's ``LlamaForCausalLM`` (fp32 RMSNorm statistics, RoPE
``freqs = position * inv_freq`` with ``rotate_half``, ``down(silu(gate(x)) * up(x))``), so in
fp32 greedy decoding matches transformers token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedattn.serving import ops
from pagedattn.serving.cache import PagedKVCache, StepMetadata
from pagedattn.serving.gguf_loader import LlamaConfig, load_gguf

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` with fp32 statistics (as transformers)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Llama(torch.nn.Module):
    """Llama decoder weights and forward passes.

    Args:
        cfg: shapes and constants (:class:`LlamaConfig`).
        weights: fp32 tensors as returned by :func:`load_gguf` (nn.Linear layout).
        dtype: compute dtype of weights and activations (float32/float16/bfloat16).
        device: where the weights live.
        impl: the ``paged_decode`` impl used by :meth:`decode`.
    """

    inv_freq: torch.Tensor  # [head_dim // 2] fp32 RoPE frequencies (a buffer)

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 impl: str = "auto"):
        super().__init__()
        self.cfg, self.impl = cfg, impl
        p = {k: torch.nn.Parameter(v.to(device=device, dtype=dtype), requires_grad=False)
             for k, v in weights.items()}
        self.embed, self.final_norm = p["embed"], p["final_norm"]
        self.lm_head = p.get("lm_head", self.embed)  # tied embeddings: the same tensor
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.num_layers):
            layer = torch.nn.Module()
            for k in _LAYER_KEYS:
                setattr(layer, k, p[f"layers.{i}.{k}"])
            self.layers.append(layer)
        inv = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    @classmethod
    def from_gguf(cls, path=None, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", impl: str = "auto") -> Llama:
        """Load SmolLM2 (or any llama GGUF); see :func:`pagedattn.serving.gguf_loader.find_gguf`."""
        cfg, weights = load_gguf(path)
        return cls(cfg, weights, dtype=dtype, device=device, impl=impl)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def make_cache(self, num_pages: int, *, page_size: int = 16, dtype: torch.dtype | None = None,
                   k_scale=None, v_scale=None) -> PagedKVCache:
        """A paged cache shaped for this model (``dtype`` defaults to the model's)."""
        return PagedKVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim,
                            num_pages=num_pages, page_size=page_size,
                            dtype=self.dtype if dtype is None else dtype, device=self.device,
                            k_scale=k_scale, v_scale=v_scale)

    # -- shared pieces -------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin ``[num_tokens, head_dim]`` for integer ``positions`` ``[num_tokens]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[N, hidden]`` -> rotated ``q`` ``[N, Hq, D]``, ``k``/``v`` ``[N, Hkv, D]``."""
        c = self.cfg
        h = rms_norm(x, layer.attn_norm, c.rms_eps)
        q = F.linear(h, layer.wq).view(-1, c.num_q_heads, c.head_dim)
        k = F.linear(h, layer.wk).view(-1, c.num_kv_heads, c.head_dim)
        v = F.linear(h, layer.wv).view(-1, c.num_kv_heads, c.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish_layer(self, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, SwiGLU MLP, residual. ``attn`` ``[N, Hq*D]``."""
        x = x + F.linear(attn, layer.wo)
        h = rms_norm(x, layer.ffn_norm, self.cfg.rms_eps)
        return x + F.linear(F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up),
                            layer.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.final_norm, self.cfg.rms_eps), self.lm_head)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        """``q`` ``[B, Hq, Tq, D]``, ``k``/``v`` ``[B, Hkv, Tk, D]`` -> ``[B, Hq, Tq, D]``."""
        if _SDPA_HAS_GQA:  # as transformers does when there is no mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        group = self.cfg.num_q_heads // self.cfg.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # -- paged path ----------------------------------------------------------------------
    def prefill(self, token_ids: torch.Tensor, meta: StepMetadata,
                cache: PagedKVCache) -> torch.Tensor:
        """Prompts of a ragged batch, each starting at position 0 of a fresh sequence.

        Args:
            token_ids: ``[num_tokens]`` int64, the prompts concatenated in
                ``meta.query_start`` order.
            meta: from ``cache.prepare_step(seq_ids, prompt_lengths)`` on empty sequences.
            cache: the paged cache (written through ``append_kv``).

        Returns: the last position's logits per prompt, ``[num_prompts, vocab]`` (model dtype).
        Raises ValueError if ``token_ids`` and ``meta`` disagree on the token count.
        """
        starts = meta.query_start
        if token_ids.shape[0] != starts[-1]:
            raise ValueError(f"token_ids: expected {starts[-1]} tokens (meta), "
                             f"got {token_ids.shape[0]}")
        c = self.cfg
        x = F.embedding(token_ids, self.embed)
        cos, sin = self._rope(meta.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            ops.append_kv(k, v, cache.key_cache(i), cache.value_cache(i), meta.slot_mapping,
                          k_scale=cache.k_scale, v_scale=cache.v_scale)
            outs = []
            # causal attention within each prompt
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                o = self._sdpa(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                               v[a:b].transpose(0, 1)[None], causal=True)
                outs.append(o[0].transpose(0, 1).reshape(b - a, c.num_q_heads * c.head_dim))
            x = self._finish_layer(layer, x, torch.cat(outs))
        last = torch.tensor([b - 1 for b in starts[1:]], device=x.device)
        return self._logits(x[last])

    def decode(self, token_ids: torch.Tensor, meta: StepMetadata,
               cache: PagedKVCache) -> torch.Tensor:
        """One new token per sequence of a ragged batch.

        Args:
            token_ids: ``[batch]`` int64, each sequence's newest token.
            meta: from ``cache.prepare_step(seq_ids, [1] * batch)``: the token's slot and
                position, and the block tables and lengths including it.
            cache: the paged cache.

        Returns: logits ``[batch, vocab]`` in the model dtype. No host sync: traceable by
        ``torch.compile(fullgraph=True)`` and capturable in a CUDA graph.
        """
        c = self.cfg
        x = F.embedding(token_ids, self.embed)
        cos, sin = self._rope(meta.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            kc, vc = cache.key_cache(i), cache.value_cache(i)
            ops.append_kv(k, v, kc, vc, meta.slot_mapping, k_scale=cache.k_scale,
                          v_scale=cache.v_scale)
            o = ops.paged_decode(q, kc, vc, meta.block_tables, meta.context_lens,
                                 impl=self.impl, k_scale=cache.k_scale, v_scale=cache.v_scale)
            x = self._finish_layer(layer, x, o.reshape(-1, c.num_q_heads * c.head_dim))
        return self._logits(x)

    # -- dense path (baseline) -----------------------------------------------------------
    def new_dense_cache(self, batch: int, max_len: int) -> torch.Tensor:
        """``[num_layers, 2, batch, num_kv_heads, max_len, head_dim]`` zeros."""
        c = self.cfg
        return torch.zeros(c.num_layers, 2, batch, c.num_kv_heads, max_len, c.head_dim,
                           dtype=self.dtype, device=self.device)

    def forward_dense(self, token_ids: torch.Tensor, dense_kv: torch.Tensor | None = None,
                      start: int = 0) -> torch.Tensor:
        """Equal-length batch ``token_ids`` ``[batch, T]`` at positions ``[start, start+T)``;
        with ``dense_kv`` the new K/V are stored there and attention reads positions
        ``[0, start+T)``; without it, a full recompute over the given tokens (start 0).

        Returns logits ``[batch, T, vocab]`` in the model dtype. Raises ValueError for a
        multi-token chunk with ``start > 0``.
        """
        c = self.cfg
        batch, t = token_ids.shape
        if t > 1 and start > 0:
            raise ValueError("start: a multi-token chunk must start at position 0")
        x = F.embedding(token_ids, self.embed).reshape(batch * t, c.hidden_size)
        pos = torch.arange(start, start + t, device=x.device).repeat(batch)
        cos, sin = self._rope(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            q, k, v = (y.view(batch, t, -1, c.head_dim).transpose(1, 2) for y in (q, k, v))
            if dense_kv is not None:
                dense_kv[i, 0, :, :, start:start + t] = k
                dense_kv[i, 1, :, :, start:start + t] = v
                k, v = dense_kv[i, 0, :, :, :start + t], dense_kv[i, 1, :, :, :start + t]
            # a single new token attends to everything; a prompt chunk from 0 is causal
            o = self._sdpa(q, k, v, causal=t > 1)
            x = self._finish_layer(layer, x, o.transpose(1, 2).reshape(batch * t, -1))
        return self._logits(x).view(batch, t, -1)
