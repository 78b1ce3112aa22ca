"""The one-shot ``paged_decode``'s shared launchers (``launch.decode.one_shot_launcher``).

A one-shot call reuses the launch configuration (and, on a GPU, the recorded launch) of
earlier calls with the same static key: shapes, dtypes, device and variants. These tests
check that the key separates what must not be shared, that the cache is bounded, that the
launchers hold no tensor, and that repeated calls with changing lengths stay correct against
the float64 oracle (outputs NaN-poisoned).
"""

import pytest
import torch
from test_variants import PLAN_EXAMPLES

import pagedattn
from pagedattn import one_shot
from pagedattn.launch import decode as launch_decode
from pagedattn.options import DEFAULT, DecodeOptions
from pagedattn.reference import paged_decode_reference
from pagedattn.spec import LaunchSpec
from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8)


def _static(launcher):
    """What a launcher decided from its key (its launch configuration)."""
    return (launcher.config, launcher.grid, launcher.merge_grid, launcher.merge_kernel,
            launcher.flags, launcher.merge_constexprs, launcher.rows_max,
            launcher.min_chunk, launcher.forced_splits, launcher.one_unit)


def test_changing_lengths_share_one_launcher_and_stay_correct(device):
    """Lengths and block tables are per call, never part of the key: many calls with new
    lengths (and a new ``out``, LSE on and off) use one shared launcher, and each matches the
    oracle."""
    for step, lens in enumerate(([0, 9, 31], [32, 1, 0], [17, 17, 17], [5, 30, 12],
                                 [1, 0, 32])):
        x = make_paged_inputs(lens, dtype=torch.float16, seed=step, max_pages=4,
                              device=device, **SHAPE)
        out = torch.full_like(x.query, float("nan"))
        res = pagedattn.paged_decode(*x, out=out, return_lse=step % 2 == 1, num_splits=2)
        ref = paged_decode_reference(*x)
        assert rel_l2_error(out, ref.out) <= tolerance_for(torch.float16)
        if step % 2:
            finite = torch.isfinite(ref.lse)
            assert torch.isneginf(res.lse.cpu()[~finite.cpu()]).all()
            torch.testing.assert_close(res.lse.double()[finite],
                                       ref.lse[finite].to(res.lse.device), rtol=1e-3,
                                       atol=1e-3)
    assert launch_decode.one_shot_launcher.cache_info().currsize == 1
    assert len(one_shot.TEMPLATES) == 1


def test_repeats_skip_the_full_check(device, monkeypatch):
    """The first call of a static key runs ``check_metadata`` and leaves a template; the
    repeats of plain calls take the fast path (no ``check_metadata``) and stay correct; a
    call with a bad argument still gets the full check's error."""
    from pagedattn import _validation as V

    calls = []
    real = V.check_metadata
    monkeypatch.setattr(V, "check_metadata", lambda *a, **k: calls.append(1) or real(*a, **k))
    for seed, lens in enumerate(([3, 30, 0], [32, 7, 1], [0, 0, 19])):
        x = make_paged_inputs(lens, dtype=torch.bfloat16, seed=seed, max_pages=4,
                              device=device, **SHAPE)
        out = pagedattn.paged_decode(*x, scale=0.7)
        ref = paged_decode_reference(*x, scale=0.7).out
        assert rel_l2_error(out, ref) <= tolerance_for(torch.bfloat16)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="scale"):
        pagedattn.paged_decode(*x, scale=float("nan"))
    with pytest.raises(ValueError, match="context_lens"):
        pagedattn.paged_decode(*x._replace(context_lens=x.context_lens.to("meta")))
    assert len(calls) == 3


@pytest.mark.parametrize("change", [
    dict(batch=4), dict(max_pages=5), dict(num_q_heads=8), dict(num_kv_heads=4),
    dict(head_dim=32), dict(page_size=16), dict(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    dict(kv_dtype=torch.float8_e4m3fn), dict(num_splits=3), dict(q_len=2),
    *(dict(options=DecodeOptions(**{name: example})) for name, example in PLAN_EXAMPLES.items()),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_each_part_of_the_key_gets_its_own_launcher(change):
    """Two keys that differ in one shape, dtype or variant never share a launcher, and each
    launcher's configuration is the one a fresh launcher of its own key decides."""
    base = dict(batch=3, max_pages=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                page_size=8, q_dtype=torch.float16, kv_dtype=torch.float16,
                device=torch.device("cpu"), num_splits=None, q_len=1, options=DEFAULT)
    other = {**base, **change}
    a = launch_decode.one_shot_launcher(LaunchSpec(**base))
    b = launch_decode.one_shot_launcher(LaunchSpec(**other))
    assert a is not b
    assert launch_decode.one_shot_launcher(LaunchSpec(**base)) is a  # the key's own, reused
    for shared, key in ((a, base), (b, other)):
        fresh = launch_decode.AutoLauncher(LaunchSpec(**key))
        assert _static(shared) == _static(fresh)
        if shared.one_unit:  # 16 bytes no kernel touches, kept
            assert shared.workspace.numel() == 4
        else:  # scratch is per call, never shared
            assert shared.workspace is None


def test_the_cache_is_bounded():
    """More static keys than the cache holds: it keeps at most ``ONE_SHOT_CACHE_SIZE``
    launchers (least recently used dropped), and a dropped key is rebuilt on its next use."""
    size = launch_decode.ONE_SHOT_CACHE_SIZE

    def launcher(batch):
        return launch_decode.one_shot_launcher(LaunchSpec(
            batch, 4, 4, 2, 16, 8, torch.float16, torch.float16, torch.device("cpu")))

    first = launcher(1)
    for batch in range(2, size + 10):
        launcher(batch)
    info = launch_decode.one_shot_launcher.cache_info()
    assert info.maxsize == size and info.currsize == size
    again = launcher(1)
    assert again is not first and again.batch == 1


def test_a_one_shot_call_shares_no_workspace(device, monkeypatch):
    """Each one-shot call launches with a workspace of its own (two calls in flight on two
    streams, or in two CUDA graphs, must not share scratch); the shared split launcher has
    none."""
    seen = []
    real = launch_decode.AutoLauncher.new_workspace

    def spy(self):
        work = real(self)
        seen.append(work)
        return work

    monkeypatch.setattr(launch_decode.AutoLauncher, "new_workspace", spy)
    # 70 keys in a 128-token table: two split rows on the CPU (32-token tiles) and the GPU
    x = make_paged_inputs([70, 3], dtype=torch.float32, seed=3, max_pages=16, device=device,
                          **SHAPE)
    ref = paged_decode_reference(*x).out
    outs = [pagedattn.paged_decode(*x, num_splits=2) for _ in range(2)]
    for out in outs:
        assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    assert launch_decode.one_shot_launcher.cache_info().currsize == 1
    assert len(seen) == 2 and all(w is not None for w in seen)
    assert seen[0] is not seen[1]  # two allocations, not one cached buffer


def test_a_one_unit_one_shot_allocates_nothing(device, monkeypatch):
    """A one-unit launcher's kernels never touch the workspace: its 16 bytes are made once,
    with the shared launcher, and later one-shot calls allocate no scratch."""
    x = make_paged_inputs([20, 3], dtype=torch.float32, seed=4, max_pages=4, device=device,
                          **SHAPE)  # a 32-token table: never more than one split
    seen = []
    real = launch_decode.AutoLauncher.new_workspace
    monkeypatch.setattr(launch_decode.AutoLauncher, "new_workspace",
                        lambda self: seen.append(self) or real(self))
    ref = paged_decode_reference(*x).out
    for _ in range(3):
        out = pagedattn.paged_decode(*x)
        assert rel_l2_error(out, ref) <= tolerance_for(torch.float32)
    (launcher,) = seen  # the shared launcher's own, once
    assert launcher.one_unit and launcher.workspace.numel() == 4


@pytest.mark.gpu
def test_repeated_one_shots_take_the_recorded_launch():
    """On the GPU (Triton 3.6) a repeated one-shot call of a binding launches the recorded
    kernels, whose argument lists hold no tensor and no address, and stays correct for new
    lengths, queries and caches; two streams running one-shot calls at once get their own
    answers (per-call workspaces)."""
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    calls = []
    for seed, lens in enumerate(([5, 40, 0, 77], [77, 1, 30, 64], [0, 0, 9, 3])):
        x = make_paged_inputs(lens, dtype=torch.bfloat16, seed=seed, device="cuda",
                              max_pages=5, **shape)
        out = torch.full_like(x.query, float("nan"))
        pagedattn.paged_decode(*x, out=out, num_splits=3)
        ref = paged_decode_reference(*x).out
        assert rel_l2_error(out, ref) <= tolerance_for(torch.bfloat16)
        calls.append((x, ref))
    assert launch_decode.one_shot_launcher.cache_info().currsize == 1
    engine = launch_decode.one_shot_launcher(LaunchSpec(
        4, 5, 8, 2, 128, 16, torch.bfloat16, torch.bfloat16, calls[0][0].query.device,
        num_splits=3))  # as the one-shot plan builds it
    assert launch_decode.one_shot_launcher.cache_info().currsize == 1  # the calls' own
    assert engine._direct and len(engine._records) == 1
    for record in engine._records.values():
        args = record.main.args + (record.merge.args if record.merge else [])
        assert not any(isinstance(a, torch.Tensor) for a in args)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [None, None]
    torch.cuda.synchronize()
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            outs[i] = pagedattn.paged_decode(*calls[i + 1][0], num_splits=3)
    torch.cuda.synchronize()
    for i in range(2):
        assert rel_l2_error(outs[i], calls[i + 1][1]) <= tolerance_for(torch.bfloat16)



def test_the_template_table_is_bounded(monkeypatch):
    """More validated static keys than the one-shot table holds: it keeps at most
    ``one_shot.TEMPLATES_MAX`` templates, and none holds a tensor."""
    monkeypatch.setattr(one_shot, "TEMPLATES_MAX", 3)
    monkeypatch.setattr(launch_decode.AutoLauncher, "launch", lambda *a, **k: {})
    for batch in range(1, 7):
        x = make_paged_inputs([5] * batch, dtype=torch.float16, seed=batch, **SHAPE)
        pagedattn.paged_decode(*x)
        assert len(one_shot.TEMPLATES) == min(batch, 3)
    for plan in one_shot.TEMPLATES.values():
        assert plan.block_tables is None and plan.context_lens is None
        assert not any(isinstance(v, torch.Tensor) for v in vars(plan).values())
