"""llama.cpp's quantized blocks -> (codes, scale, offset) of the grouped weight format (model/grouped.py).

Decoding is numpy over whole tensors (no loop over blocks): each type's block layout is split into its byte
fields, the codes unpacked by shifts and masks, the scales read as fp16 and multiplied out in fp32.

A GGUF weight [N, K] is stored row by row, each row as K / block_size blocks of type_size bytes. Every type
decoded here computes w = scale * code + offset with one (scale, offset) per group of G consecutive weights
of a row, which is exactly the grouped format's `w = scale[n, k // G] * code + offset[n, k // G]`:

  type   block  bits  G   code (from the block)        scale        offset        (gguf.quants' dequantize)
  Q4_0   32     4     32  q, 0..15                     d            -8 d          d (q - 8)
  Q4_1   32     4     32  q, 0..15                     d            m             d q + m
  Q5_0   32     8     32  q, 0..31                     d            -16 d         d (q - 16)
  Q5_1   32     8     32  q, 0..31                     d            m             d q + m
  Q8_0   32     8     32  q + 128, 1..255 (q int8)     d            -128 d        d q
  Q4_K   256    4     32  q, 0..15                     d sc_j       -dmin m_j     d sc_j q - dmin m_j
  Q5_K   256    8     32  q, 0..31                     d sc_j       -dmin m_j     d sc_j q - dmin m_j
  Q6_K   256    8     16  q, 0..63                     d sc_j       -32 d sc_j    d sc_j (q - 32)

(d, dmin, m are the block's fp16 values; sc_j, m_j the K-quants' per-sub-block 6-bit scale and min; Q6_K's
sc_j is a signed int8.) Decoding reads only integers and fp16 values: no weight goes through floats.

The one rounding: the grouped format stores scale and offset in fp16. d, m, -8 d, -16 d and -128 d are fp16
values already (a power-of-two multiple of an fp16 value is exact while it neither overflows nor lands in
fp16's subnormals). d sc_j (11 + 8 significant bits) and dmin m_j are exact in fp32 here and round once to
fp16, a relative error of at most 2^-11 of the scale and of the offset: |w' - w| <= 2^-11 (|scale code| +
|offset|) per weight. tests/decoder/model/test_gguf_blocks.py checks exactly that bound against
gguf.quants.dequantize on block bytes.

Every other type (IQ*, Q2_K, Q3_K, TQ*, MXFP4, ...) is not decoded: SUPPORTED names what is, and the loader
refuses the rest before reading a weight.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from services.decoder.model import grouped
from services.decoder.model.grouped import GroupedWeight

T = GGMLQuantizationType
QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """[B, 2] bytes -> fp32 [B, 1]: the fp16 value they hold (little-endian, as GGUF stores it)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, C, H] packed bytes -> [B, C, 2 H] codes: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's [B, 4] bytes -> [B, 32]: bit j of the little-endian uint32 is weight j's fifth bit."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> (sc, m) [B, 8] each, 6-bit: the layout of ggml's get_scale_min_k4."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, None, 2:]).reshape(-1, 32), d, -8 * d


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, None, 4:]).reshape(-1, 32), d, m


def _q5_0(b: np.ndarray):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, None, 6:]).reshape(-1, 32) | (_fifth_bits(b[:, 2:6]) << 4)
    return q, d, -16 * d


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, None, 8:]).reshape(-1, 32) | (_fifth_bits(b[:, 4:8]) << 4)
    return q, d, m


def _q8_0(b: np.ndarray):
    d = _f16(b[:, :2])
    q = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's header -> (scale, offset) [B, 8] per 32-weight sub-block, fp32 (exact, see module doc)."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(b: np.ndarray):
    scale, offset = _k_scales(b)
    # 4 chunks of 32 bytes: chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, QK_K)
    return q, scale, offset


def _q5_k(b: np.ndarray):
    scale, offset = _k_scales(b)
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # qh's 32 bytes: bit j of byte i is the fifth bit of weight i of sub-block j.
    high = (b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1          # [B, 32, 8]
    q = low | (high.transpose(0, 2, 1) << 4)
    return q.reshape(-1, QK_K), scale, offset


def _q6_k(b: np.ndarray):
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    # Two halves of 128 weights; half h: ql bytes [64h, 64h + 64) low nibbles then high nibbles give the
    # low 4 bits of its 4 runs of 32, qh bytes [32h, 32h + 32) shifted by 0, 2, 4, 6 their top 2 bits.
    low = _nibbles(ql.reshape(-1, 2, 64)).reshape(-1, 2, 4, 32)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).reshape(-1, QK_K)
    scale = d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
    return q, scale, -32 * scale


# type -> (decoder of [B, type_size] blocks to (codes [B, block], scale [B, block / G], offset), bits, G)
_DECODERS = {
    T.Q4_0: (_q4_0, 4, 32), T.Q4_1: (_q4_1, 4, 32), T.Q5_0: (_q5_0, 8, 32), T.Q5_1: (_q5_1, 8, 32),
    T.Q8_0: (_q8_0, 8, 32), T.Q4_K: (_q4_k, 4, 32), T.Q5_K: (_q5_k, 8, 32), T.Q6_K: (_q6_k, 8, 16),
}
SUPPORTED = tuple(_DECODERS)
DENSE = (T.F32, T.F16, T.BF16)


def block_size(qtype: GGMLQuantizationType) -> int:
    """Weights per block of qtype (K must be a multiple of it)."""
    return GGML_QUANT_SIZES[qtype][0]


def decode(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> GroupedWeight:
    """A quantized weight's bytes (uint8, rows * cols / block * type_size of them, any shape) -> the grouped
    weight [rows, cols] (grouped.pack: scale and offset rounded to fp16 there). qtype must be in SUPPORTED."""
    fn, bits, group = _DECODERS[qtype]
    size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // size, type_size)
    codes, scale, offset = fn(blocks)
    return grouped.pack(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, cols)),
                        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1)),
                        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, -1)),
                        bits, group)
