"""Run the state machine's ``kernels_built`` step for ``examples/dsv32.toml`` on this host's GPU.

The same code path as ``pdctl apply``: the spec's build command (``kernels_build_command``: heads =
128 / decode TP, FP8 KV, the model's context length) with this interpreter and a temporary cache
dir, then ``KernelsBuilt.apply`` and ``KernelsBuilt.verify`` (which reads the manifest). Prints the
proof. Needs a CUDA GPU, torch and triton. Run on the device machine (see device_acceptance.sh).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.service import kernels_build_command
from pdctl.statemachine.spec import load_spec
from pdctl.statemachine.steps import KernelsBuilt, Timeouts

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    dep = load_spec(ROOT / "examples" / "dsv32.toml")
    cmd, manifest = kernels_build_command(dep)
    cache = tempfile.mkdtemp(prefix="sglang-cache-")
    old_cache = cmd[cmd.index("--cache-dir") + 1]
    cmd = [sys.executable, *[cache if a == old_cache else a for a in cmd[1:]]]
    if os.environ.get("PYTHONPATH"):  # a bare checkout mapped onto PYTHONPATH (device_acceptance.sh)
        # Run from /tmp: in the checkout, ./pdctl would shadow the mapped package for `-m`.
        cmd = ["env", "-C", "/tmp", f"PYTHONPATH={os.environ['PYTHONPATH']}", *cmd]
    manifest = manifest.replace(old_cache, cache)
    ctx = SimpleNamespace(dep=dep, host=LocalHost(), kernels_command=cmd, kernels_manifest=manifest, timeouts=Timeouts())
    step = KernelsBuilt()
    print("command:", " ".join(cmd))
    assert step.observe(ctx) is None, "kernels are enabled in the spec: observe must not skip"
    t0 = time.monotonic()
    step.apply(ctx)  # type: ignore[arg-type]
    proof = step.verify(ctx)  # type: ignore[arg-type]
    print(f"kernels_built: {proof.summary} ({time.monotonic() - t0:.1f} s)")
    m = proof.evidence["manifest"]
    print(json.dumps({k: m[k] for k in m if k in ("gpu", "versions", "ok")}, indent=1, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
