"""The small, frozen input types of :mod:`pdctl.units`.

``pdctl.units`` imports nothing of pdctl (an import-linter contract says so): the state machine
builds these values from the spec (``pdctl.statemachine.launch``) and hands them over. Every field
is plain data — strings, ints, tuples — so a value can be hashed, compared, printed in a plan and
rebuilt in a detached watchdog process from JSON.

Mappings are stored as tuples of ``(key, value)`` pairs in the order given (``env``); pass a
``dict`` and ``__post_init__`` turns it into pairs, so ``ServerLaunch(env={"A": "1"})`` works.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "RouterLaunch",
    "ServerLaunch",
    "ServiceSpec",
    "ServiceStatus",
    "TargetSpec",
    "UnitSet",
    "cpu_list",
    "cpu_set",
    "pairs",
]

_CPU_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
CPU_MAX = 8192
"""CPU numbers must stay below this: systemd refuses larger ones in ``CPUAffinity=`` (``CPU_SET_MAX_NCPU``,
src/shared/cpu-set-util.c; CONFIG_NR_CPUS goes up to 8192) and would start the unit unpinned."""


def cpu_list(text: str) -> str:
    """Check a CPU list and return it in Linux's cpulist form, e.g. ``"0-31,64-95"`` (sysfs
    ``/sys/devices/system/node/nodeN/cpulist``; kernel Documentation/admin-guide/cputopology.rst): the CPUs in
    ascending order, runs written as ranges, so that one set of CPUs has one spelling (``"0,1"``, ``"0 1"`` and
    ``"1,0-1"`` are all ``"0-1"``). Spaces are also taken as separators, as systemd.exec(5)'s ``CPUAffinity=``
    reads them. ``""`` (a node without CPUs) stays ``""``. The one grammar of the spec check, the unit renderer and
    the process supervisor.

    Raises:
        ValueError: ``'…' is not a CPU list: …`` for anything else: non-ASCII digits, a range whose end is below its
            start, another separator, an empty item, a CPU number of :data:`CPU_MAX` or more.
    """
    body = text.strip(" ")
    if not body:
        return ""
    items = re.split(r" *, *| +", body)
    for item in items:
        m = _CPU_ITEM.fullmatch(item)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{text!r} is not a CPU list: write CPU numbers and ranges, e.g. \"0-31,64-95\"")
        if int(m.group(2) or m.group(1)) >= CPU_MAX:
            raise ValueError(f"{text!r} is not a CPU list: CPU numbers stop at {CPU_MAX - 1} (systemd's limit)")
    cpus = sorted({c for item in items for c in _cpu_range(item)})
    runs: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs)


def _cpu_range(item: str) -> range:
    a, _, b = item.partition("-")
    return range(int(a), int(b or a) + 1)


def cpu_set(text: str) -> set[int]:
    """The CPUs of a list :func:`cpu_list` accepts (``"0-2,8"`` → ``{0, 1, 2, 8}``). Raises ValueError as it does."""
    return {c for item in filter(None, cpu_list(text).split(",")) for c in _cpu_range(item)}

Pairs = tuple[tuple[str, str], ...]


def pairs(value: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Pairs:
    """``{"A": "1"}`` or ``[("A", "1")]`` → ``(("A", "1"),)``; later keys replace earlier ones."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[str, str] = {}
    for k, v in items:
        out[str(k)] = str(v)
    return tuple(out.items())


def _freeze(obj: Any) -> None:
    """Normalise mapping fields to pairs and list fields to tuples on a frozen dataclass."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.name in ("env", "secrets"):
            object.__setattr__(obj, f.name, pairs(v))
        elif isinstance(v, list):
            object.__setattr__(obj, f.name, tuple(tuple(x) if isinstance(x, list) else x for x in v))


@dataclass(frozen=True)
class ServerLaunch:
    """One SGLang server (``python -m sglang.launch_server``) or its stand-in (``pdctl.sim``).

    ``gpu_ids`` are the host's physical GPU ids: they become ``CUDA_VISIBLE_DEVICES`` and the argv
    carries ``--base-gpu-id 0`` (SGLang counts ``--base-gpu-id`` inside the visible set).
    ``kind`` "single" is a non-PD server (no ``--disaggregation-*`` flags at all).
    """

    kind: Literal["prefill", "decode", "single"]
    model_path: str
    http_port: int
    python: str
    module: str = "sglang.launch_server"
    http_host: str = "127.0.0.1"
    served_name: str | None = None
    context_length: int | None = None
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    """``None`` or ``"auto"``: the flag is left out (SGLang's default)."""
    trust_remote_code: bool = False
    load_format: str | None = None
    attention_backend: str | None = None
    dsa_prefill_backend: str | None = None
    dsa_decode_backend: str | None = None
    tp: int = 1
    attn_dp: int = 1
    ep: int = 1
    bootstrap_port: int | None = None
    nccl_port: int | None = None
    transfer_backend: str | None = None
    ib_device: str | None = None
    ucx_net_devices: str | None = None
    mem_fraction: float | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    gpu_ids: tuple[int, ...] = ()
    numa_node: int | None = None
    numa_cpus: str | None = None
    """CPU list of ``numa_node`` in sysfs ``cpulist`` syntax (``"0-31,64-95"``); None: unknown."""
    cache_dir: str | None = None
    """``SGLANG_CACHE_DIR``."""
    env: Pairs = ()
    extra_args: tuple[str, ...] = ()
    sparse_attention_prefix: Literal["--dsa", "--nsa"] = "--dsa"
    """How the target SGLang spells the sparse-attention backend flags: ``--dsa-prefill-backend`` (0.5.15+) or
    ``--nsa-prefill-backend`` (0.5.6 – 0.5.12)."""
    legacy_dp_attention: bool = False
    """Attention-DP as ``--dp-size N --enable-dp-attention`` (SGLang ≤ 0.5.20) instead of ``--attn-dp-size N``."""

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class RouterLaunch:
    """The router in front of the servers: ``smg launch …`` or the legacy
    ``python -m sglang_router.launch_router …`` (``impl="sglang-router"``, ``executable`` is then
    the Python interpreter).

    ``prefill`` holds ``(url, bootstrap_port)`` pairs: the bootstrap port is always passed, because
    an omitted one makes decode fall back to its own default. ``workers`` are plain (non-PD)
    workers (``--worker-urls``); a router has either ``prefill``+``decode`` or ``workers``.
    """

    executable: str
    impl: Literal["smg", "sglang-router"] = "smg"
    prefill: tuple[tuple[str, int], ...] = ()
    decode: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30001
    policy: str | None = None
    prometheus_host: str | None = None
    prometheus_port: int | None = None
    health_check_interval_s: int | None = None
    health_check_timeout_s: int | None = None
    health_failure_threshold: int | None = None
    health_success_threshold: int | None = None
    worker_startup_timeout_s: int | None = None
    worker_startup_check_interval_s: int | None = None
    extra_args: tuple[str, ...] = ()
    env: Pairs = ()

    def __post_init__(self) -> None:
        _freeze(self)
        object.__setattr__(self, "prefill", tuple((str(u), int(p)) for u, p in self.prefill))

    @property
    def is_pd(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass(frozen=True)
class ServiceSpec:
    """One long-running role as a service manager sees it: a systemd ``.service`` or a process
    under :class:`~pdctl.units.ProcessSupervisor`. Both managers honour every field.

    Times are seconds. ``requires`` names services that must be *ready* (readiness gate passed)
    before this one starts (systemd ``Wants=`` + ``After=``: a restart of one never restarts this one). ``secrets`` never appear in the
    unit: they go to ``secrets_file`` (written 0600) and reach the process as environment.
    ``start_limit_burst`` starts within ``start_limit_interval_s`` is the most a failing role gets.
    """

    name: str
    """Unit name, ``pdctl-<deployment>-<role>.service``."""
    description: str
    argv: tuple[str, ...]
    deployment: str
    role: str
    env: Pairs = ()
    secrets: Pairs = field(default=(), repr=False)
    """Never printed: ``repr`` leaves them out and :meth:`to_json` writes ``***`` unless asked."""
    secrets_file: str | None = None
    working_dir: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    """CPU list (``"0-31,64-95"``) for ``CPUAffinity=`` / ``sched_setaffinity``."""
    memlock_infinity: bool = False
    restart_sec: float = 10.0
    restart_prevent_exit_status: tuple[int, ...] = ()
    """Exit codes never restarted (systemd ``RestartPreventExitStatus=``): 2 is argparse's for a refused command line
    (SGLang's launch_server and smg's launcher parse with it), which no restart can fix."""
    start_limit_burst: int = 3
    start_limit_interval_s: int = 600
    timeout_start_s: int = 3600
    timeout_stop_s: int = 120
    readiness_url: str | None = None
    """Polled until it answers 200; the role counts as started (``active``) only then."""
    readiness_python: str | None = None
    """Interpreter that runs the systemd readiness gate (``ExecStartPost=``); any Python 3."""
    requires: tuple[str, ...] = ()
    part_of: str | None = None
    """The target that groups the deployment's units (``PartOf=``)."""
    log_path: str | None = None
    """Append stdout+stderr to this file (systemd: ``StandardOutput=append:``); None: the journal."""
    log_max_bytes: int | None = None
    """The process supervisor's ``output.log``: past this size its lines are copied to ``output.log.1`` and it is
    emptied (``supervise.LOG_MAX_BYTES`` when None). systemd's journal rotates its own."""
    user: str | None = None
    """The account the role runs as (systemd ``User=``: its UID, primary group and supplementary groups, and
    ``HOME``/``USER``/``LOGNAME``/``SHELL`` from its passwd entry), switched to after the CPU, NUMA and memlock settings
    are applied, as systemd does; None: the manager's own (root under a system manager). Needs a manager running as
    root; a user manager refuses it."""

    def __post_init__(self) -> None:
        _freeze(self)
        if not self.argv or not self.argv[0].startswith("/"):
            raise ValueError(f"{self.name}: argv[0] must be an absolute path, got {self.argv[:1]!r}")
        if self.secrets and not self.secrets_file:
            raise ValueError(f"{self.name}: secrets need a secrets_file (an EnvironmentFile= path)")

    def to_json(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists); :meth:`from_json` inverts it. Secret values
        are ``"***"`` unless *reveal_secrets* (plans, journals and logs never reveal them)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "secrets":
                out[f.name] = [[k, val if reveal_secrets else "***"] for k, val in v]
            elif f.name in ("user", "log_max_bytes") and v is None:
                continue  # (left out unset: a definition written before the field reads the same)
            else:
                out[f.name] = [list(x) for x in v] if f.name == "env" else v
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServiceSpec:
        kw = dict(data)
        for k in ("argv", "requires", "restart_prevent_exit_status"):
            kw[k] = tuple(kw.get(k, ()))
        for k in ("env", "secrets"):
            kw[k] = tuple((a, b) for a, b in kw.get(k, ()))
        return cls(**kw)


@dataclass(frozen=True)
class TargetSpec:
    """The deployment's grouping unit, ``pdctl-<deployment>.target``: starting it starts every
    service in ``wants``; stopping it stops them (they are ``PartOf=`` it)."""

    name: str
    description: str
    deployment: str
    wants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class UnitSet:
    """Everything one deployment installs on one host: its target and its services."""

    target: TargetSpec
    services: tuple[ServiceSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "services", tuple(self.services))
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError(f"unit names repeat: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every unit name, services first, the target last."""
        return (*(s.name for s in self.services), self.target.name)

    def service(self, name: str) -> ServiceSpec:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


SUPERVISOR_STOPPED = "supervisor-stopped"
"""``ServiceStatus.sub_state`` of a service whose watchdog lives but is stopped (``kill -STOP``, or held by a debugger:
state ``T``/``t`` in ``/proc/PID/stat``): it restarts nothing until it is continued."""


STATUS_UNWRITTEN = "status-unwritten"
"""``sub_state`` of a process-supervisor service whose watchdog runs but cannot write its ``status.json`` (its state
directory full, read-only or over quota): what the file says is stale, so nothing reads the service as supervised."""


def unsupervised_reason(sub_state: str | None) -> str:
    """Why a service that runs is not supervised, from its ``sub_state``: the words after "its supervisor is"."""
    if sub_state == SUPERVISOR_STOPPED:
        return "stopped (kill -STOP or a debugger; `kill -CONT` its watchdog to resume it)"
    if sub_state == STATUS_UNWRITTEN:
        return ("unable to write its status file (the state directory is full, read-only or over quota: free space or "
                "make it writable; the role runs on and its state is written once it can be)")
    return "gone"


@dataclass(frozen=True)
class ServiceStatus:
    """What a manager observes of one service.

    ``state`` uses systemd's ActiveState words: ``active`` (started *and* past its readiness gate),
    ``activating`` (starting, or waiting for readiness, or waiting to restart), ``deactivating``,
    ``inactive``, ``failed``. ``restarts`` counts automatic restarts since the last manual start.
    ``supervised`` is False while the service's process runs but nothing watches it any more (the process
    backend's watchdog was killed, or is stopped: ``sub_state`` :data:`SUPERVISOR_STOPPED`): it is still ``active``,
    yet a crash would not restart it. systemd services are always supervised. :func:`unsupervised_reason` words why.
    """

    name: str
    state: str
    main_pid: int | None = None
    restarts: int = 0
    sub_state: str = ""
    supervised: bool = True

    @property
    def is_active(self) -> bool:
        return self.state == "active"
