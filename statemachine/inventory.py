"""``inventory = "discover"``: read a host's GPUs and NUMA layout through its :class:`~pdctl.statemachine.hosts.Host`
(this machine or one reached over SSH), for the placement rules (``rules.validate(inventories=...)``).

Facts and where they come from:

* the GPUs, in ``nvidia-smi`` index order (the ids a spec's ``gpus`` lists use), with their PCI bus ids:
  ``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`` (fields as ``nvidia-smi --help-query-gpu``
  documents them; bus ids spelled ``00000000:3B:00.0``). nvidia-smi, not NVML bindings, so that the same
  command answers over SSH, where pdctl has no Python of its own;
* each GPU's NUMA node: sysfs ``/sys/bus/pci/devices/<0000:3b:00.0>/numa_node`` (``-1`` when the platform
  reports none, e.g. a single-node VM — then no placement rule can be checked for it);
* each NUMA node's CPUs: ``/sys/devices/system/node/node<N>/cpulist`` (``cpulist`` syntax, ``0-31,64-95``).

``pdctl plan`` and ``pdctl apply`` discover; ``pdctl validate`` never contacts a host.

:func:`gpu_processes` lists the compute processes on each GPU (``nvidia-smi --query-compute-apps=gpu_bus_id,pid,
used_memory --format=csv,noheader,nounits``: one line per process and GPU, memory in MiB, ``[N/A]`` where the driver
does not tell), for apply's check that a role's GPUs are free before anything starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdctl.statemachine.errors import HostError
from pdctl.statemachine.rules import Inventory

if TYPE_CHECKING:  # pragma: no cover
    from pdctl.statemachine.hosts import Host

__all__ = ["GpuProcess", "discover", "gpu_processes", "parse_compute_apps", "parse_gpu_query", "sysfs_bus_id"]

GPU_QUERY = ("nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader")
COMPUTE_APPS_QUERY = ("nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,used_memory", "--format=csv,noheader,nounits")


class GpuProcess(NamedTuple):
    """One compute process on one GPU, as nvidia-smi lists it."""

    gpu: int
    """The GPU's nvidia-smi index (what a spec's ``gpus`` lists)."""
    pid: int
    """In the PID namespace nvidia-smi answers for (in a container without the host's PIDs, one ``/proc`` lacks)."""
    used_mib: int | None
    """GPU memory it holds, MiB; None where nvidia-smi prints ``[N/A]``."""


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """``00000000:3B:00.0`` (nvidia-smi / NVML) → ``0000:3b:00.0`` (sysfs)."""
    s = nvml_bus_id.strip().lower()
    if s.count(":") == 2:
        dom, rest = s.split(":", 1)
        try:
            return f"{int(dom, 16):04x}:{rest}"
        except ValueError:
            return s
    return s


def parse_gpu_query(text: str) -> list[str]:
    """Bus ids in index order from ``GPU_QUERY``'s output. Raises ValueError on a line it cannot read or a
    gap in the indices."""
    rows: dict[int, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        idx, sep, bus = (p.strip() for p in line.partition(","))
        if not sep or not idx.isdigit() or not bus:
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        rows[int(idx)] = bus
    if sorted(rows) != list(range(len(rows))):
        raise ValueError(f"nvidia-smi listed GPU indices {sorted(rows)}, not 0..{len(rows) - 1}")
    return [rows[i] for i in range(len(rows))]


def parse_compute_apps(text: str) -> list[tuple[str, int, int | None]]:
    """``(bus id, PID, used MiB or None)`` per line of ``COMPUTE_APPS_QUERY``'s output (none: no compute process).
    Raises ValueError on a line it cannot read."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.strip().lower().startswith("no running"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0] or not fields[1].isdigit():
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        out.append((fields[0], int(fields[1]), int(fields[2]) if fields[2].isdigit() else None))
    return out


def gpu_processes(host: Host) -> list[GpuProcess] | None:
    """Every compute process on *host*'s GPUs (two nvidia-smi queries: the GPUs' indices, then the processes by bus
    id), sorted by GPU and PID; None where the host has no nvidia-smi (a host without the NVIDIA driver, as the
    demo's): nothing to check there. Raises HostError naming the host when nvidia-smi is there but exits non-zero
    ("couldn't communicate with the NVIDIA driver") or answers what cannot be read, and CommandTimeout after 60 s."""
    from pdctl.statemachine.errors import CommandTimeout

    def ask(argv: tuple[str, ...]) -> str | None:
        try:
            res = host.run(list(argv), timeout=60, check=False)
        except CommandTimeout:
            raise
        except HostError:  # (it cannot be run here: not installed)
            return None
        if res.returncode == 127:  # (a shell's "command not found", over SSH)
            return None
        if res.returncode != 0:
            raise HostError(f"nvidia-smi on host {host.name} exited {res.returncode}: "
                            f"{(res.stderr or res.stdout).strip()[-300:]}", host=host.name)
        return res.stdout

    gpus = ask(GPU_QUERY)
    if gpus is None:
        return None
    apps = ask(COMPUTE_APPS_QUERY)
    if apps is None:
        return None
    try:
        index = {sysfs_bus_id(bus): i for i, bus in enumerate(parse_gpu_query(gpus))}
        rows = parse_compute_apps(apps)
    except ValueError as exc:
        raise HostError(f"nvidia-smi on host {host.name} answered what pdctl cannot read: {exc}", host=host.name) from None
    return sorted(GpuProcess(index[sysfs_bus_id(bus)], pid, mib) for bus, pid, mib in rows if sysfs_bus_id(bus) in index)


def discover(host: Host, *, pci_root: str = "/sys/bus/pci/devices",
             node_root: str = "/sys/devices/system/node") -> Inventory:
    """The :class:`~pdctl.statemachine.rules.Inventory` of *host*. Raises HostError (naming the host and the fix)
    when nvidia-smi is missing or fails; a GPU whose NUMA node sysfs does not report gets ``-1``."""
    hint = 'install the NVIDIA driver there, or declare gpu_numa / numa_cpus and set inventory = "declared"'
    try:
        res = host.run(list(GPU_QUERY), timeout=60, check=False)
    except HostError as exc:
        raise HostError(f"cannot discover the GPUs of host {host.name}: {exc.message}", host=host.name,
                        hint=hint) from None
    if res.returncode != 0:
        raise HostError(f"cannot discover the GPUs of host {host.name}: nvidia-smi exited {res.returncode}: "
                        f"{(res.stderr or res.stdout).strip()[-300:]}", host=host.name, hint=hint)
    try:
        buses = parse_gpu_query(res.stdout)
    except ValueError as exc:
        raise HostError(f"cannot discover the GPUs of host {host.name}: {exc}", host=host.name, hint=hint) from None
    gpu_numa = []
    for bus in buses:
        try:
            gpu_numa.append(int(host.read_text(f"{pci_root}/{sysfs_bus_id(bus)}/numa_node").strip()))
        except (OSError, ValueError):
            gpu_numa.append(-1)
    numa_cpus: dict[int, str] = {}
    try:
        nodes = [n for n in host.list_dir(node_root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        nodes = []
    for n in sorted(nodes, key=lambda n: int(n[4:])):
        try:
            numa_cpus[int(n[4:])] = host.read_text(f"{node_root}/{n}/cpulist").strip()
        except OSError:
            continue
    return Inventory(tuple(gpu_numa), numa_cpus or None)
