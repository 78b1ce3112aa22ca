"""Smoke test of an installed pagedattn (CI: the wheel in a fresh virtualenv, on each Triton of
its smoke run). Run it from outside the source tree, so that ``import pagedattn`` finds the
installed package::

    cd /tmp && python /path/to/scripts/smoke_wheel.py

It checks: the package imports from site-packages, not from a checkout; ``__version__`` is the
installed distribution's; the packaged data (traces, licenses) came along; one CPU decode in
Triton's interpreter matches the float64 oracle; ``pagedattn --help`` exits 0; where the bench
extra is not installed (CI installs the wheel with ``[interpret]`` only), ``pagedattn run`` is
refused in one line naming it, exit status 2. Prints one line per check and exits 1 at the
first that fails.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import importlib.metadata  # noqa: E402
import importlib.resources  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


def fail(what: str) -> None:
    print(f"smoke: FAILED: {what}", flush=True)
    sys.exit(1)


def main() -> int:
    import torch
    import triton

    import pagedattn
    from pagedattn.testing import make_paged_inputs, rel_l2_error, tolerance_for

    where = os.path.dirname(pagedattn.__file__)
    if "site-packages" not in where:
        fail(f"pagedattn imported from {where}, not from an installed package")
    dist = importlib.metadata.distribution("pagedattn")
    if pagedattn.__version__ != dist.version:
        fail(f"__version__ {pagedattn.__version__} != the installed {dist.version}")
    print(f"smoke: pagedattn {pagedattn.__version__} from {where}; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    data = importlib.resources.files("pagedattn") / "data"
    names = sorted(p.name for p in data.iterdir())
    licenses = [f for f in dist.files or () if f.name == "LICENSE"]
    if not any(n.endswith(".csv") for n in names) or not licenses:
        fail(f"packaged data {names}, license files {licenses}")
    print(f"smoke: {len(names)} data files, {licenses[0]}", flush=True)
    x = make_paged_inputs([5, 40, 0, 77], num_q_heads=8, num_kv_heads=2, head_dim=64,
                          page_size=16, dtype=torch.float16, seed=1)
    out = pagedattn.paged_decode(*x, num_splits=3)
    err = float(rel_l2_error(out, pagedattn.paged_decode_reference(*x).out))
    if not err <= tolerance_for(torch.float16):
        fail(f"decode against the oracle: rel. L2 {err:.2e}")
    print(f"smoke: one decode in the interpreter, rel. L2 {err:.1e} against the oracle",
          flush=True)
    cli = shutil.which("pagedattn", path=os.path.dirname(sys.executable))
    if cli is None:
        fail(f"no pagedattn command beside {sys.executable}")
    done = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or "usage: pagedattn" not in done.stdout:
        fail(f"pagedattn --help: exit {done.returncode}, {done.stderr[-500:]}")
    print("smoke: pagedattn --help ok", flush=True)
    from pagedattn.cli import missing_extra

    if missing_extra("run") is None:
        print("smoke: the bench extra is installed: pagedattn run's refusal not checked")
    else:
        done = subprocess.run([cli, "run"], capture_output=True, text=True, timeout=300)
        # (without numpy, torch's own warning that it found none comes first)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        if done.returncode != 2 or "Traceback" in done.stderr or not last.startswith(
                "pagedattn run: error: ") or not last.endswith('pip install "pagedattn[bench]"'):
            fail(f"pagedattn run without the bench extra: exit {done.returncode}, "
                 f"{done.stderr[-500:]}")
        print(f"smoke: {last}", flush=True)
    print("smoke: ok", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:]:
        print(f"smoke_wheel: error: takes no arguments (got {sys.argv[1]!r})", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
