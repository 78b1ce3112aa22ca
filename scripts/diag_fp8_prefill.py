"""Which part of the varlen (paged prefill) path faults with an fp8 cache on the GPU.

Each case runs in a process of its own (a fault loses the CUDA context): a bf16 query over an
e4m3 cache with tensor scales, a batch of chunks over cached prefixes and one decode row,
against the float64 oracle. A variant patches one choice of the launch while the plan is
built and first run:

* ``base``: as shipped;
* ``nopairs``: the fp8 values read as bytes (``FP8_V_PAIRS`` off);
* ``cfg:FIELD=V,...``: the policy's ``DecodeConfig`` fields (``num_stages``, ``block_n``,
  ``num_warps``, ``maxnreg``) or its ``_VARLEN_*`` constants (``policy_patch.patched_config``).

    PYTHONPATH=src python3 scripts/diag_fp8_prefill.py [--variants "base;nopairs;..."]
    python3 scripts/diag_fp8_prefill.py --one VARIANT --head-dim 64 --group 4   # one case
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = [(64, 4), (128, 8), (128, 4)]  # (head_dim, group)


def run_one(variant: str, head_dim: int, group: int) -> dict:
    import torch

    import pagedattn
    from pagedattn.launch import decode as launch_decode
    from pagedattn.testing import make_paged_inputs, rel_l2_error

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from policy_patch import patched_config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv_heads = 2
    cached, new = [37, 200, 0, 500, 64], [20, 77, 33, 1, 130]
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    inputs = make_paged_inputs(lens, num_q_heads=kv_heads * group, num_kv_heads=kv_heads,
                               head_dim=head_dim, page_size=16, dtype=torch.bfloat16,
                               cache_dtype=torch.float8_e4m3fn, device=dev, seed=3)
    g = torch.Generator().manual_seed(11)
    query = torch.randn(sum(new), kv_heads * group, head_dim, generator=g).bfloat16().to(dev)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    ks = torch.tensor(0.7, device=dev)
    vs = torch.tensor(1.3, device=dev)
    fields = {}
    if variant.startswith("cfg:"):
        fields = {k: int(v) for k, v in (f.split("=") for f in variant[4:].split(","))}
    saved = launch_decode.fp8_v_pairs
    if variant == "nopairs":
        launch_decode.fp8_v_pairs = lambda value_cache, head_dim: 0
    try:
        with patched_config(fields):
            out = pagedattn.paged_attention(query, inputs.key_cache, inputs.value_cache,
                                            inputs.block_tables, inputs.context_lens, qsl,
                                            k_scale=ks, v_scale=vs)
            torch.cuda.synchronize() if dev == "cuda" else None
    finally:
        launch_decode.fp8_v_pairs = saved
    ref = pagedattn.paged_attention_reference(query, inputs.key_cache, inputs.value_cache,
                                              inputs.block_tables, inputs.context_lens, qsl,
                                              k_scale=ks, v_scale=vs).out
    return {"err": rel_l2_error(out, ref), "nan": bool(torch.isnan(out).any())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="base;nopairs;cfg:num_stages=1;cfg:num_stages=2;"
                    "cfg:maxnreg=168;cfg:block_n=32;cfg:block_n=64;cfg:_VARLEN_ROWS=32")
    ap.add_argument("--one")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.head_dim, args.group)))
        return 0
    for variant in args.variants.split(";"):
        for hd, group in CASES:
            p = subprocess.run([sys.executable, __file__, "--one", variant, "--head-dim",
                                str(hd), "--group", str(group)], capture_output=True,
                               text=True, timeout=300)
            tail = (p.stdout.strip().splitlines() or [""])[-1]
            if p.returncode:
                err = [ln for ln in p.stderr.splitlines() if "Error" in ln][-1:] or ["?"]
                tail = f"rc {p.returncode}: {err[0][:150]}"
            print(f"{variant:28s} hd{hd} g{group}: {tail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
