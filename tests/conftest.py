"""Test setup: Triton's interpreter on machines without a GPU, and the ``gpu``/``gpu2`` markers.

``TRITON_INTERPRET`` must be set before anything imports ``triton``; conftest is imported
before the test modules, so it is set here (the library itself never sets it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter patches triton.language once per launch, not once per helper call
    # (Triton 3.6-3.9; the seam's docstring says why)
    from pagedattn.launch._triton_compat import patch_interpreter_lang  # noqa: E402

    patch_interpreter_lang()


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
        getattr(sys.modules.get("pagedattn.one_shot"), "TEMPLATES", {}).clear()

    clear()
    yield
    clear()
