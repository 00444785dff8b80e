"""What a client of the router gets now, and restarts that keep it served.

``/readiness`` 200 and every worker ``is_healthy`` in ``/workers`` do not mean a request succeeds: smg keeps a
circuit breaker per worker, and while one is open the router answers 503 ``No available decode workers (all circuits
open or unhealthy)`` with both of those still saying all is well (seen for 47 s after an engine came back). So a
worker counts as served only when its circuit is closed, and a bounded canary request through the router backs it.

Facts relied on, smg 1.13.0 (observed against the real router, and read in smg-project/smg
``model_gateway/src/worker/circuit_breaker.rs``):

* ``smg_worker_cb_state{worker="<URL>"}`` on the router's prometheus port: 0 closed, 1 open, 2 half_open. The
  gauge moves on transitions only; open turns half_open once ``--cb-timeout-duration-secs`` (60 s) passed and a
  request looks at it; half_open closes after ``--cb-success-threshold`` (3) successes.
* A failed PD request counts against the prefill's and the decode's circuit alike (both opened when decode died).
* ``DELETE /workers/{id}`` → 202; the worker then reads ``status: draining`` (``is_healthy`` false: no new requests)
  and leaves ``/workers`` about 5 s later. ``POST /workers`` of its URL meanwhile → 409 ``WORKER_ALREADY_EXISTS``;
  once it is gone, ``POST /workers {url, worker_type, bootstrap_port}`` registers it again with a closed circuit.

Nothing here prints; errors are :class:`~pdctl.statemachine.errors.ProbeError`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from pdctl.statemachine.errors import ProbeError
from pdctl.statemachine.topology import Topology, dial_host

__all__ = ["CIRCUIT_STATES", "Canary", "CanaryRunner", "Serving", "circuits", "admit", "drain", "judge", "listed", "metrics_url",
           "run_canary", "served_problems", "worker_kinds"]

CIRCUIT_STATES = {0: "closed", 1: "open", 2: "half_open"}
"""``smg_worker_cb_state`` values (smg ``CircuitState::as_int``)."""

CANARY_BODY = {"text": "pdctl canary", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
"""The canary: one token of ``/generate`` through the router (PD: both servers, the KV transfer, the router's pair)."""


def metrics_url(topo: Topology) -> str | None:
    """The router's prometheus URL (``--prometheus-host`` / ``--prometheus-port``), None without a router."""
    r = topo.router
    if r is None:
        return None
    s = r.settings
    return f"http://{dial_host(str(s.get('prometheus_host', '127.0.0.1')))}:{s.get('prometheus_port', 29000)}/metrics"


def parse_circuits(text: str) -> dict[str, str]:
    """Worker URL (no trailing slash) → ``closed`` / ``open`` / ``half_open`` from smg's exposition *text*. Pure."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "smg_worker_cb_state":
            continue
        for s in fam.samples:
            url = s.labels.get("worker")
            if url:
                out[url.rstrip("/")] = CIRCUIT_STATES.get(int(s.value), f"state {int(s.value)}")
    return out


def circuits(client: httpx.Client, topo: Topology, *, timeout: float = 2.0) -> dict[str, str]:
    """:func:`parse_circuits` of the router's metrics now. Raises ProbeError when they cannot be read."""
    url = metrics_url(topo)
    if url is None:
        return {}
    try:
        r = client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ProbeError(f"GET {url}: {type(exc).__name__}: {exc}", url=url, cause=exc) from None
    if r.status_code != 200:
        raise ProbeError(f"GET {url}: HTTP {r.status_code}", url=url, status=r.status_code, body=r.text)
    try:
        return parse_circuits(r.text)
    except ValueError as exc:
        raise ProbeError(f"GET {url}: not a Prometheus exposition: {exc}", url=url) from None


@dataclass(frozen=True)
class Canary:
    """One canary request through the router: what a client got. ``status`` 0: no HTTP answer (``error`` says why)."""

    ok: bool
    status: int
    error: str | None
    latency_s: float
    at: float
    """When it was sent (epoch seconds)."""

    def said(self) -> str:
        """What the client got, in words: ``HTTP 503: No available decode workers …``."""
        if self.ok:
            return f"HTTP {self.status} in {self.latency_s:.2f} s"
        return f"HTTP {self.status}: {self.error}" if self.status else (self.error or "no answer")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _error_message(r: httpx.Response) -> str:
    """smg's ``{"error": {"message": …}}`` (or SGLang's ``{"message": …}``), else the body's start."""
    try:
        data = r.json()
    except ValueError:
        return r.text[:200]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if isinstance(data.get("message"), str):
            return data["message"][:300]
    return str(data)[:200]


def run_canary(client: httpx.Client, router_url: str, *, timeout: float = 5.0,
               clock: Any = time.time) -> Canary:
    """POST :data:`CANARY_BODY` to ``<router_url>/generate`` within *timeout* seconds. Never raises."""
    at, t0 = clock(), time.monotonic()
    try:
        r = client.post(f"{router_url}/generate", json=CANARY_BODY, timeout=timeout)
    except httpx.TimeoutException:
        return Canary(False, 0, f"no answer within {timeout:g} s", time.monotonic() - t0, at)
    except (httpx.HTTPError, RuntimeError) as exc:  # (RuntimeError: a client closed meanwhile)
        return Canary(False, 0, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, at)
    latency = time.monotonic() - t0
    if r.status_code != 200:
        return Canary(False, r.status_code, _error_message(r), latency, at)
    try:
        data = r.json()
    except ValueError:
        return Canary(False, r.status_code, f"not JSON: {r.text[:100]!r}", latency, at)
    if not isinstance(data, dict) or not (data.get("output_ids") or data.get("text")):
        return Canary(False, r.status_code, f"no tokens in the answer: {str(data)[:100]}", latency, at)
    return Canary(True, r.status_code, None, latency, at)


def _role_of_url(topo: Topology) -> dict[str, str]:
    return {r.url.rstrip("/"): r.name for r in topo.roles}


def served_problems(topo: Topology, states: dict[str, str]) -> list[str]:
    """The workers behind the router whose circuit is not closed, in words (``decode circuit open``). A worker
    missing from *states* (no gauge yet: smg sets it when it builds the worker) is not called open. Pure."""
    r = topo.router
    if r is None:
        return []
    names = _role_of_url(topo)
    urls = [u for u, _port in r.prefill] + list(r.decode) + list(r.regular)
    out = []
    for url in urls:
        state = states.get(url.rstrip("/"))
        if state is not None and state != "closed":
            out.append(f"{names.get(url.rstrip('/'), url)} circuit {state.replace('_', '-')}")
    return out


@dataclass(frozen=True)
class Serving:
    """Whether a client of the router is served now, with the evidence: each worker's circuit (by role name),
    the canary (None: not sent) and what is wrong, in words (empty: served)."""

    circuits: dict[str, str]
    circuits_error: str | None
    canary: Canary | None
    problems: tuple[str, ...]

    @property
    def served(self) -> bool:
        return not self.problems

    @property
    def seen_failing(self) -> bool:
        """Evidence that clients fail: the canary failed, or a circuit is not closed (unreadable metrics without a
        canary are no evidence either way)."""
        return (self.canary is not None and not self.canary.ok) or any(c != "closed" for c in self.circuits.values())

    def as_dict(self) -> dict[str, Any]:
        return {"circuits": dict(self.circuits), "circuits_error": self.circuits_error,
                "canary": self.canary.as_dict() if self.canary is not None else None,
                "problems": list(self.problems), "served": self.served}


def judge(topo: Topology, states: dict[str, str] | None, circuits_error: str | None,
          canary: Canary | None) -> Serving:
    """:class:`Serving` from the router's circuit *states* (URL → state; None: not read, *circuits_error* says why)
    and a *canary*. A failed canary is the first problem, with what the client got; open circuits follow. Pure."""
    names = _role_of_url(topo)
    problems = served_problems(topo, states or {})
    if canary is not None and not canary.ok:
        problems.insert(0, f"clients get {canary.said()}")
    elif canary is None and circuits_error is not None:
        problems.append(f"router metrics unreadable ({circuits_error}): circuits unknown")
    by_role = {names.get(u, u): s for u, s in (states or {}).items() if u in names}
    return Serving(by_role, circuits_error, canary, tuple(problems))


class CanaryRunner:
    """Canaries at most every *interval_s* seconds, never more than one in flight, each in its own thread: the
    console's and ``status --watch``'s refresh reads :attr:`latest` and never waits on the router."""

    def __init__(self, client_factory: Any, router_url: str, *, interval_s: float = 2.0, timeout_s: float = 5.0,
                 clock: Any = time.time) -> None:
        self._factory = client_factory
        self.router_url = router_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_start = float("-inf")
        self.latest: Canary | None = None
        """The last canary that finished (None: none yet)."""

    def tick(self) -> Canary | None:
        """Start a canary when none is in flight and *interval_s* passed since the last start; return :attr:`latest`,
        or None when it is older than two periods (a router that was down meanwhile: its result would be stale)."""
        with self._lock:
            busy = self._thread is not None and self._thread.is_alive()
            if not busy and time.monotonic() - self._last_start >= self.interval_s:
                self._last_start = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="pdctl-canary", daemon=True)
                self._thread.start()
        latest = self.latest
        if latest is not None and self._clock() - latest.at > 2 * (self.interval_s + self.timeout_s):
            return None
        return latest

    def _run(self) -> None:
        with self._factory() as client:
            self.latest = run_canary(client, self.router_url, timeout=self.timeout_s, clock=self._clock)


# --- taking a worker out of the router and putting it back -------------------------------------------------------


def listed(client: httpx.Client, router_url: str, url: str) -> Any:
    """The router's ``/workers`` entry of *url* (a :class:`~pdctl.statemachine.probes.RouterWorker`), None when not
    listed. Raises ProbeError."""
    from pdctl.statemachine import probes

    workers, _stats = probes.router_workers(client, router_url, timeout=5.0)
    return next((w for w in workers if w.url == url.rstrip("/")), None)


def drain(client: httpx.Client, router_url: str, url: str, *, bound_s: float, poll_s: float = 0.25,
          checkpoint: Any = None) -> bool:
    """Take the worker at *url* out of the router (``DELETE /workers/{id}``): the router sends it no new request and
    removes it once its requests are done. Returns once it is gone from ``/workers`` (True), or after *bound_s*
    seconds (False: still draining); False at once when the router does not list it. Raises ProbeError when the
    router does not answer."""
    w = listed(client, router_url, url)
    if w is None or w.id is None:
        return False
    if w.status != "draining":
        try:
            r = client.delete(f"{router_url}/workers/{w.id}", timeout=5.0)
        except httpx.HTTPError as exc:
            raise ProbeError(f"DELETE {router_url}/workers/{w.id}: {type(exc).__name__}: {exc}") from None
        if r.status_code not in (200, 202, 204, 404):
            raise ProbeError(f"DELETE {router_url}/workers/{w.id}: HTTP {r.status_code}: {r.text[:200]}")
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if checkpoint is not None:
            checkpoint()
        if listed(client, router_url, url) is None:
            return True
        time.sleep(poll_s)
    return False


def admit(client: httpx.Client, router_url: str, topo: Topology, url: str, worker_type: str,
          bootstrap_port: int | None, *, bound_s: float, poll_s: float = 0.25, checkpoint: Any = None) -> str | None:
    """Register the worker at *url* with the router (``POST /workers``) once any earlier entry of it has left, and
    wait until the router serves it: listed ready and healthy, its circuit closed. Returns None when served, else
    why not after *bound_s* seconds. Raises ProbeError when the router refuses the registration."""
    end = time.monotonic() + bound_s
    body: dict[str, Any] = {"url": url.rstrip("/"), "worker_type": worker_type}
    if bootstrap_port is not None:
        body["bootstrap_port"] = bootstrap_port
    posted = False
    why = "not registered yet"
    while time.monotonic() < end:
        if checkpoint is not None:
            checkpoint()
        w = listed(client, router_url, url)
        if w is None and not posted:
            try:
                r = client.post(f"{router_url}/workers", json=body, timeout=5.0)
            except httpx.HTTPError as exc:
                raise ProbeError(f"POST {router_url}/workers: {type(exc).__name__}: {exc}") from None
            if r.status_code == 409:  # (its old entry still leaving: listed again at the next look)
                time.sleep(poll_s)
                continue
            if r.status_code not in (200, 201, 202):
                raise ProbeError(f"POST {router_url}/workers {body}: HTTP {r.status_code}: {r.text[:200]}")
            posted = True
        elif w is None:
            why = "registered, not listed yet"
        elif w.status == "draining":
            why = "its earlier entry is still draining"
        else:
            state = circuits(client, topo).get(url.rstrip("/"), "closed")
            if w.is_healthy and state == "closed":
                return None
            why = f"listed {'healthy' if w.is_healthy else 'not healthy yet'}, circuit {state}"
        time.sleep(poll_s)
    return f"the router does not serve {url} after {bound_s:g} s: {why}"


def worker_kinds(topo: Topology) -> dict[str, tuple[str, int | None]]:
    """Worker URL → ``(worker_type, bootstrap port)`` as the router's ``--prefill`` / ``--decode`` give them."""
    r = topo.router
    if r is None:
        return {}
    out: dict[str, tuple[str, int | None]] = {u.rstrip("/"): ("prefill", p) for u, p in r.prefill}
    out.update({u.rstrip("/"): ("decode", None) for u in r.decode})
    out.update({u.rstrip("/"): ("regular", None) for u in r.regular})
    return out
