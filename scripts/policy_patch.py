"""The launch policies patched while a block runs, for the scripts that A/B their choices on a
GPU (``bench_prefill.py --variants``): :func:`patched_config`.

A plan's launcher reads the policy when it is built (its first run), so build and run the plan
inside the block. (Moved here from ``ab_schedule.py``, removed with the persistent schedule:
docs/perf-notes.md step 48.)
"""

from __future__ import annotations

import contextlib
from dataclasses import fields as dataclass_fields
from dataclasses import replace

from pagedattn.launch import policy
from pagedattn.launch import prefill as prefill_launch


@contextlib.contextmanager
def patched_config(fields: dict, *, prefill_first: bool = False):
    """The decode policy's :class:`~pagedattn.launch.policy.DecodeConfig` and the prefill
    policy's :class:`~pagedattn.launch.prefill.PrefillConfig` with ``fields`` replaced where
    each has them (a ``ValueError`` for a field neither has), while the block runs; a field
    named ``_NAME`` sets the decode policy's module constant ``_NAME`` instead (an
    ``AttributeError`` for a name :mod:`pagedattn.launch.policy` does not have).
    ``prefill_first``: a field both have (``block_n``, ``num_warps``, ``num_stages``) patches
    the prefill policy only, so a mixed step's decodes keep their own tiles."""
    consts = {k: v for k, v in fields.items() if k.startswith("_")}
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    decode_names = {f.name for f in dataclass_fields(policy.DecodeConfig)}
    prefill_names = {f.name for f in dataclass_fields(prefill_launch.PrefillConfig)}
    unknown = sorted(set(fields) - decode_names - prefill_names)
    if unknown:
        raise ValueError(f"patched_config: no policy has the field {unknown[0]!r}")
    prefill = {k: v for k, v in fields.items() if k in prefill_names}
    decode = {k: v for k, v in fields.items()
              if k in decode_names and not (prefill_first and k in prefill)}
    saved = {k: getattr(policy, k) for k in consts}  # AttributeError: a misspelled name
    base, base_prefill = policy.choose_config, prefill_launch.prefill_config
    if decode:
        policy.choose_config = lambda *a, **k: replace(base(*a, **k), **decode)
    if prefill:
        prefill_launch.prefill_config = lambda *a, **k: replace(base_prefill(*a, **k), **prefill)
    for k, v in consts.items():
        setattr(policy, k, v)
    try:
        yield
    finally:
        policy.choose_config = base
        prefill_launch.prefill_config = base_prefill
        for k, v in saved.items():
            setattr(policy, k, v)
