"""The refine codec ("q3k-refine1"): a Q3_K base whose scales are fitted for a 16-level grid, and one refinement bit
per weight that selects the fine level inside the base's coarse one.

WQ is valid stock Q3_K (ggml's block_q3_K: hmask[32], qs[64], scales[12], d fp16 = 110 bytes per 256 weights), so
stock llama.cpp runs it unchanged; with the bit t of the sidecar a weight of Q3_K index L (0..7) and sub-block scale
s = d * (sc - 32) becomes

    refined = s * (L - 4) + s/4 * (2t - 1) = s/4 * (2f - 17),   f = 2L + t in 0..15

(16 levels, step s/2; the base is the fine value with its last bit dropped). ggml's own Q3_K quantizer fits its
scales to the 8-level grid; this one fits them to the 16-level grid, so the refined weights are close to a 4-bit
quantization while the base stays a usable 3-bit one. The bits are stored LSB first: column i of a row is bit
(i & 7) of byte i >> 3.

Pure numpy and vectorized over the whole matrix (every 16-column sub-block at once).
"""
from __future__ import annotations

import numpy as np

QK_K = 256  # weights per Q3_K super-block
SUB = 16  # weights per sub-block (one 6-bit scale)
N_SUB = QK_K // SUB
BLOCK_BYTES = 110  # sizeof(block_q3_K)
# byte offsets of block_q3_K's fields
_HMASK, _QS, _SCALES, _D = slice(0, 32), slice(32, 96), slice(96, 108), slice(108, 110)
# starting points of the weighted least-squares rounds: the first scale (the grid's long side on the largest |w|)
# times these; the best result is kept. Measured on tiny-moe-a's experts (relative RMS error of the refined weights
# over ggml's Q4_K): 1.030 with 0.85..1.05, 0.999 with 0.8..1.2, 0.993 with these (wider sets gain nothing more)
SCALE_MULTIPLIERS = (0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3)
LS_ROUNDS = 2


class RefineShapeError(ValueError):
    """An input the codec cannot encode (rows not whole Q3_K super-blocks, wrong shapes)."""


def _check_rows(n_in: int) -> None:
    if n_in <= 0 or n_in % QK_K:
        raise RefineShapeError(f"the refine codec needs rows that are whole Q3_K super-blocks of {QK_K} weights; "
                               f"these rows have {n_in}")


# -- fitting ------------------------------------------------------------------------------------------------------
def _fine_index(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """f in 0..15 nearest to w on the grid s/4 * (2f - 17) (s: one scale per sub-block row of w; s == 0 gives 8)."""
    nz = s != 0
    inv = np.divide(np.float32(4.0), s, out=np.zeros_like(s), where=nz)
    f = np.rint((w * inv[:, None] + np.float32(17.0)) * np.float32(0.5))
    out: np.ndarray = np.clip(f, 0, 15)
    return out


def sum16(x: np.ndarray) -> np.ndarray:
    """Row sums of float32 [n, 16] in one fixed order, a tree of halves: (x[j] + x[j+8]), then (+4), (+2), (+1).
    np.einsum and np.sum leave the order to numpy's build and the CPU's SIMD width; the compiled encoder
    (src/rapidmoe_ggml/pymodule/encode.cpp) adds in this order, so both give the same bits everywhere."""
    x = x[:, :8] + x[:, 8:]
    x = x[:, :4] + x[:, 4:]
    x = x[:, :2] + x[:, 2:]
    out: np.ndarray = x[:, 0] + x[:, 1]
    return out


def _weighted_err(w: np.ndarray, c: np.ndarray, s: np.ndarray, q: np.ndarray) -> np.ndarray:
    """sum of c * (w - s/4 * q)^2 per sub-block (q = 2f - 17)."""
    e = w - (s * np.float32(0.25))[:, None] * q
    return sum16(c * (e * e))


def fit_sub_scales(w: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The fine grid's scale of every sub-block: w, c float32 [n_sub, 16] (weights and their weights c >= 0).

    Starts from the scale whose long side (17 half-steps) reaches the largest-|w| element, tries a few multiples of
    it, each followed by weighted least-squares rounds (f for s, then s for f), and keeps the least weighted error.
    """
    rows = np.arange(w.shape[0])
    wmax = w[rows, np.argmax(np.abs(w), axis=1)]
    s0 = np.float32(-4.0 / 17.0) * wmax
    best_s: np.ndarray = s0.copy()
    best_err = np.full(w.shape[0], np.inf, dtype=np.float32)
    for mult in SCALE_MULTIPLIERS:
        s = s0 * np.float32(mult)
        for r in range(LS_ROUNDS + 1):
            q = np.float32(2.0) * _fine_index(w, s) - np.float32(17.0)
            err = _weighted_err(w, c, s, q)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
            if r == LS_ROUNDS:
                break
            cq = c * q
            num = sum16(cq * w)
            den = sum16(cq * q)
            s = np.where(den > 0, np.float32(4.0) * num / np.where(den > 0, den, 1), s).astype(np.float32)
    return best_s


# -- Q3_K packing --------------------------------------------------------------------------------------------------
def pack_q3k(levels: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q3_K bytes [n_blocks, 110] from the indices L in 0..7 [n_blocks, 256], the signed 6-bit scales
    sc in -32..31 [n_blocks, 16] and the super-block scales d (float16) [n_blocks], as quantize_row_q3_K_ref lays
    them out."""
    nb = levels.shape[0]
    lv = levels.astype(np.uint8)
    out = np.empty((nb, BLOCK_BYTES), dtype=np.uint8)
    # hmask: element j -> byte j % 32, bit j // 32, set when L > 3
    high = (lv > 3).astype(np.uint8).reshape(nb, 8, 32)
    out[:, _HMASK] = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    # qs: for each half of 128, qs[32 h + l] holds the low 2 bits of L[128 h + 32 k + l] at bits 2k
    low = (lv & 3).reshape(nb, 2, 4, 32)
    out[:, _QS] = (low << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(nb, 64)
    # scales: 6-bit sc + 32; low nibbles of 0..7 in bytes 0..7, of 8..15 in their high nibbles; the top 2 bits of
    # scale j in byte 8 + j % 4 at bit 2 * (j // 4)
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    out[:, 96:104] = (u[:, :8] & 0xF) | ((u[:, 8:] & 0xF) << 4)
    top = (u >> 4).reshape(nb, 4, 4)  # [block, j // 4, j % 4]
    out[:, 104:108] = (top << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1, dtype=np.uint8)
    out[:, _D] = np.ascontiguousarray(d.astype("<f2")).view(np.uint8).reshape(nb, 2)
    return out


def unpack_q3k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of pack_q3k: (L uint8 [n_blocks, 256], sc int8 in -32..31 [n_blocks, 16], d float16 [n_blocks])."""
    nb = blocks.shape[0]
    hm = blocks[:, _HMASK]
    high = (hm[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [block, j // 32, j % 32]
    qs = blocks[:, _QS].reshape(nb, 2, 1, 32)
    low = (qs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3  # [block, half, k, l]
    levels = (low.reshape(nb, QK_K) | (high.reshape(nb, QK_K) << 2)).astype(np.uint8)
    sb = blocks[:, _SCALES]
    lo = np.concatenate([sb[:, :8] & 0xF, sb[:, :8] >> 4], axis=1)
    top = (sb[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3  # [block, j // 4, j % 4]
    sc = ((lo | (top.reshape(nb, N_SUB) << 4)).astype(np.int16) - 32).astype(np.int8)
    d = np.ascontiguousarray(blocks[:, _D]).view("<f2").reshape(nb).astype(np.float16)
    return levels, sc, d


# -- the codec -----------------------------------------------------------------------------------------------------
def _weights(w: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """c = |w|, or importance * |w| (importance per column [n_in], or per weight [n_out, n_in])."""
    a: np.ndarray = np.abs(w)
    if importance is None:
        return a
    imp = np.asarray(importance, dtype=np.float32)
    if imp.shape not in ((w.shape[1],), w.shape):
        raise RefineShapeError(f"importance has shape {imp.shape}; the matrix {w.shape} needs ({w.shape[1]},) "
                               "(one value per column) or its own shape")
    out: np.ndarray = a * imp
    return out


def encode_refine(w: np.ndarray, importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode W [n_out, n_in] (n_in a multiple of 256) as (Q3_K bytes uint8 [n_out, n_in / 256 * 110], refinement
    bits uint8 [n_out, n_in / 8]). importance: per-column weights of the error (an imatrix row), or None."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise RefineShapeError(f"encode_refine takes one matrix [n_out, n_in], not shape {w.shape}")
    n_out, n_in = w.shape
    _check_rows(n_in)
    nb = n_out * (n_in // QK_K)
    c = _weights(w, importance).reshape(nb * N_SUB, SUB)
    ws = w.reshape(nb * N_SUB, SUB)
    s = fit_sub_scales(ws, c).reshape(nb, N_SUB)
    # super-block scale: the largest |s| is 31 steps of d; the 6-bit scales are rounded to it
    d = (np.abs(s).max(axis=1) / np.float32(31.0)).astype(np.float16)
    d32 = d.astype(np.float32)
    ratio = np.divide(s, d32[:, None], out=np.zeros_like(s), where=d32[:, None] != 0)
    sc = np.clip(np.rint(ratio), -32, 31).astype(np.int8)
    # requantize on the scales the kernels see (float32 d * sc, as ggml's dequantization computes them)
    sq = (d32[:, None] * sc.astype(np.float32)).reshape(nb * N_SUB)
    f = _fine_index(ws, sq).astype(np.uint8).reshape(nb, QK_K)  # sq == 0 gives f = 8: L = 4, t = 0
    blocks = pack_q3k(f >> 1, sc, d)
    bits = np.packbits((f & 1).reshape(n_out, n_in), axis=1, bitorder="little")
    return blocks.reshape(n_out, (n_in // QK_K) * BLOCK_BYTES), bits


def decode_refine(q3k_bytes: np.ndarray, bits: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, refined) float32 [n_out, n_in] from encode_refine's outputs: base = s * (L - 4), exactly as ggml's
    Q3_K dequantization gives it; refined = s/4 * (2f - 17) with f = 2L + t."""
    _check_rows(n_in)
    q = np.ascontiguousarray(q3k_bytes, dtype=np.uint8)
    row_bytes = (n_in // QK_K) * BLOCK_BYTES
    if q.ndim != 2 or q.shape[1] != row_bytes:
        raise RefineShapeError(f"Q3_K bytes of shape {q.shape} are not rows of {n_in} weights ({row_bytes} bytes)")
    n_out = q.shape[0]
    if bits.shape != (n_out, n_in // 8):
        raise RefineShapeError(f"refinement bits of shape {bits.shape}; {n_out} rows of {n_in} need "
                               f"({n_out}, {n_in // 8})")
    nb = n_out * (n_in // QK_K)
    levels, sc, d = unpack_q3k(q.reshape(nb, BLOCK_BYTES))
    s = d.astype(np.float32)[:, None] * sc.astype(np.float32)  # dl = d_all * (sc - 32), float32
    s = np.repeat(s, SUB, axis=1)  # [block, 256]
    base = s * (levels.astype(np.float32) - np.float32(4.0))
    t = np.unpackbits(np.ascontiguousarray(bits, dtype=np.uint8), axis=1, bitorder="little").reshape(nb, QK_K)
    f = (2 * levels + t).astype(np.float32)
    refined = (s * np.float32(0.25)) * (np.float32(2.0) * f - np.float32(17.0))
    return base.reshape(n_out, n_in), refined.reshape(n_out, n_in)
