"""The policy of the production launcher (``impl="auto"``): what to launch, decided from
shapes, dtypes and device facts (the SM count, the GPU's name, the interpreter) alone.

Pure functions, no tensor and no Triton: :func:`choose_config` picks the tiles
(:class:`DecodeConfig`: a per-GPU tuned table where one has the key, else
:func:`heuristic_config`), and :func:`plan_launch` turns a launcher's shapes and variants
into a :class:`LaunchPlan`: the split rules (forced splits, the device planner's split
targets and smallest chunk, one unit per sequence or not, the grid's rows), the merge kernel
and its tile, the workspace's rows. Each rule says which rows it was measured on (an
H200); ``docs/perf-notes.md`` keeps the measurements and the alternatives that lost.
:class:`~pagedattn.launch.decode.AutoLauncher` asks this module and builds the launches;
tests and scripts patch or call these functions here.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedattn._validation import FP8_DTYPES, kernel_max_pages
from pagedattn.launch._common import block_d, cdiv, next_power_of_2
from pagedattn.spec import LaunchSpec

# split rows merged per vector step by the per-head merge, at most: the most rows a sequence
# can have (from shapes), so the usual split counts take one round (batch 1 at 32 k tokens:
# 64 rows, which two rounds of 32 merged slower than one)
_MERGE_MAX_BLOCK_R = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch choices for one (head_dim, group, cache dtype, page_size)."""

    block_n: int  # tokens per tile (may span several pages)
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # split target: SMs x this many units (about one wave when resident)
    min_chunk: int  # fewest tokens per split
    ragged_ctas_per_sm: int = 8  # the target for a ragged batch (mean length < max / 2)
    # batch_invariant=True: the fixed split size in tokens (a multiple of block_n), never
    # derived from the batch; 512 keeps b1-c4k at 64 units and b1-c32k at 512
    invariant_chunk: int = 512
    # register cap of the main kernel (Triton's ``maxnreg``), or None for ptxas's choice
    maxnreg: int | None = None
    # launch a per-group merge as a programmatic dependent of the main kernel where the GPU
    # has it (sm_90+): its launch overlaps the main kernel's tail
    pdl: bool = True
    # a plan owning its workspace merges a sequence's split rows in the last unit of each
    # (sequence, kv head) to arrive, where the merge is per group: no merge launch
    # (faster for 16-bit caches; fp8's kernel was slower with it)
    fold_merge: bool = False
    # ... and where the merge would be per query head (the pairs do not fill the SMs) when a
    # sequence holds at most this many split rows, known from shapes (the table's capacity
    # over min_chunk, or the forced count): the last unit's row loop stays short, and the
    # call launches one kernel
    fold_max_rows: int = 4
    # the token loop's online softmax without its clamp and selects, where every row of
    # every tile sees a key (one query token, no window, no soft-cap; the launcher checks):
    # scores as exactly rounded products (fewer loop instructions a tile; the issue-bound
    # fp8 kernel gains most)
    lean_softmax: bool = True
    # a token's offset within its page (slot and kv head) in int32 where every such offset
    # of both caches fits (the launcher checks the strides), the page's own in 64-bit
    slot_offsets_i32: bool = True


#: tuned tables, one per GPU model: ``tuned/<device name, non-alphanumerics as _>.json``,
#: written by ``scripts/sweep_decode.py --write-table`` on that GPU (none ships: the heuristic
#: serves every GPU)
_TUNED_DIR = Path(__file__).with_name("tuned")


def config_key(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int) -> str:
    return f"hd{head_dim}-g{group}-{str(cache_dtype).removeprefix('torch.')}-ps{page_size}"


def tuned_table_path(device_name: str) -> Path:
    return _TUNED_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


@functools.cache
def tuned_table(device_name: str) -> dict[str, dict]:
    """The tuned entries of one GPU model (empty when it has no table): read once per name."""
    path = tuned_table_path(device_name)
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("configs", {})


def heuristic_config(head_dim: int, group: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """The rule for GPUs (or keys) without a tuned entry, read off H200 sweeps: 16-bit caches
    take 64-token tiles 2 stages deep at head_dim 128 (128-token tiles 2 deep at head_dim ≤ 64;
    32-token tiles 3 deep at 256); fp8 caches 64-token tiles 3 deep (116 registers with V read
    as dim pairs); fp32 caches 64-token tiles 2 deep at head_dim ≤ 128 (with bf16x3 dots),
    16-token tiles 3 deep at 256. Splits target about one wave of four resident programs per
    SM (three for fp8 at head_dim ≤ 128, two for fp32, head_dim ≤ 64 and fp8 at 256), eight
    for ragged batches. A plan's merge is folded into the main kernel for 16-bit caches where
    it is per group, or where it would be per head and a sequence holds at most 4 split rows
    (faster on b1-c1k and on b8-c300's host path; even at 8 rows, slower from 16)."""
    bd = block_d(head_dim)
    if cache_dtype == torch.float32:
        # 64-token tiles 2 deep with bf16x3 dots: the fastest tile, stage and warp count of
        # the seed-fp32 sweep
        block_n, stages, ctas = (64, 2, 2) if bd <= 128 else (16, 3, 2)
    elif cache_dtype in FP8_DTYPES:
        # 64-token tiles: with V read as dim pairs (FP8_V_PAIRS) the kernel takes 116
        # registers, so four programs per SM (the 128-token tile took 255: two); a split
        # target of three per SM leaves b64-c8k's 512 sequence-heads unsplit
        block_n, stages, ctas = (64, 3, 3) if bd <= 128 else (64, 3, 2)
    elif bd <= 64:
        # 128-token tiles 2 deep: faster than 64 x 3 on hd64-b64-c2k in three explorations
        block_n, stages, ctas = 128, 2, 2
    elif bd <= 128:
        block_n, stages, ctas = 64, 2, 4
    else:
        block_n, stages, ctas = 32, 3, 4
    # the lean softmax and int32 slot offsets: faster on every 16-bit and fp8 row or even;
    # the fp32 kernel (bf16x3 dots) ran slower with them
    fast_loop = cache_dtype != torch.float32
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=stages, ctas_per_sm=ctas,
                        min_chunk=256,
                        fold_merge=cache_dtype in (torch.float16, torch.bfloat16),
                        lean_softmax=fast_loop, slot_offsets_i32=fast_loop)


def choose_config(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int,
                  interpret: bool, device_name: str | None = None,
                  ragged: bool = False) -> DecodeConfig:
    """The tuned entry of this GPU model when its table has the key, else the heuristic.
    Keyed on shapes and dtype only, so a new batch size or context length never recompiles
    (split sizing is a runtime argument of the kernel). ``ragged``: the caller's host copy of
    the lengths says the batch is ragged (mean under half the longest); 16-bit caches then
    pipeline one stage deeper (an H200 sweep: faster on the three ragged rows, slower on the
    uniform ones; 64-token tiles only)."""
    cfg = heuristic_config(head_dim, group, cache_dtype)
    if (ragged and cache_dtype in (torch.float16, torch.bfloat16) and cfg.num_stages == 2
            and cfg.block_n == 64):  # the head_dim-128 tiles of the sweep, not hd64's 128 x 2
        cfg = replace(cfg, num_stages=3, ctas_per_sm=cfg.ragged_ctas_per_sm)
    if interpret:  # the interpreter runs programs one by one: fewer, smaller is faster
        return replace(cfg, ctas_per_sm=1, ragged_ctas_per_sm=2, num_stages=1,
                       block_n=min(cfg.block_n, 32), min_chunk=128, invariant_chunk=64)
    tuned = tuned_table(device_name).get(config_key(head_dim, group, cache_dtype, page_size)) \
        if device_name else None
    if tuned:
        cfg = replace(cfg, **{k: v for k, v in tuned.items() if k in cfg.__dataclass_fields__})
    return cfg


# the widest sliding window (keys seen by the query) planned one unit per sequence: measured
# at 1,025 keys; 4,097 also won on a uniform batch, but a ragged one is unmeasured there
_WINDOW_UNIT_MAX_KEYS = 2048


def window_one_unit(*, batch: int, num_kv_heads: int, sms: int, window_left: int,
                    q_len: int, kv_dtype: torch.dtype, head_dim: int, batch_invariant: bool,
                    forced_splits: int) -> bool:
    """Plan a sliding window one unit per (sequence, kv head): no split and no merge.

    A window bounds every sequence's keys by ``window_left + q_len`` (plus the part of the
    first tile before the window), whatever ``context_lens`` holds, so the longest unit is
    known from shapes. When the pairs alone fill the GPU (at least 1.5 per SM), splitting
    them buys no parallelism and costs the partials' round trip and a merge launch: on the
    H200 a 1,024-token window ran faster unsplit on b64-c2k, the Azure
    batch and at batch 32, and slower at batch 16 (128 pairs). Measured for 16-bit caches at
    head_dim 128 and one query token; batch invariance
    keeps its fixed split size (a batch-size rule would make a sequence's arithmetic depend
    on the batch), and a forced ``num_splits`` is obeyed."""
    return (window_left >= 0 and window_left + q_len <= _WINDOW_UNIT_MAX_KEYS and q_len == 1
            and not batch_invariant and not forced_splits
            and kv_dtype in (torch.float16, torch.bfloat16) and block_d(head_dim) <= 128
            and 2 * batch * num_kv_heads >= 3 * sms)


def fp8_few_pairs(*, batch: int, num_kv_heads: int, sms: int, kv_dtype: torch.dtype,
                  head_dim: int) -> bool:
    """An fp8 plan of one query token whose (sequence, kv head) pairs are fewer than the SMs
    splits for four units per SM (the four 116-register programs resident), not the fp8
    default of three: on the H200 b1-c32k ran faster at four; b64-c8k (512 pairs) keeps
    three, where four cut each sequence in two and ran slower."""
    return (kv_dtype in FP8_DTYPES and block_d(head_dim) <= 128
            and batch * num_kv_heads < sms)


# programs per SM that the multi-token kernel's register cap keeps resident, at most: the split
# target (ctas_per_sm) may ask for more units than that (a ragged batch: eight per SM), which
# is a count of units to plan, not of programs resident at once
_MULTI_TOKEN_RESIDENT_MAX = 4


def multi_token_config(cfg: DecodeConfig, *, head_dim: int, kv_dtype: torch.dtype,
                       choose_tiles: bool) -> DecodeConfig:
    """The tiles, split target and register cap of a plan with ``q_len > 1`` (speculative
    decoding).

    Multi-token rows add live values: on sm_90 the q_len=4 kernel takes 168 registers, so
    three programs per SM fit where the one-token kernel (118) fits four, a slower call.
    The cap keeps ``min(ctas_per_sm, 4)`` programs resident (a ragged
    batch's split target of eight units per SM is not residency). For 16-bit caches at
    head_dim 65-128 (``choose_tiles``: the launcher's own choice, not a tuning override),
    32-token tiles 3 deep fit the 128 cap with no spill (64 x 2 spill 92 bytes), and a split
    target of three units per SM (four stay resident) ran faster than the capped 64 x 2
    tiles at four on b64-c2k (measured at q_len=4, group 4); a ragged
    batch keeps its own split target. fp32 caches at head_dim 65-128 keep 32-token tiles 3
    deep (their one-token 64 x 2 tiles were swept at q_len 1 only)."""
    bd = block_d(head_dim)
    if cfg.maxnreg is not None or bd > 128:
        return cfg
    cap = 65536 // (min(cfg.ctas_per_sm, _MULTI_TOKEN_RESIDENT_MAX) * cfg.num_warps * 32) // 8 * 8
    if choose_tiles and bd > 64 and kv_dtype in (torch.float16, torch.bfloat16):
        cfg = replace(cfg, block_n=32, num_stages=3,
                      ctas_per_sm=3 if cfg.ctas_per_sm <= 4 else cfg.ctas_per_sm)
    elif choose_tiles and bd > 64 and kv_dtype == torch.float32:
        # fp32's one-token 64 x 2 tiles take 255 registers with bf16x3 dots (swept at q_len
        # 1 only): multi-token rows keep the 32 x 3 tiles they ran before
        cfg = replace(cfg, block_n=32, num_stages=3)
    return replace(cfg, maxnreg=cap) if cap < 255 else cfg


def merge_per_group(batch: int, num_kv_heads: int, sms: int) -> bool:
    """One merge program per (sequence, kv head) when those fill the SMs, else one per
    (sequence, query head)."""
    return batch * num_kv_heads >= sms


@dataclass(frozen=True)
class LaunchPlan:
    """What :func:`plan_launch` decided for one launcher (see
    :class:`~pagedattn.launch.decode.AutoLauncher` for how each is used)."""

    config: DecodeConfig  # the tiles, after the plan's own adjustments
    max_pages: int  # the table's width as the kernels see it (int32 positions)
    window_left: int  # -1: no window (also a window at least the table's capacity)
    forced_splits: int  # 0: token-balanced on the device
    window_unit: bool  # a sliding window planned one unit per (sequence, kv head)
    target_units: int  # the device planner's split target (units), uniform batch
    target_units_ragged: int  # ... and ragged batch
    min_chunk: int  # fewest tokens per split (the fixed split under batch invariance)
    one_unit: bool  # one unit per sequence: no scan of the lengths, no merge
    rows_max: int  # split rows the grid and the workspace hold
    block_h: int  # the main kernel's tile rows (q_len x group, at least 16)
    per_group_merge: bool  # the merge: one program per (sequence, kv head), else per head
    fold_merge: bool  # the per-group merge runs in the main kernel's last unit per pair
    merge_block: int  # the per-group merge's BLOCK_H, or the per-head merge's BLOCK_R
    part_rows: int  # workspace rows of partials (split row x query token x query head)


def plan_launch(spec: LaunchSpec, *, config: DecodeConfig | None, interpret: bool, sms: int,
                device_name: str | None, owns_workspace: bool = True) -> LaunchPlan:
    """The launch plan of an :class:`~pagedattn.launch.decode.AutoLauncher`: its
    :class:`~pagedattn.spec.LaunchSpec` and the device facts (``interpret``, ``sms`` and
    ``device_name``, the GPU's name for its tuned table or ``None``). ``config`` replaces
    :func:`choose_config` (tuning) and turns off the plan's own tile adjustments.
    ``owns_workspace``: the launcher keeps one workspace for every launch (a plan's), so a
    merge may be folded (``fold_merge``).

    Raises:
        ValueError: ``num_splits`` past the partial rows the kernels index in int32.
    """
    batch, num_q_heads, num_kv_heads = spec.batch, spec.num_q_heads, spec.num_kv_heads
    head_dim, page_size, kv_dtype = spec.head_dim, spec.page_size, spec.kv_dtype
    q_len = spec.q_len
    num_splits, ragged = spec.num_splits, spec.ragged
    window_left, batch_invariant = spec.options.window_left, spec.options.batch_invariant
    max_pages = spec.max_pages
    group = spec.group
    # int32 safety: the kernels hold positions in 32 bits, so the table they see holds at
    # most MAX_CONTEXT_LEN tokens (max_pages * page_size past 2^31 wrapped: zeros, or
    # reads outside the cache), and a window at least that wide is no window (it sees
    # every key; n - q_len - window_left wrapped in the planner); both on the host, so
    # the kernels are unchanged
    max_pages = kernel_max_pages(max_pages, page_size)
    if window_left >= max_pages * page_size:
        window_left = -1
    cfg = config or choose_config(head_dim, group, kv_dtype, page_size, interpret, device_name,
                                  ragged and not batch_invariant)
    if q_len > 1:
        cfg = multi_token_config(cfg, head_dim=head_dim, kv_dtype=kv_dtype,
                                 choose_tiles=config is None and not interpret)
    # a split holds at least one tile: forced splits past the table's tiles would only
    # launch programs that find no token (the pieces are the same either way)
    forced_splits = min(int(num_splits or 0), max(1, cdiv(max_pages * page_size, cfg.block_n)))
    window_unit = window_one_unit(
        batch=batch, num_kv_heads=num_kv_heads, sms=sms, window_left=window_left,
        q_len=q_len, kv_dtype=kv_dtype, head_dim=head_dim, batch_invariant=batch_invariant,
        forced_splits=forced_splits)
    if window_unit and config is None and not interpret:
        # unsplit units run one window each: 32-token tiles 3 deep measured faster than
        # the split plan's 64 x 2 (or the ragged 64 x 3) on both rows
        cfg = replace(cfg, block_n=32, num_stages=3)
    if (config is None and not interpret and q_len == 1
            and fp8_few_pairs(batch=batch, num_kv_heads=num_kv_heads, sms=sms,
                              kv_dtype=kv_dtype, head_dim=head_dim)):
        cfg = replace(cfg, ctas_per_sm=4)
    target_units = sms * cfg.ctas_per_sm
    target_units_ragged = sms * cfg.ragged_ctas_per_sm
    # Σ ceil(len_b / chunk) <= total / chunk + batch <= target / num_kv_heads + batch
    # and each sequence has at most ceil(capacity / min_chunk) rows (chunks are never
    # shorter than min_chunk): a small table needs few programs
    capacity = max_pages * page_size
    # batch_invariant: every split is invariant_chunk tokens (rounded to whole tiles), so
    # a sequence has at most ceil(capacity / chunk) rows, whatever the others hold
    min_chunk = (cdiv(cfg.invariant_chunk, cfg.block_n) * cfg.block_n
                 if batch_invariant else cfg.min_chunk)
    # one unit per sequence, known from shapes: a forced single split, or a table too
    # small to hold more than the smallest chunk (every chunk is at least min_chunk, so
    # no sequence splits); the kernel then skips its scans and no merge is launched
    # (serving with a short max_model_len), or a sliding window whose (sequence, kv head)
    # pairs fill the GPU (window_one_unit)
    one_unit = window_unit or forced_splits == 1 or (
        not forced_splits and capacity <= min_chunk)
    if one_unit:
        rows_max = batch
    elif forced_splits:
        rows_max = batch * forced_splits
    elif batch_invariant:
        rows_max = batch * cdiv(capacity, min_chunk)
    else:
        rows_max = min(batch + cdiv(max(target_units, target_units_ragged), num_kv_heads),
                       batch * cdiv(capacity, cfg.min_chunk))
    # merge: one program per (sequence, kv head) when those fill the SMs (H200, batch 64:
    # faster than 2,048 mostly idle per-head programs), else one per (sequence, query
    # head) with split rows vectorized (batch 1: faster than the per-group row loop)
    # multi-token rows merge per group only; batch invariance needs one merge whatever
    # the batch size (the per-group row loop: a fixed order per sequence)
    per_group = merge_per_group(batch, num_kv_heads, sms) or q_len > 1 or batch_invariant
    # a sequence has at most ceil(capacity / min_chunk) rows (or the forced count)
    most_rows = forced_splits or min(rows_max, cdiv(capacity, min_chunk))
    # the merge folded into the main kernel (FOLD_MERGE): a plan that owns its workspace
    # (its arrival counters stay zeroed between launches), 16-bit caches (cfg.fold_merge),
    # split rows to merge; a per-head merge's plan folds (per group) when its sequences
    # hold few rows
    fold_merge = bool(cfg.fold_merge) and owns_workspace and not one_unit and (
        per_group or most_rows <= cfg.fold_max_rows)
    per_group = per_group or fold_merge
    if per_group:
        merge_block = max(2, next_power_of_2(q_len * group))
    else:
        merge_block = min(_MERGE_MAX_BLOCK_R, max(2, next_power_of_2(most_rows)))
    # the workspace: per split row and query head and query token (m, l) then acc
    part_rows = 0 if one_unit else rows_max * q_len * num_q_heads
    if part_rows >= 1 << 31:  # the kernels index partial rows (and programs) in int32
        most = (1 << 31) // (batch * q_len * num_q_heads)
        raise ValueError(f"num_splits: expected at most {most} splits for this batch "
                         f"(the kernels index the workspace's rows in int32), got "
                         f"{num_splits}")
    return LaunchPlan(
        config=cfg, max_pages=max_pages, window_left=window_left,
        forced_splits=forced_splits, window_unit=window_unit, target_units=target_units,
        target_units_ragged=target_units_ragged, min_chunk=min_chunk, one_unit=one_unit,
        rows_max=rows_max,
        # the query group (x q_len tokens) is the tile's rows: tl.dot needs >= 16 (padding
        # rows masked)
        block_h=max(16, next_power_of_2(q_len * group)),
        per_group_merge=per_group, fold_merge=fold_merge, merge_block=merge_block,
        part_rows=part_rows)

