"""Launch each kernel of interest once, for Nsight Compute to profile (hardware counters: stall reasons, issue
slots, memory throughput). Run on the GPU machine under ncu, e.g. (``kernels_device_run.sh ncu`` does this):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:'decode|topk|indexer' \\
        python3 benchmarks/ncu_targets.py

Shapes: FP8 decode at h = 16 / 32 and B = 1 / 64 with the Gluon variants (cp.async staging and straight-to-register loads),
and the indexer at L = 32K, B = 64 (logits, first histogram, partition + refinement); ``--b1``: decode at B = 1 only (gluon 3, and the warp-specialised gluon 5 that the build picks there);
``--indexer L,B``: the indexer alone at that shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap  # noqa: E402


def main() -> int:
    _bootstrap()
    import torch

    from pdctl.kernels._build import make_decode_case, make_indexer_case
    from pdctl.kernels._indexer import lightning_indexer
    from pdctl.kernels._sparse_mla import DecodeConfig, sparse_mla_decode

    only_b1 = "--b1" in sys.argv  # decode at B = 1 only: the split kernel and the combine, per launch
    if "--indexer" in sys.argv:  # --indexer L,B: the indexer's four launches at that shape only
        length, rows = (int(x) for x in sys.argv[sys.argv.index("--indexer") + 1].split(","))
        q8, w, cache, bt, sl = make_indexer_case([length] * rows, max_context=163840)
        print(f"indexer L={length} B={rows}", flush=True)
        lightning_indexer(q8, w, cache, bt, sl, 2048)
        torch.cuda.synchronize()
        return 0
    cases = ((32, 64, 32, 2, (1, 3)), (16, 64, 16, 4, (3, 1)), (16, 1, 16, 32, (1, 3)))
    if only_b1:
        cases = ((16, 1, 16, 32, (3, 5)), (16, 1, 16, 16, (3,)), (16, 1, 16, 64, (3, 5)), (128, 1, 32, 32, (3,)))
    for h, rows, bh, splits, variants in cases:
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        for v in variants:
            print(f"decode fp8 h={h} B={rows} gluon-{v}: {bh},{splits}", flush=True)
            sparse_mla_decode(q, kv, idx, 0.135234, None, config=DecodeConfig(block_h=bh, splits=splits, gluon=v))
            torch.cuda.synchronize()
    if only_b1:
        return 0
    q8, w, cache, bt, sl = make_indexer_case([32768] * 64, max_context=163840)
    print("indexer L=32K B=64", flush=True)
    lightning_indexer(q8, w, cache, bt, sl, 2048)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
