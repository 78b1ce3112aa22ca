"""pagedattn: paged-attention decode kernels for LLM serving, written in Triton.

``paged_decode`` is the entry point, ``plan_decode`` its plan/run form for serving;
``paged_attention`` / ``plan_attention`` take any number of new tokens per sequence (paged
prefill, mixed batches);
``mla_decode`` / ``plan_mla_decode`` are absorbed multi-head latent attention (DeepSeek-V2/V3);
``merge_states`` merges attention states (cascade serving); ``paged_decode_reference`` (and
``mla_decode_reference``) is the float64 oracle.
Importing this package does not import Triton (the launchers load on first use).
"""

from pagedattn.api import (
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
from pagedattn.attention import AttentionPlan, paged_attention, plan_attention
from pagedattn.mla import MLADecodePlan, mla_decode, plan_mla_decode
from pagedattn.reference import (
    mla_decode_reference,
    paged_attention_reference,
    paged_decode_reference,
)

__all__ = ["IMPLS", "STAGES", "AttentionPlan", "DecodeOutput", "DecodePlan", "ImplSpec",
           "MLADecodePlan", "append_kv", "compiled_kernels", "merge_states", "mla_decode",
           "mla_decode_reference", "paged_attention", "paged_attention_reference",
           "paged_decode", "paged_decode_reference", "plan_attention", "plan_decode",
           "plan_mla_decode"]
__version__ = "0.1.0"
