"""The Triton rotary kernel (imported by ``rotary.py`` on first use of the ``triton`` backend).

A tensor (B, S, H, D) is B * S * H *rows* of D contiguous elements (any position/head strides, last dim
contiguous). One program rotates BLOCK_R rows: it loads each row whole (contiguous, coalesced loads),
splits the interleaved pairs (2i, 2i + 1) in registers, rotates them by the row's position and stores the
row whole. One launch rotates q and k (the same rows of both, the table rows loaded once); backward is
the same kernel with -sin (the inverse rotation). On CPU it runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported): that is how the tests execute it without a
GPU.
"""

import triton
import triton.language as tl


@triton.jit
def rotate_rows(X, O, offs_x, offs_o, e, mask, c, sn, BLOCK_R: tl.constexpr, BLOCK_D2: tl.constexpr):
    # Rows at element offsets offs_x / offs_o (BLOCK_R,); e (2 * BLOCK_D2,) the elements of a row;
    # c, sn (BLOCK_R, BLOCK_D2) fp32, pair i of each row.
    x = tl.load(X + offs_x[:, None] + e[None, :], mask=mask, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_D2, 2)))
    out = tl.reshape(tl.join(x0 * c - x1 * sn, x1 * c + x0 * sn), (BLOCK_R, 2 * BLOCK_D2))
    tl.store(O + offs_o[:, None] + e[None, :], out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(X1, X2, O1, O2, COS, SIN,
                sx1b, sx1s, sx1h, sx2b, sx2s, sx2h,
                so1b, so1s, so1h, so2b, so2s, so2h,
                ROWS, S, H, HALF,
                HAS_X2: tl.constexpr, BACKWARD: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D2: tl.constexpr):
    # Rows r = (b * S + s) * H + h of x1 (and x2, the same shape); cos/sin (S, HALF) fp32. Offsets in
    # int64: B * S * H * D may exceed 2^31 elements.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < ROWS
    h = r % H
    s = (r // H) % S
    b = r // (H * S)
    d = tl.arange(0, BLOCK_D2)
    e = tl.arange(0, 2 * BLOCK_D2)
    pair_ok = row_ok[:, None] & (d < HALF)[None, :]
    table = s[:, None] * HALF + d[None, :]
    c = tl.load(COS + table, mask=pair_ok, other=0.0).to(tl.float32)
    sn = tl.load(SIN + table, mask=pair_ok, other=0.0).to(tl.float32)
    if BACKWARD:  # the inverse rotation
        sn = -sn
    mask = row_ok[:, None] & (e < 2 * HALF)[None, :]
    rotate_rows(X1, O1, b * sx1b + s * sx1s + h * sx1h, b * so1b + s * so1s + h * so1h, e, mask, c, sn,
                BLOCK_R, BLOCK_D2)
    if HAS_X2:
        rotate_rows(X2, O2, b * sx2b + s * sx2s + h * sx2h, b * so2b + s * so2s + h * so2h, e, mask, c, sn,
                    BLOCK_R, BLOCK_D2)
