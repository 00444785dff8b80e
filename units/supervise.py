"""The per-role watchdog of :class:`~pdctl.units.ProcessSupervisor`:
``python -m pdctl.units.supervise SERVICE_DIR``.

It runs detached (its own session) on the role's host and owns the role's process group until
SIGTERM: waits for required services, starts the role, gates on readiness, restarts on failure
within the start limit, and on exit stops the whole group and reaps every orphan. See
``pdctl.units._process`` for the design; this file is the loop. It talks to the local OS
directly — it *is* the host-side agent — and writes its state atomically to ``status.json``.

A write it cannot make (a full, read-only or over-quota state directory) never stops it nor its role, and
never waits: the OS refuses such a write at once. A status it could not write is kept and written again at
every poll; meanwhile the watchdog names itself :data:`~pdctl.units._process.STATUS_UNWRITTEN_COMM` (its
``/proc/PID/comm``, which takes no disk), so that ``pdctl`` waiting on that status reads why it does not
change instead of waiting out its start timeout, and its own log lines (best effort, in ``output.log``) say so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import pwd
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

from ._process import (
    STATUS_UNWRITTEN_COMM,
    SUPERVISOR_TAG,
    UNIT_DIR_ENV,
    UNIT_ENV,
    _proc_pgrp,
    _proc_starttime,
    _proc_state,
    parse_env_file,
)
from ._types import ServiceSpec, cpu_set

BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")
"""What the role inherits from the watchdog's environment (systemd, too, starts from a clean one)."""

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15
MPOL_BIND = 2
EXIT_NUMA_POLICY = 242
"""systemd's exit status for a NUMA policy it could not set (systemd.exec(5), "Process exit codes")."""
EXIT_CPUAFFINITY = 214
"""systemd's exit status for a CPU affinity it could not set (systemd.exec(5), "Process exit codes")."""
EXIT_USER = 217
"""systemd's exit status for a ``User=`` it could not switch to (systemd.exec(5), "Process exit codes")."""
LOG_MAX_BYTES = 256 * 2**20
"""A role's ``output.log`` past this size (256 MiB, ~2 million lines of SGLang's request log) is copied to
``output.log.1`` and emptied, as logrotate's ``copytruncate`` does: the role keeps its descriptor, which appends
(``O_APPEND``), so it writes on at the start of the emptied file. Lines written while the copy runs are lost. A
role's logs take at most twice this on disk; systemd's journal rotates its own."""
LOG_CHECK_S = 5.0
"""How often the watchdog looks at ``output.log``'s size, in seconds."""
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
"""``set_mempolicy(2)`` syscall numbers: what ``NUMAPolicy=bind`` + ``NUMAMask=`` do under systemd."""


def _account(user: str) -> tuple[pwd.struct_passwd, list[int]] | None:
    """*user*'s passwd entry and its groups (``getgrouplist(3)``, its primary group included); None: no such
    account. Read in the watchdog, before the fork: the child only switches."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    return pw, os.getgrouplist(pw.pw_name, pw.pw_gid)


def _online_cpus() -> set[int]:
    """The host's online CPUs (``/sys/devices/system/cpu/online``); empty when that cannot be read."""
    try:
        return cpu_set(Path("/sys/devices/system/cpu/online").read_text().strip())
    except (OSError, ValueError):
        return set()

class Watchdog:
    def __init__(self, d: Path) -> None:
        self.dir = d
        unit = json.loads((d / "unit.json").read_text())
        self.spec = ServiceSpec.from_json({**unit["service"], "secrets": []})
        self.affinity: set[int] = set()  # (the CPUs spawn() pins the role to; empty: left as inherited)
        self.account: tuple[pwd.struct_passwd, list[int]] | None = None  # (spec.user's, read by spawn())
        self.secrets_file = unit["service"].get("secrets_file")
        self.stopping = False
        self.restarts = 0
        self.unwritten: tuple[str, str] | None = None
        self.proc: subprocess.Popen | None = None
        self.log = open(d / "output.log", "ab", buffering=0)  # noqa: SIM115 - lives as long as the watchdog
        self.log_checked = 0.0  # (time.monotonic() of the last look at output.log's size)
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork
        try:
            self.comm = Path("/proc/self/comm").read_bytes().strip()[:15]  # (its name while its status is written)
        except OSError:
            self.comm = b"python3"

    # -- bookkeeping -------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        try:
            self.log.write(f"{SUPERVISOR_TAG}[{os.getpid()}]: {msg}\n".encode())
        except OSError:  # a full disk loses the line, never the watchdog (its role would run unsupervised)
            pass

    def status(self, state: str, sub: str) -> None:
        """Write ``status.json`` atomically. On a full disk the last written status stays and this one is kept
        (``unwritten``) for :meth:`retry_status`, which the loop calls at every poll: the role's state reaches its
        readers once the disk has room, and the watchdog never dies of it."""
        body = {"state": state, "sub": sub, "restarts": self.restarts, "updated": time.time(),
                "watchdog_pid": os.getpid(), "main_pid": self.proc.pid if self.proc else None}
        tmp = self.dir / f".status.json.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.dir / "status.json")
        except OSError as exc:
            if self.unwritten is None:
                self.say(f"cannot write status.json: {exc}; the role runs on, its state is written again at every "
                         "poll until it can be")
                self.name_self(STATUS_UNWRITTEN_COMM.encode())
            self.unwritten = (state, sub)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return
        if self.unwritten is not None:
            self.name_self(getattr(self, "comm", b""))
            self.say(f"status.json written again ({state}/{sub})")
        self.unwritten = None

    def name_self(self, name: bytes) -> None:
        """Set this process's name (``/proc/PID/comm``, ``prctl(PR_SET_NAME)``): how it says, without the disk, that
        its status could not be written. Best effort."""
        if not name:
            return
        with contextlib.suppress(AttributeError, OSError, ctypes.ArgumentError):
            self.libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)

    def retry_status(self) -> None:
        if self.unwritten is not None:
            self.status(*self.unwritten)

    def rotate_log(self) -> None:
        """Past ``log_max_bytes`` (:data:`LOG_MAX_BYTES`), copy ``output.log`` to ``output.log.1`` (replacing it)
        and empty it; at most every :data:`LOG_CHECK_S` seconds. A copy that fails (a full disk) still empties it:
        the disk matters more than the old lines, and the line that says so is the new file's first."""
        now = time.monotonic()
        if now - self.log_checked < LOG_CHECK_S:
            return
        self.log_checked = now
        limit = self.spec.log_max_bytes or LOG_MAX_BYTES
        try:
            size = os.fstat(self.log.fileno()).st_size
        except OSError:
            return
        if size <= limit:
            return
        tmp, kept = self.dir / ".output.log.1.tmp", self.dir / "output.log.1"
        try:
            with open(self.dir / "output.log", "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(tmp, kept)
            why = f"its lines before this one are in {kept.name}"
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            why = f"its lines before this one could not be kept ({exc.strerror or exc})"
        try:
            os.ftruncate(self.log.fileno(), 0)
        except OSError as exc:
            self.say(f"cannot empty output.log past {limit} bytes: {exc.strerror or exc}")
            return
        self.say(f"output.log passed {limit} bytes ({size}): emptied; {why}")

    def on_term(self, *_: object) -> None:
        self.stopping = True

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    # -- the role ----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
        env.update(dict(self.spec.env))
        if self.secrets_file and os.path.exists(self.secrets_file):
            env.update(parse_env_file(Path(self.secrets_file).read_text()))
        if self.account is not None:  # as systemd sets them for User= (systemd.exec(5), "Environment variables")
            pw = self.account[0]
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell or "/bin/sh")
        # last: how status and down find this role's process, whatever the spec's tables say
        env[UNIT_ENV] = self.spec.name
        env[UNIT_DIR_ENV] = os.path.normpath(self.dir)
        return env

    def preexec(self) -> None:  # runs in the child between fork and exec (single-threaded parent)
        os.setpgid(0, 0)
        # The role's CPUs, else every CPU of the host, never the affinity this watchdog inherited from whoever ran
        # pdctl (`taskset -c 0 pdctl apply` pinned every role to CPU 0): as under systemd, whose services start with
        # its own affinity. The kernel keeps them within the cgroup's cpuset (a container's) and refuses a set
        # with none of its CPUs (EINVAL): for the role's own CPUs that ends the child before exec, as systemd does.
        cpus = self.affinity
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)
        except OSError as e:
            if self.spec.cpu_affinity:
                os.write(2, f"pdctl supervise: sched_setaffinity(CPUs {self.spec.cpu_affinity}) failed: "
                            f"{os.strerror(e.errno or 0)}; are they CPUs of this host?\n".encode())
                os._exit(EXIT_CPUAFFINITY)
        if self.spec.numa_node is not None:
            self.bind_memory(self.spec.numa_node)
        if self.spec.memlock_infinity:
            try:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except (OSError, ValueError):  # no CAP_SYS_RESOURCE: the most we may have
                hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
                try:
                    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
                except (OSError, ValueError):
                    pass
        if self.spec.user is not None:  # last, as systemd does: the limits above were raised with the manager's rights
            self.switch_user(self.spec.user)

    def switch_user(self, user: str) -> None:
        """In the child: become *user* (supplementary groups, primary group, UID), or end with exit status 217, as
        systemd's ``User=`` does (EXIT_USER), saying why in the role's log."""
        if self.account is None:
            os.write(2, f"pdctl supervise: User={user}: no such account on this host\n".encode())
            os._exit(EXIT_USER)
        pw, groups = self.account
        try:
            os.setgroups(groups)
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
        except OSError as e:  # (EPERM: the watchdog does not run as root)
            os.write(2, f"pdctl supervise: User={user}: cannot switch to UID {pw.pw_uid}: "
                        f"{os.strerror(e.errno or 0)}\n".encode())
            os._exit(EXIT_USER)

    def bind_memory(self, node: int) -> None:
        """``set_mempolicy(MPOL_BIND, {node})``, inherited across exec. A node the kernel refuses (EINVAL: no such
        node) ends the child before exec with exit status 242, as systemd's ``NUMAPolicy=`` does (EXIT_NUMA_POLICY),
        saying why in the role's log. Any other failure — ENOSYS (no NUMA in the kernel), EPERM (Docker's and
        containerd's default seccomp profiles allow the call only with CAP_SYS_NICE) — is said in the log and the
        role runs unbound, as it did before binding was enforced."""
        nr = SYS_SET_MEMPOLICY.get(os.uname().machine)
        if nr is None:
            return
        mask = (ctypes.c_ulong * 16)()
        if 0 <= node < 1024:
            mask[node // 64] = 1 << (node % 64)
        if self.libc.syscall(nr, MPOL_BIND, mask, ctypes.c_ulong(1024 + 1)) != 0:
            err = ctypes.get_errno()
            said = f"pdctl supervise: set_mempolicy(MPOL_BIND, NUMA node {node}) failed: {os.strerror(err)}"
            if err != errno.EINVAL:
                os.write(2, f"{said}; running without the memory binding\n".encode())
                return
            os.write(2, f"{said}; the node does not exist on this host?\n".encode())
            os._exit(EXIT_NUMA_POLICY)

    def spawn(self) -> None:
        cwd = self.spec.working_dir or str(self.dir)
        # (read before the fork: preexec only sets it)
        self.affinity = cpu_set(self.spec.cpu_affinity) if self.spec.cpu_affinity else _online_cpus()
        self.account = _account(self.spec.user) if self.spec.user is not None else None
        self.proc = subprocess.Popen(
            list(self.spec.argv), env=self.env(), cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=self.preexec, close_fds=True,
        )
        # The start time first: whoever reads main.pid can then tell this process from a later one with its PID.
        try:
            start = _proc_starttime(Path(f"/proc/{self.proc.pid}/stat").read_bytes())
        except OSError:  # already gone: the loop sees the exit
            start = -1
        try:
            for f, text in (("main.start", f"{start}\n"), ("main.pid", f"{self.proc.pid}\n")):
                tmp = self.dir / f".{f}.tmp"
                tmp.write_text(text)
                os.replace(tmp, self.dir / f)
        except OSError:  # (a full disk) a main process no reader can find must not run: end it, then say why
            self.kill_group(5.0)
            raise
        self.say(f"started main process {self.proc.pid}: {' '.join(self.spec.argv)}")

    def ready(self) -> bool:
        if not self.spec.readiness_url:
            return True
        try:
            with self.opener.open(self.spec.readiness_url, timeout=2) as r:
                return 200 <= r.status < 300
        except Exception:  # noqa: BLE001 - any failure means "not ready yet"
            return False

    def group_alive(self, pgid: int) -> bool:
        for e in os.listdir("/proc"):
            if e.isdigit():
                try:
                    st = Path(f"/proc/{e}/stat").read_bytes()
                except OSError:
                    continue
                if _proc_pgrp(st) == pgid and _proc_state(st) not in ("Z", "X"):
                    return True
        return False

    def kill_group(self, timeout: float) -> None:
        """SIGTERM the role's group, wait *timeout*, SIGKILL; then reap every child we have."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)  # as systemd does after SIGTERM: a stopped process can act on it
        except ProcessLookupError:
            pass
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.reap()
            if self.proc.poll() is not None and not self.group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            self.say(f"group {pgid} still alive after {timeout:g} s: SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.kill_orphans()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def kill_orphans(self) -> None:
        """As a child subreaper we inherit the role's orphans (even ones that left its group)."""
        me = os.getpid()
        for _ in range(50):
            kids = []
            for e in os.listdir("/proc"):
                if e.isdigit() and int(e) != me:
                    try:
                        st = Path(f"/proc/{e}/stat").read_bytes()
                    except OSError:
                        continue
                    fields = st[st.rfind(b")") + 2:].split()
                    if len(fields) > 1 and int(fields[1]) == me and _proc_state(st) not in ("Z", "X"):
                        kids.append(int(e))
            self.reap()
            if not kids:
                return
            for k in kids:
                try:
                    os.kill(k, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def reap(self) -> None:
        while True:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.proc is not None and pid == self.proc.pid and self.proc.returncode is None:
                # reaped here: record the code so that Popen never waits on a PID that is gone
                self.proc.returncode = os.waitstatus_to_exitcode(wstatus)

    # -- the loop ----------------------------------------------------------------------------

    def wait_requires(self) -> bool:
        if not self.spec.requires:
            return True
        self.status("activating", "waiting-for-dependencies")
        deadline = time.monotonic() + self.spec.timeout_start_s
        root = self.dir.parent
        while not self.stopping:
            states = []
            for r in self.spec.requires:
                try:
                    states.append(json.loads((root / r / "status.json").read_text()).get("state"))
                except (OSError, ValueError):
                    states.append(None)
            if all(s == "active" for s in states):
                return True
            if any(s in ("failed", "inactive") for s in states):
                self.say(f"dependency failed: {dict(zip(self.spec.requires, states))}")
                return False
            if time.monotonic() > deadline:
                self.say("timed out waiting for dependencies")
                return False
            self.sleep(0.2)
        return False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, self.on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            self.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except AttributeError:
            pass
        try:
            (self.dir / "watchdog.pid").write_text(f"{os.getpid()}\n")
        except OSError as exc:  # (pdctl wrote it too, as it spawned this watchdog; it finds it by its command line)
            self.say(f"cannot write watchdog.pid: {exc}")
        s = self.spec
        if not self.wait_requires():
            self.status("inactive" if self.stopping else "failed", "dead" if self.stopping else "dependency")
            return 0 if self.stopping else 1
        starts: deque[float] = deque()
        final = ("inactive", "dead")
        while not self.stopping:
            now = time.monotonic()
            while starts and now - starts[0] > s.start_limit_interval_s:
                starts.popleft()
            if len(starts) >= s.start_limit_burst:
                self.say(f"start limit hit: {len(starts)} starts in {now - starts[0]:.0f} s "
                         f"(limit {s.start_limit_burst} per {s.start_limit_interval_s:g} s)")
                final = ("failed", "start-limit-hit")
                break
            starts.append(now)
            try:
                self.spawn()
            except OSError as exc:
                self.say(f"cannot start {s.argv[0]}: {exc}")
                self.kill_group(5.0)  # (spawn ends what it started; this is a no-op then, and if Popen itself failed)
                self.proc = None
                final = ("failed", "exec")
                break
            self.status("activating", "start")
            ready, t0, rc, why = False, time.monotonic(), None, ""
            while not self.stopping:
                self.retry_status()
                self.rotate_log()
                rc = self.proc.poll()
                if rc is not None:
                    why = f"exited, code={rc}" if rc >= 0 else f"killed, signal={-rc}"
                    break
                if not ready:
                    if self.ready():
                        ready = True
                        self.say("ready")
                        self.status("active", "running")
                        continue
                    if time.monotonic() - t0 > s.timeout_start_s:
                        why, rc = f"readiness gate timed out after {s.timeout_start_s} s", -1
                        break
                self.sleep(0.25 if not ready else 0.2)
            if self.stopping:
                break
            self.say(f"main process {self.proc.pid} {why}")
            self.kill_group(min(10.0, s.timeout_stop_s))
            if rc == 0:
                final = ("inactive", "dead")
                break
            if rc in s.restart_prevent_exit_status:  # systemd's RestartPreventExitStatus=
                self.say(f"exit code {rc} is not restarted (a refused command line)")
                final = ("failed", "exit-code")
                break
            self.restarts += 1
            self.status("activating", "auto-restart")
            self.sleep(s.restart_sec)
        if self.stopping:
            self.status("deactivating", "stop-sigterm")
            self.say("stopping")
        self.kill_group(s.timeout_stop_s)
        for f in ("main.pid", "main.start", "watchdog.pid"):
            try:
                (self.dir / f).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # (a read-only file system: the role is stopped all the same)
                self.say(f"cannot remove {f}: {exc}")
        self.status(*final)
        self.say(f"{final[0]} ({final[1]})")
        return 0


WATCHDOG_ENV_KEYS = (*BASE_ENV_KEYS, "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH")
"""What the watchdog keeps of the environment it was started with: the role's base, and what its own interpreter
may need to start and import pdctl. It was started by pdctl, whose environment holds the variables ``[secrets]``
read their values from (``env:NAME``): kept, they stayed readable in the watchdog's ``/proc/PID/environ`` for its
whole life, while the role gets them from the 0600 secrets file only."""


_CLEANED = "PDCTL_WATCHDOG_ENV"
"""Set (to ``clean``) in the environment the watchdog re-executes itself with: it does so once. (Comparing the
environment instead looped forever where Python adds a variable itself at start: PEP 538's ``LC_CTYPE`` coercion
under the C locale, as in an SSH session without ``LANG``.)"""


def _clean_environment() -> None:
    # Re-executes this process (same PID) with WATCHDOG_ENV_KEYS alone: /proc/PID/environ shows the environment a
    # process was exec'd with, which no change to os.environ rewrites.
    if os.environ.get(_CLEANED) == "clean":
        return
    kept = {k: v for k, v in os.environ.items() if k in WATCHDOG_ENV_KEYS} | {_CLEANED: "clean"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], kept)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdctl.units.supervise SERVICE_DIR", file=sys.stderr)
        return 2
    if argv is None:  # (run as the watchdog process, not called in-process)
        _clean_environment()
    return Watchdog(Path(args[0])).run()


if __name__ == "__main__":
    sys.exit(main())
