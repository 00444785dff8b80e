"""Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``) sparse-MLA decode for the FP8 656-byte
cache on sm_90: tokens are the wgmma's M dimension, heads its N.

Why a second kernel: in the ``tl.dot`` kernel (``_sparse_mla_kernels``) a 16-head tile is too short for wgmma's
64-row M, so Triton falls back to ``mma.sync`` with the whole [16, 576] query replicated in every warp's registers;
with the converted FP8 tile on top that is 255 registers and spills (compiled offline with ``ptxas -v`` for
sm_90a), i.e. one or two programs per SM and few gathers in flight. Here one warpgroup (4 warps) owns a program:

* Sᵀ[64 tokens, BH heads] = K_g[64, 128] · Q_gᵀ[128, BH] per 128-lane chunk g (plus the 64 rope lanes), with K_g
  converted e4m3 → bf16 straight into wgmma's register A operand and Qᵀ resident in shared memory as the B
  operand; the chunk's per-token scale multiplies its partial score (``s += sc_g[:, None] · S_g``), as in the
  ``tl.dot`` kernel, so no element-wise dequantisation happens;
* the online softmax runs over tokens (axis 0), and Oᵀ_g[128, BH] += V_gᵀ[128, 64] · (P ∘ sc_g)ᵀ[64, BH] with V_gᵀ
  read transposed from the same staged bytes and (P ∘ sc_g)ᵀ written to shared memory as the B operand;
* the 64 gathered rows of the next tile (512 e4m3 + 64 bf16 lanes each) are in flight as 16-byte ``cp.async``
  copies into the other of two shared-memory stages while this tile computes; index and scale loads run one
  tile ahead in registers.

Program grid, split-K and the LSE merge are those of the ``tl.dot`` kernel (``_combine_kernel`` merges splits).
Needs Triton ≥ 3.6 with Gluon and a Hopper GPU; ``_sparse_mla.sparse_mla_decode`` uses it only when the config
says ``gluon=1``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, fence_async_shared
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp


@gluon.jit
def _issue_tile(kv8_ptr, kvr_ptr, irow, n0, end, nope_buf, rope_buf,
                CP_NOPE: gl.constexpr, CP_ROPE: gl.constexpr):
    # Gather 64 selected rows: 512 e4m3 lanes and 64 bf16 rope lanes each, as 16-byte cp.async copies.
    offs_a = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, CP_NOPE))
    idx_a = gl.load(irow + offs_a, mask=offs_a < end, other=-1)
    row_a = gl.where(idx_a >= 0, idx_a, 0).to(gl.int64) * 656
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, CP_NOPE))
    ptrs = kv8_ptr + gl.expand_dims(row_a, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(idx_a >= 0, 1) & gl.expand_dims(cols < 512, 0)
    cp.async_copy_global_to_shared(nope_buf, ptrs, mask=mask)
    offs_b = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, CP_ROPE))
    idx_b = gl.load(irow + offs_b, mask=offs_b < end, other=-1)
    row_b = gl.where(idx_b >= 0, idx_b, 0).to(gl.int64) * 328 + 264
    colr = gl.arange(0, 64, layout=gl.SliceLayout(0, CP_ROPE))
    rptrs = kvr_ptr + gl.expand_dims(row_b, 1) + gl.expand_dims(colr, 0)
    rmask = gl.expand_dims(idx_b >= 0, 1) & gl.expand_dims(colr < 64, 0)
    cp.async_copy_global_to_shared(rope_buf, rptrs, mask=rmask)


@gluon.jit
def _decode_fp8_tm_kernel(
    q_ptr, stride_qt, stride_qh,
    kv8_ptr, kvs_ptr, kvr_ptr,
    idx_ptr, stride_it, len_ptr,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr,
    H, K, qk_scale_log2, SPLITS,
    HAS_LEN: gl.constexpr, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    CP_NOPE: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
    CP_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    NOPE_SL: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    ROPE_SL: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
    QPE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_H], gl.bfloat16)

    t = gl.program_id(0)
    hb = gl.program_id(1)
    sp = gl.program_id(2)

    # Q^T chunks into shared memory (wgmma B operands), stored [heads, lanes] and viewed transposed.
    qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    qrow = q_ptr + t.to(gl.int64) * stride_qt + gl.expand_dims(qh, 1) * stride_qh
    qm = gl.expand_dims(qh < H, 1) & gl.expand_dims(qd < 128, 0)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
    for g in gl.static_range(4):
        q_s.index(g).store(gl.load(qrow + g * 128 + gl.expand_dims(qd, 0), mask=qm, other=0.0))
    qd2 = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qpe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], QPE_SL,
                                      gl.load(qrow + 512 + gl.expand_dims(qd2, 0), mask=gl.expand_dims(qh < H, 1) & gl.expand_dims(qd2 < 64, 0), other=0.0))
    p_s = gl.allocate_shared_memory(gl.bfloat16, [4, 64, BLOCK_H], P_SL)
    nope_s = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 512], NOPE_SL)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], ROPE_SL)
    fence_async_shared()

    n_valid = K
    if HAS_LEN:
        n_valid = gl.minimum(gl.maximum(gl.load(len_ptr + t), 0), K)
    chunk = gl.cdiv(gl.cdiv(n_valid, SPLITS), 64) * 64
    start = sp * chunk
    end = gl.minimum(start + chunk, n_valid)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), 64)
    irow = idx_ptr + t.to(gl.int64) * stride_it

    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=COL)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=COL)
    acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    zs = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)

    _issue_tile(kv8_ptr, kvr_ptr, irow, start, end, nope_s.index(0), rope_s.index(0), CP_NOPE, CP_ROPE)
    cp.commit_group()
    offs = start + gl.arange(0, 64, layout=ROW)
    idx_n = gl.load(irow + offs, mask=offs < end, other=-1)
    for it in range(n_tiles):
        stg = it % 2
        n0 = start + it * 64
        idx_c = idx_n
        srow = gl.where(idx_c >= 0, idx_c, 0).to(gl.int64) * 164 + 128
        c0 = gl.load(kvs_ptr + srow, mask=idx_c >= 0, other=0.0)
        c1 = gl.load(kvs_ptr + srow + 1, mask=idx_c >= 0, other=0.0)
        c2 = gl.load(kvs_ptr + srow + 2, mask=idx_c >= 0, other=0.0)
        c3 = gl.load(kvs_ptr + srow + 3, mask=idx_c >= 0, other=0.0)
        _issue_tile(kv8_ptr, kvr_ptr, irow, n0 + 64, end, nope_s.index(1 - stg), rope_s.index(1 - stg), CP_NOPE, CP_ROPE)
        cp.commit_group()
        offs = n0 + 64 + gl.arange(0, 64, layout=ROW)
        idx_n = gl.load(irow + offs, mask=offs < end, other=-1)
        cp.wait_group(1)
        gl.thread_barrier()
        nope = nope_s.index(stg)
        kpe = rope_s.index(stg).load(A_OP)
        s = warpgroup_mma(kpe, qpe_s.permute([1, 0]), zs)
        k0 = nope.slice(0, 128, dim=1).load(A_OP).to(gl.bfloat16)
        s += warpgroup_mma(k0, q_s.index(0).permute([1, 0]), zs) * gl.expand_dims(c0, 1)
        k1 = nope.slice(128, 128, dim=1).load(A_OP).to(gl.bfloat16)
        s += warpgroup_mma(k1, q_s.index(1).permute([1, 0]), zs) * gl.expand_dims(c1, 1)
        k2 = nope.slice(256, 128, dim=1).load(A_OP).to(gl.bfloat16)
        s += warpgroup_mma(k2, q_s.index(2).permute([1, 0]), zs) * gl.expand_dims(c2, 1)
        k3 = nope.slice(384, 128, dim=1).load(A_OP).to(gl.bfloat16)
        s += warpgroup_mma(k3, q_s.index(3).permute([1, 0]), zs) * gl.expand_dims(c3, 1)
        valid = idx_c >= 0
        s = gl.where(gl.expand_dims(valid, 1), s * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_s.index(0).store((p * gl.expand_dims(c0, 1)).to(gl.bfloat16))
        p_s.index(1).store((p * gl.expand_dims(c1, 1)).to(gl.bfloat16))
        p_s.index(2).store((p * gl.expand_dims(c2, 1)).to(gl.bfloat16))
        p_s.index(3).store((p * gl.expand_dims(c3, 1)).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        al = gl.expand_dims(alpha, 0)
        v = nope.slice(0, 128, dim=1).permute([1, 0]).load(A_OP).to(gl.bfloat16)
        acc0 = warpgroup_mma(v, p_s.index(0), acc0 * al)
        v = nope.slice(128, 128, dim=1).permute([1, 0]).load(A_OP).to(gl.bfloat16)
        acc1 = warpgroup_mma(v, p_s.index(1), acc1 * al)
        v = nope.slice(256, 128, dim=1).permute([1, 0]).load(A_OP).to(gl.bfloat16)
        acc2 = warpgroup_mma(v, p_s.index(2), acc2 * al)
        v = nope.slice(384, 128, dim=1).permute([1, 0]).load(A_OP).to(gl.bfloat16)
        acc3 = warpgroup_mma(v, p_s.index(3), acc3 * al)
        gl.thread_barrier()
    cp.wait_group(0)

    live = l_i > 0.0
    inv = gl.expand_dims(gl.where(live, 1.0 / gl.where(live, l_i, 1.0), 0.0), 0)
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=COL)
    hmask = gl.expand_dims(heads < H, 0)
    d = gl.expand_dims(gl.arange(0, 128, layout=ROW), 1)
    LN2: gl.constexpr = 0.6931471805599453
    if SPLIT_OUT:
        lse = gl.where(live, (m_i + gl.log2(gl.where(live, l_i, 1.0))) * LN2, float("-inf"))
        base = (t.to(gl.int64) * H + heads) * SPLITS + sp
        mb = mo_ptr + gl.expand_dims(base, 0) * 512 + d
        gl.store(mb, acc0 * inv, mask=hmask)
        gl.store(mb + 128, acc1 * inv, mask=hmask)
        gl.store(mb + 256, acc2 * inv, mask=hmask)
        gl.store(mb + 384, acc3 * inv, mask=hmask)
        gl.store(ml_ptr + base, lse, mask=heads < H)
    else:
        lse = gl.where(live, (m_i + gl.log2(gl.where(live, l_i, 1.0))) * LN2, float("inf"))
        ob = o_ptr + t.to(gl.int64) * stride_ot + gl.expand_dims(heads, 0) * stride_oh + d
        gl.store(ob, (acc0 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 128, (acc1 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 256, (acc2 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 384, (acc3 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + heads, lse, mask=heads < H)
