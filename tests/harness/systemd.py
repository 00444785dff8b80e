"""A real systemd user manager for tests, on a machine whose PID 1 is not systemd.

``systemd --user`` refuses to run unless ``/run/systemd/system`` exists (it checks that the system
was booted with systemd). The harness starts it inside a private mount namespace whose ``/run`` is
a fresh tmpfs holding that directory — nothing leaks to the host's ``/run`` — with
``XDG_RUNTIME_DIR`` on the *real* filesystem (under the test's tmp dir), so that the test process,
outside the namespace, reaches the manager's private socket with plain ``systemctl --user`` and
writes units to ``$HOME/.config/systemd/user`` directly. Processes the manager starts live in the
same PID and network namespaces as the tests: PIDs can be killed and ports probed from the test.

Shape (works with pytest, no test has to run inside the namespace)::

    unshare -m --propagation private sh -c 'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system
                                             && exec /lib/systemd/systemd --user'

``unshare`` without ``--fork`` execs, so the PID we started *is* the manager. Teardown:
``systemctl --user exit`` (stops every unit, then the manager), a bounded wait, SIGKILL to that one
PID only if it lingers. By default journald does not run there: a unit's output goes nowhere unless it
names a file (``StandardOutput=append:``).

``start(root, journald=True)`` runs a real ``systemd-journald`` there too, as a host with systemd has it:

* journald runs in the namespace, before the manager, ``Storage=volatile`` (a drop-in in the private
  ``/run/systemd/journald.conf.d``): its sockets and files are in the private ``/run`` and nothing reaches the
  host's ``/run`` or ``/var/log/journal``; ``ReadKMsg=no``, ``Audit=no``, no forwarding.
* The manager runs in a cgroup of its own named as a real user manager's (``<unique>.slice/user@UID.service``,
  made at the cgroup root and removed at teardown): journald attributes a unit's lines from that path
  (``_SYSTEMD_USER_UNIT``), which is what ``journalctl --user-unit`` matches. (From ``init.scope``, where the
  plain harness runs it, journald would record ``_SYSTEMD_UNIT`` and ``--user-unit`` would find nothing.)
* ``journalctl`` reaches that journal through a wrapper first on ``env["PATH"]`` that runs the real one with
  ``nsenter -m`` into the manager's mount namespace: the same arguments as on a host, reading ``/run/log/journal``.

Use the ``user_systemd`` fixture (module-scoped; tests share one manager) or
``UserSystemd.start(root)`` directly. ``UserSystemd.skip_reason()`` says why it cannot run here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
JOURNALD = "/lib/systemd/systemd-journald"


@dataclass
class UserSystemd:
    """A running private user manager. ``env`` reaches it (``XDG_RUNTIME_DIR``, ``HOME``)."""

    root: Path
    proc: subprocess.Popen
    unit_dir: Path
    runtime_dir: Path
    home: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cgroups: list[Path] = field(default_factory=list)
    """``journald=True``: the manager's cgroup in each hierarchy (``…/<unique>.slice/user@UID.service``)."""

    @staticmethod
    def skip_reason(*, journald: bool = False) -> str | None:
        if os.geteuid() != 0:
            return "needs root (unshare -m and mount)"
        for exe in ("unshare", "systemctl", "systemd-analyze", *(("nsenter", "journalctl") if journald else ())):
            if shutil.which(exe) is None:
                return f"{exe} not installed"
        for exe in (SYSTEMD, *((JOURNALD,) if journald else ())):
            if not os.access(exe, os.X_OK):
                return f"{exe} not installed"
        if journald:
            mounts = _cgroup_mounts()
            if "cgroup2" not in mounts:
                return "no cgroup2 hierarchy mounted (the manager's cgroup names its user units for journald)"
            if not all(os.access(m, os.W_OK) for m in mounts.values()):
                return f"cgroup hierarchies not writable: {', '.join(map(str, mounts.values()))}"
        return None

    @classmethod
    def start(cls, root: Path, *, timeout: float = 30.0, journald: bool = False) -> UserSystemd:
        root = Path(root)
        home, xdg = root / "home", root / "xdg"
        unit_dir = home / ".config" / "systemd" / "user"
        unit_dir.mkdir(parents=True, exist_ok=True)
        xdg.mkdir(parents=True, exist_ok=True)
        os.chmod(xdg, 0o700)
        log_path = root / "systemd-user.log"
        env = {"XDG_RUNTIME_DIR": str(xdg), "HOME": str(home)}
        script = "mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -p /run/systemd/system && "
        cgroups: list[Path] = []
        if journald:
            script += _journald_script(root)
            # (made here, removed by stop(): a name no other manager has, under slices only, as user@UID.service is)
            slice_ = f"pdctl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.slice"
            for mount in _cgroup_mounts().values():
                cgroups.append(mount / slice_ / f"user@{os.geteuid()}.service")
                cgroups[-1].mkdir(parents=True)
            script += "".join(f"echo $$ > {shlex.quote(str(cg / 'cgroup.procs'))} && " for cg in cgroups)
            bindir = root / "bin"
            bindir.mkdir(exist_ok=True)
            env["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
        script += f"exec {SYSTEMD} --user --log-target=console --log-level=info"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                env={**os.environ, **env, "SYSTEMD_LOG_COLOR": "0"}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        mgr = cls(root=root, proc=proc, unit_dir=unit_dir, runtime_dir=xdg, home=home, log_path=log_path, env=env,
                  cgroups=cgroups)
        if journald:  # (the PID started is the manager's, in its mount namespace: nsenter reaches that /run)
            wrapper = root / "bin" / "journalctl"
            wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('nsenter')} -t {proc.pid} -m -- "
                               f"{shutil.which('journalctl')} \"$@\"\n")
            wrapper.chmod(0o755)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                mgr.stop()  # (a journald it started, its cgroups)
                raise RuntimeError(f"systemd --user exited {proc.returncode}:\n{mgr.log_tail()}")
            if (xdg / "systemd" / "private").exists():
                # (``is-system-running`` says "offline": it checks the host's /run, not the manager)
                r = mgr.systemctl("show", "-p", "SystemState", check=False, timeout=5)
                if r.stdout.strip() in ("SystemState=running", "SystemState=degraded"):
                    return mgr
            time.sleep(0.1)
        mgr.stop()
        raise TimeoutError(f"systemd --user not running after {timeout:g} s:\n{mgr.log_tail()}")

    def systemctl(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", "--user", *args], env={**os.environ, **self.env}, check=check,
                              capture_output=True, text=True, timeout=timeout)

    def journalctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """``journalctl ARGS`` on this manager's journal (``journald=True``), checked."""
        return subprocess.run(["journalctl", *args], env={**os.environ, **self.env}, check=True,
                              capture_output=True, text=True, timeout=timeout)

    def journald_pid(self) -> int | None:
        """The PID of the journald :meth:`start` ran (``journald=True``), None while it has not said it."""
        try:
            return int((self.root / "journald.pid").read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def manager(self, host=None):
        """A :class:`pdctl.units.SystemdManager` (user scope) pointed at this manager."""
        from pdctl.statemachine.hosts import LocalHost
        from pdctl.units import SystemdManager

        return SystemdManager(host or LocalHost(), scope="user", unit_dir=str(self.unit_dir), env=self.env)

    def reset(self) -> None:
        """Stop every unit and delete every unit file (between tests sharing the manager)."""
        self.systemctl("stop", "--", "pdctl-*", check=False, timeout=120)
        for p in self.unit_dir.iterdir():
            if p.is_file():
                p.unlink()
            elif p.is_dir() and p.name.endswith(".wants"):  # the links `systemctl enable` of a target made
                for link in p.iterdir():
                    link.unlink()
        self.systemctl("daemon-reload", check=False)
        self.systemctl("reset-failed", check=False)

    def stop(self, timeout: float = 60.0) -> None:
        """``systemctl --user exit``, wait; SIGKILL the manager's PID only if it lingers."""
        if self.proc.poll() is None:
            try:
                self.systemctl("exit", check=False, timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        jpid = self.journald_pid()
        if jpid is not None:  # (the journald start() ran, by its PID, while that PID is still a journald)
            _end(jpid, "systemd-journal", timeout=10)
        deadline = time.monotonic() + 10
        for cg in self.cgroups:  # (empty once every process in them has exited: their folders, deepest first)
            below = sorted((p for p in cg.parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for folder in [*below, cg.parent]:
                while folder.exists():
                    try:
                        folder.rmdir()
                    except OSError:
                        if time.monotonic() >= deadline:
                            break
                        time.sleep(0.05)


def _cgroup_mounts() -> dict[str, Path]:
    """Where the cgroup2 hierarchy (``"cgroup2"``) and v1's ``name=systemd`` (``"name=systemd"``, hybrid hosts) are
    mounted here (proc(5) ``mountinfo``)."""
    out: dict[str, Path] = {}
    try:
        rows = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for row in rows:
        pre, _, post = row.partition(" - ")
        fstype, _, opts = (post.split() + ["", "", ""])[:3]
        point = Path(pre.split()[4].replace("\\040", " "))
        if fstype == "cgroup2":
            out.setdefault("cgroup2", point)
        elif fstype == "cgroup" and "name=systemd" in opts.split(","):
            out.setdefault("name=systemd", point)
    return out


JOURNALD_CONF = "[Journal]\nStorage=volatile\nReadKMsg=no\nAudit=no\nForwardToSyslog=no\nForwardToWall=no\n"


def _journald_script(root: Path) -> str:
    """The part of the namespace's script that starts journald (its PID to ``root/journald.pid``) and waits, at most
    10 s, for its stdout socket, which a unit's output connects to as its exec begins."""
    pidfile, log = shlex.quote(str(root / "journald.pid")), shlex.quote(str(root / "journald.log"))
    return ("mkdir -p /run/systemd/journald.conf.d && "
            f"printf '{JOURNALD_CONF}' > /run/systemd/journald.conf.d/test.conf && "
            f"{{ {JOURNALD} > {log} 2>&1 & echo $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; }} && "
            "i=0 && while [ ! -S /run/systemd/journal/stdout ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done && "
            "[ -S /run/systemd/journal/stdout ] && ")


def _end(pid: int, comm: str, *, timeout: float) -> None:
    """SIGTERM process *pid* while its name is *comm*, SIGKILL it if it lingers *timeout* seconds."""
    def alive() -> bool:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() == comm and pid_alive(pid)
        except OSError:
            return False

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not alive():
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)


def user_systemd_session(root: Path, *, journald: bool = False) -> Iterator[UserSystemd]:
    """Generator body for a pytest fixture: skip when impossible, always tear down. *journald*: see
    :meth:`UserSystemd.start`."""
    from harness import skip_or_fail

    why = UserSystemd.skip_reason(journald=journald)
    if why:
        skip_or_fail(f"real systemd{' with journald' if journald else ''}: {why}")
    mgr = UserSystemd.start(root, journald=journald)
    try:
        yield mgr
    finally:
        mgr.stop()


# -- a PD deployment of stand-ins, for scenario tests under either manager ------------------------
#
# ``pd_deployment(tmp_path, service_manager)`` builds a PD spec whose engines are ``pdctl.sim``
# (1.5 s "model load": ``/health`` 503 until then) and whose router is the real smg behind a tiny
# wrapper that, before exec'ing smg, records what both servers' ``/health`` answered at the
# instant the router started: the ordering check reads that file.

from harness.sim import free_ports  # noqa: E402
from pdctl.statemachine.spec import Deployment, parse_spec  # noqa: E402

SMG = Path(sys.executable).parent / "smg"

ROUTER_WRAPPER = """\
#!{python}
import json, os, sys, time, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
seen = {{}}
for url in os.environ["PROBE_URLS"].split():
    try:
        seen[url] = opener.open(url, timeout=2).status
    except urllib.error.HTTPError as e:
        seen[url] = e.code
    except Exception:
        seen[url] = 0
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps({{"t": time.time(), "pid": os.getpid(), "health": seen}}) + "\\n")
os.execv({smg!r}, [{smg!r}] + sys.argv[1:])
"""


@dataclass
class PD:
    dep: Deployment
    probe_out: Path
    ports: dict[str, int]

    def units(self, **kw):
        """``unit_set_for(dep, **kw)`` with test-speed restarts (1 s instead of 10 s / 5 s)."""
        import dataclasses

        from pdctl.statemachine.launch import unit_set_for
        from pdctl.units import UnitSet

        us = unit_set_for(self.dep, **kw)
        return UnitSet(target=us.target, services=tuple(dataclasses.replace(s, restart_sec=1) for s in us.services))

    def probes(self) -> list[dict]:
        if not self.probe_out.exists():
            return []
        return [json.loads(line) for line in self.probe_out.read_text().splitlines() if line.strip()]


def pd_deployment(tmp_path: Path, service_manager: str, name: str = "t") -> PD:
    from harness import skip_or_fail

    if not SMG.exists():
        skip_or_fail(f"smg not installed at {SMG}")
    keys = ("prefill", "decode", "bootstrap", "router", "metrics", "pnccl", "dnccl")
    ports = dict(zip(keys, free_ports(len(keys))))
    wrapper = tmp_path / "bin" / "router-probe"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(ROUTER_WRAPPER.format(python=sys.executable, smg=str(SMG)))
    wrapper.chmod(0o755)
    probe_out = tmp_path / "router-probe.jsonl"
    health = [f"http://127.0.0.1:{ports[r]}/health" for r in ("prefill", "decode")]
    dep = parse_spec({
        "name": name,
        "service_manager": service_manager,
        "engine": {"launcher": "sim", "env": {"PDCTL_SIM_LOAD_SECONDS": "1.5", "PDCTL_SIM_WARMUP_SECONDS": "0.1"}},
        "model": {"path": "deepseek-ai/DeepSeek-V4-Flash", "page_size": 64, "kv_cache_dtype": "fp8_e4m3"},
        "prefill": [{"gpus": [0], "port": ports["prefill"], "bootstrap_port": ports["bootstrap"],
                     "nccl_port": ports["pnccl"]}],
        "decode": [{"gpus": [1], "port": ports["decode"], "nccl_port": ports["dnccl"]}],
        "kv_transfer": {"backend": "mooncake_tcp"},
        "router": {"port": ports["router"], "prometheus_port": ports["metrics"], "health_check_interval_s": 1,
                   "worker_startup_timeout_s": 60, "executable": str(wrapper),
                   "extra_args": ["--shutdown-grace-period-secs", "2"],
                   "env": {"PROBE_URLS": " ".join(health), "PROBE_OUT": str(probe_out)}},
    })
    return PD(dep=dep, probe_out=probe_out, ports=ports)


def pid_alive(pid: int) -> bool:
    """True for a live process (a zombie is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")
