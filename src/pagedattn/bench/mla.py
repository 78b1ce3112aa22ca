"""The MLA lab: ``pagedattn.mla_decode`` beside FlashInfer's MLA wrapper on issue 47's rows,
each against its limits (``python -m pagedattn.bench.mla``, ``scripts/bench_mla.py``).

Rows (DeepSeek-V3: 512 latent + 64 rope dims, pages of 64 tokens, scale ``1/√192``, bf16
unless named): the five shapes of FlashInfer 0.7.4's anchor, TP1 (128 heads) at b64-c4k,
b128-c2k and b1-c32k, TP8 (16 heads) at b64-c4k and b128-c8k; the fp8 latent at TP1 and TP8
b64-c4k; the variants the kernel carries for free (soft-cap, sinks) at TP8 b64-c4k.

Columns, each from the row's shapes: µs eager and graph (cold L2 after a read-only flush,
:mod:`pagedattn.bench.timing`), TFLOP/s (``2·H·q_len·(latent + rope + latent)`` a token:
the score and the output dots), the size-matched limit (a contiguous streaming read of
exactly the row's minimal bytes, :func:`mla_minimal_bytes`, timed the same way) and % of it,
and % of the dense bf16 peak (``--peak-tflops``, the H200's 989 by default). Every output is
checked against the float64 MLA oracle on its first ``--check-sequences`` sequences (the
peer's too, at the cache dtype's tolerance).

The peer is a factory in the style of :mod:`pagedattn.bench.peers`: it takes the row and its
inputs, plans outside the timing (FlashInfer's ``plan``: its CSR page list from our block
table) and returns a zero-argument runner, or raises
:class:`~pagedattn.bench.peers.PeerUnsupported`. These rows are not rows of ``pagedattn
bench``: its impls and peers take ``paged_decode``'s tensors, and MLA's are others (two query
parts, one latent cache); the timing, the flush and the limit are its own functions.

``--dry-run`` (the CPU, ``TRITON_INTERPRET=1``): every row shrunk to interpreter size (batch
at most 2, contexts / 256, the same heads and dims), run and checked against the oracle,
untimed; the report's timing columns say n/a.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import pagedattn
from pagedattn.bench.peers import FLASHINFER_WORKSPACE_BYTES, PeerUnsupported
from pagedattn.bench.report import dump_rows, format_row
from pagedattn.testing import MLAInputs, make_mla_inputs, rel_l2_error, tolerance_for

#: the dense bf16 tensor-core peak of an H200 (H100 SXM alike), TFLOP/s (spec)
H200_BF16_TFLOPS = 989.0


@dataclass(frozen=True)
class MLAShape:
    """One lab row: DeepSeek-V3's MLA at ``num_heads`` query heads (128 / TP)."""

    name: str
    num_heads: int
    batch: int
    context: int
    page_size: int = 64
    latent_dim: int = 512
    rope_dim: int = 64
    q_len: int = 1
    cache_dtype: torch.dtype = torch.bfloat16
    soft_cap: float | None = None
    sinks: bool = False

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(128 + 64)  # DeepSeek-V3's heads before absorption

    def lens(self) -> list[int]:
        return [self.context] * self.batch

    def small(self) -> MLAShape:
        """An interpreter-sized copy: batch at most 2, contexts / 256 (at least 16)."""
        return replace(self, name=self.name + "-small", batch=min(self.batch, 2),
                       context=max(self.context // 256, 16))


MLA_SHAPES = [
    MLAShape("ds-tp1-b64-c4k", 128, 64, 4096),
    MLAShape("ds-tp1-b128-c2k", 128, 128, 2048),
    MLAShape("ds-tp1-b1-c32k", 128, 1, 32768),
    MLAShape("ds-tp8-b64-c4k", 16, 64, 4096),
    MLAShape("ds-tp8-b128-c8k", 16, 128, 8192),
    MLAShape("fp8-ds-tp1-b64-c4k", 128, 64, 4096, cache_dtype=torch.float8_e4m3fn),
    MLAShape("fp8-ds-tp8-b64-c4k", 16, 64, 4096, cache_dtype=torch.float8_e4m3fn),
    MLAShape("softcap-ds-tp8-b64-c4k", 16, 64, 4096, soft_cap=50.0),
    MLAShape("sinks-ds-tp8-b64-c4k", 16, 64, 4096, sinks=True),
]
#: the cache's dequantization scale of the fp8 rows (their latents are drawn ~N(0, 1))
FP8_SCALE = 1.0


def mla_minimal_bytes(shape: MLAShape, q_dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes one call must read, exactly: the latent and rope rows of every valid token
    (``(latent + rope) · cache element size`` each), the used block-table entries (int32)
    and the query (``q_nope`` and ``q_pe``). Not counted: the lengths and the output."""
    elem = torch.empty((), dtype=shape.cache_dtype).element_size()
    q_elem = torch.empty((), dtype=q_dtype).element_size()
    tokens = sum(shape.lens())
    pages = sum(-(-n // shape.page_size) for n in shape.lens())
    query = shape.batch * shape.q_len * shape.num_heads * (shape.latent_dim + shape.rope_dim)
    return tokens * (shape.latent_dim + shape.rope_dim) * elem + 4 * pages + query * q_elem


def mla_flops(shape: MLAShape) -> float:
    """``2 · H · q_len · (latent + rope + latent)`` a token: the score dot over ``[latent |
    rope]`` and the output dot over the latent (DeepSeek-V3: 278.5 kFLOP at 128 heads)."""
    return 2.0 * shape.num_heads * shape.q_len * (2 * shape.latent_dim + shape.rope_dim) \
        * sum(shape.lens())


def build_inputs(shape: MLAShape, device, dtype=torch.bfloat16, seed: int = 0):
    """The row's inputs (:func:`pagedattn.testing.make_mla_inputs`: shuffled pages, NaN in
    every unused slot) and its per-call options."""
    inputs = make_mla_inputs(shape.lens(), num_q_heads=shape.num_heads,
                             latent_dim=shape.latent_dim, rope_dim=shape.rope_dim,
                             page_size=shape.page_size, q_len=shape.q_len, dtype=dtype,
                             cache_dtype=shape.cache_dtype, seed=seed, device=device)
    sinks = (torch.linspace(-1.0, 2.0, shape.num_heads, device=device) if shape.sinks
             else None)
    return inputs, sinks


Runner = Callable[[], torch.Tensor]


def ours(shape: MLAShape, inputs: MLAInputs, sinks, variant: str = "default") -> Runner:
    """``plan_mla_decode`` once (outside the timing), ``plan.run`` per call. ``variant``
    (``--ours``): ``default``; ``gluon-ws``, the MLA kernel's Hopper path (the default where
    it applies: the Gluon kernel, warp-specialized); ``gluon-ws-land``, that kernel with the
    producer that never waits for its copies (opt-in, perf-notes step 60); ``gluon``, its
    single-partition form; ``plain``, the plain Triton
    MLA kernel; or the plain kernel with other tiles, ``bn<tokens>s<stages>[w<warps>]``
    (A/B tuning)."""
    plan = pagedattn.plan_mla_decode(
        inputs.block_tables, inputs.context_lens, num_q_heads=shape.num_heads,
        latent_dim=shape.latent_dim, rope_dim=shape.rope_dim, page_size=shape.page_size,
        q_dtype=inputs.q_nope.dtype, kv_dtype=shape.cache_dtype, q_len=shape.q_len,
        logits_soft_cap=shape.soft_cap)
    if variant != "default":
        plan.kernel_config = _variant_config(plan, variant)
    out = torch.empty_like(inputs.q_nope)
    fp8 = shape.cache_dtype != inputs.q_nope.dtype
    return lambda: plan.run(*inputs[:4], scale=shape.scale, out=out, sinks=sinks,
                            kv_scale=FP8_SCALE if fp8 else None)


def _variant_config(plan, variant: str):
    """An ``--ours`` variant as the plan's kernel config: ``gluon-ws`` (the Hopper path, where
    it applies), ``gluon-ws-land`` (its producer never waiting for its copies), ``gluon`` (its
    single-partition form), ``plain`` (the plain Triton kernel) or its tiles
    ``bn<N>s<S>[w<W>]``."""
    base = plan.policy_config()  # through the API layer (tests/package/test_layers.py)
    if variant in ("gluon", "gluon-ws", "gluon-ws-land", "plain"):
        return replace(base, gluon=variant != "plain", ws=variant.startswith("gluon-ws"),
                       land=variant == "gluon-ws-land")
    m = re.fullmatch(r"bn(\d+)s(\d+)(?:w(\d+))?", variant)
    if m is None:
        raise ValueError(f"--ours: unknown variant {variant!r} (default, gluon, gluon-ws, "
                         "gluon-ws-land, plain, or bn<tokens>s<stages>[w<warps>])")
    bn, st, w = int(m[1]), int(m[2]), int(m[3]) if m[3] else base.num_warps
    return replace(base, block_n=bn, num_stages=st, num_warps=w, gluon=False)


def flashinfer_mla(shape: MLAShape, inputs: MLAInputs, sinks) -> Runner:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (its ``auto`` backend: fa3 on Hopper),
    planned once from our block table as its CSR page list; ``PeerUnsupported`` off CUDA,
    without the package, for fp8 latents, soft-cap and sinks (the wrapper has none)."""
    if not inputs.q_nope.is_cuda:
        raise PeerUnsupported("flashinfer-mla: needs CUDA")
    if shape.cache_dtype != inputs.q_nope.dtype or shape.soft_cap or shape.sinks \
            or shape.q_len != 1:
        raise PeerUnsupported("flashinfer-mla: fp8 latents, soft-cap, sinks and multi-token "
                              "rows are not run through its wrapper here")
    try:
        import flashinfer  # noqa: PLC0415 (a peer: imported only where it runs)
    except ImportError as e:
        raise PeerUnsupported(f"flashinfer-mla: {e}") from None
    dev = inputs.q_nope.device
    pages = [-(-n // shape.page_size) for n in shape.lens()]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                             device=dev)
    kv_indices = torch.cat([inputs.block_tables[b, :p] for b, p in enumerate(pages)]).int()
    qo_indptr = torch.arange(shape.batch + 1, dtype=torch.int32, device=dev)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev))
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, inputs.context_lens.int(), shape.num_heads,
                 shape.latent_dim, shape.rope_dim, shape.page_size, False, shape.scale,
                 inputs.q_nope.dtype, shape.cache_dtype)
    return lambda: wrapper.run(*inputs[:4])


PEERS: dict[str, Callable[..., Runner]] = {"flashinfer-mla": flashinfer_mla}


def measure_row(shape: MLAShape, *, device, dry_run: bool, reps: int = 30,
                peak_tflops: float = H200_BF16_TFLOPS, check_sequences: int = 8,
                peers: tuple[str, ...] = tuple(PEERS), timing=None,
                variants: tuple[str, ...] = ("default",)) -> dict:
    """One row: ours and each peer run once and checked against the float64 oracle (the
    first ``check_sequences`` sequences), then, unless ``dry_run``, timed eager and as a
    graph replay, with the size-matched limit. Returns the row's record (``n/a`` cells in a
    dry run; a peer's ``unsupported`` or ``error`` cell says why)."""
    inputs, sinks = build_inputs(shape, device)
    nbytes, flops = mla_minimal_bytes(shape), mla_flops(shape)
    row: dict = {"row": shape.name, "heads": shape.num_heads, "batch": shape.batch,
                 "context": shape.context, "cache": str(shape.cache_dtype).split(".")[-1],
                 "minimal_mb": nbytes / 1e6, "gflop": flops / 1e9}
    k = min(check_sequences, shape.batch)
    ref = pagedattn.mla_decode_reference(
        *(t[:k] for t in inputs[:2]), *inputs[2:4], inputs.block_tables[:k],
        inputs.context_lens[:k], scale=shape.scale,
        kv_scale=FP8_SCALE if shape.cache_dtype != inputs.q_nope.dtype else None,
        logits_soft_cap=shape.soft_cap, sinks=sinks).out
    tol = tolerance_for(shape.cache_dtype)
    limit_us = None
    if not dry_run:
        limit_us = timing.time_read(nbytes, reps=reps).median_us
    row["limit_us"] = limit_us if limit_us is not None else "n/a"
    failed = False
    makers = {("pagedattn" if v == "default" else f"pagedattn:{v}"):
              (lambda sh, inp, sk, v=v: ours(sh, inp, sk, v)) for v in variants}
    for name, make in {**makers, **{p: PEERS[p] for p in peers}}.items():
        try:
            fn = make(shape, inputs, sinks)
            out = fn()
        except PeerUnsupported as e:
            row[name] = f"unsupported: {e}"
            continue
        except Exception as e:  # noqa: BLE001 (a peer that fails is a cell of the row)
            row[name] = f"error: {e!r}"[:200]
            failed = failed or name.startswith("pagedattn")
            continue
        err = rel_l2_error(out[:k], ref)
        row[f"{name} err"] = err
        failed = failed or (name.startswith("pagedattn") and not err <= tol)
        if dry_run:
            row[f"{name} us"] = row[f"{name} graph us"] = "n/a"
            row[f"{name} tflops"] = row[f"{name} % limit"] = row[f"{name} % peak"] = "n/a"
            continue
        eager = timing.time_cold(fn, reps=reps).median_us
        graph = timing.time_graph(fn, reps=reps).median_us
        best = min(eager, graph)
        row[f"{name} us"], row[f"{name} graph us"] = eager, graph
        row[f"{name} tflops"] = flops / best / 1e6
        row[f"{name} % limit"] = 100.0 * limit_us / best
        row[f"{name} % peak"] = 100.0 * flops / best / 1e6 / peak_tflops
    row["ok"] = not failed
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(s.name for s in MLA_SHAPES),
                    help="comma list of row names (default: all)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--check-sequences", type=int, default=8,
                    help="sequences of each row checked against the float64 oracle")
    ap.add_argument("--no-peers", action="store_true", help="pagedattn alone")
    ap.add_argument("--ours", default="default",
                    help="comma list of our variants: default, gluon-ws (the Hopper path), "
                         "gluon-ws-land (its producer never waiting for its copies), "
                         "gluon (its single-partition form), "
                         "plain (the plain Triton MLA kernel), "
                         "bn<tokens>s<stages>[w<warps>] (the plain kernel's tiles)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: interpreter-sized rows, checked against the oracle, untimed")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    names = args.rows.split(",")
    shapes = {s.name: s for s in MLA_SHAPES}
    unknown = [n for n in names if n not in shapes]
    if unknown:
        print(f"bench-mla: --rows: unknown row {unknown[0]!r} (one of {', '.join(shapes)})",
              file=sys.stderr)
        return 2
    if args.reps < 1 or args.check_sequences < 1 or not args.peak_tflops > 0:
        print("bench-mla: --reps, --check-sequences and --peak-tflops must be > 0",
              file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("bench-mla: nothing measured: needs a CUDA GPU (or --dry-run under "
              "TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    timing = None
    if not args.dry_run:
        from pagedattn.bench import timing  # noqa: PLC0415 (Triton: on a GPU only)
    device = "cpu" if args.dry_run else "cuda"
    rows = []
    for name in names:
        shape = shapes[name].small() if args.dry_run else shapes[name]
        row = measure_row(shape, device=device, dry_run=args.dry_run, reps=args.reps,
                          peak_tflops=args.peak_tflops, check_sequences=args.check_sequences,
                          peers=() if args.no_peers else tuple(PEERS), timing=timing,
                          variants=tuple(args.ours.split(",")))
        print(format_row(row), flush=True)
        rows.append(row)
    dump_rows(rows, args.json)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
