"""CPU tensors without Triton's interpreter: a clear ``ValueError`` before any launch.

Triton runs CPU tensors only through its interpreter, selected by ``TRITON_INTERPRET=1`` when
its kernels are defined; the library never sets the variable. Without it Triton would fail
with "0 active drivers". Each case runs in a fresh interpreter (the test process itself has
the variable set by conftest).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

INPUTS = """
import sys, torch, pagedattn
from pagedattn.testing import make_paged_inputs
inputs = make_paged_inputs([5, 0, 17], num_q_heads=4, num_kv_heads=2, head_dim=32,
                           page_size=8, dtype=torch.float32)
"""


def _run(body: str, interpret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    code = textwrap.dedent(INPUTS) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def _expect_error(result: subprocess.CompletedProcess, name: str) -> None:
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ERROR" in result.stdout, result.stdout
    message = result.stdout.split("ERROR", 1)[1]
    assert message.startswith(f" {name}:"), message
    assert "TRITON_INTERPRET=1" in message and "before triton is imported" in message, message


@pytest.mark.parametrize(("impl", "interpret"), [("auto", None), ("split_kv_v4", "0")])
def test_paged_decode_cpu_tensors_need_the_interpreter(impl, interpret):
    """No ``TRITON_INTERPRET`` (or ``0``): ValueError naming ``query``, saying what to set,
    raised before any launch and without importing Triton."""
    result = _run(f"""
        try:
            pagedattn.paged_decode(*inputs, impl={impl!r})
            print("NO ERROR")
        except ValueError as e:
            print("ERROR", e)
        print("triton imported:", "triton" in sys.modules)
    """, interpret)
    _expect_error(result, "query")
    assert "triton imported: False" in result.stdout


def test_append_kv_cpu_tensors_need_the_interpreter():
    result = _run("""
        from pagedattn.launch.append_kv import append_kv
        new = torch.randn(2, 2, 32)
        try:
            append_kv(new, new, inputs.key_cache, inputs.value_cache,
                      torch.tensor([0, 1], dtype=torch.int32))
            print("NO ERROR")
        except ValueError as e:
            print("ERROR", e)
    """, None)
    _expect_error(result, "key")


def test_kernels_imported_before_the_variable_was_set():
    """Setting the variable after pagedattn's kernels were imported is too late (their
    ``@triton.jit`` objects are GPU kernels): the same clear error, not a driver failure."""
    result = _run("""
        import os
        import pagedattn.launch.stages  # defines the kernels without the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            pagedattn.paged_decode(*inputs, impl="baseline")
            print("NO ERROR")
        except ValueError as e:
            print("ERROR", e)
    """, None)
    _expect_error(result, "query")


def test_with_the_interpreter_cpu_tensors_run():
    """The control: with ``TRITON_INTERPRET=1`` set first, the same call runs and matches the
    float64 reference."""
    result = _run("""
        from pagedattn.testing import check_against_reference
        out = pagedattn.paged_decode(*inputs, impl="fused_v1")
        print("ERR", check_against_reference(out, inputs))
    """, "1")
    assert result.returncode == 0, result.stderr[-2000:]
    err = float(result.stdout.split("ERR", 1)[1])
    assert err <= 1e-4
