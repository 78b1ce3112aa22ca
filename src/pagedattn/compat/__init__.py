"""Drop-in entry points for code written against other attention libraries.

``flash_attn_with_kvcache`` (FlashAttention's, FA3 semantics) and
``BatchDecodeWithPagedKVCacheWrapper`` (FlashInfer's plan/run decode wrapper), each running
pagedattn's production decode kernel; for MLA (DeepSeek-V2/V3), FlashInfer's
``BatchMLAPagedAttentionWrapper`` and FlashMLA's ``get_mla_metadata`` /
``flash_mla_with_kvcache``, running ``pagedattn.mla_decode``. Importing this package imports
torch and ``pagedattn.api`` only (no Triton, no transformers).

This layer sits above ``pagedattn.api`` and is never imported by it.
"""

from pagedattn.compat.flash_attn import flash_attn_with_kvcache
from pagedattn.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from pagedattn.compat.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
)
from pagedattn.compat.flashinfer_mla import BatchMLAPagedAttentionWrapper

# transformers' integration, pagedattn.compat.transformers (register()), is imported by its user,
# so that importing this package never imports transformers.

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
           "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "flash_attn_with_kvcache",
           "flash_mla_with_kvcache", "get_mla_metadata"]
