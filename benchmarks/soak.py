"""Soak: every fault, one at a time, under client traffic, on a 1-prefill + 1-decode and a 2-prefill + 1-decode demo
(issue 39 item 6).

The real smg router and pdctl's SGLang stand-in under the process supervisor, on free loopback ports in a temporary
state directory. For each spec, one deployment; for each fault (kill -9 of decode's, prefill's and the router's main
process; ``pdctl apply --restart prefill``): client traffic at ``--rate`` requests a second through the router for at
least ``--seconds`` after the fault, ``service.status`` with its canary polled back to back, and a deployment that
has not come back by itself ``--self-recovery`` seconds after the fault recovered as an operator would, with
``pdctl apply``. (That bound's default, 75 s, lies past smg's breaker: a circuit it opened stays open 60 s,
``--cb-timeout-duration-secs``, before a request may close it; a bound of 60 s would end just as it may.) The
driver is ``tests/harness/soak.py`` (the soak test runs a short version of it and asserts the bounds).

Prints the table (fault, spec, sent, failed, fault → not healthy, fault → healthy, recovery, lied?) and, per fault,
what status first said, the client failures' kinds, the plan's client impact of an apply and status's own latency.
Asserts nothing. Run: ``.venv/bin/python benchmarks/soak.py [--seconds 60] [--rate 5]``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import soak  # noqa: E402  (tests/harness/soak.py)
from harness.deploy import Demo  # noqa: E402

SPECS = {"1P1D": None, "2P1D": soak.two_prefills}
ORDER = ["kill -9 decode", "kill -9 prefill", "kill -9 router", "apply --restart prefill"]


def _kinds(res: soak.FaultResult) -> str:
    """The failures grouped by what the client got, with when (seconds after the fault)."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for f in res.failures:
        msg = f.error
        if '"message":"' in msg:
            msg = msg.split('"message":"', 1)[1].split('"', 1)[0]
        groups[f"HTTP {f.status}: {msg[:90]}" if f.status else msg[:90]].append(f.sent)
    return "; ".join(f"{len(ts)}× {k} (sent {min(ts):.1f}–{max(ts):.1f} s)" for k, ts in groups.items()) or "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="client traffic after each fault, at least")
    ap.add_argument("--self-recovery", type=float, default=75.0,
                    help="how long a deployment is left to come back by itself before an operator's `pdctl apply`")
    ap.add_argument("--rate", type=float, default=5.0, help="client requests per second through the router")
    ap.add_argument("--spec", choices=list(SPECS), action="append", help="only this spec (repeatable)")
    ap.add_argument("--fault", choices=ORDER, action="append", help="only this fault (repeatable)")
    args = ap.parse_args()
    results: list[soak.FaultResult] = []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdctl-soak-") as tmp:
        for spec in args.spec or list(SPECS):
            sub = Path(tmp) / spec
            sub.mkdir()
            demo = Demo(sub, SPECS[spec])
            try:
                t0 = time.monotonic()
                state = demo.apply().state
                print(f"# {spec}: applied ({state}) in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
                for fault in args.fault or ORDER:
                    res = soak.run_fault(demo, fault, spec, rate=args.rate, settle_s=5.0,
                                         self_recovery_s=args.self_recovery, min_traffic_s=args.seconds,
                                         recovery_bound_s=120.0)
                    results.append(res)
                    print(f"# {fault} on {spec}: {' | '.join(res.row())}", file=sys.stderr, flush=True)
            finally:
                demo.down()
    print(soak.table(results))
    print()
    for r in results:
        st = r.status_s
        print(f"- {r.fault} on {r.spec}: {'; '.join(r.notes)}")
        print(f"  first not-healthy status: {r.first_unhealthy_why or '-'}")
        print(f"  client failures: {_kinds(r)}" + (f"; skipped ticks (every client thread busy): {r.skipped}"
                                                     if r.skipped else ""))
        if r.window is not None:
            print(f"  apply ran 0–{r.window[1]:.1f} s; failures outside it: {len(r.failures_outside_window)}; "
                  f"plan's client impact: {r.client_impact or 'none (served throughout)'}")
        if r.lying:
            print(f"  status said healthy while a request failed: {len(r.lying)} poll(s), longest run "
                  f"{r.longest_lie_s:.2f} s, first at {r.lying[0].started:.2f} s")
        if st:
            print(f"  status calls: {len(st)}, median {statistics.median(st) * 1000:.0f} ms, "
                  f"max {max(st) * 1000:.0f} ms")
    print(f"\ntotal {time.monotonic() - t_all:.0f} s, rate {args.rate:g}/s, traffic ≥ {args.seconds:g} s after each "
          f"fault, {args.self_recovery:g} s to come back by itself")
    return 0


if __name__ == "__main__":
    sys.exit(main())
