"""Launcher of the production kernel (``impl="auto"``): the engine behind a decode plan.

:class:`AutoLauncher` is built once per decode step from shapes and dtypes (never from the
values of ``context_lens``: no host sync) and launched once per layer. It chooses the tiles
(:func:`choose_config`), sizes the grid and the workspace, and owns both; the kernel plans its
token-balanced splits on the device every launch, so a CUDA graph captured around a launch
replays correctly for any new lengths and block tables within the table's capacity.

Grid and workspace. Each program is one split unit (row ``r``, kv head). The device picks
``chunk = roundup(max(min_chunk, ceil(total_tokens · num_kv_heads / target_units)), BLOCK_N)``
with ``target_units = SMs · ctas_per_sm`` (about one wave of resident programs), so
``Σ_b ceil(len_b / chunk) ≤ target_units / num_kv_heads + batch``: the grid is
``rows_max · num_kv_heads`` programs with ``rows_max = batch + ceil(target_units /
num_kv_heads)`` (``batch · num_splits`` when forced), and programs past the last real row exit
after the scan of ``context_lens``.

One unit per sequence. When the shapes rule out any split (``num_splits=1``, or a table whose
capacity ``max_pages · page_size`` is at most the smallest chunk), the grid is ``batch ·
num_kv_heads`` programs, one per (sequence, kv head), the kernel skips its scans of
``context_lens`` (``ONE_UNIT``) and no merge is launched.

Launching. The first launch of a binding (the tensors' dtypes, strides and 16-byte alignment,
LSE on or off) goes through Triton's own ``kernel[grid](...)``, which compiles or finds the
binary. On Triton 3.6, where the call signature of a compiled kernel's ``run`` is known, the
launcher records that launch's argument list, and later launches of the binding fill in the
per-call pointers and scales and call ``CompiledKernel.run`` directly (the host path of
``kernel[grid]`` re-derives the specialization from every argument each call). Everything
else Triton specializes on (constexprs, integers, launch options) is fixed by the launcher,
so the records live in the launcher object (one per plan). Every tensor argument, the
workspace's included, is a per-call slot, so a record holds no tensor and no address. A
one-shot ``paged_decode`` launches through the launcher that :func:`one_shot_launcher` keeps
per static key (a bounded LRU cache of launch configurations and their records), with a
fresh workspace per call, so its repeats take the recorded path too. On any
other Triton version or under the interpreter every launch goes through ``kernel[grid]``;
launch hooks (profilers) are honoured on both paths. Calls with tensor scales always launch
through ``kernel[grid]``; ``sinks`` and ``alibi_slopes`` (per-layer tensors, validated as
``[num_q_heads]`` float32) are per-call slots of the record.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from pagedattn._env import device_name_for, is_interpreter, num_sms
from pagedattn._validation import FP8_DTYPES, kernel_max_pages
from pagedattn.kernels.decode import (
    _merge_per_group_kernel,
    _merge_per_head_kernel,
    _paged_decode_kernel,
)
from pagedattn.launch._common import LOG2E, block_d, cdiv, next_power_of_2

# split rows merged per vector step by the per-head merge, at most: the most rows a sequence
# can have (from shapes), so the usual split counts take one round (batch 1 at 32 k tokens:
# 64 rows, which two rounds of 32 merged slower than the floor's one: perf-notes step 23)
_MERGE_MAX_BLOCK_R = 64
# sequences scanned per vector step of the device-side split planner (context_lens loads)
_BLOCK_B = 128


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
    # has it (sm_90+): its launch overlaps the main kernel's tail (perf-notes step 32)
    pdl: bool = True


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
    """The rule for GPUs (or keys) without a tuned entry, read off the H200 sweeps recorded in
    ``docs/perf-notes.md`` (step 8): 16-bit caches take 64-token tiles 2 stages deep at head_dim
    128 (128-token tiles 2 deep at head_dim ≤ 64: step 32; 32-token tiles 3 deep at 256); fp8
    caches 64-token tiles 3 deep (step 28: 116 registers with V read as dim pairs); fp32 caches
    32-token tiles 3 deep (twice the bytes). Splits target about one wave of four resident
    programs per SM (three for fp8 at head_dim ≤ 128, two for fp32, head_dim ≤ 64 and fp8 at
    256), eight for ragged batches."""
    bd = block_d(head_dim)
    if cache_dtype == torch.float32:
        block_n, stages, ctas = (32, 3, 2) if bd <= 128 else (16, 3, 2)
    elif cache_dtype in FP8_DTYPES:
        # 64-token tiles: with V read as dim pairs (FP8_V_PAIRS) the kernel takes 116
        # registers, so four programs per SM (the 128-token tile took 255: two); a split
        # target of three per SM leaves b64-c8k's 512 sequence-heads unsplit (perf-notes step 28)
        block_n, stages, ctas = (64, 3, 3) if bd <= 128 else (64, 3, 2)
    elif bd <= 64:
        # 128-token tiles 2 deep: faster than 64 x 3 on hd64-b64-c2k in three explorations
        # (perf-notes steps 25 and 32: 0.7-1.0 µs eager)
        block_n, stages, ctas = 128, 2, 2
    elif bd <= 128:
        block_n, stages, ctas = 64, 2, 4
    else:
        block_n, stages, ctas = 32, 3, 4
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=stages, ctas_per_sm=ctas,
                        min_chunk=256)


def choose_config(head_dim: int, group: int, cache_dtype: torch.dtype, page_size: int,
                  interpret: bool, device_name: str | None = None,
                  ragged: bool = False) -> DecodeConfig:
    """The tuned entry of this GPU model when its table has the key, else the heuristic.
    Keyed on shapes and dtype only, so a new batch size or context length never recompiles
    (split sizing is a runtime argument of the kernel). ``ragged``: the caller's host copy of
    the lengths says the batch is ragged (mean under half the longest); 16-bit caches then
    pipeline one stage deeper (the H200 sweep of perf-notes step 8: faster on the three ragged
    rows, slower on the uniform ones; 64-token tiles only)."""
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


def _dot_dtype(cache_dtype: torch.dtype, interpret: bool):
    if cache_dtype in FP8_DTYPES:
        return tl.float16  # fp8 -> fp16 converts in hardware; the query is range-scaled first
    if cache_dtype == torch.bfloat16:
        return tl.float32 if interpret else tl.bfloat16  # interpreter bf16 dots are garbage
    return {torch.float16: tl.float16}.get(cache_dtype, tl.float32)


def _dot_precision(cache_dtype: torch.dtype) -> str:
    """fp32 operands: split-TF32 (three tensor-core passes, fp32-level accuracy; plain tf32
    would miss the 1e-4 contract)."""
    return "tf32x3" if cache_dtype == torch.float32 else "tf32"


def fp8_v_pairs(value_cache: torch.Tensor, head_dim: int) -> int:
    """The ``FP8_V_PAIRS`` constexpr of a launch: 1 (e4m3) or 2 (e5m2) when an fp8 value cache
    can be read as 16-bit pairs of dims (unit dim stride, the other strides multiples of 16
    bytes, an even head_dim, a 16-byte aligned base: all part of a launch's binding), else 0
    (bytes, as before). Pairs transpose through shared memory like fp16 (perf-notes step 28)."""
    if (value_cache.dtype not in FP8_DTYPES or head_dim % 2 or value_cache.stride(-1) != 1
            or any(st % 16 for st in value_cache.stride()[:-1])
            or value_cache.data_ptr() % 16):
        return 0
    return 1 if value_cache.dtype == torch.float8_e4m3fn else 2


def _direct_launch_supported() -> bool:
    """``CompiledKernel[grid](*args)`` takes every argument of the kernel in order (constexpr
    slots included) on Triton 3.6 (checked by the GPU tests against ``kernel[grid]``);
    elsewhere every launch binds through ``kernel[grid](**kwargs)``."""
    return triton.__version__.split(".")[:2] == ["3", "6"] and not is_interpreter()


#: the per-call arguments of each kernel, in the order :meth:`AutoLauncher.launch` fills them
#: into a recorded launch (everything else is fixed by the binding and the launcher)
_MAIN_SLOTS = ("query_ptr", "key_cache_ptr", "value_cache_ptr", "block_tables_ptr",
               "context_lens_ptr", "out_ptr", "lse_ptr", "sinks_ptr", "alibi_ptr",
               "scale_log2", "k_scale_val", "v_scale_val", "part_ml_ptr", "part_acc_ptr",
               "seq_rows_ptr", "k_scale_ptr", "v_scale_ptr")
_MERGE_SLOTS = ("context_lens_ptr", "out_ptr", "lse_ptr", "sinks_ptr", "part_ml_ptr",
                "part_acc_ptr", "seq_rows_ptr")
#: bindings kept per launcher (a plan sees one or two in practice: with and without LSE)
_MAX_BINDINGS = 16


def _hooks() -> tuple:
    """Triton's launch hooks (profilers), ``None`` for a chain with no hook: Triton 3.6's
    hooks are ``HookChain`` objects, never ``None``, so without this every launch would build
    launch metadata and make two calls into empty chains."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if type(enter) is knobs.HookChain and not enter.calls:
        enter = None
    if type(leave) is knobs.HookChain and not leave.calls:
        leave = None
    return enter, leave


def _launch_compiled(compiled, grid: tuple[int, int, int], stream: int, args: list,
                     enter, leave) -> None:
    """What ``kernel[grid](...)`` ends with on Triton 3.6 (``CompiledKernel.__getitem__``'s
    runner, without building a closure per call); ``enter``/``leave`` are Triton's launch
    hooks (:func:`_hooks`), honoured as Triton does."""
    metadata = (compiled.launch_metadata(grid, stream, *args)
                if enter is not None or leave is not None else None)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *args)


def _recorded(kernel, args: dict, slots: tuple[str, ...]) -> tuple[list, tuple[int, ...]]:
    """``kernel``'s arguments in parameter order with ``None`` in the per-call ``slots``, and
    the positions of those slots. Every tensor argument is a slot (the caller's tensors and
    the workspace), so a record holds no tensor and no address: it is a function of the
    launcher's shapes and the binding alone."""
    names = kernel.arg_names
    rec = [None if n in slots else args[n] for n in names]
    assert not any(isinstance(a, torch.Tensor) for a in rec), "a tensor argument is no slot"
    return rec, tuple(names.index(n) for n in slots)


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
    H200 (perf-notes step 25) a 1,024-token window ran faster unsplit on b64-c2k, the Azure
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
    default of three: on the H200 (perf-notes step 28) b1-c32k ran 38.6 µs at four against
    41.6 at three; b64-c8k (512 pairs) keeps three, where four cut each sequence in two
    (312.8 against 308.4 µs)."""
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
    three programs per SM fit where the one-token kernel (118) fits four, a slower call
    (perf-notes step 15). The cap keeps ``min(ctas_per_sm, 4)`` programs resident (a ragged
    batch's split target of eight units per SM is not residency). For 16-bit caches at
    head_dim 65-128 (``choose_tiles``: the launcher's own choice, not a tuning override),
    32-token tiles 3 deep fit the 128 cap with no spill (64 x 2 spill 92 bytes), and a split
    target of three units per SM (four stay resident) ran faster than the capped 64 x 2
    tiles at four on b64-c2k (perf-notes step 26; measured at q_len=4, group 4); a ragged
    batch keeps its own split target."""
    bd = block_d(head_dim)
    if cfg.maxnreg is not None or bd > 128:
        return cfg
    cap = 65536 // (min(cfg.ctas_per_sm, _MULTI_TOKEN_RESIDENT_MAX) * cfg.num_warps * 32) // 8 * 8
    if choose_tiles and bd > 64 and kv_dtype in (torch.float16, torch.bfloat16):
        cfg = replace(cfg, block_n=32, num_stages=3,
                      ctas_per_sm=3 if cfg.ctas_per_sm <= 4 else cfg.ctas_per_sm)
    return replace(cfg, maxnreg=cap) if cap < 255 else cfg


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): compute capability 9.0 and up."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def merge_per_group(batch: int, num_kv_heads: int, sms: int) -> bool:
    """One merge program per (sequence, kv head) when those fill the SMs, else one per
    (sequence, query head)."""
    return batch * num_kv_heads >= sms


class AutoLauncher:
    """Everything one decode step launches, decided from shapes: see the module docstring.

    Args:
        batch, max_pages: ``block_tables``' shape.
        num_q_heads, num_kv_heads, head_dim, page_size: the model's attention shapes.
        q_dtype: the query's dtype; ``kv_dtype``: the caches' (the query's, or fp8).
        device: where the tensors live.
        num_splits: forced splits per sequence, or ``None`` (token-balanced on the device).
        config: a :class:`DecodeConfig` to use instead of :func:`choose_config` (tuning).
        ragged: the caller knows the batch is ragged (from a host copy of the lengths).
        q_len, window_left, softcap, batch_invariant: the plan-time variants (see
            :func:`pagedattn.plan_decode`); each is a constexpr of the kernels, off by default.
        record: record each binding's launch for the direct path of later launches (see the
            module docstring); ``False`` for a launcher that launches once, which saves the
            record's host time.
        workspace: own a workspace, used by every launch (a plan's launcher); ``False`` for a
            launcher shared by one-shot calls (:func:`one_shot_launcher`): each of its
            launches passes a fresh :meth:`new_workspace`.
    """

    def __init__(self, *, batch: int, max_pages: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, num_splits: int | None,
                 config: DecodeConfig | None = None, ragged: bool = False, q_len: int = 1,
                 window_left: int = -1, softcap: float | None = None,
                 batch_invariant: bool = False, record: bool = True, workspace: bool = True):
        interpret = is_interpreter()
        on_gpu = device.type == "cuda"
        group = num_q_heads // num_kv_heads
        # int32 safety: the kernels hold positions in 32 bits, so the table they see holds at
        # most MAX_CONTEXT_LEN tokens (max_pages * page_size past 2^31 wrapped: zeros, or
        # reads outside the cache), and a window at least that wide is no window (it sees
        # every key; n - q_len - window_left wrapped in the planner); both on the host, so
        # the kernels are unchanged
        max_pages = kernel_max_pages(max_pages, page_size)
        if window_left >= max_pages * page_size:
            window_left = -1
        self.config = cfg = config or choose_config(
            head_dim, group, kv_dtype, page_size, interpret,
            device_name_for(device) if on_gpu else None, ragged and not batch_invariant)
        bd = block_d(head_dim)
        if q_len > 1:
            self.config = cfg = multi_token_config(
                cfg, head_dim=head_dim, kv_dtype=kv_dtype,
                choose_tiles=config is None and not interpret)
        self.q_len, self.window_left, self.softcap = q_len, window_left, softcap
        self.batch_invariant = batch_invariant
        self.batch, self.num_q_heads, self.num_kv_heads = batch, num_q_heads, num_kv_heads
        self.group, self.page_size, self.max_pages = group, page_size, max_pages
        self.device = device
        # a split holds at least one tile: forced splits past the table's tiles would only
        # launch programs that find no token (the pieces are the same either way)
        self.forced_splits = min(int(num_splits or 0),
                                 max(1, cdiv(max_pages * page_size, cfg.block_n)))
        self.block_d = bd
        self.head_dim = head_dim
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if on_gpu else 4
        self.window_unit = window_one_unit(
            batch=batch, num_kv_heads=num_kv_heads, sms=sms, window_left=window_left,
            q_len=q_len, kv_dtype=kv_dtype, head_dim=head_dim,
            batch_invariant=batch_invariant, forced_splits=self.forced_splits)
        if self.window_unit and config is None and not interpret:
            # unsplit units run one window each: 32-token tiles 3 deep measured faster than
            # the split plan's 64 x 2 (or the ragged 64 x 3) on both rows (perf-notes step 25)
            self.config = cfg = replace(cfg, block_n=32, num_stages=3)
        if (config is None and not interpret and q_len == 1
                and fp8_few_pairs(batch=batch, num_kv_heads=num_kv_heads, sms=sms,
                                  kv_dtype=kv_dtype, head_dim=head_dim)):
            self.config = cfg = replace(cfg, ctas_per_sm=4)
        self.target_units = sms * cfg.ctas_per_sm
        self.target_units_ragged = sms * cfg.ragged_ctas_per_sm
        # Σ ceil(len_b / chunk) <= total / chunk + batch <= target / num_kv_heads + batch
        # and each sequence has at most ceil(capacity / min_chunk) rows (chunks are never
        # shorter than min_chunk): a small table needs few programs
        capacity = max_pages * page_size
        # batch_invariant: every split is invariant_chunk tokens (rounded to whole tiles), so
        # a sequence has at most ceil(capacity / chunk) rows, whatever the others hold
        self.min_chunk = (cdiv(cfg.invariant_chunk, cfg.block_n) * cfg.block_n
                          if batch_invariant else cfg.min_chunk)
        # one unit per sequence, known from shapes: a forced single split, or a table too
        # small to hold more than the smallest chunk (every chunk is at least min_chunk, so
        # no sequence splits); the kernel then skips its scans and no merge is launched
        # (serving with a short max_model_len: perf-notes step 20), or a sliding window
        # whose (sequence, kv head) pairs fill the GPU (window_one_unit: step 25)
        self.one_unit = self.window_unit or self.forced_splits == 1 or (
            not self.forced_splits and capacity <= self.min_chunk)
        if self.one_unit:
            self.rows_max = batch
        elif self.forced_splits:
            self.rows_max = batch * self.forced_splits
        elif batch_invariant:
            self.rows_max = batch * cdiv(capacity, self.min_chunk)
        else:
            self.rows_max = min(batch + cdiv(max(self.target_units,
                                                        self.target_units_ragged),
                                                    num_kv_heads),
                                batch * cdiv(capacity, cfg.min_chunk))
        self.grid = (self.rows_max * num_kv_heads, 1, 1)
        self.main_constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=cfg.block_n,
            BLOCK_B=_BLOCK_B,
            # the query group (x q_len tokens) is the tile's rows: tl.dot needs >= 16
            # (padding rows masked)
            BLOCK_H=max(16, next_power_of_2(q_len * group)),
            PAGE_SIZE=page_size, DOT_DTYPE=_dot_dtype(kv_dtype, interpret),
            DOT_PRECISION=_dot_precision(kv_dtype),
            Q_POW2_SCALE=kv_dtype in FP8_DTYPES and q_dtype != torch.float16,
            Q_LEN=q_len, HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap is not None,
            BATCH_INVARIANT=batch_invariant, ONE_UNIT=self.one_unit,
        )
        # merge: one program per (sequence, kv head) when those fill the SMs (H200, batch 64:
        # faster than 2,048 mostly idle per-head programs), else one per (sequence, query
        # head) with split rows vectorized (batch 1: faster than the per-group row loop)
        # multi-token rows merge per group only; batch invariance needs one merge whatever
        # the batch size (the per-group row loop: a fixed order per sequence)
        per_group = merge_per_group(batch, num_kv_heads, sms) or q_len > 1 or batch_invariant
        # the per-group merge as a programmatic dependent launch: its programs start during
        # the main kernel's tail and wait in griddepcontrol.wait; on the H200 1.4-2.0 µs faster
        # eager on five rows, graph replays within 0.7 µs; the per-head merge (b1, b8) lost up
        # to 2.7 µs in graph replays with it, so it launches as before (perf-notes step 32).
        # Off without a merge, under the interpreter and before sm_90: the code is unchanged
        self.pdl = bool(cfg.pdl) and per_group and on_gpu and not interpret and (
            not self.one_unit) and pdl_supported(device.index if device.index is not None
                                                 else torch.cuda.current_device())
        self.main_constexprs["PDL"] = self.pdl
        self.merge_kernel = _merge_per_group_kernel if per_group else _merge_per_head_kernel
        self.merge_grid = (batch, num_kv_heads if per_group else num_q_heads, 1)
        self.merge_constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=bd)
        if per_group:
            self.merge_constexprs["BLOCK_H"] = max(2, next_power_of_2(q_len * group))
            self.merge_constexprs["Q_LEN"] = q_len
            self.merge_constexprs["PDL"] = self.pdl
        else:  # a sequence has at most ceil(capacity / min_chunk) rows (or the forced count)
            most_rows = self.forced_splits or min(self.rows_max, cdiv(capacity, self.min_chunk))
            self.merge_constexprs["BLOCK_R"] = min(_MERGE_MAX_BLOCK_R,
                                                   max(2, next_power_of_2(most_rows)))
        # the workspace: per split row and query head and query token (m, l) then acc
        # (fp32), then the [batch, 2] int32 (start_b, n_b)
        part_rows = 0 if self.one_unit else self.rows_max * q_len * num_q_heads
        if part_rows >= 1 << 31:  # the kernels index partial rows (and programs) in int32
            most = (1 << 31) // (batch * q_len * num_q_heads)
            raise ValueError(f"num_splits: expected at most {most} splits for this batch "
                             f"(the kernels index the workspace's rows in int32), got "
                             f"{num_splits}")
        self._n_ml = -(-part_rows * 2 // 4) * 4  # acc starts 16-byte aligned
        self._n_acc = part_rows * bd
        # a plan's launcher owns one (reused by each run); a shared one (one-shot calls)
        # owns none and takes a fresh one per call
        self.workspace = self.new_workspace() if workspace else None
        self.part_ml, self.part_acc, self.seq_rows = self.workspace or (None, None, None)
        # recorded launches of this launcher, one per binding (see launch): every integer,
        # constexpr and launch option is fixed by the launcher, so the binding is the
        # tensors' dtypes, strides and 16-byte alignment and whether LSE is written; the
        # records hold no tensor and no address (the workspace's are per-call slots too)
        self._direct = (record and on_gpu and device.index is not None
                        and _direct_launch_supported())
        self._bindings: dict[tuple, tuple] = {}
        self._get_stream = driver.active.get_current_stream if self._direct else None

    def new_workspace(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fresh workspace ``(part_ml, part_acc, seq_rows)`` for this launcher's shapes, one
        allocation on the current stream (the caching allocator's, so a CUDA graph captured
        around the launch keeps its own)."""
        n_ml, n_acc = self._n_ml, self._n_acc
        work = torch.empty(n_ml + n_acc + 2 * self.batch, dtype=torch.float32,
                           device=self.device)
        seq_rows = work[n_ml + n_acc:].view(torch.int32)
        # the main kernel writes an entry per non-empty sequence only; the per-group merge
        # loads the entry of an empty one too (beside its length, in one round) and ignores
        # it: zeroed here, that load never reads uninitialized memory (initcheck); one unit
        # per sequence never writes or reads it (and skips this fill kernel)
        if not self.one_unit:
            seq_rows.zero_()
        return work[:n_ml], work[n_ml:n_ml + n_acc], seq_rows

    def launch(self, query, key_cache, value_cache, block_tables, context_lens, out, lse, *,
               scale: float, k_scale=None, v_scale=None, sinks=None, alibi_slopes=None,
               workspace=None) -> dict[str, object]:
        """Launch the main kernel and the merge on the current stream. Caches arrive as
        NHD-shaped views (HND is a stride permutation); inputs are validated by the API.
        ``query``/``out`` are ``[batch, q_len, num_q_heads, head_dim]`` when ``q_len > 1``.
        ``sinks`` and ``alibi_slopes`` are contiguous ``[num_q_heads]`` float32 (the API makes
        them so). ``workspace``: a :meth:`new_workspace` for this launch, or ``None`` for the
        launcher's own. Returns the compiled kernels launched, by name (compile metadata for
        the tools)."""
        part_ml, part_acc, seq_rows = workspace or self.workspace
        tensor_scales = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
        key = None
        if self._direct and not tensor_scales:
            q_ptr, k_ptr, v_ptr = query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()
            bt_ptr, cl_ptr, out_ptr = (block_tables.data_ptr(), context_lens.data_ptr(),
                                       out.data_ptr())
            ml_ptr = part_ml.data_ptr()
            # the binding: what Triton specializes on beyond the launcher's fixed choices (the
            # workspace's parts are aligned with its base: new_workspace's offsets are
            # multiples of 16 bytes)
            key = (lse is None, query.dtype, query.stride(), key_cache.dtype,
                   key_cache.stride(), value_cache.dtype, value_cache.stride(), out.dtype,
                   out.stride(), block_tables.dtype, block_tables.stride(),
                   context_lens.dtype, context_lens.stride(), q_ptr % 16 == 0,
                   k_ptr % 16 == 0, v_ptr % 16 == 0, bt_ptr % 16 == 0, cl_ptr % 16 == 0,
                   out_ptr % 16 == 0, ml_ptr % 16 == 0,
                   None if sinks is None else (sinks.dtype, sinks.data_ptr() % 16 == 0),
                   None if alibi_slopes is None else (alibi_slopes.dtype,
                                                      alibi_slopes.data_ptr() % 16 == 0))
            entry = self._bindings.get(key)
            if entry is not None:
                main, merge, main_args, merge_args, main_slots, merge_slots, compiled = entry
                # unused pointers (flags off) point at the workspace, never read
                lse_ptr = lse.data_ptr() if lse is not None else ml_ptr
                sinks_ptr = sinks.data_ptr() if sinks is not None else ml_ptr
                acc_ptr, rows_ptr = part_acc.data_ptr(), seq_rows.data_ptr()
                args = main_args.copy()
                (args[main_slots[0]], args[main_slots[1]], args[main_slots[2]],
                 args[main_slots[3]], args[main_slots[4]], args[main_slots[5]],
                 args[main_slots[6]], args[main_slots[7]], args[main_slots[8]],
                 args[main_slots[9]], args[main_slots[10]], args[main_slots[11]],
                 args[main_slots[12]], args[main_slots[13]], args[main_slots[14]],
                 args[main_slots[15]], args[main_slots[16]]) = (
                    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, lse_ptr, sinks_ptr,
                    alibi_slopes.data_ptr() if alibi_slopes is not None else ml_ptr,
                    scale * LOG2E, 1.0 if k_scale is None else float(k_scale),
                    1.0 if v_scale is None else float(v_scale), ml_ptr, acc_ptr, rows_ptr,
                    ml_ptr, ml_ptr)
                stream = self._get_stream(self.device.index)
                enter, leave = _hooks()
                _launch_compiled(main, self.grid, stream, args, enter, leave)
                if merge is None:
                    return compiled
                args = merge_args.copy()
                (args[merge_slots[0]], args[merge_slots[1]], args[merge_slots[2]],
                 args[merge_slots[3]], args[merge_slots[4]], args[merge_slots[5]],
                 args[merge_slots[6]]) = (cl_ptr, out_ptr, lse_ptr, sinks_ptr, ml_ptr, acc_ptr,
                                          rows_ptr)
                _launch_compiled(merge, self.merge_grid, stream, args, enter, leave)
                return compiled
        multi = self.q_len > 1  # a 4-D query and out
        k_t = v_t = None
        if tensor_scales:  # both as tensors: one specialization for the pair
            k_t, v_t = (s if isinstance(s, torch.Tensor) else torch.full(
                (), 1.0 if s is None else float(s), device=self.device)
                for s in (k_scale, v_scale))
        main_args = dict(
            query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
            block_tables_ptr=block_tables, context_lens_ptr=context_lens, out_ptr=out,
            lse_ptr=lse if lse is not None else part_ml,
            part_ml_ptr=part_ml, part_acc_ptr=part_acc, seq_rows_ptr=seq_rows,
            k_scale_ptr=k_t if tensor_scales else part_ml,
            v_scale_ptr=v_t if tensor_scales else part_ml,
            stride_k_scale=k_t.stride(0) if tensor_scales and k_t.dim() == 1 else 0,
            stride_v_scale=v_t.stride(0) if tensor_scales and v_t.dim() == 1 else 0,
            k_scale_val=1.0 if tensor_scales or k_scale is None else float(k_scale),
            v_scale_val=1.0 if tensor_scales or v_scale is None else float(v_scale),
            scale_log2=scale * LOG2E,
            sinks_ptr=part_ml if sinks is None else sinks,
            alibi_ptr=part_ml if alibi_slopes is None else alibi_slopes,
            window_left=max(self.window_left, 0),
            softcap=1.0 if self.softcap is None else float(self.softcap),
            stride_q_t=query.stride(1) if multi else 0,
            stride_o_t=out.stride(1) if multi else 0,
            batch=self.batch, num_kv_heads=self.num_kv_heads, group=self.group,
            max_pages=self.max_pages, forced_splits=self.forced_splits,
            min_chunk=self.min_chunk, target_units=self.target_units,
            target_units_ragged=self.target_units_ragged,
            stride_q_b=query.stride(0), stride_q_h=query.stride(-2),
            stride_q_d=query.stride(-1),
            stride_k_page=key_cache.stride(0), stride_k_tok=key_cache.stride(1),
            stride_k_head=key_cache.stride(2), stride_k_d=key_cache.stride(3),
            stride_v_page=value_cache.stride(0), stride_v_tok=value_cache.stride(1),
            stride_v_head=value_cache.stride(2), stride_v_d=value_cache.stride(3),
            stride_bt_b=block_tables.stride(0), stride_bt_p=block_tables.stride(1),
            stride_ctx=context_lens.stride(0),
            stride_o_b=out.stride(0), stride_o_h=out.stride(-2), stride_o_d=out.stride(-1),
            SCALE_FROM_PTR=tensor_scales, HAS_LSE=lse is not None,
            FP8_V_PAIRS=fp8_v_pairs(value_cache, self.head_dim), FP8_ASM=not is_interpreter(),
            HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None,
            **self.main_constexprs,
        )
        merge_args = dict(
            context_lens_ptr=context_lens, part_ml_ptr=part_ml,
            part_acc_ptr=part_acc, seq_rows_ptr=seq_rows, out_ptr=out,
            lse_ptr=main_args["lse_ptr"], sinks_ptr=main_args["sinks_ptr"],
            num_q_heads=self.num_q_heads, group=self.group,
            page_size=self.page_size, max_pages=self.max_pages,
            stride_ctx=context_lens.stride(0), stride_o_b=out.stride(0),
            stride_o_h=out.stride(-2), stride_o_d=out.stride(-1),
            stride_o_t=main_args["stride_o_t"],
            HAS_LSE=lse is not None, HAS_SINKS=sinks is not None, **self.merge_constexprs,
        )
        cfg = self.config
        main = _paged_decode_kernel[self.grid](**main_args, num_warps=cfg.num_warps,
                                               num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
        compiled = {"paged_decode": main}
        merge = None
        if not self.one_unit:
            merge = self.merge_kernel[self.merge_grid](
                **merge_args, num_warps=4, **({"launch_pdl": True} if self.pdl else {}))
            compiled["paged_decode_merge"] = merge
        if key is not None:
            if len(self._bindings) >= _MAX_BINDINGS:
                self._bindings.clear()
            main_rec, main_slots = _recorded(_paged_decode_kernel, main_args, _MAIN_SLOTS)
            merge_rec, merge_slots = (_recorded(self.merge_kernel, merge_args, _MERGE_SLOTS)
                                      if merge is not None else (None, None))
            self._bindings[key] = (main, merge, main_rec, merge_rec, main_slots, merge_slots,
                                   compiled)
        return compiled


#: shared one-shot launchers kept, at most (least recently used dropped first): each holds its
#: launch configuration and at most ``_MAX_BINDINGS`` records, no tensor and no address
ONE_SHOT_CACHE_SIZE = 64


@functools.lru_cache(maxsize=ONE_SHOT_CACHE_SIZE)
def one_shot_launcher(batch: int, max_pages: int, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, page_size: int, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype, device: torch.device, num_splits: int | None,
                      q_len: int, window_left: int, softcap: float | None,
                      batch_invariant: bool) -> AutoLauncher:
    """The launcher that every one-shot ``paged_decode`` of these shapes, dtypes, device and
    variants shares (its arguments are the key; ``ragged`` is off, as a one-shot call has no
    host copy of the lengths).

    What it caches is a pure function of the key: the launch configuration (tiles, grid,
    merge, constexprs) and, per binding, the recorded launch (the compiled kernels and their
    argument list with every tensor argument a per-call slot). It owns no workspace: each
    launch passes a fresh one (:meth:`AutoLauncher.new_workspace`, through the caching
    allocator on the current stream), so calls on different streams, or captured in
    different CUDA graphs, never share scratch. Context lengths, block tables, queries and
    caches are per call and never part of the key."""
    return AutoLauncher(batch=batch, max_pages=max_pages, num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                        q_dtype=q_dtype, kv_dtype=kv_dtype, device=device,
                        num_splits=num_splits, q_len=q_len, window_left=window_left,
                        softcap=softcap, batch_invariant=batch_invariant, workspace=False)
