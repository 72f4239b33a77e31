"""The Triton rotary kernel (imported by ``rotary.py`` on first use of the ``triton`` backend).

One launch rotates q and k (two tensors of shape (B, S, H, D), any position/head strides, last dim
contiguous) in place of two; backward is the same kernel with -sin (the inverse rotation). On CPU it
runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported): that
is how the tests execute it without a GPU.
"""

import triton
import triton.language as tl


@triton.jit
def rotate_tile(X, O, sxb, sxs, sxh, sob, sos, soh, b, s, H, d, tile_mask, c, sn, BLOCK_H: tl.constexpr):
    # Rotate every head of X at positions s (BLOCK_S,) of batch b, BLOCK_H heads at a time.
    # Pairs (2d, 2d+1) for d (BLOCK_D,); c, sn (BLOCK_S, 1, BLOCK_D) fp32; tile_mask (BLOCK_S, BLOCK_D).
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + h
        m = tile_mask[:, None, :] & (hh < H)[None, :, None]
        src = X + b * sxb + s[:, None, None] * sxs + hh[None, :, None] * sxh + 2 * d[None, None, :]
        dst = O + b * sob + s[:, None, None] * sos + hh[None, :, None] * soh + 2 * d[None, None, :]
        x0 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(src + 1, mask=m, other=0.0).to(tl.float32)
        tl.store(dst, (x0 * c - x1 * sn).to(O.dtype.element_ty), mask=m)
        tl.store(dst + 1, (x1 * c + x0 * sn).to(O.dtype.element_ty), mask=m)


@triton.jit
def rope_kernel(X1, X2, O1, O2, COS, SIN,
                sx1b, sx1s, sx1h, sx2b, sx2s, sx2h,
                so1b, so1s, so1h, so2b, so2s, so2h,
                S, H1, H2, HALF,
                HAS_X2: tl.constexpr, BACKWARD: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (block of BLOCK_S positions, batch): cos/sin (S, HALF) loaded once, then every
    # head of x1 and of x2. Offsets in int64: B * S * H * D may exceed 2^31 elements.
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    tile_mask = (s < S)[:, None] & (d < HALF)[None, :]
    table = s[:, None] * HALF + d[None, :]
    c = tl.load(COS + table, mask=tile_mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + table, mask=tile_mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the inverse rotation
        sn = -sn
    c = c[:, None, :]
    sn = sn[:, None, :]
    rotate_tile(X1, O1, sx1b, sx1s, sx1h, so1b, so1s, so1h, b, s, H1, d, tile_mask, c, sn, BLOCK_H)
    if HAS_X2:
        rotate_tile(X2, O2, sx2b, sx2s, sx2h, so2b, so2s, so2h, b, s, H2, d, tile_mask, c, sn, BLOCK_H)
