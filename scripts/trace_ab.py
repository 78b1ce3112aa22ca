"""The serving benchmark's trace run alone (random weights in SmolLM2-135M's shapes, CUDA
graphs), with where its time goes: prefill seconds, decode seconds, steps. For A/B runs of two
source trees (``PYTHONPATH=<tree>/src``) on one machine, and of the engine with its overlapped
decode turned off (``--no-overlap``: each decode step is read as soon as it is launched).

    PYTHONPATH=src python scripts/trace_ab.py [--no-overlap] [--requests 256]
"""

from __future__ import annotations

import argparse
import json

import torch
from profile_serving_step import SMOLLM2_135M  # scripts/ is on sys.path when run as a script

from pagedattn.serving import baselines
from pagedattn.serving.bench_model import run_engine, trace_requests
from pagedattn.serving.engine import Engine
from pagedattn.serving.gguf_loader import LlamaConfig
from pagedattn.serving.model import Transformer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    if args.no_overlap and hasattr(Engine, "_drain"):
        decode = Engine._decode

        def read_at_once(self):  # launch, then read the step before returning
            decode(self)
            self._drain()

        Engine._decode = read_at_once
    cfg = LlamaConfig(**SMOLLM2_135M)  # type: ignore[arg-type]
    model = Transformer(cfg, baselines.random_weights(cfg), dtype=torch.bfloat16,
                        device=torch.device("cuda"))
    reqs = trace_requests(args.requests, cfg.max_position, 1024, cfg.vocab_size)
    done, s, wall = run_engine(model, [p for p, _ in reqs], [n for _, n in reqs],
                               mode="graphs", page_size=16, max_batch=args.max_batch)
    out = sum(len(r.output) for r in done)
    print(json.dumps({"label": args.label, "no_overlap": args.no_overlap, "wall_s": wall,
                      "tokens_per_s": out / wall, "output_tokens": out,
                      "prefill_steps": s.prefill_steps, "prefill_s": s.prefill_s,
                      "prefill_tokens": s.prefill_tokens, "decode_steps": s.decode_steps,
                      "decode_s": s.decode_s, "decode_tokens": s.decode_tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
