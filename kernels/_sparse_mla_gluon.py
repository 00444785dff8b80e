"""Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``) sparse-MLA decode for the FP8 656-byte
cache on sm_90: tokens are the wgmma's M dimension, heads its N.

Why a second kernel: in the ``tl.dot`` kernel (``_sparse_mla_kernels``) a 16-head tile is too short for wgmma's
64-row M, so Triton falls back to ``mma.sync`` with the whole [16, 576] query replicated in every warp's registers;
with the converted FP8 tile on top that is 255 registers and spills (compiled offline with ``ptxas -v`` for
sm_90a), i.e. one or two programs per SM and few gathers in flight. Here one warpgroup (4 warps) owns a program:

* the 64 gathered rows of a tile (512 e4m3 + 64 bf16 lanes each) arrive either in shared memory as 16-byte
  ``cp.async`` copies, ``STAGES`` tiles in flight, or (``STAGES = 0``) straight in registers, with half the
  shared memory so that two programs share an SM; each tile is converted once, e4m3 → bf16 (16-byte accesses,
  no scale applied), into four [64, 128] wgmma-swizzled chunks;
* Sᵀ[64 tokens, BH heads] = K_g[64, 128] · Q_gᵀ[128, BH] per chunk g (plus the 64 rope lanes), both operands read
  by wgmma from shared memory; the chunk's per-token scale multiplies its partial score
  (``s += sc_g[:, None] · S_g``), as in the ``tl.dot`` kernel;
* the online softmax runs over tokens (axis 0), and Oᵀ_g[128, BH] += K_gᵀ[128, 64] · (P ∘ sc_g)ᵀ[64, BH], the same
  converted chunk read transposed (an MN-major A operand) and (P ∘ sc_g)ᵀ written to shared memory as B.

An earlier version converted each chunk straight into wgmma's register A operand from the staged bytes; the
transposed byte gathers for the PV product bank-conflicted and it ran 10 % slower than the ``tl.dot`` kernel on
the H200 (2026-11-30), so the bf16 tile is now staged once. Register use (``ptxas -v``, sm_90a, 16 heads): 255 with
spills while the compiler hoisted the loop-invariant wgmma descriptors out of the loop, 168–186 once a
not-provably-zero index keeps them inside it.

Program grid, split-K and the LSE merge are those of the ``tl.dot`` kernel (``_combine_kernel`` merges splits).
Asynchronous wgmma (the five QKᵀ products issued together and waited for once, a tile's PV products left in flight
while the next tile's rows load) was built and measured on the H200 (2026-11-30, every variant verified): 10–15 %
slower at every FP8 shape with h ≤ 32 (h = 16, B = 64: 85.2 against 74.7 µs; h = 32, B = 64: 122.2 against 96.2 µs),
so MMA latency is not what bounds this kernel; it was removed. So was a small-footprint variant (each 128-lane
chunk loaded and converted just before its wgmma, for QKᵀ and again for PV: 51 KB of shared memory, 128–176
registers): 129–143 µs against 68.6 at h = 16, B = 64 under Nsight Compute. There the grid, not the registers or
shared memory, limits residency: 64 rows × 4 splits is two programs per SM (11.8 % achieved occupancy either way),
and the profile of the kept kernel shows 1.9 active warps per scheduler, 0.2 instructions issued per cycle, and
38 % of stalls waiting on global loads.

The warp-specialised kernel (``_decode_fp8_ws_kernel``, ``gluon`` 4 and 5) answers that profile. One program per SM
runs ``gl.warp_specialize`` partitions that meet on mbarriers over two bf16 stages:

* one or two loader partitions (4 warps each) gather a tile's rows into registers (as 32-bit words) before waiting
  for a free stage, prefetch the next tile's slots, and dequantise with the per-token scale folded in, the way
  FlashMLA's sm90 kernel does (e4m3 → bf16 exactly, times the scale rounded to bf16: bf16(bf16(x)·bf16(scale)));
* the MMA partition (one warpgroup, or two splitting 64 heads) runs five chained asynchronous QKᵀ wgmmas, the online
  softmax with a 0 / −inf row bias from the loader, and four PV wgmmas, then frees the stage. It also reads the
  query, so the first gathers overlap that read.

Per-tile ``clock64`` stamps (``benchmarks/decode_ws_profile.py``, H200, h = 16, B = 64) put the MMA partition at
2.1 µs a tile, starved for only 0.3 µs of it: QKᵀ 0.45, softmax 0.85 (0.28 at B = 1, where no loader runs beside
it), PV 0.40. Those phases share the SM's shared-memory bandwidth with the loaders: a tile is written once as bf16
(72 KB) and read twice as wgmma's A operand (136 KB). A variant with two MMA warpgroups taking alternate tiles was
built and measured (verified against the reference): 61.2 against 51.0 µs, each warpgroup's QKᵀ phase growing from
0.45 to 1.28 µs, so it was removed. So was a software-pipelined MMA partition (the next tile's QKᵀ issued before
this tile's softmax, FlashAttention-3's intra-warpgroup overlap): verified, and 1–25 % slower at every measured
shape (h = 16, B = 64: 61.4 against 50.9 µs; h = 128, B = 64: 194.6 against 155.5; H200, 2026-11-30).

With ``DecodeConfig.merge`` the warp-specialised kernel also merges its splits: after the partitions join, every
program arrives at a grid barrier (``_grid_barrier``; the launch is cooperative, so the whole grid is resident) and
then merges a slice of the lanes over all splits (``_merge_splits``), so that no second kernel is launched. Measured on
the H200 (2026-11-30): the barrier costs 1.0–1.9 µs per call; the merge 2.7–3.3 µs once its code was a short loop,
against 5–52 µs as first written, straight-line: run once per program, that code was fetched cold (its time followed
its instruction count, not its bytes). Faster than two launches at B = 8 (h = 16: 11.9 against 14.2 µs) and at
h = 128, B = 1; slower at B = 1 with h ≤ 32 (9.4 against 7.3 µs), where the build keeps two launches.

With 64-head blocks (h ≥ 64) the tokens-as-M layout costs a softmax reduction across the warpgroup's four warps
every tile: the warp-specialised kernel timed with that max removed (wrong outputs, ``benchmarks/decode_ws_bounds.py``)
ran h = 128, B = 64 in 126 instead of 157 µs on the H200. ``gluon`` 7 therefore puts the heads on wgmma's M
(``_ws_mma_hm``, one loader partition as in 5): S[heads, tokens] = Q·Kᵀ with the staged tile as its natural
K-major B operand, a softmax along the tokens that stays inside each warp, and O[heads, lanes] += P·V with P taken
straight from registers as the A operand. O for 64 heads × 512 lanes is too large for one warpgroup's registers, so a
second 4-warp MMA partition (``_ws_pv_hm``) computes lanes 256–511 from the P and rescale that the first hands it
through shared memory each tile (FlashMLA's split of the output between two warpgroups). Measured on the H200
(2026-11-30, plain launches, the second partition then at 192 registers): h = 128, B = 64 133.7 µs against 157.0 for
gluon 5, and 146.8 when both partitions computed QKᵀ and the softmax themselves instead of the handoff.

The loader then bounded gluon 7 (its first MMA partition waited 2.3 µs of 3.9 per tile for a staged tile). Reading
the rows as 32-bit words (Triton holds an fp8 tensor one byte to a register) and dequantising as FlashMLA does, one
inline-asm block per word, took h = 128, B = 64 from 132.5 to 115.0 µs (H200, 2026-11-30, same call); the integer
bit-trick conversions and issuing the next tile's gathers during this tile's conversion were measured and were slower
(``kernels/RESULTS.md``, section "The loader reads 32-bit words").

Needs Triton ≥ 3.6 with Gluon and a Hopper GPU; ``_sparse_mla.sparse_mla_decode`` uses these kernels only when the
config says ``gluon`` ≥ 1 (1: two cp.async stages, 2: one, 3: no staging; 4: warp-specialised with two loaders,
5: with one loader, 7: one loader and heads as M).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from pdctl.kernels._gdc import _gdc_enter, _gdc_trigger


@gluon.jit
def _query_to_smem(q_ptr, stride_qt, stride_qh, t, hb, H, q_s, qpe_s, BLOCK_H: gl.constexpr):
    # This program's BLOCK_H query heads into shared memory as wgmma B operands: four [BLOCK_H, 128] chunks of the
    # 512 latent lanes and the 64 rope lanes (heads ≥ H zero-filled).
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    qrow = q_ptr + t.to(gl.int64) * stride_qt + gl.expand_dims(qh, 1) * stride_qh
    qm = gl.expand_dims(qh < H, 1) & gl.expand_dims(qd < 128, 0)
    for g in gl.static_range(4):
        q_s.index(g).store(gl.load(qrow + g * 128 + gl.expand_dims(qd, 0), mask=qm, other=0.0))
    qd2 = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qpe_s.index(0).store(gl.load(qrow + 512 + gl.expand_dims(qd2, 0),
                                 mask=gl.expand_dims(qh < H, 1) & gl.expand_dims(qd2 < 64, 0), other=0.0))


@gluon.jit
def _split_range(K, len_ptr, t, sp, SPLITS, HAS_LEN: gl.constexpr):
    # Positions [start, end) of the top-k row that split `sp` covers (64-aligned chunks of the row's valid length,
    # topk_length when given) and its number of 64-row tiles.
    n_valid = K
    if HAS_LEN:
        n_valid = gl.minimum(gl.maximum(gl.load(len_ptr + t), 0), K)
    chunk = gl.cdiv(gl.cdiv(n_valid, SPLITS), 64) * 64
    start = sp * chunk
    end = gl.minimum(start + chunk, n_valid)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), 64)


@gluon.jit
def _store_split(acc0, acc1, acc2, acc3, m_i, l_i, t, hb, sp, H, SPLITS, o_ptr, stride_ot, stride_oh, lse_ptr,
                 stride_lt, mo_ptr, ml_ptr, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, MMA: gl.constexpr):
    # Normalise Oᵀ by the softmax denominator and write either this split's partial (fp32, or bf16 with
    # DecodeConfig.bf16_partials) and its LSE (merged by `_combine_kernel`) or, unsplit, the bf16 output and LSE. An
    # empty split or row has l = 0: o = 0 and lse = −inf (partial) / +inf (FlashMLA's convention for the output).
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
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
        gl.store(mb, (acc0 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        gl.store(mb + 128, (acc1 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        gl.store(mb + 256, (acc2 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        gl.store(mb + 384, (acc3 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        gl.store(ml_ptr + base, lse, mask=heads < H)
    else:
        lse = gl.where(live, (m_i + gl.log2(gl.where(live, l_i, 1.0))) * LN2, float("inf"))
        ob = o_ptr + t.to(gl.int64) * stride_ot + gl.expand_dims(heads, 0) * stride_oh + d
        gl.store(ob, (acc0 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 128, (acc1 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 256, (acc2 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 384, (acc3 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + heads, lse, mask=heads < H)


@gluon.jit
def _issue_tile(kv8_ptr, kvr_ptr, irow, n0, end, nope_buf, rope_buf, CP_NOPE: gl.constexpr, CP_ROPE: gl.constexpr):
    # Gather 64 selected rows into shared memory as 16-byte cp.async copies: 512 e4m3 lanes and 64 bf16 rope
    # lanes per row; invalid rows (index -1, or past `end`) are zero-filled.
    offs = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, CP_NOPE))
    idx = gl.load(irow + offs, mask=offs < end, other=-1)
    base = gl.expand_dims(gl.where(idx >= 0, idx, 0).to(gl.int64) * 656, 1)
    cols = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, CP_NOPE)), 0)
    cp.async_copy_global_to_shared(nope_buf, kv8_ptr + base + cols, mask=gl.expand_dims(idx >= 0, 1) & (cols < 512))
    offs_r = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, CP_ROPE))
    idx_r = gl.load(irow + offs_r, mask=offs_r < end, other=-1)
    base_r = gl.expand_dims(gl.where(idx_r >= 0, idx_r, 0).to(gl.int64) * 328 + 264, 1)
    cols_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, CP_ROPE)), 0)
    cp.async_copy_global_to_shared(rope_buf, kvr_ptr + base_r + cols_r,
                                   mask=gl.expand_dims(idx_r >= 0, 1) & (cols_r < 64))


@gluon.jit
def _load_scales(kvs_ptr, irow, n0, end, ROW: gl.constexpr):
    offs = n0 + gl.arange(0, 64, layout=ROW)
    idx = gl.load(irow + offs, mask=offs < end, other=-1)
    valid = idx >= 0
    srow = gl.where(valid, idx, 0).to(gl.int64) * 164 + 128
    c0 = gl.load(kvs_ptr + srow, mask=valid, other=0.0)
    c1 = gl.load(kvs_ptr + srow + 1, mask=valid, other=0.0)
    c2 = gl.load(kvs_ptr + srow + 2, mask=valid, other=0.0)
    c3 = gl.load(kvs_ptr + srow + 3, mask=valid, other=0.0)
    return c0, c1, c2, c3, valid


@gluon.jit
def _load_tile(kv8_ptr, kvs_ptr, kvr_ptr, irow, n0, end,
               LD_NOPE: gl.constexpr, LD_ROPE: gl.constexpr, ROW: gl.constexpr):
    # One tile of 64 selected rows into registers: four [64, 128] e4m3 chunks, the [64, 64] bf16 rope lanes, the
    # four per-chunk scales and the validity of each row (index ≥ 0 and inside [n0, end)).
    offs = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LD_NOPE))
    idx = gl.load(irow + offs, mask=offs < end, other=-1)
    ok = gl.expand_dims(idx >= 0, 1)
    base = gl.expand_dims(gl.where(idx >= 0, idx, 0).to(gl.int64) * 656, 1)
    cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, LD_NOPE)), 0)
    m = ok & (cols < 128)
    k0 = gl.load(kv8_ptr + base + cols, mask=m, other=0.0)
    k1 = gl.load(kv8_ptr + base + 128 + cols, mask=m, other=0.0)
    k2 = gl.load(kv8_ptr + base + 256 + cols, mask=m, other=0.0)
    k3 = gl.load(kv8_ptr + base + 384 + cols, mask=m, other=0.0)
    offs_r = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LD_ROPE))
    idx_r = gl.load(irow + offs_r, mask=offs_r < end, other=-1)
    base_r = gl.expand_dims(gl.where(idx_r >= 0, idx_r, 0).to(gl.int64) * 328 + 264, 1)
    cols_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LD_ROPE)), 0)
    kpe = gl.load(kvr_ptr + base_r + cols_r, mask=gl.expand_dims(idx_r >= 0, 1) & (cols_r < 64), other=0.0)
    c0, c1, c2, c3, valid = _load_scales(kvs_ptr, irow, n0, end, ROW)
    return k0, k1, k2, k3, kpe, c0, c1, c2, c3, valid


@gluon.jit
def _decode_fp8_tm_kernel(
    q_ptr, stride_qt, stride_qh,
    kv8_ptr, kvs_ptr, kvr_ptr,
    idx_ptr, stride_it, len_ptr,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr,
    H, K, qk_scale_log2, SPLITS,
    HAS_LEN: gl.constexpr, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr,
    GDC: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    LD_NOPE: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    CP_NOPE: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
    ST_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    LD_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    KC_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    KPE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
    QPE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_H], gl.bfloat16)

    t = gl.program_id(0)
    hb = gl.program_id(1)
    sp = gl.program_id(2)
    _gdc_enter(GDC)

    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
    qpe_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, 64], QPE_SL)
    _query_to_smem(q_ptr, stride_qt, stride_qh, t, hb, H, q_s, qpe_s, BLOCK_H)
    kc_s = gl.allocate_shared_memory(gl.bfloat16, [4, 64, 128], KC_SL)
    kpe_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], KPE_SL)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [4, 64, BLOCK_H], P_SL)

    start, end, n_tiles = _split_range(K, len_ptr, t, sp, SPLITS, HAS_LEN)
    irow = idx_ptr + t.to(gl.int64) * stride_it

    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=COL)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=COL)
    acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    zs = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)

    if STAGES > 0:
        nope_st = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 512], ST_SL)
        rope_st = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 64], ST_SL)
        for j in gl.static_range(STAGES - 1):
            _issue_tile(kv8_ptr, kvr_ptr, irow, start + j * 64, end, nope_st.index(j), rope_st.index(j), CP_NOPE,
                        LD_ROPE)
            cp.commit_group()
        d0, d1, d2, d3, rv = _load_scales(kvs_ptr, irow, start, end, ROW)
    for it in range(n_tiles):
        n0 = start + it * 64
        # z is 0 but not provably so: it keeps the wgmma shared-memory descriptors inside the loop. Hoisted, the
        # 68 descriptors of one iteration pin ~2 registers each (255 registers and spills with ptxas -v; 173 without).
        z = it >> 30
        if STAGES == 0:
            # No staging: this tile's rows straight into registers, then converted into the bf16 chunks (half the
            # shared memory, so two programs share an SM and overlap each other's loads).
            k0, k1, k2, k3, kpe, c0, c1, c2, c3, valid = _load_tile(kv8_ptr, kvs_ptr, kvr_ptr, irow, n0, end,
                                                                    LD_NOPE, LD_ROPE, ROW)
            kc_s.index(z + 0).store(k0.to(gl.bfloat16))
            kc_s.index(z + 1).store(k1.to(gl.bfloat16))
            kc_s.index(z + 2).store(k2.to(gl.bfloat16))
            kc_s.index(z + 3).store(k3.to(gl.bfloat16))
            kpe_s.index(z).store(kpe)
        else:
            stg = it % STAGES
            if STAGES > 1:
                # the stage read in the previous iteration is free (barrier at its end): refill it
                nxt = (it + STAGES - 1) % STAGES
                _issue_tile(kv8_ptr, kvr_ptr, irow, n0 + (STAGES - 1) * 64, end, nope_st.index(nxt),
                            rope_st.index(nxt), CP_NOPE, LD_ROPE)
                cp.commit_group()
                cp.wait_group(STAGES - 1)
            else:
                _issue_tile(kv8_ptr, kvr_ptr, irow, n0, end, nope_st.index(0), rope_st.index(0), CP_NOPE, LD_ROPE)
                cp.commit_group()
                cp.wait_group(0)
            gl.thread_barrier()
            nst = nope_st.index(stg)
            kc_s.index(z + 0).store(nst.slice(0, 128, dim=1).load(LD_NOPE).to(gl.bfloat16))
            kc_s.index(z + 1).store(nst.slice(128, 128, dim=1).load(LD_NOPE).to(gl.bfloat16))
            kc_s.index(z + 2).store(nst.slice(256, 128, dim=1).load(LD_NOPE).to(gl.bfloat16))
            kc_s.index(z + 3).store(nst.slice(384, 128, dim=1).load(LD_NOPE).to(gl.bfloat16))
            kpe_s.index(z).store(rope_st.index(stg).load(LD_ROPE))
            c0 = d0
            c1 = d1
            c2 = d2
            c3 = d3
            valid = rv
            d0, d1, d2, d3, rv = _load_scales(kvs_ptr, irow, n0 + 64, end, ROW)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(kpe_s.index(z), qpe_s.index(z).permute([1, 0]), zs)
        s += warpgroup_mma(kc_s.index(z + 0), q_s.index(z + 0).permute([1, 0]), zs) * gl.expand_dims(c0, 1)
        s += warpgroup_mma(kc_s.index(z + 1), q_s.index(z + 1).permute([1, 0]), zs) * gl.expand_dims(c1, 1)
        s += warpgroup_mma(kc_s.index(z + 2), q_s.index(z + 2).permute([1, 0]), zs) * gl.expand_dims(c2, 1)
        s += warpgroup_mma(kc_s.index(z + 3), q_s.index(z + 3).permute([1, 0]), zs) * gl.expand_dims(c3, 1)
        s = gl.where(gl.expand_dims(valid, 1), s * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_s.index(z + 0).store((p * gl.expand_dims(c0, 1)).to(gl.bfloat16))
        p_s.index(z + 1).store((p * gl.expand_dims(c1, 1)).to(gl.bfloat16))
        p_s.index(z + 2).store((p * gl.expand_dims(c2, 1)).to(gl.bfloat16))
        p_s.index(z + 3).store((p * gl.expand_dims(c3, 1)).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        al = gl.expand_dims(alpha, 0)
        acc0 = warpgroup_mma(kc_s.index(z + 0).permute([1, 0]), p_s.index(z + 0), acc0 * al)
        acc1 = warpgroup_mma(kc_s.index(z + 1).permute([1, 0]), p_s.index(z + 1), acc1 * al)
        acc2 = warpgroup_mma(kc_s.index(z + 2).permute([1, 0]), p_s.index(z + 2), acc2 * al)
        acc3 = warpgroup_mma(kc_s.index(z + 3).permute([1, 0]), p_s.index(z + 3), acc3 * al)
        gl.thread_barrier()
    if STAGES > 0:
        cp.wait_group(0)
    _gdc_trigger(GDC)

    _store_split(acc0, acc1, acc2, acc3, m_i, l_i, t, hb, sp, H, SPLITS, o_ptr, stride_ot, stride_oh, lse_ptr,
                 stride_lt, mo_ptr, ml_ptr, SPLIT_OUT, BLOCK_H, MMA)


@gluon.jit
def _ws_slots(irow, n0, end, RW: gl.constexpr):
    # A tile's 64 selected slots (−1 past `end`), one per row of the loader's layout.
    offs = n0 + gl.arange(0, 64, layout=RW)
    return gl.load(irow + offs, mask=offs < end, other=-1)


# Dequantisation of one 32-bit word (four e4m3 lanes) with the token's scale, as FlashMLA's sm90 sparse decode does
# it (``cvt_fp8x8_bf16x8``, csrc/sm90/decode/sparse_fp8/components/dequant.h): e4m3 → fp32 (exact, through f16x2),
# paired into bf16x2 (exact: e4m3 fits bf16), times the scale rounded to bf16 ($3: bf16x2 [scale, scale]): exact but
# for the product's rounding with power-of-two (ue8m0) scales; other fp32 scales are rounded to bf16 first, the same
# for all 128 lanes of a chunk, as in FlashMLA. Out: two bf16x2 words, lanes (0, 1) and (2, 3). NaN codes stay NaN.
_DEQUANT_WORD = gl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b, p0, p1;
.reg .f16 x0, x1, x2, x3;
.reg .f32 f0, f1, f2, f3;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mov.b32 {x0, x1}, a;
mov.b32 {x2, x3}, b;
cvt.f32.f16 f0, x0;
cvt.f32.f16 f1, x1;
cvt.f32.f16 f2, x2;
cvt.f32.f16 f3, x3;
cvt.rn.bf16x2.f32 p0, f1, f0;
cvt.rn.bf16x2.f32 p1, f3, f2;
mul.rn.bf16x2 $0, p0, $3;
mul.rn.bf16x2 $1, p1, $3;
}""")


@gluon.jit
def _dequant_store(words, scale, dst):
    # words [64, 32] int32 (a row's 128 e4m3 lanes), scale [64] fp32 (the loader's row layout) → dst, a [64, 128]
    # bf16 wgmma-swizzled chunk, written as [64, 64] int32 (bf16 pairs: the same bytes under the same 128-byte swizzle).
    s16 = scale.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    lo, hi = gl.inline_asm_elementwise(_DEQUANT_WORD, "=r,=r,r,r", [words, gl.expand_dims(s16 * 0x10001, 1)],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    pairs = gl.reshape(gl.join(lo, hi), [64, 64])
    dst._reinterpret(gl.int32, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.int32)).store(pairs)


@gluon.jit
def _ws_load(kv8_ptr, kvs_ptr, kvr_ptr, irow, start, end, n_tiles, kc_s, kpe_s, bias_s, full, empty,
             W: gl.constexpr, P: gl.constexpr, PW: gl.constexpr, EVICT_FIRST: gl.constexpr):
    # Loader partition W of P (PW warps): tiles W, W + P, … of this split (tile j uses stage j % 2). A 656-byte row
    # is read as 32-bit words (the three views of the cache, 164 words a row): four chunks of 32 words (128 e4m3
    # lanes each), the four fp32 scales at word 128 and the rope lanes' bf16 pairs at word 132. A tile's rows are
    # loaded into registers before the wait for its stage, so the gather is in flight while the MMA partitions work
    # on the other stage, and the next tile's slots are read meanwhile; then each chunk is dequantised (``_dequant_store``) into a wgmma-swizzled [64, 128] bf16 chunk, the
    # rope lanes and a 0 / −inf row bias are stored, and the stage is signalled on `full`.
    # EVICT_FIRST marks the row loads evict_first (L1 and L2); the host sets it for long per-program loops
    # (``_sparse_mla._ws_launch``: faster there, slower at B = 1). `.cg` was 4–7 % slower, evict_last in between.
    EVICT: gl.constexpr = "evict_first" if EVICT_FIRST else ""
    LD: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [PW, 1], [1, 0])
    RW: gl.constexpr = gl.SliceLayout(1, LD)
    KPE_W: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 32], gl.int32)
    kw_ptr = kv8_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    kr_ptr = kvr_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    cols = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LD)), 0)
    idx = _ws_slots(irow, start + W * 64, end, RW)
    for j in range(W, n_tiles, P):
        st = j % 2
        kb = st * 4
        ok = idx >= 0
        row = gl.where(ok, idx, 0).to(gl.int64) * 164
        okc = gl.expand_dims(ok, 1)
        base = gl.expand_dims(row, 1) + cols
        k0 = gl.load(kw_ptr + base, mask=okc, other=0, eviction_policy=EVICT)
        k1 = gl.load(kw_ptr + base + 32, mask=okc, other=0, eviction_policy=EVICT)
        k2 = gl.load(kw_ptr + base + 64, mask=okc, other=0, eviction_policy=EVICT)
        k3 = gl.load(kw_ptr + base + 96, mask=okc, other=0, eviction_policy=EVICT)
        kpe = gl.load(kr_ptr + base + 132, mask=okc, other=0, eviction_policy=EVICT)
        c0 = gl.load(kvs_ptr + row + 128, mask=ok, other=0.0)
        c1 = gl.load(kvs_ptr + row + 129, mask=ok, other=0.0)
        c2 = gl.load(kvs_ptr + row + 130, mask=ok, other=0.0)
        c3 = gl.load(kvs_ptr + row + 131, mask=ok, other=0.0)
        bias = gl.where(ok, 0.0, float("-inf"))
        idx = _ws_slots(irow, start + (j + P) * 64, end, RW)
        mbarrier.wait(empty.index(st), ((j // 2) & 1) ^ 1)
        _dequant_store(k0, c0, kc_s.index(kb + 0))
        _dequant_store(k1, c1, kc_s.index(kb + 1))
        _dequant_store(k2, c2, kc_s.index(kb + 2))
        _dequant_store(k3, c3, kc_s.index(kb + 3))
        kpe_s.index(st)._reinterpret(gl.int32, [64, 32], KPE_W).store(kpe)
        bias_s.index(st).store(bias)
        fence_async_shared()
        mbarrier.arrive(full.index(st), count=1)


@gluon.jit
def _ws_mma(q_ptr, stride_qt, stride_qh, q_s, qpe_s, kc_s, kpe_s, bias_s, p_s, full, empty, n_tiles, qk_scale_log2,
            o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp, H, SPLITS,
            SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, GDC: gl.constexpr):
    # MMA partition (the default one; 4 warps, or 8 splitting the heads): per staged tile, Sᵀ = K·Qᵀ as five chained
    # asynchronous wgmmas (the scales are already in K), online softmax over tokens, Pᵀ to shared memory, Oᵀ_g += K_gᵀ·Pᵀ,
    # then the stage goes back to the loaders on `empty`. The query is read here, so the loaders' first gathers
    # overlap it; the softmax denominator is summed per element and reduced over tokens once, at the end.
    _query_to_smem(q_ptr, stride_qt, stride_qh, t, hb, H, q_s, qpe_s, BLOCK_H)
    fence_async_shared()
    gl.thread_barrier()
    WG: gl.constexpr = gl.num_warps() // 4
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BLOCK_H // WG, 16])
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=COL)
    l_acc = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
    acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=MMA)
    zs = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
    for it in range(n_tiles):
        st = it % 2
        kb = st * 4
        mbarrier.wait(full.index(st), (it // 2) & 1)
        s = warpgroup_mma(kpe_s.index(st), qpe_s.index(0).permute([1, 0]), zs, is_async=True)
        s = warpgroup_mma(kc_s.index(kb + 0), q_s.index(0).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(kc_s.index(kb + 1), q_s.index(1).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(kc_s.index(kb + 2), q_s.index(2).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(kc_s.index(kb + 3), q_s.index(3).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        bias = bias_s.index(st).load(ROW)
        s = s * qk_scale_log2 + gl.expand_dims(bias, 1)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        al = gl.expand_dims(alpha, 0)
        l_acc = l_acc * al + p
        m_i = m_new
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc0 = warpgroup_mma(kc_s.index(kb + 0).permute([1, 0]), p_s, acc0 * al, is_async=True)
        acc1 = warpgroup_mma(kc_s.index(kb + 1).permute([1, 0]), p_s, acc1 * al, is_async=True)
        acc2 = warpgroup_mma(kc_s.index(kb + 2).permute([1, 0]), p_s, acc2 * al, is_async=True)
        acc3 = warpgroup_mma(kc_s.index(kb + 3).permute([1, 0]), p_s, acc3 * al, is_async=True)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st), count=1)

    _gdc_trigger(GDC)
    l_i = gl.sum(l_acc, axis=0)
    _store_split(acc0, acc1, acc2, acc3, m_i, l_i, t, hb, sp, H, SPLITS, o_ptr, stride_ot, stride_oh, lse_ptr,
                 stride_lt, mo_ptr, ml_ptr, SPLIT_OUT, BLOCK_H, MMA)


@gluon.jit
def _ws_mma_hm(q_ptr, stride_qt, stride_qh, q_s, qpe_s, kc_s, kpe_s, bias_s, p_s, a_s, lm_s, full, empty, pfull, pempty,
               fin, n_tiles, qk_scale_log2, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp,
               H, SPLITS, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, GDC: gl.constexpr):
    # Heads as wgmma's M (gluon 7, 64-head blocks), the first of two 4-warp MMA partitions. Per staged tile:
    # S[heads, tokens] = Q·Kᵀ (Q the shared-memory A operand, the tile its natural K-major B operand), the online
    # softmax along the tile's tokens (a reduction inside each warp: a head's 64 scores sit in one quad of threads),
    # P and the rescale handed to the second partition through shared memory (``_ws_pv_hm``: it waits on `pfull` and
    # frees the buffer on `pempty`), then O[heads, 0:256] += P·V with P straight from registers as the A operand.
    # Both partitions release the stage. At the end l and m go to the second partition (`fin`).
    _query_to_smem(q_ptr, stride_qt, stride_qh, t, hb, H, q_s, qpe_s, BLOCK_H)
    fence_async_shared()
    gl.thread_barrier()
    MS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MO, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, MS)
    COL_S: gl.constexpr = gl.SliceLayout(0, MS)
    ROW_O: gl.constexpr = gl.SliceLayout(1, MO)
    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW_S)
    o0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MO)
    o1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MO)
    zs = gl.zeros([BLOCK_H, 64], gl.float32, layout=MS)
    for it in range(n_tiles):
        st = it % 2
        kb = st * 4
        mbarrier.wait(full.index(st), (it // 2) & 1)
        s = warpgroup_mma(qpe_s.index(0), kpe_s.index(st).permute([1, 0]), zs, is_async=True)
        s = warpgroup_mma(q_s.index(0), kc_s.index(kb + 0).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(q_s.index(1), kc_s.index(kb + 1).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(q_s.index(2), kc_s.index(kb + 2).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma(q_s.index(3), kc_s.index(kb + 3).permute([1, 0]), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        bias = bias_s.index(st).load(COL_S)
        s = s * qk_scale_log2 + gl.expand_dims(bias, 0)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        pb = p.to(gl.bfloat16)
        mbarrier.wait(pempty, (it & 1) ^ 1)
        p_s.store(pb)
        a_s.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pfull, count=1)
        pa = gl.convert_layout(pb, PA)
        al = gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        o0 = warpgroup_mma(pa, kc_s.index(kb + 0), o0 * al, is_async=True)
        o1 = warpgroup_mma(pa, kc_s.index(kb + 1), o1 * al, is_async=True)
        o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st), count=1)

    _gdc_trigger(GDC)
    lm_s.index(0).store(l_i)
    lm_s.index(1).store(m_i)
    gl.thread_barrier()
    mbarrier.arrive(fin, count=1)
    _store_hm(o0, o1, gl.convert_layout(l_i, ROW_O), gl.convert_layout(m_i, ROW_O), t, hb, sp, H, SPLITS, o_ptr,
              stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, SPLIT_OUT, BLOCK_H, 0, MO)


@gluon.jit
def _ws_pv_hm(kc_s, empty, n_tiles, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp, H,
              SPLITS, p_s, a_s, lm_s, pfull, pempty, fin, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr,
              GDC: gl.constexpr):
    # The second MMA partition of gluon 7: O[heads, 256:512] += P·V per tile, from the P (the shared-memory A
    # operand) and rescale that ``_ws_mma_hm`` leaves each tile; l and m come from it at the end.
    MO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    ROW_O: gl.constexpr = gl.SliceLayout(1, MO)
    o0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MO)
    o1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MO)
    for it in range(n_tiles):
        st = it % 2
        kb = st * 4
        mbarrier.wait(pfull, it & 1)
        al = gl.expand_dims(a_s.load(ROW_O), 1)
        o0 = warpgroup_mma(p_s, kc_s.index(kb + 2), o0 * al, is_async=True)
        o1 = warpgroup_mma(p_s, kc_s.index(kb + 3), o1 * al, is_async=True)
        o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
        gl.thread_barrier()
        mbarrier.arrive(pempty, count=1)
        mbarrier.arrive(empty.index(st), count=1)
    _gdc_trigger(GDC)
    mbarrier.wait(fin, 0)
    _store_hm(o0, o1, lm_s.index(0).load(ROW_O), lm_s.index(1).load(ROW_O), t, hb, sp, H, SPLITS, o_ptr, stride_ot,
              stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, SPLIT_OUT, BLOCK_H, 1, MO)


@gluon.jit
def _store_hm(o0, o1, l_o, m_o, t, hb, sp, H, SPLITS, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr,
              SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, PART: gl.constexpr, MO: gl.constexpr):
    # Normalise and write one partition's 256 lanes (split partial + LSE, or the bf16 output + LSE; the LSE from
    # PART 0), as _store_split does with the heads on the other axis.
    ROW_O: gl.constexpr = gl.SliceLayout(1, MO)
    COL_O: gl.constexpr = gl.SliceLayout(0, MO)
    live = l_o > 0.0
    inv = gl.expand_dims(gl.where(live, 1.0 / gl.where(live, l_o, 1.0), 0.0), 1)
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    hmask = gl.expand_dims(heads < H, 1)
    lanes = gl.expand_dims(PART * 256 + gl.arange(0, 128, layout=COL_O), 0)
    LN2: gl.constexpr = 0.6931471805599453
    if SPLIT_OUT:
        lse = gl.where(live, (m_o + gl.log2(gl.where(live, l_o, 1.0))) * LN2, float("-inf"))
        base = (t.to(gl.int64) * H + heads) * SPLITS + sp
        mb = mo_ptr + gl.expand_dims(base, 1) * 512 + lanes
        gl.store(mb, (o0 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        gl.store(mb + 128, (o1 * inv).to(mo_ptr.dtype.element_ty), mask=hmask)
        if PART == 0:
            gl.store(ml_ptr + base, lse, mask=heads < H)
    else:
        lse = gl.where(live, (m_o + gl.log2(gl.where(live, l_o, 1.0))) * LN2, float("inf"))
        ob = o_ptr + t.to(gl.int64) * stride_ot + gl.expand_dims(heads, 1) * stride_oh + lanes
        gl.store(ob, (o0 * inv).to(gl.bfloat16), mask=hmask)
        gl.store(ob + 128, (o1 * inv).to(gl.bfloat16), mask=hmask)
        if PART == 0:
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + heads, lse, mask=heads < H)


@gluon.jit
def _grid_barrier(bar_ptr, first, n_programs, MAX_POLLS: gl.constexpr):
    # Every program of the grid arrives here; returns True once all have (False after MAX_POLLS polls, a grid that
    # is not co-resident). The counting is CUDA cooperative groups' grid sync (CUDA 12 ``cooperative_groups``
    # ``details/sync.h``): program 0 adds 2^31 − (n − 1), the others 1, so the counter's top bit flips exactly when the
    # last one arrives and its low 31 bits come back to where they were (0: the host zeroes it once). One thread per
    # program makes the acq_rel arrival (Triton issues a scalar atomic from one thread) after a CTA barrier, so the
    # program's partial-output stores are released with it; the polls are acquire loads.
    gl.thread_barrier()
    inc = gl.where(first, 2147483647 - n_programs + 2, 1)
    old = gl.atomic_add(bar_ptr, inc, sem="acq_rel", scope="gpu")
    cur = old
    polls = 0
    while ((cur ^ old) >= 0) & (polls < MAX_POLLS):
        cur = gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    gl.thread_barrier()
    return (cur ^ old) < 0


@gluon.constexpr_function
def _merge_layout(dl, num_warps):
    # [splits, 16 heads, dl lanes] spread so that each thread loads 4 consecutive lanes (16 bytes) of one partial
    # row: lanes first, then heads, then splits, over threads and then warps.
    td = min(32, dl // 4)
    th = min(32 // td, 16)
    wh = min(num_warps, max(1, 16 // th))
    return gl.BlockedLayout([1, 1, 4], [32 // (td * th), th, td], [num_warps // wh, wh, 1], [2, 1, 0])


@gluon.jit
def _merge_splits(mo_ptr, ml_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, hb, sp, H, SPLITS, ok,
                  BLOCK_H: gl.constexpr, S_P2: gl.constexpr, DL: gl.constexpr):
    # The flash-decoding LSE merge of `_combine_kernel`, done by the split programs themselves after the grid
    # barrier: split program `sp` of (row t, head block hb) merges lanes [sp·DL, sp·DL + DL) of the block's heads over
    # all SPLITS partials, 16 heads per loop step ([S_P2, 16, DL] values, S_P2 · DL ≤ 1024); the sp = 0 program also
    # writes the LSE. The code is kept short on purpose (a loop, one LSE per (split, head), 16-byte partial loads):
    # straight-line merge code, run once per program, measured 5–50 µs on the H200, fetching its instructions cold.
    # `ok` False (this program's barrier wait timed out) gives NaN in its lanes of o (and in lse from sp = 0). The
    # partials come from other programs: read through L2 (.cg).
    L3: gl.constexpr = _merge_layout(DL, gl.num_warps())
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    LO: gl.constexpr = gl.SliceLayout(0, L3)
    s = gl.expand_dims(gl.arange(0, S_P2, layout=gl.SliceLayout(1, LS)), 1)
    hl = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LS)), 0)
    ho = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, LO)), 1)
    d = sp * DL + gl.expand_dims(gl.arange(0, DL, layout=gl.SliceLayout(0, LO)), 0)
    for hh in range(0, BLOCK_H, 16):
        h = hb * BLOCK_H + hh + hl
        rows = (t.to(gl.int64) * H + h) * SPLITS + s
        lj = gl.load(ml_ptr + rows, mask=(s < SPLITS) & (h < H), other=float("-inf"), cache_modifier=".cg")
        mx = gl.max(lj, axis=0)
        live = mx > float("-inf")
        msafe = gl.where(live, mx, 0.0)
        w = gl.where(lj > float("-inf"), gl.exp(lj - gl.expand_dims(msafe, 0)), 0.0)
        wsum = gl.sum(w, axis=0)
        hout = hb * BLOCK_H + hh + ho
        omask = (hout < H) & (d < 512)
        parts = gl.load(mo_ptr + gl.expand_dims(rows, 2) * 512 + gl.expand_dims(d, 0),
                        mask=gl.expand_dims((s < SPLITS) & (h < H), 2) & gl.expand_dims(d < 512, 0), other=0.0,
                        cache_modifier=".cg").to(gl.float32)
        inv = gl.where(live, 1.0 / gl.where(live, wsum, 1.0), 0.0)
        o = gl.sum(parts * gl.expand_dims(w, 2), axis=0) * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, LO)), 1)
        o = gl.where(ok, o, float("nan"))
        gl.store(o_ptr + t.to(gl.int64) * stride_ot + hout * stride_oh + d, o.to(gl.bfloat16), mask=omask)
        lse = gl.where(live, msafe + gl.log(gl.where(live, wsum, 1.0)), float("inf"))
        lse = gl.where(ok, lse, float("nan"))
        hs = hb * BLOCK_H + hh + gl.arange(0, 16, layout=gl.SliceLayout(0, LS))
        gl.store(lse_ptr + t.to(gl.int64) * stride_lt + hs, lse, mask=(hs < H) & (sp == 0))


@gluon.jit
def _decode_fp8_ws_kernel(
    q_ptr, stride_qt, stride_qh,
    kv8_ptr, kvs_ptr, kvr_ptr,
    idx_ptr, stride_it, len_ptr,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr,
    H, K, qk_scale_log2, SPLITS,
    HAS_LEN: gl.constexpr, SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, LOADERS: gl.constexpr,
    LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, GDC: gl.constexpr,
    bar_ptr=None, MERGE: gl.constexpr = False, MERGE_S_P2: gl.constexpr = 2, MERGE_DL: gl.constexpr = 256,
    HM: gl.constexpr = False, MMA_REGS: gl.constexpr = 168, EVICT_FIRST: gl.constexpr = False,
):
    KC_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    KPE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
    QPE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_H], gl.bfloat16)
    B_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    t = gl.program_id(0)
    hb = gl.program_id(1)
    sp = gl.program_id(2)
    _gdc_enter(GDC)

    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
    qpe_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, 64], QPE_SL)
    kc_s = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 128], KC_SL)
    kpe_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], KPE_SL)
    bias_s = gl.allocate_shared_memory(gl.float32, [2, 64], B_SL)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if HM:  # two MMA partitions release each stage; P, its rescale and the final l, m go from one to the other
        for i in gl.static_range(2):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        ph_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16))
        a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], B_SL)
        lm_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], B_SL)
        hbar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(3):
            mbarrier.init(hbar.index(i), count=1)
    else:
        p_s = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_H], P_SL)
        for i in gl.static_range(2):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    start, end, n_tiles = _split_range(K, len_ptr, t, sp, SPLITS, HAS_LEN)
    irow = idx_ptr + t.to(gl.int64) * stride_it

    if HM:
        gl.warp_specialize([
            (_ws_mma_hm, (q_ptr, stride_qt, stride_qh, q_s, qpe_s, kc_s, kpe_s, bias_s, ph_s, a_s, lm_s, full, empty,
                          hbar.index(0), hbar.index(1), hbar.index(2), n_tiles, qk_scale_log2, o_ptr, stride_ot,
                          stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp, H, SPLITS, SPLIT_OUT, BLOCK_H, GDC)),
            (_ws_pv_hm, (kc_s, empty, n_tiles, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb,
                         sp, H, SPLITS, ph_s, a_s, lm_s, hbar.index(0), hbar.index(1), hbar.index(2), SPLIT_OUT,
                         BLOCK_H, GDC)),
            (_ws_load, (kv8_ptr, kvs_ptr, kvr_ptr, irow, start, end, n_tiles, kc_s, kpe_s, bias_s, full, empty,
                        0, 1, LOADER_WARPS, EVICT_FIRST)),
        ], [4, LOADER_WARPS], [MMA_REGS, LOADER_REGS])
    elif LOADERS == 1:
        gl.warp_specialize([
            (_ws_mma, (q_ptr, stride_qt, stride_qh, q_s, qpe_s, kc_s, kpe_s, bias_s, p_s, full, empty, n_tiles, qk_scale_log2,
                       o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp, H, SPLITS,
                       SPLIT_OUT, BLOCK_H, GDC)),
            (_ws_load, (kv8_ptr, kvs_ptr, kvr_ptr, irow, start, end, n_tiles, kc_s, kpe_s, bias_s, full, empty,
                        0, 1, LOADER_WARPS, EVICT_FIRST)),
        ], [LOADER_WARPS], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_ws_mma, (q_ptr, stride_qt, stride_qh, q_s, qpe_s, kc_s, kpe_s, bias_s, p_s, full, empty, n_tiles, qk_scale_log2,
                       o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, mo_ptr, ml_ptr, t, hb, sp, H, SPLITS,
                       SPLIT_OUT, BLOCK_H, GDC)),
            (_ws_load, (kv8_ptr, kvs_ptr, kvr_ptr, irow, start, end, n_tiles, kc_s, kpe_s, bias_s, full, empty,
                        0, 2, LOADER_WARPS, EVICT_FIRST)),
            (_ws_load, (kv8_ptr, kvs_ptr, kvr_ptr, irow, start, end, n_tiles, kc_s, kpe_s, bias_s, full, empty,
                        1, 2, LOADER_WARPS, EVICT_FIRST)),
        ], [LOADER_WARPS, LOADER_WARPS], [LOADER_REGS, LOADER_REGS])
    if MERGE:
        # The split programs merge their own partials (one launch instead of two; needs the whole grid resident:
        # the host launches it cooperatively). Under PDL the next grid on this stream may already be resident, but
        # its programs wait (_gdc_enter) for this grid to complete before they touch the barrier counter.
        first = (t == 0) & (hb == 0) & (sp == 0)
        n_programs = gl.num_programs(0) * gl.num_programs(1) * gl.num_programs(2)
        ok = _grid_barrier(bar_ptr, first, n_programs, 1 << 22)
        _merge_splits(mo_ptr, ml_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, t, hb, sp, H, SPLITS, ok,
                      BLOCK_H, MERGE_S_P2, MERGE_DL)
