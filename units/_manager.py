"""The one interface in front of systemd and pdctl's own process supervisor.

Callers (the state machine's steps) never branch on the concrete manager: a step installs a
:class:`~pdctl.units.UnitSet`, starts a unit, waits for it to be ``active`` (which, for both
managers, means "past its readiness gate"), reads its main PID and recent log lines, stops it.
Names are unit names (``pdctl-demo-prefill.service``, ``pdctl-demo.target``) for both managers.

Every method is bounded: nothing waits without a timeout, and a wait that runs out raises
:class:`~pdctl.units.errors.ServiceTimeout`.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from ._host import HostLike
from ._systemd import render_env_file
from ._types import ServiceSpec, ServiceStatus, UnitSet
from .errors import ServiceFailed, ServiceTimeout

__all__ = ["LOG_LINE_BYTES", "ServiceManager", "clean_log_lines", "log_lines_of", "log_tail", "new_lines", "probe_writable"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def clean_log_lines(text: str, lines: int) -> list[str]:
    """The last *lines* lines of *text*, terminal colour codes removed (smg colours its log
    even when it is not a terminal)."""
    return [_ANSI.sub("", line) for line in text.splitlines()[-lines:]] if lines > 0 else []


LOG_LINE_BYTES = 4096
"""The most bytes read from a log's end per line asked for (SGLang's longest lines, its ``server_args`` dump, run to a
few KB; most are near 150 bytes)."""


def new_lines(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """``(lines to append, reset)`` to turn a view showing the tail *old* into the tail *new*.

    Both are the last N lines of a growing log; *new* is *old* shifted by the lines written since.
    Finds the shift where ``old[d:] == new[:len(old) - d]``; when none fits (rotated or
    truncated log), ``reset`` is True and everything in *new* is to be shown afresh. Lines alone cannot tell a line
    written again from one shown already (a log of one repeated line reads unchanged): right for a view of the tail,
    which looks the same either way; a follow that prints each line once reads by offset
    (:meth:`ServiceManager.follow_logs`)."""
    if not old:
        return new, False
    if old == new:
        return (), False
    n = len(old)
    for d in range(n):
        k = n - d
        if k <= len(new) and old[d] == new[0] and old[d:] == new[:k]:
            return new[k:], False
    return new, True


def log_lines_of(data: bytes, *, cut: bool) -> tuple[list[str], int]:
    """The whole lines of log bytes *data* (:func:`clean_log_lines`), and how many bytes they take: a last line
    still being written (no newline yet) is left for the next read. *cut*: *data* starts inside the file, so its
    first line may be a part of one, left out (its bytes counted)."""
    end = data.rfind(b"\n") + 1  # (0: no line complete yet)
    start = data.find(b"\n") + 1 if cut else 0
    if start >= end:  # (none, or only the cut line's end)
        return [], end
    text = data[start:end].decode("utf-8", "replace")
    return clean_log_lines(text, text.count("\n")), end


def log_tail(host: HostLike, path: str, lines: int) -> list[str]:
    """The last *lines* lines of the log file *path* on *host* (:func:`clean_log_lines`), reading only its end: 64 KiB
    or 256 bytes a line, doubled while that holds fewer lines, up to ``lines × LOG_LINE_BYTES``. A role's log grows
    for as long as it serves (hundreds of MB a day for a busy SGLang server's request lines), and the console asks
    for its end every second. A line cut by where the read starts is left out. ``FileNotFoundError`` for a missing
    file."""
    if lines <= 0:
        return []
    want, most = max(65536, lines * 256), max(65536, lines * LOG_LINE_BYTES)
    while True:
        data = host.read_tail(path, want)
        cut = len(data) >= want  # (the read began inside the file: its first line may be a part of one)
        if cut:
            data = data[data.find(b"\n") + 1:]
        if not cut or want >= most or data.count(b"\n") >= lines:
            return clean_log_lines(data.decode("utf-8", "replace"), lines)
        want = min(most, want * 2)


OTHER_DEPLOYMENT_HINT = ("rename this deployment (its name) or the role, so that its unit names (pdctl-NAME-ROLE) "
                         "differ from the other deployment's; or `pdctl down` that one first, if it is no longer wanted")
"""The fix for a unit name that another pdctl deployment's unit has already."""


def current_text(host: HostLike, path: str) -> str | None:
    """*path*'s text on *host* now, None when it is absent (what install() compares its rendering with)."""
    return host.read_file(path).decode() if host.exists(path) else None


def secrets_pending(host: HostLike, service: ServiceSpec, path: str | None) -> bool:
    """Whether install() would rewrite *service*'s secrets file at *path* (None: it has none)."""
    return bool(path) and current_text(host, path) != render_env_file(service.secrets, deployment=service.deployment)


def probe_writable(host: HostLike, directory: str) -> None:
    """Raise ``OSError`` unless *directory* could be written — without creating it: the probe
    (a file written then removed) goes into the nearest ancestor that exists, so a refusal
    leaves no trace. An ancestor that is not a directory fails the probe."""
    import os
    import posixpath

    d = directory.rstrip("/") or "/"
    while not host.exists(d):
        parent = posixpath.dirname(d)
        if parent == d:
            break
        d = parent
    probe = posixpath.join(d, f".pdctl-write-probe-{os.getpid()}")
    host.write_file(probe, b"", mode=0o600)
    host.remove_file(probe)


class ServiceManager(ABC):
    """Install, remove, start, stop, restart and observe a deployment's services on one host."""

    kind: ClassVar[str]
    """``"systemd"`` or ``"process"``."""

    host: HostLike

    @abstractmethod
    def install(self, units: UnitSet) -> list[str]:
        """Write (or refresh) every unit of *units*; return the names whose content changed.

        Checks everything first — the manager is there, the directory is writable, no unit of
        the same name was written by someone else — and only then writes, so a refusal changes
        nothing. Raises ManagerUnavailable, UnitDirNotWritable, ForeignUnit, ValueError (a value
        that cannot be rendered)."""

    @abstractmethod
    def pending_changes(self, units: UnitSet) -> list[str]:
        """The units whose definition :meth:`install` would change now: the unit's file, or a service's secrets file
        (read once, at its start). Writes nothing. A running one of them keeps its old definition until restarted."""

    @abstractmethod
    def remove(self, names: Sequence[str], *, deployment: str | None = None) -> None:
        """Stop and delete the named units (and their secrets files). Missing ones are skipped;
        a foreign one (or, with *deployment*, one another pdctl deployment installed) raises ForeignUnit before
        anything is removed."""

    @abstractmethod
    def installed_text(self, name: str) -> str | None:
        """The installed definition of *name* as pdctl wrote it, or None when absent."""

    def installed_deployment(self, name: str) -> str | None:
        """The pdctl deployment whose definition of *name* is installed (the one that wrote it), or None when none
        is. Unit names are ``pdctl-NAME-ROLE``, so two deployments can name one unit alike (``hX`` with a role
        ``a-prefill``, ``hX-a`` with ``prefill``): one must never take over or remove the other's."""
        return None

    def installed_units_of(self, deployment: str) -> list[str]:
        """The services (``pdctl-<deployment>-*.service``, not its target) that *deployment* installed under this
        manager, whatever a journal records: a lost journal must not hide them. Sorted; ``[]`` where the manager's
        folder is absent or unreadable."""
        return []

    def running_elsewhere(self, deployment: str) -> list[tuple[str, str, int]]:
        """``(unit, folder, watchdog PID)`` of each service of *deployment* that runs from another folder than this
        manager's (the same deployment applied with another state directory: a second copy beside it). ``[]`` for a
        manager whose units have one place on the host (systemd's)."""
        return []

    def unit_file_not_pdctls(self, name: str) -> str | None:
        """The path of *name*'s unit file where one is there that pdctl did not write as it stands (damaged: not the
        JSON it writes, or written by hand), which :meth:`install` refuses to overwrite; None where there is none or
        it is pdctl's. A manager whose install overwrites its files (systemd's, which it checks there) has none."""
        return None

    @abstractmethod
    def start(self, name: str, *, wait: bool = False, timeout: float | None = None) -> None:
        """Start a unit (a target starts its services; a service starts what it requires
        first). With *wait*, return only once it is active; raise ServiceFailed if it fails and
        ServiceTimeout after *timeout* seconds (default: the unit's start timeout)."""

    @abstractmethod
    def stop(self, name: str, *, timeout: float | None = None) -> None:
        """Stop a unit and every process it started, within *timeout* seconds (default: the
        unit's stop timeout plus a margin). A stopped unit is a no-op."""

    def stop_orphans(self, name: str, *, timeout: float = 60.0) -> list[int]:
        """Stop what still runs for a unit that is no longer installed (its files removed by hand while it ran), within
        *timeout* seconds; the PIDs stopped. A manager whose units cannot outlive their files (systemd) has none."""
        return []

    def restart(self, name: str, *, wait: bool = False, timeout: float | None = None) -> None:
        """Stop then start (see :meth:`stop`, :meth:`start`)."""
        self.stop(name)
        self.start(name, wait=wait, timeout=timeout)

    @abstractmethod
    def status(self, name: str) -> ServiceStatus:
        """What the manager sees of *name* now (``inactive`` for an unknown unit)."""

    def is_active(self, name: str) -> bool:
        """True when *name* is started and past its readiness gate."""
        return self.status(name).is_active

    def main_pid(self, name: str) -> int | None:
        """PID of the service's main process, None when it has none."""
        return self.status(name).main_pid

    @abstractmethod
    def logs(self, name: str, *, lines: int = 50) -> list[str]:
        """The last *lines* lines the service wrote (stdout and stderr), oldest first."""

    def follow_logs(self, name: str, mark: object = None, *, lines: int = 500) -> tuple[list[str], object, bool]:
        """One read of a log being followed, ``(lines, mark, missed)``: with *mark* None the last *lines* lines and a
        mark at the log's end; else the lines written since *mark* was made, at most *lines* of them, and *missed*
        True where more were written or the log was emptied or rotated so that some are lost. This default compares
        the last *lines* lines with the previous read's (:func:`new_lines`), which cannot tell a line written again
        from one shown already; managers whose logs are files read by offset instead."""
        got = tuple(self.logs(name, lines=lines))
        if mark is None:
            return list(got), got, False
        fresh, reset = new_lines(mark, got)  # type: ignore[arg-type]
        return list(fresh), got, reset and bool(got)

    def members(self, name: str) -> list[str]:
        """The services a target groups (``[]`` for a service)."""
        return []

    def wait_active(self, name: str, *, timeout: float, poll_s: float = 0.25) -> ServiceStatus:
        """Poll until *name* is active — for a target, until every service it groups is (a
        systemd target turns active even when a service it merely wants failed). Raises
        ServiceFailed when one fails (or ends inactive) and ServiceTimeout after *timeout*
        seconds, each carrying recent log lines."""
        deadline = time.monotonic() + timeout
        for member in self.members(name):
            self.wait_active(member, timeout=max(0.0, deadline - time.monotonic()), poll_s=poll_s)
        seen_activating = False
        while True:
            st = self.status(name)
            if st.state == "active":
                return st
            if st.state == "failed" or (st.state == "inactive" and seen_activating):
                log = self._safe_logs(name)
                raise ServiceFailed(f"{name} {st.state} ({st.sub_state}) while starting", unit=name, log=log,
                                    hint="; ".join(log[-3:]) or None)
            seen_activating = seen_activating or st.state in ("activating", "reloading")
            if time.monotonic() >= deadline:
                raise ServiceTimeout(f"{name} not active after {timeout:g} s (state {st.state}/{st.sub_state})",
                                     unit=name)
            time.sleep(poll_s)

    def _safe_logs(self, name: str) -> list[str]:
        try:
            return self.logs(name, lines=20)
        except Exception:  # noqa: BLE001 - logs are a courtesy inside an error message
            return []
