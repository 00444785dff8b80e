"""`pdctl logs`: each role's log lines through its service manager, on the deployment's host. (A read that never
comes back is ended by pytest-timeout: pyproject's 300 s.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdctl.console.cli import FOLLOW_POLL_S


def _output_log(demo, role: str) -> list[str]:  # noqa: ANN001
    """The role's log as the process supervisor wrote it, read here whole."""
    path = demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-{role}.service" / "output.log"
    return path.read_text(errors="replace").splitlines()


def _the_end_of(lines: list[str], log: list[str]) -> bool:
    """Whether *lines* are the end of *log* as it stood a moment before it was read here: the router's health checks
    write on meanwhile."""
    return any(log[i:i + len(lines)] == lines for i in range(max(0, len(log) - len(lines) - 20), len(log)))


def test_logs_shows_the_end_of_each_roles_log(demo):
    r = demo.cli("logs", str(demo.spec))
    assert r.returncode == 1, r.stdout + r.stderr  # (not applied: nothing installed, nothing to show)
    assert f"note: deployment {demo.name!r} is not deployed" in r.stderr, r.stderr
    assert f"decode: no log lines (pdctl-{demo.name}-decode.service is not installed here)" in r.stderr, r.stderr
    assert r.stdout == ""
    demo.apply()
    r = demo.cli("logs", str(demo.spec), "decode", "-n", "5")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 5 and _the_end_of(r.stdout.splitlines(), _output_log(demo, "decode")), r.stdout
    r = demo.cli("logs", str(demo.spec), "--lines", "3")
    assert r.returncode == 0, r.stderr
    by_role: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        role, _, text = line.partition(" | ")
        by_role.setdefault(role.rstrip(), []).append(text)
    assert list(by_role) == ["prefill", "decode", "router"], r.stdout  # (the deployment's order)
    assert len(by_role["prefill"]) == len(by_role["decode"]) == len(by_role["router"]) == 3, by_role
    assert _the_end_of(by_role["prefill"], _output_log(demo, "prefill"))
    assert _the_end_of(by_role["decode"], _output_log(demo, "decode"))


def test_a_role_the_deployment_lacks_is_a_usage_error_naming_its_roles(demo):
    r = demo.cli("logs", str(demo.spec), "decoder")
    assert r.returncode == 64, r.stderr
    assert "'decoder': deployment" in r.stderr and "its roles are prefill, decode, router" in r.stderr, r.stderr


def test_follow_prints_new_lines_and_ends_when_the_deployment_is_taken_down(demo):
    demo.apply()
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "logs", str(demo.spec), "decode", "-n", "1", "--follow"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = p.stdout.readline()
        assert first.rstrip("\n") in _output_log(demo, "decode"), first
        r = demo.cli("chat", str(demo.spec), "hello", "--timeout", "60", timeout=120)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 10 * FOLLOW_POLL_S + 10
        seen = []
        while time.monotonic() < deadline:  # (the decode server's access line of the chat the router passed on)
            seen.append(p.stdout.readline())
            if "POST /v1/chat/completions" in seen[-1]:
                break
        assert "POST /v1/chat/completions" in seen[-1], seen
        demo.down()
        out, err = p.communicate(timeout=30)  # (it ends on its own once the unit is gone)
        assert p.returncode == 0, err
        assert f"pdctl-{demo.name}-decode.service: not installed here (any more): nothing to follow" in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_follow_prints_each_line_once_however_alike(make_demo):
    # (it compared each read's last 500 lines with the previous one's: 5 more of an idle server's repeated health-check
    # lines read as nothing new; helper-111. The router's own health checks, which write other lines into the log,
    # are slowed down here, as the helper did)
    demo = make_demo(lambda d: d["router"].update(health_check_interval_s=300))
    demo.apply()
    log = demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-decode.service" / "output.log"
    same = "pdctl test: the same line again"
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "logs", str(demo.spec), "decode", "-n", "1", "-f"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline()
        seen = 0
        # (fewer than a read's 500 lines a second; after the second batch the last 500 lines are all the same one)
        for batch, total in ((300, 300), (300, 600), (5, 605)):
            with open(log, "a") as f:  # (appended, as the server's own writes are)
                f.write(f"{same}\n" * batch)
            while seen < total:  # (a line that never comes: pytest-timeout ends it)
                seen += p.stdout.readline().rstrip("\n") == same
        time.sleep(2 * FOLLOW_POLL_S)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        assert seen + out.count(same) == 605, (seen, out)  # (none twice either)
        assert "lines may be missing" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_follow_stopped_by_sigterm_says_it_changed_nothing(demo):
    demo.apply()
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
    p = subprocess.Popen([sys.executable, "-m", "pdctl", "logs", str(demo.spec), "-f"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline()  # (following)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 143, err
        assert err.strip().splitlines()[-1] == "terminated (SIGTERM); interrupted: logs only reads, it changes nothing", err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
