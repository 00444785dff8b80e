"""The console's one I/O module: what the panels show, gathered into a frozen :class:`Snapshot`.

:class:`Collector` runs only in a worker thread (never on the UI thread). Each
:meth:`Collector.collect` reads the journal, asks the service manager for each role's state and
main PID, scrapes each server's ``/metrics`` and the router's prometheus port, reads NVML, sysfs
and ``/proc`` through :mod:`pdctl.console.telemetry`, and tails the selected role's log through
the manager. A source that fails is reported as such in the snapshot; ``collect`` never raises
for a deployment that is down — that is what it reports.

It holds no deployment logic: it calls the engine's journal, topology and service-manager APIs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.console.metrics import ThroughputSample, ThroughputTracker, parse_scrape
from pdctl.console.telemetry import GpuNumaSample, RoleNuma, read_gpu_numa
from pdctl.console.views import StepView, expected_states, step_views, unit_names
from pdctl.statemachine.journal import JournalState
from pdctl.statemachine.topology import Topology, topology_of

__all__ = ["Collector", "ServiceView", "Snapshot", "current_topology", "gpu_owners", "log_sources", "role_numa", "scrape_sources"]


@dataclass(frozen=True)
class ServiceView:
    """What the service manager says of one unit."""

    role: str
    unit: str
    state: str
    main_pid: int | None = None
    restarts: int = 0
    supervised: bool = True
    started_at: float | None = None
    """When its main process started (epoch seconds, from the host's /proc), None where unknown: a process that
    started after its step's proof is not what the step proved (``pdctl status``'s ``restarted_since``)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the panels render at one moment (epoch seconds ``at``)."""

    at: float
    topology: Topology
    journal: JournalState | None = None
    steps: tuple[StepView, ...] = ()
    services: Mapping[str, ServiceView] = field(default_factory=dict)
    throughput: tuple[ThroughputSample, ...] = ()
    gpu: GpuNumaSample | None = None
    log_role: str | None = None
    log_lines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """Problems gathering the snapshot itself (never a deployment being down)."""
    locked_by: Mapping[str, Any] | None = None
    """The deployment lock's holder when another process (a headless apply, a ``down``) holds it."""
    serving: Any = None
    """Whether a client of the router is served (:class:`~pdctl.statemachine.serving.Serving`: circuits and the
    latest canary), None while no router runs."""
    bench: Mapping[str, Any] | None = None
    """The newest saved ``pdctl bench`` result in the state directory (:func:`pdctl.statemachine.bench.latest`),
    None when there is none. Read only: the console starts no load."""


def current_topology(loaded: Any, journal: JournalState | None) -> Topology:
    """What the deployment is (or is becoming): the journal's target, else what it deployed, else
    what the spec asks."""
    if journal is not None and (journal.target or journal.deployed):
        return journal.target or journal.deployed  # type: ignore[return-value]
    return topology_of(loaded.deployment)


def gpu_owners(dep: Any, topo: Topology) -> dict[int, str]:
    """GPU index → role name. A deployment runs on one host (apply refuses more), and the GPU panel reads that host,
    over SSH where it is another machine: every role's GPUs are on it (they were left out for a remote host, so its
    panel had no role column and no "GPUs by role")."""
    del dep  # (the host every role runs on is the one the panel reads)
    return {g: r.name for r in topo.roles for g in r.gpus}


def role_numa(dep: Any, role_name: str) -> tuple[int | None, str | None]:
    """``(NUMA node, declared CPU list)`` the spec asks for *role_name* (the engine's own
    :func:`pdctl.statemachine.launch.numa_for`, which renders ``CPUAffinity=``)."""
    from pdctl.statemachine.launch import numa_for

    return numa_for(dep, role_name)




def scrape_sources(topo: Topology) -> list[tuple[str, str, str]]:
    """``(source, kind, metrics URL)``: every server's ``/metrics`` and the router's prometheus port."""
    out = [(r.name, r.kind, f"{r.url}/metrics") for r in topo.roles]
    if topo.router is not None:
        from pdctl.statemachine.serving import metrics_url

        out.append(("router", "router", metrics_url(topo)))
    return out


def log_sources(topo: Topology) -> list[str]:
    """Roles whose logs the logs panel can show (servers, then the router)."""
    return [r.name for r in topo.roles] + (["router"] if topo.router is not None else [])


class Collector:
    """Gathers :class:`Snapshot` s for one loaded spec. One owner (the telemetry worker).

    *interval_s* sets when a source counts as stale (three intervals without a good scrape).
    *nvml* False skips NVML (tests). *manager* and *client* are injectable."""

    def __init__(
        self,
        loaded: Any,
        *,
        interval_s: float = 1.0,
        client: Any = None,
        manager: Any = None,
        nvml: bool = True,
        clock: Callable[[], float] = time.time,
        log_lines: int = 200,
        scrape_timeout_s: float | None = None,
        canary: bool | None = None,
    ) -> None:
        self.loaded = loaded
        self.interval_s = interval_s
        self.nvml = nvml
        self.clock = clock
        self.log_lines = log_lines
        self.scrape_timeout_s = scrape_timeout_s if scrape_timeout_s is not None else max(0.5, min(2.0, interval_s))
        self.tracker = ThroughputTracker(stale_after_s=3 * interval_s)
        self._client = client
        self._manager = manager
        self.canary = canary
        """Send canaries through the router (None: the spec's ``console.canary``)."""
        self._router_metrics: tuple[str | None, str | None] | None = None  # (text, error) of this tick's scrape
        self._canary: Any = None  # (a CanaryRunner for the router's URL: one canary in flight at most)
        self._boot: int | None = None  # the host's boot time (epoch s), read once per host
        self._pid_started: dict[int, float | None] = {}  # main PID → when it started, read once per PID

    # -- lazily built engine handles --------------------------------------------------------------
    @property
    def host(self) -> Any:
        """The deployment's host (this machine, or an SSH host: scrapes and unit status go through it)."""
        if getattr(self, "_host", None) is None:
            from pdctl.statemachine.errors import PdctlError
            from pdctl.statemachine.hosts import LocalHost
            from pdctl.statemachine.service import deployment_host

            try:
                self._host = deployment_host(self.loaded.deployment)
            except PdctlError:  # roles over several hosts (apply refuses it): show what this machine sees
                self._host = LocalHost()
        return self._host

    @property
    def client(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.Client(trust_env=False, transport=self.host.http_transport())
            self._own_client = True
        return self._client

    @property
    def manager(self) -> Any:
        if self._manager is None:
            from pdctl.statemachine import launch

            self._manager = launch.manager_for(self.loaded.deployment, self.host, state_dir=str(self.loaded.journal.dir))
        return self._manager

    def set_loaded(self, loaded: Any) -> None:
        """Follow a reloaded spec (the journal directory may differ)."""
        if loaded.journal.dir != self.loaded.journal.dir or loaded.deployment.hosts != self.loaded.deployment.hosts:
            self._manager = None
            self._canary = None
            if loaded.deployment.hosts != self.loaded.deployment.hosts and getattr(self, "_host", None) is not None:
                if getattr(self, "_own_client", False) and self._client is not None:
                    self._client.close()  # it dialled through the old host
                    self._client = None
                self._host.close()
                self._host = None
            if loaded.deployment.hosts != self.loaded.deployment.hosts:  # (another machine's boot time and PIDs)
                self._boot, self._pid_started = None, {}
        self.loaded = loaded

    def close(self) -> None:
        self._canary = None
        if self._client is not None:
            self._client.close()
        if getattr(self, "_host", None) is not None:
            self._host.close()  # an SSH host's connection and its loop thread

    # -- parts --------------------------------------------------------------------------------------
    def read_journal(self) -> tuple[JournalState | None, str | None]:
        try:
            return self.loaded.journal.read(), None
        except Exception as exc:  # noqa: BLE001 - a torn or foreign journal is shown, not fatal
            return None, f"journal: {exc}"

    def _started_at(self, pid: int | None) -> float | None:
        # (read once per main PID: a restart is a new PID)
        if not pid:
            return None
        cache = self._pid_started
        if pid not in cache:
            from pdctl.statemachine.service import _boot_time, _process_started_at

            if self._boot is None:
                self._boot = _boot_time(self.host)
            if len(cache) > 256:
                cache.clear()
            cache[pid] = _process_started_at(self.host, pid, self._boot)
        return cache[pid]

    def services(self, topo: Topology) -> dict[str, ServiceView]:
        out = {}
        for role, unit in unit_names(topo).items():
            try:
                st = self.manager.status(unit)
                out[role] = ServiceView(role, unit, st.state, st.main_pid, st.restarts, st.supervised,
                                        self._started_at(st.main_pid) if st.state == "active" else None)
            except Exception as exc:  # noqa: BLE001
                from pdctl.statemachine.errors import HostError

                # (an SSH host that stopped answering: what runs there is unknown, not down)
                why = "host not answering" if isinstance(exc, HostError) else type(exc).__name__
                out[role] = ServiceView(role, unit, f"unknown ({why})")
        return out

    def serving(self, topo: Topology, services: Mapping[str, ServiceView]) -> Any:
        """:func:`~pdctl.statemachine.serving.judge` of the router's circuits now and the latest canary (sent in the
        background every ``console.canary_interval_s``, when ``console.canary``), None while no router runs."""
        from pdctl.statemachine import serving
        from pdctl.statemachine.errors import PdctlError

        view = services.get("router")
        if topo.router is None or view is None or view.state != "active":
            return None
        scraped, self._router_metrics = self._router_metrics, None  # (this tick's scrape, when it ran first)
        try:
            if scraped is None:
                states, error = serving.circuits(self.client, topo, timeout=self.scrape_timeout_s), None
            elif scraped[0] is not None:
                states, error = serving.parse_circuits(scraped[0]), None
            else:
                states, error = None, scraped[1]
        except (PdctlError, ValueError) as exc:
            states, error = None, str(exc)
        console = self.loaded.deployment.console
        canary = None
        if console.canary if self.canary is None else self.canary:
            runner = self._canary
            if runner is None or runner.router_url != topo.router.url or runner.interval_s != console.canary_interval_s:
                import contextlib

                # (the collector's client of the moment: a reload of [hosts] closes and replaces it)
                runner = self._canary = serving.CanaryRunner(
                    lambda: contextlib.nullcontext(self.client), topo.router.url,
                    interval_s=console.canary_interval_s, timeout_s=console.canary_timeout_s, clock=self.clock)
            canary = runner.tick()
        return serving.judge(topo, states, error, canary)

    def scrape(self, topo: Topology, at: float,
               services: Mapping[str, ServiceView] | None = None) -> tuple[ThroughputSample, ...]:
        """One scrape of every source (:func:`scrape_sources`). A source whose unit does not run (*services*: its
        state ``inactive`` or ``failed``) and whose port answers anyway is reported down, not shown: what answers is
        another process's (a renamed spec's old deployment on the same ports), whose figures are not this
        deployment's."""
        import httpx

        out = []
        self._router_metrics = None
        for source, kind, url in scrape_sources(topo):
            sv = (services or {}).get(source)
            try:
                r = self.client.get(url, timeout=self.scrape_timeout_s)
                if r.status_code != 200:
                    raise ValueError(f"HTTP {r.status_code}")
                if source == "router":  # (the serving verdict reads its circuits from the same text)
                    self._router_metrics = (r.text, None)
                sc = parse_scrape(r.text, at)
                if not sc.samples and not sc.histograms:
                    raise ValueError("none of the expected metrics in the answer (server without --enable-metrics?)")
            except (httpx.HTTPError, ValueError) as exc:
                msg = "connection refused" if isinstance(exc, httpx.ConnectError) else f"{type(exc).__name__}: {exc}"[:120]
                if source == "router" and self._router_metrics is None:
                    self._router_metrics = (None, f"GET {url}: {msg}")
                out.append(self.tracker.observe(source, kind, url, at, None, msg))
                continue
            if sv is not None and sv.state in ("inactive", "failed"):
                out.append(self.tracker.observe(
                    source, kind, url, at, None,
                    f"{sv.unit} is {sv.state}, yet its port answers: another process's figures, not shown"))
                continue
            out.append(self.tracker.observe(source, kind, url, at, sc))
        return tuple(out)

    def gpu(self, topo: Topology, services: Mapping[str, ServiceView]) -> GpuNumaSample:
        dep = self.loaded.deployment
        roles = []
        for r in topo.roles:
            node, cpus = role_numa(dep, r.name)
            sv = services.get(r.name)
            pid = sv.main_pid if sv is not None and sv.state in ("active", "activating", "reloading") else None
            roles.append(RoleNuma(r.name, pid, node, cpus))
        from pdctl.statemachine.hosts import LocalHost

        remote = None if isinstance(self.host, LocalHost) else self.host  # another machine: read it there
        return read_gpu_numa(roles, gpu_owners(dep, topo), nvml=self.nvml, clock=self.clock, host=remote)

    def logs(self, topo: Topology, role: str | None) -> tuple[str, ...]:
        if role is None:
            return ()
        unit = unit_names(topo).get(role)
        if unit is None:
            return ()
        try:
            return tuple(self.manager.logs(unit, lines=self.log_lines))
        except Exception as exc:  # noqa: BLE001 - a missing journal/log is shown as a line
            return (f"(logs unavailable: {type(exc).__name__}: {exc})",)

    def collect(self, *, log_role: str | None = None, gpu: bool = True, throughput: bool = True) -> Snapshot:
        """One snapshot. Never raises for a down deployment."""
        at = self.clock()
        notes: list[str] = []
        journal, err = self.read_journal()
        if err:
            notes.append(err)
        topo = current_topology(self.loaded, journal)
        locked_by = None
        try:
            holder = self.loaded.journal.held_by()
            locked_by = holder if holder and holder.get("pid") != os.getpid() else None
        except Exception as exc:  # noqa: BLE001 - the lock's state is a courtesy
            notes.append(f"lock: {exc}")
        services = self.services(topo)
        tp = self.scrape(topo, at, services) if throughput else ()
        try:
            verdict = self.serving(topo, services)
        except Exception as exc:  # noqa: BLE001 - the verdict is read again next tick
            verdict = None
            notes.append(f"serving: {exc}")
        saved_bench = None
        if throughput:
            from pdctl.statemachine.bench import latest

            saved_bench = latest(self.loaded.journal.dir)  # (a folder listing and one small JSON file a tick)
        g = None
        if gpu:
            try:
                g = self.gpu(topo, services)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"gpu/numa: {exc}")
        from pdctl.statemachine.steps import steps_for

        hints = {}
        try:
            hints = {s.name: s.hint for s in steps_for(topo)}
        except Exception:  # noqa: BLE001 - hints are a courtesy
            pass
        return Snapshot(
            at=at,
            topology=topo,
            journal=journal,
            steps=step_views(expected_states(topo), journal, at, hints),
            services=services,
            throughput=tp,
            gpu=g,
            log_role=log_role,
            log_lines=self.logs(topo, log_role),
            notes=tuple(notes),
            locked_by=locked_by,
            serving=verdict,
            bench=saved_bench,
        )
