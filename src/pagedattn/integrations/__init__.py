"""pagedattn inside serving frameworks: one subpackage per framework (``vllm``: an attention
backend registered through vLLM's plugin entry point).

Each subpackage imports its framework only inside the functions that need it, so importing
``pagedattn.integrations`` (or ``pagedattn``) never imports a framework. This layer sits above
``pagedattn.api`` and ``pagedattn.attention``, as ``pagedattn.compat`` does, and nothing in
the library imports it.
"""
