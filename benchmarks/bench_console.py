#!/usr/bin/env python3
"""CPU use of the pdctl console at its refresh interval with the demo topology up.

Brings up a copy of ``examples/demo.toml`` on free ports (the SGLang stand-in under the process
supervisor and the real smg router; needs ``smg`` from ``pdctl[router]``), starts
``pdctl console SPEC --refresh R`` in a pseudo-terminal of 80x24, lets it warm up, then reads the
console process's user+system CPU time from ``/proc/<pid>/stat`` over the measuring window. By
default a chat request goes through the router every 2 s so every panel has moving numbers.
Each tab is measured in turn (hidden tabs cost less: Textual skips what is not displayed).
Then it quits the console (``q``) and takes the demo down.

Goal: under 3 % of one core at 1 s refresh.

    python benchmarks/bench_console.py                    # 30 s per tab, 1 s refresh
    python benchmarks/bench_console.py --seconds 60 --tabs topology throughput --no-traffic
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAB_KEYS = {"topology": "1", "gpu": "2", "throughput": "3", "logs": "4", "proof": "5", "plan": "6"}


sys.path.insert(0, str(ROOT / "tests"))
from harness.deploy import Demo  # noqa: E402  (tests/harness/deploy.py: the demo on free ports)


def demo_spec(tmp: Path) -> tuple[Path, dict[str, int]]:
    d = Demo(tmp)
    return d.spec, d.ports


def cpu_seconds(pid: int) -> float:
    """utime + stime of *pid* (and its reaped children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def traffic(router_port: int, model: str, stop: threading.Event, every_s: float = 2.0) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "count to twenty"}], "max_tokens": 64}).encode()
    while not stop.wait(every_s):
        req = urllib.request.Request(f"http://127.0.0.1:{router_port}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except OSError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="measuring window per tab (default 30)")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--refresh", type=float, default=1.0, help="console refresh interval (default 1 s)")
    ap.add_argument("--tabs", nargs="+", default=["topology", "throughput", "gpu", "logs"], choices=list(TAB_KEYS))
    ap.add_argument("--no-traffic", action="store_true", help="no chat requests during the measurement")
    ap.add_argument("--size", default="80x24")
    args = ap.parse_args()

    from pdctl.statemachine import service

    tmp = Path(tempfile.mkdtemp(prefix="pdctl-bench-console-"))
    spec, ports = demo_spec(tmp)
    state = tmp / "state"
    loaded = service.load(spec, state_dir=state)
    print(f"bringing up {loaded.deployment.name} (demo topology) on free ports…", file=sys.stderr)
    t0 = time.monotonic()
    res = service.apply(loaded)
    print(f"  reached {res.state} in {time.monotonic() - t0:.1f} s", file=sys.stderr)

    stop = threading.Event()
    feeder = None
    if not args.no_traffic:
        feeder = threading.Thread(target=traffic, args=(ports["router"], loaded.deployment.model.served_name, stop), daemon=True)
        feeder.start()

    cols, rows = (int(x) for x in args.size.split("x"))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PDCTL_STATE_DIR": str(state), "COLUMNS": str(cols), "LINES": str(rows)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "console", str(spec), "--refresh", str(args.refresh)],
        stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True, close_fds=True,
    )
    os.close(slave)
    drained = {"bytes": 0}

    def drain() -> None:  # a terminal that is never read blocks the app
        while proc.poll() is None:
            r, _w, _x = select.select([master], [], [], 0.2)
            if r:
                try:
                    drained["bytes"] += len(os.read(master, 65536))
                except OSError:
                    return

    threading.Thread(target=drain, daemon=True).start()
    results = []
    try:
        time.sleep(args.warmup)
        if proc.poll() is not None:
            raise SystemExit(f"the console exited early (rc {proc.returncode})")
        for tab in args.tabs:
            os.write(master, TAB_KEYS[tab].encode())
            time.sleep(1.0)
            c0, w0, b0 = cpu_seconds(proc.pid), time.monotonic(), drained["bytes"]
            time.sleep(args.seconds)
            c1, w1, b1 = cpu_seconds(proc.pid), time.monotonic(), drained["bytes"]
            pct = 100.0 * (c1 - c0) / (w1 - w0)
            results.append((tab, pct, (b1 - b0) / (w1 - w0)))
            print(f"  tab {tab:<10} {pct:5.2f} % of one core   ({(b1 - b0) / (w1 - w0):,.0f} B/s to the terminal)", file=sys.stderr)
    finally:
        if proc.poll() is None:
            os.write(master, b"q")
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        stop.set()
        service.down(loaded)
        os.close(master)
        shutil.rmtree(tmp, ignore_errors=True)
    if not results:
        return 1
    worst = max(p for _t, p, _b in results)
    mean = sum(p for _t, p, _b in results) / len(results)
    print(
        f"console CPU at {args.refresh:g} s refresh, demo topology up{'' if args.no_traffic else ', chat every 2 s'}, {args.size}: "
        f"mean {mean:.2f} %, worst tab {worst:.2f} % of one core (goal < 3 %) — {'OK' if worst < 3.0 else 'OVER GOAL'}"
    )
    return 0 if worst < 3.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
