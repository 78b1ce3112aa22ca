"""Test setup: Triton's interpreter on machines without a GPU, and the ``gpu``/``gpu2`` markers.

``TRITON_INTERPRET`` must be set before anything imports ``triton``; conftest is imported
before the test modules, so it is set here (the library itself never sets it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _patch_the_language_once_per_launch() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` at the start of a launch (its
    ``GridExecutor``, restored when the launch ends) and again at every call of a nested
    ``@triton.jit`` helper (``InterpretedFunction.__call__``), although the launch's patch
    is still in place then: an ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and
    ``tl.math`` per helper call, about a third of an interpreted decode call (cProfile of
    ``gqa_reuse_v3`` at batch 4). The production kernel is a chain of named helpers, so every
    CPU test paid it. Here a helper's call inside a launch skips the repeat (it would set the
    same attributes to equivalent wrappers, and its scope is never restored); the launch's
    own patch and restore are Triton's; a helper from a module the launch did not patch
    (``triton.language.standard`` sees ``tl.core`` only) is patched as Triton does, once per
    launch. Only for Triton 3.6, whose interpreter this was read from; any other version runs
    unpatched."""
    import triton
    from triton.runtime import interpreter

    if triton.__version__.split(".")[:2] != ["3", "6"] or not hasattr(interpreter,
                                                                       "_patch_lang"):
        return
    import inspect

    import triton.language as tl

    real, active = interpreter._patch_lang, []  # active: per open launch, the modules patched

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values()
                 if inspect.ismodule(v) and v in (tl, tl.core)}
        if active and langs <= active[-1][1]:  # a helper whose modules the launch patched
            return interpreter._LangPatchScope()
        scope = real(fn)
        if active:  # a helper of another module (triton.language.standard): patched as
            active[-1][1].update(langs)  # Triton does, never restored (as Triton does)
            return scope
        restore = scope.restore

        def restore_and_close():
            active.pop()
            restore()

        scope.restore = restore_and_close
        active.append((scope, langs))
        return scope

    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


def _peer_sample(config, items) -> None:
    """``PAGEDATTN_PEER_SUITES=sample``: of each test marked ``peer_grid(*lengths)`` (an
    upstream grid), each combination of its other parameters at two of its length
    combinations; the combination's ordinal ``c`` picks the ``c % n``-th and the ``(c + n //
    2) % n``-th of its ``n`` runnable ones (the marker's ``runs`` predicate of the
    parameters), so every length comes about equally often. The rest is deselected."""
    groups: dict = {}
    dropped = []
    for item in items:
        mark = item.get_closest_marker("peer_grid")
        if mark is None:
            continue
        params = item.callspec.params
        if not mark.kwargs.get("runs", lambda p: True)(params):
            dropped.append(item)
            continue
        rest = tuple((k, repr(v)) for k, v in params.items() if k not in mark.args)
        groups.setdefault(item.originalname, {}).setdefault(rest, []).append(item)
    for combos in groups.values():
        for c, group in enumerate(combos.values()):
            n = len(group)
            keep = {c % n, (c + n // 2) % n}
            dropped += [item for i, item in enumerate(group) if i not in keep]
    if dropped:
        gone = set(map(id, dropped))
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) not in gone]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PAGEDATTN_PEER_SUITES") == "sample":
        _peer_sample(config, items)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_gpu2 = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu2" in item.keywords and gpus < 2:
            item.add_marker(skip_gpu2)
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """Where kernels run: the GPU when present, else the CPU through the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_one_shot_launchers():
    """Each test starts and ends with no shared one-shot launcher or template: a test that
    patches the launcher's policy (``choose_config``, ``merge_per_group``) must not meet a
    launcher built before the patch, nor leave one built under it."""
    import sys

    def clear():
        launchers = getattr(sys.modules.get("pagedattn.launch.decode"), "one_shot_launcher",
                            None)
        if launchers is not None:
            launchers.cache_clear()
        getattr(sys.modules.get("pagedattn.api"), "_ONE_SHOT_TEMPLATES", {}).clear()

    clear()
    yield
    clear()
