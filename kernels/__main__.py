"""``python -m pdctl.kernels build --cache-dir DIR [--model deepseek-v4] [...]``: the ``kernels_built`` step on the
target host.

Prints the manifest path on success (exit 0). Exit 2: cannot build here (no CUDA GPU / no torch+triton, or
``PDCTL_KERNELS_COMPILE_WORKERS`` is not a whole number; nothing is written);
exit 1: verification failed (the manifest is still written, with ``"ok": false``). Errors go to stderr.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, without running anything: pdctl's ``kernels_built`` step checks the command it
    writes against it (``pdctl.statemachine.service.kernels_build_command``'s test)."""
    parser = argparse.ArgumentParser(prog="python -m pdctl.kernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile, tune and verify on this host's GPU; write the manifest")
    b.add_argument("--cache-dir", required=True, help="server cache dir (SGLANG_CACHE_DIR); manifest + triton/ go here")
    b.add_argument("--model", choices=["deepseek-v3.2", "deepseek-v4"], default="deepseek-v3.2",
                   help="which model's kernels (V4: the dsv4 backend's 584-byte cache and compressed-row indexer)")
    b.add_argument("--heads", type=int, nargs="+", default=[16],
                   help="local attention heads (num_attention_heads / attention TP), e.g. 16 32")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    b.add_argument("--kv-formats", nargs="+", choices=["fp8", "bf16", "v4"], default=None,
                   help="default: fp8 bf16 (V3.2), v4 (V4)")
    b.add_argument("--topk", type=int, default=None, help="index_topk (default 2048 for V3.2, 512 for V4)")
    b.add_argument("--max-context", type=int, default=None, help="default 163840 (V3.2), 1048576 (V4)")
    b.add_argument("--no-tune", action="store_true", help="verify the default configs only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from pdctl.kernels._build import KernelsBuildError, build_and_verify

    try:
        m = build_and_verify(
            args.cache_dir, heads=tuple(args.heads), batch_sizes=tuple(args.batch_sizes),
            kv_formats=tuple(args.kv_formats) if args.kv_formats else None, topk=args.topk,
            max_context=args.max_context, tune=not args.no_tune, model=args.model,
        )
    except KernelsBuildError as e:
        print(f"pdctl.kernels: {e}", file=sys.stderr)
        return 2 if str(e).startswith("cannot build here") else 1
    print(m["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
