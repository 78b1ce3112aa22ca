"""Helpers of the hardening tests (issue 6): NaN-poisoned runs, the oracle check, scratch
poisoning, hand-built block tables, the tile boundaries of each impl, and bit-for-bit
comparisons of poisoned pages.

Not a test module (no ``test_`` prefix); the test files of every folder import it by name
(pyproject.toml's pytest ``pythonpath`` puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedattn
from pagedattn._env import is_interpreter
from pagedattn.reference import ReferenceOutput, paged_decode_reference
from pagedattn.testing import PagedInputs, rel_l2_error, tolerance_for

IMPLS = list(pagedattn.IMPLS)
STAGES = list(pagedattn.STAGES)
# the impls run by a launcher of the stage signature (every impl but the planned one): the
# study's stages and any impl added beside them
LAUNCHER_IMPLS = [name for name, spec in pagedattn.IMPLS.items() if spec.launcher is not None]
# the impls the table marks without the variants (a new impl starts there)
NO_VARIANT_IMPLS = [name for name, spec in pagedattn.IMPLS.items() if not spec.variants]
# the impls that honour num_splits, from the impl table's capabilities
SPLIT_IMPLS = [name for name, spec in pagedattn.IMPLS.items() if spec.splits]
NAN = float("nan")


def sizes(cpu: dict, natural: dict) -> list:
    """Two size variants of one case: ``cpu`` (tiny, keeps the trigger; runs everywhere) and
    ``natural`` (the case's own sizes; marked ``gpu``). Each dict gains ``"cpu": bool``."""
    return [pytest.param({**cpu, "cpu": True}, id="cpu"),
            pytest.param({**natural, "cpu": False}, id="natural", marks=pytest.mark.gpu)]


def run(impl: str, inputs, **kw):
    """``paged_decode`` into a NaN-poisoned ``out``; returns ``out`` or ``(out, lse)``."""
    out = torch.full_like(inputs[0], NAN, memory_format=torch.contiguous_format)
    result = pagedattn.paged_decode(*inputs, impl=impl, out=out, **kw)
    if kw.get("return_lse"):
        assert result.out is out
        return result
    assert result is out
    return out


def check(out: torch.Tensor, inputs, dtype: torch.dtype | None = None,
          **ref_kw) -> ReferenceOutput:
    """Assert ``out`` is finite and within the contract's tolerance of the float64 oracle."""
    ref = paged_decode_reference(*inputs, **ref_kw)
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    err = rel_l2_error(out, ref.out)
    tol = tolerance_for(dtype if dtype is not None else inputs[1].dtype)
    assert err <= tol, f"relative L2 error {err:.3g} > {tol:.0e}"
    return ref


def check_lse(lse: torch.Tensor, ref: ReferenceOutput | torch.Tensor, rtol: float = 1e-5,
              atol: float = 1e-4) -> None:
    """LSE: ``-inf`` exactly where the reference is (empty rows), else finite and close.
    ``ref``: the oracle's output, or its LSE tensor (a slice of it). The LSE is fp32 from
    fp32-accumulated scores of exact inputs, hence the tight defaults."""
    lse64 = lse.detach().double().cpu()
    ref_lse = (ref if isinstance(ref, torch.Tensor) else ref.lse).cpu()
    assert lse64.shape == ref_lse.shape, (lse64.shape, ref_lse.shape)
    empty = torch.isneginf(ref_lse)
    assert torch.isneginf(lse64[empty]).all()
    assert torch.isfinite(lse64[~empty]).all()
    torch.testing.assert_close(lse64[~empty], ref_lse[~empty], rtol=rtol, atol=atol)


def poison_scratch(monkeypatch) -> None:
    """Make every ``torch.empty`` (the launchers' workspaces) come back poisoned: NaN for
    floats, -1 for integers. A kernel that reads scratch it did not write then fails."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(NAN)
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def used_slots(block_tables, context_lens, num_pages: int, page_size: int) -> torch.Tensor:
    """``[num_pages, page_size]`` bool: the cache slots some sequence attends to."""
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for row, n in zip(block_tables.cpu().tolist(), context_lens.cpu().tolist(), strict=True):
        for j in range(math.ceil(n / page_size)):
            used[row[j], : min(page_size, n - j * page_size)] = True
    return used


def paged_batch(context_lens, block_tables, num_pages: int, *, num_q_heads: int,
                num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                fill: float = NAN, seed: int = 0, device="cpu") -> PagedInputs:
    """A batch with the given block tables: random K/V/query, and every slot no sequence
    attends to (tails of last pages, pages only padding refers to) set to ``fill``."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    tables = torch.as_tensor(block_tables, dtype=torch.int32)
    lens = torch.as_tensor(context_lens, dtype=torch.int32)
    free = ~used_slots(tables, lens, num_pages, page_size)
    k[free] = fill
    v[free] = fill
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=g)
    return PagedInputs(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
                       tables.to(device), lens.to(device))


def tile_sizes(impl: str, *, head_dim: int, group: int, dtype: torch.dtype,
               page_size: int) -> list[int]:
    """Token-tile sizes an impl walks in (besides the page), as its launcher picks them here
    (the interpreter's tiles are smaller): masking must hold at each."""
    if impl == "auto":
        from pagedattn.launch.policy import choose_config
        cfg = choose_config(head_dim, group, dtype, page_size, is_interpreter())
        return [cfg.block_n, cfg.min_chunk]  # MIN_CHUNK: the automatic split granularity
    if impl == "gqa_reuse_v3":
        from pagedattn.launch.stages import _V3_SLICE_ELEMENTS
        bd = 1 << (head_dim - 1).bit_length()
        bg = 1 << (group - 1).bit_length()
        return [max(1, min(1 << (page_size - 1).bit_length(), _V3_SLICE_ELEMENTS // (bg * bd)))]
    return []  # the other stages walk one token at a time


def boundary_lengths(impl: str, *, head_dim: int, group: int, dtype: torch.dtype,
                     page_size: int, multiples=(1, 2)) -> list[int]:
    """Lengths at and around every page and tile boundary of ``impl`` (k·size - 1, k·size,
    k·size + 1), plus length 1."""
    lens = {1}
    for size in [page_size, *tile_sizes(impl, head_dim=head_dim, group=group, dtype=dtype,
                                          page_size=page_size)]:
        for k in multiples:
            lens.update(n for n in (k * size - 1, k * size, k * size + 1) if n >= 1)
    return sorted(lens)


def fp8_quantize(x: torch.Tensor, scale, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Store ``x / scale`` in fp8 (``scale`` a float or a ``[num_kv_heads]`` tensor), so that
    ``stored * scale`` dequantizes back to about ``x``. NaN stays NaN."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.dim() == 1:  # per kv head: the cache's dim 2 (NHD)
        s = s[None, None, :, None]
    return (x.float() / s).to(dtype)


def head_values(device, seed: int, low: float, high: float, n: int) -> torch.Tensor:
    """``[n]`` float32 values uniform in ``[low, high)`` on ``device`` (per-head sinks or
    ALiBi slopes), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * (high - low) + low).to(device)


def bits(t):
    """A tensor's bits as integers of its element size (NaN-poisoned slots compare equal)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(got, ref):
    """Bit-identical but for the sign of zero (the append and the drop-ins' pages)."""
    g, r = bits(got), bits(ref)
    bad = g != r
    if got.is_floating_point():  # +0 and -0 are the same value
        bad &= ~((got.cpu().float() == 0) & (ref.cpu().float() == 0))
    assert not bad.any(), f"{int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


class MBarrier:
    """An mbarrier as the kernel uses it: a phase completes after ``count`` arrivals
    (``arrive``; at count 1, ``completed += 1`` is the same), and
    ``mbarrier.try_wait.parity`` passes while the current, incomplete phase's parity differs
    from the one waited for (a fresh barrier passes parity 1; a waiter two phases behind
    blocks, as on the hardware)."""

    def __init__(self, count: int = 1):
        self.completed = 0  # phases completed
        self.count, self.pending = count, count

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def done(self, parity: int) -> bool:
        return self.completed % 2 != parity


def run_sides(*sides) -> bool:
    """Step coroutines that yield ``(MBarrier, parity)`` waits until each has finished (True)
    or none can move (False: they wait on each other). A side moves when the barrier it last
    waited on has completed that phase."""
    sides, waiting = list(sides), [None] * len(sides)
    while any(sides):
        moved = False
        for k, side in enumerate(sides):
            if side is None or (waiting[k] is not None and not waiting[k][0].done(waiting[k][1])):
                continue
            try:
                waiting[k] = next(side)
            except StopIteration:
                sides[k] = None
            moved = True
        if not moved:
            return False
    return True
