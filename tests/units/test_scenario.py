"""One scenario, both managers: install a PD deployment of stand-ins (pdctl.sim engines, the real
smg router), start its target, and check

* ordering — the router is started only after both servers are *ready* (its wrapper records both
  ``/health`` answers at the instant it starts; each must be 200, on every router start);
* restart on failure — ``kill -9`` the prefill's main PID; it comes back with a new PID, ready;
* stop — the target stops everything: every PID seen is gone, no process left;
* idempotence — installing the same units again changes nothing.

Under systemd it runs in the harness's private user manager; under the process supervisor the
start is issued by a short-lived child process that exits at once, so the roles must outlive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.systemd import pd_deployment, pid_alive
from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.launch import manager_for
from pdctl.units import ServiceManager


def _wait(pred, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def run_scenario(m: ServiceManager, pd, units, start) -> None:
    names = [s.name for s in units.services]
    prefill, decode, router = names
    target = units.target.name
    assert m.install(units) == [*names, target]
    assert m.install(units) == []  # idempotent

    start(target)
    m.wait_active(target, timeout=90)
    seen_pids = {n: m.main_pid(n) for n in names}
    assert all(seen_pids.values()), seen_pids

    # ordering: at the router's start both servers already answered 200
    probes = pd.probes()
    assert len(probes) == 1, probes
    assert set(probes[0]["health"].values()) == {200}, probes

    # restart on failure
    old = seen_pids[prefill]
    os.kill(old, signal.SIGKILL)
    _wait(lambda: (st := m.status(prefill)).is_active and st.main_pid not in (None, old), 60,
          "prefill to come back after kill -9")
    assert m.status(prefill).restarts >= 1
    m.wait_active(target, timeout=60)
    all_pids = {p for p in seen_pids.values()} | {m.main_pid(n) for n in names}
    # whenever the router (re)started, both servers were ready
    assert all(set(p["health"].values()) == {200} for p in pd.probes()), pd.probes()
    assert any(line for line in m.logs(prefill, lines=200)), "prefill wrote no log lines"

    # stop: nothing left running
    m.stop(target)
    for n in names:
        assert m.status(n).state == "inactive", m.status(n)
        assert m.main_pid(n) is None
    left = [p for p in all_pids if p and pid_alive(p)]
    assert left == [], f"still running after stop: {left}"


@pytest.mark.systemd
@pytest.mark.slow
def test_pd_scenario_under_real_systemd(clean_user_systemd, tmp_path):
    sd = clean_user_systemd
    pd = pd_deployment(tmp_path, "systemd-user", name="sdpd")
    units = pd.units(scope="user", state_dir=tmp_path / "state", log_dir=tmp_path / "logs")
    m = manager_for(pd.dep, LocalHost(), state_dir=tmp_path / "state", unit_dir=str(sd.unit_dir), env=sd.env)
    assert m.kind == "systemd"
    try:
        run_scenario(m, pd, units, start=lambda t: m.start(t))
    finally:
        sd.systemctl("stop", "--", *units.names, check=False, timeout=120)
    # systemd's own view: the cgroups are empty
    for s in units.services:
        out = sd.systemctl("show", "-p", "ControlGroup,MainPID", "--", s.name, check=False).stdout
        assert "MainPID=0" in out


START_IN_CHILD = """
import sys
from pdctl.statemachine.hosts import LocalHost
from pdctl.units import ProcessSupervisor
ProcessSupervisor(LocalHost(), state_dir=sys.argv[1]).start(sys.argv[2])
"""


@pytest.mark.slow
def test_pd_scenario_under_the_process_supervisor(tmp_path):
    pd = pd_deployment(tmp_path, "process", name="pspd")
    state = tmp_path / "state"
    m = manager_for(pd.dep, LocalHost(), state_dir=state)
    assert m.kind == "process"
    units = pd.units(scope="process", state_dir=state)

    def start_from_a_short_lived_process(target: str) -> None:
        child = subprocess.run([sys.executable, "-c", START_IN_CHILD, m.state_dir, target],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr

    try:
        run_scenario(m, pd, units, start=start_from_a_short_lived_process)
        watchdogs = [int(p.read_text()) for p in Path(m.state_dir).glob("services/*/watchdog.pid")]
        assert watchdogs == []
    finally:
        m.stop(units.target.name)
