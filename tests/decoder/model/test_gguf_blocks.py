"""model/gguf_blocks.py: every quantized type it decodes, as scale * code + offset, against gguf.quants.dequantize
on the same block bytes.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 bytes come from gguf.quants.quantize (the reference quantizer); gguf has no
quantizer for the K-quants, so their blocks are drawn at random byte by byte (every code, 6-bit scale and min,
and Q6_K's signed scales), with finite fp16 super-block scales. The exact types must equal the reference bit
for bit; the K-quants differ only by the fp16 rounding of d * sc and dmin * m (module docstring's bound).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, dequantize, quantize
from gguf import GGMLQuantizationType as T

from services.decoder.model import gguf_blocks, grouped

ROWS, COLS = 6, 512
EXACT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# The byte ranges of one block that hold fp16 super-block scales (d, dmin): drawn as finite values.
_FP16_AT = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _weights(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of unlike magnitude and sign balance, as real projections have.
    return (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 0.5, (ROWS, 1)) + rng.uniform(-0.05, 0.05,
                                                                                               (ROWS, 1)))


def _random_k_blocks(qtype: T, seed: int) -> np.ndarray:
    size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (ROWS * COLS // size, type_size), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        d = rng.uniform(1e-4, 2e-3, raw.shape[0]).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(ROWS, -1)


def _bytes(qtype: T, seed: int) -> np.ndarray:
    if qtype in K_QUANTS:
        return _random_k_blocks(qtype, seed)
    return quantize(_weights(seed).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", EXACT + K_QUANTS, ids=lambda q: q.name)
def test_codes_reproduce_gguf_dequantize(qtype):
    raw = _bytes(qtype, seed=int(qtype))
    expected = torch.from_numpy(dequantize(raw, qtype))
    got = gguf_blocks.decode(raw, qtype, ROWS, COLS)
    codes = grouped.unpack_codes(got)
    assert (got.out_features, got.in_features) == (ROWS, COLS) and int(codes.max()) < 2 ** got.bits
    ours = grouped.dequantize(got)
    if qtype in EXACT:
        assert torch.equal(ours, expected), qtype.name
        return
    # Each of scale and offset was rounded once to fp16 (relative 2^-11, so within (1 + 2^-10) 2^-11 of the
    # stored values); gguf's own fp32 products and difference add at most 2 fp32 roundings (2^-24 each).
    scale = got.scale.float().repeat_interleave(got.group, dim=1)
    offset = got.offset.float().repeat_interleave(got.group, dim=1)
    bound = (2.0 ** -11 * (1 + 2.0 ** -10) + 2.0 ** -23) * ((scale * codes.float()).abs() + offset.abs())
    assert bool(((ours - expected).abs() <= bound).all()), qtype.name
    # The rounding is real but small against the weights.
    assert float((ours - expected).abs().max()) < 1e-2 * float(expected.abs().max())


def test_q8_codes_are_offset_int8():
    raw = _bytes(T.Q8_0, seed=1)
    got = gguf_blocks.decode(raw, T.Q8_0, ROWS, COLS)
    q = torch.from_numpy(np.ascontiguousarray(raw.reshape(-1, 34)[:, 2:]).view(np.int8).astype(np.int16))
    assert torch.equal(grouped.unpack_codes(got).reshape(-1, 32).to(torch.int16) - 128, q)


def test_unsupported_types_are_not_decoded():
    for qtype in (T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ2_XXS, T.TQ1_0, T.Q8_1):
        assert qtype not in gguf_blocks.SUPPORTED
