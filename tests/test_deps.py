"""The package's own needs: ``import pagedattn`` and its launch layer need torch and triton only;
numpy, tqdm, matplotlib and tabulate belong to the extras that use them (pyproject.toml).
(Triton's CPU interpreter itself imports numpy, an undeclared need of triton: the ``interpret``
extra names it.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("numpy", "tqdm", "matplotlib", "tabulate")

PROBE = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # any import of these now raises ImportError
import importlib, pkgutil, warnings
warnings.simplefilter("ignore")  # torch warns that it runs without numpy
import pagedattn
from pagedattn.testing import make_paged_inputs
inputs = make_paged_inputs([3, 17, 0])
out = pagedattn.paged_decode_reference(*inputs).out
assert out.shape == (3, 4, 64), out.shape
import pagedattn.launch, pagedattn.kernels
for pkg in (pagedattn.launch, pagedattn.kernels):
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
print("ok", sorted(m for m in sys.modules if m.startswith("pagedattn.")))
"""


def test_import_and_launchers_need_only_torch_and_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok") and "pagedattn.launch." in done.stdout


def test_core_dependencies_are_torch_and_triton():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert core == {"torch", "triton"}
    extras = project["optional-dependencies"]
    assert {"matplotlib", "tabulate", "tqdm"} <= set(extras["bench"])
    assert "numpy" in extras["interpret"] and "numpy" in extras["dev"]
