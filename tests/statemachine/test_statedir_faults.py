"""A state directory that cannot be written (issue 39, item 5): every command fails within seconds naming the
directory and the fix, exit 5 (``ExitCode.STATE_DIR``), leaves no lock or temp file and the journal as it was; an
apply checks for room before it touches any host; one whose directory fills mid-way ends within seconds (it waited
614 s on a status its supervisor could not write) naming what it left running, which runs on.

Real conditions, no mocked writes: a small tmpfs in a private mount namespace (``unshare -m``), filled with ``dd`` or
remounted read-only, driven by ``_statedir_faults.py`` (root only, as the systemd harness is)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import skip_or_fail
from harness.deploy import Demo, process_gone
from pdctl.console.exit_codes import ExitCode
from pdctl.statemachine.errors import PdctlError, StateDirUnwritable
from pdctl.statemachine.journal import MIN_FREE_ENV, Journal, JournalState, min_free_bytes

DRIVER = Path(__file__).with_name("_statedir_faults.py")
BOUND_S = 10.0
"""Issue 39's acceptance: a full state directory ends the command within 10 s."""


def _needs_namespaces() -> None:
    if os.geteuid() != 0:
        skip_or_fail("needs root (unshare -m and mount -t tmpfs)")
    if shutil.which("unshare") is None:
        skip_or_fail("unshare not installed")


def _drive(args: dict, timeout: float = 400) -> dict:
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(DRIVER), json.dumps(args)],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fault", ["full", "ro"])
def test_an_unwritable_state_directory_fails_each_command_naming_it_and_leaves_nothing_behind(tmp_path, fault):
    _needs_namespaces()
    demo = Demo(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    spec = str(demo.spec)
    r = _drive({"mount": str(mnt), "size": "256k", "name": demo.name, "fault": fault, "mode": "before",
                # (0: the probe write, not the free-space minimum, finds the read-only file system)
                "env": {MIN_FREE_ENV: "0"} if fault == "ro" else {},
                "commands": [["apply", spec], ["down", spec, "--yes"], ["plan", spec, "-o", "{state}/plan.json"],
                             ["status", spec]]})
    state = str(mnt / "state")
    why = os.strerror(errno.ENOSPC if fault == "full" else errno.EROFS)
    apply, down, plan, status = r["commands"]
    for c in (apply, down):
        assert c["rc"] == ExitCode.STATE_DIR, c
        assert f"state directory {state} cannot be written" in c["stderr"] and why in c["stderr"], c["stderr"]
        assert "hint: " in c["stderr"] and ("free space" if fault == "full" else "read-only file system") in c["stderr"]
        assert "Traceback" not in c["stderr"]
        assert c["took_s"] < BOUND_S, c
    assert "nothing was changed" in apply["stderr"]
    # plan -o into the refused directory: the output path named (not the state directory: plan writes nothing there)
    assert plan["rc"] == ExitCode.ERROR and f"{state}/plan.json" in plan["stderr"] and why in plan["stderr"], plan
    assert "Traceback" not in status["stderr"] and status["took_s"] < BOUND_S  # (status only reads)
    # nothing left behind: no lock file, no temp file, no plan; the journal byte for byte as it was
    assert [f for f in r["files_after"] if f[0] != "fill"] == r["files_before"], r
    assert r["journal_after"] == r["journal_before"] is not None


def test_a_state_directory_that_fills_during_an_apply_ends_it_within_seconds_naming_what_runs(tmp_path):
    # (it hung 614 s with no word: the prefill's supervisor could not write "active", and the apply waited out its
    # start timeout for a server long ready)
    _needs_namespaces()
    # the stand-in loads for 3 s, so that the fill lands while the prefill loads: the supervisor's write of "active"
    # is the first one refused (any later write refused instead ends the apply the same way)
    demo = Demo(tmp_path, mutate=lambda d: d["engine"]["env"].update(PDCTL_SIM_LOAD_SECONDS="3"))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = _drive({"mount": str(mnt), "size": "4m", "name": demo.name, "spec": str(demo.spec), "fault": "full",
                    "mode": "during", "env": {MIN_FREE_ENV: "1"}})
    finally:
        _end_supervisors_of(mnt)
    state = str(mnt / "state")
    assert r["rc"] == ExitCode.STATE_DIR, r
    assert r["fault_to_exit_s"] is not None and r["fault_to_exit_s"] < BOUND_S, r
    err = r["stderr"]
    assert f"state directory {state} cannot be written" in err and os.strerror(errno.ENOSPC) in err, err
    assert "hint: free space on the file system holding" in err and "Traceback" not in err
    # what it left running is named with its PID, and runs on (its supervisor keeps it: no write stops it)
    assert "running now: prefill (" in err, err
    assert r["named_pids_alive"] and all(r["named_pids_alive"].values()), r
    assert r["events"][-1]["kind"] == "apply_failed" and r["events"][-1]["data"]["error_type"] == "StateDirUnwritable"
    # the supervisor's refused write was seen at once: the prefill's step failed on it, not on its start timeout
    assert r["events"][-1]["step"] == "prefill_up" and "prefill_up had failed: " in err, r["events"][-1]
    assert "unable to write its status file" in err, err
    # the journal as its last good write left it (readable, this deployment's, the target recorded); no lock held,
    # no temp file
    assert isinstance(r["journal"], dict) and r["journal"]["name"] == demo.name and r["journal"]["target"], r["journal"]
    assert r["lock"] == "" and r["temp_files"] == [], r
    assert r["down_rc"] == ExitCode.OK, r["down_stderr"]


def _end_supervisors_of(mnt: Path) -> None:
    # A failed test's last resort: the watchdogs this test's apply started (their command line names their folder
    # under *mnt*, which the ended namespace took with it) are sent SIGTERM, each by its PID
    pids = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                cmd = Path(f"/proc/{e}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pdctl.units.supervise" in cmd and any(str(mnt).encode() in a for a in cmd):
                pids.append(int(e))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_check_room_refuses_a_directory_with_less_than_the_minimum_and_creates_nothing(tmp_path, monkeypatch):
    j = Journal(tmp_path / "a" / "b", "x")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    monkeypatch.setenv(MIN_FREE_ENV, str(free / (1 << 20) * 4 + 1))
    with pytest.raises(StateDirUnwritable) as e:
        j.check_room()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path)  # (the folder that exists, above it)
    assert f"state directory {j.dir} cannot be written" in e.value.message and MIN_FREE_ENV in e.value.message
    assert list(tmp_path.iterdir()) == []  # nothing created, not even the probe
    monkeypatch.setenv(MIN_FREE_ENV, "0")
    j.check_room()
    assert list(tmp_path.iterdir()) == []


def test_the_minimum_free_space_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(MIN_FREE_ENV, raising=False)
    assert min_free_bytes() == 8 << 20
    monkeypatch.setenv(MIN_FREE_ENV, "0.5")
    assert min_free_bytes() == 1 << 19
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(MIN_FREE_ENV, bad)
        with pytest.raises(PdctlError, match=MIN_FREE_ENV):
            min_free_bytes()
