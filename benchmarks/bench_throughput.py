"""Throughput of a deployment through its router: ``pdctl bench`` (``statemachine/bench.py``), optionally after
``pdctl apply``.

Usage (pdctl's venv)::

    .venv/bin/python benchmarks/bench_throughput.py examples/demo.toml [--apply] [pdctl bench's options...]

Every option but ``--apply`` is ``pdctl bench``'s (``--concurrency 1,4,16 --isl 256 --osl 128
--requests-per-level 8 --duration-s S --tokenizer PATH --timeout S --state-dir DIR --json``): see ``pdctl bench
--help`` and :mod:`pdctl.statemachine.bench`'s docstring for what is measured, why AIPerf, and where it is saved.
"""

from __future__ import annotations

import sys

from pdctl.console.cli import main as pdctl


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--apply" in args:
        args.remove("--apply")
        spec = next(a for a in args if not a.startswith("-"))
        state = [a for i, a in enumerate(args) if a.startswith("--state-dir") or (i and args[i - 1] == "--state-dir")]
        try:
            pdctl(["apply", spec, *state])
        except SystemExit as e:
            if e.code:
                raise
    pdctl(["bench", *args])


if __name__ == "__main__":
    main()
