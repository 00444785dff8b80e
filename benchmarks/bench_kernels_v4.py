"""Benchmark pdctl's DeepSeek-V4 kernels on one GPU (the H200 device machine), everything side by side in one run
(issue 43, item 6).

    python benchmarks/bench_kernels_v4.py [--sections ceil,decode,flashmla,ref,indexer] [--heads 8 16 32 64] ...

* ceilings: ``bench_kernels.ceilings`` (device copy bandwidth, bf16 8192³ matmul), measured in this run;
* decode of a c4 layer as sglang 0.5.23's dsv4 backend calls FlashMLA for it: q ``[B, h, 512]``, a 128-token window
  in the SWA cache (256-token pages of 584-byte V4 rows) beside the indexer's top-k compressed rows in the c4 cache
  (64-row pages), attention sink, ``softmax_scale`` 512^-0.5; h ∈ {8, 16, 32, 64} (V4-Flash's 64 heads at TP 8/4/2/1,
  V4-Pro's 128 at TP 8/4/2), B ∈ {1, 8, 64}, top-512 (Flash) and top-1024 (Pro):
  - ours (``sparse_decode_v4``): every candidate of ``_build._decode_candidates_v4`` checked against the fp32
    reference, the fastest verified one reported, then PDL and bf16 partials tried on the three fastest;
  - FlashMLA (PyPI ``sgl-flash-mla`` 1.0.0, ``flash_mla_with_kvcache(..., use_legacy=True, kv_format="V4")``, the
    legacy SM90 kernel SGLang calls), which takes 64 or 128 heads only: h < 64 padded to 64 with zero rows and zero
    sinks, as SGLang pads (``models/deepseek_v4.py`` ``_kernel_num_heads``); its output is checked against our
    reference too (this is where the 584-byte quantiser is checked against FlashMLA);
  - the PyTorch reference (``reference_sparse_decode_v4`` in fp32).
  µs: median of CUDA-graph replays, 10 back to back, rotating through input sets whose rows do not fit L2.
* indexer over compressed rows (the V4 C4 indexer, top-512): requests of L ∈ {8K, 32K, 128K} tokens, i.e. L/4
  compressed rows, B ∈ {1, 8, 64}, page tables as wide as max context 128K and 1M tokens (512 and 4096 pages of 64
  compressed rows): ours (``lightning_indexer``) at both widths (outputs compared), against SGLang 0.5.23's torch
  path for SM120 — ``fp8_paged_mqa_logits_torch_sm120`` + ``topk_transform_pytorch_vectorized`` (its
  ``dsa_topk_backend`` torch transform), copied verbatim below — at both widths.

Writes ``$OUT/RESULTS_V4.md`` (the tables) and ``$OUT/bench_v4.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, ceilings, graph_us_multi, rotations  # noqa: E402

SM = 512 ** -0.5


# --- SGLang 0.5.23's torch indexer path (python/sglang/srt/layers/attention/dsv4/indexer.py), verbatim ----------

_arange_cache: dict = {}


def fp8_paged_mqa_logits_torch_sm120(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata,
                                     max_seq_len, clean_logits=True):
    """sglang 0.5.23 ``dsv4/indexer.py`` ``fp8_paged_mqa_logits_torch_sm120`` (the 1024-row chunking dropped: B ≤ 64
    here); its gather spans ``ceil(max_seq_len / 64)`` pages of every row, the page table's width under graphs."""
    import torch
    import torch.nn.functional as F  # noqa: F401

    batch_size, _, num_heads, head_dim = q_fp8.shape
    block_size = kvcache_fp8.shape[1]
    device = q_fp8.device
    assert head_dim == 128 and block_size == 64 and clean_logits is False
    max_pages = (max_seq_len + block_size - 1) // block_size
    max_padded_seq = max_pages * block_size
    kvcache_flat = kvcache_fp8.view(-1, block_size * (head_dim + 4))
    SCALE_OFFSET = block_size * head_dim
    page_ids = page_table[:, :max_pages]
    kvcache_gathered = kvcache_flat[page_ids]
    kv_value_raw = kvcache_gathered[..., :SCALE_OFFSET]
    kv_scale_raw = kvcache_gathered[..., SCALE_OFFSET:]
    kv_value = kv_value_raw.contiguous().view(dtype=torch.float8_e4m3fn).to(torch.bfloat16)
    kv_value = kv_value.view(batch_size, max_padded_seq, head_dim)
    kv_scale = kv_scale_raw.contiguous().view(dtype=torch.float32)
    kv_scale = kv_scale.view(batch_size, max_padded_seq)
    q = q_fp8[:, 0].to(torch.bfloat16)
    score = torch.bmm(kv_value, q.transpose(1, 2))
    score = torch.relu(score)
    score = score * weight.unsqueeze(1)
    score = score.sum(dim=2)
    score = score * kv_scale
    out_width = min(max_padded_seq, max_seq_len)
    logits = score.new_full((batch_size, max_seq_len), float("-inf"))
    logits[:, :out_width] = score[:, :out_width]
    positions = torch.arange(max_seq_len, device=device)
    invalid_mask = positions.unsqueeze(0) >= seq_lens.unsqueeze(1)
    logits.masked_fill_(invalid_mask, float("-inf"))
    return logits


def topk_transform_pytorch_vectorized(scores, seq_lens, page_tables, out_page_indices, page_size):
    """sglang 0.5.23 ``dsv4/indexer.py`` ``_topk_transform_vectorized`` with ``torch.topk`` (what
    ``topk_transform_pytorch_vectorized`` runs; ``out_raw_indices`` None): a top-k over the whole
    ``[B, max_seq_len]`` row."""
    import torch
    import torch.nn.functional as F

    TOPK = out_page_indices.shape[1]
    batch_size = scores.shape[0]
    max_seq_len = scores.shape[1]
    device = scores.device
    page_bits = (page_size - 1).bit_length() if page_size > 1 else 0
    page_mask = page_size - 1
    cache = _arange_cache
    for key, n, dt in ((f"s{max_seq_len}", max_seq_len, torch.int64), (f"k{TOPK}", TOPK, torch.int32),
                       (f"b{batch_size}", batch_size, torch.int64)):
        if key not in cache:
            cache[key] = torch.arange(n, device=device, dtype=dt)
    positions = cache[f"s{max_seq_len}"].unsqueeze(0).expand(batch_size, -1)
    valid_mask = positions < seq_lens.unsqueeze(1)
    masked_scores = scores.clone()
    masked_scores.masked_fill_(~valid_mask, float("-inf"))
    actual_k = min(TOPK, max_seq_len)
    _, raw_indices = torch.topk(masked_scores, actual_k, dim=1, largest=True, sorted=False)
    raw_indices = raw_indices.to(torch.int32)
    if actual_k < TOPK:
        raw_indices = F.pad(raw_indices, (0, TOPK - actual_k), value=0)
    batch_indices = cache[f"b{batch_size}"].unsqueeze(1).expand(-1, TOPK)
    gathered_scores = scores[batch_indices.flatten(), raw_indices.clamp(min=0).flatten()].view(batch_size, TOPK)
    valid_topk = gathered_scores != float("-inf")
    needs_sequential = seq_lens <= TOPK
    sequential_indices = cache[f"k{TOPK}"].unsqueeze(0).expand(batch_size, -1)
    sequential_valid = sequential_indices < seq_lens.unsqueeze(1)
    seq_indices_or_neg1 = sequential_indices.clone()
    seq_indices_or_neg1.masked_fill_(~sequential_valid, -1)
    needs_seq_mask = needs_sequential.unsqueeze(1).expand(-1, TOPK)
    raw_indices = torch.where(needs_seq_mask, seq_indices_or_neg1, raw_indices)
    valid_topk = torch.where(needs_seq_mask, sequential_valid, valid_topk)
    page_idx = raw_indices >> page_bits
    offset_in_page = raw_indices & page_mask
    page_idx_clamped = torch.clamp(page_idx, min=0)
    physical_pages = torch.gather(page_tables, dim=1, index=page_idx_clamped.long())
    page_indices = (physical_pages << page_bits) | offset_in_page
    page_indices = page_indices.to(torch.int32)
    page_indices.masked_fill_(~valid_topk, -1)
    out_page_indices.copy_(page_indices)


def sglang_torch_indexer(q8, w, cache, bt, sl, out):
    """The two calls as ``forward_c4_indexer`` makes them on SM120 (max_seq_len = the page table's width · 64)."""
    logits = fp8_paged_mqa_logits_torch_sm120(q8.unsqueeze(1), cache.view(-1, 64, 1, 132), w, sl, bt, None,
                                              bt.shape[1] * 64, False)
    topk_transform_pytorch_vectorized(logits, sl, bt, out, 64)


# --- decode -------------------------------------------------------------------------------------------------------

def _check(o, lse, ro, rlse) -> dict:
    from pdctl.kernels._build import _decode_tolerance_check

    return _decode_tolerance_check(o, lse, ro, rlse)


def flashmla_v4(fm, case: dict, pad_heads: int):
    """FlashMLA's legacy V4 decode on *case* (``make_v4_decode_case``), q and sink padded to *pad_heads* with zeros:
    returns a function of no arguments giving ``(out [B, 1, pad, 512], lse [B, pad, 1])``."""
    import torch

    q = case["q"]
    b, h = q.shape[0], q.shape[1]
    qp = torch.zeros(b, 1, pad_heads, 512, dtype=torch.bfloat16, device="cuda")
    qp[:, 0, :h] = q
    sink = torch.zeros(pad_heads, dtype=torch.float32, device="cuda")
    if case["attn_sink"] is not None:
        sink[:h] = case["attn_sink"]
    sched = fm.get_mla_metadata()[0]

    def call():  # noqa: ANN202
        return fm.flash_mla_with_kvcache(
            qp, case["cache"], None, None, 512, sched, softmax_scale=SM, is_fp8_kvcache=True,
            indices=case["indices"].view(b, 1, -1), attn_sink=sink, extra_k_cache=case["extra_cache"],
            extra_indices_in_kvcache=case["extra_indices"].view(b, 1, -1), topk_length=case["topk_length"],
            extra_topk_length=case["extra_topk_length"], use_legacy=True, kv_format="V4")

    return call


def bench_decode(heads, batches, topks, sections, log, partial=None) -> list[dict]:
    import dataclasses

    import torch

    from pdctl.kernels._build import (
        _compile_workers,
        _decode_candidates_v4,
        _precompile,
        decode_job,
        make_v4_decode_case,
    )
    from pdctl.kernels._reference import reference_sparse_decode_v4
    from pdctl.kernels._sparse_mla import sparse_decode_v4

    fm = None
    if "flashmla" in sections:
        try:
            import flash_mla as fm
        except Exception as e:  # noqa: BLE001
            log(f"flash_mla not importable: {e!r}")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(h, b, k) for k in topks for h in (heads if k == 512 else [h for h in heads if 16 <= h <= 32])
              for b in batches]  # top-1024 is V4-Pro's: 16 and 32 local heads at TP8 / TP4
    cands = {s: _decode_candidates_v4(s[0], s[1], num_sms, 128 + s[2]) for s in shapes}
    workers = _compile_workers()
    t0 = time.time()
    info = _precompile([decode_job(h, b, "v4", k, SM, c, ragged=False) for (h, b, k), cs in cands.items()
                        for c in cs], workers, 0)
    log(f"precompile {info} ({time.time() - t0:.0f}s)")
    rows = []
    for (h, b, k) in shapes:
        r: dict = {"h": h, "B": b, "topk": k}
        try:
            nrot = rotations(b * (128 + k) * 584, cap=8)
            cases = [make_v4_decode_case(h, b, topk=k, ragged=False, slots=1 << 18) for _ in range(nrot)]
            # one check case: ragged lengths, an empty row, sinks of ±inf
            chk = make_v4_decode_case(h, b, topk=k, slots=1 << 16)
            ro, rl = reference_sparse_decode_v4(sm_scale=SM, compute_dtype=torch.float32, **chk)
            outs = [(torch.empty(b, h, 512, dtype=torch.bfloat16, device="cuda"),
                     torch.empty(b, h, dtype=torch.float32, device="cuda")) for _ in range(nrot)]
            timed = []

            def attempt(cfg):  # noqa: ANN001, ANN202
                o = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                ls = torch.full((b, h), float("nan"), device="cuda")
                sparse_decode_v4(sm_scale=SM, config=cfg, out=o, lse=ls, **chk)
                torch.cuda.synchronize()
                err = _check(o, ls, ro, rl)
                if not err["ok"]:
                    r.setdefault("failed", []).append({"config": cfg.as_dict(), "err": err})
                    return
                us = graph_us_multi([lambda c=c, oo=oo, cfg=cfg: sparse_decode_v4(
                    sm_scale=SM, config=cfg, out=oo[0], lse=oo[1], **c) for c, oo in zip(cases, outs)])
                timed.append((us, cfg, err))

            for cfg in cands[(h, b, k)]:
                try:
                    attempt(cfg)
                except Exception as e:  # noqa: BLE001
                    r.setdefault("skipped", []).append(f"{cfg}: {str(e)[:120]}")
            timed.sort(key=lambda x: x[0])
            for _us, cfg, _e in timed[:3]:  # launch settings on the three fastest
                for extra in ([dict(pdl=1), dict(pdl=2)] + ([dict(bf16_partials=1), dict(pdl=1, bf16_partials=1)]
                                                             if cfg.splits > 1 else [])):
                    try:
                        attempt(dataclasses.replace(cfg, **extra))
                    except Exception as e:  # noqa: BLE001
                        r.setdefault("skipped", []).append(f"{extra}: {str(e)[:120]}")
            timed.sort(key=lambda x: x[0])
            if timed:
                us, cfg, err = timed[0]
                r.update(us=us, config=cfg.as_dict(), err={kk: err[kk] for kk in ("max_abs_err", "rel_fro_err",
                                                                                  "lse_max_abs_err")})
                r["configs_verified"] = len(timed)
            if fm is not None and h <= 128:
                pad = 64 if h <= 64 else 128
                try:
                    call = flashmla_v4(fm, chk, pad)
                    fo, flse = call()
                    torch.cuda.synchronize()
                    ferr = _check(fo[:, 0, :h], flse[:, :h, 0], ro, rl)
                    r["flashmla_check"] = {kk: ferr[kk] for kk in ("ok", "max_abs_err", "rel_fro_err",
                                                                   "lse_max_abs_err")}
                    calls = [flashmla_v4(fm, c, pad) for c in cases]
                    for c in calls:
                        c()
                    r["flashmla_us"] = graph_us_multi(calls)
                except Exception:
                    r["flashmla_error"] = traceback.format_exc()[-500:]
            if "ref" in sections:
                try:
                    r["ref_us"] = graph_us_multi([lambda c=c: reference_sparse_decode_v4(
                        sm_scale=SM, compute_dtype=torch.float32, **c) for c in cases[:2]], reps=5, back_to_back=3)
                except Exception:
                    r["ref_error"] = traceback.format_exc()[-300:]
            del cases, chk, outs
            torch.cuda.empty_cache()
        except Exception:
            r["error"] = traceback.format_exc()[-800:]
        log(json.dumps({kk: v for kk, v in r.items() if kk not in ("skipped",)}, default=str))
        rows.append(r)
        if partial is not None:
            partial(rows)
    return rows


# --- indexer ------------------------------------------------------------------------------------------------------

def bench_indexer(lens, batches, topk, log, torch_reps: int = 3) -> list[dict]:
    import torch

    from pdctl.kernels._build import check_topk, make_indexer_case
    from pdctl.kernels._indexer import lightning_indexer
    from pdctl.kernels._reference import reference_indexer_logits

    widths = {"128K": 131072 // 4, "1M": 1048576 // 4}  # compressed rows a page table of that max context spans
    rows = []
    for L in lens:
        lc = L // 4
        for b in batches:
            r: dict = {"L": L, "compressed": lc, "B": b}
            try:
                nrot = rotations(b * lc * 132, cap=8)
                q8, w, cache, bt1m, sl = make_indexer_case([lc] * (b * nrot), max_context=widths["1M"])
                outs = {}
                for name, wc in widths.items():
                    bt = bt1m[:, : wc // 64].contiguous()
                    reps = []
                    for k in range(nrot):
                        s = slice(k * b, (k + 1) * b)
                        reps.append((q8[s], w[s], bt[s], sl[s], torch.full((b, topk), -7, dtype=torch.int32,
                                                                           device="cuda"),
                                     torch.empty(b, bt.shape[1] * 64, device="cuda")))
                    a = reps[0]
                    lightning_indexer(a[0], a[1], cache, a[2], a[3], topk, out=a[4], logits=a[5])
                    torch.cuda.synchronize()
                    outs[name] = a[4].sort(dim=1).values.clone()
                    r[f"us_{name}"] = graph_us_multi([lambda a=a: lightning_indexer(
                        a[0], a[1], cache, a[2], a[3], topk, out=a[4], logits=a[5]) for a in reps])
                    # SGLang's torch path (SM120 recipe) on the first input set
                    tout = torch.full((b, topk), -7, dtype=torch.int32, device="cuda")
                    try:
                        sglang_torch_indexer(a[0], a[1], cache, a[2], a[3], tout)
                        torch.cuda.synchronize()
                        r[f"torch_same_{name}"] = bool(torch.equal(tout.sort(dim=1).values, outs[name]))
                        r[f"torch_us_{name}"] = graph_us_multi(
                            [lambda a=a: sglang_torch_indexer(a[0], a[1], cache, a[2], a[3], tout)],
                            reps=torch_reps, back_to_back=1)
                    except Exception as e:  # noqa: BLE001
                        r[f"torch_us_{name}"] = f"failed: {str(e)[:160]}"
                    torch.cuda.empty_cache()
                r["same_output_128K_1M"] = bool(torch.equal(outs["128K"], outs["1M"]))
                if b * lc <= 8 * 8192:
                    ref = reference_indexer_logits(q8[:b], w[:b], cache, bt1m[:b], sl[:b], compute_dtype=torch.float32)
                    out = torch.full((b, topk), -7, dtype=torch.int32, device="cuda")
                    lightning_indexer(q8[:b], w[:b], cache, bt1m[:b], sl[:b], topk, out=out)
                    r["topk_check"] = check_topk(out, ref, bt1m[:b], sl[:b], topk)
                r["spread_pct"] = 100 * abs(r["us_1M"] - r["us_128K"]) / r["us_128K"]
                del q8, w, cache, bt1m, sl
                torch.cuda.empty_cache()
            except Exception:
                r["error"] = traceback.format_exc()[-800:]
            log(json.dumps(r, default=str))
            rows.append(r)
    return rows


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) else "—"


def render(meta: dict, ceil: dict, dec: list[dict], idx: list[dict]) -> str:
    out = [f"### DeepSeek-V4 kernels on one {meta['gpu']} ({meta['date']}; torch {meta['torch']}, triton "
           f"{meta['triton']}, flash_mla {meta['flash_mla']})", "",
           f"Ceilings measured in this run: copy {_f(ceil.get('copy_GBps'), '{:.0f}')} GB/s, bf16 matmul "
           f"{_f(ceil.get('matmul_TFLOPs'), '{:.0f}')} TFLOP/s.", "",
           "Decode of a c4 layer (128-token window + top-k compressed rows, 584-byte V4 cache, attention sink), µs per "
           "call from CUDA-graph replays (median). FlashMLA: sgl-flash-mla 1.0.0 legacy `kv_format=\"V4\"`, h < 64 "
           "padded to 64. Speed-up = FlashMLA / ours.", "",
           "| h | B | top-k | ours µs | config | FlashMLA µs | speed-up | torch ref µs | ours max abs err | FlashMLA "
           "vs ref |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dec:
        c = r.get("config") or {}
        cfg = (f"bh{c.get('block_h')} bn{c.get('block_n')} w{c.get('num_warps')} s{c.get('splits')}"
               f"{' pdl' + str(c['pdl']) if c.get('pdl') else ''}{' bf16p' if c.get('bf16_partials') else ''}"
               if c else r.get("error", "—")[:60])
        sp = r["flashmla_us"] / r["us"] if isinstance(r.get("flashmla_us"), float) and r.get("us") else None
        fc = r.get("flashmla_check") or {}
        out.append(f"| {r['h']} | {r['B']} | {r['topk']} | {_f(r.get('us'), '{:.2f}')} | {cfg} | "
                   f"{_f(r.get('flashmla_us'), '{:.2f}')} | {_f(sp, '{:.2f}x')} | {_f(r.get('ref_us'))} | "
                   f"{_f((r.get('err') or {}).get('max_abs_err'), '{:.1e}')} | "
                   f"{('ok' if fc.get('ok') else 'FAIL') + ' ' + _f(fc.get('max_abs_err'), '{:.1e}') if fc else '—'} |")
    out += ["", "Indexer over compressed rows (top-512, FP8 keys, 132 B per row), µs per call (logits + top-k). "
            "L = tokens per request (L/4 compressed rows scored); max context 128K / 1M = page tables of 512 / 4096 "
            "pages of 64 compressed rows. SGLang torch = sglang 0.5.23 `fp8_paged_mqa_logits_torch_sm120` + "
            "`topk_transform_pytorch_vectorized`.", "",
            "| L | B | ours 128K | ours 1M | spread | same output | SGLang torch 128K | SGLang torch 1M | "
            "ours vs torch at 1M |", "|---|---|---|---|---|---|---|---|---|"]
    for r in idx:
        t1m = r.get("torch_us_1M")
        sp = t1m / r["us_1M"] if isinstance(t1m, float) and r.get("us_1M") else None
        out.append(f"| {r['L'] // 1024}K | {r['B']} | {_f(r.get('us_128K'), '{:.2f}')} | {_f(r.get('us_1M'), '{:.2f}')}"
                   f" | {_f(r.get('spread_pct'), '{:.1f} %')} | {r.get('same_output_128K_1M', '—')} | "
                   f"{_f(r.get('torch_us_128K'))} | {_f(t1m)} | {_f(sp, '{:.0f}x')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ceil,decode,flashmla,ref,indexer")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--topks", type=int, nargs="+", default=[512])
    ap.add_argument("--lens", type=int, nargs="+", default=[8192, 32768, 131072])
    args = ap.parse_args(argv)
    _bootstrap()
    import torch
    import triton

    out_dir = Path(os.environ.get("OUT") or "/tmp/out")
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "bench_v4.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    sec = set(args.sections.split(","))
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import flash_mla

        meta["flash_mla"] = getattr(flash_mla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        meta["flash_mla"] = f"not importable ({type(e).__name__})"
    t0 = time.time()
    ceil = ceilings() if "ceil" in sec else {}
    log(f"ceilings {ceil} ({time.time() - t0:.0f}s)")
    idx = bench_indexer(args.lens, args.batches, 512, log) if "indexer" in sec else []
    log(f"indexer done ({time.time() - t0:.0f}s)")
    (out_dir / "RESULTS_V4.partial.md").write_text(render(meta, ceil, [], idx))
    dec = bench_decode(args.heads, args.batches, args.topks, sec, log, partial=lambda rows: (
        out_dir / "RESULTS_V4.partial.md").write_text(render(meta, ceil, rows, idx))) if "decode" in sec else []
    log(f"decode done ({time.time() - t0:.0f}s)")
    text = render(meta, ceil, dec, idx)
    print(text)
    (out_dir / "RESULTS_V4.md").write_text(text)
    (out_dir / "bench_v4.json").write_text(json.dumps({"meta": meta, "ceil": ceil, "decode": dec, "indexer": idx},
                                                       indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
