"""Helpers of the tests that run the repository's ``scripts/`` in a subprocess: the sm_90
compile checks (``scripts/compile_sm90.py``, Triton's interpreter off) and the benchmark
scripts' CPU dry runs (interpreter on).

Not a test module (no ``test_`` prefix); the test files import it by name (pytest puts
``tests/`` on ``sys.path``).
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
