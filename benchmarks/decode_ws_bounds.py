"""Upper bounds for the warp-specialised FP8 decode (``gluon`` 4/5): how fast would it be if one piece of work
cost nothing? Each variant is the kernel's text with one piece removed or cheapened (its outputs are WRONG; only
the time means something), timed like ``decode_pdl.py`` (CUDA-graph replay, inputs rotated, plain launches of the
split kernel and ``_combine_kernel``):

* ``no-rescale``: the MMA partition does not rescale the output accumulators by exp2(m_old − m_new) each tile;
* ``no-xwarp-max``: no max over the tile's tokens (a reduction across the warpgroup's 4 warps); the running max
  stays 0;
* ``ld-noscale``: the loaders convert e4m3 → bf16 without the per-token scale (no bf16 multiply);
* ``ld-prmt``: the loaders "convert" with two byte permutes per 4 values (the cost floor of any conversion);
* ``ld-nogather``: the loaders' row loads are masked off (no KV bytes move; indices and scales are still read), so
  the time is what the MMA side alone needs;
* combinations of the above.

The two MMA-side edits change the tokens-as-M partition (``gluon`` 4 and 5) only; with ``gluon`` 7 they time the
kernel unchanged.

The base variant is checked against the fp32 reference (the harness is the kernel's). Usage (device machine, repo
root): ``PDCTL_KERNELS_GPU=1 python3 benchmarks/decode_ws_bounds.py [--cases h,B,block_h,splits,gluon ...]
[--variants ...] [--compare LABEL=PATH ...]``; ``--compare`` times other versions of the module beside it, each
checked against the reference too.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, rotations, ws_launch_args  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRMT = "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;"  # a word's 4 bytes spread over 2 words


def _edit(src: str, start: str, end: str, old: str, new: str, n: int) -> str:
    a, z = src.index(start), src.index(end)
    body = src[a:z]
    if body.count(old) != n:
        raise SystemExit(f"kernel text changed: {old!r} found {body.count(old)}× in {start!r}, expected {n}")
    return src[:a] + body.replace(old, new) + src[z:]


def variant_source(edits: set[str]) -> str:
    s = (REPO / "kernels" / "_sparse_mla_gluon.py").read_text()
    mma = ("def _ws_mma(", "def _grid_barrier(")
    load = ("def _ws_load(", "def _ws_mma(")
    if "no-rescale" in edits:
        for i in range(4):
            s = _edit(s, *mma, f"acc{i} * al,", f"acc{i},", 1)
    if "no-xwarp-max" in edits:
        s = _edit(s, *mma, "m_new = gl.maximum(m_i, gl.max(s, axis=0))", "m_new = gl.maximum(m_i, 0.0)", 1)
    if "ld-nogather" in edits:
        s = _edit(s, *load, "mask=okc, other=0,", "mask=okc & (cols < 0), other=0,", 5)
    conv = ("_DEQUANT_WORD = ", "def _dequant_store(")
    if "ld-noscale" in edits:
        s = _edit(s, *conv, "mul.rn.bf16x2 $0, p0, $3;\nmul.rn.bf16x2 $1, p1, $3;", "mov.b32 $0, p0;\nmov.b32 $1, p1;", 1)
    if "ld-prmt" in edits:
        a, z = s.index(conv[0]), s.index(conv[1])
        s = s[:a] + f"_DEQUANT_WORD = gl.constexpr({PRMT!r})\n\n\n@gluon.jit\n" + s[z:]
    return s


VARIANTS = [(), ("no-rescale",), ("no-xwarp-max",), ("no-rescale", "no-xwarp-max"), ("ld-noscale",), ("ld-prmt",),
            ("ld-prmt", "no-rescale", "no-xwarp-max"), ("ld-nogather",)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["16,64,16,2,4", "32,64,32,2,4", "128,64,64,1,5", "16,8,16,16,5",
                                                   "16,1,16,32,5"], help="h,B,block_h,splits,gluon variant (4, 5 or 7)")
    ap.add_argument("--compare", nargs="+", default=[], metavar="LABEL=PATH",
                    help="also time other versions of the Gluon module (e.g. an earlier commit's), each checked "
                         "against the reference like the base")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="variants to time, each a '+'-joined set of edits (default: all; 'base' is always timed)")
    args = ap.parse_args(argv)
    _bootstrap()
    import torch

    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import (DecodeConfig, _combine_block_d, _kernels, _next_pow2,
                                           check_decode_config)

    tmp = tempfile.TemporaryDirectory(prefix="pdctl-ws-bounds-")
    mods = {}
    chosen = VARIANTS if args.variants is None else [()] + [tuple(v.split("+")) for v in args.variants if v != "base"]
    known = {e for v in VARIANTS for e in v}
    if unknown := {e for v in chosen for e in v} - known:
        raise SystemExit(f"unknown edits {sorted(unknown)}; known: {sorted(known)}")
    for k, edits in enumerate(chosen):
        path = Path(tmp.name) / f"pdctl_ws_bound{k}.py"  # Triton reads a kernel's source from its file
        path.write_text(variant_source(set(edits)))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        mods[" + ".join(edits) or "base"] = mod
    for k, item in enumerate(args.compare):
        label, _, src = item.partition("=")
        path = Path(tmp.name) / f"pdctl_ws_other{k}.py"
        path.write_text(Path(src).read_text())
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        mods[label] = mod
    checked = {"base"} | {item.partition("=")[0] for item in args.compare}
    sm = 0.135234
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    print("| h | B | config | " + " | ".join(mods) + " |")
    print("|---|---|---|" + "---|" * len(mods))
    for case in args.cases:
        h, rows, bh, splits, variant = (int(x) for x in case.split(","))
        check_decode_config(DecodeConfig(block_h=bh, splits=splits, gluon=variant), h, rows, "fp8", nsm)
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        kv2 = kv.reshape(-1, 656)
        idxs = [idx] + [torch.stack([torch.randperm(kv2.shape[0], device="cuda")[:2048] for _ in range(rows)])
                        .to(torch.int32) for _ in range(rotations(rows * 2048 * 656) - 1)]
        hb = -(-h // bh)
        mid_o = torch.empty(rows, h, splits, 512, device="cuda")
        mid_l = torch.empty(rows, h, splits, device="cuda")
        out = torch.empty(rows, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        res = []
        for name, mod in mods.items():
            def run(ix, mod=mod) -> None:
                mod._decode_fp8_ws_kernel[(rows, hb, splits)](
                    q, q.stride(0), q.stride(1), kv2.view(torch.float8_e4m3fn), kv2.view(torch.float32),
                    kv2.view(torch.bfloat16), ix, ix.stride(0), ix, out, out.stride(0), out.stride(1), lse,
                    lse.stride(0), mid_o, mid_l, h, ix.shape[1], sm * 1.4426950408889634, splits,
                    HAS_LEN=False, SPLIT_OUT=splits > 1, BLOCK_H=bh, GDC=False,
                    **ws_launch_args(mod._decode_fp8_ws_kernel, variant, bh, splits))
                if splits > 1:
                    bd = _combine_block_d(rows * h, nsm)
                    _kernels()[1][(rows, h, 512 // bd)](mid_o, mid_l, out, out.stride(0), out.stride(1), lse,
                                                        lse.stride(0), h, splits, BLOCK_S=max(2, _next_pow2(splits)),
                                                        BLOCK_D=bd, num_warps=4, GDC=False)
            try:
                run(idx)
                torch.cuda.synchronize()
                tag = ""
                if name in checked:
                    ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
                    tag = "" if _decode_tolerance_check(out, lse, ro, rl)["ok"] else " WRONG"
                res.append(f"{graph_us_multi([lambda ix=ix, run=run: run(ix) for ix in idxs]):.2f}{tag}")
            except Exception:
                res.append("failed")
                print(f"{name} at {case}: {traceback.format_exc()[-400:]}", file=sys.stderr)
        print(f"| {h} | {rows} | gluon-{variant}: {bh},{splits} | " + " | ".join(res) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
