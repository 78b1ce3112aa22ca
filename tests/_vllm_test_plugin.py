"""A vLLM general plugin for the tests only: ``test_vllm_backend.py`` makes it findable
(a ``.dist-info`` with its entry point, on ``PYTHONPATH``), so that vLLM loads it in each
process it starts, its spawned workers included, beside pagedattn's own plugin.

:func:`install` speeds up Triton's interpreter as the test setup does (``conftest.py``: the
version seam's ``patch_interpreter_lang``), and with ``PAGEDATTN_TEST_PROBE=DIR`` records one
line per event into ``DIR/<pid>.log``:

- ``forward K D V W`` for each ``forward`` of pagedattn's backend that attends (``K``: the
  pagedattn kernels launched during the call, counted in Triton's interpreter; ``D`` and
  ``V``: the step's decode and varlen tokens; ``W``: the layer's ``window_left``),
  ``forward K`` for vLLM's profiling call;
- ``update K`` for each ``do_kv_cache_update`` (``K`` as above);
- ``vllm_op NAME`` for each call of vLLM's CPU attention ops (``vllm._custom_ops``'s
  ``cpu_attention_with_kv_cache``, ``cpu_attn_reshape_and_cache``,
  ``cpu_attn_get_scheduler_metadata``), whichever backend runs.
"""

from __future__ import annotations

import os
from pathlib import Path


def install() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        from pagedattn.launch._triton_compat import patch_interpreter_lang

        patch_interpreter_lang()  # as conftest.py: triton.language patched once per launch
    if os.environ.get("PAGEDATTN_TEST_PROBE"):
        install_probe(os.environ["PAGEDATTN_TEST_PROBE"])


def install_probe(probe_dir: str) -> None:
    """The counters described in the module docstring."""
    from pagedattn.launch._triton_compat import on_interpreter_launch

    Path(probe_dir).mkdir(parents=True, exist_ok=True)
    launches = [0]  # pagedattn kernels launched in this process (forked workers: their own)

    def record(line: str) -> None:
        with open(os.path.join(probe_dir, f"{os.getpid()}.log"), "a") as f:
            f.write(line + "\n")

    def count(kernel) -> None:
        if getattr(kernel, "__module__", "").startswith("pagedattn.kernels"):
            launches[0] += 1

    on_interpreter_launch(count)

    from pagedattn.integrations.vllm import backend

    for method, kind in (("forward", "forward"), ("do_kv_cache_update", "update")):
        real = getattr(backend.PagedAttnImpl, method)

        def wrapped(self, *args, _real=real, _kind=kind, **kwargs):
            before = launches[0]
            result = _real(self, *args, **kwargs)
            line = f"{_kind} {launches[0] - before}"
            metadata = args[5] if _kind == "forward" else None
            if metadata is not None:  # the step's make-up: decode tokens, varlen tokens
                step = next(iter(metadata.plans.values()))
                line += (f" {step.num_decode_tokens}"
                         f" {step.num_actual_tokens - step.num_decode_tokens}"
                         f" {self.options.window_left}")
            record(line)
            return result

        setattr(backend.PagedAttnImpl, method, wrapped)

    from vllm import _custom_ops

    for name in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache",
                 "cpu_attn_get_scheduler_metadata"):
        real = getattr(_custom_ops, name)

        def op(*args, _real=real, _name=name, **kwargs):
            record(f"vllm_op {_name}")
            return _real(*args, **kwargs)

        setattr(_custom_ops, name, op)
