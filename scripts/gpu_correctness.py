"""The GPU correctness gate: every kernel family against the float64 oracle, on the device.

Families (``--family``; each runs in a process of its own under ``--all``, so a fault that
loses one CUDA context does not hide the others' results):

* ``decode``: ``plan_decode`` (split-KV, the planner's splits and forced ones), one and
  three query tokens; ``one-shot``: ``paged_decode``;
* ``prefill``: ``paged_attention`` over batches of chunks, prompts and empty sequences;
  ``mixed``: ``plan_attention`` with ``num_decodes`` (decodes through the decode plan, the
  rest through the prefill kernel);
* ``mla``: ``mla_decode`` (576/512 dims; 128 and 16 heads; on sm_90 the Gluon kernel,
  warp-specialized); ``mla-single``: the same on its single-partition form; ``mla-land``:
  the warp-specialized kernel whose producer never waits for its copies (opt-in, ``land``);
* ``prefill-gluon``: the opt-in Gluon prefill kernel, forced through the policy;
* ``append``: ``append_kv`` (each written row against torch's own cast, unwritten slots
  untouched); ``merge``: ``merge_states`` against the state over the union;
* ``stages``: the study's five stages (their dtypes, NHD).

Each case draws fresh random inputs (``make_paged_inputs``: shuffled pages, NaN in every
unused page and slot, garbage table padding), poisons ``out`` (and the LSE) with NaN, and
checks the relative L2 error against the oracle within the dtype's tolerance, LSE included.
The grid covers cache dtypes fp32, fp16, bf16, fp8 e4m3 and e5m2 (with scales), NHD, HND and
vLLM's K-then-V pages (``[pages, kv_heads, 2, page, head_dim]`` views), pages of 1, 16 and
64, head dims 64, 128 and 256, ragged lengths with empty rows; each family walks the dtype
and layout products in full and turns the page sizes and head dims so that every pair
appears (a covering design: all three sizes run with every dtype).

    PYTHONPATH=src python3 scripts/gpu_correctness.py --all [--jobs 8] [--json F]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/gpu_correctness.py --cpu-smoke

Exit status: the number of failing cases (a crashed family counts as one); the last line of
``--all`` is the table of families, cases and failures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch

import pagedattn
from pagedattn.testing import make_mla_inputs, make_paged_inputs, rel_l2_error, tolerance_for

FAMILIES = ("decode", "one-shot", "prefill", "mixed", "prefill-gluon", "mla", "mla-single",
            "mla-land", "append", "merge", "stages")
DTYPES = {"fp32": (torch.float32, None), "fp16": (torch.float16, None),
          "bf16": (torch.bfloat16, None), "e4m3": (torch.bfloat16, torch.float8_e4m3fn),
          "e5m2": (torch.float16, torch.float8_e5m2)}
LAYOUTS = ("NHD", "HND", "vllm")
PAGES = (1, 16, 64)
HEAD_DIMS = (64, 128, 256)
LENS = [0, 1, 37, 300, 16, 130]  # ragged, an empty row, one token, page tails
SMOKE = False  # --cpu-smoke: a few tiny cases in the interpreter


def _device() -> str:
    return "cpu" if SMOKE else "cuda"


def _sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def _grid(dtypes=tuple(DTYPES), layouts=LAYOUTS):
    """(dtype name, layout, page size, head dim): dtypes x layouts in full, the sizes turned
    so that each (page size, head dim) pair and each size with each dtype appear."""
    sizes = list(itertools.product(PAGES, HEAD_DIMS))
    cases = []
    for i, (dt, lay) in enumerate(itertools.product(dtypes, layouts)):
        page, hd = sizes[i % len(sizes)]
        cases.append((dt, lay, page, hd))
    if SMOKE:
        return [(dt, lay, 4, 16) for dt, lay, _, _ in cases[::4]]
    return cases


def _inputs(lens, dt, layout, page, hd, heads=(8, 2), seed=0):
    if SMOKE:
        lens = [min(n, 13) for n in lens]
    dtype, cache = DTYPES[dt]
    kv_layout = "NHD" if layout == "NHD" else "HND"
    inputs = make_paged_inputs(lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=hd, page_size=page, dtype=dtype, cache_dtype=cache,
                               kv_layout=kv_layout, seed=seed, device=_device())
    if layout == "vllm":  # each (page, kv head): a K tile, then a V tile
        paged = torch.stack([inputs.key_cache, inputs.value_cache], dim=2)
        inputs = inputs._replace(key_cache=paged[:, :, 0], value_cache=paged[:, :, 1])
    scales = {}
    if cache is not None:
        scales = dict(k_scale=torch.full((heads[1],), 0.75, device=_device()), v_scale=1.25)
    return inputs, kv_layout, scales


def _check(name, out, ref_out, lse=None, ref_lse=None, tol_dtype=None) -> tuple[bool, float]:
    err = rel_l2_error(out, ref_out)
    ok = bool(err <= tolerance_for(tol_dtype))
    if lse is not None:
        got, want = lse.double().cpu(), ref_lse.cpu()
        finite = torch.isfinite(want)
        ok &= bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        ok &= bool(torch.allclose(got[finite], want[finite], rtol=1e-3, atol=1e-3))
    return ok, err


def _decode(one_shot=False):
    for dt, layout, page, hd in _grid():
        for q_len in (1, 3):
            inputs, kv_layout, scales = _inputs(LENS, dt, layout, page, hd, seed=q_len)
            query = inputs.query
            if q_len > 1:
                g = torch.Generator().manual_seed(q_len)
                query = torch.randn(len(LENS), q_len, *query.shape[1:], generator=g).to(
                    query.dtype).to(query.device)
            ref = pagedattn.paged_decode_reference(query, *inputs[1:], kv_layout=kv_layout,
                                                   **scales)
            for splits in (None, 3):
                out = torch.full_like(query, float("nan"))
                if one_shot:
                    res = pagedattn.paged_decode(query, *inputs[1:], kv_layout=kv_layout,
                                                 out=out, num_splits=splits, return_lse=True,
                                                 **scales)
                else:
                    plan = pagedattn.plan_decode(
                        inputs.block_tables, inputs.context_lens, num_q_heads=8,
                        num_kv_heads=2, head_dim=hd, page_size=page, q_dtype=query.dtype,
                        kv_dtype=inputs.key_cache.dtype, kv_layout=kv_layout, q_len=q_len,
                        num_splits=splits)
                    res = plan.run(query, *inputs[1:3], out=out, return_lse=True, **scales)
                _sync()
                ok, err = _check("decode", out, ref.out, res.lse, ref.lse,
                                 inputs.key_cache.dtype)
                yield (dt, layout, page, hd, f"q_len{q_len}", f"splits{splits}"), ok, err


def _varlen_query(seq_lens, q_lens, hd, dtype, seed):
    """A ``[n + 2, 8, hd]`` query (two padding rows), its ``query_start_loc`` and the new
    tokens of each sequence (``q_lens``; in the smoke, at most its shortened length)."""
    if SMOKE:
        q_lens = [min(q, n_) for q, n_ in zip(q_lens, [min(x, 13) for x in seq_lens],
                                               strict=True)]
    n = sum(q_lens)
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(n + 2, 8, hd, generator=g).to(dtype).to(_device())
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=_device())
    return query, qsl, q_lens


def _prefill(mixed=False):
    seq_lens, q_lens = [40, 300, 0, 77, 1, 130], [40, 17, 0, 77, 1, 3]
    if mixed:  # three decodes first
        seq_lens, q_lens = [31, 300, 17, 0, 77, 130], [1, 1, 1, 0, 60, 3]
    for dt, layout, page, hd in _grid():
        # a negative softmax scale: the unmasked loop's other form (SCALE_NONNEG off)
        for window, scale in ((-1, None), (20, None), (-1, -0.3)):
            inputs, kv_layout, scales = _inputs(seq_lens, dt, layout, page, hd, seed=window)
            dtype = inputs.query.dtype
            query, qsl, q_lens = _varlen_query(seq_lens, q_lens, hd, dtype, seed=hd)
            n = sum(q_lens)
            out = torch.full_like(query, float("nan"))
            plan = pagedattn.plan_attention(
                inputs.block_tables, inputs.context_lens, qsl, num_q_heads=8, num_kv_heads=2,
                head_dim=hd, page_size=page, q_dtype=dtype, kv_dtype=inputs.key_cache.dtype,
                kv_layout=kv_layout, max_query_len=max(q_lens),
                num_decodes=3 if mixed else 0, window_left=window)
            res = plan.run(query, *inputs[1:3], out=out, return_lse=True, scale=scale,
                           **scales)
            _sync()
            ref = pagedattn.paged_attention_reference(query, *inputs[1:], qsl,
                                                      kv_layout=kv_layout, window_left=window,
                                                      scale=scale, **scales)
            ok, err = _check("prefill", out[:n], ref.out[:n], res.lse[:n], ref.lse[:n],
                             inputs.key_cache.dtype)
            ok &= bool(torch.isnan(out[n:]).all())  # padding rows untouched
            yield (dt, layout, page, hd, f"window{window}" + "-scale-0.3" * (scale is not None)
                   ), ok, err


def _prefill_gluon():
    """The Gluon prefill kernel (``kernels/prefill_gluon.py``, opt-in: forced here through the
    policy) on the cases it takes: bf16 and fp16 caches of the query's dtype, every layout and
    page size, head dims 64 and 128, long chunks and short ones, its tile configs, the
    consumers' overlap and the consumer warpgroups as two partitions (``split``), also in
    turns (``ping_pong``); on a GPU
    where it does not apply (not sm_90) or in the interpreter, the plain kernel runs and the
    case says so."""
    from policy_patch import patched_config  # noqa: PLC0415 (scripts/: the script's path)

    seq_lens, q_lens = [400, 300, 0, 1100, 9, 129], [300, 300, 0, 200, 9, 129]
    grid = [(dt, LAYOUTS[i % len(LAYOUTS)], page, hd) for i, (page, hd, dt) in enumerate(
        itertools.product(PAGES, (64, 128), ("bf16", "fp16")))]  # every page size x head dim
    if SMOKE:
        grid = _grid(dtypes=("bf16", "fp16"))
    for (dt, layout, page, hd), tiles in itertools.product(grid, ((128, 2, False, False, False),
                                                                  (64, 3, False, False, False),
                                                                  (64, 2, True, False, False),
                                                                  (64, 3, False, True, False),
                                                                  (64, 3, False, True, True))):
        with patched_config(dict(gluon=True, block_n=tiles[0], num_stages=tiles[1],
                                 overlap=tiles[2], split=tiles[3], ping_pong=tiles[4])):
            inputs, kv_layout, scales = _inputs(seq_lens, dt, layout, page, hd, seed=page)
            dtype = inputs.query.dtype
            query, qsl, lens = _varlen_query(seq_lens, q_lens, hd, dtype, seed=hd + page)
            n = sum(lens)
            out = torch.full_like(query, float("nan"))
            plan = pagedattn.plan_attention(
                inputs.block_tables, inputs.context_lens, qsl, num_q_heads=8, num_kv_heads=2,
                head_dim=hd, page_size=page, q_dtype=dtype, kv_layout=kv_layout)
            res = plan.run(query, *inputs[1:3], out=out, return_lse=True, **scales)
            _sync()
            path = "gluon" if plan._engine(query.shape[0]).gluon else "plain"
        ref = pagedattn.paged_attention_reference(query, *inputs[1:], qsl,
                                                  kv_layout=kv_layout, **scales)
        ok, err = _check("prefill", out[:n], ref.out[:n], res.lse[:n], ref.lse[:n], dtype)
        ok &= bool(torch.isnan(out[n:]).all())  # padding rows untouched
        hopper = not SMOKE and torch.cuda.get_device_capability()[0] == 9
        ok &= path == "gluon" or not hopper  # on sm_90 the Gluon kernel must have run
        yield (dt, layout, page, hd, f"n{tiles[0]}s{tiles[1]}" + "o" * tiles[2]
               + "-split" * tiles[3] + "-pingpong" * tiles[4], path), ok, err


def _mla(single=False, land=False):
    """MLA decode (a plan: ``mla_decode``'s path) on bf16, fp16 and fp8 latents, TP1 and TP8
    heads, several tokens. On sm_90 the policy's Gluon kernel in its warp-specialized form
    must have run; ``single``: its single-partition form instead, through the plan's
    ``kernel_config`` (opt-out, kept as the fallback of perf-notes step 55); ``land``: the
    warp-specialized form whose producer never waits for its copies (opt-in, step 60)."""
    import dataclasses

    for (dt, _, page, _), (heads, q_len) in itertools.product(
            _grid(dtypes=("bf16", "fp16", "e4m3"), layouts=("NHD",)),
            ((128, 1), (16, 1), (16, 3))):
        dtype, cache = DTYPES[dt]
        latent, rope = (32, 8) if SMOKE else (512, 64)
        lens = [min(n, 13) for n in LENS] if SMOKE else LENS
        inputs = make_mla_inputs(lens, num_q_heads=heads if not SMOKE else 4,
                                 latent_dim=latent, rope_dim=rope, page_size=page,
                                 dtype=dtype, cache_dtype=cache, device=_device(),
                                 q_len=q_len, seed=heads + q_len)
        scale = (128 + 64) ** -0.5
        kv_scale = 0.5 if cache is not None else None
        out = torch.full_like(inputs.q_nope, float("nan"))
        plan = pagedattn.plan_mla_decode(
            inputs.block_tables, inputs.context_lens, num_q_heads=inputs.q_nope.shape[-2],
            latent_dim=latent, rope_dim=rope, page_size=page, q_dtype=dtype, kv_dtype=cache,
            q_len=q_len)
        if single or land:
            plan.kernel_config = dataclasses.replace(plan.policy_config(), ws=not single,
                                                     land=land)
        res = plan.run(*inputs[:4], scale=scale, kv_scale=kv_scale, out=out, return_lse=True)
        launcher = plan._engine()
        _sync()
        ref = pagedattn.mla_decode_reference(*inputs, scale=scale, kv_scale=kv_scale)
        ok, err = _check("mla", out, ref.out, res.lse, ref.lse, cache or dtype)
        hopper = not SMOKE and torch.cuda.get_device_capability()[0] == 9
        ok &= (launcher.gluon and launcher.config.ws != single
               and launcher.config.land == land) or not hopper
        yield (dt, page, f"heads{heads}" + (f"-q{q_len}" if q_len > 1 else ""),
               ("gluon-single" if single else "gluon-ws" + "-land" * land)
               if launcher.gluon else ""), ok, err


def _append():
    for dt, layout, page, hd in _grid():
        dtype, cache = DTYPES[dt]
        kv_layout = "NHD" if layout == "NHD" else "HND"
        pages, heads = 9, 2
        shape = (pages, page, heads, hd) if kv_layout == "NHD" else (pages, heads, page, hd)
        kc = torch.full(shape, float("nan"), device=_device()).to(cache or dtype)
        vc = kc.clone()
        g = torch.Generator().manual_seed(hd + page)
        n = 7
        key = torch.randn(n, heads, hd, generator=g).to(dtype).to(_device())
        value = torch.randn(n, heads, hd, generator=g).to(dtype).to(_device())
        slots = torch.randperm(pages * page, generator=g)[:n].to(_device())
        slots[3] = -1  # padding: skipped
        scale = 0.5 if cache is not None else None
        pagedattn.append_kv(key, value, kc, vc, slots, kv_layout=kv_layout, k_scale=scale,
                            v_scale=scale)
        _sync()
        ok, worst = True, 0.0
        view_k = kc if kv_layout == "NHD" else kc.transpose(1, 2)
        view_v = vc if kv_layout == "NHD" else vc.transpose(1, 2)
        for t in range(n):
            s = int(slots[t])
            if s < 0:
                continue
            want_k = (key[t].float() / (scale or 1.0)).to(cache or dtype).float()
            want_v = (value[t].float() / (scale or 1.0)).to(cache or dtype).float()
            got_k = view_k[s // page, s % page].float()
            got_v = view_v[s // page, s % page].float()
            ok &= bool(torch.equal(got_k, want_k) and torch.equal(got_v, want_v))
        written = int((slots >= 0).sum()) * heads * hd
        ok &= int(torch.isnan(view_k.float()).logical_not().sum()) == written
        yield (dt, layout, page, hd), ok, worst


def _merge():
    for dt in ("fp32", "fp16", "bf16"):
        dtype = DTYPES[dt][0]
        inputs = make_paged_inputs([0, 40, 300, 17], num_q_heads=8, num_kv_heads=2,
                                   head_dim=16 if SMOKE else 128, page_size=16, dtype=dtype,
                                   device=_device())
        cut = 2  # pages: the head part and the tail
        lens = inputs.context_lens
        head = pagedattn.paged_decode(inputs.query, *inputs[1:3], inputs.block_tables[:, :cut],
                                      lens.clamp(max=cut * 16), return_lse=True)
        tail = pagedattn.paged_decode(inputs.query, *inputs[1:3], inputs.block_tables[:, cut:],
                                      (lens - cut * 16).clamp(min=0), return_lse=True)
        out, lse = pagedattn.merge_states(torch.stack([head.out, tail.out]),
                                          torch.stack([head.lse, tail.lse]))
        _sync()
        ref = pagedattn.paged_decode_reference(*inputs)
        ok, err = _check("merge", out, ref.out, lse, ref.lse, dtype)
        yield (dt,), ok, err


def _stages():
    for impl, dt, page in itertools.product(pagedattn.STAGES, ("fp32", "fp16", "bf16"),
                                            (1,) if SMOKE else (1, 16)):
        dtype = DTYPES[dt][0]
        inputs = make_paged_inputs([min(n, 13) for n in LENS] if SMOKE else LENS,
                                   num_q_heads=14, num_kv_heads=2,
                                   head_dim=16 if SMOKE else 80, page_size=page, dtype=dtype,
                                   device=_device())
        out = torch.full_like(inputs.query, float("nan"))
        pagedattn.paged_decode(*inputs, impl=impl, out=out)
        _sync()
        ref = pagedattn.paged_decode_reference(*inputs)
        ok, err = _check(impl, out, ref.out, tol_dtype=dtype)
        yield (impl, dt, page), ok, err


RUNS = {"decode": lambda: _decode(), "one-shot": lambda: _decode(one_shot=True),
        "prefill": lambda: _prefill(), "mixed": lambda: _prefill(mixed=True),
        "prefill-gluon": _prefill_gluon, "mla": _mla, "mla-single": lambda: _mla(single=True),
        "mla-land": lambda: _mla(land=True),
        "append": _append, "merge": _merge, "stages": _stages}


def run_family(family: str) -> tuple[int, int]:
    cases = failures = 0
    for key, ok, err in RUNS[family]():
        cases += 1
        failures += not ok
        print(f"{family:18s} {' '.join(map(str, key)):48s} rel_l2={err:.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    pagedattn.check_errors(_device())  # valid metadata: nothing reported
    return cases, failures


def main(argv=None) -> int:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=FAMILIES)
    ap.add_argument("--all", action="store_true", help="every family, a process each")
    ap.add_argument("--jobs", type=int, default=len(FAMILIES))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a few tiny cases of every family in the interpreter")
    ap.add_argument("--json")
    ap.add_argument("--family-timeout", type=float, default=240.0,
                    help="seconds a family's process may take before it is killed and "
                         "counted failed (a hang must not cost the other families' rows; "
                         "on a cold machine, ten families compiling side by side, the "
                         "mixed family took over 150 s on 1ee97d9)")
    args = ap.parse_args(argv)
    SMOKE = args.cpu_smoke
    if not SMOKE and not torch.cuda.is_available():
        print("gpu_correctness: needs a CUDA GPU (or --cpu-smoke under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    if args.family:
        cases, failures = run_family(args.family)
        print(f"{args.family}: {cases} cases, {failures} failed")
        return min(failures, 125)
    if not args.all and not SMOKE:
        print("gpu_correctness: give --family NAME or --all", file=sys.stderr)
        return 2
    t0 = time.time()
    if SMOKE:
        rows = {f: run_family(f) for f in FAMILIES}
    else:
        procs, started = {}, {}
        pending = list(FAMILIES)
        rows = {}
        while pending or procs:
            while pending and len(procs) < args.jobs:
                f = pending.pop(0)
                procs[f] = subprocess.Popen([sys.executable, __file__, "--family", f],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True, env=os.environ.copy())
                started[f] = time.time()
            for f, p in list(procs.items()):
                if p.poll() is None and time.time() - started[f] > args.family_timeout:
                    p.kill()  # a hang (a kernel that never returns): its rows so far, failed
                    p.wait()
                    print(f"{f}: TIMED OUT after {args.family_timeout:.0f} s", flush=True)
                    print(p.stdout.read(), end="", flush=True)
                    rows[f] = (0, 1)
                    del procs[f]
                elif p.poll() is not None:
                    text = p.stdout.read()
                    print(text, end="", flush=True)
                    tail = [ln for ln in text.splitlines() if ln.startswith(f"{f}: ")]
                    if tail:
                        words = tail[-1].split()
                        rows[f] = (int(words[1]), int(words[3]))
                    else:  # a crash: the process's last lines say why
                        print(f"{f}: CRASHED (exit {p.returncode})", flush=True)
                        rows[f] = (0, 1)
                    del procs[f]
            time.sleep(0.5)
    total = sum(f for _, f in rows.values())
    print("\n| family | cases | failed |\n|---|---|---|")
    for f in FAMILIES:
        c, x = rows.get(f, (0, 1))
        print(f"| {f} | {c} | {x} |")
    print(f"gpu_correctness: {sum(c for c, _ in rows.values())} cases, {total} failed, "
          f"{time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f: {"cases": c, "failed": x} for f, (c, x) in rows.items()}, fh)
    return min(total, 125)


if __name__ == "__main__":
    sys.exit(main())
