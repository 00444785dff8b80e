"""Does the SMs' split of their 256 KB between L1 and shared memory cost time between our kernels?

An SM runs the programs of one kernel with one L1/shared-memory split ("carveout"), and can change it only while
it is idle (CUDA C++ Programming Guide, "Shared Memory" of compute capability 9.0: 0–228 KB of shared memory).
Triton asks for the largest shared carveout only for kernels that need more than 48 KB
(``cuFuncSetCacheConfig(CU_FUNC_CACHE_PREFER_SHARED)`` in ``triton/backends/nvidia/driver.c``); for the others the
driver picks one from the kernel's needs. The decode's split kernel (~200 KB) and its merge (none), and the
indexer's logits (33 KB × 4 programs) and top-k launches, then alternate between splits on the same SMs, and with
programmatic dependent launch the next grid's programs cannot join an SM configured for the previous one.

This times each case with the driver's choice (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` = −1) and
with every loaded kernel preferring the largest shared carveout (100 %), in turn (A B A B), same harness as
``bench_kernels.py`` (CUDA graph recaptured for each, back-to-back replays, inputs rotated), µs per call; each
decode output is checked against the fp32 reference first.

Usage (device machine, repo root): ``PDCTL_KERNELS_GPU=1 python3 benchmarks/carveout.py``
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, indexer_reps, rotations  # noqa: E402

CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h, CUDA 9.0+)
SHARED_STATIC = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
LOADED: list = []  # every CompiledKernel loaded in this process

DECODE = [  # h, B, gluon, block_h, splits, pdl, merge: the shipped table's configs
    (16, 1, 5, 16, 32, 1, 0), (32, 1, 5, 16, 32, 1, 0), (16, 8, 5, 16, 16, 2, 0), (32, 8, 5, 32, 16, 1, 1),
    (128, 1, 5, 16, 16, 2, 1), (16, 64, 4, 16, 2, 2, 0),
]
INDEXER = [(8192, 1), (32768, 8), (8192, 64), (131072, 64)]


def _hook() -> None:
    from triton.compiler.compiler import CompiledKernel

    orig = CompiledKernel._init_handles

    def init(self):  # noqa: ANN001, ANN202
        fresh = getattr(self, "function", None) is None
        orig(self)
        if fresh and getattr(self, "function", None) is not None:
            LOADED.append(self)

    CompiledKernel._init_handles = init


def _set_all(value: int) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    for ck in LOADED:
        rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(ck.function), CARVEOUT, ctypes.c_int(value))
        if rc:
            raise RuntimeError(f"cuFuncSetAttribute({ck.name}, carveout {value}) returned {rc}")


def _describe() -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    for ck in LOADED:
        v = ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(v), CARVEOUT, ctypes.c_void_p(ck.function))
        print(f"  loaded {ck.name}: dynamic shared {ck.metadata.shared} B, carveout {v.value}")


def _ab(label: str, fns_for) -> None:  # noqa: ANN001
    times: dict[str, list[float]] = {"driver": [], "max shared": []}
    for _ in range(2):
        for name, value in (("driver", -1), ("max shared", 100)):
            _set_all(value)
            times[name].append(graph_us_multi(fns_for()))
    _set_all(-1)
    print(f"{label}: " + "; ".join(f"{k} {min(v):.2f} µs ({' / '.join(f'{x:.2f}' for x in v)})"
                                   for k, v in times.items()), flush=True)


def main() -> int:
    _bootstrap()
    _hook()
    import torch

    from pdctl.kernels import _indexer as ix
    from pdctl.kernels._build import _decode_tolerance_check, make_decode_case, make_indexer_case
    from pdctl.kernels._reference import reference_sparse_mla_decode
    from pdctl.kernels._sparse_mla import DecodeConfig, sparse_mla_decode

    sm = 0.135234
    for h, rows, gluon, bh, splits, pdl, merge in DECODE:
        q, kv, idx, _ = make_decode_case(h, rows, "fp8", slots=262144, ragged=False, with_length=False)
        nrot = rotations(rows * 2048 * 656)
        idxs = [idx] + [torch.stack([torch.randperm(kv.shape[0], device="cuda")[:2048] for _ in range(rows)])
                        .to(torch.int32) for _ in range(nrot - 1)]
        cfg = DecodeConfig(block_h=bh, splits=splits, gluon=gluon, pdl=pdl, merge=merge)
        o = torch.full((rows, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(rows, h, device="cuda")
        ro, rl = reference_sparse_mla_decode(q, kv, idx, sm, None, compute_dtype=torch.float32)
        for value in (-1, 100):
            _set_all(value)
            o.fill_(float("nan"))
            sparse_mla_decode(q, kv, idx, sm, None, out=o, lse=lse, config=cfg)
            ok = _decode_tolerance_check(o, lse, ro, rl)["ok"]
            if not ok:
                print(f"h={h} B={rows}: CHECK FAILED with carveout {value}")
        label = f"decode h={h} B={rows} gluon-{gluon}: {bh},{splits} pdl-{pdl}{' merged' if merge else ''} (check {ok})"
        _ab(label, lambda q=q, kv=kv, idxs=idxs, cfg=cfg, o=o, lse=lse: [
            lambda i=i: sparse_mla_decode(q, kv, i, sm, None, out=o, lse=lse, config=cfg) for i in idxs])
    base = ix._TUNED.get("default") or ix.IndexerConfig()
    for L, B in INDEXER:
        nrot = rotations(B * L * 132, cap=8)
        q8, w, cache, bt, sl = make_indexer_case([L] * (B * nrot), max_context=163840)
        reps = indexer_reps(q8, w, bt, sl, B, nrot)
        outs = []
        for value in (-1, 100):
            _set_all(value)
            a = reps[0]
            a[4].fill_(-7)
            ix.lightning_indexer(a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5], config=base)
            outs.append(a[4].sort(dim=1).values.clone())
        same = torch.equal(outs[0], outs[1])
        _ab(f"indexer L={L} B={B} (same set {same})", lambda reps=reps, cache=cache: [
            lambda a=a: ix.lightning_indexer(a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5], config=base)
            for a in reps])
        torch.cuda.empty_cache()
    _describe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
