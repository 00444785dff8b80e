"""What :mod:`pdctl.units` needs of a host, as a :class:`typing.Protocol`.

The concrete ``Host`` ABC and ``LocalHost`` live in ``pdctl.statemachine.hosts`` (units imports
nothing of pdctl); an SSH host implements the same methods. Every file and process action of the
managers goes through this surface, so a manager works on whatever host it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["CommandResultLike", "HostLike"]


class CommandResultLike(Protocol):
    returncode: int
    stdout: str
    stderr: str


@runtime_checkable
class HostLike(Protocol):
    """The host actions the service managers use.

    ``run`` with ``check=False`` returns the result whatever the exit status; it raises only when
    the command cannot run or times out (a ``TimeoutError`` subclass). ``write_file`` is atomic
    (temp file + rename) and creates parent directories. ``read_file`` raises
    ``FileNotFoundError`` for a missing file; ``read_tail`` reads only a file's last bytes (a log's end), ``read_from`` what it gained since an
    offset, with its size. ``spawn_detached`` starts a process in a new session
    that outlives the caller and returns its PID. ``signal`` returns False when no such process
    (or group) exists. ``proc_files`` reads one ``/proc/<pid>/`` file of every process (or of the PIDs given) at
    once, ``{pid: bytes}``, leaving out those gone or unreadable.
    """

    name: str

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None,
            check: bool = True, input: str | None = None) -> CommandResultLike: ...

    def read_file(self, path: str) -> bytes: ...

    def read_tail(self, path: str, max_bytes: int) -> bytes: ...

    def read_from(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]: ...

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None: ...

    def remove_file(self, path: str) -> None: ...

    def exists(self, path: str) -> bool: ...

    def which(self, name: str) -> str | None: ...

    def make_dirs(self, path: str, *, mode: int = 0o755, private: bool = False) -> None: ...

    def list_dir(self, path: str) -> list[str]: ...

    def spawn_detached(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                       cwd: str | None = None, log_path: str | None = None) -> int: ...

    def signal(self, pid: int, sig: int, *, group: bool = False) -> bool: ...

    def proc_files(self, name: str, pids: Iterable[int] | None = None) -> dict[int, bytes]: ...
