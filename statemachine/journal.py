"""The journal: what is deployed, each step's status and proof, and an append-only audit log.

A deployment's state directory holds three files:

* ``journal.json`` — the last *completed* apply's topology (``deployed``), the topology an apply
  in progress is driving towards (``target``), each step's status and proof, and a ``serial`` that
  grows with every write. Written atomically (temp file in the same directory, ``fsync``,
  ``os.replace``, ``fsync`` of the directory), so a kill at any point leaves either the old or the
  new journal, never a torn one.
* ``audit.log`` — JSON lines, appended and fsynced, never rewritten: who, when, which plan id,
  which confirmation, what happened.
* ``lock`` — held with ``flock(2)`` for the whole of an apply or a ``down``; the kernel drops it
  when its holder dies (even ``kill -9``), so a stale lock cannot block a re-run. The file's
  content names the holder (PID, user, host, command) for the refusal message.

State directory: ``--state-dir``, else ``$PDCTL_STATE_DIR``, else ``/var/lib/pdctl/<name>`` for
``systemd-system`` scope, else ``$XDG_STATE_HOME/pdctl/<name>`` (``~/.local/state/pdctl/<name>``).

A state directory that refuses a write — full (``ENOSPC``), over quota (``EDQUOT``), read-only (``EROFS``), not
permitted (``EACCES``/``EPERM``) — is one error, :class:`~pdctl.statemachine.errors.StateDirUnwritable`, naming the
directory, the file refused and the fix for that cause; such a write fails at once (the kernel does not wait for room).
Nothing is left behind by it: a temp file is removed, the journal keeps its previous content (the rename never
happened), a lock file this command created is removed, a state directory it created and left empty too. An apply
first checks that the directory has room (:meth:`Journal.check_room`: :data:`MIN_FREE_MIB` free, configurable with
``$PDCTL_STATE_MIN_FREE_MIB``, and a probe write), before it takes the lock or reaches any host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.statemachine.errors import LockHeld, PdctlError, StateDirUnwritable
from pdctl.statemachine.topology import Topology

__all__ = ["MIN_FREE_ENV", "MIN_FREE_MIB", "UNWRITABLE_ERRNOS", "Journal", "JournalState", "StepRecord", "atomic_write",
           "default_state_dir", "min_free_bytes"]

UNWRITABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""The OS's reasons a state directory refuses a write that :class:`Journal` reports as
:class:`~pdctl.statemachine.errors.StateDirUnwritable` (any other OSError, such as a file where a folder should be,
is raised as it is)."""

MIN_FREE_MIB = 8
"""The free space (MiB, for this user: ``statvfs`` ``f_bavail``) an apply wants in its state directory before it starts:
the journal is rewritten whole (a copy beside it, then a rename) at every step, the audit log grows, and under the
process supervisor every role's ``output.log`` lives there too. ``$PDCTL_STATE_MIN_FREE_MIB`` (:data:`MIN_FREE_ENV`)
sets another; 0 keeps only the probe write."""

MIN_FREE_ENV = "PDCTL_STATE_MIN_FREE_MIB"

_PROBE_BYTES = 4096
"""What :meth:`Journal.check_room` writes and removes: one block, as the journal's smallest rewrite takes."""


def min_free_bytes() -> int:
    """:data:`MIN_FREE_MIB` in bytes, or ``$PDCTL_STATE_MIN_FREE_MIB``'s (a number of MiB, fractions allowed).
    Raises :class:`PdctlError` for a value that is not a number >= 0."""
    raw = os.environ.get(MIN_FREE_ENV, "").strip()
    if not raw:
        return MIN_FREE_MIB << 20
    try:
        mib = float(raw)
        if not mib >= 0 or mib == float("inf"):
            raise ValueError
    except ValueError:
        raise PdctlError(f"{MIN_FREE_ENV}={raw!r} is not a number of MiB >= 0; nothing was changed",
                         hint=f"set it to the free space an apply wants in its state directory, in MiB (default "
                              f"{MIN_FREE_MIB}; 0: only check that it takes a write), or unset it") from None
    return int(mib * (1 << 20))


def default_state_dir(name: str, service_manager: str, *, override: str | os.PathLike[str] | None = None) -> Path:
    """Where deployment *name* keeps its journal. See the module docstring for the order."""
    if override:
        return Path(override)
    env = os.environ.get("PDCTL_STATE_DIR")
    if env:
        return Path(env)
    if service_manager == "systemd-system":
        return Path("/var/lib/pdctl") / name
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pdctl" / name


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace *path* with *data* atomically (same-directory temp file, fsync, rename, dir fsync). Raises
    :class:`IsADirectoryError` (an ``OSError``) when *path* exists and is no regular file: the rename would replace a
    device (``/dev/null``), a link or a folder instead of writing to it."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise IsADirectoryError(errno.EISDIR, "not a regular file (a device, link or folder): nothing was written",
                                str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked (a nearly full disk): never rename a truncated file in
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # a failed write (full disk, a directory at *path*) leaves no temp file behind
        if exc.filename is None:  # os.write and fsync name no file: "No space left on device" alone says not where
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


INTERRUPTED_SUMMARY = "stopped by Ctrl-C, a signal or the console while it ran (the next apply resumes it)"
"""What an ``interrupted`` step record with no words of its own means (``pdctl status`` and the console)."""


STEP_STATUSES = ("pending", "running", "done", "skipped", "failed", "interrupted")
"""What a journalled step's ``status`` can be (:class:`StepRecord`)."""


@dataclass
class StepRecord:
    """A step's last outcome: ``status`` is pending, running, done, skipped, failed or interrupted (Ctrl-C or SIGTERM
    while it ran)."""

    status: str = "pending"
    proof: dict[str, Any] | None = None
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "proof": self.proof,
            "error": self.error,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


@dataclass
class JournalState:
    """The journal's content. ``deployed``/``target`` are topologies (None: none)."""

    name: str
    serial: int = 0
    deployed: Topology | None = None
    target: Topology | None = None
    plan_id: str | None = None
    steps: dict[str, StepRecord] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    """Unit name → fingerprint of the service definition last proven running; or ``restarting`` (its new definition
    installed, its restart not yet issued; ``restarting:<fingerprint>@<PID>`` where the process still running, that
    main PID, is known to run the definition with that fingerprint) or ``started:<fingerprint>`` (started or
    restarted with that definition, not yet proven): ``pdctl.statemachine.steps`` ``RESTARTING`` and ``STARTED``."""
    removing: list[str] = field(default_factory=list)
    """Units of roles an apply drops (its earlier topologies had them, its target has not), journalled with the target
    and cleared as each is removed: a kill before they are gone loses the topology that named them, not them."""
    machine: dict[str, str] | None = None
    """The machine the deployment's units were installed on, as an apply found it: ``machine_id``
    (``/etc/machine-id``), ``hostname``, ``reached_as`` (how the spec reached it); None: not recorded."""
    updated_at: float | None = None
    generation: int = 0
    """How many applies completed with a ``deployed`` topology other than the one before (0 in journals from before
    2026-12-04): part of the plan id, so that a ``--confirm-topology`` id confirmed once does not confirm the same
    change again after the deployment went elsewhere and back (a command line replayed from a shell's history)."""
    taken_down: Topology | None = None
    """What was deployed when a ``pdctl down`` last took it all down (None: never, or a journal from before
    2026-12-04): the next plan of a first deployment names how its topology differs from it."""
    taken_down_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "name": self.name,
            "serial": self.serial,
            "deployed": self.deployed.model_dump(mode="json") if self.deployed else None,
            "target": self.target.model_dump(mode="json") if self.target else None,
            "plan_id": self.plan_id,
            "steps": {k: v.to_json() for k, v in self.steps.items()},
            "units": dict(self.units),
            "removing": list(self.removing),
            "machine": dict(self.machine) if self.machine else None,
            "updated_at": self.updated_at,
            "generation": self.generation,
            "taken_down": self.taken_down.model_dump(mode="json") if self.taken_down else None,
            "taken_down_at": self.taken_down_at,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JournalState:
        """Raises ValueError or TypeError for a field of the wrong shape (:meth:`Journal.read` says the journal is
        not readable): a hand edit pdctl would otherwise read as something it never wrote."""
        for key, kind in (("steps", dict), ("units", dict), ("removing", list)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise TypeError(f"{key!r} is a JSON {type(data[key]).__name__}, not an "
                                f"{'object' if kind is dict else 'array'}")
        for step, rec in (data.get("steps") or {}).items():
            if not isinstance(rec, dict) or rec.get("status", "pending") not in STEP_STATUSES:
                raise ValueError(f"step {step!r} has status {rec.get('status') if isinstance(rec, dict) else rec!r}, "
                                 f"not one of {', '.join(STEP_STATUSES)}")
        return cls(
            name=data["name"],
            serial=int(data.get("serial", 0)),
            deployed=Topology.model_validate(data["deployed"]) if data.get("deployed") else None,
            target=Topology.model_validate(data["target"]) if data.get("target") else None,
            plan_id=data.get("plan_id"),
            steps={k: StepRecord(**v) for k, v in (data.get("steps") or {}).items()},
            units=dict(data.get("units") or {}),
            removing=[str(u) for u in data.get("removing") or []],
            machine=dict(data["machine"]) if isinstance(data.get("machine"), dict) else None,
            updated_at=data.get("updated_at"),
            generation=int(data.get("generation") or 0),
            taken_down=Topology.model_validate(data["taken_down"]) if data.get("taken_down") else None,
            taken_down_at=data.get("taken_down_at"),
        )


class Journal:
    """A deployment's state directory: journal, audit log and lock."""

    def __init__(self, state_dir: str | os.PathLike[str], name: str) -> None:
        # absolute: the supervisor's folders under it are named on its command lines, which pdctl later recognises
        # its own processes by, whatever directory a later command runs in
        self.dir = Path(state_dir).absolute()
        self.name = name
        self.path = self.dir / "journal.json"
        self.audit_path = self.dir / "audit.log"
        self.lock_path = self.dir / "lock"
        self.recorded_as: Callable[[Topology], Topology] | None = None
        """Applied to the deployed and target topologies :meth:`read` returns: how records an older pdctl wrote
        read today (``service.journal_for`` sets it; the file is rewritten in today's form at the next write)."""

    # -- journal --------------------------------------------------------------------------------
    def read(self) -> JournalState:
        """The journal's state; an empty one when nothing was ever deployed here. Raises :class:`PdctlError` when the
        file is not a journal (pdctl writes it atomically, so only a hand edit or a damaged disk leaves it so)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._refuse_a_base()
            return JournalState(name=self.name)
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
        except (ValueError, TypeError) as exc:  # not JSON (JSONDecodeError), not an object
            raise self._unreadable(exc) from None
        if data.get("format", 1) != 1:  # before parsing: a newer pdctl's journal is not damaged; keep it
            raise PdctlError(f"journal {self.path} has format {data.get('format')!r}, which this pdctl does not know "
                             "(a newer pdctl wrote it?); nothing was changed",
                             hint="use the pdctl that wrote it, or a newer one; keep the file as it is")
        try:
            state = JournalState.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a missing field, a wrong type
            raise self._unreadable(exc) from None
        if self.recorded_as is not None:
            state.deployed = self.recorded_as(state.deployed) if state.deployed is not None else None
            state.target = self.recorded_as(state.target) if state.target is not None else None
            state.taken_down = self.recorded_as(state.taken_down) if state.taken_down is not None else None
        if state.name != self.name and not (state.deployed or state.target or state.units):
            state.name = self.name  # another deployment's, taken down: nothing of it runs, so this one may start here
        if state.name != self.name:
            # one --state-dir / PDCTL_STATE_DIR shared by two specs, or a renamed deployment: the other deployment's
            # record would be planned against this spec, its units removed as "gone roles" without a confirmation
            raise PdctlError(
                f"state directory {self.dir} holds the journal of deployment {state.name!r}, not {self.name!r}; "
                "nothing was changed",
                hint="give each deployment its own --state-dir (PDCTL_STATE_DIR names one deployment's directory, not "
                     f"a base like XDG_STATE_HOME); to rename {state.name!r}, `pdctl down` it under its old name first",
            )
        return state

    def _unreadable(self, exc: Exception) -> PdctlError:
        return PdctlError(
            f"journal {self.path} is not a readable pdctl journal ({type(exc).__name__}: {exc}); nothing was changed",
            hint=f"restore it from a backup, or move it aside to start over (pdctl then takes nothing as deployed, and "
                 f"the next apply must confirm taking over the units still installed; the audit log {self.audit_path} "
                 "says what ran)",
        )

    def write(self, state: JournalState) -> JournalState:
        """Write *state* atomically with the next serial; returns it. Raises
        :class:`~pdctl.statemachine.errors.StateDirUnwritable` where the state directory refuses it (the file keeps
        its previous content, and *state* its serial)."""
        now = time.time()
        data = json.dumps({**state.to_json(), "serial": state.serial + 1, "updated_at": now}, indent=1,
                          sort_keys=True).encode()
        try:
            atomic_write(self.path, data)
        except OSError as exc:
            raise self.unwritable(exc, self.path) from exc
        state.serial += 1
        state.updated_at = now
        return state

    # -- a state directory that refuses writes ----------------------------------------------------
    refused: StateDirUnwritable | None = None
    """The last refusal this journal raised (None: none): the command is failing of it, and :meth:`audit` then loses a
    record quietly rather than hide that error behind a second one of the same cause."""

    def unwritable(self, exc: OSError, path: Path | None = None, *, doing: str = "") -> OSError:
        """*exc* (a write into the state directory that failed) as :class:`StateDirUnwritable` where its ``errno`` is
        one of :data:`UNWRITABLE_ERRNOS` — naming the directory, *path* (the file refused, else ``exc.filename``) and
        the fix — else *exc* itself, its ``filename`` set to *path* where the OS named none. *doing*: words after the
        reason (``; nothing was changed``)."""
        if isinstance(exc, StateDirUnwritable):
            return exc
        where = str(path) if path is not None else exc.filename
        if exc.errno not in UNWRITABLE_ERRNOS:
            if exc.filename is None and where is not None:
                return OSError(exc.errno, exc.strerror, where)
            return exc
        reason = exc.strerror or os.strerror(exc.errno or 0)
        err = StateDirUnwritable(
            f"state directory {self.dir} cannot be written ({where or self.dir}: {reason}){doing}",
            state_dir=str(self.dir), filename=where, errno=exc.errno, strerror=reason,
            hint=_fix_for(exc.errno, self.dir))
        self.refused = err
        return err

    def check_room(self, min_free: int | None = None) -> None:
        """Raise :class:`StateDirUnwritable` unless the state directory — or, where it does not exist yet, the nearest
        folder above it that does (nothing is created here) — has *min_free* bytes free for this user (default
        :func:`min_free_bytes`) and takes a write: a probe file of one block written, fsynced and removed, which a
        read-only file system, a quota used up or a folder of another user refuse while ``statvfs`` shows room. Bounded:
        each call fails or returns at once. An apply calls it before its lock, its plan or any host."""
        need = min_free_bytes() if min_free is None else min_free
        d = self.dir
        while not d.exists() and d.parent != d:
            d = d.parent
        if not d.is_dir():  # (a file in the way: _make_dir names it)
            return
        try:
            st = os.statvfs(d)
        except OSError:
            return  # (said by the lock or the journal's own write, as before this check)
        if st.f_flag & os.ST_RDONLY:  # (said as such, not as the room it has)
            raise self.unwritable(OSError(errno.EROFS, os.strerror(errno.EROFS)), d, doing="; nothing was changed")
        free = st.f_bavail * st.f_frsize
        if free < need and st.f_blocks:  # (no blocks at all: procfs and the like, which the write below refuses)
            raise self.unwritable(
                OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {_size(free)} free, an apply wants at least "
                                      f"{_size(need)} there, {MIN_FREE_ENV}"), d, doing="; nothing was changed")
        probe = d / f".pdctl-room.{os.getpid()}.tmp"  # (a kill mid-probe: removed by the next lock, as any temp file)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"\0" * _PROBE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in UNWRITABLE_ERRNOS:
                raise self.unwritable(exc, d, doing="; nothing was changed") from exc
            # (any other refusal, a folder the OS will not create files in, is said by the lock's own write)
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()

    _BASE_SCAN = 256
    """Entries of a journal-less state directory looked at for other deployments' journals (a bound: it may be /tmp)."""

    def _refuse_a_base(self) -> None:
        """Raise :class:`PdctlError` when the state directory has no journal of its own but folders holding other
        deployments' journals: it is their base (``--state-dir`` given ``…/pdctl`` rather than ``…/pdctl/<name>``).
        Planned against it, every deployment there would read as not deployed; a ``down`` would leave its lock and
        audit log beside theirs. At most :attr:`_BASE_SCAN` entries are looked at."""
        try:
            entries = [e for _, e in zip(range(self._BASE_SCAN), os.scandir(self.dir))]
        except OSError:  # not there yet (a first apply creates it), or not a readable folder
            return
        held = sorted(e.name for e in entries if e.is_dir() and Path(e.path, "journal.json").is_file())
        try:  # (or the base of those bases: --state-dir given what XDG_STATE_HOME names, which holds pdctl/<name>)
            held += sorted(e.name for _, e in zip(range(self._BASE_SCAN), os.scandir(self.dir / "pdctl"))
                           if e.is_dir() and Path(e.path, "journal.json").is_file())
            mine = self.dir / "pdctl" / self.name
        except OSError:
            mine = self.dir / self.name
        if held:
            raise PdctlError(
                f"state directory {self.dir} has no journal of its own but holds the state directories of "
                f"{', '.join(map(repr, held[:5]))}{' …' if len(held) > 5 else ''}: it is their base, not the "
                f"directory of deployment {self.name!r}; nothing was changed",
                hint=f"give --state-dir {mine}" + (" (it is there)" if self.name in held else
                                                    " or the directory this deployment was applied with"),
            )

    # -- audit ----------------------------------------------------------------------------------
    def _make_dir(self) -> None:
        # The state directory, created on first use; a file in its way is named with the fix (not "File exists").
        # A base of other deployments' directories is refused before anything is written into it.
        if not self.path.exists():
            self._refuse_a_base()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PdctlError(f"state directory {self.dir}: a file is in the way",
                             hint="give --state-dir (or PDCTL_STATE_DIR / XDG_STATE_HOME) a directory") from None
        except OSError as exc:
            raise self.unwritable(exc, self.dir) from exc

    def audit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one audit record (who, when, what) and fsync it."""
        record = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "epoch": time.time(),
            "user": _user(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "event": event,
            **fields,
        }
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            self._make_dir()
            fd = os.open(self.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    if os.write(fd, line) != len(line):  # (a nearly full disk: part of the line)
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    os.fsync(fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)  # no torn line left behind (the log keeps its previous content)
                    raise
            finally:
                os.close(fd)
        except OSError as exc:
            if self.refused is not None and exc.errno in UNWRITABLE_ERRNOS:
                return record  # (the command already fails of this directory: that error is the one to say)
            raise self.unwritable(exc, self.audit_path) from exc
        return record

    def audit_records(self) -> list[dict[str, Any]]:
        try:
            lines = self.audit_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):  # a line torn by a kill mid-append
                out.append(json.loads(line))
        return out

    def last_audit(self, events: Iterable[str], *, tail_bytes: int = 1 << 16) -> dict[str, Any] | None:
        """The newest audit record whose ``event`` is one of *events*, looked for in the log's last *tail_bytes*
        (a status poll must not read a years-long log); None when there is none there or the log cannot be read."""
        wanted = set(events)
        try:
            with self.audit_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            with contextlib.suppress(json.JSONDecodeError):  # the first line cut by the seek, or torn by a kill
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") in wanted:
                    return record
        return None

    # -- lock -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, purpose: str) -> Iterator[None]:
        """Hold the deployment's lock; raise :class:`LockHeld` naming the holder if taken. Taking over a lock whose
        holder died without releasing it (its record is still in the lock file) is audited as ``lock-abandoned``
        with that record: the audit log then says how an apply or down killed before recording its end ended."""
        self.refused = None  # (a refusal of an earlier command on this Journal: the console keeps one across applies)
        made_dir = not self.dir.exists()
        self._make_dir()
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            made = True
        except FileExistsError:
            made = False
            try:
                fd = os.open(self.lock_path, os.O_RDWR, 0o644)
            except OSError as exc:
                raise self.unwritable(exc, self.lock_path, doing="; nothing was changed") from exc
        except OSError as exc:
            self._unmake(made_dir)
            raise self.unwritable(exc, self.lock_path, doing="; nothing was changed") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.lock_holder() or {}
                argv = holder.get("argv") if isinstance(holder.get("argv"), list) else []
                # (its command line: two specs sharing one state directory lock each other, under either's name)
                prog = str(argv[0]) if argv else ""
                prog = "python -m pdctl" if prog.endswith("pdctl/__main__.py") else os.path.basename(prog)
                cmd = f", `{' '.join([prog, *map(str, argv[1:])])[:200]}`" if argv[1:] else ""
                who = (f"PID {holder.get('pid', '?')} ({holder.get('user', '?')}@{holder.get('host', '?')}: "
                       f"{holder.get('purpose', '?')}{cmd})")
                raise LockHeld(f"deployment {self.name!r} (state directory {self.dir}) is locked by {who} since "
                               f"{holder.get('since', '?')}", holder=holder) from None
            info = {
                "pid": os.getpid(),
                "user": _user(),
                "host": socket.gethostname(),
                "purpose": purpose,
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "argv": sys.argv,
            }
            try:
                abandoned = self.lock_holder()  # a release empties the file: a record left means a holder killed
                if abandoned:
                    self.audit("lock-abandoned", holder=abandoned, taken_by=purpose)
                record = json.dumps(info).encode()
                os.ftruncate(fd, 0)
                if os.pwrite(fd, record, 0) != len(record):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            except OSError as exc:
                # Taken, but its holder cannot be recorded: released, and the file this call created removed (still
                # holding it: another command that opened it meanwhile found it held, LockHeld, and went away)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                if made:
                    with contextlib.suppress(OSError):
                        self.lock_path.unlink()
                    self._unmake(made_dir)
                raise self.unwritable(exc, self.lock_path, doing="; nothing was changed") from exc
            self._remove_stale_temps()
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _unmake(self, made_dir: bool) -> None:
        # the state directory this command created, left empty by a refusal: removed (its parents stay)
        if made_dir:
            with contextlib.suppress(OSError):
                self.dir.rmdir()

    def _remove_stale_temps(self) -> None:
        # An atomic_write killed before its rename (SIGKILL, a reboot) leaves ``.NAME.PID.tmp`` beside the file: those
        # of processes that no longer run are removed by the next lock holder (a live PID's may be a write in flight)
        for p in self.dir.glob(".*.*.tmp"):
            pid = p.name[:-len(".tmp")].rpartition(".")[2]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                p.unlink(missing_ok=True)
            except OSError:
                pass  # (another user's process: it runs)

    def lock_holder(self) -> dict[str, Any] | None:
        """What the lock file says of its last holder (``pid``, ``user``, ``host``, ``purpose``, ``since``,
        ``argv``), or None. A holder killed with SIGKILL leaves this behind: see :meth:`held_by`."""
        try:
            raw = self.lock_path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            return None

    def held_by(self, proc_locks: str = "/proc/locks") -> dict[str, Any] | None:
        """The lock's holder while the lock is really held, else None; never takes the lock (a test lock
        could refuse a concurrent apply). Held means: the kernel lists a ``FLOCK`` on the lock file's inode
        in *proc_locks* (proc(5)) for the PID the file names. Without a readable *proc_locks*, the named PID
        being alive is taken as held."""
        holder = self.lock_holder()
        if not holder or not isinstance(holder.get("pid"), int):
            return None
        try:
            st = os.stat(self.lock_path)
        except FileNotFoundError:
            return None
        try:
            text = Path(proc_locks).read_text()
        except OSError:  # no /proc/locks (a restricted container)
            return holder if _pid_alive(holder["pid"]) else None
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in text.splitlines():
            f = line.split()
            # "1: FLOCK  ADVISORY  WRITE 12345 fd:01:1234567 0 EOF"; waiters carry "->" after the number
            if len(f) >= 6 and f[1] == "FLOCK" and f[4] == str(holder["pid"]) and f[5].lower() == dev:
                return holder
        return None


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _fix_for(err: int | None, d: Path) -> str:
    """The fix for a state directory *d* that refuses writes with *err* (:data:`UNWRITABLE_ERRNOS`)."""
    other = "or give another --state-dir / PDCTL_STATE_DIR; then run the command again"
    if err == errno.ENOSPC:
        return (f"free space on the file system holding {d} (`df -h {d}`; an apply wants {_size(_min_free_or_default())} "
                f"free there before it starts, {MIN_FREE_ENV}), {other}")
    if err == errno.EDQUOT:
        return f"the disk quota of {_user()} on {d} is used up (`quota -s`): free some of it, {other}"
    if err == errno.EROFS:
        return (f"{d} is on a read-only file system (`findmnt -T {d}`): remount it read-write (after a disk error, "
                f"check the disk first), {other}")
    return (f"make {d} writable by {_user()} (its permissions; `lsattr -d {d}` shows an immutable flag, which "
            f"`chattr -i` clears), or run as the user that owns it, {other}")


def _min_free_or_default() -> int:
    try:
        return min_free_bytes()
    except PdctlError:
        return MIN_FREE_MIB << 20


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        return str(os.getuid())
