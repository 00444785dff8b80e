"""A demo deployment on free loopback ports, for end-to-end tests and benchmarks.

``Demo(tmp)`` writes a copy of ``examples/demo.toml`` (the SGLang stand-in under the process
supervisor, the real smg router) with free ports, a unique name, fast stand-in start-up and its
own state directory; nothing starts until ``apply``. ``down()`` stops what it started and, as a
last resort for a broken test, ends the processes that listen on its ports — found through
``/proc`` (smg retitles itself ``smg::router``, so command lines cannot tell deployments apart).

Specs are written with ``tomli_w``; ``tomllib`` reads them back to the same dict.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import tomli_w

from harness.sim import free_ports

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.toml"
SEED = ROOT / "examples" / "seed.toml"

__all__ = ["DEMO", "SEED", "Demo", "demo_dict", "discover_spec", "dsv32_dict", "dump_toml",
           "interrupted_while_a_host_command_runs", "interrupted_while_nvidia_smi_runs", "listening_pids",
           "process_gone", "seed_dict"]


def dump_toml(d: dict) -> str:
    """TOML text of a spec dict."""
    return tomli_w.dumps(d)


def demo_dict() -> dict:
    return tomllib.loads(DEMO.read_text())


def seed_dict() -> dict:
    return tomllib.loads(SEED.read_text())


def discover_spec(tmp_path: Path) -> Path:
    """The seed written under *tmp_path* with its host's inventory to be discovered (``inventory = "discover"``: the
    GPUs and NUMA nodes read from nvidia-smi and sysfs at plan time) rather than given."""
    d = seed_dict()
    host = next(iter(d["hosts"]))
    for k in ("gpu_numa", "numa_cpus"):
        d["hosts"][host].pop(k, None)
    d["hosts"][host]["inventory"] = "discover"
    spec = tmp_path / "discover.toml"
    spec.write_text(dump_toml(d))
    return spec


def process_gone(pid: int) -> bool:
    """No process *pid* any more, or only its zombie (its parent exited, or has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: reaped between open and read)
        return True


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """``kill -STOP`` *pid* and return once proc(5) shows it stopped (``T``): kill returns before the signal lands."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"PID {pid} not stopped {timeout} s after SIGSTOP")


def interrupted_while_nvidia_smi_runs(tmp_path: Path, command: list[str], sig: int,
                                      smi_s: int = 30) -> tuple[subprocess.CompletedProcess, float, bool]:
    """``pdctl *command* <discover spec>`` with a host whose ``nvidia-smi`` answers only after *smi_s* seconds, sent
    *sig* once that stand-in has started: :func:`interrupted_while_a_host_command_runs`."""
    return interrupted_while_a_host_command_runs(tmp_path, command, sig, discover_spec(tmp_path),
                                                 executable="nvidia-smi", hang_s=smi_s)


def interrupted_while_a_host_command_runs(tmp_path: Path, command: list[str], sig: int, spec: Path, *,
                                          executable: str, hang_s: int = 30,
                                          ) -> tuple[subprocess.CompletedProcess, float, bool]:
    """``pdctl *command* <spec>`` whose host's *executable* (``nvidia-smi``, ``systemctl``, ``true``: a stand-in first
    on PATH) answers only after *hang_s* seconds, sent *sig* once that stand-in has started: ``(the finished pdctl,
    seconds from the signal to its exit, whether the stand-in had ended by then)``. The state directory is
    ``tmp_path / "state"``; the stand-in is killed by its PID afterwards if it still runs. Bounded: 60 s for the start,
    30 s for the exit."""
    started = tmp_path / f"{executable}.pid"
    started.unlink(missing_ok=True)  # (an earlier call's, in the same folder)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / executable).write_text(f"#!/bin/sh\necho $$ > {started}.tmp && mv {started}.tmp {started}\n"
                                               f"exec sleep {hang_s}\n")
    (tmp_path / "bin" / executable).chmod(0o755)
    env = {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state"),
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "-m", "pdctl", command[0], str(spec), *command[1:]]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (a background job's SIG_IGN)
    stand_in = None
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert started.exists(), p.communicate(timeout=30)
        stand_in = int(started.read_text())
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
        ended = process_gone(stand_in)  # as pdctl exits, not after a grace period
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if stand_in is not None and not process_gone(stand_in):  # (the stand-in started here, by its PID)
            try:
                os.kill(stand_in, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(argv, p.returncode, out, err), took, ended


def dsv32_dict() -> dict:
    """The seed's shape serving DeepSeek-V3.2 with pdctl's kernels: the checkpoint whose sparse attention they compute
    (SGLang's dsa backend, 64-token pages, the 656-byte FP8 rows), with the plugin's decode path and V3.2's parsers
    (SGLang docs/basic_usage/deepseek_v32.md: deepseek-v3 and deepseekv32). For rules, argv and units only: the
    weights would not fit one 4-GPU group of the seed's host."""
    d = seed_dict()
    d["name"] = "dsv32"
    d["model"].update(path="deepseek-ai/DeepSeek-V3.2", served_name="deepseek-v3.2", page_size=64,
                      dsa_prefill_backend="triton_sparse_mla", dsa_decode_backend="flashmla_kv")
    d["model"].pop("attention_backend", None)  # (the seed pins V4's dsv4; V3.2 runs the dsa backend SGLang picks)
    d["parsers"] = {"reasoning_parser": "deepseek-v3", "tool_call_parser": "deepseekv32"}
    d["kernels"] = {"enabled": True, "which": ["sparse_mla_decode", "lightning_indexer"]}
    return d


def listening_pids(ports: list[int]) -> list[int]:
    """PIDs of the processes listening on one of *ports* on this machine."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) in ports:
                inodes.add(f[9])
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                out.add(int(pid))
                break
    return sorted(out)


class Demo:
    """The demo topology on free ports in a temporary directory."""

    prefix = "t"

    def __init__(self, tmp: Path, mutate=None) -> None:  # noqa: ANN001
        d = demo_dict()
        self.name = self.prefix + uuid.uuid4().hex[:8]
        d["name"] = self.name
        keys = ("prefill", "bootstrap", "pnccl", "decode", "dnccl", "router", "prom")
        self.ports = dict(zip(keys, free_ports(len(keys))))
        d["prefill"][0].update(port=self.ports["prefill"], bootstrap_port=self.ports["bootstrap"], nccl_port=self.ports["pnccl"])
        d["decode"][0].update(port=self.ports["decode"], nccl_port=self.ports["dnccl"])
        d["router"].update(port=self.ports["router"], prometheus_port=self.ports["prom"], health_check_interval_s=1)
        d["engine"]["env"] = {**d["engine"].get("env", {}), "PDCTL_SIM_LOAD_SECONDS": "0.3", "PDCTL_SIM_WARMUP_SECONDS": "0.1"}
        if mutate:
            mutate(d)
        self.dict = d
        self.tmp = Path(tmp)
        self.spec = self.tmp / f"{self.name}.toml"
        self.spec.write_text(dump_toml(d))
        self.state = self.tmp / "state"

    def write(self, d: dict, name: str) -> Path:
        p = self.tmp / name
        p.write_text(dump_toml(d))
        return p

    def load(self, spec: Path | None = None):  # noqa: ANN201
        from pdctl.statemachine import service

        return service.load(spec or self.spec, state_dir=self.state)

    def timeouts(self):  # noqa: ANN201
        from pdctl.statemachine.steps import Timeouts

        return Timeouts(role_start=60, bootstrap=15, kv_request=30, router=60, chat=30)

    def apply(self, spec: Path | None = None, **kw):  # noqa: ANN201
        from pdctl.statemachine import service

        kw.setdefault("timeouts", self.timeouts())
        return service.apply(self.load(spec), **kw)

    def status(self, **kw) -> dict:  # noqa: ANN003
        from pdctl.statemachine import service

        return service.status(self.load(), **kw)

    def pids(self) -> list[int]:
        return listening_pids(list(self.ports.values()))

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        env = {**os.environ, "PDCTL_STATE_DIR": str(self.state)}
        return subprocess.run([sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, timeout=timeout, env=env)

    def kill_routers(self) -> None:
        """SIGKILL each router this demo's process supervisor runs, and its watchdog first (so that it does not
        start it again): smg drains for 5 s on SIGTERM (its ``drain_settle_secs``, which its launcher does not
        expose), which a teardown need not wait for. Only a watchdog whose command line names the router's folder,
        and a router whose parent it is, are signalled."""
        for folder in (self.state / "supervisor" / "services").glob("*-router.service"):
            try:
                wpid = int((folder / "watchdog.pid").read_text())
                mpid = int((folder / "main.pid").read_text())
                cmdline = Path(f"/proc/{wpid}/cmdline").read_bytes().split(b"\0")
                ppid = int(Path(f"/proc/{mpid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if str(folder).encode() not in cmdline or ppid != wpid:
                continue
            os.kill(wpid, signal.SIGKILL)
            try:
                os.killpg(mpid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while not (process_gone(wpid) and process_gone(mpid)) and time.monotonic() < deadline:
                time.sleep(0.02)

    def down(self) -> None:
        """Take the demo down with ``service.down`` once its routers are killed (:meth:`kill_routers`)."""
        from pdctl.statemachine import service
        from pdctl.statemachine.errors import PdctlError

        self.kill_routers()
        try:
            service.down(self.load())
        except PdctlError:
            pass  # a remote host or a broken journal: nothing of it to stop here, see below
        finally:
            # Last resort for a broken test: end only the processes listening on this demo's ports.
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
