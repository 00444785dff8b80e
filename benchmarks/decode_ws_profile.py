"""Where the warp-specialised FP8 decode kernel spends each 64-row tile: per-tile ``%clock64`` stamps in both
partitions, read back and summarised as medians (µs at the SM clock given by ``--clock-ghz``, 1.98 on the H200).

The kernel is instrumented at run time, not in the product: this script copies ``kernels/_sparse_mla_gluon.py`` into a
temporary module with a ``clock64`` store at each phase boundary (the edit fails loudly if the kernel's text moved),
runs it once per shape, checks the output against the fp32 reference, and prints, per shape:

* loader: ``issue+wait_empty`` (gathers issued, then the wait for a free stage) and ``convert+store`` (the rest of
  the gather latency, dequantisation, shared-memory stores, signalling);
* MMA partition: ``wait_full`` (starved for a staged tile), ``qk`` (five wgmmas), ``softmax`` (scores, online softmax,
  Pᵀ store, barrier) and ``pv`` (four wgmmas and releasing the stage).

With gluon 7 the MMA figures are the first MMA partition's (``_ws_mma_hm``): ``softmax`` runs up to P's handoff to the
second partition (waiting for its P buffer included) and ``pv`` covers the first partition's two PV wgmmas.
``--source PATH`` instruments another version of the module (e.g. an earlier commit's copy) instead of this checkout's.

Run on the GPU machine (bare checkout): ``python3 benchmarks/decode_ws_profile.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, ws_launch_args  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLK = 'gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'
EVENTS = ("ld_start", "ld_stage_free", "ld_signalled", "mma_wait", "mma_staged", "mma_qk_done", "mma_p_stored",
          "mma_released")


def instrumented_source(path: Path = REPO / "kernels" / "_sparse_mla_gluon.py") -> str:
    """The Gluon module's text with per-tile stamps: slot j·8 + e of a 512-slot row per program (64 tiles max)."""
    s = path.read_text()

    def rep(old: str, new: str, n: int = 1, within: tuple[str, str] | None = None) -> None:
        # Replace `old` (n times) in the whole text or in the part from within[0] up to within[1].
        nonlocal s
        a, z = (s.index(within[0]), s.index(within[1])) if within else (0, len(s))
        part = s[a:z]
        if part.count(old) != n:
            raise SystemExit(f"kernel text changed, cannot instrument: {old!r} found {part.count(old)}×, expected {n}")
        s = s[:a] + part.replace(old, new) + s[z:]

    mma = ("def _ws_mma(", "def _ws_mma_hm(")  # the tokens-as-M MMA partition (gluon 4 and 5)
    hm = ("def _ws_mma_hm(", "def _ws_pv_hm(")  # gluon 7's first MMA partition (QKᵀ, softmax, P handoff, its PV)

    def stamp(slot: str, e: int) -> str:
        return f"gl.store(prof + {slot} * 8 + {e}, {CLK})"

    rep("kc_s, kpe_s, bias_s, full, empty,\n             W: gl.constexpr",
        "kc_s, kpe_s, bias_s, full, empty, prof,\n             W: gl.constexpr")
    rep("    for j in range(W, n_tiles, P):\n        st = j % 2\n",
        f"    for j in range(W, n_tiles, P):\n        {stamp('j', 0)}\n        st = j % 2\n")
    rep("        mbarrier.wait(empty.index(st), ((j // 2) & 1) ^ 1)\n",
        f"        mbarrier.wait(empty.index(st), ((j // 2) & 1) ^ 1)\n        {stamp('j', 1)}\n")
    rep("        mbarrier.arrive(full.index(st), count=1)\n",
        f"        mbarrier.arrive(full.index(st), count=1)\n        {stamp('j', 2)}\n")
    rep("bias_s, p_s, full, empty, n_tiles, qk_scale_log2,\n            o_ptr",
        "bias_s, p_s, full, empty, prof, n_tiles, qk_scale_log2,\n            o_ptr")
    for part in (mma, hm):
        rep("        mbarrier.wait(full.index(st), (it // 2) & 1)\n",
            f"        {stamp('it', 3)}\n        mbarrier.wait(full.index(st), (it // 2) & 1)\n        {stamp('it', 4)}\n",
            within=part)
        rep("        s = warpgroup_mma_wait(0, deps=[s])\n",
            f"        s = warpgroup_mma_wait(0, deps=[s])\n        {stamp('it', 5)}\n", within=part)
    # gluon 7's first MMA partition: "softmax" ends once P is handed to the second, "pv" once the stage is released
    rep("        mbarrier.arrive(pfull, count=1)\n", f"        mbarrier.arrive(pfull, count=1)\n        {stamp('it', 6)}\n",
        within=hm)
    rep("        mbarrier.arrive(empty.index(st), count=1)\n",
        f"        mbarrier.arrive(empty.index(st), count=1)\n        {stamp('it', 7)}\n", within=hm)
    rep("full, empty, pfull, pempty,\n               fin, n_tiles,", "full, empty, pfull, pempty,\n               fin, prof, n_tiles,")
    rep("hbar.index(0), hbar.index(1), hbar.index(2), n_tiles,", "hbar.index(0), hbar.index(1), hbar.index(2), prof, n_tiles,")
    rep("        p_s.store(p.to(gl.bfloat16))\n        fence_async_shared()\n        gl.thread_barrier()\n",
        f"        p_s.store(p.to(gl.bfloat16))\n        fence_async_shared()\n        gl.thread_barrier()\n"
        f"        {stamp('it', 6)}\n")
    rep("        mbarrier.arrive(empty.index(st), count=1)\n\n    _gdc_trigger(GDC)\n    l_i",
        f"        mbarrier.arrive(empty.index(st), count=1)\n        {stamp('it', 7)}\n\n    _gdc_trigger(GDC)\n    l_i")
    rep("lse_ptr, stride_lt, mo_ptr, ml_ptr,\n    H, K, qk_scale_log2, SPLITS,\n    HAS_LEN: gl.constexpr, SPLIT_OUT: "
        "gl.constexpr, BLOCK_H: gl.constexpr, LOADERS",
        "lse_ptr, stride_lt, mo_ptr, ml_ptr, prof_ptr,\n    H, K, qk_scale_log2, SPLITS,\n    HAS_LEN: gl.constexpr, "
        "SPLIT_OUT: gl.constexpr, BLOCK_H: gl.constexpr, LOADERS")
    rep("    irow = idx_ptr + t.to(gl.int64) * stride_it\n\n    if HM:",
        "    irow = idx_ptr + t.to(gl.int64) * stride_it\n"
        "    prof = prof_ptr + ((t * gl.num_programs(1) + hb) * SPLITS + sp).to(gl.int64) * 512\n\n    if HM:")
    rep("bias_s, p_s, full, empty, n_tiles, qk_scale_log2,\n                       o_ptr",
        "bias_s, p_s, full, empty, prof, n_tiles, qk_scale_log2,\n                       o_ptr", 2)
    rep("kc_s, kpe_s, bias_s, full, empty,\n                        0,", "kc_s, kpe_s, bias_s, full, empty, prof,\n                        0,", 3)
    rep("kc_s, kpe_s, bias_s, full, empty,\n                        1,", "kc_s, kpe_s, bias_s, full, empty, prof,\n                        1,")
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--source", type=Path, default=REPO / "kernels" / "_sparse_mla_gluon.py",
                    help="the Gluon module to instrument (default: this checkout's), e.g. an earlier commit's copy")
    ap.add_argument("--cases", nargs="+", default=["16,64,16,2,4", "16,64,16,2,5", "32,64,32,2,4", "128,64,64,1,5",
                                                   "128,64,32,1,4", "16,1,16,32,4", "16,8,16,16,4"],
                    help="h,B,block_h,splits,gluon variant (4, 5 or 7)")
    args = ap.parse_args()
    _bootstrap()
    import torch

    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import _combine_block_d, _kernels, _next_pow2

    # Triton reads a kernel's source from its file, so the instrumented copy lives in a directory kept for the run
    tmp = tempfile.TemporaryDirectory(prefix="pdctl-ws-prof-")
    path = Path(tmp.name) / "pdctl_ws_prof.py"
    path.write_text(instrumented_source(args.source))
    spec = importlib.util.spec_from_file_location("pdctl_ws_prof", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pdctl_ws_prof"] = mod
    spec.loader.exec_module(mod)
    sm = 0.135234
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for case in args.cases:
        h, rows, bh, splits, variant = (int(x) for x in case.split(","))
        if variant not in (4, 5, 7):
            raise SystemExit(f"{case}: only the warp-specialised kernels (gluon 4, 5 and 7) are instrumented")
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        kv2 = kv.reshape(-1, 656)
        hb = -(-h // bh)
        mid_o = torch.empty(rows, h, splits, 512, device="cuda")
        mid_l = torch.empty(rows, h, splits, device="cuda")
        out = torch.empty(rows, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        prof = torch.zeros(rows * hb * splits, 64, 8, dtype=torch.int64, device="cuda")

        def run() -> None:
            mod._decode_fp8_ws_kernel[(rows, hb, splits)](
                q, q.stride(0), q.stride(1), kv2.view(torch.float8_e4m3fn), kv2.view(torch.float32),
                kv2.view(torch.bfloat16), idx, idx.stride(0), idx, out, out.stride(0), out.stride(1), lse, lse.stride(0),
                mid_o, mid_l, prof, h, idx.shape[1], sm * 1.4426950408889634, splits,
                HAS_LEN=False, SPLIT_OUT=splits > 1, BLOCK_H=bh, GDC=False,
                **ws_launch_args(mod._decode_fp8_ws_kernel, variant, bh, splits))
            if splits > 1:
                bd = _combine_block_d(rows * h, nsm)
                _kernels()[1][(rows, h, 512 // bd)](mid_o, mid_l, out, out.stride(0), out.stride(1), lse, lse.stride(0),
                                                    h, splits, BLOCK_S=max(2, _next_pow2(splits)), BLOCK_D=bd, num_warps=4,
                                                    GDC=False)

        run()
        torch.cuda.synchronize()
        ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
        ok = _decode_tolerance_check(out, lse, ro, rl)["ok"]
        for _ in range(3):  # the stamps of the last run are read
            run()
        torch.cuda.synchronize()
        us = prof.cpu().double() / (args.clock_ghz * 1e3)
        n_t = idx.shape[1] // 64 // splits
        ph: dict[str, list[float]] = {k: [] for k in ("ld issue+wait_empty", "ld convert+store", "mma wait_full",
                                                      "mma qk", "mma softmax", "mma pv", "mma per tile")}
        spans, first = [], []
        for c in range(us.shape[0]):
            e = us[c, :n_t]
            for j in range(n_t):
                ph["ld issue+wait_empty"].append(e[j, 1] - e[j, 0])
                ph["ld convert+store"].append(e[j, 2] - e[j, 1])
                ph["mma wait_full"].append(e[j, 4] - e[j, 3])
                ph["mma qk"].append(e[j, 5] - e[j, 4])
                ph["mma softmax"].append(e[j, 6] - e[j, 5])
                ph["mma pv"].append(e[j, 7] - e[j, 6])
                ph["mma per tile"].append(e[j, 7] - e[j, 3])
            spans.append(e[n_t - 1, 7] - e[0, 0])
            first.append(e[0, 4] - e[0, 0])
        print(f"h={h} B={rows} block_h={bh} splits={splits} gluon-{variant}: correct={ok}, {n_t} tiles per program, "
              f"program span {statistics.median(spans):.1f} µs, first tile staged after {statistics.median(first):.2f} µs")
        print("    " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in ph.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
