"""Triton kernels of the lightning indexer (imported lazily by ``_indexer``; see its docstring for the design).

Keys for the top-k: an fp32 logit's bits ``i`` map to the order-preserving signed key ``i ^ ((i >> 31) & 0x7fffffff)``
(negative floats get their magnitude bits flipped). The radix select runs on the key high bits first: the top
byte (offset by 128 to be non-negative, a 256-bin histogram: ``_topk_hist_kernel`` pass 0, or the logits kernel
as it writes the logits), then four 6-bit digits (64-bin histograms, ``_topk_hist_kernel`` passes 1–4) over the keys that match the digits
chosen so far, accumulated by many programs per row with global atomics. Digit widths follow the cost of
``tl.histogram`` on sm_90 (Triton 3.6 lowers it to one warp vote per bit plus a population count per bin a lane
owns; counted in the PTX: 256 bins ≈ 2.5 warp instructions per key, 64 bins ≈ 0.6, so the 6-bit passes stay
memory-bound while the earlier 8-bit passes were issue-bound at ~25 µs per 8 MB of logits on an H200). Grids:
``(B, R)`` with R fixed by the SM count and B, never by the context length.
"""

import triton
import triton.language as tl


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, stride_bt, seqlen_ptr, logits_ptr, stride_lg, hist_ptr,
    B, NUM_PROGS,
    BLOCK_B: tl.constexpr,
    PAGES: tl.constexpr,
    HIST: tl.constexpr,
):
    # Persistent: every program derives the same work list from seq_lens (no host sync, no extra launch):
    # p_b = ceil(L_b / 64) pages, runs of seg ≈ Σ p_b / (NUM_PROGS − B) pages (a multiple of PAGES), n_b runs per
    # request; program p walks runs p, p + NUM_PROGS, ... Tokens are the MMA's M dimension:
    # s[tok, head] = k8[tok] · q8[head] with q8ᵀ as the (shared-memory) B operand, so the ReLU·w head-sum is a
    # reduction inside each warp's rows, and each page's 8 KB of keys is one contiguous pipelined copy. With
    # HIST, the top-k's first radix pass (256-bin histogram of the keys' high byte) is counted here too.
    pid = tl.program_id(0)
    jb = tl.arange(0, BLOCK_B)
    lens = tl.maximum(tl.load(seqlen_ptr + jb, mask=jb < B, other=0), 0)
    pages = tl.cdiv(lens, 64)
    # Σ ceil(p_b / seg) ≤ Σ p_b / seg + B: sizing runs for NUM_PROGS − B programs keeps every run in the first
    # wave (a few runs over NUM_PROGS would each cost a second full run's time).
    denom = tl.maximum(NUM_PROGS - B, NUM_PROGS // 2)
    seg = tl.cdiv(tl.cdiv(tl.sum(pages, 0), denom), PAGES) * PAGES
    seg = tl.maximum(seg, PAGES)
    runs = tl.cdiv(pages, seg)
    cu_incl = tl.cumsum(runs, 0)
    cu_excl = cu_incl - runs
    total = tl.sum(runs, 0)
    hh = tl.arange(0, 64)
    dd = tl.arange(0, 128)
    tok = tl.arange(0, 64 * PAGES)
    slot = tok % 64
    for w in range(pid, total, NUM_PROGS):
        b = tl.sum((cu_incl <= w).to(tl.int32), 0)
        sel = jb == b
        i = w - tl.sum(tl.where(sel, cu_excl, 0), 0)
        seq = tl.sum(tl.where(sel, lens, 0), 0)
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
def _pick_digit(hist_ptr, need, NB: tl.constexpr):
    # Largest digit d with #(keys with digit >= d) >= need; returns (d, need minus the keys strictly above d).
    bins = tl.arange(0, NB)
    h = tl.load(hist_ptr + bins)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    at = tl.sum(tl.where(bins == d, suffix, 0), 0)
    hd = tl.sum(tl.where(bins == d, h, 0), 0)
    return d, need - (at - hd)


@triton.jit
def _threshold(hist_ptr, HB, PASSES: tl.constexpr, TOPK: tl.constexpr):
    # Key prefix (and the count still needed among keys equal to it) from the histograms of passes < PASSES:
    # pass 0 is the 8-bit top byte, pass p ≥ 1 the 6-bit digit at bits [24 − 6p, 30 − 6p).
    # hist_ptr points at this row's pass-0 histogram; pass p's is p·HB elements further.
    need = tl.full([], TOPK, dtype=tl.int32)
    thr = tl.zeros([], dtype=tl.int32)
    if PASSES >= 1:
        d, need = _pick_digit(hist_ptr, need, 256)
        thr = (d - 128) << 24
    if PASSES >= 2:
        d, need = _pick_digit(hist_ptr + HB, need, 64)
        thr = thr | (d << 18)
    if PASSES >= 3:
        d, need = _pick_digit(hist_ptr + 2 * HB, need, 64)
        thr = thr | (d << 12)
    if PASSES >= 4:
        d, need = _pick_digit(hist_ptr + 3 * HB, need, 64)
        thr = thr | (d << 6)
    if PASSES >= 5:
        d, need = _pick_digit(hist_ptr + 4 * HB, need, 64)
        thr = thr | d
    return thr, need


@triton.jit
def _topk_hist_kernel(
    logits_ptr, stride_lg, seqlen_ptr, hist_ptr, HB,
    PASS: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
):
    # Pass PASS of the radix select over this program's segment of row b: pass 0 a 256-bin histogram of the
    # key's top byte, pass p ≥ 1 a 64-bin histogram of the 6-bit digit at bits [24 − 6p, 30 − 6p), counting only
    # keys whose higher bits equal the prefix picked by the earlier passes.
    b = tl.program_id(0)
    r = tl.program_id(1)
    nr = tl.num_programs(1)
    seq = tl.load(seqlen_ptr + b)
    NB: tl.constexpr = 256 if PASS == 0 else 64
    SH: tl.constexpr = 24 if PASS == 0 else 24 - 6 * PASS  # the digit's lowest bit; bits above it are the prefix
    if seq > TOPK:
        b64 = b.to(tl.int64)
        hrow = hist_ptr + b64 * 256
        thr, need = _threshold(hrow, HB, PASS, TOPK)
        seg = tl.cdiv(tl.cdiv(seq, nr), BLOCK) * BLOCK
        lo = r * seg
        hi = tl.minimum(lo + seg, seq)
        offs = tl.arange(0, BLOCK)
        hist = tl.zeros([NB], dtype=tl.int32)
        nomatch = tl.zeros([], dtype=tl.int32)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + offs
            inb = n < hi
            ks = _key(tl.load(logits_ptr + b64 * stride_lg + n, mask=inb, other=0.0))
            if PASS == 0:
                dig = (ks >> 24) + 128
                match = inb
            else:
                dig = (ks >> SH) & 63
                match = inb & ((ks >> (SH + 6)) == (thr >> (SH + 6)))
            hist += tl.histogram(tl.where(match, dig, 0), NB)
            nomatch += BLOCK - tl.sum(match.to(tl.int32), 0)
        bins = tl.arange(0, NB)
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
        thr, need = _threshold(hist_ptr + b64 * 256, HB, 5, TOPK)
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
            tl.store(orow + dst, val, mask=sel & (dst >= 0) & (dst < TOPK))  # in bounds even if fed stale counts
