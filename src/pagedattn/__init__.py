"""pagedattn: paged-attention decode kernels for LLM serving, written in Triton.

``paged_decode`` is the entry point; ``paged_decode_reference`` is the float64 oracle.
Importing this package does not import Triton (the launchers load on first use).
"""

from pagedattn.api import IMPLS, STAGES, DecodeOutput, paged_decode
from pagedattn.reference import paged_decode_reference

__all__ = ["IMPLS", "STAGES", "DecodeOutput", "paged_decode", "paged_decode_reference"]
__version__ = "0.1.0"
