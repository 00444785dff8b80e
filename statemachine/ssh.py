"""``SshHost``: the :class:`~pdctl.statemachine.hosts.Host` surface on a machine reached over SSH (asyncssh).

Every method is one remote command (or SFTP request) on one kept-open connection (asyncssh 2.x, ``SSHClientConnection.run``),
run from a private event loop in a daemon thread so that callers stay synchronous like with ``LocalHost``.
What each method runs (POSIX sh and coreutils on the host):

* ``run``: the argv, shell-quoted, under ``timeout --kill-after=2 T`` so that a command that outlives its
  timeout is killed on the host, not only abandoned by the client (exit 124/137 → ``CommandTimeout``); ``env``
  replaces the environment through ``env -i``, ``cwd`` is a ``cd`` first.
* ``read_file``, ``exists``, ``list_dir``, ``readlink``: the connection's SFTP session (no shell per call; a
  shell command when the host offers no SFTP); ``write_file``: ``mktemp`` beside the target (mode 0600), the
  bytes on stdin, ``chmod``, ``sync``, ``mv -f`` — the file never exists with other permissions or half written.
* ``spawn_detached``: ``setsid`` in the background with stdin from /dev/null and output appended to the log,
  printing ``$!`` (``setsid`` execs the program, so that is the program's PID).
* ``socket_links``: one ``find /proc/[0-9]*/fd -lname 'socket:*'`` instead of a ``readlink`` round trip per
  descriptor (``pdctl.statemachine.ports`` asks for every socket on the host).
* HTTP probes reach the host's services through SSH local port forwards (:meth:`SshHost.http_transport`), so
  services bound to the host's loopback are probed exactly as pdctl on that host would.

Authentication is public-key only (``identity_file``, else asyncssh's defaults: the agent and ``~/.ssh/id_*``);
the host key is checked against ``known_hosts`` (asyncssh's default ``~/.ssh/known_hosts`` when None) — an
unknown or changed host key is a :class:`~pdctl.statemachine.errors.HostError` naming the fix, never a prompt.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from pdctl.statemachine.errors import CommandFailed, CommandTimeout, HostError
from pdctl.statemachine.hosts import CommandResult, Host

__all__ = ["SshHost"]

_CONNECT_TIMEOUT_S = 15.0
# GNU coreutils timeout(1)'s words when it cannot exec the command (coreutils src/timeout.c: "failed to run command %s")
_TIMEOUT_EXEC_FAILED = re.compile(r"^(?:\S*/)?timeout: failed to run command [^:]*: ")
RETRY_AFTER_S = 60.0
"""After a connect attempt that timed out, how long later calls on the same host fail at once with its error
instead of waiting the connect timeout again (a refused or unresolvable address fails fast by itself, and a dropped
connection is still reconnected): a status, plan or down asks the host many times."""


class SshHost(Host):
    """A machine reached over SSH. *address* is its name or IP as this machine resolves it."""

    def __init__(
        self,
        address: str,
        *,
        name: str | None = None,
        port: int = 22,
        user: str | None = None,
        identity_file: str | None = None,
        known_hosts: str | None = None,
        connect_timeout: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.name = name or address
        self.port = port
        self.user = user
        self.identity_file = identity_file
        self.known_hosts = known_hosts
        self.connect_timeout = connect_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        self._forwards: dict[tuple[str, int], int] = {}
        self._forward_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sftp: Any = None
        self._sftp_conn: Any = None
        self._connecting: asyncio.Lock | None = None
        self.connection_error: HostError | None = None
        """The last failure to reach the host (None once a command went through): steps report it as such."""
        self._timed_out: tuple[float, HostError] | None = None
        """When the last connect attempt timed out, and its error: repeated at once for :data:`RETRY_AFTER_S`."""

    # -- plumbing ---------------------------------------------------------------------------

    def _submit(self, coro, timeout: float):  # noqa: ANN001, ANN202
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=f"ssh-{self.name}", daemon=True)
                self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    async def _connection(self):  # noqa: ANN202
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # callers from several threads: one connection
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            self._forwards.clear()  # listeners of a dropped connection are gone with it
            if self._timed_out is not None and time.monotonic() - self._timed_out[0] < RETRY_AFTER_S:
                raise self._timed_out[1]  # (one command's many calls each waited the whole connect timeout again)
            try:
                conn = await self._connect()
            except HostError as exc:
                self.connection_error = exc
                raise
            self.connection_error = self._timed_out = None
            return conn

    async def _connect(self):  # noqa: ANN202
        import asyncssh

        opts: dict[str, Any] = {"port": self.port, "connect_timeout": self.connect_timeout,
                                "keepalive_interval": 15, "agent_forwarding": False}
        if self.user:
            opts["username"] = self.user
        if self.identity_file:  # that key alone: not the agent's too (it may hold a key of another account)
            opts["client_keys"] = [self.identity_file]
            opts["agent_path"] = None
        if self.known_hosts is not None:
            opts["known_hosts"] = self.known_hosts
        where = f"{self.user + '@' if self.user else ''}{self.address}:{self.port}"
        for attr, path in (("ssh_identity", self.identity_file), ("ssh_known_hosts", self.known_hosts)):
            if path and not os.path.isfile(path):
                raise HostError(f"ssh {where}: hosts.{self.name}.{attr} {path} is not a file on this machine",
                                host=self.name, hint=f"fix hosts.{self.name}.{attr} in the spec")
        try:
            self._conn = await asyncssh.connect(self.address, **opts)
        except asyncssh.KeyImportError as exc:
            raise HostError(f"ssh {where}: cannot use the key {self.identity_file or '(default keys)'}: {exc}",
                            host=self.name,
                            hint=f"hosts.{self.name}.ssh_identity must be an unencrypted private key (not the .pub); "
                                 "for a key with a passphrase, leave ssh_identity unset and load it into ssh-agent") from None
        except asyncssh.HostKeyNotVerifiable as exc:
            known = self.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
            field = f"hosts.{self.name}.ssh_known_hosts" + ("" if self.known_hosts else " (unset: the default)")
            trusted, revoked = self._known_keys(known), self._known_keys(known, revoked=True)
            if revoked:
                # a key the file marks @revoked for this host: never suggest trusting what answers
                raise HostError(f"ssh {where}: host key not trusted: {known} ({field}) marks a key of this host "
                                "@revoked, and vouches for none it offered", host=self.name,
                                hint="do not add the key it offers: a revoked key means the host's keys were "
                                     "compromised or retired; get its current key from its administrators, checked "
                                     "out of band (on the host: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub)") from None
            if trusted:
                # known_hosts vouches for other keys: never suggest trusting whatever answers now
                raise HostError(f"ssh {where}: host key CHANGED: the key the host offered is not the one {known} "
                                f"({field}) records for it", host=self.name,
                                hint="someone may be intercepting the connection, or the host was reinstalled: check "
                                     "its key out of band (on the host: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) "
                                     f"before replacing its line in {known}") from None
            raise HostError(f"ssh {where}: host key not verifiable ({exc.reason}): {known} ({field}) has no key for "
                            "it", host=self.name,
                            hint=f"add the host's key to {known} once its fingerprint matches the host's own, checked "
                                 f"out of band (`ssh-keyscan -p {self.port} {self.address} | ssh-keygen -lf -` here, "
                                 "`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the host)") from None
        except asyncssh.PermissionDenied as exc:
            tried = (f"the key {self.identity_file}" if self.identity_file else
                     "ssh_identity is unset, so the agent's keys and ~/.ssh/id_* here were tried, if any")
            raise HostError(f"ssh {where}: permission denied ({exc.reason}; {tried})", host=self.name,
                            hint=f"check hosts.{self.name}.ssh_user and ssh_identity (public-key login only): the "
                                 "key's .pub must be in that account's ~/.ssh/authorized_keys on the host") from None
        except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
            # a port that accepts but never speaks SSH times out with an empty message: say what did not happen
            timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
            why = str(exc) or (f"no SSH greeting within {self.connect_timeout:g} s (is it an sshd?)" if timed_out
                               else type(exc).__name__)
            err = HostError(f"ssh {where}: cannot connect: {why}", host=self.name,
                            hint=f"is sshd running there, and hosts.{self.name}.address / ssh_port right?")
            if timed_out:
                self._timed_out = (time.monotonic(), err)
            raise err from None
        return self._conn

    def _known_keys(self, path: str, *, revoked: bool = False) -> list:
        """The host keys *path* trusts for this host and port (OpenSSH's ``[address]:port`` form off port 22), or
        with *revoked* those it marks ``@revoked``; empty when the file is missing or unreadable."""
        import asyncssh

        try:
            entries = asyncssh.read_known_hosts(path)
        except (OSError, ValueError, asyncssh.Error):
            return []
        # (asyncssh's match: trusted host keys, trusted CA keys, revoked keys, then the same for X.509. Off port 22 it
        # falls back to the bare address when nothing is trusted for [address]:port, which drops a revoked-only entry
        # for it: its _match (asyncssh 2.x) keeps the port)
        if revoked:
            exact = getattr(entries, "_match", None)
            found = list(exact(self.address, self.address, self.port)[2]) if exact is not None else []
            return found or list(entries.match(self.address, self.address, self.port)[2])
        return list(entries.match(self.address, self.address, self.port)[0])

    async def _exec(self, command: str, *, input: bytes | None, timeout: float):  # noqa: ANN202
        import asyncssh

        conn = await self._connection()
        if input:
            return await conn.run(command, input=input, check=False, encoding=None, timeout=timeout)
        # no bytes to send: stdin at EOF at once (asyncssh leaves it open otherwise, and `cat` would wait)
        return await conn.run(command, stdin=asyncssh.DEVNULL, check=False, encoding=None, timeout=timeout)

    def _sh(self, command: str, *, input: bytes | None = None, timeout: float = 60.0):  # noqa: ANN202
        """Run a shell command line on the host; returns (exit status, stdout bytes, stderr text)."""
        import asyncssh

        try:
            res = self._submit(self._exec(command, input=input, timeout=timeout), timeout + self.connect_timeout + 5)
        except HostError:
            raise
        except (asyncssh.TimeoutError, TimeoutError, asyncio.TimeoutError):
            raise CommandTimeout(f"ssh {self.name}: no answer after {timeout:g} s: {command[:200]}",
                                 host=self.name) from None
        except (OSError, asyncssh.Error) as exc:
            raise self._lost(str(exc)) from None
        if res.exit_status is None and res.exit_signal is None:
            # The channel closed with neither an exit status nor a signal: the session or its connection died under
            # the command (asyncssh returns, it does not raise), not the command failing
            raise self._lost(f"the session ended before the command did: {command[:120]}")
        status = res.exit_status if res.exit_status is not None else 255
        return status, res.stdout or b"", (res.stderr or b"").decode("utf-8", "replace")

    def probe_connection(self) -> None:
        """After a failure that may be the connection's own (an HTTP request through a forward refused, which no SSH
        call saw): one short command on it, which records a lost connection as :attr:`connection_error`, as any
        other call would. Raises nothing."""
        if self.connection_error is not None or self._loop is None:
            return
        try:
            self.run(["true"], timeout=min(10.0, self.connect_timeout + 5), check=False)
        except Exception:  # noqa: BLE001 - what failed is recorded, or it was not the connection
            pass

    def _lost(self, why: str) -> HostError:
        """The connection is gone (or its session was): forgotten, so that the next call reconnects, and recorded as
        :attr:`connection_error`, which the steps report as a lost connection whatever operation tripped on it."""
        conn, self._conn = self._conn, None
        if conn is not None and self._loop is not None:  # (a session that died on a live connection: let it go)
            self._loop.call_soon_threadsafe(conn.close)
        self.connection_error = HostError(f"ssh {self.name}: {why}", host=self.name,
                                          hint=f"is host {self.name} up and its sshd answering? `pdctl status` tells "
                                               "what runs once it is")
        return self.connection_error

    async def _sftp_client(self):  # noqa: ANN202
        """The connection's SFTP session (opened once), or None when the host offers no SFTP subsystem."""
        import asyncssh

        conn = await self._connection()
        if self._sftp_conn is not conn:
            self._sftp_conn = conn
            try:
                self._sftp = await conn.start_sftp_client()
            except (asyncssh.Error, OSError):
                self._sftp = None
        return self._sftp

    def _sftp_call(self, op: str, path: str, fn):  # noqa: ANN001, ANN202
        """Run ``fn(sftp)`` (a coroutine function) on the SFTP session. Returns (True, result), or (False, None)
        when there is no SFTP session (the caller then uses a shell command). Maps a missing path to
        ``FileNotFoundError`` and other failures to ``HostError``."""
        import asyncssh

        async def _go():  # noqa: ANN202
            sftp = await self._sftp_client()
            if sftp is None:
                return False, None
            return True, await fn(sftp)

        try:
            return self._submit(_go(), 60 + self.connect_timeout)
        except HostError:  # could not connect: keep its own message and hint
            raise
        except asyncssh.SFTPNoSuchFile:
            raise FileNotFoundError(2, f"{path} on {self.name}", path) from None
        except (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection) as exc:  # (the connection, not the file)
            raise self._lost(f"the connection was lost while trying to {op} {path}: {exc.reason or type(exc).__name__}") from None
        except asyncssh.SFTPError as exc:
            denied = isinstance(exc, asyncssh.SFTPPermissionDenied)
            raise HostError(f"cannot {op} {path} on {self.name}: {exc.reason}", host=self.name,
                            hint=self._denied_hint(op) if denied else None) from None
        except (OSError, asyncssh.Error) as exc:
            raise self._lost(str(exc)) from None

    def close(self) -> None:
        """Close the connection and stop the loop thread (idempotent)."""
        loop, conn = self._loop, self._conn
        if loop is None:
            return
        if conn is not None:
            async def _close() -> None:
                conn.close()
                await conn.wait_closed()

            try:
                asyncio.run_coroutine_threadsafe(_close(), loop).result(5)
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = self._thread = self._conn = self._sftp = self._sftp_conn = self._connecting = None
        self._forwards.clear()

    # -- Host surface -----------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None,
            check: bool = True, input: str | None = None, cwd: str | None = None) -> CommandResult:
        argv = [str(a) for a in argv]
        if not argv:
            raise HostError("empty command", host=self.name)
        line = shlex.join(argv)
        if env is not None:
            line = "env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + line
        line = f"timeout --kill-after=2 {timeout:g} {line}"
        if cwd:
            line = f"cd {shlex.quote(cwd)} && {line}"
        t0 = time.monotonic()
        status, out, err = self._sh(line, input=input.encode() if input is not None else None, timeout=timeout + 5)
        if status in (124, 137):
            raise CommandTimeout(f"{' '.join(argv)} on {self.name}: no answer after {timeout:g} s", host=self.name)
        if status == 126 or (status == 127 and "No such file" in err):  # `timeout` could not exec it
            # ("timeout: failed to run command 'nvidia-smi': No such file or directory": the wrapper is pdctl's, so
            # only the reason is said, as LocalHost says it)
            why = _TIMEOUT_EXEC_FAILED.sub("", err.strip()[-300:])
            raise HostError(f"cannot run {argv[0]} on {self.name}: {why}", host=self.name,
                            hint=f"is {argv[0]} installed there?")
        res = CommandResult(tuple(argv), status, out.decode("utf-8", "replace"), err, time.monotonic() - t0)
        if check and status != 0:
            raise CommandFailed(f"{' '.join(argv)} on {self.name} exited {status}: {err.strip()[-500:]}",
                                host=self.name, argv=argv, returncode=status, stderr=err)
        return res

    def _file_error(self, op: str, path: str, status: int, err: str) -> Exception:
        if "No such file" in err or (op == "read" and "Not a directory" in err):  # (absent, as over SFTP)
            return FileNotFoundError(2, f"{path} on {self.name}", path)
        return HostError(f"cannot {op} {path} on {self.name}: {err.strip()[-300:] or f'exit {status}'}",
                         host=self.name, hint=self._denied_hint(op) if "Permission denied" in err else None)

    def _denied_hint(self, op: str) -> str:
        """The fix for a file the SSH login may not *op*: most often logged in as another user than the one the
        deployment was applied as (its supervisor's files and units are that user's)."""
        who = repr(self.user) if self.user else "this machine's user name (ssh_user unset)"
        return (f"pdctl logs in to host {self.name} as {who}, which may not {op} it: set hosts.{self.name}.ssh_user to "
                "the user the deployment was applied as, or give this one access")

    def read_file(self, path: str) -> bytes:
        async def _read(sftp):  # noqa: ANN001, ANN202
            async with sftp.open(path, "rb") as f:
                chunks = []
                while True:  # /proc and sysfs files report size 0: read to EOF, bounded by what the file holds
                    chunk = await f.read(65536)
                    if not chunk:
                        return b"".join(chunks)
                    chunks.append(chunk)

        return self._read(path, _read, f"cat -- {shlex.quote(path)}")

    def _read(self, path: str, over_sftp, command: str) -> bytes:  # noqa: ANN001
        """*path*'s bytes as ``over_sftp(sftp)`` reads them, else (no SFTP session) as the shell *command* prints
        them; errors as :meth:`read_file`'s."""
        done, data = self._sftp_call("read", path, over_sftp)
        if done:
            return data
        status, out, err = self._sh(command)
        if status != 0:
            raise self._file_error("read", path, status, err)
        return out

    def read_tail(self, path: str, max_bytes: int) -> bytes:
        if max_bytes <= 0:
            return b""

        async def _read(sftp):  # noqa: ANN001, ANN202
            async with sftp.open(path, "rb") as f:
                size = (await f.stat()).size or 0
                if size > max_bytes:
                    await f.seek(size - max_bytes)
                chunks, got = [], 0
                while got < max_bytes or not size:  # (size 0: a /proc or sysfs file, read to its end)
                    chunk = await f.read(min(65536, max_bytes - got) if size else 65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
                return b"".join(chunks)[-max_bytes:]

        return self._read(path, _read, f"tail -c {int(max_bytes)} -- {shlex.quote(path)}")

    def read_from(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        # Both ways answer the same bytes: the size on a line of its own, then the bytes from where the rule starts.
        async def _read(sftp):  # noqa: ANN001, ANN202
            async with sftp.open(path, "rb") as f:
                size = (await f.stat()).size or 0
                start = max(offset, size - max_bytes)
                chunks = [f"{size}\n".encode()]
                if offset <= size and max_bytes > 0 and start < size:
                    await f.seek(start)
                    got = 0
                    while got < size - start:  # (what is written meanwhile is the next read's)
                        chunk = await f.read(min(65536, size - start - got))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        got += len(chunk)
                return b"".join(chunks)

        script = ('size=$(stat -c %s -- "$1") || exit 1; echo "$size"; start=$(( $2 > size - $3 ? $2 : size - $3 )); '
                  '[ "$2" -le "$size" ] && [ "$3" -gt 0 ] && [ "$start" -lt "$size" ] && '
                  'tail -c +$((start + 1)) -- "$1" | head -c $((size - start)); exit 0')
        out = self._read(path, _read, f"sh -c {shlex.quote(script)} sh {shlex.quote(path)} {int(offset)} {int(max_bytes)}")
        size, _, rest = out.partition(b"\n")
        return rest, int(size)

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        script = ('set -e; d=$(dirname -- "$1"); mkdir -p -- "$d"; t=$(mktemp "$d/.pdctl.XXXXXX"); '
                  'trap \'rm -f -- "$t"\' EXIT; cat > "$t"; chmod "$2" "$t"; sync "$t"; mv -f -- "$t" "$1"; trap - EXIT')
        status, _out, err = self._sh(f"sh -c {shlex.quote(script)} sh {shlex.quote(path)} {mode:o}", input=bytes(data))
        if status != 0:
            raise HostError(f"cannot write {path} on {self.name}: {err.strip()[-300:]}", host=self.name)

    def remove_file(self, path: str) -> None:
        status, _out, err = self._sh(f"rm -f -- {shlex.quote(path)}")
        if status != 0:
            raise HostError(f"cannot remove {path} on {self.name}: {err.strip()[-300:]}", host=self.name)

    def exists(self, path: str) -> bool:
        async def _exists(sftp):  # noqa: ANN001, ANN202
            try:
                await sftp.lstat(path)
                return True
            except Exception:  # noqa: BLE001 - SFTPNoSuchFile and friends: absent
                return False

        done, found = self._sftp_call("stat", path, _exists)
        if done:
            return found
        q = shlex.quote(path)
        return self._sh(f"test -e {q} || test -L {q}")[0] == 0

    def make_dirs(self, path: str, *, mode: int = 0o755, private: bool = False) -> None:
        q = shlex.quote(path)
        cmd = f"mkdir -p -m 700 -- {q} && chmod go-rwx -- {q}" if private else f"mkdir -p -m {mode:o} -- {q}"
        status, _out, err = self._sh(cmd)
        if status != 0:
            raise HostError(f"cannot create {path} on {self.name}: {err.strip()[-300:]}", host=self.name)

    def list_dir(self, path: str) -> list[str]:
        async def _list(sftp):  # noqa: ANN001, ANN202
            return [n for n in await sftp.listdir(path) if n not in (".", "..")]

        done, names = self._sftp_call("list", path, _list)
        if done:
            return names
        status, out, err = self._sh(f"ls -A1 -- {shlex.quote(path)}")
        if status != 0:
            raise self._file_error("list", path, status, err)
        return [n for n in out.decode("utf-8", "replace").split("\n") if n]

    def which(self, name: str) -> str | None:
        status, out, _err = self._sh(f"command -v -- {shlex.quote(name)}")
        found = out.decode().strip()
        return found if status == 0 and found.startswith("/") else None

    def spawn_detached(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                       log_path: str | None = None) -> int:
        argv = [str(a) for a in argv]
        line = "setsid " + shlex.join(argv)
        if env is not None:
            line = "env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + line
        out = shlex.quote(log_path) if log_path else "/dev/null"
        line = f"{line} < /dev/null >> {out} 2>&1 & echo $!"
        if cwd:  # not `cd X && prog &`: that backgrounds a subshell which holds the session's output open
            line = f"cd {shlex.quote(cwd)} || exit 97; {line}"
        status, stdout, err = self._sh(line)
        try:
            pid = int(stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostError(f"cannot start {argv[0]} on {self.name}: {err.strip()[-300:] or f'exit {status}'}",
                            host=self.name) from None
        return pid

    def signal(self, pid: int, sig: int, *, group: bool = False) -> bool:
        if pid <= 1:
            raise ValueError(f"refusing to signal pid {pid}")
        target = f"-{pid}" if group else str(pid)
        status, _out, err = self._sh(f"kill -s {int(sig)} -- {target}")
        if status == 0:
            return True
        if "No such process" in err:
            return False
        raise HostError(f"cannot signal {pid} on {self.name}: {err.strip()[-200:]}", host=self.name)

    def readlink(self, path: str) -> str:
        async def _readlink(sftp):  # noqa: ANN001, ANN202
            return await sftp.readlink(path)

        try:
            done, target = self._sftp_call("readlink", path, _readlink)
        except (FileNotFoundError, HostError) as exc:
            raise OSError(f"readlink {path} on {self.name}: {exc}") from None
        if done:
            return target
        status, out, err = self._sh(f"readlink -- {shlex.quote(path)}")
        if status != 0:
            raise OSError(f"readlink {path} on {self.name}: {err.strip() or 'not a link'}")
        return out.decode("utf-8", "replace").rstrip("\n")

    def proc_files(self, name: str, pids: Iterable[int] | None = None) -> dict[int, bytes]:
        # One command instead of one SFTP read per process: GNU grep prints each NUL-ended record of each file as
        # "PATH:RECORD\0" (-z; a stat line is one record, each argument of cmdline or environ one), -a for bytes,
        # -s for files gone or unreadable meanwhile
        if not re.fullmatch(r"[a-z_]+", name):
            raise ValueError(f"not a /proc file name: {name!r}")
        paths = "/proc/[0-9]*/" + name if pids is None else " ".join(f"/proc/{int(p)}/{name}" for p in pids)
        if not paths:
            return {}
        status, out, _err = self._sh(f"grep -a -s -H -z '' -- {paths}")
        if not out and status > 1:  # (no grep, one without -z, or every file unreadable: file by file)
            return super().proc_files(name, pids)
        parts: dict[int, list[bytes]] = {}
        for record in out.split(b"\0")[:-1]:
            path, sep, body = record.partition(b":")
            fields = path.split(b"/")
            if sep and len(fields) == 4 and fields[2].isdigit():
                parts.setdefault(int(fields[2]), []).append(body)
        return {pid: b"".join(x + b"\0" for x in bodies) if name != "stat" else b"".join(bodies)
                for pid, bodies in parts.items()}

    def socket_links(self) -> list[tuple[int, str]]:
        status, out, _err = self._sh("find /proc/[0-9]*/fd -lname 'socket:*' -printf '%h %l\\n' 2>/dev/null; true")
        found = []
        for row in out.decode("utf-8", "replace").splitlines():
            where, _, link = row.partition(" ")
            pid = where.split("/")[2] if where.count("/") >= 3 else ""
            if pid.isdigit() and link.startswith("socket:["):
                found.append((int(pid), link[8:-1]))
        return found

    # -- HTTP through the connection --------------------------------------------------------

    def forward(self, dest_host: str, dest_port: int) -> int:
        """Local port on this machine's loopback that the connection forwards to *dest_host:dest_port* as seen
        from the host (opened once per destination)."""
        key = (dest_host, int(dest_port))
        with self._forward_lock:  # (the console's canary thread and its collector dial the router's port at once)
            if key not in self._forwards:
                async def _open() -> int:
                    conn = await self._connection()
                    listener = await conn.forward_local_port("127.0.0.1", 0, dest_host, int(dest_port))
                    return listener.get_port()

                self._forwards[key] = self._submit(_open(), self.connect_timeout + 10)
            return self._forwards[key]

    def http_transport(self) -> httpx.BaseTransport:
        return _ForwardingTransport(self)


class _ForwardingTransport(httpx.BaseTransport):
    """Sends each request to the local end of an SSH forward to the URL's host:port on the remote machine.
    ``0.0.0.0`` (a bind address) is reached as the host's loopback."""

    def __init__(self, host: SshHost) -> None:
        self._host = host
        self._inner = httpx.HTTPTransport(trust_env=False)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        dest = request.url.host or "127.0.0.1"
        if dest in ("0.0.0.0", "::", "localhost"):
            dest = "127.0.0.1"
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        try:
            local = self._host.forward(dest, port)
        except HostError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        request.url = request.url.copy_with(host="127.0.0.1", port=local)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()
