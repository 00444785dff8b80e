"""Time each launch of the lightning indexer on its own (CUDA-graph replay of that launch alone), to see where
an indexer call's time goes: logits (which also zeroes the top-k workspace), the first radix histogram, the
partition and the per-row refinement. Prints one line per (L, B, launch), then
the whole call. Run on the GPU machine:

    python benchmarks/indexer_stages.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi  # noqa: E402


def main() -> int:
    _bootstrap()
    import torch

    from pdctl.kernels import _indexer as ix
    from pdctl.kernels._build import make_indexer_case

    kern = ix._kernels()
    cfg = ix.IndexerConfig()
    for L, B in ((8192, 1), (32768, 8), (32768, 64), (131072, 64)):
        q8, w, cache, bt, sl = make_indexer_case([L] * B, max_context=163840)
        lg = torch.empty(B, bt.shape[1] * 64, device="cuda")
        out = torch.empty(B, 2048, dtype=torch.int32, device="cuda")
        ws = torch.zeros(B, ix.WS_STRIDE, dtype=torch.int32, device="cuda")
        cw = lg.shape[1]
        cand = ix.candidate_buffer(B, cw, cfg, "cuda")
        ix.lightning_indexer(q8, w, cache, bt, sl, 2048, out=out, logits=lg, config=cfg)
        segs = max(1, cfg.topk_programs // B)

        def hist():
            kern._topk_hist_kernel[(B, segs)](lg, lg.stride(0), sl, ws, ix.WS_STRIDE, TOPK=2048, BLOCK=cfg.topk_block,
                                             num_warps=cfg.topk_warps, num_stages=cfg.topk_stages, GDC=False)

        def partition():
            # the counters must start at zero for every replay: the zeroing rides in the same graph, timed apart
            ws[:, 256:].zero_()
            kern._topk_partition_kernel[(B, segs)](
                lg, lg.stride(0), sl, ws, ix.WS_STRIDE, cand, cand.stride(0), cw, bt, bt.stride(0), out, out.stride(0),
                TOPK=2048, BLOCK=cfg.topk_block, PHYSICAL=True, num_warps=cfg.topk_warps, num_stages=cfg.topk_stages,
                GDC=False)

        def refine():
            ws[:, 258].zero_()  # its arrival and slot counters, zeroed in the same graph for every replay
            ws[:, 262:264].zero_()
            kern._topk_refine_kernel[(B, segs)](
                sl, ws, ix.WS_STRIDE, cand, cand.stride(0), cw, out, out.stride(0), TOPK=2048,
                BLOCK=cfg.refine_block, CAP=cfg.topk_refine_cap, num_warps=cfg.refine_warps, GDC=False)

        ws.zero_()
        hist()
        partition()
        refine()
        n_cand = ws[:, 257].float().mean().item()
        n_short = ws[:, 261].float()
        print(f"L={L} B={B} candidates per row {n_cand:.0f}, short list per row mean {n_short.mean():.0f} max "
              f"{n_short.max():.0f} (cap {cfg.topk_refine_cap})", flush=True)
        ws_scratch = torch.empty_like(ws)
        # order matters: the hist0 replays keep adding into ws, so partition (which reads it) is timed first
        launches = {
            "logits (zeroes the workspace)": lambda: ix.indexer_logits(q8, w, cache, bt, sl, logits=lg, config=cfg,
                                                                      workspace=ws_scratch),
            "counter zeroing alone": lambda: ws[:, 256:].zero_(),
            "partition (incl. counter zeroing)": partition,
            "refine (incl. counter zeroing, 2 launches)": refine,
            "hist0 (256 bins)": hist,
            "whole call": lambda: ix.lightning_indexer(q8, w, cache, bt, sl, 2048, out=out, logits=lg, config=cfg),
        }
        for name, fn in launches.items():
            us = graph_us_multi([fn])
            print(f"L={L} B={B} {name}: {us:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
