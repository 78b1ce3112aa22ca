"""Drop-in entry points for code written against other attention libraries.

``flash_attn_with_kvcache`` (FlashAttention's, FA3 semantics) and
``BatchDecodeWithPagedKVCacheWrapper`` (FlashInfer's plan/run decode wrapper), each running
pagedattn's production decode kernel. Importing this package imports torch and
``pagedattn.api`` only (no Triton, no transformers).

This layer sits above ``pagedattn.api`` and is never imported by it.
"""

from pagedattn.compat.flash_attn import flash_attn_with_kvcache
from pagedattn.compat.flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
)

# transformers' integration, pagedattn.compat.transformers (register()), is imported by its user,
# so that importing this package never imports transformers.

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "flash_attn_with_kvcache"]
