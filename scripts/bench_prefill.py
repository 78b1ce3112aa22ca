"""Paged prefill (``pagedattn.paged_attention``) beside FlashInfer's paged prefill and FA3's
varlen call with a block table, on the issue's three rows, each against its limits.

Rows (Llama-3-8B heads: 32 query, 8 kv, head_dim 128, bf16, pages of 16 tokens unless named):

* ``chunks-b8-q512-c4k``: 8 sequences, each 512 new tokens over 4,096 cached (chunked prefill);
* ``prompt-8k``: one 8,192-token prompt, nothing cached;
* ``mixed-b64-decode-2k-chunk``: 64 decodes at 2,048 tokens and one 2,048-token chunk over
  2,048 cached (a vLLM step with chunked prefill on; the decodes come first and go through
  the decode kernel, ``num_decodes``);
* ``prompt-32k``: one 32,768-token prompt; ``chunks-b4-q2k-c16k``: 4 chunks of 2,048 over
  16,384 cached; ``chunks-b8-q512-c4k-page1`` / ``-page64``: the first row's batch in pages
  of 1 (SGLang's) and 64 tokens.

Each row's limits, from its shapes: the K/V bytes every sequence must read at least once (a
contiguous streaming read of exactly those bytes after a clean flush, timed the same way:
the size-matched limit) and the FLOPs of its visible query-key pairs, ``4 · Hq · D`` each
(``q·k`` and ``p·v``), against the dense bf16 peak (``--peak-tflops``, the H200's ~790 by
default). A long chunk is bound by compute, a short one by bytes.

Timing: CUDA-graph replays of one call after a read-only flush of twice the L2
(``pagedattn.bench.timing``), median of ``--reps``. Checks: every output against the
float64 oracle (rows of at most ``--oracle-tokens`` new tokens), the peers' against ours.

    PYTHONPATH=src python3 scripts/bench_prefill.py [--fa3 .peers/fa3_peer.py] [--json F]
        [--variants "m64:block_m=64,num_warps=4;n128:block_n=128,num_stages=2;..."]

A ``--variants`` entry adds a ``pagedattn-LABEL`` column: our plan with the prefill
policy's :class:`~pagedattn.launch.prefill.PrefillConfig` fields (``block_m``, ``block_n``,
``g_pack``, ``num_warps``, ``num_stages``, ``gluon``, ...) replaced while the plan is built
and first run; a field only the decode policy's ``DecodeConfig`` has (``fold_merge``, ...)
patches a mixed step's decodes (a field both have patches the prefill policy alone).
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/bench_prefill.py --dry-run   # CPU
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import pagedattn
from pagedattn.bench.report import dump_rows, format_row
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for


@dataclass(frozen=True)
class Row:
    name: str
    cached: tuple[int, ...]  # tokens already in the cache, per sequence
    new: tuple[int, ...]  # new tokens, per sequence
    page: int = 16  # tokens a page

    def shrink(self) -> Row:
        """An interpreter-sized copy: at most 3 sequences, lengths / 256 (at least 1)."""
        k = min(3, len(self.new))
        keep = list(range(k - 1)) + [len(self.new) - 1]
        return Row(self.name + "-small", tuple(max(c // 256, 0) for c in
                                                (self.cached[i] for i in keep)),
                   tuple(max(n // 256, 1) for n in (self.new[i] for i in keep)),
                   min(self.page, 16))


ROWS = [
    Row("chunks-b8-q512-c4k", (4096,) * 8, (512,) * 8),
    Row("prompt-8k", (0,), (8192,)),
    Row("mixed-b64-decode-2k-chunk", (2047,) * 64 + (2048,), (1,) * 64 + (2048,)),
    Row("prompt-32k", (0,), (32768,)),
    Row("chunks-b4-q2k-c16k", (16384,) * 4, (2048,) * 4),
    Row("chunks-b8-q512-c4k-page1", (4096,) * 8, (512,) * 8, 1),
    Row("chunks-b8-q512-c4k-page64", (4096,) * 8, (512,) * 8, 64),
]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def build(row: Row, device, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    lens = [c + n for c, n in zip(row.cached, row.new, strict=True)]
    inputs = make_paged_inputs(lens, num_q_heads=heads, num_kv_heads=kv_heads,
                               head_dim=head_dim, page_size=row.page, dtype=dtype,
                               device=device)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(sum(row.new), heads, head_dim, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0, *torch.tensor(row.new).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    return inputs, query, qsl, lens


def limits(row: Row, heads: int, kv_heads: int, head_dim: int, elem: int) -> tuple[int, float]:
    """``(K/V bytes read at least once, FLOPs of the visible query-key pairs)``."""
    tokens = sum(c + n for c, n in zip(row.cached, row.new, strict=True))
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(row.cached, row.new, strict=True))
    return 2 * tokens * kv_heads * head_dim * elem, 4.0 * heads * head_dim * pairs


def num_decodes(row: Row) -> int:
    """The row's leading one-token sequences over a cached context (a vLLM step's decodes,
    which come first)."""
    n = 0
    while n < len(row.new) and row.new[n] == 1 and row.cached[n] > 0:
        n += 1
    return n


def ours(inputs, query, qsl, row: Row):
    plan = pagedattn.plan_attention(inputs.block_tables, inputs.context_lens, qsl,
                                    num_q_heads=query.shape[1],
                                    num_kv_heads=inputs.key_cache.shape[2],
                                    head_dim=query.shape[2], page_size=row.page,
                                    q_dtype=query.dtype, max_query_len=max(row.new),
                                    num_decodes=num_decodes(row))
    out = torch.empty_like(query)
    return lambda: plan.run(query, inputs.key_cache, inputs.value_cache, out=out)


def ours_with(fields: dict):
    """:func:`ours` with the policy patched by ``fields`` (``policy_patch.patched_config``)
    while the plan's launcher is built (its first run)."""
    from policy_patch import patched_config  # noqa: PLC0415 (scripts/ is the script's path)

    def make(inputs, query, qsl, row: Row):
        with patched_config(fields, prefill_first=True):
            fn = ours(inputs, query, qsl, row)
            fn()
        return fn
    return make


def flashinfer_prefill(inputs, query, qsl, row: Row):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal), planned once."""
    import flashinfer  # noqa: PLC0415 (a peer: imported only where it runs)

    dev = query.device
    pages = [-(-(c + n) // row.page) for c, n in zip(row.cached, row.new, strict=True)]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([inputs.block_tables[b, :p].cpu() for b, p in enumerate(pages)])
    last = torch.tensor([(c + n - 1) % row.page + 1 for c, n in zip(row.cached, row.new,
                                                                strict=True)],
                        dtype=torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qsl, indptr.to(dev), indices.to(dev).int(), last.to(dev), query.shape[1],
                 inputs.key_cache.shape[2], query.shape[2], row.page, causal=True,
                 q_data_type=query.dtype, kv_data_type=inputs.key_cache.dtype)
    return lambda: wrapper.run(query, (inputs.key_cache, inputs.value_cache))


def fa3_varlen(path: str):
    """FA3's paged varlen call: ``flash_attn_with_kvcache`` with ``cu_seqlens_q``,
    ``max_seqlen_q``, ``page_table`` and ``cache_seqlens`` (its ``flash_attn_varlen_func``
    takes no page table), from the peers' FA3 unpacked by ``fa3_peer.py``'s loader."""
    from fa_dropin_per_call import load_fa3  # noqa: PLC0415 (scripts/ is the script's path)

    fa = load_fa3(path)  # flash_attn_interface.flash_attn_with_kvcache

    def make(inputs, query, qsl, row: Row):
        lens = inputs.context_lens.int()
        table = inputs.block_tables.int()
        return lambda: fa(query, inputs.key_cache, inputs.value_cache, cache_seqlens=lens,
                          page_table=table, cu_seqlens_q=qsl, max_seqlen_q=max(row.new),
                          causal=True)
    return make


def makers(variants: str, fa3: str | None = None, peers: bool = True) -> dict:
    """The runner factories of a bench (``name -> make(inputs, query, qsl, row)``): ours, one
    per ``--variants`` entry (``label:field=value,...;...``, ``pagedattn-<label>``), then,
    with ``peers``, FlashInfer's paged prefill (when it imports) and FA3's varlen call (with
    ``fa3``)."""
    out = {"pagedattn": ours}
    for spec in filter(None, variants.split(";")):
        label, _, fields = spec.partition(":")
        out["pagedattn-" + label] = ours_with(
            {k: int(v) for k, v in (f.split("=") for f in fields.split(",") if f)})
    if peers:
        try:
            import flashinfer  # noqa: F401, PLC0415
            out["flashinfer"] = flashinfer_prefill
        except ImportError:
            print("flashinfer: not importable, left out", flush=True)
        if fa3:
            out["fa3-varlen"] = fa3_varlen(fa3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fa3", help="fa3_peer.py beside its fa3.tar")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--oracle-tokens", type=int, default=4096)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: interpreter-sized rows, checked against the oracle, untimed")
    ap.add_argument("--variants", default="",
                    help="label:field=value,...;... (see the module docstring)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    names = args.rows.split(",")
    rows = [r for r in ROWS if r.name in names]
    if len(rows) != len(names):
        print(f"bench_prefill: --rows: unknown row in {args.rows!r}", file=sys.stderr)
        return 2
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("bench_prefill: needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    shape = (4, 2, 16) if dry else (HEADS, KV_HEADS, HEAD_DIM)
    factories = makers(args.variants, args.fa3, peers=not dry)
    if not dry:
        from pagedattn.bench import timing  # noqa: PLC0415
    results, failures = [], 0
    for row in rows:
        row = row.shrink() if dry else row
        inputs, query, qsl, lens = build(row, device, torch.float32 if dry else torch.bfloat16,
                                         *shape)
        kv_bytes, flops = limits(row, *shape[:2], shape[2], query.element_size())
        res = {"row": row.name, "kv_mb": kv_bytes / 1e6, "gflop": flops / 1e9}
        ref = None
        if sum(row.new) <= args.oracle_tokens:
            ref = pagedattn.paged_attention_reference(query, *inputs[1:], qsl).out
        outs = {}
        for name, make in factories.items():
            try:
                fn = make(inputs, query, qsl, row)
                outs[name] = fn()
                if not dry:
                    t = timing.time_graph(fn, reps=args.reps).median_us
                    res[name] = t
                    res[name + " tflops"] = flops / t / 1e6
            except Exception as e:  # noqa: BLE001 (a peer that fails is a row)
                res[name] = f"error: {e!r}"[:200]
        for name, out in outs.items():
            if ref is not None:
                err = rel_l2_error(out, ref)
                res[name + " err"] = err
                if name.startswith("pagedattn") and not err <= tolerance_for(query.dtype):
                    failures += 1
            elif name != "pagedattn" and "pagedattn" in outs:
                res[name + " vs ours"] = rel_l2_error(out, outs["pagedattn"])
        if not dry:
            res["limit"] = timing.time_read(kv_bytes, reps=args.reps).median_us
            res["compute_us"] = flops / (args.peak_tflops * 1e12) * 1e6
        print(format_row(res), flush=True)
        results.append(res)
    dump_rows(results, args.json)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
