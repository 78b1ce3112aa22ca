"""pagedattn as an SGLang attention backend, ``--attention-backend pagedattn``, registered
through SGLang's general-plugin entry point (``sglang.srt.plugins``: ``pagedattn =
"pagedattn.integrations.sglang:register"`` in pyproject.toml), which SGLang loads early in each
of its processes (``sglang.srt.plugins.load_plugins``; ``SGLANG_PLUGINS`` may restrict it).

:func:`register` adds the name to SGLang's attention registry
(``attention_registry.register_attention_backend``) and to the server's choices
(``arg_groups.choices.add_attention_backend_choices``); nothing changes for anyone who does
not ask for it. The factory builds ``backend.PagedAttnSGLangBackend`` for the model runner.
What it maps and refuses: ``layer.py`` (SGLang's layer, batch and KV
pool in pagedattn's terms, no SGLang import) and ``backend.py`` (the class).

Versions: :data:`READ` are the SGLang releases whose interface this backend was written
against and unit-tested with stand-ins of SGLang's objects
(``tests/integrations/test_sglang_backend.py``); :data:`RAN` the ones it ran inside (none yet:
see docs/compat.md, "SGLang", for what could not run on a CPU). Any other version is refused
by name: a warning, and nothing registered.

Importing this package imports neither SGLang nor Triton.
"""

from __future__ import annotations

import logging

from pagedattn.integrations import release_key

#: the name to give ``--attention-backend``
NAME = "pagedattn"
#: (major, minor, patch) of the SGLang releases the backend ran inside
RAN: dict[tuple[int, int, int], str] = {}
#: releases whose attention interface was read and unit-tested against stand-ins
READ = {(0, 5, 23): "sglang 0.5.23: base_attn_backend, attention_registry, memory_pool read; "
                    "the backend unit-tested with stand-ins "
                    "(tests/integrations/test_sglang_backend.py)"}

logger = logging.getLogger("sglang.plugins.pagedattn")


def version_key(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of an SGLang version string (``0.5.23``,
    ``0.5.23.post1``, ``0.5.23+cpu``), or ``None`` when it has no such prefix."""
    return release_key(version, 3)


def supported(version: str) -> bool:
    key = version_key(version)
    return key in RAN or key in READ


def versions() -> str:
    return ", ".join(".".join(map(str, v)) for v in sorted({**RAN, **READ}))


def create_backend(model_runner):
    """SGLang's backend factory: ``fn(model_runner) -> AttentionBackend``."""
    from pagedattn.integrations.sglang.backend import PagedAttnSGLangBackend

    return PagedAttnSGLangBackend(model_runner)


def register() -> None:
    """SGLang's plugin hook: register ``pagedattn`` (safe to call more than once). An SGLang
    outside :data:`RAN`/:data:`READ` gets a warning naming its version and nothing."""
    import sglang
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if not supported(sglang.__version__):
        logger.warning("pagedattn's SGLang backend supports SGLang %s, not SGLang %s: not "
                       "registered (--attention-backend %s is unavailable)", versions(),
                       sglang.__version__, NAME)
        return
    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
