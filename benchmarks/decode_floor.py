"""How much of the decode's B = 1 time is launch and memory latency that no kernel body can remove (issue 6's
goal: B = 1 ≤ 6 µs). Same harness as ``bench_kernels.graph_us_multi`` (CUDA graph, back-to-back replays, inputs
rotated), µs per call, for:

* ``null ×1`` / ``null ×2`` / ``null ×2 PDL``: one or two kernels per call that each read one int32 and write it
  back (32 programs of 4 warps; the PDL pair waits with ``griddepcontrol.wait`` and triggers at once), the floor
  of a call made of one or two launches;
* ``gather``: 32 programs that load 64 top-k indices each, then gather those 64 rows of the 656-byte FP8 cache
  (as 32-bit words) and write one sum: the dependent index → row DRAM round trips a 32-split decode's programs
  make; the same 2048 rows over 64 and 128 programs show how much of it is one SM's throughput, not latency;
* ``split kernel only``: the decode's split kernel with the merge launch left out (outputs not checked);
* ``--batch-gathers B ...``: the floor of any decode kernel at batch B, whatever its arithmetic: a grid that loads
  each row's 2048 top-k indices and gathers those FP8 rows (656 B, as 32-bit words, 16 rows at a time per program,
  the next chunk's loads issued while this one's are summed), writing one sum per program, with 16–128 rows per
  program, plain and chained by programmatic dependent launch; printed beside the B rows' memory roofline (Q, O,
  the gathered rows and the indices at the copy bandwidth given by ``--copy-gbps``) and 80 % of it (issue 6's goal
  for h = 16 and 32 at B ≥ 8);
* ``decode``: the whole call (split + merge, or merged in-kernel), checked against the fp32 reference first.

Usage (device machine, repo root):
``PDCTL_KERNELS_GPU=1 python3 benchmarks/decode_floor.py [--cases h,B,gluon,block_h,splits,pdl,merge ...]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, rotations  # noqa: E402

DEFAULT_CASES = ["16,1,5,16,32,1,0", "16,1,5,16,32,0,0", "16,1,5,16,32,1,1", "32,1,5,16,32,1,0"]


def _kernels():  # noqa: ANN202
    import triton
    import triton.language as tl

    from pdctl.kernels._gdc import _gdc_enter

    @triton.jit
    def null_kernel(x_ptr, GDC: tl.constexpr):
        _gdc_enter(GDC)
        p = tl.program_id(0)
        v = tl.load(x_ptr + p)
        tl.store(x_ptr + p, v + 1)

    @triton.jit
    def gather_rows_kernel(kv_ptr, idx_ptr, out_ptr, ROWS: tl.constexpr, CHUNK: tl.constexpr, GDC: tl.constexpr):
        _gdc_enter(GDC)
        p = tl.program_id(0)
        w = tl.arange(0, 256)
        acc = tl.zeros([CHUNK, 256], tl.int32)
        for r0 in tl.range(0, ROWS, CHUNK, num_stages=3):
            slot = tl.load(idx_ptr + p * ROWS + r0 + tl.arange(0, CHUNK)).to(tl.int64)
            acc += tl.load(kv_ptr + slot[:, None] * 164 + w[None, :], mask=w[None, :] < 164, other=0)
        tl.store(out_ptr + p, tl.sum(tl.sum(acc, 1), 0))

    @triton.jit
    def gather_kernel(kv_ptr, idx_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
        p = tl.program_id(0)
        r = tl.arange(0, ROWS)
        w = tl.arange(0, WORDS)
        slot = tl.load(idx_ptr + p * ROWS + r).to(tl.int64)
        x = tl.load(kv_ptr + slot[:, None] * 164 + w[None, :], mask=w[None, :] < 164, other=0)
        tl.store(out_ptr + p, tl.sum(tl.sum(x, 1), 0))

    return null_kernel, gather_kernel, gather_rows_kernel


class _NoLaunch:
    """Stands in for the merge kernel: indexing gives a launcher that does nothing."""

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return lambda *a, **k: None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    ap.add_argument("--batch-gathers", nargs="*", type=int, default=[], metavar="B")
    ap.add_argument("--heads", type=int, default=16, help="h for the --batch-gathers roofline (Q and O bytes)")
    ap.add_argument("--copy-gbps", type=float, default=4250.0)
    args = ap.parse_args(argv)
    _bootstrap()
    import torch

    from pdctl.kernels import _sparse_mla
    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import DecodeConfig, sparse_mla_decode

    null_kernel, gather_kernel, gather_rows_kernel = _kernels()
    xs = [torch.zeros(32, dtype=torch.int32, device="cuda") for _ in range(4)]
    pdl = {"GDC": 1, "launch_pdl": True} if _sparse_mla._pdl_supported(xs[0].device) else {"GDC": 0}
    plain = {"GDC": 0}
    for label, n, kw in (("null ×1", 1, plain), ("null ×2", 2, plain), ("null ×2 PDL", 2, pdl)):
        fns = [lambda x=x, n=n, kw=kw: [null_kernel[(32,)](x, **kw) for _ in range(n)] for x in xs]
        print(f"{label}: {graph_us_multi(fns):.2f} µs")
    for b in args.batch_gathers:
        kv = torch.randint(0, 256, (262144, 656), dtype=torch.uint8, device="cuda")
        words = kv.view(torch.int32)
        nrot = rotations(b * 2048 * 656)
        idxs = [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(b)]).to(torch.int32)
                for _ in range(nrot)]
        nbytes = b * (2048 * (656 + 4) + args.heads * (576 + 512) * 2)
        roof = nbytes / (args.copy_gbps * 1e3)
        print(f"B={b}, h={args.heads}: roofline {roof:.2f} µs ({nbytes / 1e6:.2f} MB at {args.copy_gbps:.0f} GB/s), "
              f"80 % of it {roof / 0.8:.2f} µs", flush=True)
        for rows_p in (16, 32, 64, 128):
            progs = b * 2048 // rows_p
            sink = torch.empty(progs, dtype=torch.int32, device="cuda")
            for name, kw in (("plain", plain), ("PDL", pdl)):
                fns = [lambda i=i, p=progs, r=rows_p, kw=kw: gather_rows_kernel[(p,)](
                    words, i, sink, ROWS=r, CHUNK=16, **kw) for i in idxs]
                print(f"  gather B={b}: {progs} programs × {rows_p} rows, {name}: {graph_us_multi(fns):.2f} µs",
                      flush=True)
        del kv, words, idxs
        torch.cuda.empty_cache()
    sm = 0.135234
    for case in args.cases:
        h, rows, gluon, bh, splits, pdl_mode, merge = (int(x) for x in case.split(","))
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        nrot = rotations(rows * 2048 * 656)
        idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                        .to(torch.int32) for _ in range(nrot - 1)]
        if case == args.cases[0]:
            words = kv.view(torch.int32)
            sink = torch.empty(128, dtype=torch.int32, device="cuda")
            for progs in (32, 64, 128):  # the same 2048 rows over more SMs: latency vs one SM's throughput
                rows_p = 2048 // progs
                fns = [lambda i=i, p=progs, r=rows_p: gather_kernel[(p,)](words, i, sink, ROWS=r, WORDS=256)
                       for i in idxs]
                print(f"gather ({progs} programs × {rows_p} rows, index then rows): {graph_us_multi(fns):.2f} µs")
        cfg = DecodeConfig(block_h=bh, splits=splits, gluon=gluon, pdl=pdl_mode, merge=merge)
        o = torch.full((rows, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
        ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
        ok = _decode_tolerance_check(o, lse, ro, rl)
        full = graph_us_multi([lambda i=i: sparse_mla_decode(q, kv, i, sm, None, out=o, lse=lse, config=cfg)
                               for i in idxs])
        label = f"h={h} B={rows} gluon-{gluon}: {bh},{splits} pdl-{pdl_mode}{' merged' if merge else ''}"
        line = f"{label}: decode {full:.2f} µs (check {ok['ok']})"
        if not merge and splits > 1:
            orig = _sparse_mla._kernels
            _sparse_mla._kernels = lambda orig=orig: (orig()[0], _NoLaunch())
            try:
                split = graph_us_multi([lambda i=i: sparse_mla_decode(q, kv, i, sm, None, out=o, lse=lse, config=cfg)
                                        for i in idxs])
            finally:
                _sparse_mla._kernels = orig
            line += f", split kernel only {split:.2f} µs"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
