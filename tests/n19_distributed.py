"""Case N19 across processes: run by ``test_cases_extremes`` on a two-GPU machine.

``torch.multiprocessing.spawn`` starts two ranks (NCCL). Each rank builds the batch of its
seed on its own GPU, decodes it with every impl under a CUDA graph (captured once, replayed
after new lengths are written), and all-gathers the outputs. Rank 0 then runs every rank's
batch eagerly on cuda:0 and requires the gathered rows to match it bitwise-close and to be
within tolerance of the float64 reference. Prints ``N19 distributed: ok`` on success.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pagedattn
from pagedattn.bench.timing import capture_graph
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

WORLD = 2
LENS = [[16, 1, 40], [3, 64, 7]]  # captured lengths per rank (<= the replay lengths)
REPLAY_LENS = [[100, 1, 128], [5, 128, 33]]  # written before the replay


def _inputs(rank: int, device):
    """Rank ``rank``'s batch: a block table for the replay lengths, the captured (shorter)
    lengths in ``context_lens``."""
    inputs = make_paged_inputs(REPLAY_LENS[rank], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               page_size=16, dtype=torch.bfloat16, seed=100 + rank,
                               device=device)
    inputs.context_lens.copy_(torch.tensor(LENS[rank], dtype=torch.int32))
    return inputs


def _worker(rank: int, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    dev = torch.device("cuda", rank)
    try:
        for impl in pagedattn.IMPLS:
            inputs = _inputs(rank, dev)
            out = torch.full_like(inputs.query, float("nan"))
            graph, _ = capture_graph(
                lambda inputs=inputs, out=out, impl=impl: pagedattn.paged_decode(
                    *inputs, impl=impl, out=out))
            inputs.context_lens.copy_(torch.tensor(REPLAY_LENS[rank], dtype=torch.int32))
            out.fill_(float("nan"))
            graph.replay()
            gathered = [torch.empty_like(out) for _ in range(WORLD)]
            dist.all_gather(gathered, out)
            torch.cuda.synchronize()
            if rank == 0:
                for r in range(WORLD):
                    single = _inputs(r, "cuda:0")
                    single.context_lens.copy_(torch.tensor(REPLAY_LENS[r], dtype=torch.int32))
                    eager = pagedattn.paged_decode(*single, impl=impl)
                    got = gathered[r].to("cuda:0")
                    assert torch.isfinite(got).all(), f"{impl} rank {r}: NaN/Inf"
                    torch.testing.assert_close(got, eager, rtol=1e-2, atol=1e-2)
                    err = rel_l2_error(got, pagedattn.paged_decode_reference(*single).out)
                    assert err <= tolerance_for(torch.bfloat16), f"{impl} rank {r}: {err:.3g}"
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    tmp = sys.argv[1]
    init_file = os.path.join(tmp, "nccl_init")
    mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
    print("N19 distributed: ok")


if __name__ == "__main__":
    main()
