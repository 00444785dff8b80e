"""Triton kernels of the sparse-MLA decode (imported lazily by ``_sparse_mla``; see its docstring for the design):
DeepSeek-V3.2's (``_sparse_mla_decode_kernel``) and DeepSeek-V4's (``_sparse_decode_v4_kernel``), which share the
split-K partial layout, the online-softmax conventions and the merge, ``_combine_kernel``.

Module-level so that the ``@triton.jit`` helper ``_load_tile`` resolves from the kernels' globals.
"""

import triton
import triton.language as tl

from pdctl.kernels._gdc import _gdc_enter, _gdc_trigger


@triton.jit
def _load_tile(
    idx_ptr, n0, end, kv_ptr, stride_kv, kvs_ptr, stride_kvs, kvr_ptr, stride_kvr,
    ROPE_OFF: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Gather BLOCK_N selected latent rows: 4 chunks of 128 c_kv lanes (raw dtype), 64 rope lanes, and for FP8
    # the 4 per-chunk scales. Row offsets are multiples of 16 B (656 = 41·16, 576·2 = 72·16; rope at byte 528
    # of an fp8 row / element 512 of a bf16 row; scales at byte 512): the hints let Triton issue 16-byte loads.
    d = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    offs = n0 + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_ptr + offs, mask=offs < end, other=-1)
    valid = idx >= 0
    row = tl.where(valid, idx, 0).to(tl.int64)
    kbase = tl.multiple_of(row * stride_kv, 16)
    kb = kv_ptr + kbase[:, None] + d[None, :]
    k0 = tl.load(kb, mask=valid[:, None], other=0.0)
    k1 = tl.load(kb + 128, mask=valid[:, None], other=0.0)
    k2 = tl.load(kb + 256, mask=valid[:, None], other=0.0)
    k3 = tl.load(kb + 384, mask=valid[:, None], other=0.0)
    rbase = tl.multiple_of(row * stride_kvr + ROPE_OFF, 8)
    kpe = tl.load(kvr_ptr + rbase[:, None] + dr[None, :], mask=valid[:, None], other=0.0)
    if FP8:
        sbase = tl.multiple_of(row * stride_kvs + 128, 4)
        c0 = tl.load(kvs_ptr + sbase, mask=valid, other=0.0)
        c1 = tl.load(kvs_ptr + sbase + 1, mask=valid, other=0.0)
        c2 = tl.load(kvs_ptr + sbase + 2, mask=valid, other=0.0)
        c3 = tl.load(kvs_ptr + sbase + 3, mask=valid, other=0.0)
    else:
        c0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        c1 = c0
        c2 = c0
        c3 = c0
    return valid, k0, k1, k2, k3, kpe, c0, c1, c2, c3

@triton.jit
def _to_mma(k0, k1, k2, k3, c0, c1, c2, c3, cdt: tl.constexpr, FOLD: tl.constexpr):
    # The four c_kv chunks of a gathered tile as MMA operands. FOLD (FP8 rows): dequantised, bf16(x · scale) with
    # the product in fp32 (one rounding), so that QKᵀ and PV are the bf16 cache's dot chains (one conversion of p,
    # no per-chunk score scaling); otherwise only converted, the scales applied to the scores and to p. Measured on
    # the H200 (2026-12-01, h = 16, B = 1, 32-row tiles, 64 splits, PDL): 6.68 µs folded against 7.08 not; the
    # product in bf16, bf16(bf16(x) · bf16(scale)) as FlashMLA's sm90 kernels round, 6.99; the four scales as one
    # 16-byte load split in registers, 7.60 (28 registers spilled).
    if FOLD:
        k0 = (k0.to(tl.float32) * c0[:, None]).to(cdt)
        k1 = (k1.to(tl.float32) * c1[:, None]).to(cdt)
        k2 = (k2.to(tl.float32) * c2[:, None]).to(cdt)
        k3 = (k3.to(tl.float32) * c3[:, None]).to(cdt)
    else:
        k0 = k0.to(cdt)
        k1 = k1.to(cdt)
        k2 = k2.to(cdt)
        k3 = k3.to(cdt)
    return k0, k1, k2, k3


@triton.jit
def _sparse_mla_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kv,  # c_kv lanes: bf16/fp16 [slots, 576] or the fp8 view of [slots, 656]
    kvs_ptr, stride_kvs,  # fp8 only: fp32 view [slots, 164]; scales at columns 128..131
    kvr_ptr, stride_kvr,  # rope lanes: same tensor as kv (bf16) or the bf16 view [slots, 328]
    idx_ptr, stride_it,
    len_ptr,
    o_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt,
    mo_ptr, ml_ptr,  # split partials: fp32 [T, H, SPLITS, 512] and [T, H, SPLITS]
    H, K, qk_scale_log2, SPLITS,
    ROPE_OFF: tl.constexpr,
    FP8: tl.constexpr,
    HAS_LEN: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    PREFETCH: tl.constexpr,
    RELOAD: tl.constexpr,
    FOLD: tl.constexpr,
    MMA_F16: tl.constexpr,
    QK_CHAINS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GDC: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    _gdc_enter(GDC)
    if MMA_F16:
        # FP8 KV with fp16 MMA operands: e4m3 -> fp16 is exact and one conversion per two values on sm_89+;
        # requires |q| and |k_pe| < 65504 (fp16 range), which the kernel does not check.
        cdt = tl.float16
    else:
        cdt = q_ptr.dtype.element_ty
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, 128)
    dr = tl.arange(0, 64)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(qrow + d[None, :], mask=hmask[:, None], other=0.0).to(cdt)
    q1 = tl.load(qrow + 128 + d[None, :], mask=hmask[:, None], other=0.0).to(cdt)
    q2 = tl.load(qrow + 256 + d[None, :], mask=hmask[:, None], other=0.0).to(cdt)
    q3 = tl.load(qrow + 384 + d[None, :], mask=hmask[:, None], other=0.0).to(cdt)
    qpe = tl.load(qrow + 512 + dr[None, :], mask=hmask[:, None], other=0.0).to(cdt)

    n_valid = K
    if HAS_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), K)
    chunk = tl.cdiv(tl.cdiv(n_valid, SPLITS), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, n_valid)
    irow = idx_ptr + t.to(tl.int64) * stride_it

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    if RELOAD:
        # FP8 path with one converted 128-lane chunk live at a time: QKᵀ converts and consumes each chunk in turn;
        # PV re-reads the same bytes (an L1/L2 hit: they were just loaded) and converts them again. Keeping all
        # four bf16 chunks live for PV costs 255 registers and spills at 16 heads (measured on H200, Triton 3.6),
        # i.e. one program per SM and no latency hiding for the gathers.
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(irow + offs, mask=offs < end, other=-1)
            valid = idx >= 0
            row = tl.where(valid, idx, 0).to(tl.int64)
            kbase = tl.multiple_of(row * stride_kv, 16)
            kb = kv_ptr + kbase[:, None] + d[None, :]
            rbase = tl.multiple_of(row * stride_kvr + ROPE_OFF, 8)
            kpe = tl.load(kvr_ptr + rbase[:, None] + dr[None, :], mask=valid[:, None], other=0.0).to(cdt)
            sbase = tl.multiple_of(row * stride_kvs + 128, 4)
            c0 = tl.load(kvs_ptr + sbase, mask=valid, other=0.0)
            c1 = tl.load(kvs_ptr + sbase + 1, mask=valid, other=0.0)
            c2 = tl.load(kvs_ptr + sbase + 2, mask=valid, other=0.0)
            c3 = tl.load(kvs_ptr + sbase + 3, mask=valid, other=0.0)
            s = tl.dot(qpe, tl.trans(kpe))
            kc = tl.load(kb, mask=valid[:, None], other=0.0).to(cdt)
            s += tl.dot(q0, tl.trans(kc)) * c0[None, :]
            kc = tl.load(kb + 128, mask=valid[:, None], other=0.0).to(cdt)
            s += tl.dot(q1, tl.trans(kc)) * c1[None, :]
            kc = tl.load(kb + 256, mask=valid[:, None], other=0.0).to(cdt)
            s += tl.dot(q2, tl.trans(kc)) * c2[None, :]
            kc = tl.load(kb + 384, mask=valid[:, None], other=0.0).to(cdt)
            s += tl.dot(q3, tl.trans(kc)) * c3[None, :]
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # evict_first: a different load op from the QK one (no CSE back into one live tile), and the bytes
            # are dead after this use.
            kc = tl.load(kb, mask=valid[:, None], other=0.0, eviction_policy="evict_first").to(cdt)
            acc0 = tl.dot((p * c0[None, :]).to(cdt), kc, acc0 * alpha[:, None])
            kc = tl.load(kb + 128, mask=valid[:, None], other=0.0, eviction_policy="evict_first").to(cdt)
            acc1 = tl.dot((p * c1[None, :]).to(cdt), kc, acc1 * alpha[:, None])
            kc = tl.load(kb + 256, mask=valid[:, None], other=0.0, eviction_policy="evict_first").to(cdt)
            acc2 = tl.dot((p * c2[None, :]).to(cdt), kc, acc2 * alpha[:, None])
            kc = tl.load(kb + 384, mask=valid[:, None], other=0.0, eviction_policy="evict_first").to(cdt)
            acc3 = tl.dot((p * c3[None, :]).to(cdt), kc, acc3 * alpha[:, None])
            m_i = m_new
    else:
        if PREFETCH:
            valid, r0, r1, r2, r3, rpe, c0, c1, c2, c3 = _load_tile(
                irow, start, end, kv_ptr, stride_kv, kvs_ptr, stride_kvs, kvr_ptr, stride_kvr, ROPE_OFF, FP8, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                cur_valid = valid
                k0, k1, k2, k3 = _to_mma(r0, r1, r2, r3, c0, c1, c2, c3, cdt, FOLD)
                kpe = rpe.to(cdt)
                s0 = c0
                s1 = c1
                s2 = c2
                s3 = c3
                valid, r0, r1, r2, r3, rpe, c0, c1, c2, c3 = _load_tile(
                    irow, n0 + BLOCK_N, end, kv_ptr, stride_kv, kvs_ptr, stride_kvs, kvr_ptr, stride_kvr,
                    ROPE_OFF, FP8, BLOCK_N)
            else:
                cur_valid, k0, k1, k2, k3, kpe, s0, s1, s2, s3 = _load_tile(
                    irow, n0, end, kv_ptr, stride_kv, kvs_ptr, stride_kvs, kvr_ptr, stride_kvr, ROPE_OFF, FP8, BLOCK_N)
                k0, k1, k2, k3 = _to_mma(k0, k1, k2, k3, s0, s1, s2, s3, cdt, FOLD)
                kpe = kpe.to(cdt)
            s = tl.dot(qpe, tl.trans(kpe))
            if FP8 and not FOLD:
                s += tl.dot(q0, tl.trans(k0)) * s0[None, :]
                s += tl.dot(q1, tl.trans(k1)) * s1[None, :]
                s += tl.dot(q2, tl.trans(k2)) * s2[None, :]
                s += tl.dot(q3, tl.trans(k3)) * s3[None, :]
                s = s * qk_scale_log2
            elif QK_CHAINS:
                # Five independent MMA chains (rope, then each 128-lane chunk), each scaled before the sum: the
                # multiply keeps Triton's combine pass (add(d, dot(a, b, 0)) -> dot(a, b, d)) from folding them back
                # into one accumulator chain, 36 dependent mma.sync deep at 576 lanes.
                s = s * qk_scale_log2
                s += tl.dot(q0, tl.trans(k0)) * qk_scale_log2
                s += tl.dot(q1, tl.trans(k1)) * qk_scale_log2
                s += tl.dot(q2, tl.trans(k2)) * qk_scale_log2
                s += tl.dot(q3, tl.trans(k3)) * qk_scale_log2
            else:
                s = tl.dot(q0, tl.trans(k0), s)
                s = tl.dot(q1, tl.trans(k1), s)
                s = tl.dot(q2, tl.trans(k2), s)
                s = tl.dot(q3, tl.trans(k3), s)
                s = s * qk_scale_log2
            s = tl.where(cur_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8 and not FOLD:
                acc0 = tl.dot((p * s0[None, :]).to(cdt), k0, acc0 * alpha[:, None])
                acc1 = tl.dot((p * s1[None, :]).to(cdt), k1, acc1 * alpha[:, None])
                acc2 = tl.dot((p * s2[None, :]).to(cdt), k2, acc2 * alpha[:, None])
                acc3 = tl.dot((p * s3[None, :]).to(cdt), k3, acc3 * alpha[:, None])
            else:
                pc = p.to(cdt)
                acc0 = tl.dot(pc, k0, acc0 * alpha[:, None])
                acc1 = tl.dot(pc, k1, acc1 * alpha[:, None])
                acc2 = tl.dot(pc, k2, acc2 * alpha[:, None])
                acc3 = tl.dot(pc, k3, acc3 * alpha[:, None])
            m_i = m_new

    _gdc_trigger(GDC)
    live = l_i > 0.0
    inv = tl.where(live, 1.0 / tl.where(live, l_i, 1.0), 0.0)
    LN2: tl.constexpr = 0.6931471805599453
    if not SPLIT_OUT:
        lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * LN2, float("inf"))
        ob = o_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        odt = o_ptr.dtype.element_ty
        tl.store(ob, (acc0 * inv[:, None]).to(odt), mask=hmask[:, None])
        tl.store(ob + 128, (acc1 * inv[:, None]).to(odt), mask=hmask[:, None])
        tl.store(ob + 256, (acc2 * inv[:, None]).to(odt), mask=hmask[:, None])
        tl.store(ob + 384, (acc3 * inv[:, None]).to(odt), mask=hmask[:, None])
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)
    else:
        lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * LN2, float("-inf"))
        base = (t.to(tl.int64) * H + heads) * SPLITS + sp  # [BLOCK_H]
        mb = mo_ptr + base[:, None] * 512 + d[None, :]
        mdt = mo_ptr.dtype.element_ty  # fp32, or bf16 (DecodeConfig.bf16_partials)
        tl.store(mb, (acc0 * inv[:, None]).to(mdt), mask=hmask[:, None])
        tl.store(mb + 128, (acc1 * inv[:, None]).to(mdt), mask=hmask[:, None])
        tl.store(mb + 256, (acc2 * inv[:, None]).to(mdt), mask=hmask[:, None])
        tl.store(mb + 384, (acc3 * inv[:, None]).to(mdt), mask=hmask[:, None])
        tl.store(ml_ptr + base, lse, mask=hmask)

@triton.jit
def _combine_kernel(
    mo_ptr, ml_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, H, SPLITS, sink_ptr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    # Flash-decoding merge: M = max lse_j, w_j = exp(lse_j − M), o = Σ w_j o_j / Σ w_j, lse = M + ln Σ w_j.
    # Grid (T, H, 512 / BLOCK_D): with few rows (B = 1: T·H = 16 programs, each reading SPLITS × 2 KB) a
    # program per (row, head) leaves the GPU idle and serialises the loads, so the lanes are spread too.
    # With GDC (DecodeConfig.pdl ≥ 1, sm_90+) this grid is a programmatic dependent of the split kernel, scheduled
    # once every split program has started (pdl 1) or left its main loop (pdl 2); griddepcontrol.wait then holds it
    # until the partials are complete and visible. (Launched that way while the split kernel did not trigger
    # early, it measured no faster: 9.5 vs 9.4 µs at B = 1, H200, 2026-11-30; triggering at the start, 7.4 vs 8.4.)
    t = tl.program_id(0)
    h = tl.program_id(1)
    dblk = tl.program_id(2)
    _gdc_enter(GDC)
    base = (t.to(tl.int64) * H + h) * SPLITS
    sj = tl.arange(0, BLOCK_S)
    lj = tl.load(ml_ptr + base + sj, mask=sj < SPLITS, other=float("-inf"))
    mx = tl.max(lj, 0)
    live = mx > float("-inf")
    msafe = tl.where(live, mx, 0.0)
    w = tl.where(lj > float("-inf"), tl.exp(lj - msafe), 0.0)
    wsum = tl.sum(w, 0)
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    parts = tl.load(mo_ptr + (base + sj)[:, None] * 512 + d[None, :], mask=(sj < SPLITS)[:, None],
                    other=0.0).to(tl.float32)
    o = tl.sum(parts * w[:, None], 0) / tl.where(live, wsum, 1.0)
    o = tl.where(live, o, 0.0)
    if HAS_SINK:
        # DeepSeek-V4's per-head attention sink (sparse_decode_v4): o · 1 / (1 + exp(sink[h] − lse)), lse unchanged.
        lse_h = msafe + tl.log(tl.where(live, wsum, 1.0))
        o = o / (1.0 + tl.exp(tl.load(sink_ptr + h) - lse_h))
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(o_ptr.dtype.element_ty))
    if dblk == 0:
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h,
                 tl.where(live, msafe + tl.log(tl.where(live, wsum, 1.0)), float("inf")))


@triton.jit
def _v4_attend(
    q_n, q_r, m_i, l_i, acc_n, acc_r, irow, lo, hi, c8_ptr, cu8_ptr, cbf_ptr, page_size, page_stride, qk_scale_log2,
    BLOCK_N: tl.constexpr,
):
    # Online softmax over positions [lo, hi) of one KV source's index row (irow), BLOCK_N gathered rows at a time, on
    # top of the running state (m_i, l_i, acc_n, acc_r). A V4 row (``_reference`` describes the layout) lives in page
    # slot // page_size at row slot % page_size: 576 data bytes at page·page_stride + row·576 (448 e4m3, then 64 bf16
    # rope lanes), its 7 ue8m0 scales at page·page_stride + page_size·576 + row·8. The 448 nope lanes are dequantised
    # into a [BLOCK_N, 512] tile, lanes 448–511 zero, as bf16(x · 2^e) (exact: e4m3 times a power of two), so that
    # QKᵀ is one 512-deep dot against q (whose rope lanes meet those zeros) plus one 64-deep dot of the rope lanes,
    # and PV is the same two tiles; V = the whole 512-lane row (FlashMLA MODEL1: d_v = 512).
    cdt = q_n.dtype
    t8 = tl.arange(0, 8)
    d64 = tl.arange(0, 64)
    tile_ok = (t8 < 7)[None, :]
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(irow + offs, mask=offs < hi, other=-1)
        valid = idx >= 0
        slot = tl.where(valid, idx, 0).to(tl.int64)
        page = slot // page_size
        row = slot - page * page_size
        base = tl.multiple_of(page * page_stride + row * 576, 64)
        sbase = tl.multiple_of(page * page_stride + page_size * 576 + row * 8, 8)
        e = tl.load(cu8_ptr + sbase[:, None] + t8[None, :], mask=valid[:, None] & tile_ok, other=0)
        sc = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # ue8m0 byte e -> 2^(e - 127) (e = 0 reads as 0)
        k8 = tl.load(c8_ptr + base[:, None, None] + t8[None, :, None] * 64 + d64[None, None, :],
                     mask=(valid[:, None] & tile_ok)[:, :, None], other=0.0)
        kn = tl.reshape((k8.to(tl.float32) * sc[:, :, None]).to(cdt), (BLOCK_N, 512))
        kr = tl.load(cbf_ptr + (base // 2 + 224)[:, None] + d64[None, :], mask=valid[:, None], other=0.0).to(cdt)
        s = tl.dot(q_n, tl.trans(kn))
        s = tl.dot(q_r, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(cdt)
        acc_n = tl.dot(pc, kn, acc_n * alpha[:, None])
        acc_r = tl.dot(pc, kr, acc_r * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc_n, acc_r


@triton.jit
def _sparse_decode_v4_kernel(
    q_ptr, stride_qt, stride_qh,
    c8_ptr, cu8_ptr, cbf_ptr, page_size, page_stride, idx_ptr, stride_it, len_ptr, K1,  # main source (SWA)
    e8_ptr, eu8_ptr, ebf_ptr, e_page_size, e_page_stride, eidx_ptr, stride_eit, elen_ptr, K2,  # extra source
    sink_ptr,
    o_ptr, stride_ot, stride_oh,
    lse_ptr, stride_lt,
    mo_ptr, ml_ptr,  # split partials: [T, H, SPLITS, 512] and [T, H, SPLITS], as the V3.2 kernel's
    H, qk_scale_log2, SPLITS,
    HAS_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_ELEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GDC: tl.constexpr,
):
    # DeepSeek-V4 sparse decode, program (query row t, head block hb, split sp). The row's valid entries are the
    # first n1 of its main index row followed by the first n2 of its extra index row (n = min(topk_length, K), or K);
    # split sp takes an equal, BLOCK_N-aligned share of that concatenation, walking the part in each source with
    # ``_v4_attend`` on one softmax state. Then, as the V3.2 kernel: a normalised output and natural-log LSE per
    # split (merged by ``_combine_kernel``), or, unsplit, the final o and lse; the attention sink scales o.
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    _gdc_enter(GDC)
    cdt = q_ptr.dtype.element_ty
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d512 = tl.arange(0, 512)
    d64 = tl.arange(0, 64)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_n = tl.load(qrow + d512[None, :], mask=hmask[:, None], other=0.0)
    q_r = tl.load(qrow + 448 + d64[None, :], mask=hmask[:, None], other=0.0)

    n1 = K1
    if HAS_LEN:
        n1 = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), K1)
    n2 = 0
    if HAS_EXTRA:
        n2 = K2
        if HAS_ELEN:
            n2 = tl.minimum(tl.maximum(tl.load(elen_ptr + t), 0), K2)
    chunk = tl.cdiv(tl.cdiv(n1 + n2, SPLITS), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, n1 + n2)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    m_i, l_i, acc_n, acc_r = _v4_attend(
        q_n, q_r, m_i, l_i, acc_n, acc_r, idx_ptr + t.to(tl.int64) * stride_it, start, tl.minimum(end, n1),
        c8_ptr, cu8_ptr, cbf_ptr, page_size, page_stride, qk_scale_log2, BLOCK_N)
    if HAS_EXTRA:
        m_i, l_i, acc_n, acc_r = _v4_attend(
            q_n, q_r, m_i, l_i, acc_n, acc_r, eidx_ptr + t.to(tl.int64) * stride_eit, tl.maximum(start, n1) - n1,
            end - n1, e8_ptr, eu8_ptr, ebf_ptr, e_page_size, e_page_stride, qk_scale_log2, BLOCK_N)

    _gdc_trigger(GDC)
    live = l_i > 0.0
    inv = tl.where(live, 1.0 / tl.where(live, l_i, 1.0), 0.0)
    LN2: tl.constexpr = 0.6931471805599453
    lse_n = (m_i + tl.log2(tl.where(live, l_i, 1.0))) * LN2
    nope = (d512 < 448)[None, :]
    if not SPLIT_OUT:
        lse = tl.where(live, lse_n, float("inf"))
        f = inv
        if HAS_SINK:
            # (lse_n, finite where live: a sink of +inf gives 0 there, and dead rows keep o = 0)
            f = inv / (1.0 + tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - tl.where(live, lse_n, 0.0)))
        ob = o_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        odt = o_ptr.dtype.element_ty
        tl.store(ob + d512[None, :], (acc_n * f[:, None]).to(odt), mask=hmask[:, None] & nope)
        tl.store(ob + 448 + d64[None, :], (acc_r * f[:, None]).to(odt), mask=hmask[:, None])
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)
    else:
        lse = tl.where(live, lse_n, float("-inf"))
        base = (t.to(tl.int64) * H + heads) * SPLITS + sp
        mb = mo_ptr + base[:, None] * 512
        mdt = mo_ptr.dtype.element_ty
        tl.store(mb + d512[None, :], (acc_n * inv[:, None]).to(mdt), mask=hmask[:, None] & nope)
        tl.store(mb + 448 + d64[None, :], (acc_r * inv[:, None]).to(mdt), mask=hmask[:, None])
        tl.store(ml_ptr + base, lse, mask=hmask)
