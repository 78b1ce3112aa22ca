"""Helpers of the tests that run the repository's ``scripts/`` in a subprocess: the sm_90
compile checks (``scripts/compile_sm90.py``, Triton's interpreter off) and the benchmark
scripts' CPU dry runs (interpreter on).

Not a test module (no ``test_`` prefix); the test files of every folder import it by name
(pyproject.toml's pytest ``pythonpath`` puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, interpret: bool, timeout: float
               ) -> subprocess.CompletedProcess:
    """``scripts/<name> *args`` in a fresh Python with this checkout's ``src`` as
    ``PYTHONPATH``, ``TRITON_INTERPRET=1`` set (``interpret``) or removed (a real compile:
    no GPU needed, nothing launched); its output captured as text, killed after ``timeout``
    seconds (``subprocess.TimeoutExpired``)."""
    if interpret:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


#: The sm_90 counts over Triton 3.6's bounds, per Triton that pagedattn admits (3.6-3.9: the
#: Tritons of ``_triton_compat.LAUNCH_FORMS``), measured by a compile on that Triton:
#: ``scripts/compile_sm90.py`` (no GPU; ``ptxas -v`` and ``nvdisasm`` of the ptxas the installed
#: Triton assembles sm_90 with, 3.9's ``ptxas-blackwell``) with torch 2.13.0, triton 3.7.1 and
#: 3.9.0, and torch 2.14.1 with triton 3.8.0 (what pip picks for README's command 1).
#: ``{(major, minor): {(case, quantity): the count measured}}``, quantity one of "registers",
#: "spill bytes" (ptxas's spill stores), "loop spills" (STL/LDL in the token loop). The tests'
#: bounds are 3.6's (the code the GPU measured; perf-notes), so a count here is what that
#: Triton's compiler makes of the same source: the bound for it on that Triton only, where a
#: regression past it still fails. 3.8's fp8 tile takes 138 registers (three programs per SM
#: where the split planner assumes four) and its fp32 token loop spills (plain-fp32 81
#: instructions): 3.8 is CPU-only (README's support table).
SM90_OVER: dict[tuple[int, int], dict[tuple[str, str], int]] = {
    (3, 6): {},
    (3, 7): {},
    (3, 8): {("plain-fp8", "registers"): 138},
    (3, 9): {("prefill-bf16-gluon", "loop spills"): 1, ("prefill-n64s3-gluon", "loop spills"): 1,
             ("mlak-tp1-ws-gluon", "loop spills"): 1,
             ("mlak-tp1-q_len2-everything-ws-gluon", "loop spills"): 6,
             ("mlak-tp8-fp8-ws-gluon", "loop spills"): 6,
             ("mlak-tp1-fp8-ws-land-gluon", "loop spills"): 2},
}


def sm90_bound(case: str, quantity: str, bound: int) -> int:
    """The bound the installed Triton holds ``case``'s ``quantity`` to: Triton 3.6's
    ``bound`` unless :data:`SM90_OVER` records this Triton's measured count. On a Triton
    newer than the table the test skips here, after its kernels compiled: their registers
    are that compiler's, not yet measured."""
    import pytest

    from pagedattn.launch import _triton_compat as tc

    if tc.VERSION not in SM90_OVER:
        known = ", ".join(f"{major}.{minor}" for major, minor in SM90_OVER)
        pytest.skip(f"triton {tc.triton.__version__}: its sm_90 registers and spills were never "
                    f"measured (tests/_scripts.py, SM90_OVER: {known}); every kernel compiled, "
                    "none held to a count")
    return SM90_OVER[tc.VERSION].get((case, quantity), bound)


def compiled_sm90(cases: tuple[str, ...]) -> dict[str, str]:
    """``scripts/compile_sm90.py --cases`` on ``cases`` (exit 0 asserted, its stderr's tail
    the message): ``{case: its " ok," line}`` (registers, shared memory, spills, as the
    script prints them), one entry per case that compiled."""
    run = run_script("compile_sm90.py", "--cases", ",".join(cases), interpret=False,
                     timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return {line.split(":")[0]: line for line in run.stdout.splitlines() if " ok," in line}


def assert_unknown_row_exits_2(name: str) -> None:
    """``scripts/<name> --dry-run --rows nope`` exits 2 with one line on stderr (a bench
    script's refusal of an unknown row)."""
    bad = run_script(name, "--dry-run", "--rows", "nope", interpret=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
