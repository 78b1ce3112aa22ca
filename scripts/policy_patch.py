"""The launch policy patched while a block runs, for the scripts that A/B its choices on a GPU
(``bench_prefill.py --variants``, ``diag_fp8_prefill.py``): :func:`patched_config`.

A plan's launcher reads the policy when it is built (its first run), so build and run the plan
inside the block. (Moved here from ``ab_schedule.py``, removed with the persistent schedule:
docs/perf-notes.md step 48.)
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from pagedattn.launch import policy


@contextlib.contextmanager
def patched_config(fields: dict):
    """The policy's configs with ``fields`` replaced, while the block runs; a field named
    ``_NAME`` sets the policy's module constant ``_NAME`` instead (an ``AttributeError`` for a
    name :mod:`pagedattn.launch.policy` does not have)."""
    consts = {k: v for k, v in fields.items() if k.startswith("_")}
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    saved = {k: getattr(policy, k) for k in consts}  # AttributeError: a misspelled name
    base = policy.choose_config
    if fields:
        policy.choose_config = lambda *a, **k: replace(base(*a, **k), **fields)
    for k, v in consts.items():
        setattr(policy, k, v)
    try:
        yield
    finally:
        policy.choose_config = base
        for k, v in saved.items():
            setattr(policy, k, v)
