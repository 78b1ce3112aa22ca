"""FP8 checkpoints in the formats transformers reads, dequantized to float32 at load.

A Hugging Face checkpoint whose ``config.json`` has a ``quantization_config`` stores each
quantized ``*.weight`` as float8 codes beside one scale tensor; the value is ``codes ×
scale`` in every format transformers defines (its ``integrations/finegrained_fp8.py``,
``fbgemm_fp8.py`` and the compressed-tensors FP8 schemes; formats read from their docs and
checkpoints, no code copied):

* ``quant_method: "fp8"`` (fine-grained FP8, DeepSeek-V3 style): ``weight_scale_inv``
  ``[ceil(out / bm), ceil(in / bn)]`` for blocks ``weight_block_size = [bm, bn]`` (the last
  block of a dimension may be short), or one number per tensor;
* ``quant_method: "fbgemm_fp8"``: ``weight_scale`` ``[out, 1]``, one per output channel;
* ``quant_method: "compressed-tensors"`` with float 8-bit weights: ``weight_scale`` ``[1]``
  (tensor), ``[out, 1]`` (channel) or a block grid (``block_structure``).

Activation and KV-cache scales (``input_scale``, ``activation_scale``, ``k_scale``,
``v_scale``) are not needed: activations stay in the model's dtype, and pagedattn's own fp8
cache calibrates its scales. Anything else quantized (another ``quant_method``, integer weights,
float8 codes without a scale) is refused, naming ``quantization_config`` or the tensor:
never cast to float as if it were a weight.
"""

from __future__ import annotations

import torch

#: the FP8 formats read: quant_method -> the suffix of its scale tensors
FP8_METHODS = {"fp8": "_scale_inv", "fbgemm_fp8": "_scale", "compressed-tensors": "_scale"}
_SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: scales of activations and of an FP8 KV cache (``kv_cache_scheme``), which a float model
#: does not need (pagedattn calibrates its own cache's scales)
_UNUSED_SCALES = (".input_scale", ".activation_scale", ".input_scale_inv", ".k_scale",
                  ".v_scale", ".q_scale")


def _fail(what: str) -> None:
    raise ValueError(f"config.json: quantization_config: {what}")


def fp8_block(config: dict) -> tuple[int, int] | None:
    """The block ``(rows, cols)`` of a checkpoint's block scales, ``None`` when it states
    none (per-tensor or per-channel scales, or blocks that divide the weight), checking that
    ``config["quantization_config"]`` (present) is one of the FP8 formats above. Raises
    ValueError naming ``quantization_config`` for any other."""
    q = config["quantization_config"]
    if not isinstance(q, dict):
        _fail(f"expected an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in FP8_METHODS:
        _fail(f"quant_method {method!r} is not supported: pagedattn reads FP8 checkpoints "
              f"({', '.join(map(repr, FP8_METHODS))}); dequantize the weights first")
    block = q.get("weight_block_size")
    if method == "compressed-tensors":
        for name, group in (q.get("config_groups") or {}).items():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                _fail(f"config_groups.{name}.weights: expected FP8 weights (type 'float', "
                      f"num_bits 8), got type {weights.get('type')!r}, num_bits "
                      f"{weights.get('num_bits')!r}")
            block = weights.get("block_structure") or block
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        _fail(f"weight_block_size: expected two ints >= 1, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize(name: str, codes: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """``codes × scale`` in float32 for float8 ``codes`` ``[out, in]`` (or any shape with a
    per-tensor scale) and ``scale`` per tensor (one number), per output channel (``[out]``
    or ``[out, 1]``) or per block (``[ceil(out / bm), ceil(in / bn)]``, ``block`` or, when
    ``None``, the blocks that divide the weight). Raises ValueError naming the scale tensor
    (``name``) for any other shape."""
    w, s = codes.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if w.dim() != 2 or s.dim() not in (1, 2):
        raise ValueError(f"{name}: expected one scale, [out] or a 2-D grid for a 2-D weight, "
                         f"got shape {tuple(s.shape)} for a weight of {tuple(w.shape)}")
    rows, cols = w.shape
    if s.shape in ((rows,), (rows, 1)):
        return w * s.reshape(rows, 1)
    if s.dim() == 1:
        raise ValueError(f"{name}: expected [{rows}] (per channel), got {tuple(s.shape)}")
    if block is None:
        if rows % s.shape[0] or cols % s.shape[1]:
            raise ValueError(f"{name}: a scale grid {tuple(s.shape)} that does not divide the "
                             f"weight {tuple(w.shape)} needs quantization_config's "
                             "weight_block_size")
        block = (rows // s.shape[0], cols // s.shape[1])
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    if tuple(s.shape) != grid:
        raise ValueError(f"{name}: expected {grid} for blocks of {bm} x {bn} of a weight "
                         f"{tuple(w.shape)}, got {tuple(s.shape)}")
    return w * s.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]


def dequantized(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (file names) with every float8 weight dequantized (its scale
    consumed) and activation scales dropped; float tensors as they are. Raises ValueError
    naming ``quantization_config`` for a format other than FP8 (see :func:`fp8_block`), or
    the tensor for integer weights, float8 codes without a scale (or without any
    ``quantization_config``), a scale that is not a float, or one without its float8
    weight."""
    quantized = "quantization_config" in config
    block = fp8_block(config) if quantized else None
    out: dict[str, torch.Tensor] = {}
    consumed = set()
    for name, t in tensors.items():
        if name.endswith(_UNUSED_SCALES) or name.endswith(_SCALE_SUFFIXES):
            continue
        if t.dtype.is_floating_point and t.element_size() > 1:
            out[name] = t
            continue
        if not (t.dtype.is_floating_point and quantized):
            raise ValueError(f"{name}: a {t.dtype} tensor "
                             + ("(pagedattn reads FP8 weights only)" if quantized else
                                "in a checkpoint without quantization_config (quantized "
                                "weights need one pagedattn reads: FP8)"))
        scale = next((n for n in (name + s for s in _SCALE_SUFFIXES) if n in tensors), None)
        if scale is None:
            raise ValueError(f"{name}: {t.dtype} codes without {name}_scale_inv or "
                             f"{name}_scale: the checkpoint's scales are missing")
        if not tensors[scale].dtype.is_floating_point:  # (E8M0 exponents stored as uint8)
            raise ValueError(f"{scale}: expected a float scale, got {tensors[scale].dtype}")
        out[name] = dequantize(scale, t, tensors[scale], block)
        consumed.add(scale)
    stray = [n for n in tensors if n.endswith(_SCALE_SUFFIXES)
             and not n.endswith(_UNUSED_SCALES) and n not in consumed]
    if stray:
        raise ValueError(f"{stray[0]}: a scale without the float8 weight it scales")
    return out
