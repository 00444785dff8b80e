"""Where bf16 split partials (``DecodeConfig.bf16_partials``) lose time on the GPU machine: the whole decode call
against the split kernel alone (the merge launch skipped: outputs not complete, time only), fp32 against bf16
partials, each PDL mode, and the merge (``_combine_kernel``) launched with 1, 2, 4 or 8 warps instead of
``_sparse_mla._combine_warps``'s choice.

Usage (device machine, repo root): ``PDCTL_KERNELS_GPU=1 python3 benchmarks/partials_probe.py
--cases h,B,gluon,block_h,splits ...`` (FP8 KV; the Gluon kernels). µs per call as ``decode_pdl.py`` (CUDA-graph
replay, inputs rotated); every whole-call output is checked against the fp32 reference first ("WRONG" if not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, rotations  # noqa: E402
from decode_floor import _NoLaunch  # noqa: E402

DEFAULT_CASES = ["64,8,5,32,8", "128,8,7,64,8", "16,8,5,16,16", "128,1,5,16,16"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    args = ap.parse_args(argv)
    _bootstrap()
    import torch

    from pdctl.kernels import _sparse_mla as sm_mod
    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode

    sm = 0.135234
    chosen = sm_mod._combine_warps
    real_kernels = sm_mod._kernels
    variants = [("whole", None), ("split kernel alone", "skip")] + [(f"merge {w} warps", w) for w in args.warps]
    print("| h | B | config | partials | PDL | " + " | ".join(v for v, _ in variants) + " |")
    print("|---|---|---|---|---|" + "---|" * len(variants))
    for case in args.cases:
        h, rows, gluon, bh, splits = (int(x) for x in case.split(","))
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
        nrot = rotations(rows * 2048 * 656)
        idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                        .to(torch.int32) for _ in range(nrot - 1)]
        o = torch.empty(rows, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        for bf16 in (0, 1):
            for pdl in (0, 1, 2):
                cfg = sm_mod.DecodeConfig(block_h=bh, splits=splits, gluon=gluon, pdl=pdl, bf16_partials=bf16)
                res = []
                for _, how in variants:
                    sm_mod._combine_warps = chosen if how in (None, "skip") else (lambda s, d, w=how: w)
                    sm_mod._kernels = real_kernels if how != "skip" else (lambda: (real_kernels()[0], _NoLaunch()))
                    try:
                        ok = True
                        if how != "skip":
                            o.fill_(float("nan"))
                            sm_mod.sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
                            torch.cuda.synchronize()
                            ok = _decode_tolerance_check(o, lse, ro, rl)["ok"]
                        us = graph_us_multi([lambda ix=ix: sm_mod.sparse_mla_decode(
                            q, kv, ix, sm, None, out=o, lse=lse, config=cfg) for ix in idxs])
                        res.append(f"{us:.2f}{'' if ok else ' WRONG'}")
                    except Exception as e:  # noqa: BLE001 (a variant that does not launch here)
                        res.append(f"— ({type(e).__name__})")
                    finally:
                        sm_mod._combine_warps, sm_mod._kernels = chosen, real_kernels
                print(f"| {h} | {rows} | gluon-{gluon}: {bh},{splits} | {'bf16' if bf16 else 'fp32'} | {pdl} | "
                      + " | ".join(res) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
