"""Faults under client traffic, one at a time, against a :class:`~harness.deploy.Demo` (issue 39 item 6).

The soak test (``tests/statemachine/test_soak.py``) and the benchmark (``benchmarks/soak.py``) both run
:func:`run_fault`; this module is the one copy of the driver. For each fault it

* sends client traffic through the router at a fixed rate (:class:`Traffic`: the canary-sized ``POST /generate``,
  each request with a bounded timeout, from one bounded thread pool; a tick that finds every thread busy is counted
  as ``skipped``, never queued);
* polls ``service.status(loaded, canary=True)`` back to back (:class:`Poller`), recording when each call started and
  ended and what it said;
* injects the fault and waits, bounded, for status to say not healthy and then healthy again; a deployment that does
  not come back by itself within the bound is recovered as an operator would, with ``pdctl apply`` (the service call);
* judges the record (:class:`FaultResult`): requests sent and failed (each failure's time and HTTP status or error),
  fault → first poll that said not healthy (its end: when a reader of status knows), fault → first healthy poll after
  that, and the polls that said healthy while a client request failed (:func:`lies`).

Times are ``time.monotonic()`` seconds. Nothing here asserts: the test asserts the bounds, the benchmark prints.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

__all__ = ["FAULTS", "Failure", "FaultResult", "Poll", "Poller", "Traffic", "lies", "run_fault", "table",
           "two_prefills"]


def two_prefills(d: dict) -> None:
    """Spec mutation: a second prefill replica (``prefill-1``) on free ports, so the spec is 2P1D."""
    from harness.sim import free_ports

    extra = dict(d["prefill"][0])  # (named prefill-1 by its position)
    extra["port"], extra["bootstrap_port"], extra["nccl_port"] = free_ports(3)
    extra["gpus"] = [8, 9, 10, 11]
    d["prefill"].append(extra)


@dataclass(frozen=True)
class Failure:
    """One client request that did not get a 200 with tokens: ``status`` 0 when no HTTP answer came."""

    sent: float
    ended: float
    status: int
    error: str


@dataclass(frozen=True)
class Poll:
    """One ``service.status`` call: when it started and returned, ``healthy``, and why not in words."""

    started: float
    ended: float
    healthy: bool
    why: str


class Traffic:
    """Client requests through the router at *rate* per second until :meth:`stop`; each bounded by *timeout_s*, at
    most *max_in_flight* at once (one thread pool)."""

    BODY = {"text": "soak client", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}

    def __init__(self, router_url: str, *, rate: float = 5.0, timeout_s: float = 5.0, max_in_flight: int = 8) -> None:
        self.url = f"{router_url}/generate"
        self.rate, self.timeout_s, self.max_in_flight = rate, timeout_s, max_in_flight
        self.sent: list[float] = []
        self.failures: list[Failure] = []
        self.skipped = 0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="soak-client")
        self._client = httpx.Client(trust_env=False, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=max_in_flight))
        self._thread = threading.Thread(target=self._tick, name="soak-traffic", daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def _tick(self) -> None:
        t0, i = time.monotonic(), 0
        while not self._stop.is_set():
            with self._lock:
                busy = self._in_flight >= self.max_in_flight
                if not busy:
                    self._in_flight += 1
            if busy:
                self.skipped += 1
            else:
                self._pool.submit(self._one)
            i += 1
            self._stop.wait(max(0.0, t0 + i / self.rate - time.monotonic()))

    def _one(self) -> None:
        sent = time.monotonic()
        with self._lock:
            self.sent.append(sent)
        status, error = 0, ""
        try:
            r = self._client.post(self.url, json=self.BODY, timeout=self.timeout_s)
            status = r.status_code
            if status != 200:
                error = r.text[:160]
            elif not (r.json().get("output_ids") or r.json().get("text")):
                error = f"no tokens: {r.text[:100]}"
        except httpx.TimeoutException:
            error = f"no answer within {self.timeout_s:g} s"
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:160]
        ended = time.monotonic()
        with self._lock:
            if error:
                self.failures.append(Failure(sent, ended, status, error))
            self._in_flight -= 1

    def stop(self) -> None:
        """Stop sending and wait for the requests in flight (each bounded by its timeout)."""
        self._stop.set()
        self._thread.join(5)
        self._pool.shutdown(wait=True)
        self._client.close()


class Poller:
    """``service.status(loaded, canary=True)`` back to back in a thread until :meth:`stop`; :attr:`polls` in order."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded
        self.polls: list[Poll] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-status", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def _run(self) -> None:
        from pdctl.statemachine import service

        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                st = service.status(self.loaded, canary=True)
                healthy, why = bool(st["healthy"]), "" if st["healthy"] else _why(st)
            except Exception as exc:  # noqa: BLE001  (status raising is itself an answer: not healthy)
                healthy, why = False, f"status raised {type(exc).__name__}: {exc}"[:200]
            self.polls.append(Poll(t0, time.monotonic(), healthy, why))

    def after(self, t: float) -> list[Poll]:
        return [p for p in list(self.polls) if p.started >= t]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _why(st: dict) -> str:
    """The first reason a status dict gives for not healthy, short."""
    r = st.get("router") or {}
    for role in st.get("roles", []):
        if not role.get("healthy"):
            return f"{role['name']}: {role.get('state')} {role.get('error') or ''}"[:160]
    if r:
        if r.get("readiness") != 200:
            return f"router: {r.get('error')}"[:160]
        problems = (r.get("serving") or {}).get("problems") or []
        if problems:
            return f"router: {'; '.join(problems)}"[:160]
        if r.get("mismatches"):
            return f"router: {'; '.join(r['mismatches'])}"[:160]
    if st.get("locked_by"):
        lock = st["locked_by"]
        return f"{lock.get('purpose', 'an apply or down')} runs (PID {lock.get('pid')})" if isinstance(lock, dict) \
            else f"locked by {lock}"[:160]
    return "not converged"


def lies(polls: list[Poll], failures: list[Failure]) -> list[Poll]:
    """The polls that said healthy while a client request failed: the poll ran inside a failed request's life (it
    started after the request was sent and returned before it failed), or the request failed while the poll ran."""
    out = []
    for p in polls:
        if p.healthy and any((f.sent <= p.started and p.ended <= f.ended) or (p.started <= f.ended <= p.ended)
                             for f in failures):
            out.append(p)
    return out


def longest_lie_s(polls: list[Poll], lying: list[Poll]) -> float:
    """The longest run of consecutive lying polls, from the first one's start to the last one's end (0: none)."""
    bad = {id(p) for p in lying}
    best, run_start, last_end = 0.0, None, None
    for p in polls:
        if id(p) in bad:
            run_start = p.started if run_start is None else run_start
            last_end = p.ended
            best = max(best, last_end - run_start)
        else:
            run_start = None
    return best


@dataclass
class FaultResult:
    """What one fault did to clients and what status said about it."""

    fault: str
    spec: str
    sent: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    to_unhealthy_s: float | None = None
    """Fault → the end of the first status call started after it that said not healthy (None: none did)."""
    to_healthy_s: float | None = None
    """Fault → the end of the first healthy status call after that (None: not within the bounds)."""
    recovery: str = ""
    """``by itself`` / ``pdctl apply`` (an operator's, after the deployment did not come back within the bound) /
    ``apply finished`` (the fault was the apply) / ``none``."""
    lying: list[Poll] = field(default_factory=list)
    longest_lie_s: float = 0.0
    status_s: list[float] = field(default_factory=list)
    """Each status call's duration."""
    window: tuple[float, float] | None = None
    """The fault's own window (an apply's start and end), relative to the fault."""
    failures_outside_window: list[Failure] = field(default_factory=list)
    client_impact: list[str] = field(default_factory=list)
    """``Plan.client_impact()`` of an apply fault, planned before it ran."""
    first_unhealthy_why: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def lied(self) -> bool:
        """Status said healthy while clients failed for longer than one canary period (2 s)."""
        return self.longest_lie_s > 2.0

    def row(self) -> list[str]:
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        lie = f"yes ({self.longest_lie_s:.1f} s)" if self.lied else (
            f"no ({len(self.lying)} poll{'s' if len(self.lying) != 1 else ''} ≤ 2 s)" if self.lying else "no")
        return [self.fault, self.spec, str(self.sent), str(self.failed), s(self.to_unhealthy_s),
                s(self.to_healthy_s), self.recovery, lie]


def _main_pid(demo: Any, name: str) -> int:
    from pdctl.statemachine import service

    st = service.status(demo.load(), canary=False)
    if name == "router":
        return int(st["router"]["main_pid"])
    return int(next(r for r in st["roles"] if r["name"] == name)["main_pid"])


def _kill(name: str) -> Callable[[Any], dict]:
    def fault(demo: Any) -> dict:
        pid = _main_pid(demo, name)
        os.kill(pid, signal.SIGKILL)
        return {"t": time.monotonic(), "note": f"kill -9 {name} PID {pid}"}

    return fault


def _apply_restart(*names: str) -> Callable[[Any], dict]:
    def fault(demo: Any) -> dict:
        from pdctl.statemachine import service

        impact = service.plan_spec(demo.load(), restart=names).client_impact()
        t = time.monotonic()
        result = demo.apply(restart=set(names))
        return {"t": t, "window": (t, time.monotonic()), "impact": impact,
                "note": f"apply --restart {' '.join(names)} → {result.state}"}

    return fault


FAULTS: dict[str, Callable[[Any], dict]] = {
    "kill -9 decode": _kill("decode"),
    "kill -9 prefill": _kill("prefill"),
    "kill -9 router": _kill("router"),
    "apply --restart prefill": _apply_restart("prefill"),
}
"""Fault name → a function of the Demo that injects it and returns ``{"t": when (monotonic), "note": …}`` plus,
for an apply, its ``window`` and ``client_impact``. Kills return at once; an apply returns when it has finished."""


def wait_healthy(demo: Any, bound_s: float) -> bool:
    """Poll status (with its canary) until it says healthy, at most *bound_s* seconds."""
    from pdctl.statemachine import service

    loaded, end = demo.load(), time.monotonic() + bound_s
    while time.monotonic() < end:
        if service.status(loaded, canary=True)["healthy"]:
            return True
        time.sleep(0.2)
    return False


def run_fault(demo: Any, fault: str, spec: str, *, rate: float = 5.0, settle_s: float = 2.0,
              unhealthy_bound_s: float = 10.0, self_recovery_s: float = 15.0, recovery_bound_s: float = 60.0,
              tail_s: float = 2.0, min_traffic_s: float = 0.0, request_timeout_s: float = 5.0) -> FaultResult:
    """Inject *fault* (a key of :data:`FAULTS`) into the healthy *demo* under traffic and judge what followed.

    Traffic runs *settle_s* before the fault and *tail_s* after status is healthy again, and at least *min_traffic_s*
    after the fault. After the fault: up to
    *unhealthy_bound_s* for a not-healthy status (an apply's own run counts), then up to *self_recovery_s* for healthy
    by itself; failing that, ``pdctl apply`` (the operator's recovery), then up to *recovery_bound_s*."""
    res = FaultResult(fault, spec)
    if not wait_healthy(demo, recovery_bound_s):
        res.recovery, res.notes = "none", ["not healthy before the fault"]
        return res
    traffic = Traffic(f"http://127.0.0.1:{demo.ports['router']}", rate=rate, timeout_s=request_timeout_s).start()
    poller = Poller(demo.load()).start()
    try:
        time.sleep(settle_s)  # (traffic and status before the fault: the baseline, judged as the rest)
        done = FAULTS[fault](demo)
        t = done["t"]
        res.notes.append(done["note"])
        res.client_impact = done.get("impact", [])
        is_apply = "window" in done

        def first(pred: Callable[[Poll], bool], since: float, bound: float) -> Poll | None:
            end = time.monotonic() + bound
            while True:
                got = next((p for p in poller.after(since) if pred(p)), None)
                if got is not None or time.monotonic() > end:
                    return got
                time.sleep(0.05)

        down = first(lambda p: not p.healthy, t, 0 if is_apply else unhealthy_bound_s)
        if down is not None:
            res.to_unhealthy_s, res.first_unhealthy_why = down.ended - t, down.why
        since = down.ended if down is not None else t
        if is_apply:
            res.window = (0.0, done["window"][1] - t)
            res.recovery = "apply finished"
            up = first(lambda p: p.healthy, done["window"][1], recovery_bound_s)
        else:
            up = first(lambda p: p.healthy, since, self_recovery_s)
            res.recovery = "by itself"
            if up is None:
                res.recovery = "pdctl apply"
                ta = time.monotonic()
                result = demo.apply()
                res.notes.append(f"operator's apply → {result.state} in {time.monotonic() - ta:.1f} s")
                up = first(lambda p: p.healthy, ta, recovery_bound_s)
                if up is None:
                    res.recovery = "none"
        if up is not None:
            res.to_healthy_s = up.ended - t
            time.sleep(max(tail_s, t + min_traffic_s - time.monotonic()))
    finally:
        traffic.stop()
        poller.stop()
    res.sent, res.skipped = len(traffic.sent), traffic.skipped
    res.failures = sorted(traffic.failures, key=lambda f: f.sent)
    res.failed = len(res.failures)
    res.status_s = [p.ended - p.started for p in poller.polls]
    res.lying = lies(poller.polls, res.failures)
    res.longest_lie_s = longest_lie_s(poller.polls, res.lying)
    if res.window is not None:
        lo, hi = t + res.window[0], t + res.window[1]
        res.failures_outside_window = [f for f in res.failures if f.ended < lo or f.sent > hi]
    # (relative times for reading: the fault at 0)
    res.failures = [Failure(f.sent - t, f.ended - t, f.status, f.error) for f in res.failures]
    res.failures_outside_window = [Failure(f.sent - t, f.ended - t, f.status, f.error)
                                   for f in res.failures_outside_window]
    res.lying = [Poll(p.started - t, p.ended - t, p.healthy, p.why) for p in res.lying]
    return res


HEADER = ["fault", "spec", "sent", "failed", "fault→not healthy s", "fault→healthy s", "recovery", "lied?"]


def table(results: list[FaultResult]) -> str:
    """The results as a Markdown table."""
    rows = [HEADER] + [r.row() for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])
