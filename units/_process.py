"""pdctl's embedded process supervisor: the service manager where no systemd runs.

Shape
-----
``pdctl apply`` is short-lived, so it cannot own the roles' processes. Instead :meth:`start`
spawns, per role, a small detached **watchdog** (``python -m pdctl.units.supervise DIR``, its own
session) that owns that role until told to stop:

* it waits until every service the role ``requires`` is *active* (the router waits for both
  servers' readiness, as ``Wants=``/``After=`` do under systemd; a server that failed fails the
  router's start here, where systemd starts it and its own readiness gate waits);
* it starts the role with the same argv and environment a unit would give it (a clean base
  environment — ``PATH``, ``HOME``, ``LANG``… — plus the spec's env and the secrets file), in its
  **own process group**, output appended to ``output.log``, CPU affinity and ``RLIMIT_MEMLOCK``
  applied, PID in ``main.pid``;
* it polls the readiness URL; the role is ``active`` only after the first 200 (the same gate as
  the systemd units' ``ExecStartPost=``), and a gate that exceeds ``timeout_start_s`` is a
  failed start;
* on a non-zero exit (or a kill) it restarts the role after ``restart_sec``, at most
  ``start_limit_burst`` starts per ``start_limit_interval_s`` — then ``failed``, like systemd's
  start limit; a clean exit 0 is not restarted (``Restart=on-failure``);
* it is the process group's reaper: it marks itself a child subreaper, so orphans of the role
  come back to it, and on exit it kills the role's whole group (SIGTERM, ``timeout_stop_s``,
  SIGKILL) and any orphan left, so stopping leaves nothing running.

:meth:`stop` sends SIGTERM to the watchdog (after checking ``/proc/PID/cmdline`` really is that
watchdog — PIDs are reused) and waits, bounded; if the watchdog itself was killed, it stops the
role's process group directly: the group's members while its leader is still the process the watchdog
started (its start time, ``/proc/PID/stat`` field 22, is recorded in ``main.start``), else only processes
whose environment carries ``PDCTL_UNIT=<unit name>`` (set for every role; a process that rewrites its
title, as smg does, may leave its environ unreadable) — never a group whose id was reused. State lives in
``STATE_DIR/services/<unit name>/``: ``unit.json`` (marked ``"managed_by": "pdctl"``), ``status.json``
(written atomically by the watchdog), ``watchdog.pid``, ``main.pid``, ``main.start``, ``output.log`` (past
``supervise.LOG_MAX_BYTES`` copied to ``output.log.1`` and emptied; :meth:`remove` keeps both as
``STATE_DIR/removed/<unit name>.log[.1]``), ``supervise.log``. A damaged or missing ``watchdog.pid`` / ``main.pid`` of a unit ``status.json`` calls running
hides nothing, nor does a ``main.pid`` naming some other process (its start time is not ``main.start``'s): the
watchdog is found by its command line, the main process as its child carrying ``PDCTL_UNIT``, or, with the watchdog
gone too, as the process-group leader whose environment carries ``PDCTL_UNIT`` and ``PDCTL_UNIT_DIR`` (the unit's
folder: another state directory's role of the same name is never taken) or, where its environment reads empty (smg
rewrites its title over it), whose start time is ``main.start``'s or, that gone too, whose working directory is the
unit's folder. A damaged ``status.json``, or one deleted
while PID files remain, reads as not known, and the processes are looked for, never as ``inactive``.

Placement matches the units: ``CPUAffinity=`` is ``sched_setaffinity``, ``NUMAPolicy=bind`` +
``NUMAMask=`` is ``set_mempolicy(MPOL_BIND)`` (x86-64, aarch64), ``LimitMEMLOCK=infinity`` is
``setrlimit`` — each applied in the child before exec, best effort (a CPU list or node the machine
lacks is ignored, as it must not stop a laptop demo). Differences from systemd: nothing brings
the roles back after a reboot (run ``pdctl apply`` again). As under systemd, a restart of a
server does not restart the router: it sees the worker leave and come back.
"""

from __future__ import annotations

import json
import posixpath
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence

from ._host import HostLike
from ._manager import (
    LOG_LINE_BYTES,
    OTHER_DEPLOYMENT_HINT,
    ServiceManager,
    current_text,
    log_lines_of,
    log_tail,
    probe_writable,
    secrets_pending,
)
from ._systemd import render_env_file
from ._types import STATUS_UNWRITTEN, SUPERVISOR_STOPPED, ServiceSpec, ServiceStatus, UnitSet
from .errors import ForeignUnit, ServiceFailed, ServiceTimeout, UnitDirNotWritable

__all__ = ["SUPERVISOR_LINE", "ProcessSupervisor", "parse_env_file"]

WATCHDOG_MODULE = "pdctl.units.supervise"
UNIT_ENV = "PDCTL_UNIT"
"""Set to the unit name in every role's environment: how a stop recognises the role's processes."""
UNIT_DIR_ENV = "PDCTL_UNIT_DIR"
"""Set to the unit's folder (``STATE_DIR/services/<unit name>``) in every role's environment: with ``PDCTL_UNIT``,
how a role whose watchdog and PID files are gone is told from another state directory's role of the same name."""
SUPERVISOR_TAG = "pdctl-supervise"
"""How the watchdog signs its own lines in a role's ``output.log``: ``pdctl-supervise[PID]: message``."""
SUPERVISOR_LINE = re.compile(rf"^{SUPERVISOR_TAG}\[\d+\]: ")
"""Matches the watchdog's own lines (what it did to the role, never the role's output)."""
STATUS_UNWRITTEN_COMM = "pdctl-unwritten"
"""The name (``/proc/PID/comm``, 15 bytes at most) a watchdog gives itself while its ``status.json`` cannot be written
(a full, read-only or over-quota state directory), until it is written again: :meth:`ProcessSupervisor.status` then
says sub-state :data:`~pdctl.units.STATUS_UNWRITTEN`, not supervised, rather than the stale file's state, which an
apply would wait on until its start timeout."""


def parse_env_file(text: str) -> dict[str, str]:
    """Parse the ``KEY='v'`` / ``KEY="v"`` file :func:`render_env_file` writes (systemd's rules for
    those two forms: single quotes literal, double quotes with ``\\`` escaping ``\\ " ` $``)."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
            continue
        if c in "#;":
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        j = text.find("=", i)
        if j < 0:
            break
        key = text[i:j].strip()
        i = j + 1
        if i < n and text[i] == "'":
            k = text.index("'", i + 1)
            val, i = text[i + 1:k], k + 1
        elif i < n and text[i] == '"':
            buf, i = [], i + 1
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n:
                    nxt = text[i + 1]
                    if nxt == "\n":
                        pass
                    elif nxt in '\\"`$':
                        buf.append(nxt)
                    else:
                        buf.append("\\" + nxt)
                    i += 2
                    continue
                buf.append(text[i])
                i += 1
            val, i = "".join(buf), i + 1
        else:
            j = text.find("\n", i)
            j = n if j < 0 else j
            val, i = text[i:j].strip(), j
        out[key] = val
    return out


_PID_FILES = ("watchdog.pid", "main.pid", "main.start")
_REMOVED = "removed"
"""The follow mark of a unit's log read to its end after the unit was removed (:meth:`ProcessSupervisor.follow_logs`)."""
"""The files a watchdog's start writes and :meth:`ProcessSupervisor.stop` removes: one left means never stopped."""


def _proc_state(stat: bytes) -> str:
    """State letter of a ``/proc/PID/stat`` line (after the command name's closing paren)."""
    rest = stat[stat.rfind(b")") + 2:]
    return rest[:1].decode() if rest else "?"


def process_stopped(host: HostLike, pid: int | None) -> bool:
    """Whether process *pid* on *host* is stopped by a signal (``kill -STOP``) or held by a tracer: ``T``/``t`` in
    its ``/proc/PID/stat`` (proc(5)). False where there is no *pid* or its file cannot be read."""
    try:
        return bool(pid) and _proc_state(host.read_file(f"/proc/{pid}/stat")) in ("T", "t")
    except OSError:
        return False


def _proc_ppid(stat: bytes) -> int:
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 else -1


def _proc_pgrp(stat: bytes) -> int:
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[2]) if len(fields) > 2 else -1


def _proc_starttime(stat: bytes) -> int:
    """Start time of a ``/proc/PID/stat`` line in clock ticks since boot (field 22, proc(5)); −1 if absent.
    With the PID it names one process for good: a reused PID gets a later start time."""
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else -1


def _unit_text(body: dict) -> str:
    """A unit's ``unit.json`` as written."""
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


class ProcessSupervisor(ServiceManager):
    """Roles as supervised process groups under *state_dir* on *host*. See the module docstring.

    *python* is the interpreter that runs the watchdogs (it must import ``pdctl``); default: the
    one running pdctl.
    """

    kind = "process"

    def __init__(self, host: HostLike, *, state_dir: str, python: str | None = None, poll_s: float = 0.2) -> None:
        self.host = host
        self.state_dir = state_dir
        self.python = python or sys.executable
        self.poll_s = poll_s
        self._canonical: dict[str, str] = {}

    # -- files -------------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"bad unit name {name!r}")
        return posixpath.join(self.state_dir, "services", name)

    def _read_json(self, path: str) -> dict | None:
        try:
            return json.loads(self.host.read_file(path))
        except (FileNotFoundError, ValueError):
            return None

    def _unit(self, name: str) -> dict:
        data = self._read_json(posixpath.join(self._dir(name), "unit.json"))
        if not data or data.get("managed_by") != "pdctl":
            raise ServiceFailed(f"{name} is not installed under {self.state_dir}", unit=name)
        return data

    def _spec(self, name: str) -> ServiceSpec:
        data = self._unit(name)
        if data.get("kind") != "service":
            raise ValueError(f"{name} is a target, not a service")
        return ServiceSpec.from_json(data["service"])

    def _read_pid(self, name: str, which: str) -> int | None:
        try:
            return int(self.host.read_file(posixpath.join(self._dir(name), which)).decode().strip() or 0) or None
        except (FileNotFoundError, ValueError):
            return None

    def _watchdog_pid(self, name: str) -> int | None:
        """The PID of *name*'s watchdog while it runs: ``watchdog.pid``'s, else, where that file is damaged or gone
        while ``status.json`` says the unit runs (or cannot be read), the process whose command line is ``python -m
        pdctl.units.supervise <the unit's folder>`` (one scan of ``/proc``). None: none runs."""
        pid = self._read_pid(name, "watchdog.pid")
        if self._is_watchdog(pid, name):
            return pid
        st = self._status_record(name)
        if st.get("state") not in ("activating", "active", "deactivating"):
            return None
        return next(iter(self._watchdogs_of(name)), None)

    def _watchdogs_of(self, name: str) -> list[int]:
        """The live processes whose command line is ``python -m pdctl.units.supervise <name's folder>`` (one scan of
        ``/proc``), whatever the folder holds."""
        return [e for e, cmd in self.host.proc_files("cmdline").items()
                if self._watches(cmd.split(b"\0"), name) and self._alive(e)]

    def _watches(self, args: list[bytes], name: str) -> bool:
        """Whether the command line *args* (split at NULs) is ``python -m pdctl.units.supervise <name's folder>``: the
        folder as this manager names it, or by another path to the same folder (a state directory reached through a
        link, ``/var/lib/pdctl`` → ``/data/pdctl``), which the host's ``readlink -f`` tells."""
        if WATCHDOG_MODULE.encode() not in args:
            return False
        if self._dir(name).encode() in args:
            return True
        folder = posixpath.normpath((args[-1] or args[-2]).decode(errors="replace")) if len(args) > 1 else ""
        return posixpath.basename(folder) == name and \
            self._real(posixpath.dirname(folder)) == self._real(posixpath.join(self.state_dir, "services"))

    def _real(self, path: str) -> str:
        """*path* with every link resolved on the host (``readlink -f``; remembered), or as given where that fails."""
        path = posixpath.normpath(path)
        if path not in self._canonical:
            try:
                res = self.host.run(["readlink", "-f", path], timeout=10, check=False)
            except OSError:
                return path
            if res.returncode != 0 or not res.stdout.strip():
                return path
            self._canonical[path] = res.stdout.strip()
        return self._canonical[path]

    def running_elsewhere(self, deployment: str) -> list[tuple[str, str, int]]:
        prefix = f"pdctl-{deployment}-".encode()
        here = posixpath.normpath(posixpath.join(self.state_dir, "services"))
        found = []
        for e, cmd in self.host.proc_files("cmdline").items():
            args = cmd.split(b"\0")
            if WATCHDOG_MODULE.encode() not in args or not self._alive(e):
                continue
            folder = args[-1].decode(errors="replace") if args[-1] else args[-2].decode(errors="replace")
            unit = posixpath.basename(posixpath.normpath(folder))
            if unit.encode().startswith(prefix) and unit.endswith(".service") \
                    and posixpath.dirname(posixpath.normpath(folder)) != here:
                found.append((unit, folder, e))
        # (the same folder by another path, a link: not elsewhere)
        return [(u, f, e) for u, f, e in found if self._real(posixpath.dirname(posixpath.normpath(f))) != self._real(here)]

    def _group_leaders(self) -> Iterator[tuple[int, bytes, bytes]]:
        """``(pid, stat, environ)`` of each live process-group leader whose ``/proc`` files this user can read: where a
        role's main process is looked for once its PID files are gone (the watchdog starts it in its own group)."""
        leaders = {e: stat for e, stat in self.host.proc_files("stat").items()
                   if _proc_pgrp(stat) == e and _proc_state(stat) not in ("Z", "X")}
        envs = self.host.proc_files("environ", sorted(leaders)) if leaders else {}
        for e, stat in leaders.items():
            # (an environment that reads empty, smg's, is one over SSH that was left out: both read b"")
            yield e, stat, envs.get(e, b"")

    def _main_pid(self, name: str, wpid: int | None) -> int | None:
        """The PID of *name*'s main process while it runs: ``main.pid``'s while that names the process the watchdog
        started (:meth:`_is_main`); else — the file damaged, emptied or naming some other process — where
        ``status.json`` says the unit runs (or cannot be read): the child of its watchdog *wpid* carrying
        ``PDCTL_UNIT=<name>``; with no watchdog, the ``main_pid`` the watchdog last wrote to ``status.json`` if it is
        still the unit's, else the process-group leader whose environment carries both ``PDCTL_UNIT=<name>`` and
        ``PDCTL_UNIT_DIR=<this unit's folder>`` (so never another state directory's role of the same name). None:
        none runs."""
        pid = self._read_pid(name, "main.pid")
        if self._alive(pid) and self._is_main(pid, name):
            return pid
        st = self._status_record(name)
        if st.get("state") not in ("activating", "active", "deactivating"):
            return None
        tag = f"{UNIT_ENV}={name}".encode()
        if wpid is not None:
            children = {e: stat for e, stat in self.host.proc_files("stat").items() if _proc_ppid(stat) == wpid}
            envs = self.host.proc_files("environ", sorted(children)) if children else {}
            for e, stat in children.items():
                env = envs.get(e, b"")
                # (the watchdog's child that leads its group is its role: smg's environment reads empty)
                if tag in env.split(b"\0") or (not env.strip(b"\0") and _proc_pgrp(stat) == e):
                    return e
            return None
        last = st.get("main_pid")
        if isinstance(last, int) and last > 0 and self._alive(last) and self._is_main(last, name):
            return last
        where = f"{UNIT_DIR_ENV}={posixpath.normpath(self._dir(name))}".encode()
        recorded = self._recorded_start(name)
        for e, stat, env in self._group_leaders():
            if env.strip(b"\0"):
                if tag in env.split(b"\0") and where in env.split(b"\0"):
                    return e
            # (an environment that reads empty: smg rewrites its title over it) its start time, else its folder
            elif _proc_starttime(stat) == recorded if recorded >= 0 else self._in_unit_folder(e, name):
                return e
        return None

    def _recorded_start(self, name: str) -> int:
        """The start time ``main.start`` records for *name*'s main process (``/proc/PID/stat`` field 22); −1 where the
        file is gone or damaged."""
        try:
            return int(self.host.read_file(posixpath.join(self._dir(name), "main.start")).decode().strip())
        except (OSError, ValueError):
            return -1

    def _in_unit_folder(self, pid: int, name: str) -> bool:
        """*pid* works in *name*'s folder, where the watchdog starts a role that names no ``working_dir``: how a role
        whose environment reads empty is told from another process once ``main.start`` is gone too. False for a role
        with a ``working_dir`` (that folder may be anyone's) and where the link cannot be read."""
        try:
            if self._spec(name).working_dir:
                return False
            r = self.host.run(["readlink", "-f", f"/proc/{pid}/cwd", self._dir(name)], timeout=10, check=False)
        except (ServiceFailed, ValueError, OSError, TimeoutError):
            return False
        lines = r.stdout.splitlines()
        return r.returncode == 0 and len(lines) == 2 and lines[0] == lines[1]

    def _is_main(self, pid: int, name: str) -> bool:
        """*pid* (alive) is the main process *name*'s watchdog started: its start time is the one in ``main.start``;
        where that file is gone or damaged, its environment carries ``PDCTL_UNIT=<name>``, or, where its environment
        reads empty (smg rewrites its title over it), it leads its own process group in the unit's folder
        (:meth:`_in_unit_folder`)."""
        try:
            stat = self.host.read_file(f"/proc/{pid}/stat")
        except OSError:
            return False
        recorded = self._recorded_start(name)
        if recorded >= 0:
            return _proc_starttime(stat) == recorded
        try:
            env = self.host.read_file(f"/proc/{pid}/environ")
        except OSError:
            return False  # (another user's process)
        if env.strip(b"\0"):
            return f"{UNIT_ENV}={name}".encode() in env.split(b"\0")
        return _proc_pgrp(stat) == pid and self._in_unit_folder(pid, name)

    def _status_record(self, name: str) -> dict:
        """*name*'s ``status.json`` as its watchdog last wrote it; ``{}`` where there is none (never started, or
        stopped by :meth:`stop`). One that is there but does not read as JSON (truncated, damaged) says nothing of the
        state: it reads ``activating`` with sub-state ``status-unreadable``, so that the watchdog and main process are
        looked for (:meth:`status` then says ``active`` while both run), never a silent ``inactive``."""
        d = self._dir(name)
        path = posixpath.join(d, "status.json")
        st = self._read_json(path)
        if isinstance(st, dict):
            return st
        # (gone while a PID file :meth:`stop` removes is still there: deleted under a running role, not stopped)
        if self.host.exists(path) or any(self.host.exists(posixpath.join(d, f)) for f in _PID_FILES):
            return {"state": "activating", "sub": "status-unreadable", "updated": 0}
        # (gone with the PID files, where a watchdog once ran (its logs): deleted, maybe under a running role; nothing
        # found running, it reads inactive — the PID files that say it was never stopped are gone too)
        if any(self.host.exists(posixpath.join(d, f)) for f in ("supervise.log", "output.log")):
            return {"state": "activating", "sub": "status-unreadable", "updated": 0, "ran": True}
        return {}

    def _write_status(self, name: str, state: str, sub: str, **extra: object) -> None:
        body = {"state": state, "sub": sub, "updated": time.time(), **extra}
        self.host.write_file(posixpath.join(self._dir(name), "status.json"), json.dumps(body).encode())

    # -- processes ---------------------------------------------------------------------------

    def _alive(self, pid: int | None) -> bool:
        if not pid:
            return False
        try:
            return _proc_state(self.host.read_file(f"/proc/{pid}/stat")) not in ("Z", "X", "?")
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:
            return False

    def _stopped(self, pid: int | None) -> bool:
        return process_stopped(self.host, pid)

    def _is_watchdog(self, pid: int | None, name: str) -> bool:
        if not self._alive(pid):
            return False
        try:
            cmd = self.host.read_file(f"/proc/{pid}/cmdline").split(b"\0")
        except OSError:
            return False
        return self._watches(cmd, name)

    def _group_members(self, pgid: int, name: str) -> list[int]:
        """Live members of process group *pgid*, the role's: all of them while the group's leader is the
        process the watchdog started (same start time as recorded in ``main.start``; that file gone, the leader
        :meth:`_is_main`), else those that carry ``PDCTL_UNIT=<name>`` in their environment — so a PID (and group
        id) reused by someone else is never signalled."""
        tag = f"{UNIT_ENV}={name}".encode()
        recorded = self._recorded_start(name)
        try:
            # (main.start gone: a live leader that is the role's main process by its environment or folder)
            leader_ours = _proc_starttime(self.host.read_file(f"/proc/{pgid}/stat")) == recorded if recorded >= 0 \
                else self._alive(pgid) and self._is_main(pgid, name)
        except OSError:
            leader_ours = False
        members = sorted(e for e, st in self.host.proc_files("stat").items()
                         if _proc_pgrp(st) == pgid and _proc_state(st) not in ("Z", "X"))
        if leader_ours or not members:
            return members
        envs = self.host.proc_files("environ", members)
        return [e for e in members if tag in envs.get(e, b"").split(b"\0")]

    def _wait_gone(self, check, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not check():
                return True
            time.sleep(self.poll_s)
        return not check()

    # -- ServiceManager ----------------------------------------------------------------------

    def install(self, units: UnitSet) -> list[str]:
        root = posixpath.join(self.state_dir, "services")
        try:
            probe_writable(self.host, root)
        except OSError as exc:
            raise UnitDirNotWritable(f"cannot write supervisor state to {root} on host {self.host.name}: {exc}",
                                     hint="choose a writable state directory") from None
        bodies = self._bodies(units)
        installed: dict[str, dict | None] = {}  # (read once: over SSH each read is a round trip)
        for name in bodies:
            existing = installed[name] = self._read_json(posixpath.join(self._dir(name), "unit.json"))
            path = posixpath.join(self._dir(name), "unit.json")
            if self.host.exists(path) and (existing is None or existing.get("managed_by") != "pdctl"):
                raise ForeignUnit(f"{path} exists and was not written by pdctl: refusing to overwrite it", unit=name)
            owner, wanted = _owner(existing or {}), _owner(bodies[name])
            if owner is not None and wanted is not None and owner != wanted:
                raise ForeignUnit(f"{path} belongs to pdctl deployment {owner!r}, not {wanted!r}: refusing to "
                                  "overwrite it", unit=name, hint=OTHER_DEPLOYMENT_HINT)
        changed = []
        for s in units.services:
            if s.secrets:
                path = bodies[s.name]["service"]["secrets_file"]
                self.host.make_dirs(posixpath.dirname(path), private=True)  # (not only the files 0600: the folder too)
                self.host.write_file(path, render_env_file(s.secrets, deployment=s.deployment).encode(), mode=0o600)
        for name, body in bodies.items():
            text = _unit_text(body)
            path = posixpath.join(self._dir(name), "unit.json")
            if current_text(self.host, path) != text:
                old = installed.get(name)
                self.host.make_dirs(self._dir(name))
                self.host.write_file(path, text.encode(), mode=0o600)
                changed.append(name)
                # a secrets file the new definition no longer names (its [secrets] removed, or moved with the state
                # directory): remove() would never find it again, and its values would stay on disk
                was = (old or {}).get("service", {}).get("secrets_file")
                if was and was != body.get("service", {}).get("secrets_file") and self.host.exists(was):
                    self.host.remove_file(was)
        return changed

    def _bodies(self, units: UnitSet) -> dict[str, dict]:
        """What install() writes as each unit's ``unit.json`` (secret values go to the 0600 secrets file only)."""
        bodies: dict[str, dict] = {}
        for s in units.services:
            spec = s.to_json()
            spec["secrets"] = []
            if s.secrets:
                spec["secrets_file"] = s.secrets_file or posixpath.join(self._dir(s.name), "secrets.env")
            bodies[s.name] = {"managed_by": "pdctl", "kind": "service", "service": spec,
                              "secret_keys": [k for k, _ in s.secrets]}
        t = units.target
        bodies[t.name] = {"managed_by": "pdctl", "kind": "target",
                          "target": {"name": t.name, "description": t.description,
                                     "deployment": t.deployment, "wants": list(t.wants)}}
        return bodies

    def pending_changes(self, units: UnitSet) -> list[str]:
        bodies = self._bodies(units)
        out = []
        for name, body in bodies.items():
            if current_text(self.host, posixpath.join(self._dir(name), "unit.json")) != _unit_text(body):
                out.append(name)
        out += [s.name for s in units.services
                if s.name not in out and secrets_pending(self.host, s, bodies[s.name]["service"].get("secrets_file"))]
        return out

    def remove(self, names: Sequence[str], *, deployment: str | None = None) -> None:
        present = []
        for n in names:
            path = posixpath.join(self._dir(n), "unit.json")
            if not self.host.exists(path):
                continue
            data = self._read_json(path)
            if not data or data.get("managed_by") != "pdctl":
                raise ForeignUnit(f"{path} was not written by pdctl: refusing to remove it", unit=n)
            owner = _owner(data)
            if deployment is not None and owner is not None and owner != deployment:
                raise ForeignUnit(f"{path} belongs to pdctl deployment {owner!r}, not {deployment!r}: refusing to "
                                  "remove it", unit=n, hint=OTHER_DEPLOYMENT_HINT)
            present.append((n, data))
        for n, data in present:
            if data.get("kind") == "service":
                self._stop_service(n, None)
        for n, data in present:
            d = self._dir(n)
            sf = data.get("service", {}).get("secrets_file")
            if sf and self.host.exists(sf):
                self.host.remove_file(sf)
            if data.get("kind") == "service":
                self._keep_log(n)
            for e in self.host.list_dir(d) if self.host.exists(d) else []:
                self.host.remove_file(posixpath.join(d, e))
            self.host.run(["rmdir", d], timeout=10, check=False)

    def _kept_log(self, name: str, generation: str = "") -> str:
        """Where :meth:`remove` keeps *name*'s ``output.log`` (*generation* ``".1"``: its ``output.log.1``):
        ``STATE_DIR/removed/<unit>.log``, outside every unit's folder, replaced by the next removal."""
        self._dir(name)  # (the name's check)
        return posixpath.join(self.state_dir, "removed", f"{name}.log{generation}")

    def _keep_log(self, name: str) -> None:
        """Move the unit's logs aside before its folder goes: under systemd the journal keeps a removed unit's lines,
        and the log of a role that failed is what says why, after ``pdctl down`` too. Best effort."""
        d = self._dir(name)
        for generation in ("", ".1"):
            src, dst = posixpath.join(d, "output.log" + generation), self._kept_log(name, generation)
            try:
                if self.host.exists(src):
                    self.host.make_dirs(posixpath.dirname(dst))
                    self.host.run(["mv", "-f", "--", src, dst], timeout=30, check=False)
                elif self.host.exists(dst):  # (no such generation now: an older one would read as this run's)
                    self.host.remove_file(dst)
            except OSError:
                pass

    def installed_units_of(self, deployment: str) -> list[str]:
        root = posixpath.join(self.state_dir, "services")
        try:
            names = self.host.list_dir(root) if self.host.exists(root) else []
        except OSError:
            return []
        prefix = f"pdctl-{deployment}-"
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(".service")
                      and self.installed_deployment(n) == deployment)

    def installed_deployment(self, name: str) -> str | None:
        data = self._read_json(posixpath.join(self._dir(name), "unit.json"))  # (None when absent)
        return _owner(data) if data and data.get("managed_by") == "pdctl" else None

    def unit_file_not_pdctls(self, name: str) -> str | None:
        path = posixpath.join(self._dir(name), "unit.json")
        return path if self.host.exists(path) and self.installed_text(name) is None else None

    def installed_text(self, name: str) -> str | None:
        path = posixpath.join(self._dir(name), "unit.json")
        if not self.host.exists(path):
            return None
        data = self._read_json(path)
        return self.host.read_file(path).decode() if data and data.get("managed_by") == "pdctl" else None

    def members(self, name: str) -> list[str]:
        data = self._unit(name)
        return list(data["target"]["wants"]) if data["kind"] == "target" else []

    def start(self, name: str, *, wait: bool = False, timeout: float | None = None) -> None:
        data = self._unit(name)
        if data["kind"] == "target":
            wants = list(data["target"]["wants"])
            for s in wants:
                self._start_service(s, set())
            if wait:
                t = timeout or max(self._spec(s).timeout_start_s for s in wants) + 30
                self.wait_active(name, timeout=t)
            return
        self._start_service(name, set())
        if wait:
            self.wait_active(name, timeout=timeout or self._spec(name).timeout_start_s + 30)

    def _start_service(self, name: str, seen: set[str]) -> None:
        if name in seen:
            return
        seen.add(name)
        spec = self._spec(name)
        for r in spec.requires:
            self._start_service(r, seen)
        wpid = self._watchdog_pid(name)
        if wpid is not None and self._status_record(name).get("state") == "deactivating":
            # Being stopped (a stop begun by a down or an apply since interrupted): systemd queues the start job
            # behind the running stop job, which its manager carries to the end (TimeoutStopSec, then SIGKILL). The
            # watchdog is this unit's manager: the stop is finished as stop() would (SIGCONT too: a watchdog frozen
            # by kill -STOP mid-stop acts on it; SIGKILL after the timeout), then the unit starts anew.
            self._stop_service(name, None)
            wpid = None
        if wpid is not None:  # (its watchdog.pid damaged: still the one that runs, not a second)
            return
        d = self._dir(name)
        self._write_status(name, "activating", "spawning", restarts=0)
        pid = self.host.spawn_detached([self.python, "-m", WATCHDOG_MODULE, d],
                                       log_path=posixpath.join(d, "supervise.log"), cwd=d)
        self.host.write_file(posixpath.join(d, "watchdog.pid"), f"{pid}\n".encode())

    def stop(self, name: str, *, timeout: float | None = None) -> None:
        if self.installed_text(name) is None:
            return  # nothing installed, nothing running under this name
        data = self._unit(name)
        if data["kind"] == "target":
            for s in reversed(data["target"]["wants"]):
                if self.installed_text(s) is not None:  # (a folder removed by hand: stop_orphans is for that)
                    self._stop_service(s, timeout)
            return
        self._stop_service(name, timeout)

    def stop_orphans(self, name: str, *, timeout: float = 60.0) -> list[int]:
        """The watchdog and role of *name* still running once its folder is gone (``rm -rf`` under a running role):
        found in one scan of ``/proc`` — a watchdog by its command line (``python -m pdctl.units.supervise <the
        folder>``), a role as a process-group leader whose environment carries ``PDCTL_UNIT=<name>`` and
        ``PDCTL_UNIT_DIR=<the folder>`` or, where it reads empty (smg), that works in the deleted folder — and stopped
        as :meth:`stop` does (SIGTERM then SIGCONT; SIGKILL after *timeout*). The same for a folder that holds its
        ``unit.json`` and nothing else (the watchdog's files and logs deleted under it: nothing says it ran, so
        :meth:`status` reads it inactive). The PIDs stopped; ``[]`` while the unit is installed with any record of its
        watchdog (:meth:`stop` is for that), or while a ``unit.json`` that is not pdctl's is there (damaged: apply refuses
        it before anything, :meth:`unit_file_not_pdctls`)."""
        if self.unit_file_not_pdctls(name) is not None or (self.installed_text(name) is not None
                                                           and self._status_record(name)):
            return []
        d = posixpath.normpath(self._dir(name))
        try:  # (the cwd link of a process holds the resolved path: the folder's parent resolved, and its name)
            r = self.host.run(["readlink", "-f", posixpath.dirname(d)], timeout=10, check=False)
            real = posixpath.join(r.stdout.strip(), posixpath.basename(d)) if r.returncode == 0 else d
        except (OSError, TimeoutError):
            real = d
        tag, where = f"{UNIT_ENV}={name}".encode(), f"{UNIT_DIR_ENV}={d}".encode()
        watchdogs, roles = self._watchdogs_of(name), []
        for e, _stat, env in self._group_leaders():
            if e in watchdogs:
                continue
            if env.strip(b"\0"):
                if tag in env.split(b"\0") and where in env.split(b"\0"):
                    roles.append(e)
                continue
            try:
                r = self.host.run(["readlink", f"/proc/{e}/cwd"], timeout=10, check=False)
            except (OSError, TimeoutError):
                continue
            if r.returncode == 0 and r.stdout.rstrip("\n") in (d, real, f"{d} (deleted)", f"{real} (deleted)"):
                roles.append(e)
        for w in watchdogs:  # (a watchdog stops its role on SIGTERM, as for any stop)
            self.host.signal(w, signal.SIGTERM)
            self.host.signal(w, signal.SIGCONT)
        for pid in roles:
            self.host.signal(pid, signal.SIGTERM, group=True)
            self.host.signal(pid, signal.SIGCONT, group=True)
        for pid in [*watchdogs, *roles]:
            if not self._wait_gone(lambda pid=pid: self._alive(pid), timeout):
                self.host.signal(pid, signal.SIGKILL, group=pid in roles)
                self._wait_gone(lambda pid=pid: self._alive(pid), 5)
        return [*watchdogs, *roles]

    def _stop_service(self, name: str, timeout: float | None) -> None:
        spec = self._spec(name)
        t = timeout or spec.timeout_stop_s + 15
        wpid = self._watchdog_pid(name)
        # (read before the watchdog is stopped: damaged main.pid, its main process is found as the watchdog's child)
        mpid = self._main_pid(name, wpid)
        if wpid is not None:
            self.host.signal(wpid, signal.SIGTERM)
            self.host.signal(wpid, signal.SIGCONT)  # (a stopped watchdog, kill -STOP or ^Z: it acts on the TERM now)
            if not self._wait_gone(lambda: self._alive(wpid), t):
                self.host.signal(wpid, signal.SIGKILL)
                self._wait_gone(lambda: self._alive(wpid), 5)
        if mpid and self._group_members(mpid, name):
            # The watchdog is gone (killed) but the role's group lives on: stop it directly.
            self.host.signal(mpid, signal.SIGTERM, group=True)
            self.host.signal(mpid, signal.SIGCONT, group=True)  # as systemd does: a stopped group can act on it
            if not self._wait_gone(lambda: bool(self._group_members(mpid, name)), min(t, 30)):
                self.host.signal(mpid, signal.SIGKILL, group=True)
                if not self._wait_gone(lambda: bool(self._group_members(mpid, name)), 5):
                    raise ServiceTimeout(f"{name}: process group {mpid} survived SIGKILL", unit=name)
        d = self._dir(name)
        for f in _PID_FILES:
            p = posixpath.join(d, f)
            if self.host.exists(p):
                self.host.remove_file(p)
        st = self._read_json(posixpath.join(d, "status.json")) or {}
        self._write_status(name, "inactive", "dead", restarts=st.get("restarts", 0))

    def status(self, name: str) -> ServiceStatus:
        try:
            data = self._unit(name)
        except ServiceFailed:
            return ServiceStatus(name=name, state="inactive", sub_state="not-found")
        if data["kind"] == "target":
            states = [self.status(s).state for s in data["target"]["wants"]]
            if states and all(s == "active" for s in states):
                state = "active"
            elif "failed" in states:
                state = "failed"
            elif any(s in ("activating", "active", "deactivating") for s in states):
                state = "activating"
            else:
                state = "inactive"
            return ServiceStatus(name=name, state=state, sub_state=",".join(states))
        st = self._status_record(name)
        state, sub = st.get("state", "inactive"), st.get("sub", "dead")
        wpid = self._watchdog_pid(name)
        mpid = self._main_pid(name, wpid)
        if state in ("activating", "active", "deactivating") and not self._alive(wpid):
            if sub == "spawning" and time.time() - float(st.get("updated", 0)) < 10:
                pass  # the watchdog is being born
            elif self._alive(mpid):
                sub = "unsupervised"
            elif st.get("ran"):
                state, sub = "inactive", "dead"
            else:
                state, sub = "failed", "watchdog-gone"
        elif state in ("activating", "active") and self._stopped(wpid) and self._alive(mpid):
            sub = SUPERVISOR_STOPPED  # (it lives, but restarts nothing and marks nothing ready until continued)
        elif state in ("activating", "active", "deactivating") and self._unwritten(wpid):
            sub = STATUS_UNWRITTEN  # (what status.json says is stale: its watchdog cannot write it)
        main = mpid if self._alive(mpid) else None
        if st.get("sub") == "status-unreadable" and main is not None:
            # (readiness unknown: its server runs, supervised or not; the watchdog's next transition rewrites the file)
            state = "active"
        return ServiceStatus(name=name, state=state, main_pid=main, restarts=int(st.get("restarts", 0)), sub_state=sub,
                             supervised=sub not in ("unsupervised", SUPERVISOR_STOPPED, STATUS_UNWRITTEN))

    def _unwritten(self, wpid: int | None) -> bool:
        """Whether watchdog *wpid* names itself :data:`STATUS_UNWRITTEN_COMM`: it cannot write its ``status.json``."""
        if not wpid:
            return False
        try:
            return self.host.read_file(f"/proc/{wpid}/comm").strip() == STATUS_UNWRITTEN_COMM.encode()
        except OSError:
            return False

    def follow_logs(self, name: str, mark: object = None, *, lines: int = 500) -> tuple[list[str], object, bool]:
        """As :meth:`ServiceManager.follow_logs`, by offset in ``output.log`` (the mark is its byte count read so
        far): every line is read once, however alike. Emptied past its limit (its size below the mark), the rest of
        the old lines are read from ``output.log.1`` (the copy), then the new file from its start."""
        if mark == _REMOVED:
            return [], mark, False
        d = self._dir(name)
        path, kept = posixpath.join(d, "output.log"), posixpath.join(d, "output.log.1")
        most = max(65536, lines * LOG_LINE_BYTES)
        try:
            if mark is None and not self.host.exists(path) and self.host.exists(self._kept_log(name)):
                return self.logs(name, lines=lines), _REMOVED, False  # (removed: its kept log, to its end)
            if mark is None:
                data, size = self.host.read_from(path, 0, most)
                got, _ = log_lines_of(data, cut=len(data) < size)
                end = size - len(data) + data.rfind(b"\n") + 1  # (a line still being written: the next read's)
                return got[-lines:], end, False
            offset = int(mark)  # type: ignore[call-overload]
            data, size = self.host.read_from(path, offset, most)
            if size >= offset:
                got, used = log_lines_of(data, cut=len(data) < size - offset)
                return got[-lines:], size - len(data) + used if data else offset, \
                    len(data) < size - offset or len(got) > lines
            # emptied since (copied to output.log.1 first): the old file's rest, then the new one's start
            old, old_size = self.host.read_from(kept, offset, most) if self.host.exists(kept) else (b"", 0)
            before, _ = log_lines_of(old if old.endswith(b"\n") or not old else old + b"\n",
                                     cut=len(old) < old_size - offset)
            data, size = self.host.read_from(path, 0, most)
            got, used = log_lines_of(data, cut=len(data) < size)
            missed = old_size < offset or len(old) < old_size - offset or len(data) < size \
                or len(before) + len(got) > lines
            return (before + got)[-lines:], size - len(data) + used, missed
        except FileNotFoundError:  # (removed: taken down; its last lines from the log remove() kept, then no more)
            if mark is None:
                return [], 0, False
            try:
                data, size = self.host.read_from(self._kept_log(name), int(mark), most)  # type: ignore[call-overload]
            except FileNotFoundError:
                return [], mark, False
            got, _ = log_lines_of(data if data.endswith(b"\n") or not data else data + b"\n",
                                  cut=len(data) < size - int(mark))  # type: ignore[call-overload]
            return got[-lines:], _REMOVED, False  # (read to its end: nothing more comes)

    def logs(self, name: str, *, lines: int = 50) -> list[str]:
        """The last *lines* lines of ``output.log``, led by the end of ``output.log.1`` (its lines before the
        watchdog last emptied it) where it holds fewer; of a unit removed, those :meth:`remove` kept."""
        d = self._dir(name)
        path, kept = posixpath.join(d, "output.log"), posixpath.join(d, "output.log.1")
        if not self.host.exists(path):  # (removed: the log :meth:`remove` kept, if any)
            path, kept = self._kept_log(name), self._kept_log(name, ".1")
            if not self.host.exists(path):
                return []
        got = log_tail(self.host, path, lines)
        if len(got) < lines and self.host.exists(kept):
            try:
                got = log_tail(self.host, kept, lines - len(got)) + got
            except FileNotFoundError:  # (replaced meanwhile by the next copy)
                pass
        return got


def _owner(data: dict) -> str | None:
    """The deployment a ``unit.json`` (a service's or a target's) was written for."""
    body = data.get("service") if data.get("kind") == "service" else data.get("target")
    owner = body.get("deployment") if isinstance(body, dict) else None
    return owner if isinstance(owner, str) else None
