"""SIGTERM and SIGHUP stop the commands that change nothing (status, chat) as they stop plan and apply: like Ctrl-C,
with exit 143 / 129, one line that says what the interruption left, no traceback, and no command of theirs left
running. Each command here blocks on something that never answers, and is signalled while it waits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.deploy import SEED, interrupted_while_a_host_command_runs

SIGNALS = [(signal.SIGTERM, 143, "terminated (SIGTERM); "), (signal.SIGHUP, 129, "hung up (SIGHUP); ")]


def _in_group(pgid: int) -> list[int]:
    """PIDs of the live processes (zombies aside) whose process group is *pgid*."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(pid))
    return found


@pytest.mark.parametrize("sig,rc,said", SIGNALS)
def test_status_stopped_by_a_signal_while_systemctl_hangs_ends_it_and_says_so(tmp_path, sig, rc, said):
    # (status had no handler: SIGTERM ended pdctl at once, silently, and the systemctl it waited on, in a session of
    # its own that no terminal signal reaches, ran on with nothing left to time it out). The seed is a systemd
    # deployment: status asks systemctl first, whose stand-in here answers only after 30 s.
    r, took, ended = interrupted_while_a_host_command_runs(tmp_path, ["status"], sig, SEED, executable="systemctl")
    assert r.returncode == rc, r.stderr
    assert ended, "the systemctl that status ran still runs after pdctl exited"
    assert took < 10, took  # not the stand-in's 30 s
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "" and r.stderr.rstrip().splitlines()[-1] == (
        said + "interrupted: status only reads, it changes nothing; run it again"), r.stderr


@pytest.mark.parametrize("sig,rc,said", SIGNALS)
def test_chat_stopped_by_a_signal_while_the_router_does_not_answer_says_so(console_demo, sig, rc, said):
    # (chat had no handler: SIGTERM ended it at once with no word, exit -15). The deployment is journalled as deployed
    # and its router port is held by a listener that reads the request and never answers.
    console_demo.pretend_deployed(lambda d: None)
    router = socket.socket()
    router.bind(("127.0.0.1", console_demo.ports["router"]))
    router.listen(1)
    router.settimeout(60)
    env = {**os.environ, "PDCTL_STATE_DIR": str(console_demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "chat", str(console_demo.spec)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)  # its own group: p.pid
    try:
        conn, _ = router.accept()
        with conn:
            conn.settimeout(30)
            request = b""
            while b"\r\n\r\n" not in request:  # the POST's headers: chat now waits for the answer
                chunk = conn.recv(65536)
                assert chunk, "chat closed the connection before its request was sent"
                request += chunk
            assert request.startswith(b"POST /v1/chat/completions "), request[:80]
            t0 = time.monotonic()
            p.send_signal(sig)
            out, err = p.communicate(timeout=30)
            took = time.monotonic() - t0
    finally:
        router.close()
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == rc, err
    assert took < 10, took  # not chat's 120 s --timeout
    assert "Traceback" not in err, err
    assert out == "" and err.rstrip().splitlines()[-1] == (
        said + "interrupted: the chat was abandoned unanswered (it changes nothing of the deployment); run it again"), err
    assert _in_group(p.pid) == []  # nothing it started runs on
