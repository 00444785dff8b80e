"""The six steps of a PD deployment (and the single-server variant), each with its proof.

See :mod:`pdctl.statemachine.machine` for the contract (observe → apply → verify, undo). Proofs
follow the architecture note: a server is *up* when its unit is active **and** ``/health`` is 200
**and** ``/server_info`` shows the expected role, TP size, model, parsers, page size and kv-cache
dtype; the KV link is proven before any router exists (bootstrap ``/route`` from the decode side,
then one paired request with one bootstrap room straight to prefill and decode, transfer-failure
counters flat); the router by ``/readiness`` plus ``/workers`` counts, roles and health (never its
``/health``); the parsers by one chat request with tools and thinking through the exposed router.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx

from pdctl.statemachine import ports, probes, serving
from pdctl.statemachine.errors import (
    ApplyFailed,
    CommandTimeout,
    HostError,
    ProbeError,
    StepTimeout,
    UnmendableFault,
    VerifyFailed,
)
from pdctl.statemachine.journal import Journal, JournalState
from pdctl.statemachine.machine import PD_STATES, SINGLE_STATES, Proof, Step, role_steps
from pdctl.statemachine.plan import (
    APPLIED_ELSEWHERE_HINT,
    CONNECTION_WORDS,
    EPHEMERAL_PORT_HINT,
    HIDDEN_GPU_PROCESS,
    OTHER_DEPLOYMENT_HINT,
    GpuHeld,
    PortHeld,
    gpu_holder,
    gpus_held_hint,
)
from pdctl.statemachine.sglang_facts import DEFAULT_SGLANG_VERSION, SglangFacts, facts_for
from pdctl.statemachine.spec import Deployment
from pdctl.statemachine.topology import RoleTopology, RouterTopology, Topology, numa_binding
from pdctl.units import SUPERVISOR_LINE, SUPERVISOR_STOPPED, UnitSet, process_stopped, unsupervised_reason

__all__ = ["Context", "Timeouts", "steps_for"]

T = TypeVar("T")

_CAUSE = re.compile(r"\berror\b|\bexception\b|\bfailed\b|^[\w.]*(Error|Exception)\b", re.IGNORECASE)
_SYSTEMD = re.compile(r"Failed with result|Main process exited|Failed to start|start request repeated|Scheduled restart job")
"""The service manager's own lines about the unit (pdctl's supervisor, systemd): they say that it failed,
rarely why."""
_MANAGER_CAUSE = re.compile(r"cannot start|dependency failed|timed out|exited, code=|killed, signal=")
"""The manager lines that do say why (the executable could not be started, a dependency failed, the
readiness gate timed out): the cause when the role itself printed none."""


_FLAG_REJECTED = re.compile(r": error: (argument |unrecognized arguments|the following arguments are required)")
"""argparse's own error line (SGLang and smg parse their flags with it)."""


def startup_hint(message: str) -> str | None:
    """A hint fitted to *message*'s cause, or None (the step's general hint applies)."""
    if _FLAG_REJECTED.search(message.splitlines()[0]):
        return ("a launch flag was refused: fix its value in the spec (the role's settings or extra_args) and "
                "apply again; `pdctl validate` checks flag names against SGLang's, not every value")
    return None


def startup_failure(what: str, lines: list[str]) -> str:
    """The message for a unit that failed while starting: the log line most likely to be the cause first,
    then the last log lines for context. The cause is the last line the role printed that names an error
    (argparse's ``...: error: argument --x: invalid int value``, a traceback's ``ValueError: ...``), else the
    service manager's reason (exec failure, readiness timeout, dependency), never its "failed" verdict."""
    stripped = [ln.strip() for ln in lines]
    cause = next((ln for ln in reversed(stripped)
                  if _CAUSE.search(ln) and not SUPERVISOR_LINE.search(ln) and not _SYSTEMD.search(ln)), None)
    if cause is None:
        cause = next((SUPERVISOR_LINE.sub("", ln) for ln in reversed(stripped)
                      if SUPERVISOR_LINE.search(ln) and _MANAGER_CAUSE.search(ln)), None)
    tail = "\n    ".join(lines)
    head = f"{what} failed while starting" + (f": {cause}" if cause else "")
    return f"{head}\n  last log lines:\n    {tail}"


@dataclass(frozen=True)
class Timeouts:
    """Bounds, in seconds. ``role_start`` is used when a role declares no expected cold start."""

    role_start: float = 1800.0
    bootstrap: float = 30.0
    kv_request: float = 60.0
    router: float = 120.0
    chat: float = 120.0
    kernels_build: float = 3600.0
    drain: float = 60.0
    """How long a server taken out of the router for its restart may take to finish its requests."""
    poll: float = 0.25
    progress: float = 5.0
    """How often a role still loading is reported (a ``progress`` event: elapsed, expected, its last log line)."""


RESTARTING = "restarting"
"""A unit's journal record while its new definition is installed and its restart not yet issued: ``restarting``, or
``restarting:<fingerprint>@<main PID>`` where the process still running is known to run the definition with that
fingerprint (:func:`running_definition`)."""
STARTED = "started:"
"""Prefix of a unit's journal record once its restart was issued with the definition whose fingerprint follows, not
yet proven: a resumed apply waits for that process while it loads instead of restarting it again."""


def running_definition(record: str | None, main_pid: int | None) -> str | None:
    """The fingerprint of the definition the unit's running process runs, as its journal *record* tells it, or None
    where it does not: a plain fingerprint (proven running; any later rewrite of the unit file journals it as
    restarting first) and ``started:<fp>`` (restarted with it) tell it; ``restarting:<fp>@<pid>`` tells it while
    *main_pid*, the unit's main process now, is still ``<pid>`` (a restart since, by its supervisor after a crash,
    ran the rewritten file); a bare ``restarting`` does not."""
    if not record or record == RESTARTING:
        return None
    if record.startswith(STARTED):
        return record[len(STARTED):]
    if record.startswith(RESTARTING + ":"):
        fp, _, pid = record[len(RESTARTING) + 1:].rpartition("@")
        return fp if fp and main_pid is not None and pid == str(main_pid) else None
    return record


def fingerprint_of(units: Any, unit: str) -> str:
    """Hash of *unit*'s definition in *units* (a :class:`pdctl.units.UnitSet`: argv, env, limits…), as the journal
    records a unit proven running (``JournalState.units``)."""
    import hashlib

    spec = units.service(unit)
    return hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def edited_units(manager: Any, units: Any, records: Mapping[str, str], names: Collection[str]) -> list[str]:
    """Of the service units *names*, those whose journal record is the fingerprint of their definition in *units*
    (a :class:`pdctl.units.UnitSet`: what apply proved running is what the spec asks) while the installed unit file,
    or its secrets file, differs from what pdctl writes for it (``manager.pending_changes``): edited outside pdctl
    (``systemctl edit --full``, sed on the file). A crash or reboot would start the edited definition, which neither
    the plan's comparison nor a fingerprint sees. Reads each unit's files on the host."""
    wanted = [n for n in names if records.get(n) == fingerprint_of(units, n)]
    if not wanted:
        return []
    from pdctl.units import UnitSet

    pending = set(manager.pending_changes(UnitSet(units.target, tuple(units.service(n) for n in wanted))))
    return [n for n in wanted if n in pending]


@dataclass
class Context:
    """Everything a step needs. ``manager`` is a :class:`pdctl.units.ServiceManager`."""

    dep: Deployment
    topology: Topology
    host: Any
    manager: Any
    units: Any
    """The deployment's :class:`pdctl.units.UnitSet`."""
    unit_of: dict[str, str]
    """Role name (and ``router``) → unit name."""
    client: httpx.Client
    journal: Journal
    journal_state: JournalState
    restart: set[str] = field(default_factory=set)
    """Roles the plan restarts (settings changed); their observe never skips."""
    asked: set[str] = field(default_factory=set)
    """Of :attr:`restart`, those the operator asked to restart (``--restart``): a process an interrupted apply had
    marked for its restart and that still runs is restarted, never taken for one that apply started."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    kernels_command: list[str] | None = None
    kernels_manifest: str | None = None
    sink: Any = None
    """Where progress inside a step goes (an :class:`~pdctl.statemachine.events.EventSink`; None: nowhere)."""
    restarting_now: set[str] = field(default_factory=set)
    """Units :meth:`restart_unit` has begun to stop and not yet started again: an interruption now leaves them down,
    which the apply's ``apply_interrupted`` says (instead of "what already runs stays as it is"). So are a unit
    stopped first to free GPUs or ports for another role (its own step starts it again) and a dropped role's unit
    being stopped for its removal (:attr:`removing_now`)."""
    removing_now: set[str] = field(default_factory=set)
    """Units of roles the spec drops that the apply has begun to stop and not yet crossed off: an interruption now
    leaves them stopped, which ``apply_interrupted`` says."""

    def say(self, message: str, *, step: str | None = None, **data: Any) -> None:
        """Emit one ``info`` event: progress a step would otherwise make in silence (a stop that may take minutes)."""
        if self.sink is not None:
            from pdctl.statemachine.events import Event

            self.sink.emit(Event("info", message, step=step, data=data))

    def checkpoint(self) -> None:
        """Called every poll of a long wait: the sink's ``checkpoint()`` (the console's cancel) may raise to halt the
        run there, as it may at any event, instead of only after a wait of minutes."""
        check = getattr(self.sink, "checkpoint", None)
        if check is not None:
            check()

    def restart_unit(self, unit: str, *, step: str) -> None:
        """Restart *unit*, saying first how long stopping it may take (its ``TimeoutStopSec``): a server that does
        not exit on SIGTERM is waited for that long, with nothing else to show."""
        stop_s = self.units.service(unit).timeout_stop_s
        self.say(f"restarting {unit} (stopping it may take up to {stop_s:g} s)", step=step, unit=unit)
        self.restarting_now.add(unit)
        self.manager.restart(unit)
        self.restarting_now.discard(unit)
        self.started(unit)

    def started(self, unit: str) -> None:
        """Journal (atomically) that *unit* was just started or restarted with its desired definition, not yet
        proven (:data:`STARTED`)."""
        self.restarting_now.discard(unit)  # (one stopped first for another role, started again by its own step)
        self.journal_state.units[unit] = STARTED + self.fingerprint(unit)
        self.journal.write(self.journal_state)

    def fingerprint(self, unit: str) -> str:
        """Hash of the desired definition of *unit* (argv, env, limits…): :func:`fingerprint_of`."""
        return fingerprint_of(self.units, unit)

    def forget(self, unit: str) -> None:
        """Drop *unit*'s proven fingerprint from the journal (atomically) before touching it."""
        if self.journal_state.units.pop(unit, None) is not None:
            self.journal.write(self.journal_state)

    def mark_restarting(self, *units: str, main_pids: Mapping[str, int | None] | None = None) -> None:
        """Record (atomically) that *units* get a new definition and need a restart: until a step proves them again,
        they are neither proven (observe never skips them) nor servers loading what this apply wants (a resumed
        apply restarts them rather than wait for, or prove, a process started from the old definition). Where the
        record tells which definition the running process runs, it keeps it, with that process's PID
        (``restarting:<fp>@<pid>``): a resumed apply whose spec asks that definition again keeps the process.
        *main_pids*: each unit's main PID where the caller has just asked the manager (else it is asked here)."""
        if units:
            for u in units:
                pid = main_pids[u] if main_pids is not None and u in main_pids else self.manager.status(u).main_pid
                fp = running_definition(self.journal_state.units.get(u), pid)
                self.journal_state.units[u] = f"{RESTARTING}:{fp}@{pid}" if fp and pid else RESTARTING
            self.journal.write(self.journal_state)

    def install_units(self, own: Collection[str]) -> set[str]:
        """``manager.install`` of the units of the step that owns *own* (unit names), returning the names it changed
        whose running process does not run the new definition. Another step's service that runs now keeps its file
        until its own step restarts it: an apply stopped before that step (a kill, a failed step) never leaves a
        file that its supervisor would start after a crash with settings the apply did not get to. Units that do
        not run (and the target) are written too, so that what starts next runs what the spec asks.

        First, every running unit whose definition (file or secrets) it is about to change is journalled as
        restarting: whichever step restarts it, and whenever a kill comes, nothing waits for or proves the process
        still running the old one. A running unit whose process runs the desired definition already (an
        interrupted apply rewrote its file for another spec and had not restarted it: :func:`running_definition`)
        gets its file back, is journalled as started with it (:data:`STARTED`), and is not restarted for it."""
        services = set(self.unit_of.values())
        live = ("active", "activating", "deactivating")
        status = {u: self.manager.status(u) for u in services if u not in own}
        units = UnitSet(self.units.target, tuple(
            s for s in self.units.services if s.name not in status or status[s.name].state not in live))
        pending = [u for u in self.manager.pending_changes(units) if u in services]
        status.update({u: self.manager.status(u) for u in pending if u not in status})
        running = {u: status[u] for u in pending if status[u].state in live}
        restored = {u for u, st in running.items() if st.state != "deactivating"
                    and running_definition(self.journal_state.units.get(u), st.main_pid) == self.fingerprint(u)}
        self.mark_restarting(*[u for u in running if u not in restored],
                             main_pids={u: st.main_pid for u, st in running.items()})
        changed = set(self.manager.install(units))
        if restored:
            # (as a server started with that definition: its step waits for it while it loads and proves it as it
            # stands, never skips it as proven; the record may have come from an unproven start)
            self.journal_state.units.update({u: STARTED + self.fingerprint(u) for u in restored})
            self.journal.write(self.journal_state)
        return changed - restored

    def definition_changed(self, unit: str) -> bool:
        """True when *unit*'s desired definition differs from the one last proven running."""
        return self.journal_state.units.get(unit) != self.fingerprint(unit)

    def file_edited(self, unit: str) -> bool:
        """True when *unit*'s installed files differ from what pdctl writes for the definition last proven running
        (:func:`edited_units`): its step is not satisfied as it stands; apply writes them back."""
        return bool(edited_units(self.manager, self.units, self.journal_state.units, [unit]))

    def router_url(self) -> str:
        r = self.topology.router
        assert r is not None
        return r.url


def _wait(what: str, deadline_s: float, fn: Callable[[], T | None], *, poll: float, step: str,
          checkpoint: Callable[[], None] | None = None) -> T:
    """Call *fn* until it returns a value (not None) or *deadline_s* passes (StepTimeout); *checkpoint* before each
    try (``Context.checkpoint``: it may raise to halt the run)."""
    end = time.monotonic() + deadline_s
    last_exc: Exception | None = None
    while True:
        if checkpoint is not None:
            checkpoint()
        try:
            v = fn()
            if v is not None:
                return v
        except ProbeError as exc:
            last_exc = exc
        if time.monotonic() >= end:
            tail = f" (last error: {last_exc})" if last_exc else ""
            raise StepTimeout(f"{what}: not reached within {deadline_s:g} s{tail}", step=step)
        time.sleep(poll)


# --- server roles --------------------------------------------------------------------------------


def _bind(out: dict[int, str | None], port: int, bind: str | None) -> None:
    # one port bound twice (the spec's rules refuse it): any holder counts
    out[port] = bind if out.get(port, bind) == bind else None


def _router_ports(router: RouterTopology) -> dict[int, str | None]:
    """``{port: bind address}`` (:func:`ports.bind_address`) of the router's HTTP port and its Prometheus port. smg
    binds each on the address it is given: ``--host`` and ``--prometheus-host`` (smg 1.13.0 ``--help``,
    shared/reference/router: "Host address to bind the router server", "… the Prometheus metrics server"); without
    ``--prometheus-host`` (a journal older than the field) on "the unspecified address of --host's family": every
    address, as ``bind_address("")`` says."""
    out: dict[int, str | None] = {}
    _bind(out, router.port, ports.bind_address(router.host))
    prom = router.settings.get("prometheus_port")
    _bind(out, int(prom or router.port), ports.bind_address(str(router.settings.get("prometheus_host") or ""))
          if prom else ports.bind_address(router.host))
    return out


def _role_ports(role: RoleTopology) -> dict[int, str | None]:
    """``{port: bind address}`` (:func:`ports.bind_address`; None: any holder of the port is in the way) of every port
    *role*'s server listens on. Sources (SGLang 0.5.23 unless said):

    * HTTP port: uvicorn binds ``--host`` (shared/reference/sglang-pd.md §1.2).
    * KV bootstrap port (prefill): ``CommonKVBootstrapServer`` binds the prefill's ``--host`` too (sglang-pd.md §4:
      "on prefill ``--host:--disaggregation-bootstrap-port``"; ``disaggregation/common/conn.py``,
      ``web.TCPSite(runner, host=self.host, port=self.port)`` with ``host=server_args.host``).
    * NCCL port: torch.distributed's rendezvous store, which SGLang's ``ModelRunner`` opens at
      ``tcp://127.0.0.1:{nccl_port}`` (``model_executor/model_runner.py``, no ``--dist-init-addr``); its server
      (``TCPStore``, torch ``c10d/TCPStoreLibUvBackend.cpp`` ``UvTcpServer::makeWithPort``) binds ``::`` or
      ``0.0.0.0`` whatever host the init method names: every address, so any holder of the port is in the way.
    * attention-DP's derived ports (``port+233 … port+239``): ZMQ endpoints that sglang-pd.md §1.2 puts on
      127.0.0.1, but which of them a server binds, and how many, differs between SGLang releases (later ones reserve
      more for their Rust server path) and was not read for every release pdctl targets: the port number alone
      counts, as before addresses were compared.
    """
    from pdctl.statemachine.sglang_facts import DERIVED_PORT_OFFSETS

    http = ports.bind_address(role.http_host)
    out: dict[int, str | None] = {}
    _bind(out, role.port, http)
    if role.kind == "prefill" and role.bootstrap_port:
        _bind(out, role.bootstrap_port, http)
    if role.nccl_port:
        _bind(out, role.nccl_port, None)
    if role.attn_dp > 1:
        for off in DERIVED_PORT_OFFSETS:
            _bind(out, role.port + off, None)
    return out


def deployment_ports(topo: Topology) -> dict[int, str]:
    """``{port: role name}`` of every port *topo*'s roles and router listen on (HTTP, bootstrap, NCCL, the derived
    attention-DP ports, the router's metrics): what an apply needs free and what a running deployment holds."""
    return {port: name for port, (name, _bind_to) in deployment_binds(topo).items()}


def deployment_binds(topo: Topology) -> dict[int, tuple[str, str | None]]:
    """``{port: (role name, bind address)}``: :func:`deployment_ports` with the address each port is bound on
    (:func:`_role_ports`, :func:`_router_ports`; None: any holder of the port is in the way)."""
    out: dict[int, tuple[str, str | None]] = {}
    for role in topo.roles:
        for port, bind in _role_ports(role).items():
            out.setdefault(port, (role.name, bind))
    if topo.router is not None:
        for port, bind in _router_ports(topo.router).items():
            out.setdefault(port, ("router", bind))
    return out


def _describe(ls: list[ports.Listener]) -> str:
    return ", ".join(f"port {x.port} by PID {x.pid or '?'} ({x.command or 'unknown'})"
                     + ("" if x.listening else CONNECTION_WORDS) for x in ls)


def _ports_hint(ls: list[ports.Listener], hint: str) -> str:
    """*hint*, with where a holder is a connection from the port (not a listener) what to do about ephemeral ports."""
    return hint if all(x.listening for x in ls) else f"{hint}; {EPHEMERAL_PORT_HINT}"


def _preflight_ports(ctx: Context, name: str, wanted: dict[int, str | None], main_pid: int | None, step: str) -> None:
    """Refuse to start *name* while a process outside its unit holds one of its ports (*wanted*: ``{port: bind
    address}``) in the way of its bind."""
    foreign = ports.foreign_listeners(ctx.host, wanted, main_pid)
    if foreign:
        raise ApplyFailed(
            f"{name}: cannot start, its ports are taken: {_describe(foreign)}",
            step=step,
            hint=_ports_hint(foreign, "stop that process (another deployment?) or give this role other ports in the "
                                      "spec"),
        )


def ports_in_ephemeral_range(ctx: Context) -> str | None:
    """The ports the deployment listens on that lie in the host's ephemeral range, ``net.ipv4.ip_local_port_range``,
    and are not in ``net.ipv4.ip_local_reserved_ports`` (Linux ip-sysctl.rst), in words with the range: the kernel
    gives any outbound connection a local port from that range, and one that takes a role's port keeps the role from
    starting there (a restart too). None where none is, or the host does not say (a kernel without those files)."""
    try:
        low, high = map(int, ctx.host.read_file("/proc/sys/net/ipv4/ip_local_port_range").split())
    except (OSError, ValueError):
        return None
    try:
        reserved = ctx.host.read_file("/proc/sys/net/ipv4/ip_local_reserved_ports").decode().strip()
        kept = {p for part in reserved.split(",") if part.strip()
                for p in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    except (OSError, ValueError):
        kept = set()
    inside = sorted((port, name) for port, (name, _bind) in deployment_binds(ctx.topology).items()
                    if low <= port <= high and port not in kept)
    if not inside:
        return None
    return (f"port(s) {', '.join(f'{port} ({name})' for port, name in inside)} lie in the host's ephemeral range "
            f"{low}–{high} (net.ipv4.ip_local_port_range) and are not reserved")


_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


def _port_taken_while_starting(ctx: Context, role: RoleTopology, unit: str, step: str) -> None:
    """*role*'s server, just crashed while starting and about to be restarted, said a port was in use (uvicorn's
    ``[Errno 98] … address already in use``, the bootstrap server's or torch's ``Address already in use``): a
    process that took one of its ports after the checks before the start. Each restart would fail the same until its
    start limit (three starts, 38 s, then "start limit hit"): raises :class:`ApplyFailed` at once, naming the holder
    where one is found; returns where none is (the restart may find the port free)."""
    if not any(_IN_USE.search(ln) for ln in ctx.manager.logs(unit, lines=15)):
        return
    foreign = ports.foreign_listeners(ctx.host, _role_ports(role), None)
    if foreign:
        raise ApplyFailed(
            f"{role.name}: its server could not bind its port while starting (address already in use), taken "
            f"meanwhile: {_describe(foreign)}; its unit restarts until its start limit",
            step=step,
            hint=_ports_hint(foreign, "stop that process (another deployment?) or give this role other ports in the "
                                      "spec, then apply again"),
        )


PROGRESS_LINE_CHARS = 200
"""The most characters of a loading role's last log line that a ``progress`` event's message quotes (its ``data``
holds the whole line)."""


def _say_loading(ctx: Context, step: str, role: RoleTopology, unit: str, elapsed_s: float, bound_s: float) -> None:
    """Emit one ``progress`` event for *role*, still loading *elapsed_s* seconds after its wait began: against the
    spec's ``expected_cold_start_s`` (else the wait's bound *bound_s*), with its unit's last log line (one line read
    from the log's end through the service manager; ``""`` where it cannot be read, which never fails the wait).
    ``data``: ``role``, ``unit``, ``elapsed_s``, ``expected_cold_start_s`` (None: the spec sets none), ``bound_s``,
    ``log_line``."""
    if ctx.sink is None:
        return
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.events import Event
    from pdctl.units import UnitsError

    try:
        lines = ctx.manager.logs(unit, lines=1)
    except (PdctlError, UnitsError, OSError):
        lines = []
    line = lines[-1].strip() if lines else ""
    expected = role.settings.get("expected_cold_start_s")
    against = (f"of an expected cold start of {expected:g} s" if expected
               else f"(no expected_cold_start_s; waiting up to {bound_s:g} s)")
    quoted = line if len(line) <= PROGRESS_LINE_CHARS else line[:PROGRESS_LINE_CHARS - 1] + "…"
    ctx.sink.emit(Event("progress", f"{role.name} loading: {elapsed_s:.0f} s {against}; last log line: "
                                    f"{quoted or '(none yet)'}",
                        step=step, elapsed_s=elapsed_s,
                        data={"role": role.name, "unit": unit, "elapsed_s": round(elapsed_s, 1),
                              "expected_cold_start_s": expected, "bound_s": bound_s, "log_line": line}))


def _started_here(ctx: Context, units: set[str]) -> Callable[[int], bool]:
    """Whether a PID was started for one of *units* by this context's service manager itself
    (:func:`ports.started_as`): under pdctl's process supervisor, the watchdog's argument is the unit's folder in
    its state directory (``<state>/services/<unit>``), so that the same deployment applied with another state
    directory is not taken for this one; under systemd, the unit's cgroup in this manager's scope (``…/system.slice/
    <unit>`` for the system manager; a user manager's elsewhere)."""
    import posixpath

    state_dir = getattr(ctx.manager, "state_dir", None)
    if state_dir:
        folders = [posixpath.join(state_dir, "services", u) for u in sorted(units)]
        return lambda pid: ports.started_as(ctx.host, pid, args=folders)
    system = [f"/system.slice/{u}" for u in sorted(units)]
    if getattr(ctx.manager, "scope", "system") == "system":
        return lambda pid: ports.started_as(ctx.host, pid, cgroups=system)
    return lambda pid: ports.started_as(ctx.host, pid, cgroups=[f"/{u}" for u in sorted(units)], not_cgroups=system)


def _ports_wanted(ctx: Context, own_units: set[str]) -> tuple[dict[int, tuple[str, str, str | None]], list[int]]:
    """``({port: (role, step, bind address)}, main PIDs of *own_units*)``: the ports the deployment will listen on,
    with the role that needs each, the step an apply would fail at and the address it binds the port on
    (:func:`deployment_binds`), and the processes that vouch for a listener. Plan's warning and apply's refusal both
    scan with this (:func:`ports_held_elsewhere`, :func:`ports_taken_elsewhere`)."""
    topo = ctx.topology
    step_of = role_steps(topo)
    wanted = {port: (name, step_of[name], bind) for port, (name, bind) in deployment_binds(topo).items()}
    if not wanted:
        return {}, []
    # (a unit still stopping its main process, e.g. after an interrupted `pdctl down`, does not vouch for it: that
    # process is one of the previous ones apply waits for, not a server this apply may keep)
    ours = [st.main_pid for st in (ctx.manager.status(u) for u in sorted(own_units))
            if st.main_pid and st.state != "deactivating"]
    return wanted, ours


def _binds(wanted: dict[int, tuple[str, str, str | None]]) -> dict[int, str | None]:
    return {port: w[2] for port, w in wanted.items()}


def _unowned_looked_again(ctx: Context, wanted: dict[int, tuple[str, str, str | None]], ours: list[int],
                          held: list[ports.Listener]) -> list[ports.Listener]:
    # A listener no process owns is a socket being torn down (its process exiting) or one of a process this user
    # cannot see; the first is gone within moments: look again for up to 2 s.
    deadline = time.monotonic() + 2.0
    while any(x.pid is None for x in held) and time.monotonic() < deadline:
        time.sleep(0.1)
        held = ports.held_outside(ctx.host, _binds(wanted), ours)
    return held


def ports_held_elsewhere(ctx: Context, own_units: set[str]) -> list[PortHeld]:
    """What :func:`ports_taken_elsewhere` would refuse now, as values and without waiting (``pdctl plan``'s warning):
    each port a role or the router will listen on that a process outside *own_units* holds, with the role, the step
    an apply would fail at, and, for this deployment's own process applied another way (another ``--state-dir``, user
    or service manager), how. This deployment's own running roles are not listed, nor its previous processes that
    their units are still stopping (apply waits for those); a socket with no owner is looked at again for up to
    2 s, as apply does."""
    wanted, ours = _ports_wanted(ctx, own_units)
    if not wanted:
        return []
    mine = _started_here(ctx, own_units)
    held = [x for x in ports.held_outside(ctx.host, _binds(wanted), ours) if x.pid is None or not mine(x.pid)]
    held = [x for x in _unowned_looked_again(ctx, wanted, ours, held) if x.pid is None or not mine(x.pid)]
    markers = set(ctx.unit_of.values())
    out = []
    for x in held:
        how = ports.started_by(ctx.host, x.pid, markers) if x.pid is not None else None
        out.append(PortHeld(port=x.port, role=wanted[x.port][0], step=wanted[x.port][1], pid=x.pid, command=x.command,
                            applied_elsewhere=None if how is None else ports.applied_with(how) or "",
                            other_deployment=None if how is not None else _other_deployment(ctx, x.pid, markers),
                            listening=x.listening))
    return out


def ports_taken_elsewhere(ctx: Context, own_units: set[str]) -> None:
    """Before anything starts: refuse the apply if a process outside this deployment (outside every unit in
    *own_units*, which holds the desired roles' units and those of roles being removed) listens on a port a
    role or the router will need. The per-step checks (``_preflight_ports``) still run; this one finds a
    taken router port before prefill and decode are started, not after. Raises :class:`ApplyFailed` naming
    every holder and the step it would have failed at."""
    wanted, ours = _ports_wanted(ctx, own_units)
    if not wanted:
        return
    held = ports.held_outside(ctx.host, _binds(wanted), ours)
    # A process started for one of this deployment's own units but no longer its main process: a server its
    # supervisor is still stopping (an interrupted apply's restart; a server slow to exit on SIGTERM). Its unit ends
    # it within TimeoutStopSec: wait that long, saying so, rather than call it another deployment's.
    mine = _started_here(ctx, own_units)
    leftover = [x for x in held if x.pid is not None and mine(x.pid)]
    if leftover:
        stop_s = max((s.timeout_stop_s for s in ctx.units.services), default=120) + 15
        ctx.say(f"waiting up to {stop_s:g} s for this deployment's previous processes to exit: "
                + "; ".join(f"port {x.port} held by PID {x.pid}" for x in leftover), step="ports")
        deadline = time.monotonic() + stop_s
        while leftover and time.monotonic() < deadline:
            ctx.checkpoint()
            time.sleep(min(ctx.timeouts.poll, 0.5))
            held = ports.held_outside(ctx.host, _binds(wanted), ours)
            leftover = [x for x in held if x.pid is not None and mine(x.pid)]
        if leftover:
            raise ApplyFailed(
                "this deployment's own previous processes still hold its ports after "
                f"{stop_s:g} s, nothing was started or changed: " + _describe(leftover),
                step=wanted[leftover[0].port][1],
                hint="see why they do not exit (e.g. a stopped process: kill -CONT or kill -9 PID), then apply again",
            )
    held = _unowned_looked_again(ctx, wanted, ours, held)
    if held:
        order = [st.name for st in steps_for(ctx.topology)]
        first = min(held, key=lambda x: order.index(wanted[x.port][1]) if wanted[x.port][1] in order else len(order))
        # This deployment's own roles, applied another way (another --state-dir, user or service manager), say which
        markers = set(ctx.unit_of.values())
        started = [ports.started_by(ctx.host, x.pid, markers) if x.pid is not None else None for x in held]
        # ...and another pdctl deployment's (another name: a renamed spec's old deployment, say), its unit
        other = [None if how else _other_deployment(ctx, x.pid, markers) for x, how in zip(held, started)]
        # one clause per holder, its ports together: a renamed deployment's old processes hold every port, and each
        # port repeating its holder's whole command line made a refusal of several KB
        by_pid: dict[int | None, list[tuple[ports.Listener, str | None]]] = {}
        rank = {name: i for i, name in enumerate(order)}
        for x, o in sorted(zip(held, other), key=lambda xo: (rank.get(wanted[xo[0].port][1], len(order)), xo[0].port)):
            by_pid.setdefault(x.pid, []).append((x, o))
        where = "; ".join(
            ", ".join(f"{wanted[x.port][0]}{' needs' if i == 0 else ''} port {x.port} at {wanted[x.port][1]}"
                      for i, (x, _o) in enumerate(xs))
            + f", held by PID {xs[0][0].pid or '?'} ({xs[0][0].command or 'unknown'})"
            + ("" if all(x.listening for x, _o in xs) else CONNECTION_WORDS)
            + (f", started for {xs[0][1]}" if xs[0][1] else "")
            for xs in by_pid.values())
        applied = sorted({a for how in started if how and (a := ports.applied_with(how))})
        if all(started):
            raise ApplyFailed(
                f"ports taken by this deployment's own processes, applied another way, nothing was started or "
                f"changed: {where}" + (f"; it runs under {' and '.join(applied)}" if applied else ""),
                step=wanted[first.port][1],
                hint=APPLIED_ELSEWHERE_HINT,
            )
        ours = sum(1 for how in started if how)
        raise ApplyFailed(
            f"ports taken by processes outside this deployment, nothing was started or changed: {where}"
            + (f" ({ours} of them this deployment's own, applied another way"
               + (f": it runs under {' and '.join(applied)})" if applied else ")") if ours else ""),
            step=wanted[first.port][1],
            hint=_ports_hint(held, OTHER_DEPLOYMENT_HINT if any(other) else
                             "stop those processes (another deployment?) or give the roles other ports in the spec"),
        )


def gpus_held_elsewhere(ctx: Context, own_units: set[str]) -> list[GpuHeld] | None:
    """Each GPU a role this apply starts or restarts will run on (its ``gpus``, nvidia-smi indices; a role kept as it
    runs loads nothing) that a compute process outside *own_units* uses now (:func:`~pdctl.statemachine.inventory.gpu_processes`), with the role, the step an apply would fail at,
    and who the process runs for (this deployment applied another way, or another pdctl deployment), as
    :func:`ports_held_elsewhere` tells a port's holder. This deployment's own processes (those of roles it restarts
    or keeps, and previous ones their units are still stopping) are not listed. None where the host cannot tell (no
    nvidia-smi: a host without the NVIDIA driver, as the demo's). Raises CommandTimeout (nvidia-smi hung)."""
    from pdctl.statemachine.inventory import gpu_processes

    step_of = role_steps(ctx.topology)

    def starts(r: RoleTopology) -> bool:  # (a role kept as it runs loads nothing: what shares its GPUs is not this apply's)
        unit = ctx.unit_of[r.name]
        st = ctx.manager.status(unit)
        # (one running unsupervised, its supervisor gone, is restarted under a new one: plan said "nothing asked")
        return (r.name in ctx.restart or ctx.definition_changed(unit) or st.state not in ("active", "activating")
                or not st.supervised)

    wanted = {g: r for r in ctx.topology.roles if starts(r) for g in r.gpus}
    if not wanted:
        return []
    procs = gpu_processes(ctx.host)
    if procs is None:
        return None
    mine = _started_here(ctx, own_units)
    markers = set(ctx.unit_of.values())
    out = []
    for p in procs:
        role = wanted.get(p.gpu)
        if role is None:
            continue
        command = ports.command_line(ctx.host, p.pid)
        if command and mine(p.pid):
            continue
        how = ports.started_by(ctx.host, p.pid, markers) if command else None
        out.append(GpuHeld(gpu=p.gpu, role=role.name, step=step_of[role.name], pid=p.pid, used_mib=p.used_mib,
                           command=command, applied_elsewhere=None if how is None else ports.applied_with(how) or "",
                           other_deployment=None if how is not None or not command
                           else _other_deployment(ctx, p.pid, markers)))
    return out


def gpus_taken_elsewhere(ctx: Context, own_units: set[str]) -> None:
    """Before anything starts: refuse the apply if a compute process outside this deployment uses a GPU a role will
    run on (:func:`gpus_held_elsewhere`). SGLang sizes its KV cache from the GPU memory left when it starts: on a GPU
    another process uses, a server fails after loading its weights ("Not enough memory"), minutes in, or runs with
    a cache too small. Nothing is checked where the host has no nvidia-smi; one that fails or answers what cannot be
    read is a warning event, and the apply goes ahead. A PID the host's ``/proc`` does not show is a warning event,
    not refused: nvidia-smi can name PIDs of another namespace, this deployment's own servers among them. Raises
    :class:`ApplyFailed` naming every process and the step it would have failed at; CommandTimeout when nvidia-smi
    hangs (a wedged GPU)."""
    try:
        found = gpus_held_elsewhere(ctx, own_units) or []
    except CommandTimeout:
        raise
    except HostError as exc:  # (failing, or unreadable: what shares the GPUs cannot be told, the servers tell later)
        ctx.say(f"warning: the GPUs could not be checked for processes outside the deployment: {exc.message}; going "
                "ahead", step="gpus")
        return
    for x in found:
        if not x.command:  # (whose it is cannot be told: this deployment's own server, seen from another PID namespace?)
            ctx.say(f"warning: {gpu_holder(x)}; {HIDDEN_GPU_PROCESS}", step="gpus")
    held = [x for x in found if x.command]
    if not held:
        return
    order = [st.name for st in steps_for(ctx.topology)]
    first = min(held, key=lambda x: order.index(x.step) if x.step in order else len(order))
    raise ApplyFailed(
        "GPUs in use outside this deployment, nothing was started or changed: "
        + "; ".join(gpu_holder(x) for x in held),
        step=first.step,
        hint=gpus_held_hint(held),
    )


def _other_deployment(ctx: Context, pid: int | None, own: set[str]) -> str | None:
    """``pdctl unit U`` (with how it was applied, where that tells) when *pid* runs for a pdctl unit that is none of
    *own* (:func:`ports.pdctl_unit_of`): another deployment of pdctl's, by name; None otherwise."""
    found = ports.pdctl_unit_of(ctx.host, pid, other_than=own)
    if found is None:
        return None
    how = ports.applied_with(found[1])
    return f"pdctl unit {found[0]}" + (f" ({how})" if how else "")


# Run on the deployment's host with its engine Python: each argument an address; prints {address: why unusable}.
# getaddrinfo with AI_PASSIVE, then bind port 0 on the first result that binds, as a server's --host would.
_BIND_PROBE = """
import json, socket, sys
out = {}
for a in sys.argv[1:]:
    try:
        infos = socket.getaddrinfo(a, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        out[a] = "does not resolve on this host (" + (e.strerror or str(e)) + ")"
        continue
    why = None
    for family, _t, _p, _c, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind(addr)
            why = None
            break
        except OSError as e:  # (socket() itself fails for a family the host lacks: IPv6 disabled)
            why = "cannot be bound on this host (" + (e.strerror or str(e)) + ")"
    if why:
        out[a] = why
print(json.dumps(out))
"""


def _watchdog_probe(state_dir: str | None) -> str:
    """Run before :data:`_BIND_PROBE` for the process supervisor, whose watchdogs run ``engine.python -m
    pdctl.units.supervise`` on the host and keep their state under *state_dir* there: exit 97 (the error on stderr)
    when that interpreter cannot import it, 98 (the folder on stderr) when *state_dir*, or the nearest folder of it
    that exists, cannot be written there (not looked at when None). Creates nothing."""
    folder = "" if state_dir is None else f"""
d = {state_dir!r}
while not os.path.exists(d) and os.path.dirname(d) != d:
    d = os.path.dirname(d)
if not os.access(d, os.W_OK | os.X_OK):
    sys.stderr.write(d)
    sys.exit(98)
"""
    return """
import os, sys
try:
    import pdctl.units.supervise
except Exception as e:  # noqa: BLE001
    sys.stderr.write(type(e).__name__ + ": " + str(e))
    sys.exit(97)
""" + folder


def running_from_another_state_dir(ctx: Context) -> None:
    """Before anything starts or stops: no unit of this deployment may run from another state directory on the host
    (applied with another ``--state-dir``, ``PDCTL_STATE_DIR`` or ``XDG_STATE_HOME``): this apply would start a second
    copy of the deployment beside it, on the same GPUs, which no journal relates to the first. Under the process
    supervisor, whose units live in the state directory (systemd's share one folder: units installed there are
    this deployment's, :func:`~pdctl.statemachine.service.unrecorded_units`). Raises :class:`ApplyFailed` naming each
    unit, its watchdog's PID and that state directory."""
    found = ctx.manager.running_elsewhere(ctx.dep.name)
    if not found:
        return
    suffix = "/supervisor/services/"
    dirs = sorted({f.rstrip("/").rsplit("/", 1)[0].removesuffix(suffix.rstrip("/")) for _u, f, _p in found})
    said = ", ".join(f"{u} (watchdog PID {p})" for u, _f, p in sorted(found))
    step = next(iter(role_steps(ctx.topology).values()), "router_exposed")
    raise ApplyFailed(
        f"deployment {ctx.dep.name!r} already runs from another state directory ({', '.join(dirs)}): {said}; this "
        "apply would start a second copy beside it, nothing was started or changed",
        step=step,
        hint=f"manage it from there (--state-dir {dirs[0]}, or the PDCTL_STATE_DIR / XDG_STATE_HOME it was applied "
             f"with), or `pdctl down SPEC --state-dir {dirs[0]} --yes` first",
    )


def service_user_unusable(ctx: Context) -> None:
    """Before anything starts or stops, with ``service_user`` set: it must be an account on the host (``id -u
    NAME``), pdctl must run as root there (only root starts a process as another account: setuid(2)), and the account,
    unless root, must be allowed to bind every port the roles and the router listen on: only root may bind one below
    ``net.ipv4.ip_unprivileged_port_start`` (1024 unless lowered; Linux ip-sysctl.rst). Otherwise each unit would fail
    at its start (systemd: exit 217, USER; the server's bind: EACCES) after its predecessor was stopped. Raises
    :class:`ApplyFailed` naming ``service_user`` (and each port's field) at the first step that would fail. A host
    where ``id`` cannot run is left to the steps."""
    user = ctx.dep.service_user
    if user is None:
        return
    step_of = role_steps(ctx.topology)
    first = next(iter(step_of.values()), "router_exposed")
    try:
        account = ctx.host.run(["id", "-u", user], timeout=30, check=False)
        me = ctx.host.run(["id", "-u"], timeout=30, check=False)
    except (OSError, TimeoutError):
        return
    said = ", nothing was started or changed"
    if account.returncode != 0 or not account.stdout.strip().isdigit():
        raise ApplyFailed(
            f"service_user = {user!r} is not an account on host {ctx.host.name} (`id -u {user}`: "
            f"{(account.stderr or account.stdout).strip() or f'exit {account.returncode}'}){said}",
            step=first,
            hint=f"create it there (e.g. `useradd --system --create-home {user}`), write an account the host has, or "
                 "leave service_user unset to run the roles as the service manager's own user",
        )
    if me.stdout.strip() != "0":
        raise ApplyFailed(
            f"service_user = {user!r}: pdctl runs as UID {me.stdout.strip() or '?'} on host {ctx.host.name}, and only "
            f"root can start the roles as another account{said}",
            step=first,
            hint='run pdctl as root there (sudo, or hosts.<name>.ssh_user = "root"), or leave service_user unset and '
                 "run pdctl as that account",
        )
    if account.stdout.strip() == "0":
        return
    _not_executable_by(ctx, user, first)
    try:
        floor = int(ctx.host.read_file("/proc/sys/net/ipv4/ip_unprivileged_port_start").decode().strip())
    except (OSError, ValueError):
        floor = 1024  # (the kernel's default; a kernel before 4.11 has no such setting and uses it)
    low = sorted((port, name) for port, (name, _bind) in deployment_binds(ctx.topology).items() if port < floor)
    if low:
        ports_said = ", ".join(f"{port} ({name})" for port, name in low)
        raise ApplyFailed(
            f"service_user = {user!r} (UID {account.stdout.strip()}) cannot bind port(s) {ports_said} on host "
            f"{ctx.host.name}: below net.ipv4.ip_unprivileged_port_start = {floor} only root may{said}",
            step=step_of.get(low[0][1], "router_exposed"),
            hint=f"give those roles ports from {floor} up, lower net.ipv4.ip_unprivileged_port_start on the host "
                 "(sysctl), or leave service_user unset",
        )


def _not_executable_by(ctx: Context, user: str, step: str) -> None:
    """Each program the units start (their first argument, and the readiness gate's Python) must be one *user* can
    execute: a venv whose interpreter links into root's home (``/root`` is 0700) is not, and every unit would fail to
    exec. Asked as that account (``runuser -u USER -- test -x PATH``, which follows links and needs search permission
    on every folder on the way), and for a script (``#!``: smg's entry point) of its interpreter too. Raises :class:`ApplyFailed` naming each program and the spec field it comes from; a
    host without ``runuser`` is not checked."""
    from pdctl.statemachine.launch import python_for

    python = python_for(ctx.dep)
    programs: dict[str, str] = {}
    for svc in ctx.units.services:
        field = "router.executable" if svc.role == "router" and svc.argv[0] != python else "engine.python"
        programs.setdefault(svc.argv[0], field)
        if svc.readiness_python:
            programs.setdefault(svc.readiness_python, "engine.python")
    refused = []
    as_user = ["runuser", "-u", user, "--"]

    def named(path: str) -> str:  # (a venv's python links to the interpreter it was made from: /root/.pyenv/…)
        try:
            real = ctx.host.run(["readlink", "-f", path], timeout=30, check=False).stdout.strip()
        except (OSError, TimeoutError):
            real = ""
        return f"{path} (→ {real})" if real and real != path else path

    for path, field in programs.items():
        try:
            res = ctx.host.run([*as_user, "test", "-x", path], timeout=30, check=False)
            if res.returncode == 0:  # a script (smg's entry point is one): its interpreter must be executable too
                line = ctx.host.run([*as_user, "sed", "-n", "1{/^#!/p;q}", path], timeout=30, check=False)
                interpreter = line.stdout[2:].split()[:1] if line.returncode == 0 else []
                if interpreter and interpreter[0].startswith("/"):
                    res = ctx.host.run([*as_user, "test", "-x", interpreter[0]], timeout=30, check=False)
                    if res.returncode == 1:
                        refused.append(f"{path} ({field}: its interpreter {named(interpreter[0])})")
                        continue
        except (OSError, TimeoutError):
            return
        if res.returncode == 1:
            refused.append(f"{named(path)} ({field})")
        elif res.returncode != 0:  # (no runuser there: 127; the check is a courtesy, the units' start says it too)
            return
    if refused:
        raise ApplyFailed(
            f"service_user = {user!r} cannot execute {', '.join(refused)} on host {ctx.host.name} (a folder on the way "
            f"it may not enter, such as root's home, or no execute bit for it), nothing was started or changed",
            step=step,
            hint=f"install the engine's Python and smg where {user} can run them — a venv made from an interpreter "
                 "outside /root (e.g. /usr/bin/python3 -m venv /opt/sglang) — and write those paths in engine.python "
                 "/ router.executable, or leave service_user unset",
        )


def numa_nodes_missing(ctx: Context) -> None:
    """Before anything starts or stops: the NUMA node each role's unit binds its memory to (``NUMAMask=``; the process
    supervisor's ``set_mempolicy(2)``) must exist on the host, ``/sys/devices/system/node/node<N>`` (sysfs-devices-node
    ABI). systemd fails such a unit before exec (exit 242, NUMA) with nothing in the role's log, after its predecessor
    was stopped. A host without that folder (a kernel without NUMA) is not checked. Then the CPUs each role is pinned
    to (:func:`_numa_cpus_missing`). Raises :class:`ApplyFailed` naming each spec field, its node and the nodes the
    host has (or the CPUs)."""
    base = "/sys/devices/system/node"
    from pdctl.statemachine.rules import _role_field

    missing: list[tuple[str, int, str]] = []
    numa = ctx.host.exists(base)  # (a kernel without NUMA: no node to check)
    for _name, kind, role in ctx.dep.roles():
        node, _cpus = numa_binding(ctx.dep, role)
        if numa and node is not None and not ctx.host.exists(f"{base}/node{node}"):
            field = (f"{_role_field(ctx.dep, role)}.numa_node" if role.numa_node is not None
                     else f"hosts.{role.host}.gpu_numa")
            missing.append((field, node, f"{kind}_up"))
    if missing:
        try:
            online = ctx.host.read_file(f"{base}/online").decode().strip()
        except Exception:  # noqa: BLE001 - the nodes it has are a courtesy in the message
            online = "?"
        said = "; ".join(f"{field} = {node}" for field, node, _ in missing)
        raise ApplyFailed(
            f"NUMA node(s) the host {ctx.host.name} does not have (its nodes: {online}), nothing was started or "
            f"changed: {said}",
            step=missing[0][2],
            hint=f"write a node the host has ({online}; `lscpu` or /sys/devices/system/node lists them), or leave "
                 "numa_node unset to bind none",
        )
    _numa_cpus_missing(ctx)


def _numa_cpus_missing(ctx: Context) -> None:
    """The CPUs each role's unit is pinned to (``CPUAffinity=``; the process supervisor's ``sched_setaffinity(2)``),
    ``hosts.<h>.numa_cpus`` of its node, must all be CPUs the host has (``/sys/devices/system/cpu/online``). None of
    them there: systemd fails the unit before exec (exit 214, CPUAFFINITY) after its predecessor was stopped; some:
    the kernel pins the role to the rest, away from its GPUs' node, with nothing said. Raises :class:`ApplyFailed`
    naming each field, the CPUs the host lacks and those it has. A host without that file is not checked."""
    from pdctl.units import cpu_list, cpu_set

    try:
        online_text = ctx.host.read_file("/sys/devices/system/cpu/online").decode().strip()
        online = cpu_set(online_text)
    except Exception:  # noqa: BLE001 - a host that does not say which CPUs it has is not checked
        return
    lacking: dict[str, tuple[str, set[int], str]] = {}  # field -> (CPU list, CPUs the host lacks, first step)
    for _name, kind, role in ctx.dep.roles():
        node, cpus = numa_binding(ctx.dep, role)
        if node is None or not cpus:
            continue
        gone = cpu_set(cpus) - online
        field = f"hosts.{role.host}.numa_cpus.{node}"
        if gone and field not in lacking:
            lacking[field] = (cpus, gone, f"{kind}_up")
    if not lacking:
        return
    said = "; ".join(f'{field} = "{cpus}" (lacks {cpu_list(",".join(map(str, gone)))})'
                     for field, (cpus, gone, _s) in lacking.items())
    raise ApplyFailed(
        f"CPUs the host {ctx.host.name} does not have (its CPUs: {online_text}), nothing was started or changed: "
        f"{said}",
        step=next(iter(lacking.values()))[2],
        hint="write each node's CPUs as the host has them (/sys/devices/system/node/node<N>/cpulist), or use "
             'inventory = "discover" to read them from the host',
    )


def bind_addresses_unusable(ctx: Context) -> None:
    """Before anything starts or stops: every bind address of *ctx*'s topology (each role's ``http_host``, the
    router's host and metrics host) must resolve on the deployment's host and be bindable there, as the server's
    own bind will need (a typo such as ``127.0.0.l`` passes the spec as a host name; the server then fails after its
    predecessor was stopped). One command on the host with the engine Python, which must exist there too, and with
    the process supervisor (``service_manager = "process"``) import pdctl's watchdog there, which it runs. Raises
    :class:`ApplyFailed` naming each field and why; a host where the probe cannot run at all is left to the steps."""
    from pdctl.statemachine.launch import python_for, scope_for

    from pdctl.statemachine.rules import _role_field

    topo = ctx.topology
    field_of = {name: _role_field(ctx.dep, role) for name, _kind, role in ctx.dep.roles()}  # prefill[0]
    where: dict[str, list[tuple[str, str]]] = {}  # address -> [(spec field, step)]
    for r in topo.roles:
        where.setdefault(r.http_host, []).append((f"{field_of.get(r.name, r.name)}.http_host", f"{r.kind}_up"))
    if topo.router is not None:
        where.setdefault(topo.router.host, []).append(("router.host", "router_exposed"))
        prom = str(topo.router.settings.get("prometheus_host") or "")
        if prom:
            where.setdefault(prom, []).append(("router.prometheus_host", "router_exposed"))
    python = python_for(ctx.dep)
    first = topo.roles[0]  # (the step an unusable interpreter or supervisor folder would fail at)
    watchdogs = scope_for(ctx.dep) == "process"
    supervisor = getattr(ctx.manager, "state_dir", None) if watchdogs else None  # (ProcessSupervisor's folder)
    try:
        res = ctx.host.run([python, "-c", (_watchdog_probe(supervisor) if watchdogs else "") + _BIND_PROBE, *where],
                           timeout=30, check=False)
        bad = json.loads(res.stdout) if res.ok else {}
    except (OSError, ValueError) as exc:
        res, bad = None, {}
        why = getattr(exc, "message", None) or str(exc)
    else:
        why = (res.stderr or res.stdout).strip()[-300:]
    if res is None or res.returncode in (126, 127):  # the units' interpreter cannot run: every role would fail
        try:  # (the rules refuse a relative engine.python; pdctl's own interpreter is absolute)
            missing = ctx.dep.engine.python is not None and not ctx.host.exists(python)
        except OSError:
            missing = False
        if missing or (res is not None and res.returncode in (126, 127)):
            raise ApplyFailed(
                f"engine.python = {python!r} " + ("does not exist" if missing else "cannot run") + f" on host "
                f"{ctx.host.name} ({why or 'exit ' + str(res.returncode if res else '?')}), nothing was started or "
                "changed",
                step=f"{first.kind}_up",
                hint="write the Python of the SGLang environment on that host (e.g. /opt/sglang/.venv/bin/python: "
                     "`which python` inside it says)",
            )
        return
    if res.returncode == 98:  # (_watchdog_probe: the supervisor's state folder cannot be written on the host)
        raise ApplyFailed(
            f"the process supervisor keeps its state in {supervisor} on host {ctx.host.name} (under the state "
            f"directory's path, on that host too), and {why or 'that folder'} cannot be written there; nothing was "
            "started or changed",
            step=f"{first.kind}_up",
            hint=f"give --state-dir (or PDCTL_STATE_DIR / XDG_STATE_HOME) a path this user can write both here and on "
                 f"host {ctx.host.name}, or use service_manager = \"systemd-system\" or \"systemd-user\"",
        )
    if res.returncode == 97:  # (_watchdog_probe: the process supervisor's watchdogs could not start on the host)
        which = (f"engine.python = {python!r}" if ctx.dep.engine.python
                 else f"pdctl's Python {python} (engine.python unset)")
        raise ApplyFailed(
            f"{which} cannot import pdctl on host {ctx.host.name} ({why}), and the process supervisor's watchdogs run "
            "on it (service_manager = \"process\"); nothing was started or changed",
            step=f"{first.kind}_up",
            hint=f"install pdctl into that environment on the host ({python} -m pip install pdctl), set engine.python "
                 "to a Python that has it, or use service_manager = \"systemd-system\" or \"systemd-user\"",
        )
    if bad:
        said = "; ".join(f"{what} = {addr!r} {why}" for addr, why in bad.items() for what, _step in where[addr])
        raise ApplyFailed(
            f"bind addresses unusable, nothing was started or changed: {said}",
            step=where[next(iter(bad))][0][1],
            hint="write an address this host has (ip addr lists them), 127.0.0.1, or 0.0.0.0 / :: for every interface",
        )


def unit_files_unrenderable(ctx: Context) -> None:
    """Before anything starts or stops: under systemd, every unit file this apply may write must render. A path
    systemd would not read back as one (the secrets' ``EnvironmentFile=`` or a log's ``StandardOutput=append:``
    under a state directory whose path holds a space or a quote) raises :class:`ApplyFailed` at the first step,
    naming the path and the fix, instead of a ValueError from the step that installs it after others ran."""
    refusal = unit_files_refusal(ctx.units, getattr(ctx.manager, "scope", None), ctx.topology.roles[0].kind + "_up")
    if refusal is not None:
        raise refusal


def recorded_service_manager(state: Any) -> str | None:
    """The ``service_manager`` the journal's unfinished target, else its recorded deployment, was applied with (None:
    nothing recorded)."""
    topo = (state.target or state.deployed) if state is not None else None
    return None if topo is None else topo.deployment.get("service_manager")


def service_manager_changed(ctx: Context) -> None:
    """Before anything starts or stops: the journal must not record the deployment applied under another
    ``service_manager`` than the spec names. pdctl does not move running units between service managers: the new one
    would start servers whose ports and GPUs the old one's still hold, and apply refused that only at its port check,
    calling them "this deployment's own processes, applied another way" after the plan had offered the change as a
    restart. Raises :class:`ApplyFailed` naming both and the fix (``pdctl down``, which stops them under the
    recorded one)."""
    from pdctl.statemachine.machine import role_steps

    was = recorded_service_manager(ctx.journal_state)
    if was in (None, ctx.dep.service_manager):
        return
    raise ApplyFailed(
        f"service_manager: deployment {ctx.dep.name!r} runs under {was} (as recorded) and the spec asks "
        f"{ctx.dep.service_manager}: pdctl does not move running units between service managers; nothing was started "
        "or changed",
        step=next(iter(role_steps(ctx.topology).values())),
        hint=f"run `pdctl down` on this spec first (it stops them under {was}, as recorded), then apply it")


def units_of_another_deployment(ctx: Context) -> None:
    """Before anything starts or stops: no unit this deployment names may be installed already by another pdctl
    deployment. Unit names are ``pdctl-NAME-ROLE``, so deployment ``hX`` with a role ``a-prefill`` names
    ``hX-a``'s prefill unit: under systemd (one unit folder for all) apply took that unit over, restarting the other
    deployment's server with its own settings, and its ``down`` removed it. Raises :class:`ApplyFailed` naming each
    unit and its deployment, at the first step that would install one."""
    from pdctl.statemachine.machine import role_steps

    step_of = role_steps(ctx.topology)
    taken = [(role, unit, owner) for role, unit in ctx.unit_of.items()
             if (owner := ctx.manager.installed_deployment(unit)) is not None and owner != ctx.dep.name]
    if not taken:
        return
    from pdctl.units import OTHER_DEPLOYMENT_HINT

    said = "; ".join(f"{unit} (role {role}) is deployment {owner!r}'s" for role, unit, owner in taken)
    order = list(step_of.values())
    raise ApplyFailed(
        f"unit names another pdctl deployment has installed, nothing was started or changed: {said}",
        step=min((step_of[role] for role, _u, _o in taken), key=order.index), hint=OTHER_DEPLOYMENT_HINT)


def unit_files_not_pdctls(ctx: Context) -> None:
    """Before anything starts or stops: no unit file of this deployment may be there without being one pdctl wrote
    (:meth:`~pdctl.units.ServiceManager.unit_file_not_pdctls`: damaged, or written by hand), which its step's install
    would refuse to overwrite after apply had stopped what the unit ran. Raises :class:`ApplyFailed` naming each, at
    the first step that would install one."""
    from pdctl.statemachine.machine import role_steps

    step_of = role_steps(ctx.topology)
    bad = [(role, path) for role, unit in ctx.unit_of.items() if (path := ctx.manager.unit_file_not_pdctls(unit))]
    if not bad:
        return
    order = list(step_of.values())
    raise ApplyFailed(
        "unit files that pdctl did not write as they stand (damaged, or written by hand), nothing was started or "
        "changed: " + "; ".join(f"{path} (role {role})" for role, path in bad),
        step=min((step_of[role] for role, _p in bad), key=order.index),
        hint="restore each from a backup, or move it aside (mv FILE FILE.bad) and apply again: apply then stops what "
             "the unit still runs, found by its watchdog, and installs the unit anew")


def unit_files_refusal(units, scope: str | None, step: str) -> ApplyFailed | None:  # noqa: ANN001
    """:func:`unit_files_unrenderable`'s refusal (journalled at *step*) of *units* under *scope* (``"system"``,
    ``"user"``; anything else writes no unit files), or None where every file renders; for ``pdctl plan`` too."""
    from pdctl.units import unit_files

    if scope not in ("system", "user"):  # (the process supervisor writes no unit files)
        return None
    try:
        unit_files(units, scope=scope)
    except ValueError as exc:
        return ApplyFailed(f"a unit file cannot be written: {exc}; nothing was started or changed", step=step,
                           hint="give --state-dir (or PDCTL_STATE_DIR / XDG_STATE_HOME) a path without spaces, quotes "
                                "or backslashes: the units' secrets and log files are kept under it")
    return None


def router_executable_unusable(ctx: Context) -> None:
    """Before anything starts or stops: the router's executable (``router.executable``, else smg beside pdctl's Python)
    must be an executable file on the deployment's host; otherwise the router step would stop the running router and
    then fail to exec its successor. Raises :class:`ApplyFailed` at router_exposed; a host where ``test`` cannot run
    is left to the step."""
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.launch import router_executable

    if ctx.topology.router is None or ctx.dep.router_impl == "sglang-router":  # (sglang-router runs engine.python)
        return
    named = bool(ctx.dep.router and ctx.dep.router.executable)
    try:
        exe = router_executable(ctx.dep)
    except PdctlError as exc:  # a bare name not on PATH where pdctl runs
        raise ApplyFailed(f"{exc.message}, nothing was started or changed", step="router_exposed", hint=exc.hint) from None
    try:
        res = ctx.host.run(["test", "-f", exe, "-a", "-x", exe], timeout=30, check=False)  # (a directory is -x too)
    except OSError:
        return
    if res.returncode == 1:  # (test's "false"; 126/127 would be the host's shell, left to the step)
        what = f"router.executable = {exe!r}" if named else f"the router executable {exe} (router.executable unset)"
        raise ApplyFailed(
            f"{what} is not an executable file on host {ctx.host.name}, nothing was started or changed",
            step="router_exposed",
            hint="write the absolute path of smg on that host in router.executable (e.g. the venv's bin/smg), or "
                 "install smg there",
        )


def _visible_gpus(ctx: Context, pid: int) -> set[int]:
    """The GPUs process *pid* runs on, as its ``CUDA_VISIBLE_DEVICES`` names them (pdctl's launch sets it to the
    role's physical ids: ``units/_argv.py``); empty when unreadable or unset."""
    try:
        environ = ctx.host.read_file(f"/proc/{pid}/environ").decode(errors="replace")
    except OSError:
        return set()
    for entry in environ.split("\0"):
        if entry.startswith("CUDA_VISIBLE_DEVICES="):
            return {int(g) for g in entry.split("=", 1)[1].split(",") if g.strip().isdigit()}
    return set()


def _vacate_for(ctx: Context, role: RoleTopology) -> None:
    """Stop the deployment's other units that hold one of *role*'s ports or run on one of its GPUs and are themselves
    (re)started later in this apply (their settings changed): two roles swapping ports would otherwise each find its
    new port taken by the other, and a role moved onto GPUs another role leaves (a swap, or prefill growing from 4
    to 6 GPUs while decode moves from 4-7 to 6-7) would load next to that role's server, which SGLang does not
    survive (the memory it sizes its KV cache from is taken). A holder whose role does not change is left alone (the
    preflight then names a port it holds; the rules refuse two roles on one GPU)."""
    mine = ctx.unit_of[role.name]
    changing = [unit for name, unit in ctx.unit_of.items()
                if unit != mine and (name in ctx.restart or ctx.definition_changed(unit))]
    holders = [(unit, pid) for unit in changing if (pid := ctx.manager.status(unit).main_pid)]
    if not holders:
        return  # the usual case: no socket scan
    stopped: set[str] = set()

    def stop(unit: str, why: str) -> None:
        if unit not in stopped:
            stopped.add(unit)
            ctx.say(f"stopping {unit} first: {why}; its own step starts it again", step=role_steps(ctx.topology).get(
                role.name), unit=unit)
            ctx.forget(unit)  # from here on its step must start it again, never skip it as proven
            ctx.restarting_now.add(unit)  # (down until its step starts it: an interruption says so)
            ctx.manager.stop(unit)

    for lst in ports.listeners(ctx.host, set(_role_ports(role))):
        for unit, pid in holders:
            if lst.pid is not None and ports.is_descendant(ctx.host, lst.pid, pid):
                stop(unit, f"it holds port {lst.port}, which {role.name} will listen on")
    for unit, pid in holders:
        shared = _visible_gpus(ctx, pid) & set(role.gpus)
        if shared:
            stop(unit, f"it runs on GPU {','.join(map(str, sorted(shared)))}, which {role.name} will use")


def _check_owner(ctx: Context, name: str, unit: str, port: int, main_pid: int | None, step: str,
                 bind: str | None) -> None:
    """The process answering on *port* at *bind* (the server's bind address, :func:`ports.bind_address`) must be
    *unit*'s own (main PID or a descendant); one on another specific address of the port answers other clients."""
    ok, ls = ports.listener_belongs(ctx.host, port, main_pid, bind=bind)
    if not ok:
        who = _describe(ls) if ls else f"nobody listens on port {port}"
        raise UnmendableFault(
            f"{name}: {unit} (main PID {main_pid}) does not hold its port: {who}",
            kind="port",
            step=step,
            hint="another process answers in its place: stop it, or move this role to free ports",
        )


_MODE = {"prefill": "prefill", "decode": "decode", "server": "null"}


def expected_server_info(role: RoleTopology, topo: Topology) -> dict[str, Any]:
    """What ``/server_info`` must show for *role* (keys as SGLang 0.5.23 names them)."""
    s = role.settings
    model, parsers = s["model"], s["parsers"]
    exp: dict[str, Any] = {
        "disaggregation_mode": _MODE[role.kind],
        "tp_size": role.tp,
        "model_path": model["path"],
        "reasoning_parser": parsers["reasoning_parser"],
        "tool_call_parser": parsers["tool_call_parser"],
        "chat_template": parsers["chat_template"],
        "port": role.port,
    }
    if model.get("served_name"):
        exp["served_model_name"] = model["served_name"]
    if model.get("context_length"):
        exp["context_length"] = model["context_length"]
    if s.get("mem_fraction") is not None:
        exp["mem_fraction_static"] = s["mem_fraction"]
    if model.get("page_size") is not None:
        exp["page_size"] = model["page_size"]
    if model.get("kv_cache_dtype") not in (None, "auto"):
        exp["kv_cache_dtype"] = model["kv_cache_dtype"]
    if role.kind == "prefill":
        exp["disaggregation_bootstrap_port"] = role.bootstrap_port
    if role.kind in ("prefill", "decode") and topo.kv_link is not None:
        # "mooncake_tcp" is mooncake with MC_FORCE_TCP=1: SGLang rewrites the argument to "mooncake" before it
        # serves it (0.5.23 arg_groups/pd_disaggregation_hook.py, handle_pd_disaggregation)
        backend = topo.kv_link.backend
        exp["disaggregation_transfer_backend"] = "mooncake" if backend == "mooncake_tcp" else backend
    return exp


_SAME_VALUE = {"kv_cache_dtype": {"bf16": "bfloat16"}, "tool_call_parser": {"qwen25": "qwen", "glm45": "glm"},
               "disaggregation_transfer_backend": {"mooncake_tcp": "mooncake"}}
"""Aliases SGLang may report either way: the DeepSeek DSA override normalises ``bf16`` to ``bfloat16``
(0.5.23 ``arg_groups/overrides.py``, ``_dsa_kv_cache_dtype_default``; other models keep what was passed),
``_handle_deprecated_args`` rewrites the deprecated tool-call parsers ``qwen25`` and ``glm45`` (0.5.23; 0.5.6 kept
them), and ``handle_pd_disaggregation`` rewrites ``mooncake_tcp`` to ``mooncake`` (the upstream source; the shared
reference only says it sets ``MC_FORCE_TCP=1``). Either word passes; any other value is a mismatch."""


def _facts(topo: Topology) -> SglangFacts:
    """The target release's facts (the rules refused an unknown release before any step ran)."""
    return facts_for(topo.deployment.get("sglang_version", DEFAULT_SGLANG_VERSION))


def server_info_mismatches(info: dict[str, Any], exp: dict[str, Any]) -> list[str]:
    out = []
    for k, v in exp.items():
        alias = _SAME_VALUE.get(k, {})
        if alias.get(info.get(k), info.get(k)) != alias.get(v, v):
            out.append(f"{k} is {info.get(k)!r}, expected {v!r}")
    return out


def runs_as_service_user(ctx: Context, what: str, pid: int | None, step: str) -> list[str]:
    """With ``service_user`` set: the check line that *what*'s main process *pid* runs as that account (its effective
    UID, proc(5) ``/proc/PID/status`` ``Uid:``, against ``id -u`` on the host), else ``[]``. Raises
    :class:`VerifyFailed` when it runs as another (a unit file edited by hand, a manager that ignored ``User=``) or
    cannot be read."""
    user = ctx.dep.service_user
    if user is None or pid is None:
        return []
    try:
        uid = ctx.host.run(["id", "-u", user], timeout=30, check=False).stdout.strip()
        status = ctx.host.read_file(f"/proc/{pid}/status").decode(errors="replace")
    except OSError as exc:
        raise VerifyFailed(f"{what}: cannot tell which account main PID {pid} runs as: {exc}", step=step) from None
    runs = next((line.split()[2] for line in status.splitlines() if line.startswith("Uid:")), "?")
    if runs != uid:
        raise VerifyFailed(f"{what}: main PID {pid} runs as UID {runs}, not as service_user = {user!r} "
                           f"(UID {uid or '?'})", step=step)
    return [f"main PID {pid} runs as {user} (UID {uid})"]


class ServersUp(Step):
    """``prefill_up`` / ``decode_up`` / ``server_up``: the role's units run and serve as specified."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name
        self.hint = (
            f"read the {kind} log (the error quotes its last lines; more of them: `pdctl logs SPEC ROLE -n 500`, "
            "the console's logs panel, or under systemd `journalctl [--user] -u UNIT`); check the GPUs are free, the "
            "model path exists and the ports are not taken"
        )

    def _roles(self, ctx: Context) -> list[RoleTopology]:
        return ctx.topology.roles_of(self.kind)

    def _proof_for(self, ctx: Context, role: RoleTopology) -> tuple[list[str], dict[str, Any]]:
        unit = ctx.unit_of[role.name]
        st = ctx.manager.status(unit)
        if not st.is_active:
            raise VerifyFailed(f"{role.name}: unit {unit} is {st.state}", step=self.name)
        if not st.supervised:  # serving, but a crash would not be restarted: apply restarts it under supervision
            raise VerifyFailed(f"{role.name}: unit {unit} runs unsupervised (its supervisor is "
                               f"{unsupervised_reason(st.sub_state)})", step=self.name)
        if process_stopped(ctx.host, st.main_pid):  # (its probes would each wait out their timeout for nothing)
            raise VerifyFailed(f"{role.name}: the main process of {unit} (PID {st.main_pid}) is stopped (kill -STOP?)",
                               step=self.name)
        code = probes.health(ctx.client, role.url)
        if code != 200:
            raise VerifyFailed(f"{role.name}: GET {role.url}/health answered {code or 'nothing'}", step=self.name)
        _check_owner(ctx, role.name, unit, role.port, st.main_pid, self.name, ports.bind_address(role.http_host))
        info = probes.server_info(ctx.client, role.url)
        exp = expected_server_info(role, ctx.topology)
        bad = server_info_mismatches(info, exp)
        if bad:
            raise VerifyFailed(f"{role.name}: /server_info differs from the spec: " + "; ".join(bad), step=self.name)
        checks = [
            f"{unit} active (main PID {st.main_pid})",
            *runs_as_service_user(ctx, role.name, st.main_pid, self.name),
            f"port {role.port} is held by {unit}'s own process tree",
            f"GET {role.url}/health → 200",
            f"GET {role.url}/server_info matches {len(exp)} expected fields ({', '.join(sorted(exp))})",
        ]
        evidence = {"unit": unit, "main_pid": st.main_pid, "server_info": {k: info.get(k) for k in sorted(exp)}, "version": info.get("version")}
        return checks, evidence

    def owned_units(self, ctx: Context) -> list[str]:
        return [ctx.unit_of[r.name] for r in self._roles(ctx)]

    def observe(self, ctx: Context) -> Proof | None:
        roles = self._roles(ctx)
        if any(r.name in ctx.restart or ctx.definition_changed(ctx.unit_of[r.name]) or ctx.file_edited(ctx.unit_of[r.name])
               for r in roles):
            return None
        checks: list[str] = []
        evidence: dict[str, Any] = {}
        try:
            for r in roles:
                c, e = self._proof_for(ctx, r)
                checks += c
                evidence[r.name] = e
        except (VerifyFailed, ProbeError):
            return None
        return Proof(f"{', '.join(r.name for r in roles)} already up as specified", tuple(checks), evidence)

    def apply(self, ctx: Context) -> None:
        roles = self._roles(ctx)
        actions: dict[str, str | None] = {}
        pids: dict[str, int | None] = {}
        was: dict[str, str] = {}
        for r in roles:
            unit = ctx.unit_of[r.name]
            st = ctx.manager.status(unit)
            pids[unit] = st.main_pid
            was[unit] = st.state
            running = st.state in ("active", "activating")
            # Nothing starts while a process outside this unit holds one of its ports (after stopping any of this
            # deployment's roles that hold one and are restarted later anyway, e.g. two roles swapping ports).
            _vacate_for(ctx, r)
            _preflight_ports(ctx, r.name, _role_ports(r), st.main_pid if running else None, self.name)
            # A server an interrupted apply started with the definition wanted now (journalled as started) is not
            # restarted again on resume: waited for while it loads, proven as it stands once loaded. Otherwise a role
            # the plan restarts, or whose definition changed, or that does not serve as specified, is restarted. A
            # unit whose supervisor is gone is never waited for (nothing would mark it active): it is restarted.
            recorded = ctx.journal_state.units.get(unit)
            fp = ctx.fingerprint(unit)
            serves = self._serves_as_specified(ctx, r)
            # (a role the plan restarts has its files written anew anyway: a rotated secret changes its secrets file
            # and not its definition, which is no edit outside pdctl)
            if running and recorded == fp and r.name not in ctx.restart and ctx.file_edited(unit):
                ctx.say(f"{unit}'s unit file differs from what pdctl writes (edited outside pdctl?): writing it back"
                        + ("" if serves else " and restarting it: it does not serve as specified"),
                        step=self.name, unit=unit)
            if (recorded or "").startswith(RESTARTING) and running_definition(recorded, st.main_pid) == fp \
                    and r.name not in ctx.asked:  # (asked: the very process to restart, which the interruption spared)
                recorded = STARTED + fp  # (file rewritten for another spec, the process runs this one: install_units)
            ours = recorded == STARTED + fp and st.supervised
            stale = not serves or (
                not ours and (r.name in ctx.restart or ctx.definition_changed(unit)))
            # (a unit between restarts after its server exited, "activating (auto-restart)", loads nothing: waiting on
            # it only watched it fail again until its start limit; it is restarted)
            loading = st.state == "activating" and st.sub_state != "auto-restart" and st.supervised and (
                ours or (r.name not in ctx.restart and (recorded is None or recorded == fp)))
            actions[unit] = ("wait" if loading else "restart" if stale else None) if running else "start"
        # restarted below: a kill before it must not leave the unit looking like a server loading what is wanted
        ctx.mark_restarting(*[unit for unit, action in actions.items() if action == "restart"], main_pids=pids)
        for unit, action in actions.items():
            if action == "start":  # a kill from here on must never let observe skip this unit as proven
                ctx.forget(unit)
        changed = ctx.install_units(actions)  # (journals any running unit whose definition it changes as restarting)
        rotated: set[str] = set()
        by_unit = {ctx.unit_of[r.name]: r for r in roles}
        for unit, action in actions.items():
            if action in (None, "wait") and unit in changed:
                action = "restart"
                actions[unit] = action
            if action == "wait":
                ctx.say(f"{unit} is still starting with the definition this apply wants: waiting for it, not "
                        "restarting it", step=self.name, unit=unit)
            elif action == "restart" and self._in_rotation(ctx, by_unit[unit]):
                self._restart_in_rotation(ctx, by_unit[unit])  # (one at a time: a replica serves while one restarts)
                rotated.add(unit)
            elif action == "restart":
                ctx.restart_unit(unit, step=self.name)
            elif action == "start":
                # (said as a restart is: a unit this apply stopped for another role, or a failed one, starts again)
                ctx.say(f"starting {unit}" + (f" (it was {was[unit]})" if was[unit] != "inactive" else ""),
                        step=self.name, unit=unit)
                # journalled before the start: a kill between the two left a server loading what is wanted journalled
                # as nothing, which the next plan called new and its apply restarted, a model load thrown away. (A kill
                # before the start leaves the unit not running: the next apply starts it, whatever the record says.)
                ctx.started(unit)
                ctx.manager.start(unit)
        for r in roles:
            if ctx.unit_of[r.name] not in rotated:
                self._wait_healthy(ctx, r, waited=actions[ctx.unit_of[r.name]] == "wait")

    def _in_rotation(self, ctx: Context, role: RoleTopology) -> bool:
        """Whether *role* is restarted as a coordinated operation on the router: a router runs in front that this
        apply keeps as it runs (its definition unchanged, no restart asked) and lists the role as a worker."""
        r = ctx.topology.router
        unit = ctx.unit_of.get("router")
        if r is None or unit is None or "router" in ctx.restart or ctx.definition_changed(unit):
            return False
        if not ctx.manager.status(unit).is_active:
            return False
        try:
            return serving.listed(ctx.client, r.url, role.url) is not None
        except ProbeError:
            return False

    def _restart_in_rotation(self, ctx: Context, role: RoleTopology) -> None:
        """Restart *role* without sending clients to it meanwhile: take it out of the router (its requests finish
        first, bounded by ``Timeouts.drain``), restart it, prove it healthy, prove the KV link again from it to each
        peer of the other side with a paired request, put it back, and wait until the router serves it (listed
        healthy, circuit closed). Replicas are restarted one at a time, so that a second one serves throughout."""
        unit = ctx.unit_of[role.name]
        router_url = ctx.router_url()
        ctx.say(f"taking {role.name} out of the router before its restart (its requests finish first, up to "
                f"{ctx.timeouts.drain:g} s)", step=self.name, unit=unit)
        try:
            gone = serving.drain(ctx.client, router_url, role.url, bound_s=ctx.timeouts.drain,
                                 checkpoint=ctx.checkpoint)
            if not gone:
                ctx.say(f"{role.name} still had requests after {ctx.timeouts.drain:g} s: restarting it all the same",
                        step=self.name, unit=unit)
        except ProbeError as exc:
            ctx.say(f"could not take {role.name} out of the router ({exc}): restarting it in place", step=self.name,
                    unit=unit)
        ctx.restart_unit(unit, step=self.name)
        self._wait_healthy(ctx, role)
        for check in KVLinkVerified().prove_role(ctx, role):
            ctx.say(f"{role.name}: {check}", step=self.name, unit=unit)
        kind, bport = serving.worker_kinds(ctx.topology).get(role.url.rstrip("/"), (role.kind, None))
        try:
            why = serving.admit(ctx.client, router_url, ctx.topology, role.url, kind, bport,
                                bound_s=RouterExposed()._bound(ctx), checkpoint=ctx.checkpoint)
        except ProbeError as exc:
            why = str(exc)
        if why:
            raise VerifyFailed(f"{role.name} restarted and proven, but not served again: {why}", step=self.name,
                               hint="read the router log (`pdctl logs SPEC router`); `pdctl apply` again re-admits it")
        ctx.say(f"{role.name} is back in the router and served (circuit closed)", step=self.name, unit=unit)

    def _serves_as_specified(self, ctx: Context, role: RoleTopology) -> bool:
        try:
            self._proof_for(ctx, role)
            return True
        except (VerifyFailed, ProbeError):
            return False

    def _wait_healthy(self, ctx: Context, role: RoleTopology, *, waited: bool = False) -> None:
        """Wait for *role* active and healthy. *waited*: its unit was found starting (an interrupted apply's) and is
        waited for, not started by this apply: if its supervisor then turns out never to have come up (the apply
        that spawned it was cut, e.g. its SSH connection lost, before the watchdog ran), it is started once here."""
        unit = ctx.unit_of[role.name]
        bound = role.settings.get("expected_cold_start_s") or ctx.timeouts.role_start
        retry = [waited]
        t0 = time.monotonic()
        said = [t0]

        def ready() -> bool | None:
            if time.monotonic() - said[0] >= ctx.timeouts.progress:
                said[0] = time.monotonic()
                _say_loading(ctx, self.name, role, unit, said[0] - t0, bound)
            st = ctx.manager.status(unit)
            if st.state == "failed" and st.sub_state == "watchdog-gone" and retry[0]:
                retry[0] = False
                ctx.say(f"{unit} was still being spawned by an apply that did not finish, but its supervisor never came "
                        "up: starting it", step=self.name, unit=unit)
                ctx.manager.start(unit)
                ctx.started(unit)
                return None
            if st.state == "failed":
                msg = startup_failure(f"{role.name}: unit {unit}", ctx.manager.logs(unit, lines=15))
                raise ApplyFailed(msg, step=self.name, hint=startup_hint(msg))
            if st.sub_state == "auto-restart":  # (crashed while starting: restarted after RestartSec)
                _port_taken_while_starting(ctx, role, unit, self.name)
            if not st.supervised:  # its supervisor died or stopped: the unit would read "activating" until the bound
                stopped = st.sub_state == SUPERVISOR_STOPPED
                raise ApplyFailed(
                    f"{role.name}: the supervisor of {unit} is {unsupervised_reason(st.sub_state)} while it started "
                    f"(server PID {st.main_pid} runs unwatched)",
                    step=self.name,
                    hint=("continue it (`kill -CONT` the PID in the unit's watchdog.pid) or apply again, which "
                          "restarts the role under a new supervisor") if stopped else
                         ("check the state directory's disk is not full and read the unit's supervise.log; "
                          "apply again restarts the role under a new supervisor"))
            if not st.is_active:  # the manager's readiness gate has not passed yet
                return None
            return True if probes.health(ctx.client, role.url, timeout=2.0) == 200 else None

        try:
            _wait(f"{role.name} active and healthy at {role.url}/health", bound, ready, poll=ctx.timeouts.poll,
                  step=self.name, checkpoint=ctx.checkpoint)
        except StepTimeout as exc:
            logs = "\n    ".join(ctx.manager.logs(unit, lines=10))
            raise StepTimeout(
                f"{exc.message}; the unit stays as it is. Last log lines:\n    {logs}",
                step=self.name,
                hint=f"raise expected_cold_start_s for {role.name} if the model loads slowly; otherwise read its logs",
            ) from None

    def verify(self, ctx: Context) -> Proof:
        checks: list[str] = []
        evidence: dict[str, Any] = {}
        for r in self._roles(ctx):
            c, e = self._proof_for(ctx, r)
            checks += c
            evidence[r.name] = e
        return Proof(f"{', '.join(r.name for r in self._roles(ctx))} up: active, healthy, /server_info as specified", tuple(checks), evidence)

    def undo(self, ctx: Context) -> None:
        for r in self._roles(ctx):
            ctx.manager.stop(ctx.unit_of[r.name])


# --- kernels -------------------------------------------------------------------------------------


class KernelsBuilt(Step):
    name = "kernels_built"
    hint = "build on the GPU host: python -m pdctl.kernels build --cache-dir DIR; or set [kernels] enabled = false"

    def observe(self, ctx: Context) -> Proof | None:
        if not ctx.dep.kernels.enabled:
            return Proof("skipped: disabled in spec", ("kernels.enabled = false",), not_needed=True)
        return None

    def apply(self, ctx: Context) -> None:
        if not ctx.kernels_command:
            raise ApplyFailed("kernels are enabled but no build command is known for this host", step=self.name)
        res = ctx.host.run(ctx.kernels_command, timeout=ctx.timeouts.kernels_build, check=False)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-8:]
            raise ApplyFailed(
                f"kernel build failed (exit {res.returncode}): " + " | ".join(tail),
                step=self.name,
                hint=self.hint,
            )

    def verify(self, ctx: Context) -> Proof:
        if not ctx.kernels_manifest:
            raise VerifyFailed("no manifest path", step=self.name)
        try:
            manifest = json.loads(ctx.host.read_file(ctx.kernels_manifest))
        except (OSError, ValueError) as exc:
            raise VerifyFailed(f"kernel manifest {ctx.kernels_manifest} unreadable: {exc}", step=self.name) from None
        if not manifest.get("ok", False):
            raise VerifyFailed(f"kernel manifest says verification failed: {manifest.get('errors')}", step=self.name)
        gpu = manifest.get("gpu", {})
        return Proof(
            f"kernels built and verified on {gpu.get('name', '?')} ({gpu.get('capability', '?')}, "
            f"{gpu.get('sm_count', '?')} SMs)",  # (the manifest's keys: pdctl.kernels._build, build_and_verify)
            (f"manifest {ctx.kernels_manifest}",),
            {"manifest": manifest},
            (" ".join(ctx.kernels_command or []),),
        )


# --- KV link -------------------------------------------------------------------------------------

_FAIL_COUNTERS = ("sglang:num_transfer_failed_reqs_total", "sglang:num_bootstrap_failed_reqs_total")


class KVLinkVerified(Step):
    name = "kv_link_verified"
    hint = (
        "check that decode reaches the prefill bootstrap (host, bootstrap port, firewall), that both sides use "
        "the same transfer backend, page size and kv-cache dtype, and UCX_NET_DEVICES / ib_device for NIXL/Mooncake"
    )

    def apply(self, ctx: Context) -> None:
        return None  # the link is configured by the roles; this step only proves it

    def _counters(self, ctx: Context, url: str) -> dict[str, float]:
        try:
            text = probes.metrics(ctx.client, f"{url}/metrics")
        except ProbeError:
            return {}
        return probes.parse_metric_totals(text, _FAIL_COUNTERS)

    def prove_pair(self, ctx: Context, p: RoleTopology, d: RoleTopology) -> tuple[list[str], dict[str, Any]]:
        """Prove the link from prefill *p* to decode *d*: the bootstrap ``/route`` reached from the decode side, then
        one paired request with one bootstrap room straight to both, decode's failure counters flat. Returns
        ``(checks, evidence)``; raises VerifyFailed."""
        topo = ctx.topology
        assert topo.kv_link is not None
        boot = {name: (h, port) for name, h, port in topo.kv_link.bootstrap}
        query = dict(_facts(topo).bootstrap_route_query)
        dinfo = probes.server_info(ctx.client, d.url)
        bhost, bport = boot[p.name]
        checks: list[str] = []

        # 1. The bootstrap /route, from the decode side (this host is the decode host here).
        def route() -> Any:
            status, body = probes.bootstrap_route(ctx.client, bhost, bport, timeout=3.0, query=query)
            return body if status == 200 else None

        try:
            body = _wait(f"bootstrap GET http://{bhost}:{bport}/route from {d.name}", ctx.timeouts.bootstrap, route,
                         poll=0.5, step=self.name, checkpoint=ctx.checkpoint)
        except StepTimeout as exc:
            raise VerifyFailed(f"{d.name} cannot use the bootstrap of {p.name} at {bhost}:{bport}: {exc.message}",
                               step=self.name, hint=self.hint) from None
        for k in ("page_size", "kv_cache_dtype"):
            if k in body and k in dinfo and body[k] != dinfo[k]:
                raise VerifyFailed(f"{p.name} registers {k}={body[k]!r} but {d.name} runs {k}={dinfo[k]!r}",
                                   step=self.name, hint=self.hint)
        checks.append(f"bootstrap http://{bhost}:{bport}/route → 200 from {d.name} (page_size "
                      f"{body.get('page_size')}, kv_cache_dtype {body.get('kv_cache_dtype')})")
        # 2. One paired request with one bootstrap room, straight to prefill and decode.
        before = self._counters(ctx, d.url)
        room = probes.new_bootstrap_room()
        t0 = time.monotonic()
        pr, dr = probes.paired_generate(ctx.client, p.url, d.url, bootstrap_host=bhost, bootstrap_port=bport,
                                        room=room, timeout=ctx.timeouts.kv_request)
        latency = time.monotonic() - t0
        if dr.status_code != 200:
            raise VerifyFailed(f"paired request (bootstrap_room {room}) failed on {d.name}: HTTP {dr.status_code}: "
                               f"{dr.text[:300]}", step=self.name, hint=self.hint)
        try:
            dtext = dr.json().get("text", "")
        except ValueError:
            dtext = ""
        if not dtext:
            raise VerifyFailed(f"paired request: {d.name} answered 200 with no text", step=self.name)
        after = self._counters(ctx, d.url)
        grew = {k: (before.get(k, 0.0), v) for k, v in after.items() if v > before.get(k, 0.0)}
        if grew:
            raise VerifyFailed(f"transfer-failure counters grew on {d.name}: {grew}", step=self.name, hint=self.hint)
        checks.append(f"paired /generate {p.name} → {d.name} with bootstrap_room {room}: prefill HTTP "
                      f"{pr.status_code}, decode HTTP 200 in {latency:.2f} s")
        checks.append(f"{d.name} failure counters flat: {after or 'n/a (no metrics)'}")
        return checks, {"prefill": p.name, "decode": d.name, "route": body, "bootstrap_room": room,
                        "decode_text": dtext[:120], "latency_s": round(latency, 3), "counters": after}

    def prove_role(self, ctx: Context, role: RoleTopology) -> list[str]:
        """:meth:`prove_pair` from a restarted *role* to each peer of the other side that answers ``/health`` (a
        restart of one side is proven from the other side too: a decode's cached bootstrap of a prefill that came
        back, a prefill whose decode came back on the same address). Its checks; none without a KV link."""
        topo = ctx.topology
        if topo.kv_link is None or role.kind not in ("prefill", "decode"):
            return []
        other = "decode" if role.kind == "prefill" else "prefill"
        checks: list[str] = []
        for peer in topo.roles_of(other):
            if probes.health(ctx.client, peer.url, timeout=2.0) != 200:
                continue
            p, d = (role, peer) if role.kind == "prefill" else (peer, role)
            checks += self.prove_pair(ctx, p, d)[0]
        return checks

    def verify(self, ctx: Context) -> Proof:
        topo = ctx.topology
        assert topo.kv_link is not None
        checks: list[str] = []
        evidence: dict[str, Any] = {"pairs": []}
        for d in topo.roles_of("decode"):
            for p in topo.roles_of("prefill"):
                c, e = self.prove_pair(ctx, p, d)
                checks += c
                evidence["pairs"].append(e)
        n = len(evidence["pairs"])
        return Proof("KV link proven: bootstrap reached from decode, paired request completed" if n == 1 else
                     f"KV link proven for {n} prefill-decode pairs: bootstrap reached from each decode, each paired "
                     "request completed", tuple(checks), evidence)


# --- router --------------------------------------------------------------------------------------


def router_mismatches(workers: list[probes.RouterWorker], stats: dict[str, Any], topo: Topology) -> list[str]:
    """Differences between the router's ``/workers`` and the topology (roles, counts, health, the model id each
    worker is registered under), in words."""
    return [text for text, _kind in router_faults(workers, stats, topo)]


def router_faults(workers: list[probes.RouterWorker], stats: dict[str, Any], topo: Topology) -> list[tuple[str, str | None]]:
    """:func:`router_mismatches` with each one's :class:`~pdctl.statemachine.errors.UnmendableFault` kind
    (``swapped``, ``model``), or None for one the router's health checks can mend (a worker not healthy yet,
    missing, or counted otherwise while it comes back)."""
    r = topo.router
    assert r is not None
    want: dict[str, tuple[str, int | None]] = {}
    for url, port in r.prefill:
        want[url.rstrip("/")] = ("prefill", port)
    for url in r.decode:
        want[url.rstrip("/")] = ("decode", None)
    for url in r.regular:
        want[url.rstrip("/")] = ("regular", None)
    model_ids = {role.url.rstrip("/"): role.served_model for role in topo.roles}
    bad: list[tuple[str, str | None]] = []
    seen = set()
    for w in workers:
        seen.add(w.url)
        exp = want.get(w.url)
        if exp is None:
            bad.append((f"unexpected worker {w.url} ({w.worker_type})", None))
            continue
        kind, port = exp
        if w.worker_type != kind:
            bad.append((f"{w.url} registered as {w.worker_type}, expected {kind}", None))
        mode = w.disaggregation_mode
        if mode is not None and kind in ("prefill", "decode") and mode != kind:
            bad.append((f"{w.url} is registered as {w.worker_type} but its server runs disaggregation_mode={mode} "
                        "(swapped roles?)", "swapped"))
        if kind == "prefill" and port is not None and w.bootstrap_port != port:
            bad.append((f"{w.url} bootstrap_port {w.bootstrap_port}, expected {port}", None))
        if not w.is_healthy:
            bad.append((f"{w.url} is not healthy", None))
        served = model_ids.get(w.url)
        if w.model_id not in (None, "", "unknown") and served and w.model_id != served:
            # registered before its server came back serving another name: requests for the new one find no worker
            bad.append((f"{w.url} is registered for model {w.model_id!r}, but its server serves {served!r}", "model"))
    for url in want.keys() - seen:
        bad.append((f"worker {url} ({want[url][0]}) missing", None))
    counts = {"prefill_count": len(r.prefill), "decode_count": len(r.decode)}
    for k, v in counts.items():
        if k in stats and stats[k] != v:
            bad.append((f"{k} = {stats[k]}, expected {v}", None))
    return bad


class RouterExposed(Step):
    name = "router_exposed"
    hint = "read the router log; check its --prefill/--decode URLs, that workers are reachable from it and its port is free"

    def owned_units(self, ctx: Context) -> list[str]:
        return [ctx.unit_of["router"]]

    def observe(self, ctx: Context) -> Proof | None:
        unit = ctx.unit_of["router"]
        if "router" in ctx.restart or ctx.definition_changed(unit) or ctx.file_edited(unit):
            return None
        try:
            st = ctx.manager.status(ctx.unit_of["router"])
            if not st.is_active or not st.supervised:
                return None
            return self._check(ctx)
        except (VerifyFailed, ProbeError):
            return None

    def _bound(self, ctx: Context) -> float:
        interval = ctx.topology.router.settings.get("health_check_interval_s", 10) if ctx.topology.router else 10
        return max(ctx.timeouts.router, 6 * float(interval))

    def apply(self, ctx: Context) -> None:
        unit = ctx.unit_of["router"]
        r = ctx.topology.router
        assert r is not None
        st = ctx.manager.status(unit)
        unchanged = ctx.journal_state.units.get(unit) in (ctx.fingerprint(unit), STARTED + ctx.fingerprint(unit))
        if st.state in ("active", "activating") and st.supervised and "router" not in ctx.restart and unchanged:
            if ctx.file_edited(unit):  # (edited outside pdctl: written back; the process is judged below as it serves)
                ctx.say(f"{unit}'s unit file differs from what pdctl writes (edited outside pdctl?): writing it back",
                        step=self.name, unit=unit)
                ctx.install_units([unit])
            # The same router, running (or still starting, as an interrupted apply started it): what it lacks is
            # workers this apply restarted, which its health checks bring back (the plan said it would not restart).
            # Wait for that, within verify's bound, before restarting it; a fault waiting cannot mend (another process
            # on its port, swapped roles) restarts it at once.
            class Unmendable(Exception):
                pass

            why: list[str] = []

            def sees_them() -> bool | None:
                try:
                    self._check(ctx)
                    return True
                except UnmendableFault as exc:
                    raise Unmendable from exc
                except (VerifyFailed, ProbeError) as exc:
                    why[:] = [str(exc)]
                    return None

            try:
                self._readmit_held_out(ctx)
                if not sees_them():
                    if process_stopped(ctx.host, st.main_pid):  # (kill -STOP, a debugger: no health check brings it back)
                        ctx.say(f"{unit} does not serve as proven and its main process (PID {st.main_pid}) is "
                                "stopped (kill -STOP?): restarting it", step=self.name, unit=unit)
                        raise Unmendable
                    bound = self._bound(ctx)
                    ctx.say(f"{unit} does not serve as proven ({why[0]}): waiting up to "
                            f"{bound:g} s for it to see its workers healthy before restarting it", step=self.name,
                            unit=unit)
                    _wait("router seeing its workers healthy again", bound, sees_them, poll=0.5,
                          step=self.name, checkpoint=ctx.checkpoint)
                workers = ("its restarted workers healthy again" if set(ctx.restart) - {"router"}
                           else "its workers healthy")  # (a resumed first deployment restarted none)
                ctx.say(f"{unit} unchanged: it sees {workers}, not restarted", step=self.name, unit=unit)
                return
            except (StepTimeout, Unmendable):
                pass  # restarted below, as any router that does not serve as proven
        wanted = _router_ports(r)
        _preflight_ports(ctx, "router", wanted, st.main_pid if st.state in ("active", "activating") else None, self.name)
        ctx.forget(unit)
        ctx.install_units([unit])
        st = ctx.manager.status(unit)
        if st.state in ("active", "activating"):
            ctx.restart_unit(unit, step=self.name)
        else:
            # (said as the servers' starts are: a router that had died, or a first one)
            ctx.say(f"starting {unit}" + (f" (it was {st.state})" if st.state not in ("inactive", "not-found") else ""),
                    step=self.name, unit=unit)
            ctx.manager.start(unit)
            ctx.started(unit)  # (as a restart is: a resumed apply keeps this router rather than restart it again)

    def _readmit_held_out(self, ctx: Context) -> None:
        """Register again, with a closed circuit, each worker the router's circuit breaker holds out although its
        server answers ``/health`` (proven by its step in this apply): after a crash its supervisor recovered from,
        smg keeps it out for up to its ``--cb-timeout-duration-secs`` (60 s), every request meanwhile a 503."""
        try:
            states = serving.circuits(ctx.client, ctx.topology)
        except ProbeError:
            return
        kinds = serving.worker_kinds(ctx.topology)
        url = ctx.router_url()
        for w_url, state in states.items():
            if state == "closed" or w_url not in kinds or probes.health(ctx.client, w_url, timeout=2.0) != 200:
                continue
            kind, bport = kinds[w_url]
            ctx.say(f"re-admitting {w_url} to the router: its circuit breaker holds it out ({state}) although it "
                    "serves", step=self.name)
            try:
                serving.drain(ctx.client, url, w_url, bound_s=30.0, checkpoint=ctx.checkpoint)
                why = serving.admit(ctx.client, url, ctx.topology, w_url, kind, bport, bound_s=self._bound(ctx),
                                    checkpoint=ctx.checkpoint)
            except ProbeError as exc:
                why = str(exc)
            if why:
                ctx.say(f"{w_url} not re-admitted: {why}", step=self.name)

    def _check(self, ctx: Context) -> Proof:
        r0 = ctx.topology.router
        assert r0 is not None
        unit = ctx.unit_of["router"]
        main_pid = ctx.manager.status(unit).main_pid
        _check_owner(ctx, "router", unit, r0.port, main_pid, self.name, ports.bind_address(r0.host))
        account = runs_as_service_user(ctx, "router", main_pid, self.name)
        proof = self.serves(ctx)
        return replace(proof, checks=(*account, *proof.checks))

    def serves(self, ctx: Context) -> Proof:
        """The router's proof as its clients reach it, from ``ctx.client``, ``ctx.topology`` and ``ctx.dep`` alone (no
        unit, no host): what ``pdctl verify`` runs against a router pdctl did not start. :meth:`_check` adds that the
        router's unit holds its port and runs as ``service_user``."""
        url = ctx.router_url()
        status, body = probes.router_readiness(ctx.client, url)
        if status != 200:
            raise VerifyFailed(f"router GET {url}/readiness → {status}: {body}", step=self.name)
        workers, stats = probes.router_workers(ctx.client, url)
        bad = router_faults(workers, stats, ctx.topology)
        if bad:
            message = "router /workers differs from the topology: " + "; ".join(text for text, _kind in bad)
            kinds = {kind for _text, kind in bad if kind}
            if kinds:  # (swapped roles first: verify stops at once on that one)
                raise UnmendableFault(message, kind="swapped" if "swapped" in kinds else kinds.pop(), step=self.name,
                                      hint=self.hint)
            raise VerifyFailed(message, step=self.name, hint=self.hint)
        r = ctx.topology.router
        assert r is not None
        # healthy as a client sees it: /readiness and /workers stay good while a circuit breaker holds a worker out
        states = serving.circuits(ctx.client, ctx.topology)
        held = serving.served_problems(ctx.topology, states)
        if held:
            raise VerifyFailed("the router holds workers out (its circuit breaker, after failed requests): "
                               + "; ".join(held), step=self.name, hint=self.hint)
        canary = serving.run_canary(ctx.client, url, timeout=ctx.dep.console.canary_timeout_s)
        if not canary.ok:
            raise VerifyFailed(f"a request through the router failed: {canary.said()}", step=self.name,
                               hint=self.hint)
        seen = (f"{len(r.prefill)} prefill + {len(r.decode)} decode workers" if r.prefill or r.decode
                else f"{len(r.regular)} regular worker{'s' if len(r.regular) != 1 else ''}")
        return Proof(
            f"router on {r.exposure}: ready, {seen} healthy",
            (
                f"GET {url}/readiness → 200 {body}",
                f"GET {url}/workers: {stats}",
                f"{serving.metrics_url(ctx.topology)}: every worker's circuit closed",
                f"canary POST {url}/generate (1 token) → {canary.said()}",
                # (smg reports a worker's disaggregation_mode in its metadata only where it read it: said where it did)
                *(f"{w.url}: {w.worker_type}, healthy"
                  + (f", mode {w.disaggregation_mode}" if w.disaggregation_mode is not None else "")
                  + (f", bootstrap {w.bootstrap_port}" if w.bootstrap_port is not None else "") for w in workers),
            ),
            {"readiness": body, "stats": stats, "workers": [w.__dict__ for w in workers]},
        )

    def verify(self, ctx: Context) -> Proof:
        bound = self._bound(ctx)
        last: list[str] = []

        def attempt() -> Proof | None:
            st = ctx.manager.status(ctx.unit_of["router"])
            if st.state == "failed":
                msg = startup_failure("router unit", ctx.manager.logs(ctx.unit_of["router"], lines=15))
                raise ApplyFailed(msg, step=self.name, hint=startup_hint(msg))
            if not st.is_active:  # its readiness gate has not passed yet
                last[:] = [f"router unit {st.state}"]
                return None
            try:
                return self._check(ctx)
            except (VerifyFailed, ProbeError) as exc:
                last[:] = [str(exc)]
                if isinstance(exc, UnmendableFault) and exc.kind == "swapped":
                    raise
                return None

        try:
            return _wait("router ready with the expected workers", bound, attempt, poll=0.5, step=self.name,
                         checkpoint=ctx.checkpoint)
        except StepTimeout as exc:
            raise VerifyFailed(f"{exc.message}; last: {last[0] if last else '?'}", step=self.name, hint=self.hint) from None

    def undo(self, ctx: Context) -> None:
        ctx.manager.stop(ctx.unit_of["router"])


# --- parsers -------------------------------------------------------------------------------------

_RAW_MARKUP = ("<think>", "</think>", "<｜DSML｜", "<｜tool▁calls▁begin｜>", "<tool_call>", "<｜tool▁call▁begin｜>")


def check_chat_response(data: dict[str, Any], parsers: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(checks that held, problems)`` for a chat response against the configured parsers. Pure."""
    ok: list[str] = []
    bad: list[str] = []
    try:
        msg = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return ok, [f"no choices[0].message in the response: {str(data)[:200]}"]
    content = msg.get("content") or ""
    if parsers.get("reasoning_parser"):
        rc = msg.get("reasoning_content")
        if rc:
            ok.append(f"reasoning_content present ({len(rc)} chars) — reasoning parser {parsers['reasoning_parser']}")
        else:
            bad.append(f"no reasoning_content although reasoning_parser = {parsers['reasoning_parser']!r}")
    if parsers.get("tool_call_parser"):
        calls = msg.get("tool_calls") or []
        if not calls:
            bad.append(f"no tool_calls although tool_call_parser = {parsers['tool_call_parser']!r}")
        else:
            fn = calls[0].get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = None
            if fn.get("name") != probes.PROBE_TOOL["function"]["name"] or not isinstance(args, dict):
                bad.append(f"tool_calls[0] is not a parsed call of get_weather: {fn}")
            else:
                ok.append(f"tool_calls[0] = {fn['name']}({fn.get('arguments')}) — tool-call parser {parsers['tool_call_parser']}")
    leaked = [m for m in _RAW_MARKUP if m in content]
    if leaked:
        bad.append(f"raw model markup left in content: {leaked} (a parser is missing or does not match the model)")
    return ok, bad


class ParsersConfigured(Step):
    name = "parsers_configured"
    hint = "set the reasoning and tool-call parsers valid for the model on BOTH prefill and decode ([parsers]), then apply"

    def apply(self, ctx: Context) -> None:
        return None

    def verify(self, ctx: Context) -> Proof:
        topo = ctx.topology
        if topo.router is not None:
            url = ctx.router_url()
        else:
            url = topo.roles[0].url
        model = topo.roles[0].settings["model"].get("served_name") or topo.roles[0].settings["model"]["path"]
        data = probes.chat_probe(ctx.client, url, model, timeout=ctx.timeouts.chat)
        parsers = topo.roles[0].settings["parsers"]
        ok, bad = check_chat_response(data, parsers)
        if bad:
            raise VerifyFailed("chat probe through " + url + ": " + "; ".join(bad), step=self.name, hint=self.hint)
        msg = data["choices"][0]["message"]
        return Proof(
            f"chat with tools and thinking through {url}: reasoning_content and tool_calls parsed",
            tuple(ok),
            {"url": url, "finish_reason": data["choices"][0].get("finish_reason"), "reasoning_content": (msg.get("reasoning_content") or "")[:200], "tool_calls": msg.get("tool_calls")},
        )


def steps_for(topo: Topology) -> list[Step]:
    """The step list for *topo*: the six PD steps, or the single-server line."""
    if topo.mode == "pd":
        steps: list[Step] = [KernelsBuilt(), ServersUp("prefill", "prefill_up"), ServersUp("decode", "decode_up"), KVLinkVerified(), RouterExposed(), ParsersConfigured()]
        assert tuple(s.name for s in steps) == PD_STATES
        return steps
    steps = [KernelsBuilt(), ServersUp("server", "server_up")]
    if topo.router is not None:
        steps.append(RouterExposed())
    steps.append(ParsersConfigured())
    assert all(s.name in SINGLE_STATES for s in steps)
    return steps
