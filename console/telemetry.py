"""GPU and NUMA telemetry: NVML, sysfs and ``/proc`` read into frozen, timestamped samples.

This is the **only** module of pdctl that imports ``pynvml`` (nvidia-ml-py), and it imports it
lazily, on the first read. Every NVML call goes through :func:`query`, which turns any NVML error
(no library, no GPU, a function the driver lacks, a field the board does not support) into a
default, :data:`NA` unless told otherwise. "Not available" is a value: :data:`NA` prints ``N/A``,
is falsy and gives ``nan`` in arithmetic, so a panel renders a sample without a branch per field.

Nothing here knows Textual: panels render samples and never call NVML or read sysfs themselves.
The readers take their filesystem roots as arguments so tests feed fixture directories.

A deployment on another machine (an SSH host) is read *there*: NVML's bindings only reach local GPUs,
so its GPUs come from one ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` run through the
Host (:func:`read_gpus_smi`), and sysfs and ``/proc`` are read through the Host's file access.

Command line equivalents are given per field (``nvidia-smi --query-gpu=...``) so an operator can
check a number by hand.
"""

from __future__ import annotations


import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.statemachine.inventory import sysfs_bus_id  # noqa: F401  (one spelling for NVML and sysfs bus ids)

__all__ = [
    "NA",
    "AffinitySample",
    "GpuNumaSample",
    "GpuSample",
    "NaType",
    "NumaNodeSample",
    "compare_affinity",
    "format_cpulist",
    "nvml_status",
    "parse_cpulist",
    "query",
    "read_affinity",
    "read_gpu_numa",
    "read_gpus",
    "parse_smi_gpus",
    "read_gpus_smi",
    "read_numa_nodes",
    "sysfs_bus_id",
]


class NaType(str):
    """The "not available" value: prints ``N/A``, is falsy, is ``nan`` as a number."""

    _instance: NaType | None = None

    def __new__(cls) -> NaType:
        if cls._instance is None:
            cls._instance = super().__new__(cls, "N/A")
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __float__(self) -> float:
        return math.nan

    def __repr__(self) -> str:
        return "NA"

    def __reduce__(self) -> tuple[Any, ...]:
        return (NaType, ())


NA = NaType()
"""The single "not available" value."""


# --- NVML behind one function -------------------------------------------------------------------

_lock = threading.Lock()
_nvml: Any = None
"""The pynvml module once initialised, else None."""
_nvml_error: str | None = None
_nvml_tried_at: float | None = None
_RETRY_S = 30.0
"""A failed initialisation is retried at most this often (a driver may come back)."""
_unknown_functions: set[str] = set()


def _init(now: float | None = None) -> bool:
    """Initialise NVML once (retrying a failure every ``_RETRY_S``). True when usable."""
    global _nvml, _nvml_error, _nvml_tried_at
    if _nvml is not None:
        return True
    now = time.monotonic() if now is None else now
    with _lock:
        if _nvml is not None:
            return True
        if _nvml_tried_at is not None and now - _nvml_tried_at < _RETRY_S:
            return False
        _nvml_tried_at = now
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py not installed
            _nvml_error = f"nvidia-ml-py not installed ({exc})"
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            _nvml_error = f"NVML unavailable: {exc}"
            return False
        except OSError as exc:  # a broken libnvidia-ml
            _nvml_error = f"NVML unavailable: {exc}"
            return False
        _nvml, _nvml_error = pynvml, None
        return True


def nvml_status() -> tuple[bool, str | None]:
    """``(usable, why not)``: initialises NVML on first call."""
    ok = _init()
    return ok, (None if ok else _nvml_error)


def query(fn: str | Callable[..., Any], *args: Any, default: Any = NA) -> Any:
    """Call an NVML function (a ``pynvml`` name or the function) and return its result, or
    *default* when NVML is unusable, the function is missing from this nvidia-ml-py / driver,
    or the call raises ``NVMLError`` (not supported, GPU lost…). Never raises for NVML reasons.
    Byte strings are decoded."""
    if not _init():
        return default
    if isinstance(fn, str):
        func = getattr(_nvml, fn, None)
        if func is None:
            _unknown_functions.add(fn)
            return default
    else:
        func = fn
    try:
        out = func(*args)
    except _nvml.NVMLError:
        return default
    except (AttributeError, TypeError, OSError):  # a function the loaded library lacks
        return default
    if isinstance(out, bytes):
        return out.decode(errors="replace")
    return out


# --- samples --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. Fields NVML cannot give are :data:`NA`."""

    index: int
    name: str | NaType = NA
    """``nvidia-smi --query-gpu=name``"""
    uuid: str | NaType = NA
    util_pct: int | NaType = NA
    """GPU utilisation in percent over the driver's last sample period (``utilization.gpu``)."""
    mem_used_bytes: int | NaType = NA
    """``memory.used`` (bytes)."""
    mem_total_bytes: int | NaType = NA
    """``memory.total`` (bytes)."""
    temperature_c: int | NaType = NA
    """``temperature.gpu`` (degrees Celsius)."""
    power_w: float | NaType = NA
    """``power.draw`` (watts)."""
    power_limit_w: float | NaType = NA
    """``power.limit`` (watts)."""
    pcie_bus_id: str | NaType = NA
    """``pci.bus_id`` as NVML spells it (``00000000:17:00.0``)."""
    numa_node: int | NaType = NA
    """The NUMA node the GPU hangs off: NVML's ``nvmlDeviceGetNumaNodeId``, else sysfs."""
    numa_source: str | NaType = NA
    """``"nvml"`` or ``"sysfs"``: where :attr:`numa_node` came from."""


@dataclass(frozen=True)
class NumaNodeSample:
    """One NUMA node from ``/sys/devices/system/node/node<N>``."""

    node: int
    cpus: str
    """CPU list as the kernel writes it (``0-31,64-95``)."""
    cpu_count: int
    mem_total_bytes: int | NaType = NA
    mem_free_bytes: int | NaType = NA


@dataclass(frozen=True)
class AffinitySample:
    """Whether a role's process runs on the CPUs its NUMA node asks for.

    ``status``: ``ok`` (actual == expected), ``mismatch`` (flagged), ``not-asked`` (the spec pins no
    NUMA node), ``no-process`` (no main PID), ``unknown`` (``/proc`` unreadable)."""

    role: str
    pid: int | None
    expected_node: int | None
    expected_cpus: str | None
    """The spec's CPU list for that node (``hosts.<h>.numa_cpus``), else the node's from sysfs."""
    actual_cpus: str | None
    """``Cpus_allowed_list`` of ``/proc/<pid>/status``."""
    status: str
    detail: str = ""

    @property
    def flagged(self) -> bool:
        return self.status == "mismatch"


@dataclass(frozen=True)
class GpuNumaSample:
    """Everything the GPU/NUMA panel shows, read at ``at`` (epoch seconds)."""

    at: float
    nvml_ok: bool
    nvml_error: str | None = None
    driver_version: str | NaType = NA
    gpus: tuple[GpuSample, ...] = ()
    nodes: tuple[NumaNodeSample, ...] = ()
    affinity: tuple[AffinitySample, ...] = ()
    owners: Mapping[int, str] = field(default_factory=dict)
    """GPU index → owning role (from the topology, for GPUs of this host)."""
    source: str = "NVML"
    """Where the GPU rows came from: ``NVML`` (this machine) or ``nvidia-smi on <host>``."""


# --- CPU lists ------------------------------------------------------------------------------------


def parse_cpulist(text: str | None) -> frozenset[int] | None:
    """``"0-3,8,10-11"`` → ``{0,1,2,3,8,10,11}``; None for None or an unparseable list."""
    if text is None:
        return None
    out: set[int] = set()
    try:
        for part in text.strip().split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
    except ValueError:
        return None
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``{0,1,2,3,8}`` → ``"0-3,8"`` (the kernel's spelling)."""
    s = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


def compare_affinity(expected: str | None, actual: str | None) -> tuple[str, str]:
    """``(status, detail)`` for a role's CPU affinity against its NUMA node's CPU list.

    Pure. *expected* None → ``not-asked``; *actual* None → ``unknown``; equal sets → ``ok``;
    otherwise ``mismatch`` with what differs (an unpinned process, allowed on every CPU, is a
    mismatch too: it may run on the far socket)."""
    if expected is None:
        return "not-asked", "spec pins no NUMA node"
    if actual is None:
        return "unknown", "affinity not readable"
    e, a = parse_cpulist(expected), parse_cpulist(actual)
    if e is None or a is None:
        return "unknown", f"cannot parse {expected!r} / {actual!r}"
    if e == a:
        return "ok", "matches"
    extra, missing = a - e, e - a
    bits = []
    if extra:
        bits.append(f"also on {format_cpulist(extra)}")
    if missing:
        bits.append(f"not on {format_cpulist(missing)}")
    return "mismatch", "; ".join(bits)


# --- readers (I/O) -------------------------------------------------------------------------------


def _read(path: str, host: Any = None) -> str | None:
    """*path*'s text on this machine, or through *host* (a :class:`~pdctl.statemachine.hosts.Host`); None when
    it cannot be read."""
    if host is not None:
        from pdctl.statemachine.errors import PdctlError

        try:
            return host.read_file(path).decode("utf-8", "replace")
        except (OSError, PdctlError):
            return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None




def _sysfs_numa(bus_id: str, pci_root: str, host: Any = None) -> int | NaType:
    raw = _read(os.path.join(pci_root, sysfs_bus_id(bus_id), "numa_node"), host)
    try:
        n = int(raw.strip()) if raw is not None else -1
    except ValueError:
        return NA
    return n if n >= 0 else NA


def read_gpus(*, pci_root: str = "/sys/bus/pci/devices") -> tuple[bool, str | None, str | NaType, tuple[GpuSample, ...]]:
    """``(nvml_ok, why_not, driver_version, gpus)``. Without NVML: ``(False, reason, NA, ())``."""
    ok, why = nvml_status()
    if not ok:
        return False, why, NA, ()
    driver = query("nvmlSystemGetDriverVersion")
    count = query("nvmlDeviceGetCount", default=0)
    gpus = []
    for i in range(int(count or 0)):
        h = query("nvmlDeviceGetHandleByIndex", i, default=None)
        if h is None:
            gpus.append(GpuSample(index=i))
            continue
        util = query("nvmlDeviceGetUtilizationRates", h, default=None)
        mem = query("nvmlDeviceGetMemoryInfo", h, default=None)
        power_mw = query("nvmlDeviceGetPowerUsage", h)
        limit_mw = query("nvmlDeviceGetEnforcedPowerLimit", h)
        pci = query("nvmlDeviceGetPciInfo", h, default=None)
        bus = NA
        if pci is not None:
            b = getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", None)
            bus = b.decode() if isinstance(b, bytes) else (b or NA)
        numa, src = query("nvmlDeviceGetNumaNodeId", h), "nvml"
        if not isinstance(numa, int) or numa < 0:
            numa, src = (_sysfs_numa(bus, pci_root), "sysfs") if bus else (NA, NA)
        if numa is NA:
            src = NA
        gpus.append(
            GpuSample(
                index=i,
                name=query("nvmlDeviceGetName", h),
                uuid=query("nvmlDeviceGetUUID", h),
                util_pct=util.gpu if util is not None else NA,
                mem_used_bytes=mem.used if mem is not None else NA,
                mem_total_bytes=mem.total if mem is not None else NA,
                temperature_c=query("nvmlDeviceGetTemperature", h, 0),  # 0 = NVML_TEMPERATURE_GPU
                power_w=power_mw / 1000.0 if isinstance(power_mw, int) else NA,
                power_limit_w=limit_mw / 1000.0 if isinstance(limit_mw, int) else NA,
                pcie_bus_id=bus,
                numa_node=numa,
                numa_source=src,
            )
        )
    return True, None, driver, tuple(gpus)


#: ``nvidia-smi --query-gpu`` fields (as ``nvidia-smi --help-query-gpu`` names them) for :func:`read_gpus_smi`,
#: in the order :class:`GpuSample` is filled; with ``nounits`` memory is in MiB and power in W.
SMI_FIELDS = ("index", "name", "uuid", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
              "power.draw", "power.limit", "pci.bus_id", "driver_version")


def _smi_value(text: str, kind: type) -> Any:
    """One CSV cell of nvidia-smi: ``[N/A]``, ``[Not Supported]``, ``N/A`` or an unparsable cell → :data:`NA`."""
    v = text.strip()
    if not v or v.startswith("[") or v == "N/A":
        return NA
    if kind is str:
        return v
    try:
        return kind(float(v)) if kind is int else kind(v)
    except ValueError:
        return NA


def parse_smi_gpus(text: str) -> tuple[str | NaType, list[dict[str, Any]]]:
    """``(driver_version, rows)`` from ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``.

    Raises ValueError on a line that does not have one cell per field."""
    import csv

    driver: str | NaType = NA
    rows = []
    for cells in csv.reader(line for line in text.splitlines() if line.strip()):
        if len(cells) != len(SMI_FIELDS):
            raise ValueError(f"nvidia-smi printed {len(cells)} fields where {len(SMI_FIELDS)} were asked: {cells!r}")
        c = dict(zip(SMI_FIELDS, cells))
        driver = _smi_value(c["driver_version"], str)
        mib = 1024 * 1024
        used, total = _smi_value(c["memory.used"], float), _smi_value(c["memory.total"], float)
        rows.append({
            "index": int(c["index"]),
            "name": _smi_value(c["name"], str),
            "uuid": _smi_value(c["uuid"], str),
            "util_pct": _smi_value(c["utilization.gpu"], int),
            "mem_used_bytes": int(used * mib) if used is not NA else NA,
            "mem_total_bytes": int(total * mib) if total is not NA else NA,
            "temperature_c": _smi_value(c["temperature.gpu"], int),
            "power_w": _smi_value(c["power.draw"], float),
            "power_limit_w": _smi_value(c["power.limit"], float),
            "pcie_bus_id": _smi_value(c["pci.bus_id"], str),
        })
    return driver, rows


def read_gpus_smi(host: Any, *, pci_root: str = "/sys/bus/pci/devices", timeout_s: float = 5.0,
                  smi: str = "nvidia-smi") -> tuple[bool, str | None, str | NaType, tuple[GpuSample, ...]]:
    """:func:`read_gpus` for the GPUs of *host* (a Host, e.g. over SSH): one *smi* (``nvidia-smi``) run there,
    each GPU's NUMA node from the host's sysfs. ``(False, why, NA, ())`` when nvidia-smi is missing or fails."""
    from pdctl.statemachine.errors import PdctlError

    argv = [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        res = host.run(argv, timeout=timeout_s, check=False)
    except PdctlError as exc:  # e.g. "cannot run nvidia-smi on <host>: No such file or directory"
        return False, getattr(exc, "message", None) or str(exc), NA, ()
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip()[-200:]
        return False, f"nvidia-smi on {host.name} exited {res.returncode}: {detail}", NA, ()
    try:
        driver, rows = parse_smi_gpus(res.stdout)
    except ValueError as exc:
        return False, f"nvidia-smi on {host.name}: {exc}", NA, ()
    gpus = []
    for r in rows:
        numa = _sysfs_numa(r["pcie_bus_id"], pci_root, host) if r["pcie_bus_id"] is not NA else NA
        gpus.append(GpuSample(**r, numa_node=numa, numa_source="sysfs" if numa is not NA else NA))
    return True, None, driver, tuple(sorted(gpus, key=lambda g: g.index))


def read_numa_nodes(root: str = "/sys/devices/system/node", *, host: Any = None) -> tuple[NumaNodeSample, ...]:
    """Every ``node<N>`` under *root* (on *host* when given): CPU list and memory (``meminfo`` MemTotal/MemFree,
    kB)."""
    try:
        entries = os.listdir(root) if host is None else host.list_dir(root)
    except OSError:
        return ()
    names = sorted((n for n in entries if n.startswith("node") and n[4:].isdigit()), key=lambda n: int(n[4:]))
    out = []
    for n in names:
        cpus = (_read(os.path.join(root, n, "cpulist"), host) or "").strip()
        total: int | NaType = NA
        free: int | NaType = NA
        for line in (_read(os.path.join(root, n, "meminfo"), host) or "").splitlines():
            parts = line.split()
            # "Node 0 MemTotal:   6514908 kB"
            if len(parts) >= 4 and parts[2] in ("MemTotal:", "MemFree:"):
                try:
                    v = int(parts[3]) * 1024
                except ValueError:
                    continue
                if parts[2] == "MemTotal:":
                    total = v
                else:
                    free = v
        out.append(NumaNodeSample(node=int(n[4:]), cpus=cpus, cpu_count=len(parse_cpulist(cpus) or ()), mem_total_bytes=total, mem_free_bytes=free))
    return tuple(out)


def read_affinity(pid: int, *, proc_root: str = "/proc", host: Any = None) -> str | None:
    """``Cpus_allowed_list`` of ``/proc/<pid>/status`` (what ``taskset -cp PID`` prints; on *host* when given),
    or None."""
    text = _read(os.path.join(proc_root, str(pid), "status"), host)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return None


@dataclass(frozen=True)
class RoleNuma:
    """What the spec asks of one role's placement (input to :func:`read_gpu_numa`)."""

    role: str
    pid: int | None
    expected_node: int | None
    declared_cpus: str | None
    """``hosts.<h>.numa_cpus[node]`` when the spec declares it."""


def read_gpu_numa(
    roles: Iterable[RoleNuma],
    owners: Mapping[int, str],
    *,
    nvml: bool = True,
    node_root: str = "/sys/devices/system/node",
    pci_root: str = "/sys/bus/pci/devices",
    proc_root: str = "/proc",
    clock: Callable[[], float] = time.time,
    host: Any = None,
    smi: str = "nvidia-smi",
) -> GpuNumaSample:
    """One :class:`GpuNumaSample`: GPUs (NVML), NUMA nodes (sysfs), each role's affinity (/proc).

    With *host* (another machine's Host, e.g. SSH) everything is read there instead: the GPUs through
    :func:`read_gpus_smi`, sysfs and ``/proc`` through the Host; *nvml* False skips the GPUs either way."""
    source = "NVML" if host is None else f"nvidia-smi on {host.name}"
    if not nvml:
        ok, why, driver, gpus = False, "NVML disabled" if host is None else "GPU telemetry disabled", NA, ()
    elif host is None:
        ok, why, driver, gpus = read_gpus(pci_root=pci_root)
    else:
        ok, why, driver, gpus = read_gpus_smi(host, pci_root=pci_root, smi=smi)
    nodes = read_numa_nodes(node_root, host=host)
    by_node = {n.node: n.cpus for n in nodes}
    aff = []
    for r in roles:
        expected = r.declared_cpus
        if expected is None and r.expected_node is not None:
            expected = by_node.get(r.expected_node)
        if r.pid is None:
            aff.append(AffinitySample(r.role, None, r.expected_node, expected, None, "no-process", "not running"))
            continue
        actual = read_affinity(r.pid, proc_root=proc_root, host=host)
        status, detail = compare_affinity(expected if r.expected_node is not None else None, actual)
        aff.append(AffinitySample(r.role, r.pid, r.expected_node, expected, actual, status, detail))
    return GpuNumaSample(
        at=clock(), nvml_ok=ok, nvml_error=why, driver_version=driver, gpus=gpus, nodes=nodes, affinity=tuple(aff), owners=dict(owners),
        source=source,
    )
