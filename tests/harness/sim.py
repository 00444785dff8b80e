"""Process fixtures for the SGLang stand-in (``python -m pdctl.sim``) and the real smg router.

Small API, for any test that needs engines or a router:

    from harness.sim import start_sim, start_smg, free_port, pd_pair, sim_command

    p = start_sim(["--model-path", "m", "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", str(free_port())])   # waits for /health == 200
    p.url, p.pid, p.port, p.bootstrap_port, p.log_text(); p.stop()       # stop(): SIGTERM, then SIGKILL

    r = start_smg(["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url])
    r.url; r.wait_ready(n_workers=2); r.stop()

Every process is started in its own session, bound to 127.0.0.1 with ports from ``free_port()``, waited
for with a deadline, and stopped by its own PID only.  ``start_sim``/``start_smg`` stop the process
themselves if it does not become ready in time and raise ``TimeoutError`` with the tail of its log.
Use them as context managers (``with start_sim(...) as p:``) or call ``stop()``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

#: Start-up knobs that keep stand-in engines fast in tests (callers' env wins).
FAST_ENV = {"PDCTL_SIM_LOAD_SECONDS": "0.2", "PDCTL_SIM_WARMUP_SECONDS": "0.1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no other test can be handed: :func:`free_ports`."""
    return free_ports(1)[0]


_PORT_SPAN = 1000
_next_port: list[int] = []


def _port_block() -> range:
    """This test process's own block of ports, below the kernel's ephemeral range so that no outbound connection
    (a router's or an engine's) is ever given one: block *k* for pytest-xdist worker ``gwk`` (0 without xdist),
    from 10000 up (under the demo's fixed ports, 29000 and above; 8998 lies below)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    k = int(worker[2:]) if worker[2:].isdigit() else 0
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start = 10000 + k * _PORT_SPAN
    if start + _PORT_SPAN > min(low, 29000):
        raise RuntimeError(f"no port block for xdist worker {worker}: ports 10000-{min(low, 29000)} hold "
                           f"{(min(low, 29000) - 10000) // _PORT_SPAN} workers' blocks; run fewer workers (-n)")
    return range(start, start + _PORT_SPAN)


def _bindable(port: int) -> bool:
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == errno.EAFNOSUPPORT:
                continue
            return False
    return True


def free_ports(n: int) -> list[int]:
    """*n* distinct TCP ports, free on every address, that no other test process is handed.

    Each test process (each pytest-xdist worker) takes ports in turn from a block of its own that lies below the
    kernel's ephemeral range (:func:`_port_block`): no connection's local port and no other worker can take one
    between this call and the server's bind, which a port from ``bind(("", 0))`` released before the server binds
    it could not promise. A port still bound (a server of an earlier test still exiting, a TIME_WAIT) is skipped; a
    port comes round again only after the block's 1000 ports."""
    block = _port_block()
    if not _next_port:
        _next_port.append(block.start)
    out: list[int] = []
    for _ in range(len(block)):
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < block.stop else block.start
        if _bindable(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} free ports in {block.start}-{block.stop - 1}")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when the connection fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def http_post(url: str, body: Any, timeout: float = 30.0) -> tuple[int, Any]:
    """(status, decoded JSON or text) of a JSON POST; status 0 when the connection fails."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, urllib.error.URLError):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Proc:
    """A process we started; ``stop()`` ends it (by PID) and is idempotent."""

    popen: subprocess.Popen
    url: str
    port: int
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit status."""
        if self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(5)
        return self.popen.returncode

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class SimProcess(Proc):
    """A running ``python -m pdctl.sim`` server."""

    bootstrap_port: int | None = None

    @property
    def bootstrap_url(self) -> str | None:
        return None if self.bootstrap_port is None else f"http://127.0.0.1:{self.bootstrap_port}"


_LOGS: list[Path] = []
"""Log files of the processes started here; removed when the test process exits (PDCTL_KEEP_TEST_LOGS=1 keeps them).
A failing test already shows the log it needs (``Proc.log_text``)."""


@atexit.register
def _remove_logs() -> None:
    if os.environ.get("PDCTL_KEEP_TEST_LOGS") == "1":
        return
    for path in _LOGS:
        with contextlib.suppress(OSError):
            path.unlink()


def _spawn(cmd: list[str], env: dict[str, str] | None, tag: str) -> tuple[subprocess.Popen, Path]:
    fd, path = tempfile.mkstemp(prefix=f"pdctl-{tag}-", suffix=".log")
    _LOGS.append(Path(path))
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    with os.fdopen(fd, "wb") as logf:
        popen = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=full_env, start_new_session=True)
    return popen, Path(path)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def wait_http(url: str, *, status: int = 200, timeout: float = 20.0, proc: Proc | None = None) -> bool:
    """Poll ``url`` until it answers ``status``; False on timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            return False
        code, _ = http_get(url, timeout=2.0)
        if code == status:
            return True
        time.sleep(0.05)
    return False


def start_sim(args: list[str], env: dict[str, str] | None = None, *, wait: bool = True,
              timeout: float = 20.0, nccl_port: bool = True) -> SimProcess:
    """Start ``python -m pdctl.sim ARGS`` and (by default) wait until ``/health`` is 200.

    ``--model-path`` defaults to ``deepseek-ai/DeepSeek-V3.2``, ``--host`` to 127.0.0.1, ``--port`` to a
    free port; a prefill server without ``--disaggregation-bootstrap-port`` gets a free one, and so does
    ``--nccl-port`` unless *nccl_port* is false (the engine then draws one at random, as SGLang does, which may
    be a port handed to another test).  ``env`` is added to the inherited environment on top of ``FAST_ENV``."""
    args = list(args)
    if nccl_port and _flag_value(args, "--nccl-port") is None and _flag_value(args, "--dist-init-addr") is None:
        args += ["--nccl-port", str(free_port())]
    if _flag_value(args, "--model-path") is None and _flag_value(args, "--model") is None:
        args = ["--model-path", "deepseek-ai/DeepSeek-V3.2"] + args
    if _flag_value(args, "--host") is None:
        args += ["--host", "127.0.0.1"]
    spare = iter(free_ports(2))
    port_s = _flag_value(args, "--port")
    if port_s is None:
        port = next(spare)
        args += ["--port", str(port)]
    else:
        port = int(port_s)
    mode = _flag_value(args, "--disaggregation-mode")
    bport_s = _flag_value(args, "--disaggregation-bootstrap-port")
    if mode == "prefill" and bport_s is None:
        bport_s = str(next(spare))
        args += ["--disaggregation-bootstrap-port", bport_s]
    bport = int(bport_s) if (mode == "prefill" and bport_s) else None
    host = _flag_value(args, "--host") or "127.0.0.1"
    cmd = sim_command(args)
    popen, log_path = _spawn(cmd, {**FAST_ENV, **(env or {})}, "sim")
    proc = SimProcess(popen=popen, url=f"http://{host}:{port}", port=port, log_path=log_path,
                      argv=cmd, bootstrap_port=bport)
    if wait and not wait_http(proc.url + "/health", timeout=timeout, proc=proc):
        rc = proc.popen.poll()
        proc.stop()
        why = f"exited with status {rc}" if rc is not None else f"not healthy within {timeout}s"
        raise TimeoutError(f"sim {' '.join(args)} {why}; log:\n" + proc.log_text()[-3000:])
    return proc


def sim_command(args: list[str]) -> list[str]:
    """The argv that runs the stand-in: SGLang's flags after ``python -m pdctl.sim`` (production runs
    ``python -m sglang.launch_server`` with the same flags)."""
    return [sys.executable, "-m", "pdctl.sim", *args]


def smg_binary() -> str:
    """Path of the real smg router (on PATH or next to the running interpreter)."""
    found = shutil.which("smg")
    if found:
        return found
    cand = Path(sys.executable).parent / "smg"
    if cand.exists():
        return str(cand)
    raise FileNotFoundError("smg binary not found (pip install smg==1.13.0)")


@dataclass
class SmgProcess(Proc):
    prometheus_port: int | None = None

    def workers(self) -> dict[str, Any]:
        code, body = http_get(self.url + "/workers")
        return json.loads(body) if code == 200 else {}

    def wait_ready(self, n_workers: int = 2, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for ``/readiness`` 200 and ``n_workers`` healthy workers; returns ``/workers``."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if not self.alive():
                break
            code, _ = http_get(self.url + "/readiness", timeout=2.0)
            if code == 200:
                last = self.workers()
                healthy = [w for w in last.get("workers", []) if w.get("is_healthy")]
                if len(healthy) >= n_workers:
                    return last
            time.sleep(0.1)
        raise TimeoutError(f"smg not ready with {n_workers} healthy workers in {timeout}s: {last}\n"
                           + self.log_text()[-3000:])


def start_smg(args: list[str], env: dict[str, str] | None = None, *, timeout: float = 20.0) -> SmgProcess:
    """Start ``smg launch ARGS`` on 127.0.0.1 (free router and Prometheus ports unless given) and wait
    for its liveness ``/health``.  Call ``wait_ready()`` to wait for workers."""
    args = list(args)
    if _flag_value(args, "--host") is None:
        args += ["--host", "127.0.0.1"]
    spare = iter(free_ports(2))
    port_s = _flag_value(args, "--port")
    port = int(port_s) if port_s else next(spare)
    if port_s is None:
        args += ["--port", str(port)]
    prom_s = _flag_value(args, "--prometheus-port")
    prom = int(prom_s) if prom_s else next(spare)
    if prom_s is None:
        args += ["--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1"]
    cmd = [smg_binary(), "launch", *args]
    popen, log_path = _spawn(cmd, env, "smg")
    proc = SmgProcess(popen=popen, url=f"http://127.0.0.1:{port}", port=port, log_path=log_path, argv=cmd,
                      prometheus_port=prom)
    if not wait_http(proc.url + "/health", timeout=timeout, proc=proc):
        proc.stop()
        raise TimeoutError("smg did not come up; log:\n" + proc.log_text()[-3000:])
    return proc


def pd_pair(common: list[str] | None = None, env: dict[str, str] | None = None,
            prefill_extra: list[str] | None = None, decode_extra: list[str] | None = None,
            ) -> tuple[SimProcess, SimProcess]:
    """Start a healthy prefill + decode stand-in pair (same model flags); caller stops both."""
    common = list(common or [])
    p = start_sim(common + ["--disaggregation-mode", "prefill"] + list(prefill_extra or []), env)
    try:
        d = start_sim(common + ["--disaggregation-mode", "decode",
                                "--disaggregation-bootstrap-port", str(p.bootstrap_port)]
                      + list(decode_extra or []), env)
    except BaseException:
        p.stop()
        raise
    return p, d


def sse_events(raw: bytes | str) -> Iterator[Any]:
    """Decode an SSE body into JSON objects (``[DONE]`` yields the string ``"[DONE]"``)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)
