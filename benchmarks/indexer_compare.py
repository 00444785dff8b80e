"""Time the whole lightning-indexer call (logits + top-k) with this checkout's kernels beside other versions of
``kernels/_indexer_kernels.py``, on the same inputs, each version's output checked as a set against this
checkout's (and against the fp32 reference logits where that is cheap). Run on the GPU machine:

    python benchmarks/indexer_compare.py --compare before=OLD_KERNELS_DIR --config wide:topk_block=4096

where OLD_KERNELS_DIR holds an older ``_indexer.py`` with its ``_indexer_kernels.py`` (a kernels file alone works
only while its launch signatures match this checkout's).

Prints one line per (L, B, version): µs per call (median of CUDA-graph replays, inputs rotated so one replay
touches ≥ 3× the L2, as ``bench_kernels.py``), % of copy bandwidth at 132 B per context token, and the checks.
The versions are timed in turn, twice (A B A B), so that clock drift shows as a spread rather than a difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _bootstrap, graph_us_multi, indexer_reps, rotations  # noqa: E402

CASES = ((8192, 1), (8192, 8), (8192, 64), (32768, 1), (32768, 8), (32768, 64), (131072, 1), (131072, 8),
         (131072, 64))


def _load(label: str, path: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(f"indexer_kernels_{label}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=PATH",
                    help="another version of kernels/_indexer_kernels.py to time beside this checkout's, or a "
                         "folder holding one with the _indexer.py that launches it")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL:KEY=VAL[,KEY=VAL]",
                    help="this checkout's kernels with IndexerConfig fields changed (e.g. big:topk_block=4096)")
    ap.add_argument("--cases", nargs="+", default=None, metavar="L,B",
                    help="shapes to time (context length L, batch B) instead of the nine of the benchmark table")
    ap.add_argument("--copy-gbps", type=float, default=4250.0, help="copy bandwidth for the %% column")
    args = ap.parse_args(argv)
    _bootstrap()
    import torch

    from pdctl.kernels import _indexer as ix
    from pdctl.kernels._build import check_topk, make_indexer_case
    from pdctl.kernels._reference import reference_indexer_logits

    base = ix._TUNED.get("default") or ix.IndexerConfig()
    versions = {"this": (ix, ix._kernels(), base)}
    for item in args.compare:
        label, _, path = item.partition("=")
        if Path(path).is_dir():  # an older launcher with its kernels: its own IndexerConfig defaults
            launcher = _load(f"{label}_launcher", str(Path(path) / "_indexer.py"))
            versions[label] = (launcher, _load(label, str(Path(path) / "_indexer_kernels.py")),
                               launcher.IndexerConfig())
        else:
            versions[label] = (ix, _load(label, path), base)
    for item in args.config:
        label, _, fields = item.partition(":")
        changes = {k: int(v) for k, v in (f.split("=") for f in fields.split(","))}
        versions[label] = (ix, ix._kernels(), dataclasses.replace(base, **changes))
    own = {id(m): m._kernels for m, _, _ in versions.values()}
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] if args.cases else CASES
    for L, B in cases:
        nrot = rotations(B * L * 132, cap=8)
        q8, w, cache, bt, sl = make_indexer_case([L] * (B * nrot), max_context=163840)
        reps = indexer_reps(q8, w, bt, sl, B, nrot)
        ref_logits = None
        if B * L <= 8 * 32768:
            ref_logits = reference_indexer_logits(q8[:B], w[:B], cache, bt[:B], sl[:B], compute_dtype=torch.float32)
        first = None
        times: dict[str, list[float]] = {v: [] for v in versions}
        checks: dict[str, str] = {}
        for rnd in range(2):
            for label, (lx, mod, cfg) in versions.items():
                lx._kernels = lambda mod=mod: mod
                try:
                    a = reps[0]
                    if rnd == 0:
                        a[4].fill_(-7)
                        lx.lightning_indexer(a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5], config=cfg)
                        torch.cuda.synchronize()
                        got = a[4].sort(dim=1).values.clone()
                        first = got if first is None else first
                        checks[label] = "same set" if torch.equal(got, first) else "DIFFERENT SET"
                        if ref_logits is not None:
                            checks[label] += "; reference " + str(check_topk(a[4], ref_logits, bt[:B], sl[:B], 2048))
                    times[label].append(graph_us_multi([lambda a=a, cfg=cfg, lx=lx: lx.lightning_indexer(
                        a[0], a[1], cache, a[2], a[3], 2048, out=a[4], logits=a[5], config=cfg) for a in reps]))
                finally:
                    lx._kernels = own[id(lx)]
        for label in versions:
            best = min(times[label])
            frac = B * L * 132 / (best * 1e-6) / (args.copy_gbps * 1e9)
            spread = " / ".join(f"{t:.1f}" for t in times[label])
            print(f"L={L} B={B} {label}: {best:.1f} us ({spread}), {frac:.0%} of copy BW; {checks.get(label)}",
                  flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
