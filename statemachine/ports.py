"""Who listens on a TCP port: so that a proof is about the process pdctl started.

A ``/health`` that answers 200 proves nothing if the answer comes from another deployment that
already holds the port (the role's own process then dies with "Address already in use" while the
probe talks to the stranger). pdctl therefore checks, on the role's host:

* before an apply starts anything, that no port of any role is held outside the deployment's units
  (:func:`held_outside`); before starting a role, that none of its ports is held by a process outside the
  role's unit (:func:`foreign_listeners`); and
* in every proof, that the process listening on the role's HTTP port is the unit's main process
  or one of its descendants (:func:`listener_belongs`).

A port is "held" against a server only where the server's own bind would fail: on Linux two sockets may listen on one
TCP port when both are bound to specific, different addresses (127.0.0.1:P and 127.0.0.2:P), never when either is
bound to a wildcard (0.0.0.0, ::) or both to the same address (``bind(2)`` EADDRINUSE; ``SO_REUSEADDR`` does not lift
it for a listening socket, ``socket(7)``). Callers give each port the address the server binds it on
(:func:`bind_address`), or None where any holder of the port is in the way (:func:`in_the_way`).

Facts come from Linux's ``/proc/net/tcp``/``tcp6`` (state ``0A`` = LISTEN; the local address and port are hex),
``/proc/<pid>/fd`` socket links, ``/proc/<pid>/stat`` (parent PID) and ``/sys/kernel/cpu_byteorder`` (how the tables
print addresses), read through the host object so that an SSH host answers the same way. The parsers are pure.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Listener", "applied_with", "bind_address", "foreign_listeners", "held_outside", "in_the_way",
           "is_descendant", "listeners", "listener_belongs", "local_address", "parse_proc_net_tcp", "pdctl_unit_of",
           "started_as", "started_by"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Listener:
    port: int
    pid: int | None
    """None when the socket's owner could not be found (another user's process, a namespace)."""
    command: str = ""
    addresses: frozenset[IPAddress] | None = None
    """The local addresses its listening sockets on *port* are bound to (``0.0.0.0`` / ``::``: every address; an
    IPv4-mapped IPv6 address as its IPv4 one); None when one of them could not be read (the host's byte order
    unknown): such a listener is in the way of any bind on its port."""
    listening: bool = True
    """False for a socket bound to *port* without listening on it (:func:`listeners` with ``connections``): the local
    end of a connection, such as an outbound one given *port* as its ephemeral port, which a server's ``bind`` on it
    fails against (EADDRINUSE) as against a listener."""


def parse_proc_net_tcp(text: str, *, connections: bool = False) -> dict[str, tuple[int, str]]:
    """``{socket inode: (local port, local address field)}`` of the LISTEN sockets in a ``/proc/net/tcp*`` table; the
    address field is the table's hex, which :func:`local_address` reads. With *connections*, also the sockets a
    process holds bound to a port in any other state (a connection's local end, a socket bound and not connected),
    but not those no process holds (inode 0: TIME_WAIT and the other ends of a closed process's connections, which a
    server binding with ``SO_REUSEADDR``, as SGLang's uvicorn and smg's tokio listeners do, binds past)."""
    out: dict[str, tuple[int, str]] = {}
    for row in text.splitlines()[1:]:
        f = row.split()
        if len(f) > 9 and (f[3] == "0A" or (connections and f[3] != "06" and f[9] != "0")):
            addr, port = f[1].rsplit(":", 1)
            out[f[9]] = (int(port, 16), addr)
    return out


def local_address(field: str, byteorder: str) -> IPAddress | None:
    """The address a ``/proc/net/tcp*`` local-address *field* names, None where it cannot be read. The kernel prints
    the address as 32-bit words, each a number in the CPU's own byte order (``%08X`` of the ``__be32`` words:
    ``get_tcp4_sock`` in net/ipv4/tcp_ipv4.c, ``get_tcp6_sock`` in net/ipv6/tcp_ipv6.c), so 127.0.0.1 reads
    ``0100007F`` on a little-endian host and ``7F000001`` on a big-endian one: *byteorder* (``little`` or ``big``, as
    ``/sys/kernel/cpu_byteorder`` says) is needed. An IPv4-mapped IPv6 address (a dual-stack socket bound to
    ``::ffff:a.b.c.d``) is returned as its IPv4 address, which is what it holds."""
    if byteorder not in ("little", "big") or len(field) not in (8, 32):
        return None
    try:
        raw = b"".join(int(field[i:i + 8], 16).to_bytes(4, byteorder) for i in range(0, len(field), 8))
    except ValueError:
        return None
    ip = ipaddress.ip_address(raw)
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def bind_address(host: str) -> str | None:
    """The one address a server given *host* to bind (``--host``, smg's ``--prometheus-host``) listens on, for
    :func:`in_the_way`: an IP literal, normalised (``::ffff:127.0.0.1`` is 127.0.0.1; brackets dropped). None where
    that is every address (a wildcard: ``0.0.0.0``, ``::``, or ``""``, the unspecified address) or not known for
    sure: a host name is resolved by the server when it binds, to one address or several (aiohttp's ``TCPSite``,
    SGLang's bootstrap server, binds every address ``getaddrinfo`` gives), which pdctl does not resolve the same
    way here, so any holder of the port counts."""
    try:
        ip = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    ip = mapped if mapped is not None else ip
    return None if ip.is_unspecified else str(ip)


def in_the_way(listener: Listener, bind: str | None) -> bool:
    """Whether *listener* keeps a server from binding its port on *bind* (:func:`bind_address`; None: on every
    address, or where pdctl does not know which): a listener on a wildcard address, or on *bind* itself, is; one on
    another specific address is not (Linux lets both listen). A listener whose addresses are unknown always is."""
    if bind is None or listener.addresses is None:
        return True
    want = ipaddress.ip_address(bind)
    return any(a.is_unspecified or a == want for a in listener.addresses)


def _read(host, path: str) -> str:  # noqa: ANN001
    try:
        return host.read_file(path).decode(errors="replace")
    except OSError:
        return ""


def _shortened(command: str, limit: int = 160) -> str:
    """*command* as messages name a port's holder: whole when it fits in *limit* characters, else cut after its last
    whole argument that fits, with " …" (a cut mid-argument read as an argument: ``--kv-cache-dtype``). Control
    characters (an argument holding a newline) are written as escapes, so that the holder stays on its one line."""
    command = "".join(c if c.isprintable() else repr(c)[1:-1] for c in command)
    if len(command) <= limit:
        return command
    head = command[:limit + 1].rsplit(" ", 1)[0] if " " in command[:limit + 1] else command[:limit]
    return head + " …"


def command_line(host, pid: int) -> str:  # noqa: ANN001
    """*pid*'s command line on *host* as messages name a holder (:func:`_shortened`); "" when ``/proc`` does not
    show the process (gone, or of another PID namespace)."""
    return _shortened(_read(host, f"/proc/{pid}/cmdline").replace("\0", " ").strip())


def _addresses(fields: Iterable[str], byteorder: str) -> frozenset[IPAddress] | None:
    out = [local_address(f, byteorder) for f in fields]
    return None if any(a is None for a in out) else frozenset(a for a in out if a is not None)


def listeners(host, ports: Iterable[int], *, connections: bool = False) -> list[Listener]:  # noqa: ANN001
    """The processes listening on any of *ports* on *host* (one entry per port and PID, with the addresses its sockets
    on that port are bound to). With *connections*, also those that hold a socket bound to one of *ports* without
    listening on it (:func:`parse_proc_net_tcp`), as entries with ``listening`` False where the process does not also
    listen on that port."""
    ports = set(ports)
    inodes: dict[str, tuple[int, str]] = {}  # inode -> (port, local address field)
    listening: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = _read(host, table)
        listening |= set(parse_proc_net_tcp(text)) if connections else set()
        for inode, (port, field) in parse_proc_net_tcp(text, connections=connections).items():
            if port in ports:
                inodes[inode] = (port, field)
    if not connections:
        listening = set(inodes)
    if not inodes:
        return []
    byteorder = _read(host, "/sys/kernel/cpu_byteorder").strip()  # (Linux >= 3.15; unreadable: addresses unknown)
    # (port, pid) -> (command, address fields, whether one of those sockets listens)
    found: dict[tuple[int, int], tuple[str, set[str], list[bool]]] = {}
    owned: set[str] = set()
    for pid, inode in host.socket_links():
        if inode in inodes:
            port, field = inodes[inode]
            owned.add(inode)
            if (port, pid) not in found:
                found[(port, pid)] = (command_line(host, pid), set(), [False])
            found[(port, pid)][1].add(field)
            found[(port, pid)][2][0] |= inode in listening
    out = [Listener(port, pid, cmd, _addresses(fields, byteorder), listens[0])
           for (port, pid), (cmd, fields, listens) in found.items()]
    seen_ports = {p for p, _ in found}
    unowned: dict[int, set[str]] = {}
    for inode, (port, field) in inodes.items():
        # (a listener with no owner: being torn down, or another user's; a connection's, owned, is always found)
        if inode not in owned and port not in seen_ports and inode in listening:
            unowned.setdefault(port, set()).add(field)
    out += [Listener(p, None, "", _addresses(fields, byteorder)) for p, fields in unowned.items()]
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
                     found: list[Listener] | None = None, *, bind: str | None = None) -> tuple[bool, list[Listener]]:
    """Whether every listener on *port* that answers on *bind* (the server's bind address, :func:`bind_address`;
    None: every listener on the port) is *main_pid* or a descendant of it: a process on another specific address of
    the same port neither answers the server's clients nor keeps it from binding. *found*: listeners already read
    with :func:`listeners` for a set of ports including *port* (one scan for several checks)."""
    ls = listeners(host, {port}) if found is None else [x for x in found if x.port == port]
    ls = [x for x in ls if in_the_way(x, bind)]
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


_PDCTL_UNIT = re.compile(r"(?:^|[/\s])(pdctl-[A-Za-z0-9_.@:-]+\.service)(?=$|[/\s])")


def pdctl_unit_of(host, pid: int | None, *, other_than: Iterable[str] = ()) -> tuple[str, str] | None:  # noqa: ANN001
    """``(unit name, what started it)`` when *pid* or one of its ancestors (at most 64 up) runs for a pdctl unit
    (``pdctl-<deployment>-<role>.service``: the supervisor's folder in its command line, or the unit's cgroup) that
    is none of *other_than* (the caller's own deployment's units); None when none does, or *pid* is None. *what
    started it* is :func:`started_by`'s text, for :func:`applied_with`."""
    if pid is None:
        return None
    own = set(other_than)
    for p in _lineage(host, pid):
        for text in (_read(host, f"/proc/{p}/cmdline").replace("\0", " "), _read(host, f"/proc/{p}/cgroup")):
            if m := _PDCTL_UNIT.search(text):
                return None if m.group(1) in own else (m.group(1), text.strip())
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


def foreign_listeners(host, ports: Mapping[int, str | None], main_pid: int | None) -> list[Listener]:  # noqa: ANN001
    """Listeners in the way of *ports* (``{port: bind address}``, as for :func:`held_outside`) that are not the unit's
    main process (or its descendants)."""
    return held_outside(host, ports, [main_pid] if main_pid else [])


def held_outside(host, ports: Mapping[int, str | None], main_pids: list[int]) -> list[Listener]:  # noqa: ANN001
    """Listeners in the way of *ports* (``{port: the address the server binds it on}``, None where any listener on the
    port is: :func:`in_the_way`) that are none of *main_pids* nor a descendant of one (all of them when the list is
    empty; those whose owner is unknown always). A process holding a connection whose local port is one of *ports*
    counts (``listening`` False): the server's ``bind`` fails against it too (an outbound connection given the port
    from the host's ephemeral range, ``net.ipv4.ip_local_port_range``)."""
    return [
        lst
        for lst in listeners(host, ports, connections=True)
        if in_the_way(lst, ports[lst.port])
        and (lst.pid is None or not any(is_descendant(host, lst.pid, pid) for pid in main_pids))
    ]
