"""pdctl's own overhead per step, and how fast `status` notices a dead server.

Brings up the demo topology (SGLang stand-in under the process supervisor, real smg) on free
loopback ports in a temporary state directory, from nothing to parsers_configured, then:

* per step: wall time, time waiting on the engines (HTTP round trips to servers/router, and
  sleeps between polls while a server or the router comes up), and pdctl's own overhead = wall −
  waiting. Service-manager calls (writing units, spawning watchdogs) are shown separately;
* a second apply (everything already satisfied): the same table;
* kill -9 of decode's main PID → wall time until ``service.status`` reports decode unhealthy,
  and the cost of one ``status`` call.

Prints figures; asserts nothing. Run: ``.venv/bin/python benchmarks/bench_apply.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.deploy import dump_toml  # noqa: E402  (tests/harness/deploy.py)
from harness.sim import free_ports  # noqa: E402

from pdctl.statemachine import service, steps  # noqa: E402
from pdctl.statemachine.events import Event  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.wait = defaultdict(float)
        self.manager = defaultdict(float)
        self.step: str | None = None


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-bench-"))
    d = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    d["name"] = "bench"
    p = iter(free_ports(7))
    d["prefill"][0].update(port=next(p), bootstrap_port=next(p), nccl_port=next(p))
    d["decode"][0].update(port=next(p), nccl_port=next(p))
    d["router"].update(port=next(p), prometheus_port=next(p), health_check_interval_s=1)
    spec = tmp / "bench.toml"
    spec.write_text(dump_toml(d))
    clock = Clock()

    # Time spent in HTTP round trips to the engines and the router.
    def on_request(request: httpx.Request) -> None:
        request.extensions["t0"] = time.perf_counter()

    def on_response(response: httpx.Response) -> None:
        response.read()  # the body arrives after the headers: waiting on the engine too
        t0 = response.request.extensions.get("t0")
        if t0 is not None and clock.step:
            clock.wait[clock.step] += time.perf_counter() - t0

    client = httpx.Client(trust_env=False, event_hooks={"request": [on_request], "response": [on_response]})
    real_sleep = time.sleep

    def timed_sleep(s: float) -> None:
        t0 = time.perf_counter()
        real_sleep(s)
        if clock.step:
            clock.wait[clock.step] += time.perf_counter() - t0

    steps.time.sleep = timed_sleep  # the steps' poll loops

    real_build = service.build_context

    def build_context(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        ctx = real_build(*a, **kw)
        m = ctx.manager
        for name in ("install", "start", "stop", "restart", "status", "logs"):
            fn = getattr(m, name)

            def wrapped(*aa, _fn=fn, **kk):  # noqa: ANN002, ANN003, ANN202
                t0 = time.perf_counter()
                try:
                    return _fn(*aa, **kk)
                finally:
                    if clock.step:
                        clock.manager[clock.step] += time.perf_counter() - t0

            setattr(m, name, wrapped)
        return ctx

    service.build_context = build_context

    walls: dict[str, float] = {}

    class Sink:
        def emit(self, e: Event) -> None:
            if e.kind == "step_started":
                clock.step = e.step
            elif e.kind in ("step_verified", "step_skipped", "step_failed") and e.elapsed_s is not None:
                walls[e.step] = e.elapsed_s
                clock.step = None

    loaded = service.load(spec, state_dir=tmp / "state")
    try:
        for label in ("from nothing", "already up"):
            walls.clear()
            clock.wait.clear()
            clock.manager.clear()
            t0 = time.perf_counter()
            res = service.apply(service.load(spec, state_dir=tmp / "state"), sink=Sink(), client=client)
            total = time.perf_counter() - t0
            print(f"\napply {label}: reached {res.state} in {total:.2f} s wall")
            print(f"{'step':<20} {'wall s':>8} {'waiting s':>10} {'manager s':>10} {'pdctl own s':>12}")
            for name, wall in walls.items():
                w, m = clock.wait[name], clock.manager[name]
                print(f"{name:<20} {wall:>8.3f} {w:>10.3f} {m:>10.3f} {max(0.0, wall - w):>12.3f}")

        # Death → status.
        st = service.status(loaded, client=client)
        costs = []
        for _ in range(5):
            t0 = time.perf_counter()
            service.status(loaded, client=client)
            costs.append(time.perf_counter() - t0)
        dec = next(r for r in st["roles"] if r["name"] == "decode")
        os.kill(dec["main_pid"], signal.SIGKILL)
        t_kill = time.perf_counter()
        seen = None
        while time.perf_counter() - t_kill < 30:
            s = service.status(loaded, client=client)
            if not next(r for r in s["roles"] if r["name"] == "decode")["healthy"]:
                seen = time.perf_counter() - t_kill
                break
        print(f"\none `status` call: median {statistics.median(costs) * 1000:.1f} ms over {len(costs)}")
        print(f"decode killed -9 → status reports it unhealthy after {seen * 1000:.1f} ms" if seen else "status never saw it")
    finally:
        service.down(service.load(spec, state_dir=tmp / "state"))
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
