"""pagedattn inside serving frameworks: one subpackage per framework (``vllm``, ``sglang``:
attention backends registered through each framework's plugin entry point), over what they
share: ``layer.py`` (a layer in pagedattn's terms and the checks that refuse, at
configuration, what the kernels would refuse) and ``step.py`` (a step's plans).

Each subpackage imports its framework only inside the functions that need it, so importing
``pagedattn.integrations`` (or ``pagedattn``) never imports a framework. This layer sits above
``pagedattn.api`` and ``pagedattn.attention``, as ``pagedattn.compat`` does, and nothing in
the library imports it.
"""

from __future__ import annotations


def release_key(version: str, parts: int) -> tuple[int, ...] | None:
    """The first ``parts`` numbers of a framework's version string (``0.32.1.dev3+gabc``:
    ``(0, 32)`` for 2; ``0.5.23rc1``: ``(0, 5, 23)`` for 3), or ``None`` without them."""
    fields = version.split("+")[0].split(".")
    key = []
    for field in fields[:parts]:
        digits = field[:len(field) - len(field.lstrip("0123456789"))]
        if not digits:
            return None
        key.append(int(digits))
    return tuple(key) if len(key) == parts else None
