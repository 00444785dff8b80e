"""Programmatic dependent launch (PDL) of the decode's two kernels, measured three ways on the GPU machine, and
(``--merge``) the same with the splits merged inside the split kernel (``DecodeConfig.merge`` 1, one launch).

For each shape and config given, µs per call (CUDA-graph replay as in ``bench_kernels.graph_us_multi``, inputs
rotated so that L2 does not serve repeated calls) with ``DecodeConfig.pdl`` 0 (plain launches), 1 (both kernels
PDL-launched, the split kernel triggering the merge at its start) and 2 (triggering it after its main loop).
Every output is checked against the fp32 reference first.

Usage (device machine, repo root): ``PDCTL_KERNELS_GPU=1 python3 benchmarks/decode_pdl.py
--cases h,B,gluon,block_h,splits[,block_n,num_warps,prefetch[,flags]] ... [--merge] [--kv fp8|bf16] [--max-splits N]``
(the fields after splits for the ``tl.dot`` kernel, gluon 0; FP8 KV unless ``--kv bf16``; flags: 1 ``mma_f16``,
2 ``fold``, 4 ``bf16_partials``, 8 ``num_stages`` 1 instead of 2, 16 ``qk_chains``). ``--max-splits`` lifts the
launcher's split limit (64) for this process only, to time more and shorter splits than the build tries.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, rotations  # noqa: E402

DEFAULT_CASES = ["16,1,5,16,32", "16,8,5,16,16", "16,8,3,16,32", "32,8,5,32,16", "16,64,4,16,2", "128,1,5,32,16",
                 "128,8,4,32,4"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--merge", action="store_true",
                    help="also time DecodeConfig.merge = 1 (splits merged in the split kernel) for each PDL mode")
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="latent cache format of every case")
    ap.add_argument("--max-splits", type=int, default=0, help="raise the launcher's split limit (probe only)")
    ap.add_argument("--merge-lanes", type=int, nargs="+", default=[0],
                    help="lanes per merge program (0: _combine_block_d's choice)")
    ap.add_argument("--merge-warps", type=int, nargs="+", default=[0], help="warps per merge program (0: the rule's)")
    args = ap.parse_args(argv)
    _bootstrap()
    from pdctl.kernels import _sparse_mla

    if args.max_splits:
        _sparse_mla._MAX_SPLITS = max(_sparse_mla._MAX_SPLITS, args.max_splits)
    rule_lanes, rule_warps = _sparse_mla._combine_block_d, _sparse_mla._combine_warps
    import torch

    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import LAST_LAUNCH, DecodeConfig, sparse_mla_decode

    sm = 0.135234
    settings = [(0, 0), (1, 0), (2, 0)] + ([(0, 1), (1, 1), (2, 1)] if args.merge else [])
    heads_ = ["plain µs", "PDL, trigger at start µs", "PDL, trigger after main loop µs"]
    heads_ += [f"merged in kernel, {x}" for x in heads_] if args.merge else []
    print("| h | B | config | " + " | ".join(heads_) + " |")
    print("|---|---|---|" + "---|" * len(heads_))
    for case, lanes, mwarps in [(c, la, w) for c in args.cases for la in args.merge_lanes for w in args.merge_warps]:
        _sparse_mla._combine_block_d = (lambda rh, sms, n=lanes: n) if lanes else rule_lanes
        _sparse_mla._combine_warps = (lambda bs, bd, bf=False, n=mwarps: n) if mwarps else rule_warps
        h, rows, gluon, bh, splits, *tile = (int(x) for x in case.split(","))
        bn, warps, prefetch, flags = (list(tile) + [0])[:4] if len(tile) >= 3 else (64, 4, 0, tile[0] if tile else 0)
        q, kv, idx, _ = make_decode_case(h, rows, args.kv, slots=262144, ragged=False, with_length=False)
        ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
        nrot = rotations(rows * 2048 * (656 if args.kv == "fp8" else 1152))
        idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                        .to(torch.int32) for _ in range(nrot - 1)]
        o = torch.empty(rows, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        res = []
        regs = "—"
        for pdl, merge in settings:
            cfg = DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, splits=splits, prefetch=prefetch, gluon=gluon,
                               pdl=pdl, merge=merge, mma_f16=flags & 1, fold=(flags >> 1) & 1,
                               bf16_partials=(flags >> 2) & 1, num_stages=1 if flags & 8 else 2,
                               qk_chains=(flags >> 4) & 1)
            o.fill_(float("nan"))
            try:
                sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
            except ValueError:  # merge = 1 where the grid exceeds the SMs, or not a warp-specialised kernel
                res.append("—")
                continue
            torch.cuda.synchronize()
            regs = f"{LAST_LAUNCH.get('n_regs')} regs, {LAST_LAUNCH.get('n_spills')} spilled"
            ok = _decode_tolerance_check(o, lse, ro, rl)["ok"]
            us = graph_us_multi([lambda ix=ix, cfg=cfg: sparse_mla_decode(q, kv, ix, sm, None, out=o, lse=lse,
                                                                           config=cfg) for ix in idxs])
            res.append(f"{us:.2f}{'' if ok else ' WRONG'}")
        name = f"gluon-{gluon}: {bh},{splits}" if gluon else f"tl.dot: {bh},{bn},{warps},{splits},{prefetch}"
        name = f"{args.kv} {name}{' fp16-mma' if flags & 1 else ''}{' fold' if flags & 2 else ''}"
        name += f"{' bf16-partials' if flags & 4 else ''}{' 1-stage' if flags & 8 else ''}"
        name += ' qk-chains' if flags & 16 else ''
        name += f"{f' merge lanes {lanes}' if lanes else ''}{f' merge warps {mwarps}' if mwarps else ''} ({regs})"
        print(f"| {h} | {rows} | {name} | " + " | ".join(res) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
