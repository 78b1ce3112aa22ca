"""Test setup: Triton's interpreter on machines without a GPU, and the ``gpu`` marker.

``TRITON_INTERPRET`` must be set before anything imports ``triton``; conftest is imported
before the test modules, so it is set here (the library itself never sets it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where kernels run: the GPU when present, else the CPU through the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
