"""Hosts: every action pdctl takes on a machine goes through one of these.

A :class:`Host` is a small fixed surface — run a command, read / write (atomically) / remove a
file, look at a directory, find an executable, spawn a detached process, signal a process — so
that the service managers (``pdctl.units``, which sees hosts only through its ``HostLike``
protocol), probes and steps never care whether the machine is this one (:class:`LocalHost`) or
one reached over SSH (``pdctl.statemachine.ssh.SshHost``, same methods). Reading ``/proc`` and
sysfs is ``read_file``/``read_text`` on those paths.

Errors: a command that cannot be started raises :class:`~pdctl.statemachine.errors.HostError`; a
non-zero exit raises :class:`~pdctl.statemachine.errors.CommandFailed` only with ``check=True``
(and carries argv, exit status and stderr); a command that outlives its timeout is killed (its
whole process group) and raises :class:`~pdctl.statemachine.errors.CommandTimeout`. File methods
raise ``FileNotFoundError`` for a missing path and ``HostError`` for any other failure, so
callers can tell "absent" from "broken". Nothing here prints, prompts or exits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal as _signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from pdctl.statemachine.errors import CommandFailed, CommandTimeout, HostError

__all__ = ["CommandResult", "Host", "LocalHost", "host_for"]


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: exit status, decoded output, wall time in seconds."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Host(ABC):
    """One machine pdctl acts on. Subclasses implement the abstract methods; the rest derive."""

    name: str

    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        input: str | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run *argv* (a list, never a shell string) and wait at most *timeout* seconds.
        *env* replaces the environment when given. See the module docstring for errors."""

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """The bytes of *path*. ``FileNotFoundError`` when absent (also where a file stands in place of one of its
        folders); :class:`HostError` when it cannot be read."""

    def read_tail(self, path: str, max_bytes: int) -> bytes:
        """The last *max_bytes* bytes of *path* (all of it when shorter): a log's end without reading the gigabytes a
        server writes in weeks. Errors as :meth:`read_file`. This default reads the whole file; hosts override it."""
        return self.read_file(path)[-max_bytes:] if max_bytes > 0 else b""

    def read_from(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        """``(data, size)``: *path*'s bytes from *offset* to its end, only the last *max_bytes* of them where there
        are more, and its size now (``size < offset``: it was truncated since; ``b""`` then): what a log written on
        since *offset* gained. Errors as :meth:`read_file`. This default reads the whole file; hosts override it."""
        data = self.read_file(path)
        return (data[max(offset, len(data) - max_bytes):] if offset <= len(data) and max_bytes > 0 else b""), len(data)

    @abstractmethod
    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write *path* atomically (temp file in the same directory, fsync, rename) with *mode*,
        creating parent directories. The file never exists with other permissions."""

    @abstractmethod
    def remove_file(self, path: str) -> None:
        """Delete *path*; a missing file is not an error."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def make_dirs(self, path: str, *, mode: int = 0o755, private: bool = False) -> None:
        """``mkdir -p`` (the last folder created with *mode*). *private*: the last folder is created 0700, and one
        that exists loses its group and other permissions (a folder of secrets made 0755 by an older pdctl or by
        hand). Raises HostError when it cannot be created or made private."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Entry names of a directory (``/proc`` included)."""

    @abstractmethod
    def which(self, name: str) -> str | None:
        """Absolute path of executable *name* on the host's PATH, or None."""

    @abstractmethod
    def spawn_detached(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        log_path: str | None = None,
    ) -> int:
        """Start *argv* in a new session, stdin from /dev/null, stdout+stderr appended to
        *log_path* (or discarded), so it outlives the caller; return its PID."""

    @abstractmethod
    def signal(self, pid: int, sig: int, *, group: bool = False) -> bool:
        """Send *sig* to *pid* (or to process group *pid*). False when no such process."""

    @abstractmethod
    def readlink(self, path: str) -> str:
        """Target of a symbolic link (``/proc/<pid>/fd/<n>`` → ``socket:[inode]``). OSError if none."""

    # -- derived ---------------------------------------------------------------------------

    def socket_links(self) -> list[tuple[int, str]]:
        """``(pid, socket inode)`` of every socket descriptor under ``/proc`` this host lets us read
        (``pdctl.statemachine.ports``). Hosts where a round trip is costly answer in one command."""
        found: list[tuple[int, str]] = []
        try:
            pids = [p for p in self.list_dir("/proc") if p.isdigit()]
        except OSError:
            return found
        for pid in pids:
            try:
                fds = self.list_dir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = self.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    found.append((int(pid), link[8:-1]))
        return found

    def proc_files(self, name: str, pids: Iterable[int] | None = None) -> dict[int, bytes]:
        """``{pid: bytes of /proc/<pid>/<name>}`` (``stat``, ``cmdline``, ``environ``…) of every process, or of *pids*,
        whose file this host lets us read; a process gone meanwhile, or one whose file may not be read, is left out
        (over SSH an empty file is too). Hosts where a round trip is costly answer in one command: a scan of ``/proc``
        is one file read per process otherwise."""
        if pids is None:
            try:
                pids = [int(p) for p in self.list_dir("/proc") if p.isdigit()]
            except OSError:
                return {}
        out: dict[int, bytes] = {}
        for pid in pids:
            try:
                out[pid] = self.read_file(f"/proc/{pid}/{name}")
            except OSError:
                continue
        return out

    def http_transport(self):  # noqa: ANN201
        """An ``httpx`` transport that reaches this host's services as pdctl on the host would (None: dial
        directly)."""
        return None

    def close(self) -> None:
        """Release connections (no-op for this machine)."""

    def read_text(self, path: str) -> str:
        """``read_file`` decoded as UTF-8 (``/proc``, sysfs, unit files)."""
        return self.read_file(path).decode("utf-8", "replace")

    def write_text(self, path: str, text: str, *, mode: int = 0o644) -> None:
        self.write_file(path, text.encode("utf-8"), mode=mode)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _end_group(proc: subprocess.Popen, wait_s: float = 5.0) -> None:
    """SIGKILL the process group that :meth:`LocalHost.run` created for *proc* (``start_new_session``: its id is
    *proc*'s PID, which cannot be reused while *proc* is not reaped), then reap *proc* and close its pipes, waiting at
    most *wait_s* seconds (a descendant that left the group may hold the pipes open)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, _signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:  # (a process the kernel holds in an uninterruptible sleep)
            _reap_in_background(proc)


def _end_unreturned(proc: subprocess.Popen) -> None:
    """SIGKILL the group of a child whose ``Popen`` was interrupted after the fork (``proc.pid`` set, nothing
    returned), and reap it within 5 s."""
    pid = getattr(proc, "pid", None)
    if pid is None:
        return
    try:
        os.killpg(pid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _reap_in_background(proc)


def _reap_in_background(proc: subprocess.Popen) -> None:
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


_spawning = False
"""True while :meth:`LocalHost.run`, on the main thread, starts a child: from the fork until ``Popen`` has stored its
PID. A KeyboardInterrupt raised there loses the PID (CPython runs signal handlers as the fork call returns, before
its result is stored: seen under load, the child left running in its own session), so handlers defer it."""
_deferred = False


def defer_interrupt() -> bool:
    """For a signal handler about to raise KeyboardInterrupt: True (and the interrupt noted, not raised) while
    :meth:`LocalHost.run` starts a child; run raises it once it can end that child. False otherwise: raise it."""
    global _deferred
    if _spawning:
        _deferred = True
    return _spawning


def _raise_deferred() -> None:
    global _deferred
    if _deferred:
        _deferred = False
        raise KeyboardInterrupt


@dataclass(eq=False)
class LocalHost(Host):
    """This machine."""

    name: str = field(default_factory=lambda: socket.gethostname() or "localhost")

    def run(self, argv, *, timeout=60.0, env=None, check=True, input=None, cwd=None) -> CommandResult:
        argv = [str(a) for a in argv]
        if not argv:
            raise HostError("empty command", host=self.name)
        t0 = time.monotonic()
        # (made before it starts the child: an interrupt that lands while Popen waits for the child's exec, after
        # the fork, leaves Popen unreturned but proc.pid set, and the child, in its own session, must still be ended)
        proc = subprocess.Popen.__new__(subprocess.Popen)
        global _spawning
        main = threading.current_thread() is threading.main_thread()
        try:
            _spawning = main
            try:
                proc.__init__(
                    argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env) if env is not None else None,
                    cwd=cwd, text=True, start_new_session=True,
                )
            finally:
                _spawning = False
        except OSError as exc:
            if main:
                _raise_deferred()  # (nothing started: the interrupt as it came)
            raise HostError(f"cannot run {argv[0]} on {self.name}: {exc.strerror or exc}", host=self.name,
                            hint=f"is {argv[0]} installed?") from None
        except BaseException:
            global _deferred
            _deferred = False  # (this exception ends the command already)
            _end_unreturned(proc)
            raise
        try:
            if main:
                _raise_deferred()  # (an interrupt that came while it started: ended below, its PID known now)
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            raise CommandTimeout(f"{' '.join(argv)} on {self.name}: no answer after {timeout:g} s",
                                 host=self.name) from None
        except BaseException:
            # Ctrl-C, or SIGTERM / SIGHUP that the CLI turns into KeyboardInterrupt: the command runs in its own
            # session, so the terminal's signal never reached it, and nothing would end it once pdctl is gone (its
            # timeout is pdctl's): end it (an nvidia-smi stuck on a wedged GPU, a systemctl waiting on D-Bus) now
            _end_group(proc)
            raise
        res = CommandResult(tuple(argv), proc.returncode, out or "", err or "", time.monotonic() - t0)
        if check and res.returncode != 0:
            raise CommandFailed(
                f"{' '.join(argv)} on {self.name} exited {res.returncode}: {res.stderr.strip()[-500:]}",
                host=self.name, argv=argv, returncode=res.returncode, stderr=res.stderr,
            )
        return res

    @contextlib.contextmanager
    def _reading(self, path: str) -> Iterator[None]:
        """The errors of a read of *path* as :meth:`Host.read_file` names them."""
        try:
            yield
        except FileNotFoundError:
            raise
        except NotADirectoryError:  # (a file where a folder of the path should be: absent, as over SFTP, which
            # answers ENOTDIR with SSH_FX_NO_SUCH_FILE, and as os.path.exists says)
            raise FileNotFoundError(errno.ENOENT, f"{path} on {self.name}", path) from None
        except OSError as exc:
            raise HostError(f"cannot read {path} on {self.name}: {exc.strerror or exc}", host=self.name) from None

    def read_file(self, path: str) -> bytes:
        with self._reading(path), open(path, "rb") as f:
            return f.read()

    def read_tail(self, path: str, max_bytes: int) -> bytes:
        if max_bytes <= 0:
            return b""
        with self._reading(path), open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:  # (size 0: a /proc or sysfs file, read to its end)
                f.seek(size - max_bytes)
            return f.read(max_bytes) if size else f.read()[-max_bytes:]

    def read_from(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        with self._reading(path), open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(offset, size - max_bytes)
            if offset > size or max_bytes <= 0 or start >= size:
                return b"", size
            f.seek(start)
            return f.read(size - start), size  # (what is written meanwhile is the next read's)

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
            try:
                os.fchmod(fd, mode)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            raise HostError(f"cannot write {path} on {self.name}: {exc.strerror or exc}", host=self.name) from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def remove_file(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"cannot remove {path} on {self.name}: {exc.strerror or exc}", host=self.name) from None

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def make_dirs(self, path: str, *, mode: int = 0o755, private: bool = False) -> None:
        try:
            os.makedirs(path, mode=0o700 if private else mode, exist_ok=True)
            if private and (st := os.stat(path)).st_mode & 0o077:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
        except OSError as exc:
            raise HostError(f"cannot create {path} on {self.name}: {exc.strerror or exc}", host=self.name) from None

    def list_dir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise HostError(f"cannot list {path} on {self.name}: {exc.strerror or exc}", host=self.name) from None

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def spawn_detached(self, argv, *, env=None, cwd=None, log_path=None) -> int:
        argv = [str(a) for a in argv]
        try:
            out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env=dict(env) if env is not None else None, cwd=cwd,
                                        start_new_session=True, close_fds=True)
            finally:
                if log_path:
                    out.close()
        except OSError as exc:
            raise HostError(f"cannot start {argv[0]} on {self.name}: {exc.strerror or exc}", host=self.name) from None
        _reap_in_background(proc)  # no zombie while we live; init adopts it once we exit
        return proc.pid

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def signal(self, pid: int, sig: int, *, group: bool = False) -> bool:
        if pid <= 1:
            raise ValueError(f"refusing to signal pid {pid}")
        try:
            (os.killpg if group else os.kill)(pid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            raise HostError(f"cannot signal {pid} on {self.name}: {exc.strerror}", host=self.name) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def host_for(spec=None, *, name: str | None = None) -> Host:  # noqa: ANN001
    """The host object for a spec ``[hosts.NAME]`` table (``pdctl.statemachine.spec.Host``; None: this
    machine): :class:`LocalHost` when it is driven directly, else an ``SshHost`` with its SSH settings."""
    if spec is None or spec.is_local:
        return LocalHost()
    from pdctl.statemachine.ssh import SshHost

    return SshHost(spec.address, name=name or spec.address, port=spec.ssh_port, user=spec.ssh_user,
                   identity_file=spec.ssh_identity, known_hosts=spec.ssh_known_hosts)
