"""Round trips to the host per command when pdctl drives the demo over SSH (a loopback sshd).

Over SSH every host action is one round trip: an SFTP request (a file read, a stat, a listing) or a command. On a
far GPU host each costs the network's round-trip time, so their count, not this loopback's wall time, is what an
admin waits for. Brings up the demo topology (SGLang stand-in under the process supervisor, real smg) on free
loopback ports through a real OpenSSH server (``tests/harness/sshd.py``: needs ``sshd``), then counts the
``SshHost`` calls of `apply` (from nothing), `status`, `apply` (all satisfied) and `down`, by kind, with the
number of processes on this machine (a ``/proc`` scan used to be one read per process) and what the count would
cost at 20 ms a round trip.

Prints figures; asserts nothing. Run: ``.venv/bin/python benchmarks/bench_ssh.py``.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.deploy import dump_toml  # noqa: E402  (tests/harness/deploy.py)
from harness.sim import free_ports  # noqa: E402
from harness.sshd import Sshd  # noqa: E402

from pdctl.statemachine import service  # noqa: E402
from pdctl.statemachine import ssh as sshmod  # noqa: E402

KINDS = ("read_file", "exists", "list_dir", "readlink", "write_file", "remove_file", "make_dirs", "_sh", "signal")
RTT_S = 0.020


def main() -> None:
    reason = Sshd.skip_reason()
    if reason:
        sys.exit(f"bench_ssh: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-bench-ssh-"))
    sshd = Sshd.start(tmp / "sshd")
    calls: collections.Counter[str] = collections.Counter()
    for kind in KINDS:
        real = getattr(sshmod.SshHost, kind)

        def counted(self, *a, _real=real, _kind=kind, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls[_kind] += 1
            return _real(self, *a, **k)

        setattr(sshmod.SshHost, kind, counted)
    d = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    d["name"] = "benchssh"
    d["hosts"]["local"] = sshd.host_spec()
    p = iter(free_ports(7))
    d["prefill"][0].update(port=next(p), bootstrap_port=next(p), nccl_port=next(p))
    d["decode"][0].update(port=next(p), nccl_port=next(p))
    d["router"].update(port=next(p), prometheus_port=next(p))
    spec = tmp / "benchssh.toml"
    spec.write_text(dump_toml(d))
    state = tmp / "state"
    procs = sum(1 for e in os.listdir("/proc") if e.isdigit())
    print(f"processes on this machine: {procs}; round trips to the host per command (SshHost calls), loopback sshd")
    print(f"{'command':<24} {'wall s':>7} {'round trips':>11} {'at 20 ms':>9}  by kind")
    runs = (("apply (from nothing)", lambda: service.apply(service.load(spec, state_dir=state))),
            ("status", lambda: service.status(service.load(spec, state_dir=state))),
            ("apply (all satisfied)", lambda: service.apply(service.load(spec, state_dir=state))),
            ("down", lambda: service.down(service.load(spec, state_dir=state))))
    try:
        for label, run in runs:
            calls.clear()
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
            n = sum(calls.values())
            kinds = ", ".join(f"{k.lstrip('_')} {v}" for k, v in calls.most_common())
            print(f"{label:<24} {wall:7.2f} {n:11d} {n * RTT_S:8.1f}s  {kinds}")
    finally:
        try:
            service.down(service.load(spec, state_dir=state))
        except Exception as exc:  # noqa: BLE001  (already down, or the error to see)
            print(f"(final down: {exc})")
        sshd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
