"""Who listens on a TCP port: so that a proof is about the process pdctl started.

A ``/health`` that answers 200 proves nothing if the answer comes from another deployment that
already holds the port (the role's own process then dies with "Address already in use" while the
probe talks to the stranger). pdctl therefore checks, on the role's host:

* before an apply starts anything, that no port of any role is held outside the deployment's units
  (:func:`held_outside`); before starting a role, that none of its ports is held by a process outside the
  role's unit (:func:`foreign_listeners`); and
* in every proof, that the process listening on the role's HTTP port is the unit's main process
  or one of its descendants (:func:`listener_belongs`).

Facts come from Linux's ``/proc/net/tcp``/``tcp6`` (state ``0A`` = LISTEN; the local port is hex),
``/proc/<pid>/fd`` socket links and ``/proc/<pid>/stat`` (parent PID), read through the host object
so that an SSH host answers the same way. The parsers are pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Listener", "applied_with", "foreign_listeners", "held_outside", "is_descendant", "listeners",
           "listener_belongs", "parse_proc_net_tcp", "started_as", "started_by"]


@dataclass(frozen=True)
class Listener:
    port: int
    pid: int | None
    """None when the socket's owner could not be found (another user's process, a namespace)."""
    command: str = ""


def parse_proc_net_tcp(text: str) -> dict[str, int]:
    """``{socket inode: local port}`` of the LISTEN sockets in a ``/proc/net/tcp*`` table."""
    out: dict[str, int] = {}
    for row in text.splitlines()[1:]:
        f = row.split()
        if len(f) > 9 and f[3] == "0A":
            out[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def _read(host, path: str) -> str:  # noqa: ANN001
    try:
        return host.read_file(path).decode(errors="replace")
    except OSError:
        return ""


def _shortened(command: str, limit: int = 160) -> str:
    """*command* as messages name a port's holder: whole when it fits in *limit* characters, else cut after its last
    whole argument that fits, with " …" (a cut mid-argument read as an argument: ``--kv-cache-dtype``)."""
    if len(command) <= limit:
        return command
    head = command[:limit + 1].rsplit(" ", 1)[0] if " " in command[:limit + 1] else command[:limit]
    return head + " …"


def listeners(host, ports: set[int]) -> list[Listener]:  # noqa: ANN001
    """The processes listening on any of *ports* on *host* (one entry per port and PID)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for inode, port in parse_proc_net_tcp(_read(host, table)).items():
            if port in ports:
                inodes[inode] = port
    if not inodes:
        return []
    found: dict[tuple[int, int], Listener] = {}
    for pid, inode in host.socket_links():
        if inode in inodes:
            port = inodes[inode]
            cmd = _read(host, f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            found[(port, pid)] = Listener(port, pid, _shortened(cmd))
    seen_ports = {p for p, _ in found}
    out = list(found.values())
    out += [Listener(p, None) for p in set(inodes.values()) - seen_ports]
    return sorted(out, key=lambda x: (x.port, x.pid or 0))


def _parent(host, pid: int) -> int | None:  # noqa: ANN001
    stat = _read(host, f"/proc/{pid}/stat")
    if not stat:
        return None
    # comm may hold spaces and parentheses: the fields after the last ')' are fixed.
    rest = stat.rsplit(")", 1)[-1].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def _lineage(host, pid: int) -> Iterator[int]:  # noqa: ANN001
    """*pid*, then its parents up to (not including) init, at most 64 of them (a bounded walk whatever /proc says)."""
    seen = 0
    while pid and pid > 1 and seen < 64:
        yield pid
        pid = _parent(host, pid) or 0
        seen += 1


def is_descendant(host, pid: int, ancestor: int) -> bool:  # noqa: ANN001
    """Whether *pid* is *ancestor* or below it in the process tree of *host* (at most 64 parents up)."""
    return pid == ancestor or any(p == ancestor for p in _lineage(host, pid))


def listener_belongs(host, port: int, main_pid: int | None,  # noqa: ANN001
                     found: list[Listener] | None = None) -> tuple[bool, list[Listener]]:
    """Whether every listener on *port* is *main_pid* or a descendant of it. *found*: listeners already read
    with :func:`listeners` for a set of ports including *port* (one scan for several checks)."""
    ls = listeners(host, {port}) if found is None else [x for x in found if x.port == port]
    if not ls or main_pid is None:
        return False, ls
    return all(lst.pid is not None and is_descendant(host, lst.pid, main_pid) for lst in ls), ls


def started_by(host, pid: int, markers: Iterable[str]) -> str | None:  # noqa: ANN001
    """The command line or cgroup of *pid* or of one of its ancestors (at most 64 up) that holds one of *markers*
    (a unit's name or folder), None when none does: pdctl's process supervisor runs
    ``… -m pdctl.units.supervise <state>/services/<unit>``, and systemd puts a unit's processes in ``…/<unit>``
    (``/proc/<pid>/cgroup``). Arguments are joined by spaces."""
    markers = tuple(markers)
    for p in _lineage(host, pid):
        for text in (_read(host, f"/proc/{p}/cmdline").replace("\0", " "), _read(host, f"/proc/{p}/cgroup")):
            if any(m in text for m in markers):
                return text.strip()
    return None


def applied_with(started: str) -> str | None:
    """How a deployment whose process :func:`started_by` returned *started* was applied, in words, or None where it
    does not tell: the process supervisor's folder names the state directory; the cgroup names the systemd manager
    (``user@UID.service``: a user's; ``system.slice``: the system's)."""
    if m := re.search(r"(\S+)/supervisor/services/pdctl-", started):
        return f"state directory {m.group(1)} (process supervisor)"
    if m := re.search(r"user@(\d+)\.service", started):
        return f"the systemd user manager of UID {m.group(1)}"
    if "system.slice" in started:
        return "the systemd system manager"
    return None


def started_as(host, pid: int, *, args: Iterable[str] = (), cgroups: Iterable[str] = (),  # noqa: ANN001
               not_cgroups: Iterable[str] = ()) -> bool:
    """Whether *pid* or one of its ancestors (at most 64 up) has one of *args* as a whole command-line argument, or a
    cgroup line (``/proc/<pid>/cgroup``) ending in one of *cgroups* and ending in none of *not_cgroups*: the exact
    form of :func:`started_by`, which one state directory or service manager's unit needs (``/a/st`` must not match
    ``/b/a/st``, a user manager's unit not the system manager's of the same name)."""
    args, cgroups, not_cgroups = set(args), tuple(cgroups), tuple(not_cgroups)
    for p in _lineage(host, pid):
        if args and args & set(_read(host, f"/proc/{p}/cmdline").split("\0")):
            return True
        if cgroups and any(line.endswith(cgroups) and not (not_cgroups and line.endswith(not_cgroups))
                           for line in _read(host, f"/proc/{p}/cgroup").splitlines()):
            return True
    return False


def foreign_listeners(host, ports: set[int], main_pid: int | None) -> list[Listener]:  # noqa: ANN001
    """Listeners on *ports* that are not the unit's main process (or its descendants)."""
    return held_outside(host, ports, [main_pid] if main_pid else [])


def held_outside(host, ports: set[int], main_pids: list[int]) -> list[Listener]:  # noqa: ANN001
    """Listeners on *ports* that are none of *main_pids* nor a descendant of one (all of them when the list is
    empty; those whose owner is unknown always)."""
    return [
        lst
        for lst in listeners(host, ports)
        if lst.pid is None or not any(is_descendant(host, lst.pid, pid) for pid in main_pids)
    ]
