"""Triton kernels of the lightning indexer (imported lazily by ``_indexer``; see its docstring for the design).

Keys for the top-k: an fp32 logit's bits ``i`` map to the order-preserving signed key ``i ^ ((i >> 31) & 0x7fffffff)``
(negative floats get their magnitude bits flipped). The exact top-k is a radix select, high bits first, in three
launches after the logits (``_indexer`` describes them): the top byte's histogram over the whole row, a partition
that writes the keys above the k-th key's top byte and lists those sharing it (counting their next 12 bits),
and a per-row refinement over that list alone. For continuous logits the list is the few % of keys that share
the k-th key's exponent pair; if every logit is equal (e.g. all weights zero) it is the whole row, refined in a loop
by one program: still exact, just not spread over the GPU.

Digit widths follow the cost of ``tl.histogram`` on sm_90 (Triton 3.6 lowers it to one warp vote per bit plus a
population count per bin a lane owns; counted in the PTX: 256 bins ≈ 2.5 warp instructions per key, 64 bins ≈ 0.6).
Grids: ``(B, R)`` with R fixed by the SM count and B; never by the context length.
"""

import triton
import triton.language as tl

from pdctl.kernels._gdc import _gdc_enter, _gdc_trigger


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, kc_ptr, ks_ptr, bt_ptr, stride_bt, seqlen_ptr, logits_ptr, stride_lg, ws_ptr, WS, WS_ZERO,
    B, NUM_PROGS, k_desc,
    BLOCK_B: tl.constexpr,
    PAGES: tl.constexpr,
    HIST: tl.constexpr,
    TMA: tl.constexpr,
    GDC: tl.constexpr,
):
    # Persistent: every program derives the same work list from seq_lens (no host sync, no extra launch):
    # p_b = ceil(L_b / 64) pages, runs of seg ≈ Σ p_b / (NUM_PROGS − B) pages (a multiple of PAGES), n_b runs per
    # request; program p walks runs p, p + NUM_PROGS, ... Tokens are the MMA's M dimension:
    # s[tok, head] = k8[tok] · q8[head] with q8ᵀ as the (shared-memory) B operand, so the ReLU·w head-sum is a
    # reduction inside each warp's rows, and each page's 8 KB of keys is one contiguous pipelined copy. With
    # HIST, the top-k's first radix pass (256-bin histogram of the keys' high byte) is counted here too.
    pid = tl.program_id(0)
    _gdc_enter(GDC)
    # The top-k's workspace (WS_ZERO int32, a later launch's input) is zeroed here, not by a memset launch.
    for z0 in range(pid * 256, WS_ZERO, NUM_PROGS * 256):
        zo = z0 + tl.arange(0, 256)
        tl.store(ws_ptr + zo, tl.zeros([256], dtype=tl.int32), mask=zo < WS_ZERO)
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
            if TMA:
                # One bulk tensor copy of the page's 8 KB of keys (k_desc: the cache as e4m3 rows of 128 B, 66 rows
                # a page; PAGES = 1). Tokens past L_b in the last page are read too; their logits are not stored.
                k = k_desc.load([(tl.load(btrow + pg) * 66).to(tl.int32), 0])
            else:
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
                tl.atomic_add(ws_ptr + b64 * WS + bins, hist, mask=hist > 0, sem="relaxed")
    _gdc_trigger(GDC)


@triton.jit
def _key(x):
    i = x.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _block(lrow, x, n0, offs, hi, BLOCK: tl.constexpr):
    # One step of a loop over a program's share [lo, hi) of a logits row: this block's positions, in-range mask
    # and keys (from x, loaded one step ahead), and the next block's load, issued before the caller works on this
    # block so that two blocks are in flight per program.
    n = n0 + offs
    return n, n < hi, _key(x), tl.load(lrow + n + BLOCK, mask=n + BLOCK < hi, other=0.0)


@triton.jit
def _pick(h, need, NB: tl.constexpr):
    # Largest digit d with #(keys with digit >= d) >= need, from the histogram h [NB]; returns (d, need minus the
    # keys strictly above d).
    bins = tl.arange(0, NB)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    at = tl.sum(tl.where(bins == d, suffix, 0), 0)
    hd = tl.sum(tl.where(bins == d, h, 0), 0)
    return d, need - (at - hd)


@triton.jit
def _topk_hist_kernel(logits_ptr, stride_lg, seqlen_ptr, ws_ptr, WS, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                      GDC: tl.constexpr):
    # First radix pass over this program's segment of row b: a 256-bin histogram of the keys' top byte, added
    # into the row's workspace with global atomics.
    b = tl.program_id(0)
    r = tl.program_id(1)
    _gdc_enter(GDC)
    nr = tl.num_programs(1)
    seq = tl.load(seqlen_ptr + b)
    if seq > TOPK:
        b64 = b.to(tl.int64)
        seg = tl.cdiv(tl.cdiv(seq, nr), BLOCK) * BLOCK
        lo = r * seg
        hi = tl.minimum(lo + seg, seq)
        offs = tl.arange(0, BLOCK)
        wrow = ws_ptr + b64 * WS
        lrow = logits_ptr + b64 * stride_lg
        x = tl.load(lrow + lo + offs, mask=lo + offs < hi, other=0.0)
        for n0 in range(lo, hi, BLOCK):
            n, inb, ks, x = _block(lrow, x, n0, offs, hi, BLOCK)
            _hist_block(wrow, (ks >> 24) + 128, inb, tl.minimum(hi - n0, BLOCK))
        _gdc_trigger(GDC)


@triton.jit
def _max2(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _hist_block(wrow, top, inb, n_in):
    # One block's top bytes (0..255; n_in of them in range) added into the row's 256-bin histogram at wrow, exactly.
    # Continuous logits put a block's positive keys (top >= 128) within a few top-byte steps (2 binades each) of
    # their maximum, and its negative keys likewise: a 32-bin histogram over the 16 bytes at and below each sign's
    # maximum then holds every key. That costs 5 warp votes per key instead of the 8 votes and 8 bins per lane of
    # a 256-bin `tl.histogram`; a block with a key outside both windows (e.g. an exact zero among large positive
    # logits) is counted with the 256-bin histogram instead.
    pos = top >= 128
    pmax, nmax = tl.reduce((tl.where(inb & pos, top, 0), tl.where(inb & ~pos, top, 0)), 0, _max2)
    d = tl.where(pos, pmax - top, 16 + nmax - top)
    win = inb & (d >= 0) & (d < tl.where(pos, 16, 32))
    h = tl.histogram(tl.where(win, d, 0), 32, mask=win)
    if tl.sum(h, 0) == n_in:
        j = tl.arange(0, 32)
        tl.atomic_add(wrow + tl.where(j < 16, pmax - j, nmax + 16 - j), h, mask=h > 0, sem="relaxed")
    else:
        h256 = tl.histogram(tl.where(inb, top, 0), 256, mask=inb)
        tl.atomic_add(wrow + tl.arange(0, 256), h256, mask=h256 > 0, sem="relaxed")


@triton.jit
def _slot(bt_ptr, stride_bt, b64, n, mask, PHYSICAL: tl.constexpr):
    # Logical position n of row b -> what the output holds: the physical slot (block_table[b, n // 64]·64 + n % 64)
    # or n itself.
    if PHYSICAL:
        page = tl.load(bt_ptr + b64 * stride_bt + n // 64, mask=mask, other=0)
        return page * 64 + n % 64
    else:
        return n


@triton.jit
def _topk_partition_kernel(
    logits_ptr, stride_lg, seqlen_ptr, ws_ptr, WS, cand_ptr, stride_c, CW, bt_ptr, stride_bt, out_ptr, stride_o,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, PHYSICAL: tl.constexpr, GDC: tl.constexpr,
):
    # Second launch of the top-k. With d0 the top byte of the k-th largest key (from the first pass's histogram):
    # every key whose top byte is above d0 is in the top-k and goes straight to the output (slots claimed with a
    # row counter); keys whose top byte equals d0 are candidates: output value and key appended to the row's list
    # (cand[b, 0, :] / cand[b, 1, :], CW apart), and a 4096-bin histogram of their next 12 bits is counted on the
    # way (``_topk_refine_kernel`` finishes the row).
    b = tl.program_id(0)
    r = tl.program_id(1)
    _gdc_enter(GDC)
    nr = tl.num_programs(1)
    b64 = b.to(tl.int64)
    seq = tl.load(seqlen_ptr + b)
    orow = out_ptr + b64 * stride_o
    offs = tl.arange(0, BLOCK)
    seg = tl.cdiv(tl.cdiv(seq, nr), BLOCK) * BLOCK
    lo = r * seg
    hi = tl.minimum(lo + seg, seq)
    if seq <= TOPK:
        if r == 0:
            for j0 in tl.static_range(0, TOPK, BLOCK):
                j = j0 + offs
                inb = j < seq
                val = _slot(bt_ptr, stride_bt, b64, j, inb, PHYSICAL)
                tl.store(orow + j, tl.where(inb, val, -1), mask=j < TOPK)
    elif lo < hi:  # a program with an empty share of the row exits at once: no loads, no atomics
        wrow = ws_ptr + b64 * WS
        lrow = logits_ptr + b64 * stride_lg
        crow = cand_ptr + b64 * stride_c
        d0, need0 = _pick(tl.load(wrow + tl.arange(0, 256)), TOPK, 256)
        n_gt0 = TOPK - need0  # keys with a top byte above d0: all of them are in the top-k
        if r == 0:  # for the refinement (program 0's share is never empty)
            tl.store(wrow + 259, d0)
            tl.store(wrow + 260, need0)
        if hi - lo <= BLOCK:
            # One block (every program's share when R·BLOCK ≥ L_b, e.g. L_b ≤ 8K at any B here): the keys stay in
            # registers between counting and writing, so the second load below (an L2 round trip) is not needed.
            n = lo + offs
            inb = n < hi
            ks = _key(tl.load(lrow + n, mask=inb, other=0.0))
            top = (ks >> 24) + 128
            gt = inb & (top > d0)
            eq = inb & (top == d0)
            val = _slot(bt_ptr, stride_bt, b64, n, gt | eq, PHYSICAL)  # in flight during the reservations
            tl.atomic_add(wrow + 512 + ((ks >> 12) & 4095), 1, mask=eq, sem="relaxed")
            both = gt.to(tl.int32) | (eq.to(tl.int32) << 16)  # one scan for both ranks (BLOCK < 65536)
            tot = tl.sum(both, 0)
            bg = tl.atomic_add(wrow + 256, tot & 65535, sem="relaxed")
            be = tl.atomic_add(wrow + 257, tot >> 16, sem="relaxed")
            _gdc_trigger(GDC)
            _partition_write(both, bg, be, val, ks, gt, eq, n_gt0, orow, crow, CW)
        else:
            # Two passes over the program's segment (the second mostly from L2): count, reserve output and list
            # ranges with one atomic each, then write. Atomics inside the loop would put an L2 round trip between
            # every block's load and its stores (measured on the H200: 135 µs for 8M keys with them). The
            # candidates' next 12 bits are counted into a 4096-bin histogram with one global atomic per candidate
            # (a few % of the keys, spread over many bins).
            # Counts per lane, summed once after the loop, so that the loop has no reduction across the warps.
            cnt_g = tl.zeros([BLOCK], dtype=tl.int32)
            cnt_e = tl.zeros([BLOCK], dtype=tl.int32)
            x = tl.load(lrow + lo + offs, mask=lo + offs < hi, other=0.0)
            for n0 in range(lo, hi, BLOCK):
                n, inb, ks, x = _block(lrow, x, n0, offs, hi, BLOCK)
                top = (ks >> 24) + 128
                eq = inb & (top == d0)
                cnt_g += (inb & (top > d0)).to(tl.int32)
                cnt_e += eq.to(tl.int32)
                tl.atomic_add(wrow + 512 + ((ks >> 12) & 4095), 1, mask=eq, sem="relaxed")
            ng = tl.sum(cnt_g, 0)
            ne = tl.sum(cnt_e, 0)
            bg = tl.atomic_add(wrow + 256, ng, sem="relaxed")
            be = tl.atomic_add(wrow + 257, ne, sem="relaxed")
            _gdc_trigger(GDC)
            x = tl.load(lrow + lo + offs, mask=lo + offs < hi, other=0.0)
            for n0 in range(lo, hi, BLOCK):
                n, inb, ks, x = _block(lrow, x, n0, offs, hi, BLOCK)
                top = (ks >> 24) + 128
                gt = inb & (top > d0)
                eq = inb & (top == d0)
                both = gt.to(tl.int32) | (eq.to(tl.int32) << 16)
                val = _slot(bt_ptr, stride_bt, b64, n, gt | eq, PHYSICAL)
                _partition_write(both, bg, be, val, ks, gt, eq, n_gt0, orow, crow, CW)
                tot = tl.sum(both, 0)
                bg += tot & 65535
                be += tot >> 16


@triton.jit
def _partition_write(both, bg, be, val, ks, gt, eq, n_gt0, orow, crow, CW):
    # One block of the partition's writes: keys above d0 (gt) to output slots bg + their rank, candidates (eq) to
    # the list at be + their rank, each as what the output holds (``val``: physical slot or position), so the
    # refinement never looks the block table up; ``both`` packs the two flags as the low and high 16 bits so one
    # scan ranks both.
    rank = tl.cumsum(both, 0) - both
    rg = bg + (rank & 65535)
    re = be + (rank >> 16)
    tl.store(orow + rg, val, mask=gt & (rg < n_gt0))  # bounds hold even on stale counts
    ce = eq & (re < CW)
    tl.store(crow + re, val, mask=ce)
    tl.store(crow + CW + re, ks, mask=ce)


@triton.jit
def _topk_refine_kernel(
    seqlen_ptr, ws_ptr, WS, cand_ptr, stride_c, CW, out_ptr, stride_o,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, GDC: tl.constexpr,
):
    # Third launch, (B, R) programs. The candidates' 12-bit second digit d1 comes from the partition's histogram;
    # each program takes a slice of the row's candidate list, writes those whose second digit is above d1 (all in
    # the top-k) and appends those equal to it to a short list (cand[b, 2·CW:], at most CAP), claiming slots
    # with row counters; a program whose slice is empty exits at once. The row's last program with a slice to
    # finish (an acq_rel arrival counter) resolves the remaining 12 bits over the short list held in registers, with
    # the d1 it already picked; if more than CAP candidates share d1 (heavily tied logits), by looping over the
    # full list instead.
    b = tl.program_id(0)
    r = tl.program_id(1)
    _gdc_enter(GDC)
    nr = tl.num_programs(1)
    b64 = b.to(tl.int64)
    seq = tl.load(seqlen_ptr + b)
    if seq > TOPK:
        wrow = ws_ptr + b64 * WS
        crow = cand_ptr + b64 * stride_c
        orow = out_ptr + b64 * stride_o
        d0 = tl.load(wrow + 259)
        need0 = tl.load(wrow + 260)
        n_c = tl.minimum(tl.load(wrow + 257), CW)
        sval = crow + 2 * CW
        skey = sval + CAP
        seg = tl.maximum(tl.cdiv(tl.cdiv(n_c, nr), BLOCK) * BLOCK, BLOCK)
        lo = r * seg
        # Only the programs whose slice is non-empty take part (program 0 always does); the others exit at once,
        # so the row's arrival counter sees `active` arrivals, not R.
        if lo < tl.maximum(n_c, 1):
            active = tl.maximum(tl.cdiv(n_c, seg), 1)
            hi = tl.minimum(lo + seg, n_c)
            d1, need = _pick(tl.load(wrow + 512 + tl.arange(0, 4096)), need0, 4096)
            n_gt = TOPK - need  # slots [0, n_gt) take every key above the 20-bit prefix of the k-th key
            offs = tl.arange(0, BLOCK)
            for c0 in range(lo, hi, BLOCK):
                c = c0 + offs
                m = c < hi
                ks = tl.load(crow + CW + c, mask=m, other=0)
                val = tl.load(crow + c, mask=m, other=0)  # what the output holds, loaded beside the keys
                d = (ks >> 12) & 4095
                gt = m & (d > d1)
                eq = m & (d == d1)
                both = gt.to(tl.int32) | (eq.to(tl.int32) << 16)  # one scan for both ranks (BLOCK < 65536)
                rank = tl.cumsum(both, 0) - both
                tot = tl.sum(both, 0)
                bg = tl.atomic_add(wrow + 262, tot & 65535, sem="relaxed")
                bs = tl.atomic_add(wrow + 263, tot >> 16, sem="relaxed")
                rg = TOPK - need0 + bg + (rank & 65535)  # after the keys above d0, written by the partition
                rs = bs + (rank >> 16)
                tl.store(orow + rg, val, mask=gt & (rg < n_gt))
                keep = eq & (rs < CAP)
                tl.store(sval + rs, val, mask=keep)
                tl.store(skey + rs, ks, mask=keep)
            _gdc_trigger(GDC)
            # Arrive: the barrier orders every thread's stores before the (gpu-scope, release) arrival; the last
            # arriver's acquire makes the row's short list visible to it.
            tl.debug_barrier()
            if tl.atomic_add(wrow + 258, 1, sem="acq_rel") == active - 1:
                thr = ((d0 - 128) << 24) | (d1 << 12)
                n_s = tl.atomic_add(wrow + 263, 0, sem="relaxed")
                tl.store(wrow + 261, n_s)  # for benchmarks/indexer_stages.py: how long the short list was
                if n_s <= 1024:
                    _refine_regs(sval, skey, n_s, thr, need, n_gt, orow, TOPK, 1024)
                elif n_s <= CAP:
                    _refine_regs(sval, skey, n_s, thr, need, n_gt, orow, TOPK, CAP)
                else:
                    _refine_loop(crow, crow + CW, n_c, thr, need, n_gt, orow, TOPK, BLOCK)


@triton.jit
def _refine_regs(val_ptr, key_ptr, n, thr, need, n_gt, orow, TOPK: tl.constexpr, N: tl.constexpr):
    # Exact selection of `need` keys among n ≤ N keys whose top 20 bits all equal thr's, held in registers: two
    # 6-bit digits high to low, then one write of the keys above the threshold key (slots n_gt onwards) and of the
    # first ties at it.
    c = tl.arange(0, N)
    m = c < n
    ks = tl.load(key_ptr + c, mask=m, other=0)
    val = tl.load(val_ptr + c, mask=m, other=0)
    for p in tl.static_range(0, 2):
        SH = 6 - 6 * p
        match = m & ((ks >> (SH + 6)) == (thr >> (SH + 6)))
        d, need = _pick(tl.histogram((ks >> SH) & 63, 64, mask=match), need, 64)
        thr = thr | (d << SH)
    gti = (m & (ks > thr)).to(tl.int32)
    eqi = (m & (ks == thr)).to(tl.int32)
    rg = tl.cumsum(gti, 0) - 1
    re = tl.cumsum(eqi, 0) - 1
    sel = (gti > 0) | ((eqi > 0) & (re < need))
    dst = tl.where(gti > 0, n_gt + rg, TOPK - need + re)
    tl.store(orow + dst, val, mask=sel & (dst >= 0) & (dst < TOPK))


@triton.jit
def _refine_loop(val_ptr, key_ptr, n, thr, need, n_gt, orow, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    # ``_refine_regs`` over a list too long for registers (and whose keys need not share thr's 20-bit prefix:
    # only those that do take part): each digit and the final write loop over the list in BLOCK-sized pieces.
    offs = tl.arange(0, BLOCK)
    for p in tl.static_range(0, 2):
        SH = 6 - 6 * p
        h = tl.zeros([64], dtype=tl.int32)
        for c0 in range(0, n, BLOCK):
            c = c0 + offs
            m = c < n
            ks = tl.load(key_ptr + c, mask=m, other=0)
            match = m & ((ks >> (SH + 6)) == (thr >> (SH + 6)))
            h += tl.histogram((ks >> SH) & 63, 64, mask=match)
        d, need = _pick(h, need, 64)
        thr = thr | (d << SH)
    n_above = 0
    n_tied = 0
    for c0 in range(0, n, BLOCK):
        c = c0 + offs
        m = c < n
        ks = tl.load(key_ptr + c, mask=m, other=0)
        m = m & ((ks >> 12) == (thr >> 12))
        gti = (m & (ks > thr)).to(tl.int32)
        eqi = (m & (ks == thr)).to(tl.int32)
        rg = n_above + tl.cumsum(gti, 0) - 1
        re = n_tied + tl.cumsum(eqi, 0) - 1
        sel = (gti > 0) | ((eqi > 0) & (re < need))
        dst = tl.where(gti > 0, n_gt + rg, TOPK - need + re)
        val = tl.load(val_ptr + c, mask=sel, other=0)
        tl.store(orow + dst, val, mask=sel & (dst >= 0) & (dst < TOPK))
        n_above += tl.sum(gti, 0)
        n_tied += tl.sum(eqi, 0)
