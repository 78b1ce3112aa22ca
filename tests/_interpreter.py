"""Triton interpreter speed-up shared by the test setup (``conftest.py``) and the vLLM
driver (``_vllm_run.py``), which runs outside pytest: the version seam's patch
(:func:`pagedattn.launch._triton_compat.patch_interpreter_lang`: the interpreter patches
``triton.language`` once per launch, not once per helper call; Triton 3.6-3.9)."""

from pagedattn.launch._triton_compat import patch_interpreter_lang


def patch_the_language_once_per_launch() -> None:
    """Apply the seam's once-per-launch patch (a no-op on a Triton it has not read)."""
    patch_interpreter_lang()
