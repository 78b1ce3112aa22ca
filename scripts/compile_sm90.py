"""Compile ``impl="auto"``'s kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter never runs the code generator, so a kernel that passes every CPU test
may still fail to compile for a GPU (a non-constexpr global, a branch whose types differ).
This drives :class:`~pagedattn.launch.decode.AutoLauncher` with its kernels swapped for a
stand-in that compiles ``kernel[grid](**kwargs)`` with ``triton.compile`` for ``cuda:90``
(Triton's front end, its GPU passes and its ``ptxas``; ``_triton_compat.compile_for``, the
version seam) instead of launching, for each variant combination below, on whichever Triton
is installed (3.6-3.9 read). ``--ptx-dir`` writes each binary's PTX (to compare the plain
kernel's code before and after a change); ``--compare DIR`` checks each PTX against DIR's
file of the same name, instructions only (the ``.loc``/``.file`` lines and the DWARF sections
that follow the code hold source line numbers, which any edit above a kernel shifts, and the
``$L__tmpN:`` labels mark where an inlined ``@triton.jit`` helper's code starts and ends for
those sections: no branch targets them), and exits 1 if any differs. Where a ``ptxas`` is
found (the one the installed Triton assembles sm_90 with, which on 3.9 is its
``ptxas-blackwell``; else ``$TRITON_PTXAS_PATH``, else the system's: ``_triton_compat.ptxas``),
each kernel's registers and spilled bytes are printed (``ptxas -v`` with Triton's own flags),
with the spills inside the token loop read off ``nvdisasm``'s SASS, and ``--compare`` requires
them equal too: a label splits ptxas's basic blocks, so a helper's scope inside the token loop
once changed the registers of identical instructions (``docs/perf-notes.md``, step 31).
``--bindings`` compiles nothing: it checks that each case's recorded launch hands Triton's C
launch what ``kernel[grid](**kwargs)`` hands it (:func:`check_bindings`). Run without
``TRITON_INTERPRET``; to compare with an older commit's ``src/``::

    PYTHONPATH=src python3 scripts/compile_sm90.py [--ptx-dir DIR] [--compare OLD_DIR] [--bindings]
    git archive OLD src | tar x -C /tmp/old
    PYTHONPATH=/tmp/old/src python3 scripts/compile_sm90.py --ptx-dir /tmp/old-ptx
    PYTHONPATH=src python3 scripts/compile_sm90.py --ptx-dir /tmp/new-ptx --compare /tmp/old-ptx
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_sm90: unset TRITON_INTERPRET (the interpreter does not compile)")

import torch  # noqa: E402

import pagedattn.launch.decode as L  # noqa: E402
import pagedattn.launch.mla as LM  # noqa: E402
import pagedattn.launch.prefill as LP  # noqa: E402
from pagedattn.launch import _triton_compat as tc  # noqa: E402
from pagedattn.options import OPTIONS, plan_options  # noqa: E402
from pagedattn.spec import LaunchSpec  # noqa: E402

#: name -> (AutoLauncher table width, q_len, LSE and plan-time options (pagedattn.options),
#: per-call options, dtype, cache dtype, batch, kv heads)
CASES = {
    "plain-bf16": ({}, (), torch.bfloat16, None, 64, 8),
    "plain-fp32": ({}, (), torch.float32, None, 64, 8),
    "plain-fp8": ({}, (), torch.bfloat16, torch.float8_e4m3fn, 64, 8),
    # two (sequence, kv head) pairs: the per-head merge, which a plan of so few rows folds
    # (launch.policy: fold_max_rows), so compiled as a one-shot call launches it
    "plain-per-head-merge": (dict(one_shot=True), (), torch.bfloat16, None, 1, 2),
    "window": (dict(window_left=2100, max_pages=256), (), torch.bfloat16, None, 2, 8),  # split
    # as plan.run serves it (no LSE), where a window's load mask once cost 160 registers
    # (three programs per SM instead of four: perf-notes step 23)
    # (a window wider than launch.policy._WINDOW_UNIT_MAX_KEYS: the split plan; every window
    # case's table holds more tokens than its window, which is otherwise planned as no window)
    "window-no-lse": (dict(window_left=4096, lse=False, max_pages=512), (), torch.bfloat16,
                      None, 64, 8),
    # a 1,024-token window whose (sequence, kv head) pairs fill the GPU: one unit each
    # (window_one_unit), 32-token tiles 3 deep, no merge
    "window-one-unit-no-lse": (dict(window_left=1024, lse=False, max_pages=128), (),
                               torch.bfloat16, None, 64, 8),
    "softcap": (dict(logits_soft_cap=30.0), (), torch.bfloat16, None, 2, 8),
    "sinks": ({}, ("sinks",), torch.bfloat16, None, 2, 8),
    "sinks-per-head-merge": (dict(one_shot=True), ("sinks",), torch.bfloat16, None, 1, 2),
    "alibi": ({}, ("alibi_slopes",), torch.bfloat16, None, 2, 8),
    "invariant": (dict(batch_invariant=True), (), torch.bfloat16, None, 2, 8),
    "q_len4": (dict(q_len=4), (), torch.bfloat16, None, 2, 8),
    "everything": (dict(q_len=3, window_left=50, logits_soft_cap=5.0, batch_invariant=True),
                   ("sinks", "alibi_slopes"), torch.bfloat16, None, 2, 8),
    "q_len2-fp8-sinks": (dict(q_len=2), ("sinks",), torch.bfloat16, torch.float8_e4m3fn, 2, 8),
    "fp32-window-sinks": (dict(window_left=7), ("sinks",), torch.float32, None, 2, 8),
    # a 128-token table: one unit per sequence (ONE_UNIT), the main kernel only, no merge
    "one-unit-everything": (dict(max_pages=8, q_len=3, window_left=50, logits_soft_cap=5.0),
                            ("sinks", "alibi_slopes"), torch.bfloat16, None, 2, 8),
    "one-unit-fp8": (dict(max_pages=8), (), torch.bfloat16, torch.float8_e4m3fn, 1, 8),
    # paged prefill (kernels/prefill.py, launch/prefill.py): 128-row blocks of new tokens,
    # the unmasked and diagonal loops; 512 query rows of long chunks
    "prefill-bf16": (dict(num_tokens=512), (), torch.bfloat16, None, 8, 8),
    "prefill-fp8": (dict(num_tokens=512), (), torch.bfloat16, torch.float8_e4m3fn, 8, 8),
    "prefill-everything": (dict(num_tokens=512, window_left=100, logits_soft_cap=5.0),
                           ("sinks", "alibi_slopes"), torch.bfloat16, None, 8, 8),
    # the Gluon prefill kernel (kernels/prefill_gluon.py, opt-in) and its schedule kernel:
    # 128-key tiles two deep, 64-key tiles three deep, head dim 64
    "prefill-bf16-gluon": (dict(num_tokens=512, gluon=True), (), torch.bfloat16, None, 8, 8),
    "prefill-n64s3-gluon": (dict(num_tokens=512, gluon=True, block_n=64, num_stages=3), (),
                            torch.float16, None, 8, 8),
    "prefill-hd64-gluon": (dict(num_tokens=512, gluon=True, head_dim=64), (), torch.bfloat16,
                           None, 8, 8),
    "prefill-overlap-gluon": (dict(num_tokens=512, gluon=True, overlap=True, block_n=64,
                                   num_stages=2), (), torch.bfloat16, None, 8, 8),
    "prefill-split-gluon": (dict(num_tokens=512, gluon=True, split=True, block_n=64,
                                 num_stages=3), (), torch.bfloat16, None, 8, 8),
    "prefill-pingpong-gluon": (dict(num_tokens=512, gluon=True, split=True, ping_pong=True,
                                    block_n=64, num_stages=3), (), torch.bfloat16, None, 8, 8),
}

#: the MLA kernel (kernels/mla.py, launch/mla.py; pagedattn.mla's default) and its Gluon
#: path (kernels/mla_gluon.py, "-gluon": with the schedule kernel): name -> (query heads,
#: page size, q_len, LSE, cache dtype, per-call options, plan-time options), at
#: DeepSeek-V3's 512 + 64 dims, batch 64 and a 4k table, 66 parts (an H100/H200's 132 SMs
#: over TP1's two head blocks)
MLAK_CASES = {
    "mlak-tp1-bf16": (128, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp8-bf16": (16, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-fp8": (128, 64, 1, False, torch.float8_e4m3fn, (), {}),
    "mlak-tp1-q_len2-everything": (128, 64, 2, True, torch.bfloat16, ("sinks",),
                                   dict(logits_soft_cap=30.0)),
    "mlak-tp8-page1": (16, 1, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-gluon": (128, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp8-gluon": (16, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-q_len2-everything-gluon": (128, 64, 2, True, torch.bfloat16, ("sinks",),
                                         dict(logits_soft_cap=30.0)),
    "mlak-tp8-page1-gluon": (16, 1, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-fp8-gluon": (128, 64, 1, False, torch.float8_e4m3fn, (), {}),
    "mlak-tp8-fp8-gluon": (16, 64, 1, True, torch.float8_e5m2, (), {}),
    # its warp-specialized form (MLAKernelConfig.ws, opt-in): a producer warpgroup
    "mlak-tp1-ws-gluon": (128, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-q_len2-everything-ws-gluon": (128, 64, 2, True, torch.bfloat16, ("sinks",),
                                            {"logits_soft_cap": 30.0}),
    "mlak-tp8-fp8-ws-gluon": (16, 64, 1, True, torch.float8_e5m2, (), {}),
    # ... whose producer never waits for its own copies (MLAKernelConfig.land, opt-in)
    "mlak-tp1-ws-land-gluon": (128, 64, 1, False, torch.bfloat16, (), {}),
    "mlak-tp1-fp8-ws-land-gluon": (128, 64, 1, False, torch.float8_e4m3fn, (), {}),
}

#: an option that no case above switches on gets a case of its own, ``option-<name>`` (its
#: ``Option.example``), so a new variant compiles for sm_90 with no edit here; the word
#: ``new-options`` in ``--cases`` stands for those cases (none while every option has one)
_COVERED = {name for case in CASES.values() for name in (*case[0], *case[1])}
NEW_OPTION_CASES = [f"option-{name}" for name in OPTIONS if name not in _COVERED]
for _name in OPTIONS:
    if _name not in _COVERED:
        _on = ({_name: OPTIONS[_name].example}, ()) if OPTIONS[_name].when == "plan" else \
            ({}, (_name,))
        CASES[f"option-{_name}"] = (*_on, torch.bfloat16, None, 2, 8)


class _Compile:
    """Stands in for a ``@triton.jit`` kernel: ``[grid](**kwargs)`` compiles for sm_90
    (``_triton_compat.compile_for``: Triton's own specialization); what is not a parameter
    of the kernel is a launch option."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        names = {p.name for p in self.kernel.params}

        def compile_(**kwargs):
            options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
            options.pop("launch_pdl", None)  # a launch attribute, not a compile option
            return tc.compile_for(self.kernel, kwargs, arch=90, **options)
        return compile_


def case_launcher(name: str):
    """One case's :class:`~pagedattn.launch.decode.AutoLauncher` (CPU device) and a function
    that launches it on zero tensors made once (the same addresses at every launch)."""
    if name in MLAK_CASES:
        return mlak_case_launcher(name)
    options, per_call, dtype, kv_dtype, batch, kv_heads = CASES[name]
    options = dict(options)
    max_pages = options.pop("max_pages", 64)  # 1,024 tokens: splits and a merge
    with_lse = options.pop("lse", True)
    one_shot = options.pop("one_shot", False)  # paged_decode's launcher: a fresh workspace
    kv_dtype = kv_dtype or dtype
    q_len = options.pop("q_len", 1)
    num_tokens = options.pop("num_tokens", None)  # varlen queries (paged prefill)
    if num_tokens is not None:
        return prefill_case_launcher(options, per_call, dtype, kv_dtype, batch, kv_heads,
                                     num_tokens, with_lse)
    launcher = L.AutoLauncher(
        LaunchSpec(batch=batch, max_pages=max_pages, num_q_heads=32, num_kv_heads=kv_heads,
                   head_dim=128, page_size=16, q_dtype=dtype, kv_dtype=kv_dtype,
                   device=torch.device("cpu"), q_len=q_len, options=plan_options(options)),
        workspace=not one_shot)
    query = torch.zeros((batch, 32, 128) if q_len == 1 else (batch, q_len, 32, 128),
                        dtype=dtype)
    cache = torch.zeros(batch * 8, 16, kv_heads, 128, dtype=kv_dtype)
    tables = torch.zeros(batch, max_pages, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    tensors = {k: torch.zeros(32) for k in per_call}
    out, lse = torch.empty_like(query), torch.empty(query.shape[:-1]) if with_lse else None
    return launcher, lambda: launcher.launch(query, cache, cache, tables, lens, out, lse,
                                             scale=0.1, calls=tensors)


def prefill_case_launcher(options, per_call, dtype, kv_dtype, batch, kv_heads, num_tokens,
                          with_lse):
    """A prefill case's :class:`~pagedattn.launch.prefill.PrefillLauncher` (the GPU's tiles
    for long chunks), as :func:`case_launcher`; ``gluon`` (and tiles) in ``options``: the
    Gluon kernel's (``gluon_applies`` says no on a CPU device: forced here)."""
    options = dict(options)
    gluon = options.pop("gluon", False)
    head_dim = options.pop("head_dim", 128)
    tiles = {k: options.pop(k) for k in ("block_n", "num_stages", "overlap", "split",
                                         "ping_pong")
             if k in options}
    config = None
    if gluon:
        config = replace(LP.prefill_config(head_dim=head_dim, group=32 // kv_heads,
                                           kv_dtype=kv_dtype, page_size=16,
                                           max_query_len=None, interpret=False),
                         gluon=True, **tiles)
    real_applies = LP.gluon_applies
    LP.gluon_applies = lambda *a, **kw: gluon  # a CPU device: the policy would say no
    try:
        launcher = LP.PrefillLauncher(
            LaunchSpec(batch=batch, max_pages=64, num_q_heads=32, num_kv_heads=kv_heads,
                       head_dim=head_dim, page_size=16, q_dtype=dtype, kv_dtype=kv_dtype,
                       device=torch.device("cpu"), options=plan_options(options)),
            num_tokens=num_tokens, max_query_len=None, config=config)
    finally:
        LP.gluon_applies = real_applies
    query = torch.zeros(num_tokens, 32, head_dim, dtype=dtype)
    cache = torch.zeros(batch * 8, 16, kv_heads, head_dim, dtype=kv_dtype)
    tables = torch.zeros(batch, 64, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    tensors = {k: torch.zeros(32) for k in per_call}
    out, lse = torch.empty_like(query), torch.empty(query.shape[:-1]) if with_lse else None
    return launcher, lambda: launcher.launch(query, cache, cache, tables, lens, qsl, out, lse,
                                             scale=0.1, calls=tensors)


def mlak_case_launcher(name: str):
    """One MLA kernel case's (:data:`MLAK_CASES`) :class:`~pagedattn.launch.mla.MLALauncher`,
    as :func:`case_launcher`: the main kernel and the merge."""
    heads, page_size, q_len, with_lse, kv_dtype, per_call, options = MLAK_CASES[name]
    batch, max_pages, latent, rope = 64, 4096 // page_size, 512, 64
    gluon = name.endswith("-gluon")
    config = replace(LM.mla_kernel_config(num_heads=heads, q_len=q_len, latent_dim=latent,
                                          kv_dtype=kv_dtype, num_sms=132, interpret=False),
                     gluon=gluon, ws="-ws-" in name, land="-land-" in name)
    real_applies = LM.gluon_applies
    LM.gluon_applies = lambda **kw: gluon  # a CPU device: the policy would say no
    try:
        launcher = LM.MLALauncher(
            LaunchSpec(batch=batch, max_pages=max_pages, num_q_heads=heads, num_kv_heads=1,
                       head_dim=latent, page_size=page_size, q_dtype=torch.bfloat16,
                       kv_dtype=kv_dtype, device=torch.device("cpu"), q_len=q_len,
                       options=plan_options(options), rope_dim=rope),
            config=config)
    finally:
        LM.gluon_applies = real_applies
    lead = (batch, heads) if q_len == 1 else (batch, q_len, heads)
    q_nope = torch.zeros(*lead, latent, dtype=torch.bfloat16)
    q_pe = torch.zeros(*lead, rope, dtype=torch.bfloat16)
    cache = torch.zeros(batch * 8, page_size, latent + rope, dtype=kv_dtype)
    tables = torch.zeros(batch, max_pages, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    out, lse = torch.empty_like(q_nope), torch.empty(lead) if with_lse else None
    tensors = {k: torch.zeros(heads) for k in per_call}
    return launcher, lambda: launcher.launch(q_nope, q_pe, cache[..., :latent],
                                             cache[..., latent:], tables, lens, out, lse,
                                             scale=0.1, calls=tensors)


def compile_case(name: str) -> dict:
    """Compile one case's main and merge kernels (the main kernel only for a one-unit
    table); returns them by name."""
    return case_launcher(name)[1]()


def _first_difference(a, b) -> str:
    """Where two C launch calls first differ (``argument i``, ``[j]`` within a tuple)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            inner = f"[{_first_difference(x, y)}]" if isinstance(x, list) and isinstance(
                y, list) else f": {x!r} != {y!r}"
            return f"{i}{inner}"
    return f"the length: {len(a)} != {len(b)}"


def check_bindings(name: str) -> str | None:
    """Whether one case's recorded launch hands Triton's C launch what ``kernel[grid](
    **kwargs)`` hands it (``_triton_compat.recording_compiles``: Triton binds and specializes,
    then a launcher of the installed Triton's ``CudaLauncher`` records its C call instead of
    compiling and launching): the first launch of a binding goes through ``kernel[grid]``,
    the next through the record (the C launch itself without a hook, ``CompiledKernel.run``
    with one). Returns ``None``, or what differs."""
    seen: list = []
    with tc.recording_compiles(seen):
        launcher, launch = case_launcher(name)
        launcher._direct, launcher._get_stream = True, tc.current_stream  # as on a GPU
        if launcher.workspace is None:  # one-shot: the same fresh workspace every launch
            work = launcher.new_workspace()
            launcher.new_workspace = lambda: work
        kernels = 1 + launcher.launches_merge
        calls = {}
        for hook in (None, lambda metadata: None):
            with tc.launch_hook(hook) if hook else contextlib.nullcontext():
                launcher._records.clear()
                launch()  # kernel[grid]: Triton binds
                launch()  # the record
                with_hook = "hook" if hook else "no hook"
                calls[with_hook] = (seen[-2 * kernels:-kernels], seen[-kernels:])
    if len(seen) != 4 * kernels or len(launcher._records) != 1:
        return f"{len(seen)} C launches for {kernels} kernel(s) x 4, " \
               f"{len(launcher._records)} binding(s)"
    for with_hook, (triton_calls, recorded_calls) in calls.items():
        for k, (a, b) in enumerate(zip(triton_calls, recorded_calls, strict=True)):
            if a != b:
                return f"{'merge' if k else 'main'} kernel, {with_hook}: C launch differs " \
                       f"at {_first_difference(a, b)}"
    return None


_SCOPE_LABEL = re.compile(r"\$L__tmp\d+:")


def ptx_code(ptx: str) -> list[str]:
    """A PTX file's instructions and declarations: without the ``.loc``/``.file`` directives,
    the ``$L__tmpN:`` labels of the debug scopes, comments and the DWARF ``.section
    .debug_*`` blocks (line numbers and source scopes, not code)."""
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            break
        if stripped.startswith((".loc", ".file")) or _SCOPE_LABEL.fullmatch(stripped):
            continue
        code = line.split("//", 1)[0].rstrip()
        if code:
            lines.append(code)
    return lines


PTXAS = tc.ptxas(90)


def resources(ptx: str) -> tuple[int, int, int] | None:
    """``(registers, spill store bytes, spill load bytes)`` of a PTX file, as Triton's own
    ``ptxas -lineinfo -v`` reports them for sm_90a; ``None`` where no ``ptxas`` is found
    (``_triton_compat.ptxas``: ``$TRITON_PTXAS_PATH``, the installed Triton's, the system's)."""
    if PTXAS is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        log = subprocess.run([str(PTXAS), "-lineinfo", "-v", "--gpu-name=sm_90a", str(src),
                              "-o", str(Path(tmp, "k.cubin"))], capture_output=True, text=True,
                             check=True).stderr
    return tuple(int(re.search(pattern, log).group(1)) for pattern in (
        r"Used (\d+) registers", r"(\d+) bytes spill stores", r"(\d+) bytes spill loads"))


NVDISASM = tc.nvdisasm()
_SASS_INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_SASS_LABEL = re.compile(r"\s*\.(L_x_\d+):")


def token_loop(cubin: bytes) -> tuple[list[str], list[str]] | None:
    """A compiled kernel's SASS instructions inside its token loop and outside it: the
    smallest backward-branch loop that holds tensor-core instructions (``HMMA``, ``HGMMA``),
    read off ``nvdisasm``'s SASS (``_triton_compat.nvdisasm``); ``None`` where there is no
    ``nvdisasm`` or no such loop."""
    if NVDISASM is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        sass = subprocess.run([str(NVDISASM), "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
    insts, labels, pending = [], {}, None
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line):
            pending = m.group(1)
        elif m := _SASS_INST.search(line):
            addr = int(m.group(1), 16)
            insts.append((addr, m.group(2)))
            if pending:
                labels[pending], pending = addr, None
    loops = []
    for addr, inst in insts:
        target = re.search(r"BRA `\(\.(L_x_\d+)\)", inst)
        if target and labels.get(target.group(1), addr) < addr:
            lo = labels[target.group(1)]
            if any("MMA" in i for a, i in insts if lo <= a <= addr):  # HMMA, HGMMA
                loops.append((addr - lo, lo, addr))
    if not loops:
        return None
    _, lo, hi = min(loops)
    return ([i for a, i in insts if lo <= a <= hi], [i for a, i in insts if not lo <= a <= hi])


def loop_spills(cubin: bytes) -> int | None:
    """Spill instructions (``STL``/``LDL``) inside the token loop of a compiled kernel
    (:func:`token_loop`); ``None`` where there is none or no such loop exists.
    A spill outside the loop costs an L1 round trip a piece; one inside costs it every tile
    (docs/perf-notes.md, step 40)."""
    parts = token_loop(cubin)
    if parts is None:
        return None
    return sum(1 for i in parts[0] if re.match(r"(@!?P\d\s+)?(STL|LDL)", i))


def _resources_text(res: tuple[int, int, int] | None) -> str:
    return "" if res is None else f", {res[0]} registers, {res[1]}/{res[2]} bytes spilled"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join([*CASES, *MLAK_CASES]),
                   help="comma list (default: all)")
    p.add_argument("--ptx-dir", help="write each compiled kernel's PTX here")
    p.add_argument("--compare", metavar="DIR",
                   help="compare each kernel's instructions with DIR/<case>.<kind>.ptx (exit 1 "
                        "if any differs or is missing)")
    p.add_argument("--bindings", action="store_true",
                   help="compile nothing: check that each case's recorded launch hands Triton's "
                        "C launch what kernel[grid](**kwargs) hands it (exit 1 if any differs)")
    args = p.parse_args(argv)
    cases = [c for word in args.cases.split(",")
             for c in (NEW_OPTION_CASES if word == "new-options" else [word])]
    unknown = [c for c in cases if c not in CASES and c not in MLAK_CASES]
    if unknown or (args.bindings and (args.ptx_dir or args.compare)):
        print("compile_sm90: error: " + (
            f"unknown case {unknown[0]!r} (see CASES, MLAK_CASES)" if unknown
            else "--bindings compiles nothing: no --ptx-dir or --compare"), file=sys.stderr)
        return 2
    if args.bindings:
        print(f"triton {tc.triton.__version__}: recorded launch "
              f"{'on' if tc.VERSION in tc.LAUNCH_FORMS else 'OFF (an unread Triton)'}, "
              f"C launch form {tc.LAUNCH_FORMS.get(tc.VERSION)}", flush=True)
        bad = checked = 0
        for case in cases:
            if "num_tokens" in CASES.get(case, ({},))[0] or case in MLAK_CASES:
                # the prefill and MLA launchers record nothing
                print(f"{case}: never recorded (every launch through kernel[grid])")
                continue
            checked += 1
            verdict = check_bindings(case)
            bad += verdict is not None
            print(f"{case}: {verdict or 'same C launch arguments'}", flush=True)
        print(f"bindings: {bad} of {checked} case(s) differ")
        return 1 if bad else 0
    differ = missing = 0
    for name in ("_paged_decode_kernel", "_merge_per_group_kernel", "_merge_per_head_kernel"):
        setattr(L, name, _Compile(getattr(L, name)))
    LP._paged_prefill_kernel = _Compile(LP._paged_prefill_kernel)
    LM._mla_decode_kernel = _Compile(LM._mla_decode_kernel)
    LM._mla_merge_kernel = _Compile(LM._mla_merge_kernel)
    LM._mla_schedule_kernel = _Compile(LM._mla_schedule_kernel)
    LP._prefill_schedule_kernel = _Compile(LP._prefill_schedule_kernel)
    if any(case.endswith("-gluon") for case in cases):
        import pagedattn.kernels.mla_gluon as KG  # noqa: PLC0415 (Gluon: imported on use)
        import pagedattn.kernels.prefill_gluon as KPG  # noqa: PLC0415

        KG._mla_decode_gluon_kernel = _Compile(KG._mla_decode_gluon_kernel)
        KG._mla_decode_gluon_ws_kernel = _Compile(KG._mla_decode_gluon_ws_kernel)
        KPG._paged_prefill_gluon_kernel = _Compile(KPG._paged_prefill_gluon_kernel)
    print(f"triton {tc.triton.__version__}, ptxas {PTXAS}, nvdisasm {NVDISASM}", flush=True)
    for case in cases:
        compiled = compile_case(case)
        for kind, c in compiled.items():
            res = resources(c.asm["ptx"])
            spills = loop_spills(c.asm["cubin"]) if res is not None else None
            print(f"{case}: {kind} {c.name} ok, {len(c.asm['ptx'].splitlines())} PTX lines"
                  f"{_resources_text(res)}, {c.metadata.shared} bytes of shared memory"
                  f"{', wgmma' if 'wgmma' in c.asm['ptx'] else ''}"
                  + ("" if spills is None else f", {spills} spill instructions in the token loop"),
                  flush=True)
            if args.ptx_dir:
                Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
                Path(args.ptx_dir, f"{case}.{kind}.ptx").write_text(c.asm["ptx"])
            if args.compare:
                old = Path(args.compare, f"{case}.{kind}.ptx")
                if not old.is_file():
                    verdict = f"no {old} to compare (a new case)"
                    missing += 1
                elif ptx_code(old.read_text()) != ptx_code(c.asm["ptx"]):
                    verdict = "DIFFERENT instructions from"
                elif (old_res := resources(old.read_text())) != res:
                    verdict = (f"same instructions, DIFFERENT registers/spills "
                               f"({_resources_text(old_res)[2:]} before) from")
                else:
                    verdict = "same instructions as"
                differ += old.is_file() and verdict != "same instructions as"
                print(f"  {verdict} {old}" if old.is_file() else f"  {verdict}", flush=True)
    if args.compare:
        print(f"compare: {differ} kernel(s) differ from {args.compare}"
              + (f", {missing} without a file there (new cases)" if missing else ""))
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
