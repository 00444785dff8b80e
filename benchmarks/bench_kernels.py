"""Benchmark the DSA kernels on one GPU (written for the H200 device machine), everything side by side in one run.

    python benchmarks/bench_kernels.py [--out kernels/RESULTS.md] [--sections ceil,decode,flashmla,ref,indexer]

Sections (issue 6, item 7):

* ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192³ matmul on random data;
* ours, sparse-MLA decode, h ∈ {16, 32, 64, 128} × B ∈ {1, 8, 64} × {bf16, fp8 656 B} KV, top-k 2048 rows per
  query drawn from 256K slots (≫ L2): each candidate launch config is checked against the reference, then timed;
  the fastest verified one is reported. µs are the median of CUDA-graph replays (launch overhead excluded).
  FLOPs = 2·h·2048·(576+512) per row; bytes = Q + O + unique KV rows (FlashMLA ``tests/lib.py`` accounting);
  roofline time = max(bytes / copy BW, FLOPs / matmul rate), both measured in this run;
* FlashMLA sparse decode (PyPI ``sgl-flash-mla`` 1.0.0, FP8 only, 64/128 heads: smaller h padded to 64 as SGLang
  does) at the same shapes, ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=..., use_legacy=True,
  kv_format="V32")`` on the 656-byte cache; skipped with a note when the package is missing;
* the PyTorch reference (fp32 compute) at the same shapes;
* the indexer (logits + top-2048) at L ∈ {8K, 32K, 128K}, B ∈ {1, 8, 64}, block tables as wide as max context
  32K and 160K (same data, only the width differs; outputs compared bit for bit), against a naive indexer that
  scans the whole max context (gather all pages → bf16 → scores → top-k over the full width).

Writes the Markdown table to ``--out`` (and to ``$OUT/RESULTS.md`` plus raw JSON when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bootstrap() -> None:
    """Make ``pdctl.kernels`` importable from a bare checkout (the device machine has no editable install)."""
    try:
        import pdctl.kernels  # noqa: F401

        return
    except ImportError:
        pass
    sys.path.insert(0, str(REPO))
    import pdctl

    spec = importlib.util.spec_from_file_location(
        "pdctl.kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pdctl.kernels"] = mod
    spec.loader.exec_module(mod)
    pdctl.kernels = mod


def graph_us(fn, reps: int = 100) -> float:
    """Median µs of ``fn`` replayed from a CUDA graph; each replay timed with CUDA events."""
    return graph_us_multi([fn], reps=reps, back_to_back=1)


def graph_us_multi(fns, reps: int = 20, back_to_back: int = 10) -> float:
    """µs per call of a CUDA graph holding ``fns`` in sequence (one call each, typically the same op on different
    inputs so the caches do not serve repeated calls), replayed ``back_to_back`` times between two events.

    Back-to-back replays model a decode step (61 layers run back to back in one graph) and keep the GPU's clocks
    up; an idle H200 drops to ~345 MHz between sparse replays. Returns the median over ``reps`` samples of
    elapsed / (back_to_back · len(fns)).
    """
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(back_to_back):
            g.replay()
        e.record()
        e.synchronize()
        ts.append(a.elapsed_time(e) * 1e3 / (back_to_back * len(fns)))
    ts.sort()
    del g
    return ts[len(ts) // 2]


def rotations(bytes_per_call: float, cap: int = 16) -> int:
    """Input sets to rotate through so one graph replay touches ≥ 3× the 60 MB L2 (at most ``cap``)."""
    return max(1, min(cap, int(-(-3 * 60e6 // max(bytes_per_call, 1)))))


def ws_launch_args(kernel, variant: int, block_h: int, splits: int) -> dict:  # noqa: ANN001
    """``_sparse_mla._ws_launch`` for *kernel*, a warp-specialised kernel that may come from another version of the
    Gluon module (``decode_ws_bounds.py --compare``, ``decode_ws_profile.py --source``): the constexprs it does not
    declare (e.g. ``EVICT_FIRST`` for a module older than it) are left out, launch options kept."""
    from pdctl.kernels._sparse_mla import _ws_launch

    return {k: v for k, v in _ws_launch(variant, block_h, splits).items()
            if k in kernel.arg_names or k in ("num_warps", "maxnreg")}


def indexer_reps(q8, w, bt, sl, b: int, nrot: int) -> list[tuple]:  # noqa: ANN001
    """The *nrot* input sets of an indexer case built for ``b · nrot`` requests, rows ``k·b … (k+1)·b`` each:
    ``(q8, weights, block_table, seq_lens, out, logits)`` with ``out`` int32 [b, 2048] poisoned with −7 and an
    fp32 logits workspace as wide as the block table."""
    import torch

    reps = []
    for k in range(nrot):
        sel = slice(k * b, (k + 1) * b)
        out = torch.full((b, 2048), -7, dtype=torch.int32, device=q8.device)
        lg = torch.empty(b, bt.shape[1] * 64, dtype=torch.float32, device=q8.device)
        reps.append((q8[sel], w[sel], bt[sel], sl[sel], out, lg))
    return reps


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written, 2 GiB each way) and bf16 matmul rate, after a warm-up that brings
    the clocks up (an idle H200 sits at ~375 MHz SM clock: the first run of this script measured 2.75 TB/s cold)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t_end = time.time() + 2.0
    while time.time() < t_end:  # ~2 s of matmuls: clocks up before anything is timed
        for _ in range(20):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
    mus = graph_us(lambda: torch.mm(a, b, out=c), reps=30)
    n = 2 << 30
    x = torch.randint(0, 255, (n // 4,), dtype=torch.int32, device="cuda")
    y = torch.empty_like(x)
    us_graph = graph_us_multi([lambda: y.copy_(x)], reps=10, back_to_back=5)
    ts = []
    for _ in range(10):  # plain stream copies (cudaMemcpyAsync), no graph
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            y.copy_(x)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / 5)
    us = min(us_graph, sorted(ts)[len(ts) // 2])
    del x, y, a, b, c
    return {"copy_GBps": 2 * n / (us * 1e-6) / 1e9, "copy_us_4GiB": us, "copy_graph_us": us_graph,
            "matmul_TFLOPs": 2 * 8192**3 / (mus * 1e-6) / 1e12}


def decode_metrics(h: int, rows: int, fmt: str, us: float, ceil: dict, topk: int = 2048) -> dict:
    flops = 2 * h * topk * (576 + 512) * rows
    kv_bytes = rows * topk * (656 if fmt == "fp8" else 1152)
    byts = kv_bytes + rows * h * 576 * 2 + rows * h * 512 * 2 + rows * topk * 4
    t_mem = byts / (ceil["copy_GBps"] * 1e9)
    t_cmp = flops / (ceil["matmul_TFLOPs"] * 1e12)
    roof = max(t_mem, t_cmp)
    return {"GBps": byts / (us * 1e-6) / 1e9, "TFLOPs": flops / (us * 1e-6) / 1e12,
            "roofline_us": roof * 1e6, "frac_roofline": roof / (us * 1e-6),
            "bound": "mem" if t_mem >= t_cmp else "compute"}


def bench_decode(ceil: dict, heads, batches, fmts, log, with_flashmla: bool, with_ref: bool) -> list[dict]:
    """Every shape's candidates as ``build_and_verify`` tries them, in two passes over the shapes: the plain configs,
    then the launch settings on each shape's fastest. Before each pass the configs it will try are compiled side by
    side in ``_build._compile_workers()`` processes (``_build._precompile``), so that the sweep fits one call."""
    import torch

    from pdctl.kernels._build import (
        _compile_workers,
        _decode_candidates,
        _launch_setting_candidates,
        _precompile,
        decode_job,
        make_decode_case,
    )
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import _pdl_supported

    sm = 0.135234
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    workers = _compile_workers()
    fm = None
    if with_flashmla:
        try:
            import flash_mla as fm  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the machine
            log(f"flash_mla unavailable: {e!r}")
            fm = None

    def candidates(h: int, rows: int, fmt: str) -> list:
        cands = _decode_candidates(h, rows, nsm, fmt)
        if os.environ.get("PDCTL_BENCH_GLUON_ONLY"):
            cands = [c for c in cands if c.gluon]
        return cands

    def precompile(cands: dict) -> None:
        jobs = [decode_job(h, rows, fmt, 2048, sm, c, slots=262144, ragged=False, with_length=False)  # as below
                for (fmt, h, rows), cs in cands.items() for c in cs]
        t0 = time.time()
        info = _precompile(jobs, workers, torch.cuda.current_device())
        log(f"precompiled {info} ({time.time() - t0:.0f}s)")

    shapes = [(fmt, h, rows) for fmt in fmts for h in heads for rows in batches]
    plain = {key: candidates(key[1], key[2], key[0]) for key in shapes}
    precompile(plain)
    state: dict[tuple, dict] = {}
    for key in shapes:
        fmt, h, rows = key
        r = {"fmt": fmt, "h": h, "B": rows}
        st = state[key] = {"r": r, "timed": []}
        try:
            q, kv, idx, _ = make_decode_case(h, rows, fmt, slots=262144, ragged=False, with_length=False)
            ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
            nrot = rotations(rows * 2048 * (656 if fmt == "fp8" else 1152))
            idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                            .to(torch.int32) for _ in range(nrot - 1)]
            r["rotations"] = nrot
            st.update(q=q, kv=kv, idx=idx, idxs=idxs, ro=ro, rl=rl,
                      o=torch.empty(rows, h, 512, dtype=q.dtype, device="cuda"),
                      lse=torch.empty(rows, h, dtype=torch.float32, device="cuda"))
            for cfg in plain[key]:
                _bench_attempt(st, cfg, sm, log)
            if st["timed"]:
                r["plain_us"] = min(st["timed"], key=lambda x: x[0])[0]
        except Exception:
            r["error"] = traceback.format_exc()[-600:]
    # as build_and_verify: launch settings (PDL, the in-kernel merge) on each shape's fastest plain configs
    settings = {key: _launch_setting_candidates([cfg for _, cfg, _, _ in sorted(st["timed"], key=lambda x: x[0])],
                                                key[1], key[2], nsm, _pdl_supported(torch.device("cuda")),
                                                plain_us=sorted(us for us, _, _, _ in st["timed"]))
                for key, st in state.items() if "error" not in st["r"]}
    precompile(settings)
    rows_out = []
    for key in shapes:
        fmt, h, rows = key
        st = state.pop(key)
        r = st["r"]
        try:
            if "error" in r:
                raise RuntimeError(r["error"])
            for cfg in settings[key]:
                _bench_attempt(st, cfg, sm, log)
            q, kv, idx, idxs, ro = st["q"], st["kv"], st["idx"], st["idxs"], st["ro"]
            if st["timed"]:
                best = min(st["timed"], key=lambda x: x[0])
                r.update(ours_us=best[0], cfg=best[1].as_dict(), err=best[2], regs=best[3])
                r.update(decode_metrics(h, rows, fmt, best[0], ceil))
            if with_ref:
                r["ref_us"] = graph_us_multi([lambda: reference_sparse_mla_decode(
                    q, kv, idx, sm, None, compute_dtype=torch.float32)], reps=10, back_to_back=3)
            if fm is not None and fmt == "fp8":
                hp = 64 if h <= 64 else 128
                call = flashmla_call(fm, q, kv, idx, hp, sm)
                fo, flse = call()
                torch.cuda.synchronize()
                r["flashmla_err_vs_ref"] = (fo[:, 0, :h].float() - ro).abs().max().item()
                r["flashmla_us"] = graph_us_multi([lambda ix=ix: call(ix) for ix in idxs])
                r["flashmla_heads"] = hp
        except Exception:
            r.setdefault("error", traceback.format_exc()[-600:])
        del st
        torch.cuda.empty_cache()
        log(json.dumps({k: v for k, v in r.items() if k not in ("err", "all")}, default=str))
        rows_out.append(r)
    return rows_out


def flashmla_call(fm, q, kv, idx, heads: int, sm: float):  # noqa: ANN001, ANN201
    """FlashMLA's sparse decode (``sgl-flash-mla`` 1.0.0) on *q* ``[rows, h, 576]`` padded to *heads* (64 or 128, the
    only counts it takes, as SGLang pads) over the 656-byte FP8 cache *kv*: a function of the top-k rows (default
    *idx*) returning ``(out [rows, 1, heads, 512], lse)``."""
    import torch

    rows, h = q.shape[0], q.shape[1]
    qp = torch.zeros(rows, 1, heads, 576, dtype=torch.bfloat16, device="cuda")
    qp[:, 0, :h] = q
    kc = kv.view(-1, 64, 1, 656)
    sched, _ = fm.get_mla_metadata()

    def call(ix=idx):  # noqa: ANN001, ANN202
        return fm.flash_mla_with_kvcache(qp, kc, None, None, 512, sched, None, sm, False, True,
                                         ix.view(rows, 1, -1), use_legacy=True, kv_format="V32")

    return call


def _bench_attempt(st: dict, cfg, sm: float, log) -> None:  # noqa: ANN001
    """Check *cfg* on the shape held in *st* against the fp32 reference (outputs poisoned with NaN first); time it
    if it passes (CUDA-graph replay over the shape's rotated index sets) and add it to ``st["timed"]``."""
    import torch

    from pdctl.kernels._build import _decode_tolerance_check
    from pdctl.kernels._sparse_mla import LAST_LAUNCH, sparse_mla_decode

    q, kv, idx, o, lse, r = st["q"], st["kv"], st["idx"], st["o"], st["lse"], st["r"]
    try:
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
        torch.cuda.synchronize()
    except Exception as e:
        log(f"  cfg {cfg} failed to run: {str(e)[:160]}")
        return
    err = _decode_tolerance_check(o, lse, st["ro"], st["rl"])
    if not err["ok"]:
        log(f"  cfg {cfg} WRONG: {err}")
        r.setdefault("wrong_cfgs", []).append(cfg.as_dict())
        return
    regs = dict(LAST_LAUNCH)
    us = graph_us_multi([lambda ix=ix: sparse_mla_decode(q, kv, ix, sm, None, out=o, lse=lse, config=cfg)
                         for ix in st["idxs"]])
    r.setdefault("all", []).append((round(us, 2), cfg.as_dict(), regs))
    st["timed"].append((us, cfg, err, regs))


def bench_f16_experiment(heads, batches, log) -> list[dict]:
    """FP8 KV: bf16 vs fp16 MMA operands (``DecodeConfig.mma_f16``), same configs, same inputs, same call, next to
    FlashMLA. Configs: the two shapes of config that won at h ≤ 32 in the full sweep (16-head blocks; 32-row tiles
    × 4 warps with chunk re-reads, or 64-row tiles × 8 warps with register prefetch), splits bracketing one
    program per SM."""
    import torch

    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import DecodeConfig, sparse_mla_decode

    sm = 0.135234
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import flash_mla as fm
    except Exception:
        fm = None
    res = []
    for h in heads:
        for rows in batches:
            r = {"fmt": "fp8", "h": h, "B": rows, "experiment": "mma_f16"}
            try:
                q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
                ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
                o = torch.empty(rows, h, 512, dtype=q.dtype, device="cuda")
                lse = torch.empty(rows, h, dtype=torch.float32, device="cuda")
                nrot = rotations(rows * 2048 * 656)
                idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                                .to(torch.int32) for _ in range(nrot - 1)]
                progs = rows * -(-h // 16)
                s0 = 1
                while s0 * progs < nsm and s0 < 32:
                    s0 *= 2
                for f16 in (0, 1):
                    best = None
                    for bn, warps, pf in ((32, 4, 2), (64, 8, 1)):
                        for splits in sorted({s0, min(64, 2 * s0)}):
                            cfg = DecodeConfig(16, bn, warps, 2, splits, pf, f16)
                            o.fill_(float("nan"))
                            sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
                            err = _decode_tolerance_check(o, lse, ro, rl)
                            if not err["ok"]:
                                r.setdefault("wrong", []).append((cfg.as_dict(), err))
                                continue
                            us = graph_us_multi([lambda cfg=cfg, ix=ix: sparse_mla_decode(
                                q, kv, ix, sm, None, out=o, lse=lse, config=cfg) for ix in idxs])
                            if best is None or us < best[0]:
                                best = (us, cfg.as_dict(), err["max_abs_err"])
                    r["f16" if f16 else "bf16"] = best
                if fm is not None:
                    call = flashmla_call(fm, q, kv, idx, 64, sm)
                    call()
                    r["flashmla_us"] = graph_us_multi([lambda ix=ix: call(ix) for ix in idxs])
                del q, kv, idx, idxs, ro, rl, o, lse
                torch.cuda.empty_cache()
            except Exception:
                r["error"] = traceback.format_exc()[-600:]
            log(json.dumps(r, default=str))
            res.append(r)
    return res


def naive_indexer(q8, w, cache, bt, sl, topk: int):
    """What a careless drop-in does: score every token of the full-width block table, top-k over the full row."""
    import torch

    b, width = bt.shape
    k8 = cache[:, :8192].view(torch.float8_e4m3fn).view(-1, 64, 128)
    ks = cache[:, 8192:].view(torch.float32).view(-1, 64)
    kk = k8[bt.long()].view(b, width * 64, 128).to(torch.bfloat16)
    s = torch.einsum("bhd,bnd->bhn", q8.to(torch.bfloat16), kk).float()
    logits = (s.relu() * w[:, :, None]).sum(1) * ks[bt.long()].view(b, width * 64)
    pos = torch.arange(width * 64, device=q8.device)
    logits = logits.masked_fill(pos[None, :] >= sl[:, None].long(), float("-inf"))
    return torch.topk(logits, topk, dim=1, sorted=False).indices


def bench_indexer(ceil: dict, lens, batches, log, naive_for=(8192,)) -> list[dict]:
    """Indexer at max-context widths 32K and 160K on the same data (only the block table's width differs).

    Small problems rotate through R replicas (distinct requests with distinct pages) inside one graph so that
    the caches do not serve repeated calls; outputs are compared as sets (the top-k is unsorted and atomics order
    the slots).
    """
    import torch

    from pdctl.kernels._build import check_topk, make_indexer_case
    from pdctl.kernels._indexer import _TUNED, IndexerConfig, indexer_logits, lightning_indexer
    from pdctl.kernels._reference import reference_indexer_logits

    icfg = _TUNED.get("default") or IndexerConfig()
    out_rows = []
    for L in lens:
        for B in batches:
            r = {"L": L, "B": B}
            try:
                nrot = rotations(B * L * 132, cap=8)
                r["rotations"] = nrot
                q8, w, cache, bt160, sl = make_indexer_case([L] * (B * nrot), max_context=163840)
                widths = {"160K": bt160}
                if L <= 32768:
                    widths["32K"] = bt160[:, : 32768 // 64].contiguous()
                outs = {}
                for name, bt in widths.items():
                    reps = indexer_reps(q8, w, bt, sl, B, nrot)
                    q, ww, b_, s_, out, lg = reps[0]
                    lightning_indexer(q, ww, cache, b_, s_, 2048, out=out, logits=lg)
                    torch.cuda.synchronize()
                    outs[name] = out.sort(dim=1).values.clone()
                    r[f"us_{name}"] = graph_us_multi([lambda a=a: lightning_indexer(
                        a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5]) for a in reps])
                    r[f"logits_us_{name}"] = graph_us_multi([lambda a=a: indexer_logits(
                        a[0], a[1], cache, a[2], a[3], logits=a[5]) for a in reps])
                    if name == "160K":  # the same calls with programmatic dependent launches (both trigger points)
                        for mode in (1, 2):
                            pcfg = dataclasses.replace(icfg, pdl=mode)
                            r[f"us_160K_pdl{mode}"] = graph_us_multi([lambda a=a, pcfg=pcfg: lightning_indexer(
                                a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5], config=pcfg) for a in reps])
                if "32K" in outs:
                    r["same_output_32K_160K"] = bool(torch.equal(outs["32K"], outs["160K"]))
                if B * L <= 8 * 32768:  # reference check where it is cheap enough
                    ref = reference_indexer_logits(q8[:B], w[:B], cache, bt160[:B], sl[:B], compute_dtype=torch.float32)
                    out = torch.full((B, 2048), -7, dtype=torch.int32, device="cuda")
                    lightning_indexer(q8[:B], w[:B], cache, bt160[:B], sl[:B], 2048, out=out)
                    r["topk_check"] = check_topk(out, ref, bt160[:B], sl[:B], 2048)
                byts = B * L * 132
                r["GBps"] = byts / (r["us_160K"] * 1e-6) / 1e9
                r["frac_copy"] = r["GBps"] * 1e9 / (ceil["copy_GBps"] * 1e9)
                if L in naive_for:
                    for name, bt in widths.items():
                        try:
                            r[f"naive_us_{name}"] = graph_us_multi(
                                [lambda bt=bt: naive_indexer(q8[:B], w[:B], cache, bt[:B], sl[:B], 2048)],
                                reps=5, back_to_back=3)
                        except Exception as e:
                            r[f"naive_us_{name}"] = f"failed: {str(e)[:120]}"
                del q8, w, cache, bt160, widths, sl
                torch.cuda.empty_cache()
            except Exception:
                r["error"] = traceback.format_exc()[-600:]
            log(json.dumps(r, default=str))
            out_rows.append(r)
    return out_rows


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) else "—"


def _kernel_label(c: dict) -> str:
    """``gluon-N: BH,splits`` for the Gluon kernel, ``tl.dot: BH,BN,warps,splits,prefetch`` otherwise; then
    `` fold`` (``DecodeConfig.fold``), `` qk-chains``, `` pdl-N``, `` merged`` and `` bf16-partials`` where set."""
    pdl = ((" fold" if c.get("fold") else "") + (" qk-chains" if c.get("qk_chains") else "")
           + (f" pdl-{c['pdl']}" if c.get("pdl") else "")
           + (" merged" if c.get("merge") else "") + (" bf16-partials" if c.get("bf16_partials") else ""))
    if c.get("gluon"):
        return f"gluon-{c['gluon']}: {c['block_h']},{c['splits']}{pdl}"
    return f"tl.dot: {c['block_h']},{c['block_n']},{c['num_warps']},{c['splits']},{c.get('prefetch', 0)}{pdl}"


def render(meta: dict, ceil: dict, dec: list[dict], idx: list[dict]) -> str:
    lines = [
        "# pdctl.kernels — measured results",
        "",
        f"Machine: {meta['gpu']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, "
        f"flash_mla {meta.get('flash_mla', 'n/a')}; {meta['date']}. Produced by `benchmarks/bench_kernels.py`; "
        "µs = median of CUDA-graph replays (launch overhead excluded).",
        "",
        f"Ceilings (this run, after a 2 s warm-up): copy {ceil.get('copy_GBps', 0) / 1e3:.2f} TB/s (read + write), "
        f"bf16 matmul {ceil.get('matmul_TFLOPs', 0):.0f} TFLOP/s.",
        "",
        "## Sparse-MLA decode (top-k 2048, sm_scale 0.135234)",
        "",
        "| KV | h | B | ours µs | GB/s | TFLOP/s | roofline µs | % roofline | FlashMLA µs (heads) | ours/FlashMLA | torch ref µs | kernel: config | best plain-launch µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in dec:
        if "ours_us" not in r:
            lines.append(f"| {r['fmt']} | {r['h']} | {r['B']} | error | | | | | | | | {str(r.get('error', ''))[-80:]!r} | |")
            continue
        c = r["cfg"]
        fl = r.get("flashmla_us")
        ratio = f"{r['ours_us'] / fl:.2f}" if isinstance(fl, float) else "—"
        lines.append(
            f"| {r['fmt']} | {r['h']} | {r['B']} | {r['ours_us']:.1f} | {r['GBps']:.0f} | {r['TFLOPs']:.0f} | "
            f"{r['roofline_us']:.1f} ({r['bound']}) | {100 * r['frac_roofline']:.0f}% | "
            f"{_f(fl)}{' (' + str(r['flashmla_heads']) + ')' if fl else ''} | {ratio} | {_f(r.get('ref_us'))} | "
            f"{_kernel_label(c)} | {_f(r.get('plain_us'))} |"
        )
    lines += [
        "",
        "## Lightning indexer (64 heads × 128, FP8 132 B/token, logits + exact top-2048, physical slots)",
        "",
        "| L | B | ΣL | ours µs (max ctx 32K) | ours µs (160K) | GB/s (132 B/token) | % copy BW | logits-only µs (160K) | logits % copy BW | same output 32K/160K | naive full-scan µs (32K / 160K) | top-k check | µs (160K) with PDL trigger at start / after main loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in idx:
        if "us_160K" not in r:
            lines.append(f"| {r['L']} | {r['B']} | | error | | | | | | | | {str(r.get('error', ''))[-80:]!r} | |")
            continue
        tk = r.get("topk_check")
        lines.append(
            f"| {r['L']} | {r['B']} | {r['L'] * r['B']} | {_f(r.get('us_32K'))} | {r['us_160K']:.1f} | "
            f"{r['GBps']:.0f} | {100 * r['frac_copy']:.0f}% | {r['logits_us_160K']:.1f} | "
            f"{100 * r['frac_copy'] * r['us_160K'] / r['logits_us_160K']:.0f}% | "
            f"{r.get('same_output_32K_160K', '—')} | {_f(r.get('naive_us_32K'), '{:.0f}')} / "
            f"{_f(r.get('naive_us_160K'), '{:.0f}')} | {('ok' if tk['ok'] else 'FAIL') if tk else '—'} | "
            f"{_f(r.get('us_160K_pdl1'))} / {_f(r.get('us_160K_pdl2'))} |"
        )
    return "\n".join(lines) + "\n"


def bench_indexer_sweep(ceil: dict, log, cases=((8192, 1), (32768, 8), (131072, 1), (131072, 8), (32768, 64))
                        ) -> list[dict]:
    """Indexer launch configs side by side (section ``isweep``): logits-only µs for each logits config, then the
    whole indexer (logits + top-k) for top-k variants on the fastest logits config. Every config's top-k is
    compared, as a set, with the default config's output."""
    import torch

    from pdctl.kernels._build import make_indexer_case
    from pdctl.kernels._indexer import IndexerConfig, indexer_logits, lightning_indexer

    logit_cfgs = [IndexerConfig(chunk_pages=1, logits_warps=4, logits_stages=st, programs_per_sm=pp)
                  for st in (5, 6) for pp in (4, 8)]
    rows = []
    for L, B in cases:
        q8, w, cache, bt, sl = make_indexer_case([L] * B, max_context=163840)
        lg = torch.empty(B, bt.shape[1] * 64, dtype=torch.float32, device="cuda")
        ref = lightning_indexer(q8, w, cache, bt, sl, 2048, logits=lg).sort(dim=1).values.clone()
        res = []
        for cfg in logit_cfgs:
            try:
                us = graph_us_multi([lambda cfg=cfg: indexer_logits(q8, w, cache, bt, sl, logits=lg, config=cfg)])
                same = bool(torch.equal(lightning_indexer(q8, w, cache, bt, sl, 2048, logits=lg, config=cfg)
                                        .sort(dim=1).values, ref))
                res.append((us, cfg, same))
            except Exception as e:
                log(f"  isweep {cfg} failed: {str(e)[:160]}")
        res.sort(key=lambda x: x[0])
        byts = B * L * 132
        for us, cfg, same in res:
            log(f"isweep L={L} B={B} logits {us:.1f} us {byts / us / 1e3 / ceil['copy_GBps']:.0%} copy same={same} {cfg}")
        best = next((c for _, c, ok in res if ok), IndexerConfig())
        from dataclasses import replace

        full = []
        for tp, tb, tw, fh, rw, rb in ((528, 1024, 4, 0, 4, 512), (1056, 1024, 4, 0, 4, 512),
                                       (264, 1024, 4, 0, 4, 512), (528, 1024, 4, 1, 4, 512),
                                       (528, 2048, 8, 0, 4, 512), (528, 1024, 4, 0, 4, 256),
                                       (528, 1024, 4, 0, 4, 1024), (528, 1024, 4, 0, 8, 1024),
                                       (528, 1024, 4, 0, 8, 2048)):
            cfg = replace(best, topk_programs=tp, topk_block=tb, topk_warps=tw, fuse_hist0=fh, refine_warps=rw,
                          refine_block=rb)
            try:
                us = graph_us_multi([lambda cfg=cfg: lightning_indexer(q8, w, cache, bt, sl, 2048, logits=lg, config=cfg)])
                same = bool(torch.equal(lightning_indexer(q8, w, cache, bt, sl, 2048, logits=lg, config=cfg)
                                        .sort(dim=1).values, ref))
                full.append((us, cfg, same))
                log(f"isweep L={L} B={B} full {us:.1f} us {byts / us / 1e3 / ceil['copy_GBps']:.0%} copy same={same} {cfg}")
            except Exception as e:
                log(f"  isweep {cfg} failed: {str(e)[:160]}")
        rows.append({"L": L, "B": B, "logits": [(round(u, 2), c.as_dict(), ok) for u, c, ok in res],
                     "full": [(round(u, 2), c.as_dict(), ok) for u, c, ok in full]})
        del q8, w, cache, bt, sl, lg
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "kernels" / "RESULTS.md"))
    ap.add_argument("--sections", default="ceil,decode,flashmla,ref,indexer")
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--fmts", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--lens", type=int, nargs="+", default=[8192, 32768, 131072])
    args = ap.parse_args(argv)
    _bootstrap()
    import torch
    import triton

    out_dir = os.environ.get("OUT")
    logf = open(Path(out_dir) / "bench.log", "a") if out_dir else None

    def log(msg: str) -> None:
        print(msg, flush=True)
        if logf:
            logf.write(msg + "\n")
            logf.flush()

    sec = set(args.sections.split(","))
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import flash_mla

        meta["flash_mla"] = getattr(flash_mla, "__version__", "?")
    except Exception as e:
        meta["flash_mla"] = f"not importable ({type(e).__name__})"
    t0 = time.time()
    ceil = ceilings() if "ceil" in sec else {"copy_GBps": 4270.0, "matmul_TFLOPs": 680.0}
    log(f"ceilings {ceil} ({time.time() - t0:.0f}s)")
    dec = bench_decode(ceil, args.heads, args.batches, args.fmts, log, "flashmla" in sec, "ref" in sec) \
        if "decode" in sec else []
    log(f"decode done ({time.time() - t0:.0f}s)")
    idx = bench_indexer(ceil, args.lens, args.batches, log) if "indexer" in sec else []
    log(f"indexer done ({time.time() - t0:.0f}s)")
    if out_dir:  # the tables so far, in case a time limit cuts the sweep below
        (Path(out_dir) / "RESULTS.partial.md").write_text(render(meta, ceil, dec, idx))
    isw = bench_indexer_sweep(ceil, log) if "isweep" in sec else []
    log(f"indexer sweep done ({time.time() - t0:.0f}s)")
    f16 = bench_f16_experiment(args.heads, args.batches, log) if "f16" in sec else []
    if f16:
        log("| h | B | bf16-MMA µs | fp16-MMA µs | FlashMLA µs (64 heads) |")
        for r in f16:
            log(f"| {r['h']} | {r['B']} | {_f((r.get('bf16') or [None])[0])} | {_f((r.get('f16') or [None])[0])} | "
                f"{_f(r.get('flashmla_us'))} |")
    text = render(meta, ceil, dec, idx)
    print(text)
    Path(args.out).write_text(text)
    if out_dir:
        (Path(out_dir) / "RESULTS.md").write_text(text)
        (Path(out_dir) / "bench.json").write_text(json.dumps({"meta": meta, "ceil": ceil, "decode": dec,
                                                                "indexer": idx, "f16": f16, "isweep": isw}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
