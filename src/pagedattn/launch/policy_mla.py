"""The launch policy of absorbed multi-head latent attention (``pagedattn.mla``): how the
query heads are packed into the production kernel's tiles, and the tiles.

MLA (DeepSeek-V2/V3, Kimi K2) has one latent "kv head" that every query head reads: the
keys are ``[latent | rope]`` (``d_latent + d_rope`` dims, 512 + 64 in DeepSeek-V3) and the
values the latent itself. The kernel (``MLA`` of ``kernels/decode.py``) packs a block of
query heads as one tile's rows, as it packs a GQA group, and walks the latent tiles once for
the scores and the output. A block is what the kernel calls a kv head: the launcher hands it
the caches with a head stride of 0, so the ``num_heads / group`` blocks of one sequence all
read the same latent rows (adjacent programs: the second read comes from L2), and the
device planner and the merges are the kernel's own.

Pure functions of shapes, dtypes and the interpreter flag, as :mod:`pagedattn.launch.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedattn.launch._common import block_d, next_power_of_2
from pagedattn.launch.policy import DecodeConfig

#: tile rows (query tokens x heads of a block), at most, by cache dtype, from
#: the compiled sm_90 kernels. 64 rows are Hopper's wgmma tile
#: (one warpgroup's M; at eight warps the two warpgroups split the 512 value dims, the fp32
#: accumulator 128 registers a thread): bf16 compiles to 255 registers with no spill inside
#: the token loop; fp16 and fp8 latents at 64 rows spill inside it (74 and 215 spill
#: instructions), at 32 rows not (144 and 240 registers); fp32's split-bf16 dots spill at
#: any size (a CPU path)
_MAX_ROWS = {torch.bfloat16: 64, torch.float16: 32, torch.float32: 16}
_MAX_ROWS_FP8 = 32


def mla_max_rows(kv_dtype: torch.dtype) -> int:
    """The most tile rows of an MLA plan on the decode kernel (see :data:`_MAX_ROWS`)."""
    return _MAX_ROWS.get(kv_dtype, _MAX_ROWS_FP8)


def mla_head_blocks(num_heads: int, q_len: int, max_rows: int) -> int:
    """The blocks the ``num_heads`` query heads are cut into: the fewest that divide them with
    at most ``max_rows`` tile rows (``q_len`` tokens x the block's heads) each, so every block
    reads each latent tile once for all of its heads (DeepSeek-V3 in bf16: 128 heads at TP1
    are two blocks of 64, 16 at TP8 one). A prime count past ``max_rows`` falls to one head
    a block (correct, not fast); realistic counts are powers of two or multiples of 8."""
    for blocks in range(1, num_heads + 1):
        if num_heads % blocks == 0 and q_len * (num_heads // blocks) <= max_rows:
            return blocks
    return num_heads


def mla_config(*, d_latent: int, rows: int, kv_dtype: torch.dtype, interpret: bool
               ) -> DecodeConfig:
    """The tiles of an MLA plan whose tile holds ``rows`` rows (``q_len`` x heads of a block,
    padded to at least 16), read off the compiled sm_90 kernels (not tuned on a GPU: the H200
    runs were correct and far behind FlashInfer's MLA kernel). Eight warps: the
    ``rows x d_latent`` fp32 accumulator spread over 256
    threads (at 64 rows, one warpgroup's wgmma M, the two warpgroups each hold 256 of the
    512 value dims). 32-token latent tiles 2 deep up to 16 rows (bf16: 115 registers, 56 KB
    of shared memory, two programs per SM), 16-token tiles 2 deep above (32 rows: 144
    registers, one program; 64 rows: 255, 128 KB, one program; 32-token tiles at 64 rows
    spill inside the token loop). The split target is the programs resident per SM; the
    folded merge of 16-bit plans as in the production kernel."""
    bd = block_d(d_latent)
    narrow = rows <= 16 or bd <= 128
    ctas = 2 if narrow else 1
    cfg = DecodeConfig(block_n=32 if narrow else 16, num_warps=8 if bd >= 256 else 4,
                       num_stages=2, ctas_per_sm=ctas, min_chunk=256,
                       ragged_ctas_per_sm=2 * ctas,
                       fold_merge=kv_dtype in (torch.float16, torch.bfloat16),
                       lean_softmax=kv_dtype != torch.float32,
                       slot_offsets_i32=kv_dtype != torch.float32)
    if interpret:  # the interpreter runs programs one by one: fewer, smaller is faster
        cfg = replace(cfg, ctas_per_sm=1, ragged_ctas_per_sm=2, num_stages=1,
                      block_n=min(cfg.block_n, 16), min_chunk=64, invariant_chunk=64)
    return cfg


def mla_block_dr(d_rope: int) -> int:
    """The rope part's padded dims (``BLOCK_DR``): a power of two, at least 16 (a
    ``tl.dot``'s reduction)."""
    return max(16, next_power_of_2(d_rope))


# --- the MLA kernel's policy (kernels/mla.py) ----------------------------------------------

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
    (TP8) on fp8 rows (step 52)."""
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
                           num_stages=stages, num_parts=num_parts or parts, gluon=gluon)


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
