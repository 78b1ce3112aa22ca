"""The package's own needs: ``import pagedattn`` and its launch layer need torch and triton only;
numpy, tqdm, matplotlib and tabulate belong to the extras that use them (pyproject.toml).
(Triton's CPU interpreter itself imports numpy, an undeclared need of triton: the ``interpret``
extra names it.) Without an extra, what needs it refuses in one line naming it: a launch under
the interpreter without numpy (or Triton 3.6's with numpy 2.4), a subcommand without its extra.

CPU tensors without Triton's interpreter: a clear ``ValueError`` before any launch. Triton runs
CPU tensors only through its interpreter, selected by ``TRITON_INTERPRET=1`` when its kernels
are defined; the library never sets the variable. Without it Triton would fail with "0 active
drivers". Each case runs in a fresh interpreter (the test process itself has the variable set
by conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _tail(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def test_an_interpreted_launch_without_numpy_names_the_interpret_extra():
    """Under ``TRITON_INTERPRET=1`` without numpy, ``import triton`` itself fails deep inside
    Triton (its interpreter imports numpy): a decode raises one ``ModuleNotFoundError`` naming
    the ``interpret`` extra instead, before Triton is imported; ``import pagedattn`` and the
    oracle still work."""
    probe = """
import sys, warnings
sys.modules["numpy"] = None
warnings.simplefilter("ignore")
import pagedattn
from pagedattn.testing import make_paged_inputs
inputs = make_paged_inputs([3, 17, 0])
pagedattn.paged_decode_reference(*inputs)
try:
    pagedattn.paged_decode(*inputs)
finally:
    print("triton imported:", "triton" in sys.modules)
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == "triton imported: False\n", done.stderr[-2000:]
    assert _tail(done) == (
        "ModuleNotFoundError: pagedattn: Triton's interpreter (TRITON_INTERPRET=1) needs numpy, "
        'which is not installed: pip install "pagedattn[interpret]"')


def test_interpreter_numpy_problem_refuses_what_fails():
    """Triton 3.6's interpreter fails with numpy 2.4 (a 1-element array to a scalar: an error
    there, a deprecation warning in 2.3, which runs); 3.7-3.9 run with 2.4; no numpy at all
    names the extra. Off the interpreter, nothing is checked."""
    from pagedattn import _env

    assert _env.interpreter_numpy_problem("3.6.0", "2.2.6") is None
    assert _env.interpreter_numpy_problem("3.6.0", "2.3.5") is None
    for triton in ("3.7.1", "3.8.0", "3.9.0", "3.10.0+git1a2b"):
        assert _env.interpreter_numpy_problem(triton, "2.4.6") is None
    assert _env.interpreter_numpy_problem("3.6.0", "2.4.0") == (
        "pagedattn: Triton 3.6's interpreter (TRITON_INTERPRET=1) fails with numpy >= 2.4 "
        '(found numpy 2.4.0): pip install "numpy<2.3"')
    assert "pagedattn[interpret]" in _env.interpreter_numpy_problem("3.8.0", None)


def test_an_interpreted_launch_with_too_new_a_numpy_is_one_error():
    """The check that ``pagedattn.launch`` runs when it loads: with the interpreter on and
    Triton 3.6 beside numpy 2.4 (faked), one ``DependencyError`` (an ``ImportError``) naming
    the fix; with the interpreter off, none."""
    probe = """
import sys
import numpy
from pagedattn import _env
numpy.__version__ = "2.4.6"
_env.installed_triton = lambda: "3.6.0"
try:
    _env.check_interpreter_numpy()
except ImportError as e:
    print(type(e).__name__, e)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for interpret, expected in (("1", "DependencyError pagedattn: Triton 3.6's interpreter "
                                      "(TRITON_INTERPRET=1) fails with numpy >= 2.4 (found "
                                      'numpy 2.4.6): pip install "numpy<2.3"\n'),
                                ("0", "")):
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env=dict(env, TRITON_INTERPRET=interpret), timeout=300)
        assert done.returncode == 0 and done.stdout == expected, done.stderr[-2000:]


@pytest.mark.parametrize("argv, module, extra", [
    (["run"], "tqdm", "bench"), (["ladder", "--help"], "matplotlib", "bench"),
    (["bench", "--dry-run"], "numpy", "bench"), (["generate"], "gguf", "serve"),
    (["bench-model"], "transformers", "serve"),
])
def test_a_subcommand_without_its_extra_is_one_line(argv, module, extra, capsys, monkeypatch):
    """``pagedattn run`` without tqdm (the wheel alone) ended in a traceback: a subcommand
    whose extra is not installed is refused in one line naming the extra, exit status 2,
    before its module loads (``--help`` of it too: a module may import the extra on load)."""
    from pagedattn import cli

    others = [m for m in cli.EXTRA_MODULES[extra] if m != module and cli._not_installed(m)]
    if others:  # CI's Triton 3.9 phase installs no extra but interpret
        pytest.skip(f"the {extra} extra is not installed here ({', '.join(others)} missing)")
    monkeypatch.setitem(sys.modules, module, None)  # any import of it now fails
    assert cli.main(argv) == 2
    command = argv[0]
    assert capsys.readouterr().err == (
        f"pagedattn {command}: error: 'pagedattn {command}' needs the {extra} extra ({module} "
        f'is not installed): pip install "pagedattn[{extra}]"\n')


def test_the_cli_reports_a_dependency_error_in_one_line(capsys, monkeypatch):
    """What a subcommand meets while it runs, such as the interpreter's numpy check
    (``_env.DependencyError``), is one line and exit status 2."""
    from pagedattn import _env, cli

    if cli.missing_extra("run"):
        pytest.skip("the bench extra is not installed here")
    from pagedattn.bench import harness

    def clash(args):
        raise _env.DependencyError(_env.interpreter_numpy_problem("3.6.0", "2.4.6"))
    monkeypatch.setattr(harness.RUN, "main", clash)
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err == (
        "pagedattn run: error: Triton 3.6's interpreter (TRITON_INTERPRET=1) fails with numpy "
        '>= 2.4 (found numpy 2.4.6): pip install "numpy<2.3"\n')


def test_the_cli_extras_are_pyproject_extras():
    """Every subcommand names an extra, and each module the CLI requires of an extra is one
    that extra declares (pyproject.toml)."""
    from pagedattn import cli

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(cli.EXTRA_OF) == set(cli.COMMANDS)
    for extra, modules in cli.EXTRA_MODULES.items():
        declared = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in extras[extra]}
        assert set(modules) <= declared, (extra, set(modules) - declared)


# -- CPU tensors without the interpreter -------------------------------------------------------

SRC = str(ROOT / "src")

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
