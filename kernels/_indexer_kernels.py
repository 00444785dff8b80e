"""Triton kernels of the lightning indexer (imported lazily by ``_indexer``; see its docstring for the design).

Keys for the top-k: an fp32 logit's bits ``i`` map to the order-preserving signed key ``i ^ ((i >> 31) & 0x7fffffff)``
(negative floats get their magnitude bits flipped). The radix select runs on the key's four bytes, high
byte first (offset by 128 to be non-negative), each pass a 256-bin ``tl.histogram`` over the keys that match
the bytes chosen so far, accumulated by many programs per row with global atomics. (A first version used three
11-bit digits with 2048-bin histograms: on an H200 its top-k took ~38 µs for one 8K row, i.e. ~9 µs per pass;
our unverified reading is that Triton's histogram lowering costs grow with the bin count.) Grids: ``(B, R)`` with R fixed by the SM count and B, never by the context length.
"""

import triton
import triton.language as tl


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, stride_bt, seqlen_ptr, cu_ptr, seg_ptr, logits_ptr, stride_lg, hist_ptr,
    B, NUM_PROGS,
    BLOCK_B: tl.constexpr,
    PAGES: tl.constexpr,
    HIST: tl.constexpr,
):
    # Persistent: program p walks work items p, p + NUM_PROGS, ... < cu[B]; item w is the run of up to `seg`
    # 64-token pages number i = w − cu[b] of request b (seg = ceil(Σ pages / NUM_PROGS), computed on the device).
    # Tokens are the MMA's M dimension: s[tok, head] = k8[tok] · q8[head] with q8ᵀ as the (shared-memory) B
    # operand, so the ReLU·w head-sum is a reduction inside each warp's rows, and each page's 8 KB of keys is one
    # contiguous pipelined copy. With HIST, the top-k's first radix pass (256-bin histogram of the keys' high
    # byte) is accumulated here too, saving one pass over the logits.
    pid = tl.program_id(0)
    jb = tl.arange(0, BLOCK_B)
    starts = tl.load(cu_ptr + jb, mask=jb < B, other=2147483647)
    total = tl.load(cu_ptr + B)
    seg = tl.load(seg_ptr)
    hh = tl.arange(0, 64)
    dd = tl.arange(0, 128)
    tok = tl.arange(0, 64 * PAGES)
    slot = tok % 64
    for w in range(pid, total, NUM_PROGS):
        b = tl.sum((starts <= w).to(tl.int32), 0) - 1
        i = w - tl.load(cu_ptr + b)
        seq = tl.load(seqlen_ptr + b)
        b64 = b.to(tl.int64)
        qt = tl.load(q_ptr + b64 * 8192 + hh[None, :] * 128 + dd[:, None])  # e4m3 [128, 64] = q8ᵀ
        wv = tl.load(w_ptr + b64 * 64 + hh)  # fp32 [64]
        pg0 = i * seg
        pg1 = tl.minimum(pg0 + seg, tl.cdiv(seq, 64))
        btrow = bt_ptr + b64 * stride_bt
        lrow = logits_ptr + b64 * stride_lg
        for pg in range(pg0, pg1, PAGES):
            pgs = pg + tok // 64
            inb = ((pg * 64 + tok) < seq) & (pgs < pg1)
            page = tl.load(btrow + pgs, mask=pgs < pg1, other=0).to(tl.int64)
            krow = tl.multiple_of(page * 8448 + slot * 128, 16)  # page = 64·128 B keys | 64 fp32 scales
            k = tl.load(kc_ptr + krow[:, None] + dd[None, :], mask=inb[:, None], other=0.0)  # e4m3 [64·PAGES, 128]
            ksc = tl.load(ks_ptr + page * 2112 + 2048 + slot, mask=inb, other=0.0)  # fp32 [64·PAGES]
            s = tl.dot(k, qt, out_dtype=tl.float32)  # [64·PAGES tokens, 64 heads]
            s = tl.maximum(s, 0.0) * wv[None, :]  # ReLU per head, then the head weight
            lg = tl.sum(s, 1) * ksc
            tl.store(lrow + pg * 64 + tok, lg, mask=inb)
            if HIST:
                bins = tl.arange(0, 256)
                hist = tl.histogram(tl.where(inb, (_key(lg) >> 24) + 128, 0), 256)
                hist -= tl.where(bins == 0, 64 * PAGES - tl.sum(inb.to(tl.int32), 0), 0)
                tl.atomic_add(hist_ptr + b64 * 256 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _key(x):
    i = x.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _pick_digit(hist_ptr, need):
    # Largest digit d with #(keys with digit >= d) >= need; returns (d, need minus the keys strictly above d).
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + bins)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    at = tl.sum(tl.where(bins == d, suffix, 0), 0)
    hd = tl.sum(tl.where(bins == d, h, 0), 0)
    return d, need - (at - hd)


@triton.jit
def _threshold(hist_ptr, HB, PASSES: tl.constexpr, TOPK: tl.constexpr):
    # Key prefix (and the count still needed among keys equal to it) from the histograms of passes < PASSES.
    # hist_ptr points at this row's pass-0 histogram; pass p's is p·HB elements further.
    need = tl.full([], TOPK, dtype=tl.int32)
    thr = tl.zeros([], dtype=tl.int32)
    if PASSES >= 1:
        d, need = _pick_digit(hist_ptr, need)
        thr = (d - 128) << 24
    if PASSES >= 2:
        d, need = _pick_digit(hist_ptr + HB, need)
        thr = thr | (d << 16)
    if PASSES >= 3:
        d, need = _pick_digit(hist_ptr + 2 * HB, need)
        thr = thr | (d << 8)
    if PASSES >= 4:
        d, need = _pick_digit(hist_ptr + 3 * HB, need)
        thr = thr | d
    return thr, need


@triton.jit
def _topk_hist_kernel(
    logits_ptr, stride_lg, seqlen_ptr, hist_ptr, HB,
    PASS: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
):
    # Pass PASS (0..3) of the radix select: 256-bin histogram of key byte 3 − PASS over this program's segment
    # of row b, counting only keys whose higher bytes equal the prefix picked from passes < PASS.
    b = tl.program_id(0)
    r = tl.program_id(1)
    nr = tl.num_programs(1)
    seq = tl.load(seqlen_ptr + b)
    if seq > TOPK:
        b64 = b.to(tl.int64)
        hrow = hist_ptr + b64 * 256
        thr, need = _threshold(hrow, HB, PASS, TOPK)
        seg = tl.cdiv(tl.cdiv(seq, nr), BLOCK) * BLOCK
        lo = r * seg
        hi = tl.minimum(lo + seg, seq)
        offs = tl.arange(0, BLOCK)
        hist = tl.zeros([256], dtype=tl.int32)
        nomatch = tl.zeros([], dtype=tl.int32)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + offs
            inb = n < hi
            ks = _key(tl.load(logits_ptr + b64 * stride_lg + n, mask=inb, other=0.0))
            if PASS == 0:
                dig = (ks >> 24) + 128
                match = inb
            else:
                dig = (ks >> (24 - 8 * PASS)) & 255
                match = inb & ((ks >> (32 - 8 * PASS)) == (thr >> (32 - 8 * PASS)))
            hist += tl.histogram(tl.where(match, dig, 0), 256)
            nomatch += BLOCK - tl.sum(match.to(tl.int32), 0)
        bins = tl.arange(0, 256)
        hist -= tl.where(bins == 0, nomatch, 0)
        tl.atomic_add(hrow + PASS * HB + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _topk_select_kernel(
    logits_ptr, stride_lg, seqlen_ptr, hist_ptr, HB, cnt_ptr, bt_ptr, stride_bt, out_ptr, stride_o,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, PHYSICAL: tl.constexpr,
):
    # Write every key above the threshold plus the first `need` keys equal to it (slots claimed with atomics, so
    # the order inside the row, and which of several tied keys are taken, depend on scheduling).
    b = tl.program_id(0)
    r = tl.program_id(1)
    nr = tl.num_programs(1)
    b64 = b.to(tl.int64)
    seq = tl.load(seqlen_ptr + b)
    orow = out_ptr + b64 * stride_o
    offs = tl.arange(0, BLOCK)
    if seq <= TOPK:
        if r == 0:
            for j0 in tl.static_range(0, TOPK, BLOCK):
                j = j0 + offs
                inb = j < seq
                val = j
                if PHYSICAL:
                    page = tl.load(bt_ptr + b64 * stride_bt + j // 64, mask=inb, other=0)
                    val = page * 64 + j % 64
                tl.store(orow + j, tl.where(inb, val, -1), mask=j < TOPK)
    else:
        thr, need = _threshold(hist_ptr + b64 * 256, HB, 4, TOPK)
        n_gt = TOPK - need
        seg = tl.cdiv(tl.cdiv(seq, nr), BLOCK) * BLOCK
        lo = r * seg
        hi = tl.minimum(lo + seg, seq)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + offs
            inb = n < hi
            ks = _key(tl.load(logits_ptr + b64 * stride_lg + n, mask=inb, other=0.0))
            gti = (inb & (ks > thr)).to(tl.int32)
            eqi = (inb & (ks == thr)).to(tl.int32)
            ng = tl.sum(gti, 0)
            ne = tl.sum(eqi, 0)
            bg = tl.atomic_add(cnt_ptr + b64 * 2, ng, sem="relaxed")
            be = tl.atomic_add(cnt_ptr + b64 * 2 + 1, ne, sem="relaxed")
            rg = bg + tl.cumsum(gti, 0) - 1
            re = be + tl.cumsum(eqi, 0) - 1
            take_eq = (eqi > 0) & (re < need)
            sel = (gti > 0) | take_eq
            dst = tl.where(gti > 0, rg, n_gt + re)
            val = n
            if PHYSICAL:
                page = tl.load(bt_ptr + b64 * stride_bt + n // 64, mask=sel, other=0)
                val = page * 64 + n % 64
            tl.store(orow + dst, val, mask=sel)
