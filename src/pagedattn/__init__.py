"""pagedattn: paged-attention decode kernels for LLM serving, written in Triton.

``paged_decode`` is the entry point, ``plan_decode`` its plan/run form for serving;
``paged_attention`` / ``plan_attention`` take any number of new tokens per sequence (paged
prefill, mixed batches);
``mla_decode`` / ``plan_mla_decode`` are absorbed multi-head latent attention (DeepSeek-V2/V3);
``merge_states`` merges attention states (cascade serving); ``paged_decode_reference`` (and
``mla_decode_reference``) is the float64 oracle; ``check_errors`` raises what the kernels found
wrong in their metadata on the device (lengths past the block table, bad page ids or slots).
Importing this package does not import Triton (the launchers load on first use); below the
supported torch and triton (``pagedattn._env.MIN_TORCH``, ``MIN_TRITON``) it raises one
``ImportError`` naming the version found.
"""

from pagedattn._env import check_versions

check_versions()

from pagedattn._errors import check_errors  # noqa: E402
from pagedattn.api import (  # noqa: E402
    IMPLS,
    STAGES,
    DecodeOutput,
    DecodePlan,
    ImplSpec,
    append_kv,
    compiled_kernels,
    merge_states,
    paged_decode,
    plan_decode,
)
from pagedattn.attention import AttentionPlan, paged_attention, plan_attention  # noqa: E402
from pagedattn.mla import MLADecodePlan, mla_decode, plan_mla_decode  # noqa: E402
from pagedattn.reference import (  # noqa: E402
    mla_decode_reference,
    paged_attention_reference,
    paged_decode_reference,
)

__all__ = ["IMPLS", "STAGES", "AttentionPlan", "DecodeOutput", "DecodePlan", "ImplSpec",
           "MLADecodePlan", "append_kv", "check_errors", "compiled_kernels", "merge_states",
           "mla_decode",
           "mla_decode_reference", "paged_attention", "paged_attention_reference",
           "paged_decode", "paged_decode_reference", "plan_attention", "plan_decode",
           "plan_mla_decode"]
__version__ = "0.1.0"
