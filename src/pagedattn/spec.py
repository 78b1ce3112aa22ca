""":class:`LaunchSpec`: the facts that decide a launch, in one frozen, hashable value.

A plan builds one from its arguments (``plan_decode``, ``plan_attention``,
``plan_mla_decode``); the launchers (:mod:`pagedattn.launch`), their policies and the cache
of one-shot launchers take it whole instead of a dozen keywords. Adding a field that decides
a launch touches this class and the code that reads the field, nothing in between.

A leaf: torch and :mod:`pagedattn.options` only (no Triton), so a plan holds one before its
first launch imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pagedattn.options import DEFAULT, DecodeOptions


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What decides a launch of one step, all from shapes and dtypes (never from the values
    of the metadata: no host sync).

    Every field is hashable (``torch.dtype``, ``torch.device`` and
    :class:`~pagedattn.options.DecodeOptions` included), so a spec keys a cache of launchers
    (:func:`pagedattn.launch.decode.one_shot_launcher`).

    Absorbed MLA (``rope_dim`` not ``None``) reads one latent for every query head:
    ``num_kv_heads`` is 1 and ``head_dim`` the latent's dims (``kv_lora_rank``).
    """

    batch: int  # block_tables.shape[0]: sequences
    max_pages: int  # block_tables.shape[1]: page ids per sequence
    num_q_heads: int
    num_kv_heads: int  # divides num_q_heads (GQA: query head h reads kv head h // group)
    head_dim: int  # the dims of a key and a value (MLA: the latent's)
    page_size: int  # tokens per page
    q_dtype: torch.dtype  # the query's (and the output's) dtype
    kv_dtype: torch.dtype  # the caches': the query's, or fp8 (e4m3 / e5m2)
    device: torch.device
    q_len: int = 1  # query tokens per sequence (decode; multi-token decode, MLA's MTP)
    #: the plan-time variants (window, soft-cap; per-call fields off): constexprs
    options: DecodeOptions = DEFAULT
    num_splits: int | None = None  # decode: forced splits a sequence; None: balanced
    ragged: bool = False  # decode: the caller knows the lengths are ragged (a host copy)
    rope_dim: int | None = None  # absorbed MLA: the rope key's dims (0: none); else None

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    def as_dict(self) -> dict[str, object]:
        """The fields by name (a launcher copies them onto itself)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
