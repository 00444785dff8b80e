"""``pdctl verify``: the KV-link, router and parsers proofs against endpoints pdctl did not start.

The proofs are the steps' own (:class:`~pdctl.statemachine.steps.KVLinkVerified`, the router's as its clients reach
it, :meth:`~pdctl.statemachine.steps.RouterExposed.serves`, :class:`~pdctl.statemachine.steps.ParsersConfigured`), run
by the same state machine (:func:`~pdctl.statemachine.machine.run_steps`) on the deployment's topology, so they check
the same things and say them in the same words; what a unit or a host would add (who holds the port, which account runs
the router) is left out, there being neither.

Two address spaces meet here. The topology holds the deployment's own addresses, those its processes dial each other
at: what the router registered its workers under, the bootstrap host decode is sent to. On hosts they are the spec's;
on Kubernetes (``target="k8s"``) the pods' cluster names (:func:`pdctl.statemachine.k8s.probe_topology`). The endpoints
say where pdctl reaches each of them from here (a ``kubectl port-forward``, a tunnel, any URL): every request the proofs
make to one of the deployment's addresses goes to its endpoint instead (an ``httpx`` transport that rewrites the URL;
the ``Host`` header stays the deployment's), while the addresses inside the requests (``bootstrap_host``) stay the
deployment's, which decode resolves where it runs.

Endpoint keys: a role's name (``prefill``, ``decode-1``, ``server``), ``router``, ``router.metrics`` (its prometheus
port), ``<prefill role>.bootstrap`` (its KV bootstrap server). Values are ``http://HOST:PORT``. Left out: on hosts, the
spec's own address; a bootstrap, the role's endpoint host with the bootstrap port (a port-forward of both ports to the
same local numbers); the router's metrics, the router's endpoint host with the prometheus port. On Kubernetes every
role and the router need one.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from typing import Any

import httpx

from pdctl.statemachine.errors import PdctlError, StepTimeout, UnmendableFault, VerifyFailed
from pdctl.statemachine.events import Event, EventSink, NullSink
from pdctl.statemachine.journal import JournalState
from pdctl.statemachine.machine import Proof, StateMachine, run_steps
from pdctl.statemachine.spec import Deployment
from pdctl.statemachine.steps import (
    Context,
    KVLinkVerified,
    ParsersConfigured,
    RouterExposed,
    Timeouts,
    _wait,
)
from pdctl.statemachine.topology import Topology, dial_host, topology_of

__all__ = ["TARGETS", "Endpoints", "parse_endpoints", "verify", "verify_topology"]

TARGETS = ("hosts", "k8s")
Endpoints = dict[str, str]


def parse_endpoints(items: Iterable[str]) -> Endpoints:
    """``["prefill=http://127.0.0.1:8001,decode=http://…", "router=…"]`` (each item one or more comma-separated
    ``KEY=URL``) → ``{key: URL}``. Raises :class:`PdctlError` for an item that is not ``KEY=http://HOST:PORT``
    (a bootstrap also ``KEY=HOST:PORT``) or a key given twice."""
    out: Endpoints = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, sep, url = part.partition("=")
            key, url = key.strip(), url.strip()
            if not sep or not key or not url:
                raise PdctlError(f"--endpoints {part!r}: write ROLE=URL, e.g. decode=http://127.0.0.1:8002",
                                 hint="roles as `pdctl status` names them (prefill, decode, router…)")
            if key in out:
                raise PdctlError(f"--endpoints: {key!r} is given twice ({out[key]} and {url})")
            _address(key, url)
            out[key] = url
    return out


def _address(key: str, url: str) -> tuple[str, int]:
    """``(host, port)`` of an endpoint's URL. Raises :class:`PdctlError` for anything but ``http://HOST:PORT``."""
    if "://" not in url and key.endswith(".bootstrap"):
        url = f"http://{url}"
    u = urllib.parse.urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "http" or not u.hostname or port is None or u.path not in ("", "/") or u.query or u.fragment:
        raise PdctlError(f"--endpoints {key}={url}: give http://HOST:PORT (no path; the proofs add theirs)",
                         hint="e.g. after `kubectl port-forward pod/NAME 8001:30010`: prefill=http://127.0.0.1:8001")
    return u.hostname, port


def verify_topology(dep: Deployment, target: str, fmt: str | None = None) -> Topology:
    """The topology whose proofs run: *dep* as deployed on hosts, or as exported to Kubernetes in format *fmt*
    (``rbg`` default) with every role and the router at its cluster address."""
    if target == "hosts":
        return topology_of(dep)
    if target == "k8s":
        from pdctl.statemachine import k8s

        return k8s.probe_topology(k8s.cluster_topology(dep, fmt or "rbg"))
    raise PdctlError(f"target {target!r}: verify knows {' and '.join(TARGETS)}")


def _key(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, u.port or 80


def mapping(topo: Topology, endpoints: Endpoints, *, every: bool) -> dict[tuple[str, int], tuple[str, int]]:
    """The deployment's ``(host, port)`` → the endpoint's, for every one *endpoints* name (see the module docstring).
    *every*: each role and the router must have an endpoint (Kubernetes: pdctl cannot reach the cluster's names).
    Raises :class:`PdctlError` for an endpoint key the topology lacks, or a missing one."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    roles = {r.name: r for r in topo.roles}
    bootstraps = {name: (h, p) for name, h, p in (topo.kv_link.bootstrap if topo.kv_link else ())}
    known = [*roles, *(["router", "router.metrics"] if topo.router else []), *(f"{n}.bootstrap" for n in bootstraps)]
    unknown = [k for k in endpoints if k not in known]
    if unknown:
        raise PdctlError(f"--endpoints: {', '.join(map(repr, unknown))}: deployment {topo.name!r} has no such role",
                         hint=f"its keys: {', '.join(known)}")
    wanted = [*roles, *(["router"] if topo.router else [])]
    missing = [k for k in wanted if k not in endpoints]
    if every and missing:
        where = ", ".join(f"{k} ({roles[k].url if k in roles else topo.router.url if topo.router else ''})"
                          for k in missing)
        raise PdctlError(f"--endpoints: no endpoint for {where}: pdctl does not reach the cluster's own addresses",
                         hint="forward each (kubectl port-forward POD LOCAL:PORT) and give ROLE=http://127.0.0.1:LOCAL")
    for name, r in roles.items():
        if name in endpoints:
            out[_key(r.url)] = _address(name, endpoints[name])
    for name, (h, p) in bootstraps.items():
        given = endpoints.get(f"{name}.bootstrap")
        if given is not None:
            out[_key(f"http://{dial_host(h)}:{p}")] = _address(f"{name}.bootstrap", given)
        elif name in endpoints:
            out[_key(f"http://{dial_host(h)}:{p}")] = (_address(name, endpoints[name])[0], p)
    if topo.router is not None:
        s = topo.router.settings
        prom = dial_host(str(s.get("prometheus_host", "127.0.0.1")))
        inside = _key(f"http://{prom}:{s.get('prometheus_port', 29000)}")
        if "router" in endpoints:
            out[_key(topo.router.url)] = _address("router", endpoints["router"])
        if "router.metrics" in endpoints:
            out[inside] = _address("router.metrics", endpoints["router.metrics"])
        elif "router" in endpoints:
            out.setdefault(inside, (_address("router", endpoints["router"])[0], inside[1]))
    return out


class _Mapped(httpx.BaseTransport):
    """Sends a request for one of the deployment's addresses to its endpoint (see the module docstring)."""

    def __init__(self, to: dict[tuple[str, int], tuple[str, int]], inner: httpx.BaseTransport | None = None) -> None:
        self.to = to
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        where = self.to.get((request.url.host, request.url.port or 80))
        if where is not None:
            request.url = request.url.copy_with(host=where[0], port=where[1])
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class _NoJournal:
    """The state machine journals every step; a verification records nothing."""

    def write(self, state: Any) -> None:
        return None


class RouterServes(RouterExposed):
    """``router_exposed`` for a router pdctl did not start: :meth:`RouterExposed.serves` (its ``/readiness``,
    ``/workers`` and what a client gets through it), waited for within the step's own bound."""

    def observe(self, ctx: Context) -> Proof | None:
        return None

    def apply(self, ctx: Context) -> None:
        return None

    def owned_units(self, ctx: Context) -> list[str]:
        return []

    def verify(self, ctx: Context) -> Proof:
        last: list[str] = []

        def attempt() -> Proof | None:
            try:
                return self.serves(ctx)
            except (VerifyFailed, PdctlError) as exc:
                last[:] = [str(exc)]
                if isinstance(exc, UnmendableFault) and exc.kind == "swapped":
                    raise
                return None

        try:
            return _wait("router ready with the expected workers", self._bound(ctx), attempt, poll=0.5,
                         step=self.name, checkpoint=ctx.checkpoint)
        except StepTimeout as exc:
            raise VerifyFailed(f"{exc.message}; last: {last[0] if last else '?'}", step=self.name,
                               hint=self.hint) from None


def verify(dep: Deployment, endpoints: Endpoints, *, target: str = "hosts", fmt: str | None = None,
           sink: EventSink | None = None, timeouts: Timeouts | None = None,
           transport: httpx.BaseTransport | None = None) -> StateMachine:
    """Run the proofs of *dep*'s deployment (``kv_link_verified``, ``router_exposed``, ``parsers_configured``; a single
    server: the last two) against *endpoints*, emitting the steps' events to *sink*. Returns the state machine at
    ``parsers_configured``; raises the failed step's :class:`~pdctl.statemachine.errors.StepError`, as apply does.
    Nothing is started, stopped or recorded."""
    sink = sink or NullSink()
    topo = verify_topology(dep, target, fmt)
    to = mapping(topo, endpoints, every=target == "k8s")
    if to:
        said = ", ".join(f"{h}:{p} → {eh}:{ep}" for (h, p), (eh, ep) in to.items())
        sink.emit(Event("info", f"verifying {topo.name!r} ({target}) through endpoints: {said}",
                        data={"endpoints": {f"{h}:{p}": f"{eh}:{ep}" for (h, p), (eh, ep) in to.items()}}))
    steps = ([KVLinkVerified()] if topo.mode == "pd" else []) + ([RouterServes()] if topo.router else [])
    steps.append(ParsersConfigured())
    client = httpx.Client(trust_env=False, transport=_Mapped(to, transport))
    try:
        ctx = Context(dep=dep, topology=topo, host=None, manager=None, units=None, unit_of={}, client=client,
                      journal=_NoJournal(), journal_state=JournalState(name=dep.name),  # type: ignore[arg-type]
                      timeouts=timeouts or Timeouts(), sink=sink)
        return run_steps(ctx, steps, sink)
    finally:
        client.close()


def verify_spec(path: str, endpoints: Endpoints, *, target: str = "hosts", fmt: str | None = None,
                sink: EventSink | None = None, timeouts: Timeouts | None = None) -> StateMachine:
    """:func:`verify` of the spec at *path*, read with the rules of its target (Kubernetes takes roles on several
    hosts). Raises :class:`~pdctl.statemachine.errors.SpecError` for a spec that does not load."""
    if target == "k8s":
        from pdctl.statemachine import k8s

        dep, _warnings = k8s.load(path)
    else:
        from pdctl.statemachine.rules import check
        from pdctl.statemachine.spec import load_spec

        dep = load_spec(path)
        check(dep)
    return verify(dep, endpoints, target=target, fmt=fmt, sink=sink, timeouts=timeouts)
