"""One launch of one kernel, small, for compute-sanitizer's racecheck (whose pass over the
whole driver outruns a call on the warp-specialized kernels): ``mla`` (the Gluon MLA kernel,
single partition), ``mla-ws`` (warp-specialized), ``prefill-gluon`` (the Gluon prefill
kernel, forced), ``fa3`` (FA3's paged call: a warp-specialized control from outside the
project; ``PEERS`` holds ``fa3_peer.py`` and ``fa3.tar``)::

    python3 scripts/racecheck_probe.py mla-ws    # once, to compile outside the tool
    compute-sanitizer --tool racecheck --racecheck-report all \\
        python3 scripts/racecheck_probe.py mla-ws

``docs/results/gpu-correctness-h100.md`` (ca00c2b) reads its reports.
"""
import dataclasses
import os
import sys

import torch

import pagedattn
from pagedattn.testing import make_mla_inputs, make_paged_inputs

what = sys.argv[1] if len(sys.argv) == 2 else ""
if what not in ("mla", "mla-ws", "prefill-gluon", "fa3") or not torch.cuda.is_available():
    print("usage: racecheck_probe.py mla|mla-ws|prefill-gluon|fa3 (on a CUDA GPU)")
    sys.exit(2)
dev = "cuda"
if what.startswith("mla"):
    inp = make_mla_inputs([90, 130], num_q_heads=16, page_size=64, dtype=torch.bfloat16,
                          device=dev)
    plan = pagedattn.plan_mla_decode(inp.block_tables, inp.context_lens, num_q_heads=16,
                                     latent_dim=512, rope_dim=64, page_size=64,
                                     q_dtype=torch.bfloat16)
    plan.kernel_config = dataclasses.replace(plan.policy_config(), ws=what == "mla-ws")
    out = plan.run(*inp[:4], scale=0.07)
    print(what, "gluon", plan._engine().gluon, "ws", plan._engine().config.ws)
elif what == "prefill-gluon":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from policy_patch import patched_config  # noqa: PLC0415
    with patched_config(dict(gluon=True, block_n=128, num_stages=2)):
        inp = make_paged_inputs([300], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16,
                                dtype=torch.bfloat16, device=dev)
        q = torch.randn(300, 2, 64, dtype=torch.bfloat16, device=dev)
        qsl = torch.tensor([0, 300], dtype=torch.int32, device=dev)
        plan = pagedattn.plan_attention(inp.block_tables, inp.context_lens, qsl, num_q_heads=2,
                                        num_kv_heads=1, head_dim=64, page_size=16,
                                        q_dtype=torch.bfloat16)
        out = plan.run(q, *inp[1:3])
        print(what, "gluon", plan._engine(q.shape[0]).gluon)
elif what == "fa3":
    sys.path.insert(0, os.environ.get("PEERS", ".peers"))
    import fa3_peer  # noqa: PLC0415
    fa = fa3_peer._load()
    inp = make_paged_inputs([300, 77], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                            dtype=torch.bfloat16, device=dev)
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device=dev)
    out = fa(q, inp.key_cache, inp.value_cache, cache_seqlens=inp.context_lens,
             page_table=inp.block_tables, causal=True)
    print(what, "ran", tuple(out.shape) if torch.is_tensor(out) else type(out))
torch.cuda.synchronize()
