"""The console in a real terminal: ``pdctl console SPEC`` inside tmux (80x24), keys sent,
``capture-pane`` read back. Uses a private tmux socket and kills only the session it made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdctl.console import telemetry

from .conftest import ConsoleDemo

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")

STEPS = ("kernels_built", "prefill_up", "decode_up", "kv_link_verified", "router_exposed", "parsers_configured")


class Tmux:
    def __init__(self) -> None:
        self.socket = f"pdctl-test-{uuid.uuid4().hex[:8]}"
        self.session = "console"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10, check=check)

    def start(self, command: str) -> None:
        self.run("new-session", "-d", "-s", self.session, "-x", "80", "-y", "24", command)

    def capture(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session, check=False).stdout

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.session, *keys)

    def wait_for(self, *texts: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if all(t in screen for t in texts):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{texts} not on screen after {timeout}s:\n{screen}")

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.session, check=False).returncode == 0

    def kill(self) -> None:
        self.run("kill-session", "-t", self.session, check=False)


@pytest.fixture
def tmux():
    t = Tmux()
    yield t
    t.kill()


def test_console_in_tmux_shows_the_six_steps_and_the_gpu_panel(tmp_path, tmux):
    demo = ConsoleDemo(tmp_path)  # a free-port copy of examples/demo.toml; nothing started
    tmux.start(f"TERM=xterm-256color PDCTL_STATE_DIR={demo.state} exec {sys.executable} -m pdctl {demo.spec} --refresh 0.5")
    screen = tmux.wait_for(*STEPS)
    assert "State machine" in screen and "pending" in screen
    tmux.keys("2")
    if telemetry.nvml_status()[0]:
        screen = tmux.wait_for("GPU(s), driver")
    else:
        # Wait for every line the test reads: tmux can be captured while Textual is part-way
        # through drawing the tab (CI once caught the panel's first line without the rest).
        screen = tmux.wait_for("No GPU telemetry", "NVML", "GPUs by role (deployed, else the spec): prefill 0-3, decode 4-7")
    assert all(s in screen for s in STEPS)  # the steps stay on screen over every tab
    tmux.keys("q")
    deadline = time.monotonic() + 10
    while tmux.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tmux.alive(), "q did not quit the console"


def test_ctrl_c_quits_the_idle_console_as_q_does(tmp_path, tmux):
    # (a fresh user's Ctrl-C, twice, got Textual's "Do you want to quit? Press ctrl+q to quit the app" and the console
    # kept running: neither the README nor the keys panel said so)
    demo = ConsoleDemo(tmp_path)
    rc_file = tmp_path / "rc"
    tmux.start(f"TERM=xterm-256color PDCTL_STATE_DIR={demo.state} {sys.executable} -m pdctl {demo.spec} --refresh 0.5; "
               f"echo rc=$? > {rc_file}; sleep 30")
    tmux.wait_for(*STEPS)
    tmux.keys("C-c")
    deadline = time.monotonic() + 15
    while not rc_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rc_file.exists(), tmux.capture()
    assert rc_file.read_text().strip() == "rc=0"


@pytest.mark.parametrize("sig,code", [("INT", 130), ("TERM", 143)])
def test_a_signal_ends_the_idle_console_with_its_exit_code_and_restores_the_terminal(tmp_path, tmux, sig, code):
    # `kill -INT` (Ctrl-C is a key in the console's raw mode, which quits as q does; only another process sends SIGINT) raised
    # KeyboardInterrupt wherever Textual was: a traceback and asyncio's "Task was destroyed but it is pending!" on the
    # operator's terminal, and a line saying the console was quit during an apply. Now it ends as SIGTERM does (143).
    import signal

    demo = ConsoleDemo(tmp_path)
    rc_file = tmp_path / "rc"
    tmux.start(f"TERM=xterm-256color PDCTL_STATE_DIR={demo.state} {sys.executable} -m pdctl {demo.spec} --refresh 0.5; "
               f"echo rc=$? > {rc_file}; tput rmcup >/dev/null 2>&1; echo shell-after; sleep 30")
    tmux.wait_for(*STEPS)
    shell = int(tmux.run("display-message", "-p", "-t", tmux.session, "#{pane_pid}").stdout)
    children = (Path(f"/proc/{shell}/task/{shell}/children").read_text().split())
    assert len(children) == 1, children  # the console, started by the pane's shell
    os.kill(int(children[0]), getattr(signal, f"SIG{sig}"))
    deadline = time.monotonic() + 15
    while not rc_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rc_file.read_text().strip() == f"rc={code}"
    screen = tmux.wait_for("shell-after")
    assert "State machine" not in screen  # (the console left its screen)
    assert "Traceback" not in screen and "Task was destroyed" not in screen, screen
    said = {"INT": "interrupted (SIGINT)", "TERM": "terminated (SIGTERM)"}[sig]
    assert f"{said}: the console was closed; no apply was running" in screen, screen  # (SIGTERM said nothing)
    assert "during an apply" not in screen, screen
