"""Wall time of `pdctl plan examples/seed.toml` (goal: under 0.3 s) and `pdctl validate`.

Runs each command 20 times in a fresh interpreter (as an operator would), prints min/median/max.
Also lists the heaviest imports on that path (-X importtime) so a regression is easy to find.
Run: ``.venv/bin/python benchmarks/bench_cli.py``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(args: list[str], n: int = 20) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory(prefix="pdctl-bench-") as state:
        env = {**os.environ, "PDCTL_STATE_DIR": state}
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=ROOT, env=env, capture_output=True, check=False)
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    for args in (["plan", "examples/seed.toml"], ["validate", "examples/seed.toml"], ["plan", "examples/demo.toml", "--json"]):
        t = bench(args)
        print(f"pdctl {' '.join(args):<36} min {min(t) * 1000:6.1f} ms  median {statistics.median(t) * 1000:6.1f} ms  max {max(t) * 1000:6.1f} ms")
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "pdctl", "plan", "examples/seed.toml"], cwd=ROOT, capture_output=True, text=True)
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            parts = line.split("|")
            try:
                rows.append((int(parts[1]), parts[2].rstrip()))
            except ValueError:
                pass
    print("heaviest imports (cumulative µs):")
    for us, name in sorted(rows, reverse=True)[:8]:
        print(f"  {us:>8}  {name}")
    loaded = [name.strip() for _us, name in rows]
    print("textual imported on the plan path:", any(n == "textual" for n in loaded))


if __name__ == "__main__":
    main()
