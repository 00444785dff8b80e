"""Time each launch of the lightning indexer on its own (CUDA-graph replay of that launch alone), to see where
an indexer call's time goes: workspace memset, logits (+ first radix histogram), the four 6-bit histogram passes,
and the select pass. Prints one line per (L, B, launch). Run on the GPU machine:

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
    cfg = ix.IndexerConfig(programs_per_sm=8, logits_stages=5)
    for L, B in ((8192, 1), (32768, 8), (32768, 64)):
        q8, w, cache, bt, sl = make_indexer_case([L] * B, max_context=163840)
        lg = torch.empty(B, bt.shape[1] * 64, device="cuda")
        out = torch.empty(B, 2048, dtype=torch.int32, device="cuda")
        hb = B * 256
        ws = torch.zeros(5 * hb + 2 * B, dtype=torch.int32, device="cuda")
        hist, cnt = ws[: 5 * hb], ws[5 * hb:]
        ix.lightning_indexer(q8, w, cache, bt, sl, 2048, out=out, logits=lg, config=cfg)
        ix.indexer_logits(q8, w, cache, bt, sl, logits=lg, config=cfg, hist=hist)
        for tb, tw, tp in ((1024, 4, 1056), (1024, 4, 264), (4096, 4, 264), (1024, 1, 1056), (256, 1, 4224)):
            segs = max(1, tp // B)
            launches = {"memset": lambda: ws.zero_(),
                        "logits+hist0": lambda: ix.indexer_logits(q8, w, cache, bt, sl, logits=lg, config=cfg, hist=hist)}
            for p in range(1, 5):
                launches[f"hist{p}"] = lambda p=p: kern._topk_hist_kernel[(B, segs)](
                    lg, lg.stride(0), sl, hist, hb, PASS=p, TOPK=2048, BLOCK=tb, num_warps=tw)
            launches["select"] = lambda: kern._topk_select_kernel[(B, segs)](
                lg, lg.stride(0), sl, hist, hb, cnt, bt, bt.stride(0), out, out.stride(0), TOPK=2048, BLOCK=tb,
                PHYSICAL=True, num_warps=tw)
            for name, fn in launches.items():
                if name in ("memset", "logits+hist0") and (tb, tw, tp) != (1024, 4, 1056):
                    continue
                us = graph_us_multi([fn])
                print(f"L={L} B={B} block={tb} warps={tw} programs={tp} {name}: {us:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
