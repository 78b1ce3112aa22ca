"""The launch policy of absorbed multi-head latent attention (``pagedattn.mla``): the MLA
kernel's head blocks, tiles and balanced parts (:mod:`pagedattn.kernels.mla`), and where its
Gluon path applies (:mod:`pagedattn.kernels.mla_gluon`).

MLA (DeepSeek-V2/V3, Kimi K2) has one latent "kv head" that every query head reads: the
keys are ``[latent | rope]`` (``d_latent + d_rope`` dims, 512 + 64 in DeepSeek-V3) and the
values the latent itself. A program packs ``q_len`` x the query heads of a block as its
tile's rows and walks the latent tiles once for the scores and the output.

Pure functions of shapes, dtypes and the interpreter flag, as :mod:`pagedattn.launch.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.launch._common import block_d, next_power_of_2


def mla_head_blocks(num_heads: int, q_len: int, max_rows: int) -> int:
    """The blocks the ``num_heads`` query heads are cut into: the fewest that divide them with
    at most ``max_rows`` tile rows (``q_len`` tokens x the block's heads) each, so every block
    reads each latent tile once for all of its heads (DeepSeek-V3 at 64 rows: 128 heads at
    TP1 are two blocks of 64, 16 at TP8 one). A prime count past ``max_rows`` falls to one head
    a block (correct, not fast); realistic counts are powers of two or multiples of 8."""
    for blocks in range(1, num_heads + 1):
        if num_heads % blocks == 0 and q_len * (num_heads // blocks) <= max_rows:
            return blocks
    return num_heads


def mla_block_dr(d_rope: int) -> int:
    """The rope part's padded dims (``BLOCK_DR``): a power of two, at least 16 (a
    ``tl.dot``'s reduction)."""
    return max(16, next_power_of_2(d_rope))


#: FlashMLA's fixed cost of a sequence, in tiles of 64 tokens (its epilogue and the merge
#: of a cut sequence): the balanced parts share ``Σ (tiles + OVERHEAD)`` equally
#: (deepseek-ai/FlashMLA ``get_decoding_sched_meta.cu``)
MLA_OVERHEAD = 5


@dataclass(frozen=True)
class MLAKernelConfig:
    """Tiles, rows and the schedule of the MLA kernel (:mod:`pagedattn.kernels.mla`)."""

    heads: int  # query heads a program (a head block)
    block_h: int  # rows a program: q_len x heads, padded
    block_n: int  # latent tokens a tile
    num_warps: int
    num_stages: int
    num_parts: int  # programs a head block: the balanced parts of the batch's tiles
    overhead: int = MLA_OVERHEAD
    #: the Gluon kernel (kernels/mla_gluon.py: 64 rows, 64-token tiles, eight warps, two
    #: stages) where it applies (:func:`gluon_applies`), else the plain one
    gluon: bool = False
    #: the Gluon kernel's warp-specialized form (a producer warpgroup issues the copies):
    #: :func:`mla_kernel_config` asks for it with the Gluon kernel (docs/perf-notes.md step 55)
    ws: bool = False
    #: with ``ws``: the producer never waits for its own copies, each of its threads arriving
    #: on the stage as they land (docs/perf-notes.md step 60); opt-in, not yet run
    land: bool = False

    def head_blocks(self, num_heads: int) -> int:
        return num_heads // self.heads


def mla_kernel_config(*, num_heads: int, q_len: int, latent_dim: int, kv_dtype: torch.dtype,
                      num_sms: int, interpret: bool, num_parts: int | None = None
                      ) -> MLAKernelConfig:
    """The MLA kernel's tiles (see :mod:`pagedattn.kernels.mla`). On a GPU, 64 rows a program
    (Hopper's wgmma M; fewer heads are padded, as FlashMLA pads 16 heads at TP8), 64-token
    latent tiles two deep and eight warps for a latent of 256 dims or more (the two
    warpgroups each hold half the output's columns), and one program per SM: ``num_sms //
    head blocks`` parts. fp32 (a reference path) takes 16 rows and 16-token tiles. The
    interpreter runs 16-token tiles and four parts, so small tests cut sequences.

    16-bit and fp8 latents ask for the Gluon kernel (``gluon``), which the launcher runs where
    :func:`gluon_applies` (Hopper, 512 + 64 dims): on an H100 it ran 1.1-1.8 x faster than the
    plain kernel on every 16-bit row (docs/perf-notes.md step 50), and 1.67 x (TP1) and 1.72 x
    (TP8) on fp8 rows (step 52). Its warp-specialized form (``ws``) then ran 2-17 % faster
    than the single-partition one on every row of ``bench_mla.py`` (step 55; H100, ca00c2b)."""
    fp32 = kv_dtype == torch.float32
    max_rows = 16 if fp32 or interpret else 64
    blocks = mla_head_blocks(num_heads, q_len, max_rows)
    heads = num_heads // blocks
    rows = max(16, next_power_of_2(q_len * heads))
    if interpret:
        block_h, block_n, warps, stages, parts = rows, 16, 4, 1, 4
    elif fp32:
        block_h, block_n, warps, stages = rows, 16, 4, 2
        parts = max(num_sms // blocks, 1)
    else:
        block_h, block_n, stages = 64, 64, 2
        warps = 8 if block_d(latent_dim) >= 256 else 4
        parts = max(num_sms // blocks, 1)
    gluon = not (interpret or fp32)
    return MLAKernelConfig(heads=heads, block_h=block_h, block_n=block_n, num_warps=warps,
                           num_stages=stages, num_parts=num_parts or parts, gluon=gluon,
                           ws=gluon)


def gluon_applies(*, q_dtype: torch.dtype, kv_dtype: torch.dtype, latent_dim: int,
                  rope_dim: int, device: torch.device, interpret: bool) -> bool:
    """Whether the Gluon MLA kernel can run a plan: a Hopper GPU (sm_90; the interpreter runs
    no Gluon), a 16-bit query, a latent of its dtype or fp8 (converted in shared memory to the
    query's dtype), and DeepSeek-V2/V3's and Kimi K2's dims, a 512-dim latent and a 64-dim
    rope part (the shapes it was compiled and measured at; its shared memory holds the query
    and two stages of 64 × 576, 224 KB). Strides are the launcher's check (16-byte rows)."""
    if interpret or device.type != "cuda" or q_dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv_dtype != q_dtype and kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False
    if (latent_dim, rope_dim) != (512, 64):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9
