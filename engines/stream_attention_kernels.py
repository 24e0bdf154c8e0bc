"""Triton kernels of `engines.stream_attention_triton` (imported from there on first use, so
that only that module's callers need the `triton` package). See that module for the design."""
import triton
import triton.language as tl


@triton.jit
def attn_kernel(Q, BD, CACHE, IDX, ATT_LEN, X, LEN, WK, BK, WV, BV, OUT,
                sq_b, sq_h, sq_t, sbd_b, sbd_h, sbd_t, sc_s, sc_c, sx_b, sx_t, sw_o, so_b, so_t,
                T, C, D, DK, AC, LC,
                HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    slot = tl.load(IDX + b).to(tl.int64)
    n_cache = tl.load(ATT_LEN + b).to(tl.int32)
    n_new = tl.load(LEN + b).to(tl.int32)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < DK
    q_ok = offs_m < n_new  # padded queries produce zeros (the torch path's are don't-care)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_k[None, :],
                mask=q_ok[:, None] & k_ok[None, :], other=0.0)

    # Keys (absolute positions: cache 0..C-1, chunk C..C+t-1) that any valid query of this
    # block may see: valid cache rows and valid chunk frames, within the chunked_limited
    # window of the block's first and last query. An empty range (all queries padded) leaves
    # acc = 0 and l = 0.
    i_last = tl.minimum(m0 + BLOCK_M, n_new) - 1
    j_lo = tl.maximum(C - n_cache, ((C + m0) // AC - LC) * AC)
    j_lo = tl.maximum(j_lo, 0)
    j_hi = tl.minimum(C + n_new, ((C + i_last) // AC + 1) * AC)
    q_chunk = (C + offs_m) // AC

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < j_hi
        in_cache = offs_n < C
        # K and V of these keys = rows @ W[h*dk:(h+1)*dk].T, rows read by slot from the pool
        # (cache part) or from this step's chunk.
        kt = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        vt = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            rows_c = tl.load(CACHE + slot * sc_s + offs_n[:, None] * sc_c + offs_d[None, :],
                             mask=(n_ok & in_cache)[:, None] & d_ok[None, :], other=0.0)
            rows_x = tl.load(X + b * sx_b + (offs_n - C)[:, None] * sx_t + offs_d[None, :],
                             mask=(n_ok & ~in_cache)[:, None] & d_ok[None, :], other=0.0)
            rows = rows_c + rows_x
            w_off = (h * DK + offs_k)[None, :] * sw_o + offs_d[:, None]  # W.T tile [BLOCK_D, BLOCK_K]
            w_ok = d_ok[:, None] & k_ok[None, :]
            wk = tl.load(WK + w_off, mask=w_ok, other=0.0)
            wv = tl.load(WV + w_off, mask=w_ok, other=0.0)
            kt = tl.dot(rows, wk, kt, input_precision=DOT_PREC)
            vt = tl.dot(rows, wv, vt, input_precision=DOT_PREC)
        if HAS_BIAS:
            kt += tl.load(BK + h * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            vt += tl.load(BV + h * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]

        s = tl.dot(q, tl.trans(kt.to(q.dtype)), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        pair_ok = q_ok[:, None] & n_ok[None, :]
        s += tl.load(BD + b * sbd_b + h * sbd_h + offs_m[:, None] * sbd_t
                     + (T - 1 - offs_m[:, None] + offs_n[None, :]),
                     mask=pair_ok, other=0.0).to(tl.float32)
        back = q_chunk[:, None] - (offs_n // AC)[None, :]
        # (keys before the valid cache, C - n_cache, are already outside the loop's range)
        visible = pair_ok & (back >= 0) & (back <= LC)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vt.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + b * so_b + offs_m[:, None] * so_t + h * DK + offs_k[None, :],
             out.to(OUT.dtype.element_ty), mask=(offs_m < T)[:, None] & k_ok[None, :])

@triton.jit
def shift_kernel(CACHE, IDX, NEW, LEN, sc_s, sc_c, sn_b, sn_t, C, D,
                 BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(IDX + b).to(tl.int64)
    n = tl.load(LEN + b).to(tl.int32)
    rows = tl.arange(0, BLOCK_C)
    src = rows + n  # row r of the next cache = row r + n of cat(cache, new[:n])
    ok = (rows < C)[:, None] & (offs_d < D)[None, :]
    from_cache = (src < C)[:, None]
    base = CACHE + slot * sc_s
    old = tl.load(base + src[:, None] * sc_c + offs_d[None, :], mask=ok & from_cache, other=0.0)
    new = tl.load(NEW + b * sn_b + (src - C)[:, None] * sn_t + offs_d[None, :],
                  mask=ok & ~from_cache, other=0.0)
    val = tl.where(from_cache, old, new.to(old.dtype))
    # Rows are read and rewritten in place by different threads of this program: every
    # read must land before any write.
    tl.debug_barrier()
    tl.store(base + rows[:, None] * sc_c + offs_d[None, :], val, mask=ok)
