"""pagedattn as a vLLM attention backend, registered through vLLM's ``vllm.general_plugins``
entry point (``pagedattn = "pagedattn.integrations.vllm:register"`` in pyproject.toml), which
vLLM calls in every process it starts (front end, engine core, workers).

- **On CUDA** :func:`register` registers the backend as ``CUSTOM``; choose it with
  ``--attention-backend CUSTOM`` (``LLM(..., attention_config={"backend": "CUSTOM"})``).
  Nothing changes for anyone who does not.
- **On the CPU** vLLM's platform ignores that choice and always takes ``CPU_ATTN``, so the
  backend takes ``CPU_ATTN``'s place, only when ``PAGEDATTN_VLLM_CPU=1`` is set. The kernels
  then run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment
  before anything imports Triton (vLLM does at start): set both, or :func:`register` refuses.
  Installing pagedattn alone changes nothing.
- Any other platform: nothing is registered.

A process whose layers use the backend logs one INFO line, ``pagedattn <version> attention
backend (<layout>, <page size>)``. What it maps and refuses: ``layer.py`` (layer arguments,
the cache's bytes), ``pagedattn.integrations.step`` (vLLM's metadata to plans),
``backend.py`` (the classes).

Versions: :data:`TESTED` are the vLLM releases this plugin served with (generation token for
token against vLLM's own backend); :data:`READ` the ones whose attention interface was read
and run without serving (their Python code on the CPU, from the CUDA wheel: registration and
vLLM's backend test, ``tests/integrations/test_vllm_attention_backends.py``). Any other version is
refused, naming it: on the CPU (asked for by ``PAGEDATTN_VLLM_CPU=1``) with a
``RuntimeError``, on CUDA with a warning and nothing registered (so ``--attention-backend
CUSTOM`` then fails in vLLM, and vLLM without it runs as usual).

vLLM 0.33 and 0.34 change nothing this backend uses. What they add, and what it does here:
``AttentionBackend.supports_kv_cache_update_bypass`` (kept ``False``: a fused op would write
vLLM's cache layout, not this one), ``AttentionImpl.set_interleaved_v_cache`` (refused),
``skip_scale`` on ``do_kv_cache_update`` (accepted; vLLM passes it to MLA implementations
only), ``MLAAttentionImpl.reserve_workspace`` (MLA only, which this backend refuses), custom
KV-cache dtypes (``register_kv_cache_dtype``: none registered; the cache dtypes stay
``auto`` and ``fp8*``, so the layers' ``kv_quant_mode`` is ``NONE`` or ``FP8_PER_TENSOR``,
never 0.33's ``KVQuantMode.CUSTOM``, which equals ``OCTAVE_K3V4``) and, in 0.34,
``AttentionBackend.supports_head_size_v`` (its default, equal sizes, is what the builder
checks).

Importing this package imports neither vLLM nor Triton.
"""

from __future__ import annotations

import logging
import os

from pagedattn.integrations import release_key

#: (major, minor) of the vLLM releases the plugin served with: vllm-cpu 0.32.0 on the CPU
TESTED = {(0, 32): "vllm-cpu 0.32.0, on the CPU (tests/integrations/test_vllm_backend.py)"}
#: releases whose attention interface was read and run on the CPU without serving (the CUDA
#: wheel's Python code: registration and vLLM's backend test), no GPU
READ = {(0, 33): "vllm 0.33.0 (CUDA wheel): its attention interface run on the CPU, not served",
        (0, 34): "vllm 0.34.0 (CUDA wheel): its attention interface run on the CPU, not served"}
#: the environment variable that puts the backend in CPU_ATTN's place on the CPU
CPU_SWITCH = "PAGEDATTN_VLLM_CPU"
BACKEND = "pagedattn.integrations.vllm.backend.PagedAttnBackend"
CPU_BACKEND = "pagedattn.integrations.vllm.backend.PagedAttnCPUBackend"

logger = logging.getLogger("vllm.plugins.pagedattn")


def version_key(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.32.0``, ``0.32.1.dev3+gabc``,
    ``0.32.0+cpu``), or ``None`` when it has no such prefix."""
    return release_key(version, 2)


def supported(version: str) -> bool:
    key = version_key(version)
    return key in TESTED or key in READ


def _versions() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in sorted({**TESTED, **READ}))


def cpu_switch(environ=os.environ) -> bool:
    """Whether ``PAGEDATTN_VLLM_CPU`` asks for the backend on the CPU (``"1"``; unset, empty
    or ``"0"``: no), or a ``ValueError`` naming it for any other value."""
    value = environ.get(CPU_SWITCH, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{CPU_SWITCH}: expected '1' (pagedattn in CPU_ATTN's place) or '0', "
                         f"got {value!r}")
    return value == "1"


def choose(platform: str, vllm_version: str, environ=os.environ) -> tuple[str, str] | None:
    """What :func:`register` registers on ``platform`` (``"cpu"``, ``"cuda"`` or another
    name): ``(vLLM's backend name, class path)``, or ``None`` for nothing.

    Raises:
        ValueError: ``PAGEDATTN_VLLM_CPU`` set to something other than ``0``/``1``.
        RuntimeError: on the CPU with ``PAGEDATTN_VLLM_CPU=1``: a vLLM version outside
            :data:`TESTED`/:data:`READ`, or ``TRITON_INTERPRET`` not ``1``.
    """
    if platform == "cpu":
        if not cpu_switch(environ):
            return None
        if not supported(vllm_version):
            raise RuntimeError(f"{CPU_SWITCH}=1: pagedattn's vLLM backend supports vLLM "
                               f"{_versions()}, not vLLM {vllm_version}")
        if environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{CPU_SWITCH}=1: pagedattn's kernels run on the CPU in "
                               "Triton's interpreter: set TRITON_INTERPRET=1 in the "
                               "environment before vLLM starts (it imports Triton)")
        return "CPU_ATTN", CPU_BACKEND
    if platform == "cuda":
        if not supported(vllm_version):
            logger.warning("pagedattn's vLLM backend supports vLLM %s, not vLLM %s: not "
                           "registered (--attention-backend CUSTOM is unavailable)",
                           _versions(), vllm_version)
            return None
        return "CUSTOM", BACKEND
    return None


def register() -> None:
    """vLLM's plugin hook: register the backend where :func:`choose` says (safe to call more
    than once; vLLM calls it once per process)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = "cpu" if current_platform.is_cpu() else (
        "cuda" if current_platform.is_cuda() else current_platform.device_name)
    chosen = choose(platform, vllm.__version__)
    if chosen is not None:
        name, path = chosen
        register_backend(AttentionBackendEnum[name], path)
