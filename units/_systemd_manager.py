"""The systemd service manager: unit files on disk, ``systemctl`` for everything else.

``scope="system"`` is production (``/etc/systemd/system``, ``systemctl``); ``scope="user"`` is
for tests and operators without root (``~/.config/systemd/user``, ``systemctl --user``). The
``systemctl`` argv prefix and extra environment (``XDG_RUNTIME_DIR`` of a private user manager)
are injectable, which is how the test harness points it at its own manager.

Logs: a service with a ``log_path`` writes there (``StandardOutput=append:``) and :meth:`logs`
reads the file; otherwise the journal (``journalctl -u``). :meth:`~SystemdManager.follow_logs` follows the file by
offset and the journal by cursor.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Mapping, Sequence

from ._host import CommandResultLike, HostLike
from ._manager import (
    LOG_LINE_BYTES,
    OTHER_DEPLOYMENT_HINT,
    ServiceManager,
    clean_log_lines,
    current_text,
    log_lines_of,
    log_tail,
    probe_writable,
    secrets_pending,
)
from ._systemd import is_pdctl_unit, render_env_file, unit_deployment, unit_files
from ._types import ServiceStatus, UnitSet
from .errors import ForeignUnit, ManagerUnavailable, ServiceFailed, UnitDirNotWritable

__all__ = ["SystemdManager", "parse_show"]


def parse_show(text: str) -> dict[str, str]:
    """Parse ``systemctl show -p A,B`` output (``KEY=VALUE`` lines) into a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


class SystemdManager(ServiceManager):
    """Units managed by a systemd instance on *host*. See the module docstring."""

    kind = "systemd"

    def __init__(
        self,
        host: HostLike,
        *,
        scope: str = "system",
        unit_dir: str | None = None,
        systemctl: Sequence[str] = ("systemctl",),
        journalctl: Sequence[str] = ("journalctl",),
        env: Mapping[str, str] | None = None,
        command_timeout: float = 60.0,
    ) -> None:
        if scope not in ("system", "user"):
            raise ValueError(f"scope must be 'system' or 'user', not {scope!r}")
        self.host = host
        self.scope = scope
        if unit_dir is None and scope == "system":
            unit_dir = "/etc/systemd/system"
        self._unit_dir = unit_dir  # (user scope: the host's user's folder, asked of the host when first needed)
        self._systemctl = [*systemctl, *(["--user"] if scope == "user" else [])]
        self._journalctl = list(journalctl)
        self._env = dict(env) if env else {}
        self.command_timeout = command_timeout
        self._have_systemctl = False
        self._have_manager = False

    # -- helpers -----------------------------------------------------------------------------

    @property
    def unit_dir(self) -> str:
        """Where the units go: ``/etc/systemd/system``, or in user scope the folder the user manager of the host's
        user reads, ``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``; systemd.unit(5), "User Unit Search
        Path"), asked of the host once: over SSH the login's home, not that of the user running pdctl here (the
        units went to this machine's user's path there, and systemctl --user then found no such unit). Raises
        :class:`ManagerUnavailable` where the host does not say."""
        if self._unit_dir is None:
            res = self.host.run(["sh", "-c", 'printf %s "${XDG_CONFIG_HOME:-${HOME:+$HOME/.config}}"'],
                                timeout=self.command_timeout, check=False)
            base = (res.stdout or "").strip()
            if res.returncode != 0 or not base.startswith("/"):
                raise ManagerUnavailable(
                    f"cannot tell where the user units go on host {getattr(self.host, 'name', '?')}: its shell gave "
                    f"no absolute $XDG_CONFIG_HOME or $HOME (exit {res.returncode}: {(res.stderr or '').strip()[-200:]})",
                    hint="give that user a home folder (HOME) on the host, or use service_manager = \"systemd-system\"")
            self._unit_dir = posixpath.join(base, "systemd", "user")
        return self._unit_dir

    def _unit_path(self, name: str) -> str:
        return posixpath.join(self.unit_dir, name)

    def _require_systemctl(self) -> None:
        if self._have_systemctl:
            return
        exe = self._systemctl[0]
        found = self.host.exists(exe) if exe.startswith("/") else self.host.which(exe) is not None
        if not found:
            raise ManagerUnavailable(
                f"{exe} not found on host {self.host.name}: cannot manage systemd units there",
                hint="install systemd, or set service_manager = \"process\" in the spec",
            )
        self._have_systemctl = True

    def _require_manager(self) -> None:
        """A systemctl that cannot reach its manager (PID 1 is not systemd; no user manager) is
        as good as none: say so before anything is written."""
        self._require_systemctl()
        if self._have_manager:
            return
        res = self._ctl("show", "-p", "Version", check=False)
        if res.returncode != 0 or not res.stdout.startswith("Version="):
            raise ManagerUnavailable(
                f"no systemd {self.scope} manager answers on host {self.host.name}: "
                f"{(res.stderr or res.stdout).strip().splitlines()[-1:] or ['(no output)']}",
                hint=('set service_manager = "process" (or "systemd-user" with a running user manager)'
                      if self.scope == "system" else
                      "start the user's manager and keep it past logout (`loginctl enable-linger USER` as root), and "
                      "reach it with XDG_RUNTIME_DIR=/run/user/$(id -u) set; or set service_manager = \"process\""),
            )
        self._have_manager = True

    def _with_env(self, argv: list[str]) -> list[str]:
        """Extra environment travels in the argv (``env K=V systemctl …``), so it means the same
        on a local host and over SSH, and the host's own environment stays as it is."""
        return ["env", *(f"{k}={v}" for k, v in self._env.items()), *argv] if self._env else argv

    def _ctl(self, *args: str, check: bool = True, timeout: float | None = None):
        argv = self._with_env([*self._systemctl, *args])
        res = self.host.run(argv, timeout=timeout or self.command_timeout, check=False)
        if check and res.returncode != 0:
            unit = args[-1] if args else None
            raise ServiceFailed(
                f"{shlex.join(argv)} failed (exit {res.returncode}): {res.stderr.strip() or res.stdout.strip()}",
                unit=unit,
            )
        return res

    def _check_writable(self, directory: str) -> None:
        try:
            probe_writable(self.host, directory)
        except OSError as exc:
            raise UnitDirNotWritable(
                f"cannot write units to {directory} on host {self.host.name}: {exc}",
                hint="run as a user who can write there, or choose another unit directory / scope",
            ) from None

    def _check_owner(self, name: str, deployment: str | None = None) -> None:
        path = self._unit_path(name)
        if not self.host.exists(path):
            return
        text = self.host.read_file(path)
        if not is_pdctl_unit(text):
            raise ForeignUnit(
                f"{path} exists and was not written by pdctl: refusing to overwrite or remove it",
                unit=name, hint="rename the deployment, or move that unit away yourself",
            )
        owner = unit_deployment(text)
        if deployment is not None and owner is not None and owner != deployment:
            raise ForeignUnit(
                f"{path} belongs to pdctl deployment {owner!r}, not {deployment!r}: refusing to overwrite or remove "
                "it", unit=name, hint=OTHER_DEPLOYMENT_HINT)

    def installed_units_of(self, deployment: str) -> list[str]:
        try:
            names = self.host.list_dir(self.unit_dir) if self.host.exists(self.unit_dir) else []
        except (OSError, ManagerUnavailable):
            return []
        prefix = f"pdctl-{deployment}-"
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(".service")
                      and self.installed_deployment(n) == deployment)

    def installed_deployment(self, name: str) -> str | None:
        text = self.installed_text(name)
        return None if text is None else unit_deployment(text)

    def _check_shadowing(self, names: Sequence[str]) -> None:
        """A loaded unit of the same name elsewhere (e.g. /lib/systemd/system) is foreign too."""
        res = self._ctl("show", "-p", "Id,LoadState,FragmentPath", "--", *names, check=False)
        if res.returncode != 0:
            return
        for block in res.stdout.split("\n\n"):
            info = parse_show(block)
            name, frag = info.get("Id", ""), info.get("FragmentPath", "")
            if info.get("LoadState") != "loaded" or not frag or name not in names:
                continue
            if frag != self._unit_path(name) and self.host.exists(frag) and not is_pdctl_unit(self.host.read_file(frag)):
                raise ForeignUnit(
                    f"a unit named {name} is already loaded from {frag} and pdctl did not write it",
                    unit=name, hint="rename the deployment, or remove that unit yourself",
                )

    # -- ServiceManager ----------------------------------------------------------------------

    def install(self, units: UnitSet) -> list[str]:
        self._require_manager()
        files = unit_files(units, scope=self.scope)  # ValueError before any write
        secrets = {s.secrets_file: render_env_file(s.secrets, deployment=s.deployment)
                   for s in units.services if s.secrets and s.secrets_file}
        self._check_writable(self.unit_dir)
        for d in {posixpath.dirname(p) for p in secrets}:
            self._check_writable(d)
        for d in {posixpath.dirname(s.log_path) for s in units.services if s.log_path}:
            self._check_writable(d)  # StandardOutput=append: fails the start when its directory is missing
        owners = {s.name: s.deployment for s in units.services} | {units.target.name: units.target.deployment}
        for name in files:
            self._check_owner(name, owners.get(name))
        for path in secrets:
            if self.host.exists(path) and not is_pdctl_unit(self.host.read_file(path)):
                raise ForeignUnit(f"{path} exists and was not written by pdctl", unit=path)
        self._check_shadowing(list(files))

        for d in {posixpath.dirname(s.log_path) for s in units.services if s.log_path}:
            self.host.make_dirs(d)
        for path, text in secrets.items():
            self.host.make_dirs(posixpath.dirname(path), private=True)  # (not only the files 0600: the folder too)
            self.host.write_file(path, text.encode(), mode=0o600)
        changed = []
        dropped = []
        for name, text in files.items():
            path = self._unit_path(name)
            was = current_text(self.host, path)
            if was != text:
                self.host.write_file(path, text.encode(), mode=0o644)
                changed.append(name)
                # a secrets file the new unit no longer names (its [secrets] removed): remove() would never find it
                # again, and its values would stay on disk
                dropped += [p for p in _environment_files(was or "") if p not in secrets]
        for p in dropped:
            if self.host.exists(p) and is_pdctl_unit(self.host.read_file(p)):
                self.host.remove_file(p)
        if changed:
            self._ctl("daemon-reload")
        if self.target_enabled(units.target.name) is False:
            # The target's [Install] WantedBy= (multi-user.target / default.target) only takes effect once enabled:
            # without it nothing of the deployment starts at boot (or at the user manager's next start).
            self._ctl("enable", "--", units.target.name)
            if units.target.name not in changed:
                changed.append(units.target.name)
        return changed

    def enable(self, name: str) -> None:
        """``systemctl enable`` *name* (a target: its ``WantedBy=`` links, so that it starts at boot)."""
        self._require_manager()
        self._ctl("enable", "--", name)

    def target_enabled(self, name: str) -> bool | None:
        """Whether ``name`` is enabled (``systemctl is-enabled``: "enabled"); None when systemctl cannot say (no unit
        file, no manager: nothing to enable, or an error for the caller's next systemctl call to report)."""
        if not self.host.exists(self._unit_path(name)):
            return None
        try:
            res = self._ctl("is-enabled", "--", name, check=False)
        except Exception:  # the host's own errors (no systemctl, a lost SSH link): the next systemctl call reports
            return None
        state = res.stdout.strip().splitlines()[-1:] if res.stdout else []
        if state == ["enabled"]:
            return True
        return False if state and state[0] in ("disabled", "linked") else None

    def pending_changes(self, units: UnitSet) -> list[str]:
        out = []
        for name, text in unit_files(units, scope=self.scope).items():
            if current_text(self.host, self._unit_path(name)) != text:
                out.append(name)
        out += [s.name for s in units.services
                if s.secrets and s.name not in out and secrets_pending(self.host, s, s.secrets_file)]
        if units.target.name not in out and self.target_enabled(units.target.name) is False:
            out.append(units.target.name)  # installed by a pdctl that did not enable it: install() enables it
        return out

    def remove(self, names: Sequence[str], *, deployment: str | None = None) -> None:
        self._require_manager()
        present = [n for n in names if self.host.exists(self._unit_path(n))]
        for n in present:
            self._check_owner(n, deployment)
        secrets = [p for n in present for p in _environment_files(self.host.read_file(self._unit_path(n)).decode())]
        if present:
            self._ctl("stop", "--", *present, check=False, timeout=max(self.command_timeout, 300))
        targets = [n for n in present if n.endswith(".target")]
        if targets:  # the WantedBy= links enable made; a unit file removed without this leaves them dangling
            self._ctl("disable", "--", *targets, check=False)
        for n in present:
            self.host.remove_file(self._unit_path(n))
        for p in secrets:
            if self.host.exists(p) and is_pdctl_unit(self.host.read_file(p)):
                self.host.remove_file(p)
        if present:
            self._ctl("daemon-reload")
            self._ctl("reset-failed", "--", *present, check=False)

    def installed_text(self, name: str) -> str | None:
        path = self._unit_path(name)
        if not self.host.exists(path):
            return None
        text = self.host.read_file(path).decode()
        return text if is_pdctl_unit(text) else None

    def members(self, name: str) -> list[str]:
        if not name.endswith(".target"):
            return []
        for line in (self.installed_text(name) or "").splitlines():
            if line.startswith("Wants="):
                return line.removeprefix("Wants=").split()
        return []

    def _timeout_of(self, name: str, key: str, default: float) -> float:
        text = self.installed_text(name) or ""
        for line in text.splitlines():
            if line.startswith(key + "="):
                try:
                    return float(line.split("=", 1)[1])
                except ValueError:
                    break
        return default

    def start(self, name: str, *, wait: bool = False, timeout: float | None = None) -> None:
        self._require_manager()
        self._ctl("reset-failed", "--", name, check=False)
        self._ctl("start", "--no-block", "--", name)
        if wait:
            self.wait_active(name, timeout=timeout or self._timeout_of(name, "TimeoutStartSec", 3600) + 30)

    def stop(self, name: str, *, timeout: float | None = None) -> None:
        self._require_manager()
        members = self.members(name)
        t = timeout or max([self._timeout_of(n, "TimeoutStopSec", 120) for n in [name, *members]]) + 30
        # Name the members too: `systemctl stop X.target` returns once the target's own job is
        # done, not the PartOf= jobs it spawned; listed units are all waited for.
        self._ctl("stop", "--", name, *members, timeout=t)

    def restart(self, name: str, *, wait: bool = False, timeout: float | None = None) -> None:
        # Stop, waited for, then start, as the base class and the process backend do: `systemctl restart --no-block`
        # returned with the restart job queued, and the old process, still active, answered the probes that were to prove the new one
        self.stop(name)
        self._ctl("reset-failed", "--", name, check=False)  # as start() does: a unit past its start limit starts again
        self._ctl("start", "--no-block", "--", name)
        if wait:
            self.wait_active(name, timeout=timeout or self._timeout_of(name, "TimeoutStartSec", 3600) + 30)

    def status(self, name: str) -> ServiceStatus:
        # the manager, not only systemctl: without one (XDG_RUNTIME_DIR unset, no user manager) `systemctl show`
        # prints nothing, which read as "inactive" and made the deployment's own servers "another process"
        self._require_manager()
        res = self._ctl("show", "-p", "ActiveState,SubState,MainPID,NRestarts,LoadState,Result,StartLimitBurst", "--",
                        name, check=False)
        info = parse_show(res.stdout)
        pid = int(info.get("MainPID") or 0) or None
        restarts = int(info.get("NRestarts") or 0) if (info.get("NRestarts") or "").isdigit() else 0
        burst = int(info["StartLimitBurst"]) if (info.get("StartLimitBurst") or "").isdigit() else 0
        state = info.get("ActiveState") or "inactive"
        # A failed unit's SubState is "failed" too; say why, as the process backend's sub-state does: its Result
        # (exit-code, timeout, signal…), except that an automatic restart refused by the start limit keeps the
        # failure's Result (exit-code: seen with systemd 252, tests/units/test_real_systemd.py), so restarts up to
        # StartLimitBurst say start-limit-hit
        if state == "failed":
            sub = "start-limit-hit" if burst and restarts >= burst else info.get("Result") or ""
        else:
            sub = info.get("SubState", "")
        return ServiceStatus(name=name, state=state, main_pid=pid, restarts=restarts, sub_state=sub)

    def _log_file(self, name: str) -> str | None:
        """The file *name*'s installed unit appends its output to (``StandardOutput=append:``), None for the journal (or
        no unit installed)."""
        for line in (self.installed_text(name) or "").splitlines():
            if line.startswith("StandardOutput=append:"):
                return line.split(":", 1)[1]
        return None

    def logs(self, name: str, *, lines: int = 50) -> list[str]:
        path = self._log_file(name)
        if path is not None:
            if not self.host.exists(path):
                return []
            return log_tail(self.host, path, lines)
        flag = "--user-unit" if self.scope == "user" else "--unit"
        argv = [*self._journalctl, flag, name, "-n", str(lines), "--no-pager", "-o", "cat"]
        res = self.host.run(self._with_env(argv), timeout=self.command_timeout, check=False)
        if res.returncode != 0:  # (a host without journald, a user not in systemd-journal): say so, not nothing
            return [_unreadable(argv, res)]
        return clean_log_lines(res.stdout, lines)

    def follow_logs(self, name: str, mark: object = None, *, lines: int = 500) -> tuple[list[str], object, bool]:
        """As :meth:`ServiceManager.follow_logs`: every line once, however alike, across restarts of the unit. A
        service with ``StandardOutput=append:`` is followed in its file by offset (the mark: the bytes read so far), as
        the process supervisor's is; otherwise in the journal by cursor (the mark: the ``__CURSOR`` of the last entry
        read, ``""`` while the unit has none), over :attr:`host` (SSH too).

        The journal's facts relied on, as systemd 252 (252.38, Debian 12: ``systemctl --version``) shows them
        (tests/statemachine/test_day2_systemd.py, under a real journald):

        * ``journalctl -o json --output-fields=MESSAGE`` prints one object per entry with its ``__CURSOR``
          (``--output-fields``: systemd 236 or later); ``MESSAGE`` is a string, or a list of byte values where it is
          not UTF-8 or holds control characters (smg's colour codes), and ``null`` past 4096 bytes unless ``--all``.
        * ``--after-cursor C -n N`` prints the *first* N entries after C (not the last N); none: exit 0 and no
          output. (``--show-cursor`` was not used: for a unit without entries it exits 1 and prints nothing, like a
          failure.)
        * A cursor is a position in the whole journal: it holds across the unit's restarts and its removal, and the
          entries after it are every line written since, alike or not.

        So a read after a cursor asks for ``lines + 1`` entries; all of them coming means more than *lines* were
        written since, and the last *lines* are read from the journal's end instead (*missed*). A journalctl that
        fails says so as the first read's one line (as :meth:`logs`) and reads as nothing new after that, its
        cursor kept for the next read."""
        path = self._log_file(name)
        if path is not None:
            return self._follow_file(path, mark if isinstance(mark, int) and not isinstance(mark, bool) else None,
                                     lines)
        if not isinstance(mark, str):  # (None; or an offset of a unit that logged to a file until it was removed)
            got, why = self._journal(name, "-n", str(lines))
            return ([why] if why else _entry_lines(got)[-lines:]), (got[-1][0] if got else ""), False
        if mark:
            got, why = self._journal(name, "--after-cursor", mark, "-n", str(lines + 1))
        else:  # (no entry when the follow began: every one there now is new)
            got, why = self._journal(name, "-n", str(lines + 1))
        if why:
            return [], mark, False
        missed = len(got) > lines
        if missed and mark:  # (the first lines + 1 after the cursor: the newest are at the journal's end)
            tail, why = self._journal(name, "-n", str(lines))
            got = tail if tail and not why else got
        text = _entry_lines(got)
        return text[-lines:], (got[-1][0] if got else mark), missed or len(text) > lines

    def _follow_file(self, path: str, offset: int | None, lines: int) -> tuple[list[str], object, bool]:
        """:meth:`follow_logs` of a unit that appends to *path*: the lines past *offset* (None: the last *lines*), by
        byte offset. A file shorter than *offset* was emptied or truncated (logrotate's ``copytruncate``): read again
        from its start, *missed* True (what was written between the last read and the truncation is elsewhere)."""
        most = max(65536, lines * LOG_LINE_BYTES)
        try:
            if offset is None:
                data, size = self.host.read_from(path, 0, most)
                got, _ = log_lines_of(data, cut=len(data) < size)
                return got[-lines:], size - len(data) + data.rfind(b"\n") + 1, False  # (a line being written: next)
            data, size = self.host.read_from(path, offset, most)
            truncated = size < offset
            if truncated:
                offset = 0
                data, size = self.host.read_from(path, 0, most)
            got, used = log_lines_of(data, cut=len(data) < size - offset)
            return (got[-lines:], size - len(data) + used if data else offset,
                    truncated or len(data) < size - offset or len(got) > lines)
        except FileNotFoundError:  # (not written yet, or removed)
            return [], offset or 0, False

    def _journal(self, name: str, *args: str) -> tuple[list[tuple[str, str]], str | None]:
        """``([(cursor, message), ...], None)``: the journal entries of unit *name* that ``journalctl -o json ARGS``
        prints, oldest first, each message as text (bytes not UTF-8 replaced); ``([], why)`` where journalctl fails."""
        flag = "--user-unit" if self.scope == "user" else "--unit"
        argv = [*self._journalctl, flag, name, "--no-pager", "-o", "json", "--output-fields=MESSAGE", "--all", *args]
        res = self.host.run(self._with_env(argv), timeout=self.command_timeout, check=False)
        if res.returncode != 0:
            return [], _unreadable(argv, res)
        out = []
        for line in res.stdout.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            cursor, msg = (entry.get("__CURSOR"), entry.get("MESSAGE")) if isinstance(entry, dict) else (None, None)
            if not isinstance(cursor, str):
                continue
            if isinstance(msg, list):
                msg = bytes(b for b in msg if isinstance(b, int) and 0 <= b < 256).decode("utf-8", "replace")
            out.append((cursor, msg if isinstance(msg, str) else ""))
        return out, None


def _unreadable(argv: Sequence[str], res: CommandResultLike) -> str:
    """The one log line that says journalctl *argv* failed (its result *res*), in place of the lines it did not give."""
    said = (res.stderr or "").strip().splitlines()
    return f"(no log lines: {' '.join(argv)} exited {res.returncode}" + (f": {said[-1][-200:]})" if said else ")")


def _entry_lines(entries: Sequence[tuple[str, str]]) -> list[str]:
    """The log lines of journal *entries* (:func:`_journal`'s): a message may hold several; colour codes removed."""
    text = "\n".join(msg for _, msg in entries)
    return clean_log_lines(text, text.count("\n") + 1) if entries else []


def _environment_files(unit_text: str) -> list[str]:
    """The ``EnvironmentFile=`` paths of a unit file pdctl wrote (its secrets files; a leading ``-`` dropped)."""
    return [line.removeprefix("EnvironmentFile=").lstrip("-") for line in unit_text.splitlines()
            if line.startswith("EnvironmentFile=")]
