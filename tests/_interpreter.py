"""Triton interpreter speed-up shared by the test setup (``conftest.py``) and the vLLM
driver (``_vllm_run.py``), which runs outside pytest."""


def patch_the_language_once_per_launch() -> None:
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
    launch. Only for Triton 3.6, whose interpreter this was read from, and 3.9 (vLLM's, in
    its own venv: ``_patch_lang``, ``_LangPatchScope``, ``InterpretedFunction.__call__`` and
    ``GridExecutor.__call__``'s patch and restore are 3.6's source); any other version runs
    unpatched."""
    import triton
    from triton.runtime import interpreter

    if triton.__version__.split(".")[:2] not in (["3", "6"], ["3", "9"]) or not hasattr(
            interpreter, "_patch_lang"):
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
