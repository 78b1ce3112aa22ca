"""The decode kernel's sm_90 instructions beside the plain floor's, on a machine without a GPU:
how many instructions the token loop holds and how many lie outside it (the prologue, the
split bookkeeping, the epilogue), by opcode.

``auto``'s main kernel is compiled as an H100 (132 SMs) would plan it for a benchmark row's
shapes (Llama-3-8B heads: 32 query, 8 kv, head_dim 128, bf16, pages of 16; ``--batch`` and
``--context`` size the block table, so the plan's merge and fold match the row's), and the
floor's split kernel (``scripts/peers/plain_floor.py``) at the same tile (``--block-n``,
``--stages``). The token loop is ``scripts/compile_sm90.py``'s: the smallest backward-branch
loop holding tensor-core instructions (``token_loop``). Compiled code, not executed counts: a
branch taken by few programs (a fold's merge, an empty sequence) counts the same as the loop
body; ncu's instruction statistics weigh them (docs/perf-notes.md, issue 68).

    python3 scripts/sass_beside_floor.py [--batch 1 --context 32768] [--block-n 64 --stages 2]

Exit status 2 (one line) on a bad argument or where no ``ptxas``/``nvdisasm`` is found.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("sass_beside_floor: unset TRITON_INTERPRET (the interpreter does not compile)")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import compile_sm90 as C  # noqa: E402  (a sibling script: its compile hooks and SASS rule)
import plain_floor as F  # noqa: E402  (the measuring peer)

import pagedattn.launch.decode as L  # noqa: E402
from pagedattn.launch import _triton_compat as tc  # noqa: E402
from pagedattn.launch.policy import DecodeConfig  # noqa: E402

H100_SMS = 132


def opcodes(insts: list[str]) -> dict[str, int]:
    """Instruction counts by opcode (predicate and modifiers dropped), most first."""
    counts: dict[str, int] = {}
    for inst in insts:
        op = re.sub(r"^@!?U?P\w+\s+", "", inst).split()[0].split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def compile_auto(batch: int, context: int, block_n: int, stages: int):
    """``auto``'s main decode kernel for the row, planned for an H100's SMs, at the tile."""
    for name in ("_paged_decode_kernel", "_merge_per_group_kernel", "_merge_per_head_kernel"):
        setattr(L, name, C._Compile(getattr(L, name)))
    plan_launch = L.policy.plan_launch

    def on_h100(spec, **kw):  # off a GPU the launcher plans for 4 SMs (the interpreter's)
        return plan_launch(spec, **{**kw, "sms": H100_SMS})

    L.policy.plan_launch = on_h100
    heuristic = L.policy.heuristic_config(128, 4, torch.bfloat16)
    config = DecodeConfig(**{**heuristic.__dict__, "block_n": block_n, "num_stages": stages})
    C.CASES["row"] = (dict(max_pages=-(-context // 16)), (), torch.bfloat16, None, batch, 8)
    choose = L.policy.choose_config
    L.policy.choose_config = lambda *a, **k: config
    try:
        compiled = C.compile_case("row")
    finally:
        L.policy.choose_config, L.policy.plan_launch = choose, plan_launch
    return compiled["paged_decode"]


def compile_floor(block_n: int, stages: int):
    """The floor's split kernel at the tile (Llama-3-8B heads, bf16, pages of 16)."""
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    part = torch.zeros(16, dtype=torch.float32)
    args = dict(q_ptr=q, k_ptr=cache, v_ptr=cache, bt_ptr=table, lens_ptr=lens, po_ptr=part,
                pm_ptr=part, pl_ptr=part, scale_log2=0.1, chunk=512, max_splits=4,
                s_qb=4096, s_qh=128, s_kp=16384, s_kt=1024, s_kh=128, s_vp=16384,
                s_vt=1024, s_vh=128, s_bt=8, G=4, BLOCK_H=16, D=128, PAGE=16,
                BLOCK_N=block_n)
    return tc.compile_for(F._floor_split_kernel, args, arch=90, num_warps=4,
                          num_stages=stages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768, help="tokens a sequence's table holds")
    ap.add_argument("--block-n", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--stages", type=int, default=2, choices=(1, 2, 3, 4))
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per part")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.context < 16:
        print("sass_beside_floor: --batch must be >= 1 and --context >= 16", file=sys.stderr)
        return 2
    if C.NVDISASM is None or C.PTXAS is None:
        print("sass_beside_floor: no ptxas/nvdisasm found (Triton's, or $TRITON_PTXAS_PATH)",
              file=sys.stderr)
        return 2
    print(f"triton {tc.triton.__version__}; b{args.batch}-c{args.context}, "
          f"{args.block_n}-token tiles {args.stages} deep, planned for {H100_SMS} SMs")
    for name, kernel in (("auto", compile_auto(args.batch, args.context, args.block_n,
                                               args.stages)),
                         ("floor", compile_floor(args.block_n, args.stages))):
        loop, rest = C.token_loop(kernel.asm["cubin"]) or ([], [])
        print(f"{name}: {kernel.name}, {len(loop) + len(rest)} instructions, "
              f"{len(loop)} in the token loop, {len(rest)} outside")
        for part, insts in (("loop", loop), ("outside", rest)):
            top = list(opcodes(insts).items())[:args.top]
            print(f"  {part}: " + ", ".join(f"{op} {n}" for op, n in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
