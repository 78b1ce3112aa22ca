"""The import rules DESIGN.md states, read from the source with ``ast`` (nothing is imported):
one-way layers ``cli → bench/serving → api → launch → kernels`` (inside the API layer,
``api → one_shot → plan``; ``compat → api`` and ``integrations → api`` beside
bench/serving: nothing else imports them), leaves that import no
``pagedattn`` layer, no cycles, and dispatch through real import statements. Imports inside
functions count: they are what a reader (and a tool such as import-linter) follows too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
#: modules that import no pagedattn module but these (torch only, or one leaf)
LEAVES = {"pagedattn._env": set(), "pagedattn._validation": {"pagedattn._env"},
          "pagedattn._errors": set(),
          "pagedattn._cli_types": set(), "pagedattn.traces": set(), "pagedattn.reference": set(),
          "pagedattn.options": {"pagedattn._validation"},
          "pagedattn.spec": {"pagedattn.options"},
          "pagedattn._validation_mla": {"pagedattn._validation"},
          "pagedattn.testing": {"pagedattn.reference"}}
#: the one kernel outside the attention path: the roofline probe that bench/timing launches
MEASUREMENT_KERNELS = {"pagedattn.kernels.readbw"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """``module -> pagedattn modules it imports`` (``from pkg import submodule`` resolved)."""
    paths = {_module_name(p): p for p in (SRC / "pagedattn").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("pagedattn"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.startswith("pagedattn"):
                    targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                                   for a in node.names)
        graph[name] = targets - {name}
    return graph


GRAPH = _import_graph()


def _layer(module: str) -> str:
    for prefix in ("kernels", "launch", "bench", "serving", "compat", "integrations"):
        if module.startswith(f"pagedattn.{prefix}"):
            return prefix
    return {"pagedattn.api": "api", "pagedattn.attention": "api", "pagedattn.mla": "api",
            "pagedattn.plan": "api", "pagedattn.one_shot": "api", "pagedattn": "api",
            "pagedattn.cli": "cli"}.get(module, "leaf")


#: what each layer may import (leaves are checked on their own)
ALLOWED = {"kernels": {"kernels"}, "launch": {"launch", "kernels", "leaf"},
           "api": {"api", "launch", "leaf"}, "bench": {"bench", "api", "leaf"},
           "serving": {"serving", "api", "leaf"}, "compat": {"compat", "api", "leaf"},
           # the serving frameworks' plugins (vLLM's backend) use the API as a user does, as
           # compat/ does; a framework's process imports them by name, the library never
           "integrations": {"integrations", "api", "leaf"},
           "cli": {"bench", "serving", "leaf"}}


def test_graph_was_read():
    assert {"pagedattn.api", "pagedattn.launch.decode", "pagedattn.kernels.decode"} <= set(GRAPH)
    assert "pagedattn.launch.decode" in GRAPH["pagedattn.plan"]
    assert "pagedattn.kernels.decode" in GRAPH["pagedattn.launch.decode"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_one_way(module):
    layer = _layer(module)
    if layer == "leaf":
        assert GRAPH[module] <= LEAVES[module], f"{module} is a leaf but imports {GRAPH[module]}"
        return
    wrong = {t for t in GRAPH[module] if _layer(t) not in ALLOWED[layer]
             and not (layer == "bench" and t in MEASUREMENT_KERNELS)}
    assert not wrong, f"{module} ({layer}) imports {sorted(wrong)}"


def test_the_plan_and_the_one_shot_cache_sit_below_the_api():
    """Inside the API layer, one way too: ``api`` on top, ``one_shot`` (the template cache)
    below it, ``plan`` (``DecodePlan``) below both; neither imports back up."""
    assert {"pagedattn.plan", "pagedattn.one_shot"} <= GRAPH["pagedattn.api"]
    assert "pagedattn.plan" in GRAPH["pagedattn.one_shot"]
    assert not GRAPH["pagedattn.one_shot"] & {"pagedattn.api", "pagedattn"}
    assert not GRAPH["pagedattn.plan"] & {"pagedattn.api", "pagedattn.one_shot", "pagedattn"}


def test_compat_sits_above_the_api():
    assert "pagedattn.compat.flash_attn" in GRAPH and "pagedattn.compat.flashinfer" in GRAPH
    assert not [m for m, targets in GRAPH.items() if _layer(m) != "compat"
                and any(_layer(t) == "compat" for t in targets)]


def test_integrations_sit_above_the_api():
    assert {"pagedattn.integrations.vllm.backend", "pagedattn.integrations.step"} <= set(
        GRAPH)
    assert not [m for m, targets in GRAPH.items() if _layer(m) != "integrations"
                and any(_layer(t) == "integrations" for t in targets)]


def test_nothing_imports_the_cli():
    assert not [m for m, targets in GRAPH.items() if "pagedattn.cli" in targets]


def _cycles() -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(GRAPH):
        if start not in state:
            visit(start, [start])
    return cycles


def test_no_import_cycles():
    assert not _cycles()


def test_cli_dispatch_uses_import_statements():
    tree = ast.parse((SRC / "pagedattn" / "cli.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr == "import_module"]
    assert not calls


def test_the_launch_policy_is_pure():
    """``launch/policy.py`` decides from shapes, dtypes and device facts: it imports no Triton
    and no kernel (the launcher, ``launch/decode.py``, builds the launches)."""
    tree = ast.parse((SRC / "pagedattn" / "launch" / "policy.py").read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "triton"}, imported
    assert not {m for m in GRAPH["pagedattn.launch.policy"] if _layer(m) == "kernels"}


#: Triton's modules under its public surface (``triton``, ``triton.language``, ``triton.jit``,
#: ``triton.testing``): what only the version seam may import or reach
_PRIVATE_TRITON = ("triton.knobs", "triton.runtime", "triton.backends", "triton.compiler",
                   "triton._C", "triton._utils")
_PRIVATE_NAMES = {"knobs", "CudaLauncher", "_patch_lang", "_LangPatchScope", "_do_compile",
                  "get_ptxas", "getenv_bool", "InterpreterBuilder"}
SEAM = "src/pagedattn/launch/_triton_compat.py"


def _private_triton_uses(source: str) -> list[str]:
    """The imports and attribute or name uses of Triton's private API in ``source`` (code
    only: docstrings, comments and strings do not count)."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            uses += [n for n in names if n.startswith(_PRIVATE_TRITON)]
        elif isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name.startswith(_PRIVATE_TRITON)]
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_NAMES:
            uses.append(f".{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _PRIVATE_NAMES:
            uses.append(node.id)
    return uses


def test_private_triton_api_lives_in_the_seam():
    """Every use of Triton's private API (``knobs``, the runtime and its driver and
    interpreter, the backends' launcher and tools, the compiler's entry points, ``_C``) is in
    ``launch/_triton_compat.py``, the version seam, where each has a version-checked
    fallback: in the library, the scripts and the tests alike."""
    assert _private_triton_uses("from triton.runtime import driver\nfrom triton import knobs\n"
                                "import triton.backends.nvidia.driver\nx.CudaLauncher\n") == [
        "triton.runtime.driver", "triton.knobs", "triton.backends.nvidia.driver",
        ".CudaLauncher"]
    root = SRC.parent
    found = {}
    for folder in ("src", "scripts", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            uses = _private_triton_uses(path.read_text(encoding="utf-8"))
            if uses and rel != SEAM:
                found[rel] = uses
    assert found == {}
    assert _private_triton_uses((root / SEAM).read_text(encoding="utf-8"))
