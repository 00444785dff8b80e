"""Day-2 operations (issue 40) against the demo under a real systemd user manager with a real journald
(tests/harness/systemd.py, ``journald=True``): ``logs`` (journald's lines, ``-f`` by cursor across a restart, ending
on ``down``), ``apply --restart``, ``status --watch``, progress while a role loads and ``support-bundle``.

One test, one deployment: pytest-xdist (``--dist worksteal``) would hand separate tests of a module-scoped deployment
to separate workers, each applying it again. Every wait is bounded by a deadline; nothing sleeps to decide an
outcome."""

from __future__ import annotations

import json
import os
import pty
import queue
import select
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from harness.systemd import user_systemd_session
from pdctl.statemachine.journal import Journal
from pdctl.units._manager import clean_log_lines

from .conftest import Demo

pytestmark = [pytest.mark.systemd, pytest.mark.smg, pytest.mark.slow]

PREFILL_LOAD_S = 6
"""The prefill stand-in's load time: past the CLI's progress interval (``Timeouts.progress``, 5 s), so that
``apply --json`` says it loading once."""


def _journal(sd, unit: str) -> list[str]:  # noqa: ANN001
    """Every line of *unit* in the manager's journal, read here with journalctl itself (colour codes out, as pdctl
    shows them)."""
    text = sd.journalctl("--user-unit", unit, "-o", "cat", "--no-pager").stdout
    return clean_log_lines(text, text.count("\n") + 1)


def _main_pid(sd, unit: str) -> int:  # noqa: ANN001
    return int(sd.systemctl("show", unit, "-p", "MainPID", "--value").stdout.strip())


def _the_end_of(lines: list[str], log: list[str]) -> bool:
    """Whether *lines* are the end of *log* as it stood a moment before it was read here (a server may write on
    meanwhile)."""
    n = len(lines)
    return bool(lines) and any(log[i:i + n] == lines for i in range(max(0, len(log) - n - 40), len(log)))


def _members(path: Path) -> dict[str, bytes]:
    """Every member of a support bundle, name (under its one top folder) → bytes."""
    with tarfile.open(path, "r:gz") as tar:
        return {i.name.split("/", 1)[1]: tar.extractfile(i).read() for i in tar.getmembers() if i.isfile()}


class _Lines:
    """The stdout lines of a running process, read by a thread, waited for with deadlines."""

    def __init__(self, stream) -> None:  # noqa: ANN001
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:  # noqa: ANN001
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, done, timeout: float) -> bool:  # noqa: ANN001
        """Read until ``done(self.seen)`` holds (True), the stream ends or *timeout* seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while not done(self.seen):
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                return done(self.seen)
            self.seen.append(line)
        return True

    def drain(self, timeout: float) -> None:
        """Read to the stream's end (the process exited), at most *timeout* seconds."""
        self.until(lambda _: False, timeout)
        self._t.join(timeout=1)


def _watch_redraws(demo: Demo, interval: float, redraws: int, timeout: float) -> tuple[int, str]:
    """``pdctl status SPEC --watch --interval I`` on a terminal (a pty: rich's Live draws only there): read until
    *redraws* frames came, then SIGINT; ``(exit status, what it drew)``."""
    main_fd, tty = pty.openpty()
    env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state), "TERM": "xterm", "COLUMNS": "160", "LINES": "60"}
    argv = [sys.executable, "-m", "pdctl", "status", str(demo.spec), "--watch", "--interval", str(interval)]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=tty, stderr=tty, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (a background job's SIG_IGN)
    os.close(tty)
    out, footer = b"", f"every {interval:g} s; Ctrl-C ends".encode()
    try:
        deadline = time.monotonic() + timeout
        signalled = False
        while time.monotonic() < deadline:
            if not signalled and out.count(footer) >= redraws:
                p.send_signal(signal.SIGINT)
                signalled = True
            ready, _, _ = select.select([main_fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main_fd, 65536)
                except OSError:  # (EIO: the terminal's other end closed, every writer gone)
                    chunk = b""
                if not chunk and p.poll() is not None:
                    break
                out += chunk
            elif p.poll() is not None and signalled:
                break
        return p.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        os.close(main_fd)


def test_day_two_operations_under_systemd_and_journald(tmp_path, monkeypatch):
    session = user_systemd_session(tmp_path / "systemd", journald=True)
    sd = next(session)
    demo = follow = client = None
    secret, api_key = "hub-" + uuid.uuid4().hex, "sk-" + uuid.uuid4().hex
    try:
        for k in ("XDG_RUNTIME_DIR", "HOME", "PATH"):  # (systemctl --user and journalctl reach the harness's)
            monkeypatch.setenv(k, sd.env[k])
        (tmp_path / "demo").mkdir()

        def under_systemd(d: dict) -> None:
            d["service_manager"] = "systemd-user"
            d["secrets"] = {"MODEL_HUB_AUTH": secret}
            d["engine"]["env"]["OPENAI_API_KEY"] = api_key  # (a secret in an env table: the units move it to secrets)
            d["prefill"][0].update(expected_cold_start_s=60, env={"PDCTL_SIM_LOAD_SECONDS": str(PREFILL_LOAD_S)})
            # (the router's own health checks write other lines into decode's log between the test's alike ones,
            # which a follow comparing windows of lines could align by: slowed down, as tests/statemachine/test_logs.py
            # does)
            d["router"]["health_check_interval_s"] = 300

        demo = Demo(tmp_path / "demo", mutate=under_systemd)
        units = {r: f"pdctl-{demo.name}-{r}.service" for r in ("prefill", "decode", "router")}

        # -- apply --json: progress events while prefill loads, its last log line read from the journal --------------
        r = demo.cli("apply", str(demo.spec), "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        events = [json.loads(line) for line in r.stdout.splitlines()]
        loading = [e for e in events if e["kind"] == "progress" and e["data"]["role"] == "prefill"]
        assert loading, [(e["kind"], e.get("step")) for e in events]
        prefill_log = [line.strip() for line in _journal(sd, units["prefill"])]
        for e in loading:
            assert e["step"] == "prefill_up" and e["data"]["unit"] == units["prefill"], e
            assert 5 <= e["data"]["elapsed_s"] < PREFILL_LOAD_S + 30 and e["data"]["expected_cold_start_s"] == 60, e
            assert e["data"]["log_line"] and e["data"]["log_line"] in prefill_log, (e["data"]["log_line"], prefill_log)
        kinds = [(e["kind"], e.get("step")) for e in events]
        assert kinds.index(("step_started", "prefill_up")) < kinds.index(("progress", "prefill_up")) < kinds.index(
            ("step_verified", "prefill_up"))
        for unit in units.values():  # (journald's: no unit names a file for its output)
            assert "ActiveState=active" in sd.systemctl("show", unit, "-p", "ActiveState").stdout, unit
            assert "StandardOutput=" not in (sd.unit_dir / unit).read_text(), unit

        # -- logs -n N: the end of each unit's journal --------------------------------------------------------------
        r = demo.cli("logs", str(demo.spec), "decode", "-n", "5")
        assert r.returncode == 0, r.stderr
        got = r.stdout.splitlines()
        assert len(got) == 5 and _the_end_of(got, _journal(sd, units["decode"])), got
        r = demo.cli("logs", str(demo.spec), "-n", "3")
        assert r.returncode == 0, r.stderr
        by_role: dict[str, list[str]] = {}
        for line in r.stdout.splitlines():
            role, _, text = line.partition(" | ")
            by_role.setdefault(role.rstrip(), []).append(text)
        assert list(by_role) == ["prefill", "decode", "router"], r.stdout
        for role, shown in by_role.items():
            assert len(shown) == 3 and _the_end_of(shown, _journal(sd, units[role])), (role, shown)

        # -- logs -f: lines written after it began, each once, across a restart (apply --restart decode) ------------
        env = {**os.environ, "PDCTL_STATE_DIR": str(demo.state)}
        follow = subprocess.Popen([sys.executable, "-m", "pdctl", "logs", str(demo.spec), "decode", "-n", "1", "-f"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines = _Lines(follow.stdout)
        assert lines.until(lambda seen: len(seen) >= 1, 60), follow.stderr.read() if follow.poll() is not None else ""
        decode_url = f"http://127.0.0.1:{demo.ports['decode']}"

        client = httpx.Client(trust_env=False, timeout=10)  # (one connection, kept: one client port in every line)

        def mark(marker: str, times: int) -> None:
            """*times* requests to decode whose access lines its log writes alike (the marker in the request line)."""
            for _ in range(times):
                assert client.get(f"{decode_url}/health", params={"m": marker}).status_code == 200

        def count(marker: str) -> int:
            return sum(marker in line for line in lines.seen)

        # fewer than a read's 500 lines a second, each batch once the follow has shown the last: after the second
        # batch a read's last 500 lines are nearly all the same line, and the third is told apart only by the cursor
        before = f"pdctl-day2-before-{uuid.uuid4().hex}"
        for batch, total in ((300, 300), (300, 600), (5, 605)):
            mark(before, batch)
            assert lines.until(lambda _, total=total: count(before) >= total, 60), (total, count(before))
        alike = {line for line in lines.seen if before in line}
        assert len(alike) == 1, sorted(alike)[:5]
        # more lines since a cursor than a read takes: the newest of them, and said (the manager's own API, on the
        # same journal; the follow above prints them all, fewer than its 500)
        manager = sd.manager()
        _, cursor, _ = manager.follow_logs(units["decode"], None, lines=1)
        burst = f"pdctl-day2-burst-{uuid.uuid4().hex}"
        mark(burst, 5)
        deadline = time.monotonic() + 30
        while sum(burst in line for line in _journal(sd, units["decode"])) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        got, newest, missed = manager.follow_logs(units["decode"], cursor, lines=3)
        # (the router's health checks write lines too, at any moment: the 3 read are the journal's end as it was
        # when read, so a run of it at or after the burst's last line)
        journal = _journal(sd, units["decode"])
        last_burst = max(i for i, line in enumerate(journal) if burst in line)
        at = [i for i in range(len(journal) - 2) if journal[i:i + 3] == got]
        assert missed and len(got) == 3 and at and at[-1] + 2 >= last_burst, (got, journal[-6:])
        again, _, missed = manager.follow_logs(units["decode"], newest, lines=3)  # (only what came since: no burst)
        assert not missed and not any(burst in line for line in again), again
        assert lines.until(lambda _: count(burst) >= 5, 30), count(burst)

        pids = {r: _main_pid(sd, u) for r, u in units.items()}
        r = demo.cli("apply", str(demo.spec), "--restart", "decode")
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"restarting {units['decode']}" in r.stderr, r.stderr[-3000:]
        after_restart = {r: _main_pid(sd, u) for r, u in units.items()}
        assert after_restart["decode"] not in (0, pids["decode"]), (pids, after_restart)
        assert {r: after_restart[r] for r in ("prefill", "router")} == {r: pids[r] for r in ("prefill", "router")}
        audit = Journal(demo.state, demo.name).audit_records()
        last_plan = max(i for i, a in enumerate(audit) if a["event"] == "plan")
        assert audit[last_plan].get("restart") == ["decode"], audit[last_plan]
        assert {"apply-started", "apply-done"} <= {a["event"] for a in audit[last_plan:]}, audit[last_plan:]
        assert demo.status()["healthy"]

        after = f"pdctl-day2-after-{uuid.uuid4().hex}"
        client.close()  # (its connection was to the decode server stopped meanwhile)
        client = httpx.Client(trust_env=False, timeout=10)
        mark(after, 2)  # (written by the new decode process: the follow is past the restart)
        assert lines.until(lambda _: count(after) >= 2, 30), lines.seen[-20:]
        new_pid_lines = [json.loads(x)["MESSAGE"] for x in sd.journalctl(
            "--user-unit", units["decode"], "-o", "json", "--output-fields=MESSAGE", "--all",
            f"_PID={after_restart['decode']}").stdout.splitlines()]
        assert new_pid_lines and all(m in lines.seen for m in new_pid_lines[:5]), new_pid_lines[:5]  # (its start)

        # -- status --watch: redrawn in place until Ctrl-C (130) -----------------------------------------------------
        code, drawn = _watch_redraws(demo, interval=0.5, redraws=2, timeout=60)
        assert code == 130, drawn[-2000:]
        frames = drawn.split("\x1b[1A")  # (rich's Live goes back up over the last frame to draw the next in its place)
        assert len(frames) > 2 and drawn.count("every 0.5 s; Ctrl-C ends") >= 2, drawn[-2000:]
        last = frames[-1]
        assert f"deployment {demo.name} (pd): healthy" in last, last
        for role in units:  # (each row with the main PID systemd has for its unit)
            row = [role, "active", "pid", str(after_restart[role])]
            assert any(line.split()[:4] == row for line in last.splitlines()), last

        # -- support-bundle: unit files, journald's lines, no secret value -------------------------------------------
        out = tmp_path / "bundle.tar.gz"
        r = demo.cli("support-bundle", str(demo.spec), "-o", str(out), "-n", "20")
        assert r.returncode == 0, r.stderr
        m = _members(out)
        for name, data in m.items():
            assert secret.encode() not in data and api_key.encode() not in data, name
        installed = b"".join(p.read_bytes() for p in demo.state.rglob("*.env"))
        assert secret.encode() in installed and api_key.encode() in installed  # (what the bundle had to keep out)
        for role, unit in units.items():
            assert m[f"units/{unit}"] == (sd.unit_dir / unit).read_bytes(), role  # (no secret in a unit file)
            got = m[f"logs/{role}.log"].decode().splitlines()
            assert 0 < len(got) <= 20 and all(line in _journal(sd, unit) for line in got), (role, got)
        assert b"EnvironmentFile=" in m[f"units/{units['decode']}"]  # (it names the secrets file; its values stay out)
        target = f"pdctl-{demo.name}.target"
        assert m[f"units/{target}"] == (sd.unit_dir / target).read_bytes()
        status = json.loads(m["status.json"])
        assert status["healthy"] is True and status["deployment"] == demo.name, status.get("error")
        manifest = json.loads(m["MANIFEST.json"])
        assert [e["name"] for e in manifest["members"] if e["status"] == "error"] == [], manifest

        # -- down: the follow ends on its own, having printed every decode line once ---------------------------------
        r = demo.cli("down", str(demo.spec), "--yes")
        assert r.returncode == 0, r.stderr
        lines.drain(30)
        assert follow.wait(timeout=30) == 0
        err = follow.stderr.read()
        assert f"{units['decode']}: not installed here (any more): nothing to follow" in err, err
        assert "lines may be missing" not in err, err
        assert (count(before), count(burst), count(after)) == (605, 5, 2), (count(before), count(burst), count(after))
        journal = _journal(sd, units["decode"])  # (read after the follow ended: it may have gained lines since)
        n = len(lines.seen)
        assert any(journal[i:i + n] == lines.seen for i in range(len(journal) - n + 1)), (
            "the follow's lines are not one run of the journal's (a line twice, or one left out)")
        # the journal keeps what the removed units wrote: logs still reads it
        r = demo.cli("logs", str(demo.spec), "decode", "-n", "2")
        assert r.returncode == 0 and r.stdout.splitlines() == journal[-2:], r.stdout + r.stderr
    finally:
        if client is not None:
            client.close()
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait(10)
        if demo is not None:
            demo.down()
        session.close()
