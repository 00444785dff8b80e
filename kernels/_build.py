"""``build_and_verify``: compile, tune and verify the DSA kernels on this host's GPU, then write the manifest.

The manifest is the proof that the ``kernels_built`` step ran on the target host: GPU name, compute capability
and SM count, torch/triton versions, the launch configs chosen for each deployment shape, and the errors
measured against the PyTorch references at those shapes on fresh random data (outputs poisoned with NaN
before each run, so an unwritten element fails). Triton's compiled binaries land in ``<cache_dir>/triton``
(``TRITON_CACHE_DIR``), which the servers then reuse.

Tolerances (spec §1.2; FlashMLA @9241ae3 ``tests/test_flash_mla_sparse_decoding.py``: out abs 1e-3 / rel 2.01/128
/ cos-diff 5e-6, lse abs 1e-6, reference fed the dequantised cache). We keep FlashMLA's rel 2.01/128 and cos-diff
5e-6, add relative Frobenius error ≤ 1e-2 (bf16 operands), and use abs 1/64 elementwise and lse abs 1e-3:
FlashMLA's own sparse decode (sgl-flash-mla 1.0.0) measured on one H200 (2026-11-29, this repo's bench, same
inputs) reaches max |o − ref| = 3.8e-3 — the bf16 rounding of P in the PV product, ≈ 2^-9 · Σ p·|v| — so
1e-3 only holds on FlashMLA's own test data; lse is an fp32 statistic whose summation order differs from the
reference. Empty rows must give exactly o = 0 and lse = +inf. The indexer's logits must match within 1e-3
relative to the size of the summed terms, max over the row of k_scale · Σ_j |w_j| · ReLU(q_j · k) (not of the
logit itself: with mixed-sign head weights a logit can cancel to far below its terms, and Hopper's FP8 MMA keeps
only about 14 bits while accumulating, DeepSeek-V3 technical report §3.3.2 — measured on an H200, a 1-token row
whose logit cancelled to 5e-3 was off by 1.1e-3 of itself); its top-k must be a valid top-k of the reference
logits up to that tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

__all__ = ["KernelsBuildError", "MANIFEST_NAME", "build_and_verify", "load_manifest"]

MANIFEST_NAME = "pdctl-kernels-manifest.json"
OUT_ABS_TOL = 1.0 / 64
OUT_REL_TOL = 2.01 / 128
LSE_ABS_TOL = 1e-3
V32_SM_SCALE = 0.135234
"""DeepSeek-V3.2 softmax scale: 192^-0.5 · (0.1·ln 40 + 1)² (spec §1.2)."""


class KernelsBuildError(RuntimeError):
    """The kernels cannot be built or failed verification on this host; the message says why."""


def _decode_tolerance_check(o, lse, ro, rlse) -> dict[str, float | bool]:
    """Compare a decode result with the fp32 reference; see the module docstring for the bounds."""
    import torch

    o = o.float()
    ro = ro.float()
    dead = torch.isinf(rlse)
    finite = ~dead
    diff = (o - ro).abs()
    bound = OUT_ABS_TOL + OUT_REL_TOL * ro.abs()
    rel = ((o - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    cos_diff = (1 - 2 * (o.double() * ro.double()).sum() / ((o.double() ** 2).sum() + (ro.double() ** 2).sum())
                ).item() if ro.norm() > 0 else 0.0
    lse_err = (lse[finite] - rlse[finite]).abs().max().item() if finite.any() else 0.0
    ok = (
        bool(torch.isfinite(o).all())
        and bool((diff <= bound).all())
        and rel <= 1e-2
        and cos_diff <= 5e-6
        and lse_err <= LSE_ABS_TOL
        and bool(torch.isinf(lse[dead]).all() and (lse[dead] > 0).all())
        and bool((o[dead] == 0).all())
    )
    return {"max_abs_err": diff.max().item(), "rel_fro_err": rel, "cos_diff": cos_diff, "lse_max_abs_err": lse_err,
            "ok": ok}


def make_decode_case(heads: int, rows: int, kv_format: str, *, topk: int = 2048, slots: int | None = None,
                     device: str = "cuda", dtype=None, seed: int | None = None, with_length: bool = True,
                     ragged: bool = True):
    """Random decode inputs at real shapes: ``(q, kv, indices, topk_length)``, generated on ``device``.

    Rows get distinct random slots (no repeats within a row, like real top-k output). With ``ragged`` about one
    row in eight is short (random topk_length < topk, −1 tail) and, when rows ≥ 4, the last row is empty (all −1)
    to exercise the o = 0 / lse = +inf convention. Latent rows are N(0, 1); queries N(0, 0.25) so softmaxes are
    neither flat nor one-hot.
    """
    import torch

    from pdctl.kernels._reference import quantize_kv656

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    dtype = dtype or torch.bfloat16
    slots = slots or max(4 * topk, rows * 256)
    q = (torch.randn(rows, heads, 576, generator=g, device=device) * 0.5).to(dtype)
    kv_f = torch.randn(slots, 576, generator=g, device=device)
    # Distinct slots per row: argsort of random keys (randperm per row is slow at large slot counts).
    idx = torch.empty(rows, topk, dtype=torch.int32, device=device)
    for r in range(rows):
        idx[r] = torch.randperm(slots, generator=g, device=device)[:topk].to(torch.int32)
    length = torch.full((rows,), topk, dtype=torch.int32, device=device)
    if ragged:
        for r in range(3, rows, 8):
            n = int(torch.randint(1, topk, (1,), generator=g, device=device))
            length[r] = n
            idx[r, n:] = -1
        if rows >= 4:
            idx[rows - 1] = -1
            length[rows - 1] = 0
    kv = quantize_kv656(kv_f) if kv_format == "fp8" else kv_f.to(dtype)
    return q, kv, idx, (length if with_length else None)


def indexer_logits_error(logits, q8, weights, cache, block_table, seq_lens) -> float:
    """Max over rows of ``max |logits − ref| / max(k_scale · Σ_j |w_j| · ReLU(q_j · k))`` (the module docstring's
    logits tolerance), the reference in fp32; rows with L_b = 0 are skipped."""
    import torch

    from pdctl.kernels._reference import reference_indexer_logits

    ref = reference_indexer_logits(q8, weights, cache, block_table, seq_lens, compute_dtype=torch.float32)
    mag = reference_indexer_logits(q8, weights.abs(), cache, block_table, seq_lens, compute_dtype=torch.float32)
    err = 0.0
    for b, (r, m) in enumerate(zip(ref, mag)):
        n = int(seq_lens[b])
        if n:
            err = max(err, ((logits[b, :n] - r).abs().max() / m.abs().max().clamp_min(1e-30)).item())
    return err


def make_indexer_case(seq_lens: list[int], *, max_context: int, device: str = "cuda", seed: int | None = None,
                      extra_pages: int = 0):
    """Random indexer inputs on ``device``: ``(q8, weights, index_k_cache, block_table, seq_lens)``.

    The block table is ``ceil(max_context / 64)`` wide (as SGLang's under CUDA graphs) and maps each request's
    pages to distinct random physical pages; unused entries are 0 (a valid page that must never be read for
    positions ≥ L_b). Key scales are random powers of two (ue8m0), weights N(0, 0.01).
    """
    import torch

    from pdctl.kernels._reference import pack_index_k_cache

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    b = len(seq_lens)
    width = -(-max_context // 64)
    need = [-(-n // 64) for n in seq_lens]
    if max(need, default=0) > width:
        raise ValueError(f"seq_lens {max(seq_lens)} exceed max_context {max_context}")
    pages = sum(need) + extra_pages + 1
    perm = torch.randperm(pages, generator=g, device=device).to(torch.int32)
    bt = torch.zeros(b, width, dtype=torch.int32, device=device)
    o = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[o:o + n]
        o += n
    q8 = torch.randn(b, 64, 128, generator=g, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(b, 64, generator=g, device=device) * 0.1
    k8 = torch.randn(pages * 64, 128, generator=g, device=device).to(torch.float8_e4m3fn)
    ks = torch.exp2(torch.randint(-8, -2, (pages * 64,), generator=g, device=device).float())
    cache = pack_index_k_cache(k8, ks)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q8, w, cache, bt, sl


def check_first_histogram(device: str = "cuda", *, n: int = 1500, block: int = 128, programs: int = 3,
                          topk: int = 128) -> dict[str, Any]:
    """Run the indexer top-k's first pass (``_topk_hist_kernel``) on rows built to take both of its paths and
    compare its 256-bin top-byte histograms with torch's. Rows (``n`` logits each, ``programs`` programs a row,
    ``block`` keys a step): N(0, 1); both signs spread over 2^-100..2^100 with exact ±0 (the 256-bin path); only
    positive; only negative; all equal; N(0, 1) with a short last block; one sign over exactly 16 and 17
    consecutive top bytes in every block (windows only / 256 bins), and the same negated. Returns ``{"ok": bool,
    "bad_rows": [row, …], "past_256": bool}`` (``past_256``: something was counted beyond bin 255)."""
    import torch

    from pdctl.kernels._indexer import WS_STRIDE, _kernels

    g = torch.Generator().manual_seed(4)
    wide = torch.sign(torch.randn(n, generator=g)) * torch.exp2(200 * torch.rand(n, generator=g) - 100)
    wide[::97] = 0.0
    wide[5::89] = -0.0
    span16 = torch.exp2(-2.0 * (torch.arange(n) % 16)) * 1.5
    span17 = torch.exp2(-2.0 * (torch.arange(n) % 17)) * 1.5
    rows = torch.stack([torch.randn(n, generator=g), wide, torch.rand(n, generator=g) + 0.5,
                        -torch.rand(n, generator=g) - 0.5, torch.full((n,), 2.5), torch.randn(n, generator=g),
                        span16, span17, -span16, -span17])
    lens = torch.full((rows.shape[0],), n, dtype=torch.int32)
    lens[5] = n - n // 7
    ws = torch.zeros(rows.shape[0], WS_STRIDE, dtype=torch.int32)
    rows_d, lens_d, ws_d = rows.to(device), lens.to(device), ws.to(device)
    _kernels()._topk_hist_kernel[(rows.shape[0], programs)](rows_d, rows_d.stride(0), lens_d, ws_d, WS_STRIDE,
                                                             TOPK=topk, BLOCK=block, GDC=0)
    ws = ws_d.cpu()
    bits = rows.view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    bad = [b for b in range(rows.shape[0]) if not torch.equal(
        ws[b, :256], torch.bincount(((keys[b, : lens[b]] >> 24) + 128).long(), minlength=256).to(torch.int32))]
    past = bool(ws[:, 256:].any())
    return {"ok": not bad and not past, "bad_rows": bad, "past_256": past}


def check_topk(out, ref_logits, block_table, seq_lens, topk: int, rel_tol: float = 1e-3) -> dict[str, Any]:
    """Check ``out [B, topk]`` (physical slots) against reference logits (list of per-row tensors).

    A row passes when: entries are distinct, −1 exactly past min(L_b, topk), each selected slot maps back to a
    position < L_b, and (L_b > topk) the smallest selected reference logit is ≥ the largest unselected one minus
    ``rel_tol · max|logit|`` (a valid top-k up to the kernel's rounding; ties may be broken either way).
    """
    import torch

    worst_gap = 0.0
    ok = True
    for b, lg in enumerate(ref_logits):
        n = int(seq_lens[b])
        row = out[b].long().cpu()
        m = min(n, topk)
        if not bool((row[m:] == -1).all()) or not bool((row[:m] >= 0).all()) and n <= topk:
            ok = False
            continue
        sel = row[row >= 0]
        if sel.numel() != m or sel.unique().numel() != m:
            ok = False
            continue
        # Physical slot -> logical position through the row's block table.
        bt = block_table[b].long().cpu()
        npages = -(-n // 64)
        slot_of_pos = (bt[:npages, None] * 64 + torch.arange(64)[None, :]).reshape(-1)[:n]
        inv = {int(s): p for p, s in enumerate(slot_of_pos.tolist())}
        try:
            pos = torch.tensor([inv[int(s)] for s in sel.tolist()], dtype=torch.long)
        except KeyError:
            ok = False
            continue
        if n > topk:
            lgc = lg.double().cpu()
            mask = torch.ones(n, dtype=torch.bool)
            mask[pos] = False
            gap = (lgc[mask].max() - lgc[pos].min()).item() / max(lgc.abs().max().item(), 1e-30)
            worst_gap = max(worst_gap, gap)
            if gap > rel_tol:
                ok = False
    return {"ok": ok, "worst_rel_gap": worst_gap}


def _bench_us(fn, reps: int = 30, back_to_back: int = 10) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph, ``back_to_back`` replays per timed sample (keeps the
    clocks up and excludes launch overhead); median over ``reps`` samples."""
    import torch

    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(back_to_back):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1e3 / back_to_back)
    times.sort()
    return times[len(times) // 2]


def _decode_candidates(heads: int, rows: int, num_sms: int, kv_format: str = "bf16"):
    """Launch configs worth timing for one shape: head block × (tile, warps) × prefetch × split count.

    Split counts bracket the smallest power of two that gives ≥ 1 program per SM.
    """
    from pdctl.kernels._sparse_mla import DecodeConfig, default_decode_config

    if kv_format == "v4":
        return _decode_candidates_v4(heads, rows, num_sms)
    cands = {default_decode_config(heads, rows, kv_format, num_sms)}
    for bh in (16, 32, 64):
        if bh > max(16, heads) or (bh == 64 and heads < 64):
            continue
        progs = rows * -(-heads // bh)
        s0 = 1
        while s0 * progs < num_sms and s0 < 32:
            s0 *= 2
        # 32-row tiles with 8 warps for 16/32-head blocks too: half the registers a thread holds per tile, which the
        # FP8 fold needs at B = 1 (h = 16: 6.35 against 6.56 µs with 4 warps; kernels/RESULTS.md, twentieth session)
        tiles = [(32, 8), (32, 4)] if bh == 64 else [(64, 4), (32, 4), (64, 8), (32, 8)]
        for bn, warps in tiles:
            for prefetch in ((0, 1, 2) if kv_format == "fp8" else (0, 1)):
                for splits in sorted({s0 // 2 if s0 >= 4 else s0, s0, min(64, s0 * 2)}):
                    cands.add(DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=2,
                                           splits=splits, prefetch=prefetch))
                    if kv_format == "fp8" and bn == 32 and prefetch == 1:
                        # rows dequantised with their scales (DecodeConfig.fold): no spills at 32-row tiles only; and
                        # the same with QKᵀ as independent MMA chains (DecodeConfig.qk_chains: 6.36 -> 6.26 µs at h = 16,
                        # B = 1, 8 warps, PDL 1; neutral on the bf16 cache; kernels/RESULTS.md, 23rd session)
                        for chains in (0, 1):
                            cands.add(DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=2,
                                                   splits=splits, prefetch=prefetch, fold=1, qk_chains=chains))
    if kv_format == "fp8":
        from pdctl.kernels._sparse_mla import WS_HEAD_BLOCKS, gluon_available

        if gluon_available():
            for bh in (16, 32, 64):
                if bh > max(16, heads) or (bh == 64 and heads < 64):
                    continue
                progs = rows * -(-heads // bh)
                s0 = 1
                while s0 * progs < num_sms and s0 < 32:
                    s0 *= 2
                for splits in sorted({max(1, s0 // 2), s0, min(32, s0 * 2)}):
                    variants = [v for v in (1, 2, 3) if bh in (16, 32)]
                    variants += [v for v, blocks in WS_HEAD_BLOCKS.items() if bh in blocks]
                    for gl_variant in variants:
                        cands.add(DecodeConfig(block_h=bh, block_n=64, num_warps=4, num_stages=2, splits=splits,
                                               gluon=gl_variant))
    return sorted(cands, key=lambda c: (c.gluon, c.block_h, c.block_n, c.num_warps, c.prefetch, c.fold, c.qk_chains,
                                       c.splits))


def _decode_candidates_v4(heads: int, rows: int, num_sms: int, topk: int = 512 + 128):
    """DeepSeek-V4 decode configs worth timing: head block x (rows per step, warps) x split counts bracketing the
    smallest power of two that gives every SM a program (the V4 kernel has no prefetch, fold or Gluon variants)."""
    from pdctl.kernels._sparse_mla import DecodeConfig, default_decode_config

    cands = {default_decode_config(heads, rows, "v4", num_sms, topk)}
    for bh in (16, 32, 64):
        if bh > max(16, heads) or (bh == 64 and heads < 64):
            continue
        progs = rows * -(-heads // bh)
        s0 = 1
        while s0 * progs < num_sms and s0 < 32:
            s0 *= 2
        for bn, warps in ((32, 4), (32, 8), (16, 4), (64, 8)):
            for splits in sorted({max(1, s0 // 2), s0, min(64, s0 * 2, max(1, topk // bn))}):
                cands.add(DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=2, splits=splits))
    return sorted(cands, key=lambda c: (c.block_h, c.block_n, c.num_warps, c.splits))


V4_SM_SCALE = 512 ** -0.5
"""DeepSeek-V4's softmax scale, head_dim^-0.5 (sglang 0.5.23 ``DeepseekV4AttnBackend.__init__``)."""
V4_SWA = 128
"""V4's sliding window (``window_size``, sglang 0.5.23 ``configs/deepseek_v4.py``): the main KV source of a decode row."""
V4_SWA_PAGE = 256
"""Tokens per page of SGLang's V4 SWA cache (0.5.23 asserts page_size == 256); c4 pages hold 256 / 4 = 64 rows."""


def make_v4_decode_case(heads: int, rows: int, *, topk: int = 512, swa: int = V4_SWA, device: str = "cuda",
                        dtype=None, seed: int | None = None, ragged: bool = True, slots: int | None = None,
                        extra_page: int = 64, sink: bool = True) -> dict[str, Any]:
    """Random DeepSeek-V4 decode inputs shaped as sglang 0.5.23 hands them to FlashMLA for a c4 layer: the keyword
    arguments of ``sparse_decode_v4`` (and of the reference). Main source: a window of ``swa`` distinct slots per row
    in a cache of 256-token pages (``topk_length`` = swa); extra source: ``topk`` distinct compressed slots per row in
    a cache of ``extra_page``-row pages (``extra_topk_length`` = topk). With ``ragged``, about one row in eight gets
    shorter lists (−1 tails), and with ≥ 4 rows the last row is empty in both sources. Latent rows N(0, 1), queries
    N(0, 0.25) in ``dtype`` (bf16 default), sinks N(0, 1) with one −inf and one +inf head (FlashMLA's tests do so)."""
    import torch

    from pdctl.kernels._reference import quantize_kv584, v4_cache_view

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    dtype = dtype or torch.bfloat16
    n_main = slots or max(4 * swa * rows, 4 * V4_SWA_PAGE)
    n_main = -(-n_main // V4_SWA_PAGE) * V4_SWA_PAGE
    n_extra = slots or max(4 * topk, rows * 256)
    n_extra = -(-n_extra // extra_page) * extra_page
    main = v4_cache_view(quantize_kv584(torch.randn(n_main, 512, generator=g, device=device), V4_SWA_PAGE),
                         V4_SWA_PAGE)
    extra = v4_cache_view(quantize_kv584(torch.randn(n_extra, 512, generator=g, device=device), extra_page),
                          extra_page)
    q = (torch.randn(rows, heads, 512, generator=g, device=device) * 0.5).to(dtype)
    idx = torch.empty(rows, swa, dtype=torch.int32, device=device)
    eidx = torch.empty(rows, topk, dtype=torch.int32, device=device)
    for r in range(rows):
        idx[r] = torch.randperm(n_main, generator=g, device=device)[:swa].to(torch.int32)
        eidx[r] = torch.randperm(n_extra, generator=g, device=device)[:topk].to(torch.int32)
    length = torch.full((rows,), swa, dtype=torch.int32, device=device)
    elength = torch.full((rows,), topk, dtype=torch.int32, device=device)
    if ragged:
        for r in range(3, rows, 8):
            n = int(torch.randint(1, swa, (1,), generator=g, device=device))
            m = int(torch.randint(0, topk, (1,), generator=g, device=device))
            length[r], elength[r] = n, m
            idx[r, n:] = -1
            eidx[r, m:] = -1
        if rows >= 4:
            idx[rows - 1] = -1
            eidx[rows - 1] = -1
            length[rows - 1] = 0
            elength[rows - 1] = 0
    attn_sink = None
    if sink:
        attn_sink = torch.randn(heads, generator=g, device=device)
        if heads >= 4:
            attn_sink[1] = float("-inf")
            attn_sink[2] = float("inf")
    return {"q": q, "cache": main, "indices": idx, "topk_length": length, "attn_sink": attn_sink,
            "extra_cache": extra, "extra_indices": eidx, "extra_topk_length": elength}


def _make_case(h: int, rows: int, fmt: str, topk: int, **kw: Any) -> Any:
    """One decode shape's inputs: :func:`make_decode_case`'s tuple, or for ``"v4"`` :func:`make_v4_decode_case`'s
    keyword arguments."""
    if fmt == "v4":
        return make_v4_decode_case(h, rows, topk=topk, device="cuda", **kw)
    return make_decode_case(h, rows, fmt, topk=topk, device="cuda", **kw)


def _run_decode(fmt: str, case: Any, sm_scale: float, cfg: Any, **out: Any) -> Any:
    """Run the decode kernel of ``fmt`` on a :func:`_make_case` case (``out``/``lse`` passed through)."""
    from pdctl.kernels._sparse_mla import sparse_decode_v4, sparse_mla_decode

    if fmt == "v4":
        return sparse_decode_v4(sm_scale=sm_scale, config=cfg, **case, **out)
    q, kv, idx, tl_ = case
    return sparse_mla_decode(q, kv, idx, sm_scale, tl_, config=cfg, **out)


def _reference_decode(fmt: str, case: Any, sm_scale: float) -> Any:
    """The fp32 reference of a :func:`_make_case` case."""
    import torch

    from pdctl.kernels._reference import reference_sparse_decode_v4, reference_sparse_mla_decode

    if fmt == "v4":
        return reference_sparse_decode_v4(sm_scale=sm_scale, compute_dtype=torch.float32, **case)
    q, kv, idx, tl_ = case
    return reference_sparse_mla_decode(q, kv, idx, sm_scale, tl_, compute_dtype=torch.float32)


LAUNCH_SETTINGS_NEAR = 1.05
"""A plain config whose time is within this factor of the fastest also gets launch settings (up to two beyond the
three fastest): plain times that close do not predict which config PDL and bf16 partials help most."""


def _launch_setting_candidates(ranked: list[Any], heads: int, rows: int, num_sms: int, pdl: bool,
                               plain_us: list[float] | None = None) -> list[Any]:
    """Launch settings worth timing on top of the plain configs, given those configs fastest first (and their µs,
    ``plain_us``, in the same order, where known).

    Programmatic dependent launch (``pdl`` 1 and 2; only when ``pdl`` is True, i.e. ``_pdl_supported``) on the three
    fastest, and on up to two more within :data:`LAUNCH_SETTINGS_NEAR` of the fastest; a config and its
    ``qk_chains`` twin count as one (the faster stands for both), so that the twins do not crowd the others out. The
    in-kernel merge (``merge`` 1, with each PDL mode) on the two fastest warp-specialised Gluon configs whose grid
    fits one program per SM; and each of those and the chosen plain configs themselves, where they have splits, with
    the partials stored in bf16 (``bf16_partials``). Every one is verified like a plain config before it can be
    chosen. (Three, not two: on the H200 at FP8 h = 32, B = 1 the third plain config, 8.44 µs against 8.29, was the
    fastest with PDL and bf16 partials, 6.9 against 7.3 µs; kernels/RESULTS.md, twentieth session. Within 5 %: in
    the twenty-third session's run the same config was fifth at 8.51 µs against 8.33 and left out.)
    """
    from pdctl.kernels._sparse_mla import check_decode_config

    def mergeable(cfg: Any) -> bool:  # the launcher's own conditions (the Gluon kernels are FP8-only)
        try:
            check_decode_config(dataclasses.replace(cfg, merge=1), heads, rows, "fp8", num_sms)
        except ValueError:
            return False
        return True

    families: list[tuple[Any, float | None]] = []
    seen = set()
    for i, cfg in enumerate(ranked):
        family = dataclasses.replace(cfg, qk_chains=0)
        if family not in seen:
            seen.add(family)
            families.append((cfg, plain_us[i] if plain_us is not None else None))
    chosen = [cfg for cfg, _ in families[:3]]
    if plain_us is not None and families:
        best = families[0][1]
        chosen += [cfg for cfg, us in families[3:] if us <= best * LAUNCH_SETTINGS_NEAR][:2]
    out = []
    modes = (1, 2) if pdl else ()
    for cfg in chosen:
        out += [dataclasses.replace(cfg, pdl=m) for m in modes]
    for cfg in [c for c in ranked if mergeable(c)][:2]:
        out += [dataclasses.replace(cfg, merge=1, pdl=m) for m in (0, *modes)]
    return out + [dataclasses.replace(cfg, bf16_partials=1) for cfg in [*chosen, *out] if cfg.splits > 1]


COMPILE_WORKERS_ENV = "PDCTL_KERNELS_COMPILE_WORKERS"
"""Environment variable: how many processes compile the candidate kernels before they are timed (0 or 1: none, the
timing loop compiles each in turn). Default: ``min(16, CPUs this process may run on)``, fewer where the GPU's free
memory is short (:data:`WORKER_GPU_BYTES`)."""
WORKER_GPU_BYTES = 3 << 29
"""GPU memory one compiling process is counted at (1.5 GiB: its CUDA context, about 0.5 GiB, and one job's inputs;
the indexer's are the largest, about 0.4 GiB). The build starts no more of them than fit in a quarter of the GPU's
free memory: on a host whose servers are up (a re-apply), that memory is the headroom SGLang's ranks allocate from
beyond ``--mem-fraction-static``."""


def _compile_workers() -> int:
    """Processes for :func:`_precompile` (``PDCTL_KERNELS_COMPILE_WORKERS``, else ``min(16, usable CPUs)``).

    Raises:
        KernelsBuildError: "cannot build here: …" when the variable is set to something other than a whole number
            ≥ 0.
    """
    raw = os.environ.get(COMPILE_WORKERS_ENV)
    if raw is None or not raw.strip():
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return min(16, cpus)
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise KernelsBuildError(f"cannot build here: {COMPILE_WORKERS_ENV}={raw!r} is not a whole number >= 0; set "
                                "it to the number of compiling processes (0 to compile in the timing loop), or unset it")
    return n


def _compile_key(job: tuple) -> tuple:
    """Jobs that may share compiled kernels, so that one worker compiles them in turn instead of several at once.

    Triton compiles one binary per constexpr set and per specialisation of the integer arguments (== 1, divisible
    by 16); a decode config's ``splits`` is a runtime argument, and the batch size reaches the kernels as an integer.
    A key finer than Triton's costs a duplicate compile in two processes; a coarser one, two jobs compiled in turn
    by one process where two could have run side by side.
    """
    if job[0] == "indexer":
        return (*job[:4], tuple(sorted(job[4].items())))
    _, h, rows, fmt, _topk, _scale, cfg, case_kw = job
    rest = tuple(sorted((k, v) for k, v in cfg.items() if k != "splits"))
    return ("decode", h, fmt, rest, _int_spec(cfg.get("splits", 1)), _int_spec(rows), case_kw)


def _int_spec(n: int) -> tuple[bool, bool]:
    return n == 1, n % 16 == 0


def decode_job(heads: int, rows: int, kv_format: str, topk: int, sm_scale: float, config: Any, **case_kw: Any) -> tuple:
    """A decode job for :func:`_precompile`: the config run on :func:`make_decode_case` inputs made with *case_kw*,
    which must be the timing loop's own (``with_length`` decides whether the kernels get a ``topk_length``, a
    constexpr of theirs: other inputs compile other binaries)."""
    return ("decode", heads, rows, kv_format, topk, sm_scale, config.as_dict(), tuple(sorted(case_kw.items())))


def _precompile_group(jobs: list[tuple]) -> int:
    """Worker side of :func:`_precompile`: run each job's kernels once on inputs of the job's shapes, so that Triton
    compiles them into ``TRITON_CACHE_DIR``. Failures are left to the timing loop, which runs every job again and
    records them. Returns the number of jobs that ran."""
    import torch

    from pdctl.kernels._indexer import IndexerConfig, lightning_indexer
    from pdctl.kernels._sparse_mla import DecodeConfig

    ran = 0
    cases: dict[tuple, tuple] = {}
    for job in jobs:
        try:
            if job[0] == "decode":
                _, h, rows, fmt, topk, sm_scale, cfg, case_kw = job
                key = (h, rows, fmt, topk, case_kw)
                if (case := cases.get(key)) is None:
                    cases.clear()  # one shape's inputs at a time
                    case = cases[key] = _make_case(h, rows, fmt, topk, **dict(case_kw))
                _run_decode(fmt, case, sm_scale, DecodeConfig(**cfg))
            else:
                _, seq_lens, max_context, topk, cfg = job
                q8, w, cache, bt, sl = make_indexer_case(list(seq_lens), max_context=max_context, device="cuda")
                lightning_indexer(q8, w, cache, bt, sl, topk, config=IndexerConfig(**cfg))
            torch.cuda.synchronize()
            ran += 1
        except Exception:  # noqa: BLE001 - a config that fails here fails again, and is recorded, in the timing loop
            pass
    return ran


def _precompile_worker(device: int, tasks: Any, results: Any, run: Any) -> None:
    """One compiling process: take job groups off ``tasks`` until its ``None``, put each group's count on
    ``results``; return, too, once the process that started it is gone (killed: nobody would send the ``None``)."""
    import multiprocessing
    import queue

    try:
        import torch

        torch.cuda.set_device(device)
    except Exception:  # noqa: BLE001 - then every job fails, quickly, and the timing loop compiles them
        pass
    parent = multiprocessing.parent_process()
    while True:
        try:
            group = tasks.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if group is None:
            return
        results.put(run(group))


def _precompile(jobs: list[tuple], workers: int, device: int, *, timeout_s: float | None = None,
                run: Any = None) -> dict[str, Any]:
    """Compile the kernels of *jobs* in ``workers`` processes before the timing loop needs them.

    Each job is :func:`decode_job`'s tuple or ``("indexer", seq_lens, max_context, topk, config dict)``; jobs with
    the same :func:`_compile_key` go to one process, the groups handed out as processes come free. The processes are
    spawned (no CUDA state is forked), use GPU ``device`` and write their binaries into the ``TRITON_CACHE_DIR`` this
    process set, so the timing loop loads them instead of compiling them one after the other. Nothing they compute is
    used: the timing loop verifies and times every config itself, so a process that dies or hangs costs time, never
    a result. The round ends when the processes have run every group, or at ``timeout_s`` (default: 15 s per group
    per process, at least 120 s; one compile takes seconds), when those still running are killed. ``run`` replaces
    :func:`_precompile_group` (a picklable module-level function; for tests).

    Returns ``{"workers", "jobs", "groups", "ran", "died", "s", "timed_out"}``: ``ran`` counts the jobs whose kernels
    ran, ``died`` the processes that exited with an error (one that cannot import pdctl, say); ``timed_out`` is True
    when the round outlasted its time and the processes still running were killed.
    """
    import multiprocessing

    started = time.monotonic()
    groups: dict[tuple, list[tuple]] = {}
    for job in jobs:
        groups.setdefault(_compile_key(job), []).append(job)
    info: dict[str, Any] = {"workers": 0, "jobs": len(jobs), "groups": len(groups), "ran": 0, "died": 0,
                            "s": 0.0, "timed_out": False}
    n = min(workers, len(groups))
    if n <= 1:
        return info
    info["workers"] = n
    if timeout_s is None:
        timeout_s = max(120.0, 15.0 * len(groups) / n)
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.SimpleQueue()
    for group in groups.values():
        tasks.put(group)
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_precompile_worker, args=(device, tasks, results, run or _precompile_group),
                         daemon=True, name=f"pdctl-kernels-compile-{i}") for i in range(n)]
    for proc in procs:
        proc.start()
    deadline = started + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            info["timed_out"] = True
            proc.kill()
            proc.join()
        elif proc.exitcode:
            info["died"] += 1
    while not results.empty():
        info["ran"] += results.get()
    tasks.cancel_join_thread()  # groups never taken (killed processes) must not hold this process at exit
    tasks.close()
    info["s"] = round(time.monotonic() - started, 1)
    return info


def _kernels_source_digest() -> str:
    """sha256 of this package's Python sources (the kernels and their launchers): a build of other sources compiles
    other binaries."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _same_build_before(path: Path, manifest: dict[str, Any]) -> str | None:
    """When the manifest at *path* is of a build that passed with the same kernel sources, versions, GPU, Triton cache
    directory and shapes as *manifest* (this build's, before it ran), so that the cache holds its binaries: when it
    was written, in words. Else None (no manifest, another build, or one that cannot be read)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("kernels_source", "versions", "gpu", "triton_cache_dir", "shapes")
    if not isinstance(old, dict) or old.get("ok") is not True or any(old.get(k) != manifest[k] for k in keys):
        return None
    return f"a passing build with the same kernels, versions, GPU and shapes, {old.get('elapsed_s', '?')} s"


MODELS = ("deepseek-v3.2", "deepseek-v4")


def build_and_verify(
    cache_dir: str | os.PathLike[str],
    *,
    heads: tuple[int, ...] = (16,),
    batch_sizes: tuple[int, ...] = (1, 8, 64),
    kv_formats: tuple[str, ...] | None = None,
    topk: int | None = None,
    max_context: int | None = None,
    indexer_seq_lens: tuple[int, ...] | None = None,
    tune: bool = True,
    sm_scale: float | None = None,
    model: str = "deepseek-v3.2",
) -> dict[str, Any]:
    """Compile, tune and verify both kernels on this host's first CUDA GPU; write ``<cache_dir>/<MANIFEST_NAME>``.

    Args:
        cache_dir: the servers' cache directory (``SGLANG_CACHE_DIR``); Triton binaries go to ``<cache_dir>/triton``
            unless ``TRITON_CACHE_DIR`` is already set.
        heads: local MLA head counts to serve (128 / TP; e.g. 16 at TP8, 32 at TP4).
        batch_sizes: decode batch sizes (CUDA-graph batch sizes) to tune and verify.
        kv_formats: ``"fp8"`` (656-byte rows) and/or ``"bf16"`` ([slots, 576]).
        topk: index_topk (2048 for DeepSeek-V3.2); max_context: block-table width · 64 used for the indexer check.
        indexer_seq_lens: request lengths for the indexer check (one batch).
        tune: time candidate launch configs per shape (CUDA-graph replay) and keep the fastest verified one.
        sm_scale: softmax scale used in the decode checks.
        model: ``"deepseek-v3.2"`` (the defaults above: fp8 + bf16 caches, top-2048, 163840 context, 0.135234) or
            ``"deepseek-v4"`` (defaults: the 584-byte ``"v4"`` cache, a 128-token window beside top-512 compressed
            rows, 1048576 context, 512^-0.5): for V4 the decode shapes are those of a c4 layer
            (:func:`make_v4_decode_case`), and the indexer is checked and tuned over compressed rows
            (``max_context / 4`` wide, ``indexer_seq_lens`` counted in compressed rows). The manifest records it as
            ``model``; the SGLang plugin hooks that model's backend.

    Returns:
        The manifest dict (also written as JSON). ``manifest["ok"]`` is True.

    Raises:
        KernelsBuildError: "cannot build here: no CUDA GPU …" on a host without a usable CUDA GPU (or without
            torch/triton), or when any verification fails (the manifest is still written, with ``ok: false``).
    """
    if model not in MODELS:
        raise KernelsBuildError(f"cannot build here: unknown model {model!r} ({', '.join(MODELS)})")
    v4 = model == "deepseek-v4"
    kv_formats = kv_formats or (("v4",) if v4 else ("fp8", "bf16"))
    if v4 != (set(kv_formats) == {"v4"}):
        raise KernelsBuildError(f"cannot build here: {model} takes the kv formats {'v4' if v4 else 'fp8, bf16'}, "
                                f"got {kv_formats}")
    topk = topk or (512 if v4 else 2048)
    max_context = max_context or (1048576 if v4 else 163840)
    sm_scale = sm_scale or (V4_SM_SCALE if v4 else V32_SM_SCALE)
    index_context = max_context // 4 if v4 else max_context  # V4's indexer scores compressed rows (ratio 4)
    if indexer_seq_lens is None:
        indexer_seq_lens = ((1, topk, topk + 1, 2047, min(10000, index_context)) if v4
                            else (1, 2048, 2049, 8191, 40000))
    cache = Path(cache_dir)
    try:
        import torch
    except (ImportError, OSError) as e:  # pragma: no cover - depends on the host (OSError: a broken install)
        raise KernelsBuildError(f"cannot build here: torch is not importable ({e}); install pdctl[kernels]") from e
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise KernelsBuildError(
            "cannot build here: no CUDA GPU is visible to torch (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "run the kernels_built step on the GPU host that will serve"
        )
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise KernelsBuildError("cannot build here: TRITON_INTERPRET=1 is set (the CPU interpreter is for tests only)")
    try:
        import triton
    except Exception as e:  # pragma: no cover - depends on the host  # noqa: BLE001
        raise KernelsBuildError(f"cannot build here: triton is not importable ({e!r}); install pdctl[kernels]") from e
    # only now that this host can build: a refused build leaves no cache directory behind
    workers = _compile_workers() if tune else 0  # (a bad setting is refused before anything is written)
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))

    from pdctl.kernels._indexer import IndexerConfig, indexer_logits, lightning_indexer, set_indexer_config
    from pdctl.kernels._reference import reference_indexer_logits
    from pdctl.kernels._sparse_mla import _pdl_supported, set_decode_configs

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    num_sms = props.multi_processor_count
    started = time.time()
    manifest: dict[str, Any] = {
        "schema": 1,
        "gpu": {"name": props.name, "capability": f"sm_{props.major}{props.minor}", "sm_count": num_sms,
                "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "triton_cache_dir": os.environ["TRITON_CACHE_DIR"],
        "kernels_source": _kernels_source_digest(),
        "model": model,
        "shapes": {"heads": list(heads), "batch_sizes": list(batch_sizes), "kv_formats": list(kv_formats),
                   "topk": topk, "max_context": max_context, "sm_scale": sm_scale,
                   **({"swa": V4_SWA, "swa_page": V4_SWA_PAGE, "index_context": index_context} if v4 else {})},
        "decode": [],
        "indexer": {},
        "ok": False,
    }
    ok = True
    chosen = {}
    manifest["compile"] = []
    if workers > 1 and (same := _same_build_before(cache / MANIFEST_NAME, manifest)):
        manifest["compile"].append({"skipped": f"the cache holds this build's binaries already ({same})"})
        workers = 0
    if workers > 1:  # no more processes than a quarter of the GPU's free memory holds (servers may be up)
        free, _total = torch.cuda.mem_get_info(dev)
        if (fit := int(free // 4 // WORKER_GPU_BYTES)) < workers:
            manifest["compile"].append({"workers_cut": f"{workers} -> {fit}: {free / 2**30:.1f} GiB free on the GPU"})
            workers = fit
    shapes = [(h, fmt, rows) for h in heads for fmt in kv_formats for rows in batch_sizes]
    plain = {s: _decode_candidates(s[0], s[2], num_sms, s[1]) for s in shapes} if tune else {s: [None] for s in shapes}
    icands = [IndexerConfig()] + ([IndexerConfig(programs_per_sm=pp, logits_stages=st, topk_programs=tp)
                                   for pp, st in ((4, 5), (8, 3), (16, 5)) for tp in (528, 1056)]
                                  + [IndexerConfig(pdl=0)] if tune else [])
    if tune:  # the logits' keys by per-thread copies instead of bulk tensor copies (where those exist)
        icands += [IndexerConfig(logits_tma=0)]
    itune_lens = (min(8192, index_context),) * 64

    def decode_jobs(cands: dict) -> list[tuple]:  # (inputs made as Shape makes them)
        return [decode_job(h, rows, fmt, topk, sm_scale, cfg)
                for (h, fmt, rows), cfgs in cands.items() for cfg in cfgs if cfg is not None]

    if workers > 1:  # every plain decode candidate and every indexer candidate, compiled side by side
        manifest["compile"].append(_precompile(
            decode_jobs(plain) + [("indexer", itune_lens, index_context, topk, c.as_dict()) for c in icands],
            workers, dev.index))

    class Shape:
        """One (heads, kv format, rows) shape's inputs, reference and verified configs."""

        def __init__(self, h: int, fmt: str, rows: int) -> None:
            self.h, self.fmt, self.rows = h, fmt, rows
            self.case = _make_case(h, rows, fmt, topk)
            self.ro, self.rlse = _reference_decode(fmt, self.case, sm_scale)
            self.timed: dict[Any, tuple[float, dict]] = {}
            """Verified configs → (µs, errors); timing one again replaces its figure."""
            self.failing: list[dict] = []

        @property
        def passing(self) -> list[tuple[float, Any, dict]]:
            return [(us, cfg, err) for cfg, (us, err) in self.timed.items()]

        def attempt(self, cfg: Any) -> None:
            h, rows, fmt, case = self.h, self.rows, self.fmt, self.case
            qdt = case["q"].dtype if fmt == "v4" else case[0].dtype
            o = torch.full((rows, h, 512), float("nan"), dtype=qdt, device=dev)
            lse = torch.full((rows, h), float("nan"), dtype=torch.float32, device=dev)
            try:
                _run_decode(fmt, case, sm_scale, cfg, out=o, lse=lse)
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile here (e.g. shared memory) is skipped
                manifest.setdefault("skipped_configs", []).append(
                    {"heads": h, "kv": self.fmt, "rows": rows, "config": cfg and cfg.as_dict(), "error": str(e)[:200]})
                return
            err = _decode_tolerance_check(o, lse, self.ro, self.rlse)
            if not err["ok"]:
                self.failing.append({"config": cfg and cfg.as_dict(), "errors": err})
                return
            us = _bench_us(lambda: _run_decode(fmt, case, sm_scale, cfg, out=o, lse=lse)) if tune else float("nan")
            self.timed[cfg] = (us, err)

    cases = {}
    for key in shapes:
        cases[key] = case = Shape(*key)
        for cfg in plain[key]:
            case.attempt(cfg)
    if tune:
        # Launch settings of a given kernel (PDL, the in-kernel merge), on each shape's fastest plain configs; those
        # two are timed again beside them (the first pass timed them minutes earlier, with other work between)
        by_time = {key: sorted(case.passing, key=lambda x: x[0]) for key, case in cases.items()}
        ranked = {key: [cfg for _, cfg, _ in passing] for key, passing in by_time.items()}
        settings = {key: _launch_setting_candidates(ranked[key], key[0], key[2], num_sms, _pdl_supported(dev),
                                                    plain_us=[us for us, _, _ in by_time[key]])
                    for key in cases}
        if workers > 1:
            manifest["compile"].append(_precompile(decode_jobs(settings), workers, dev.index))
        for key, case in cases.items():
            for cfg in [*ranked[key][:2], *settings[key]]:
                case.attempt(cfg)
    for (h, fmt, rows), case in cases.items():
        entry: dict[str, Any] = {"heads": h, "kv": fmt, "rows": rows}
        if case.failing:
            entry["failed_configs"] = case.failing
        if not case.passing or case.failing:
            # Every config must compute the same function: one failing config is a kernel bug.
            ok = False
        if case.passing:
            us, cfg, err = min(case.passing, key=lambda x: x[0])
            if cfg is not None:
                chosen[(h, fmt, rows)] = cfg
            entry.update(config=cfg.as_dict() if cfg else None, us=us, errors=err)
        entry["ok"] = bool(case.passing) and not case.failing
        manifest["decode"].append(entry)
    del cases
    set_decode_configs(chosen)

    # Indexer: tune the logits launch on a decode-sized batch (64 requests of 8K tokens at the deployment's
    # block-table width), keeping only configs whose top-k is a valid top-k of the reference logits; then verify
    # the chosen config against the reference on one batch mixing short (<= topk) and long rows.
    tq8, tw, tcache, tbt, tsl = make_indexer_case(list(itune_lens), max_context=index_context, device="cuda")
    tref = reference_indexer_logits(tq8, tw, tcache, tbt, tsl, compute_dtype=torch.float32)
    itimes = []
    for icfg in icands:
        try:
            o_ = lightning_indexer(tq8, tw, tcache, tbt, tsl, topk, config=icfg)
            if not check_topk(o_, tref, tbt, tsl, topk)["ok"]:
                manifest.setdefault("indexer_failed_configs", []).append(icfg.as_dict())
                ok = False
                continue
            itimes.append((_bench_us(lambda icfg=icfg, case=(tq8, tw, tcache, tbt, tsl): lightning_indexer(
                *case, topk, config=icfg))
                           if tune else float("nan"), icfg))
        except Exception as e:
            manifest.setdefault("skipped_configs", []).append({"indexer": icfg.as_dict(), "error": str(e)[:200]})
    del tq8, tw, tcache, tbt, tsl, tref
    ius, icfg = min(itimes, key=lambda x: x[0]) if itimes else (float("nan"), IndexerConfig())
    set_indexer_config(icfg)
    q8, w, cache_k, bt, sl = make_indexer_case(list(indexer_seq_lens), max_context=index_context, device="cuda")
    lg = torch.full((len(indexer_seq_lens), bt.shape[1] * 64), float("nan"), device=dev)
    indexer_logits(q8, w, cache_k, bt, sl, logits=lg)
    ref = reference_indexer_logits(q8, w, cache_k, bt, sl, compute_dtype=torch.float32)
    lerr = indexer_logits_error(lg, q8, w, cache_k, bt, sl)
    out = torch.full((len(indexer_seq_lens), topk), -7, dtype=torch.int32, device=dev)
    lightning_indexer(q8, w, cache_k, bt, sl, topk, out=out)
    tk = check_topk(out, ref, bt, sl, topk)
    manifest["indexer"] = {"config": icfg.as_dict(), f"us_B64_L{itune_lens[0] // 1024}K": ius,
                           "logits_max_rel_err": lerr, "topk": tk,
                           "ok": bool(lerr <= 1e-3 and tk["ok"] and not (out == -7).any())}
    ok &= manifest["indexer"]["ok"]
    manifest["ok"] = bool(ok)
    manifest["elapsed_s"] = round(time.time() - started, 1)
    path = cache / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, default=str))
    manifest["path"] = str(path)
    if not ok:
        raise KernelsBuildError(f"kernel verification failed on {props.name}; see {path}")
    return manifest


@functools.cache
def _manifest_model(decode_cls: type, indexer_cls: type) -> type:
    """The part of a manifest that :func:`load_manifest` installs, as a pydantic model: launch configs are strict
    ints with exactly the dataclasses' fields (``pdl`` in 0–2, ``merge``, ``bf16_partials`` and ``logits_tma`` 0–1), the rest of the
    manifest is kept as written."""
    import dataclasses as dc
    from typing import Literal

    import pydantic

    strict = pydantic.ConfigDict(extra="forbid", strict=True)

    def launch_model(cls: type) -> type:
        top = {"pdl": 2, "merge": 1, "logits_tma": 1, "bf16_partials": 1}
        fields = {f.name: (int, pydantic.Field(f.default, ge=0, le=top.get(f.name))) for f in dc.fields(cls)}
        return pydantic.create_model(f"{cls.__name__}InManifest", __config__=strict, **fields)

    decode_cfg, indexer_cfg = launch_model(decode_cls), launch_model(indexer_cls)
    entry = pydantic.create_model("DecodeEntry", heads=(int, ...), kv=(Literal["fp8", "bf16", "v4"], ...), rows=(int, ...),
                                  config=(decode_cfg | None, None))
    indexer = pydantic.create_model("IndexerEntry", config=(indexer_cfg | None, None))
    gpu = pydantic.create_model("GpuEntry", name=(str, ...), sm_count=(int | None, None))
    return pydantic.create_model("KernelsManifest", ok=(bool, ...), gpu=(gpu, ...), decode=(list[entry], []),
                                 indexer=(indexer, indexer()),
                                 model=(Literal["deepseek-v3.2", "deepseek-v4"], "deepseek-v3.2"))


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a manifest written by :func:`build_and_verify` and install its tuned configs in this process.

    Raises:
        KernelsBuildError: missing/unreadable manifest, one whose structure or launch configs this pdctl does not
            know (the first offending field is named), a decode config that ``check_decode_config`` refuses for
            its entry's shape (e.g. ``merge`` 1 on a kernel without it, or a merged grid larger than the manifest's
            SM count), ``ok`` false, or a manifest built on another GPU model or with another SM count visible.
            Nothing is installed then.
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    try:
        m = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise KernelsBuildError(f"no usable kernels manifest at {p}: {e}") from e
    import pydantic
    import torch

    from pdctl.kernels._indexer import IndexerConfig, set_indexer_config
    from pdctl.kernels._sparse_mla import DecodeConfig, check_decode_config, set_decode_configs

    try:
        parsed = _manifest_model(DecodeConfig, IndexerConfig).model_validate(m)
    except pydantic.ValidationError as e:  # written by another pdctl version, or edited by hand
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise KernelsBuildError(f"kernels manifest {p}: {where}: {first['msg']} ({e.error_count()} problem(s)); run "
                                "the kernels_built step again (python -m pdctl.kernels build)") from e
    if not parsed.ok:
        raise KernelsBuildError(f"kernels manifest {p} records a failed verification")
    decode = {}
    for i, e in enumerate(parsed.decode):
        if e.config is None:
            continue
        cfg = DecodeConfig(**e.config.model_dump())
        try:  # a config the launcher would refuse at the first decode call is refused here, naming the entry
            check_decode_config(cfg, e.heads, e.rows, e.kv, parsed.gpu.sm_count)
        except ValueError as err:
            raise KernelsBuildError(f"kernels manifest {p}: decode.{i}.config: {err}; run the kernels_built step again "
                                    "(python -m pdctl.kernels build)") from err
        decode[(e.heads, e.kv, e.rows)] = cfg
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.name != parsed.gpu.name:
            raise KernelsBuildError(f"kernels manifest {p} was built on {parsed.gpu.name!r}, this GPU is {props.name!r}")
        if parsed.gpu.sm_count is not None and parsed.gpu.sm_count != props.multi_processor_count:
            # tuned split counts (and merge = 1, which needs its grid resident at once) assume the SM count
            raise KernelsBuildError(f"kernels manifest {p} was built with {parsed.gpu.sm_count} SMs visible, this "
                                    f"{props.name} shows {props.multi_processor_count}; run the kernels_built step "
                                    "again (python -m pdctl.kernels build)")
    indexer = IndexerConfig(**parsed.indexer.config.model_dump()) if parsed.indexer.config is not None else None
    set_decode_configs(decode)
    if indexer is not None:
        set_indexer_config(indexer)
    return m
