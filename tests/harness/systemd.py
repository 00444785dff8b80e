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
PID only if it lingers. journald does not run there: units log to files (``StandardOutput=append:``).

Use the ``user_systemd`` fixture (module-scoped; tests share one manager) or
``UserSystemd.start(root)`` directly. ``UserSystemd.skip_reason()`` says why it cannot run here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"


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

    @staticmethod
    def skip_reason() -> str | None:
        if os.geteuid() != 0:
            return "needs root (unshare -m and mount)"
        for exe in ("unshare", "systemctl", "systemd-analyze"):
            if shutil.which(exe) is None:
                return f"{exe} not installed"
        if not os.access(SYSTEMD, os.X_OK):
            return f"{SYSTEMD} not installed"
        return None

    @classmethod
    def start(cls, root: Path, *, timeout: float = 30.0) -> UserSystemd:
        root = Path(root)
        home, xdg = root / "home", root / "xdg"
        unit_dir = home / ".config" / "systemd" / "user"
        unit_dir.mkdir(parents=True, exist_ok=True)
        xdg.mkdir(parents=True, exist_ok=True)
        os.chmod(xdg, 0o700)
        log_path = root / "systemd-user.log"
        env = {"XDG_RUNTIME_DIR": str(xdg), "HOME": str(home)}
        script = (
            "mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -p /run/systemd/system && "
            f"exec {SYSTEMD} --user --log-target=console --log-level=info"
        )
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                env={**os.environ, **env, "SYSTEMD_LOG_COLOR": "0"}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        mgr = cls(root=root, proc=proc, unit_dir=unit_dir, runtime_dir=xdg, home=home, log_path=log_path, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
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


def user_systemd_session(root: Path) -> Iterator[UserSystemd]:
    """Generator body for a pytest fixture: skip when impossible, always tear down."""
    from harness import skip_or_fail

    why = UserSystemd.skip_reason()
    if why:
        skip_or_fail(f"real systemd: {why}")
    mgr = UserSystemd.start(root)
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
