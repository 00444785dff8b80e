"""The process supervisor's own promises: same limits as systemd, whole-group stop, no orphan,
clean environment, dependency and readiness semantics."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.deploy import stop_process
from harness.hosts import CountingHost
from harness.sim import free_port
from harness.systemd import pid_alive
from pdctl.statemachine.hosts import LocalHost
from pdctl.units import (
    ProcessSupervisor,
    ServiceFailed,
    ServiceSpec,
    TargetSpec,
    UnitSet,
    parse_env_file,
    render_env_file,
    unsupervised_reason,
)


def svc(name: str, argv: tuple[str, ...], **kw) -> ServiceSpec:
    base = dict(description=name, deployment="sv", role=name, restart_sec=0.2, timeout_start_s=20,
                timeout_stop_s=5)
    return ServiceSpec(name=f"pdctl-sv-{name}.service", argv=argv, **{**base, **kw})


def install(tmp_path: Path, *services: ServiceSpec) -> ProcessSupervisor:
    m = ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "state"), poll_s=0.05)
    m.install(UnitSet(target=TargetSpec(name="pdctl-sv.target", description="sv", deployment="sv",
                                        wants=tuple(s.name for s in services)), services=services))
    return m


@pytest.fixture
def cleanup():
    managers: list[ProcessSupervisor] = []
    yield managers.append
    for m in managers:
        m.stop("pdctl-sv.target")


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_crashing_role_stops_at_the_start_limit_like_systemd(tmp_path, cleanup):
    # a readiness URL nobody serves: without it the role would count as active the instant it
    # started (as a Type=exec unit without a gate does), and wait_active could return
    s = svc("crash", ("/bin/sh", "-c", "echo boom; exit 3"), start_limit_burst=3, start_limit_interval_s=60,
            readiness_url=f"http://127.0.0.1:{free_port()}/health", readiness_python=sys.executable)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    with pytest.raises(ServiceFailed) as err:
        m.wait_active(s.name, timeout=20)
    assert "boom" in "\n".join(err.value.log)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "failed" and x, what="failed")
    assert (st_.sub_state, st_.restarts) == ("start-limit-hit", 3)  # as systemd's NRestarts
    assert sum(line == "boom" for line in m.logs(s.name, lines=100)) == 3


def test_a_refused_command_line_is_not_restarted_like_systemds_restart_prevent_exit_status(tmp_path, cleanup):
    s = svc("usage", ("/bin/sh", "-c", "echo 'prog: error: argument --x: invalid int value' >&2; exit 2"),
            restart_prevent_exit_status=(2,), start_limit_burst=3, start_limit_interval_s=60,
            readiness_url=f"http://127.0.0.1:{free_port()}/health", readiness_python=sys.executable)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    with pytest.raises(ServiceFailed):
        m.wait_active(s.name, timeout=20)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "failed" and x, what="failed")
    assert (st_.sub_state, st_.restarts) == ("exit-code", 0)  # one start, as systemd with RestartPreventExitStatus=2
    assert m.logs(s.name, lines=100).count("prog: error: argument --x: invalid int value") == 1


def test_a_clean_exit_is_not_restarted(tmp_path, cleanup):
    s = svc("once", ("/bin/true",))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "inactive" and x.sub_state == "dead" and x,
                   what="inactive")
    assert st_.restarts == 0


def test_stop_kills_the_whole_group_and_orphans_that_left_it(tmp_path, cleanup):
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! > {pids}.a; setsid sleep 301 & echo $! > {pids}.b; echo up; wait"
    s = svc("tree", ("/bin/sh", "-c", script))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    a = int(wait_for(lambda: Path(f"{pids}.a").exists() and Path(f"{pids}.a").read_text().strip(), what="a"))
    b = int(wait_for(lambda: Path(f"{pids}.b").exists() and Path(f"{pids}.b").read_text().strip(), what="b"))
    main = m.main_pid(s.name)
    assert os.getpgid(a) == main and os.getpgid(b) != main  # b left the role's group
    m.stop(s.name)
    wait_for(lambda: not any(pid_alive(p) for p in (main, a, b)), 10, "group and orphan to die")
    assert m.status(s.name).state == "inactive"


def test_a_killed_watchdog_still_leaves_stop_able_to_end_the_role(tmp_path, cleanup):
    s = svc("orphaned", ("/bin/sleep", "300"))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    main = m.main_pid(s.name)
    wd = int((Path(m.state_dir) / "services" / s.name / "watchdog.pid").read_text())
    os.kill(wd, signal.SIGKILL)
    wait_for(lambda: not pid_alive(wd), what="watchdog to die")
    st_ = m.status(s.name)
    assert (st_.state, st_.sub_state, st_.supervised) == ("active", "unsupervised", False) and pid_alive(main)
    m.stop(s.name)
    wait_for(lambda: not pid_alive(main), 10, "role to die")


def _running_sleep(tmp_path: Path, cleanup, role: str, *, bare: bool = False,  # noqa: ANN001
                   ) -> tuple[ProcessSupervisor, ServiceSpec, Path, int]:
    """A role running ``sleep 300`` under its watchdog: its manager, spec, unit folder and main PID. *bare*: with an
    environment that reads empty, as smg's does once it has rewritten its title over it."""
    s = svc(role, ("/usr/bin/env", "-i", "/bin/sleep", "300") if bare else ("/bin/sleep", "300"))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    return m, s, Path(m.state_dir) / "services" / s.name, m.main_pid(s.name)


def test_a_state_directory_reached_through_a_link_is_the_same_one(tmp_path, cleanup):
    # (applied with --state-dir /var/lib/pdctl, a link to /data/pdctl, and looked at by the real path: the watchdog's
    # command line names the link, so status called every role UNSUPERVISED and apply restarted them all)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    m, s, _, main = _running_sleep(tmp_path / "link", cleanup, "linked")
    wd = int((tmp_path / "real" / "state" / "services" / s.name / "watchdog.pid").read_text())
    real = ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "real" / "state"), poll_s=0.05)
    st_ = real.status(s.name)
    assert (st_.state, st_.supervised, st_.main_pid) == ("active", True, main), st_
    assert real.running_elsewhere("sv") == []
    (tmp_path / "real" / "state" / "services" / s.name / "watchdog.pid").unlink()  # (found by its command line)
    assert real.status(s.name).supervised, real.status(s.name)
    other = ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "other" / "state"))
    assert [(u, e) for u, _, e in other.running_elsewhere("sv")] == [(s.name, wd)]
    real.stop(s.name)
    wait_for(lambda: not pid_alive(main) and not pid_alive(wd), 10, "role and watchdog to die")


@pytest.mark.parametrize("damaged", [("main.pid",), ("main.pid", "watchdog.pid"), ("status.json",),
                                     ("status.json", "main.pid", "watchdog.pid")])
def test_damaged_pid_files_neither_hide_the_running_role_nor_start_a_second_one(tmp_path, cleanup, damaged):
    # (a damaged main.pid: status showed no PID, its server "another process's"; down called it not running and left
    # it serving. A truncated status.json read as "inactive")
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "damaged")
    wd = int((folder / "watchdog.pid").read_text())
    for f in damaged:
        (folder / f).write_text("garbage\n" if f.endswith(".pid") else '{"state": "act')
    st_ = m.status(s.name)
    assert (st_.state, st_.main_pid, st_.supervised) == ("active", main, True), st_
    m.start(s.name)  # (its watchdog still runs: no second one)

    def watchdogs() -> list[int]:
        out = []
        for e in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{e}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pdctl.units.supervise" in cmd and str(folder).encode() in cmd:
                out.append(int(e))
        return out

    time.sleep(0.5)
    assert watchdogs() == [wd] and m.main_pid(s.name) == main
    m.stop(s.name)
    wait_for(lambda: not pid_alive(main) and not pid_alive(wd), 10, "role and watchdog to die")
    assert m.status(s.name).state == "inactive"


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), what=f"process {pid} to die")


@pytest.mark.parametrize("bare", [False, True], ids=["environment", "environment-unreadable"])
@pytest.mark.parametrize("lost", [("main.pid", "status.json"), ("main.pid", "main.start", "status.json"),
                                  ("status.json-deleted", "main.pid-deleted"),
                                  ("status.json-deleted", "main.pid-deleted", "main.start-deleted",
                                   "watchdog.pid-deleted")])
def test_a_role_whose_watchdog_and_files_are_all_gone_is_still_found_and_stopped(tmp_path, cleanup, lost, bare):
    # (watchdog killed, main.pid and status.json emptied: status called the server failed and its port another
    # process's, and down exited 0 leaving it serving; the router too, whose environment reads empty)
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "lost", bare=bare)
    if bare:
        assert Path(f"/proc/{main}/environ").read_bytes().strip(b"\0") == b""
    _kill(int((folder / "watchdog.pid").read_text()))
    for f in lost:
        if f.endswith("-deleted"):
            (folder / f.removesuffix("-deleted")).unlink()
        else:
            (folder / f).write_text("")
    st_ = m.status(s.name)
    assert (st_.state, st_.sub_state, st_.main_pid, st_.supervised) == ("active", "unsupervised", main, False), st_
    m.stop(s.name)
    wait_for(lambda: not pid_alive(main), 10, "role to die")
    assert m.status(s.name).state == "inactive"


@pytest.mark.parametrize("bare", [False, True], ids=["environment", "environment-unreadable"])
def test_a_role_whose_files_are_deleted_under_its_live_watchdog_is_found_and_stopped(tmp_path, cleanup, bare):
    # (every file but unit.json deleted while the watchdog ran: status read inactive with the server serving, and down
    # left both the watchdog and its role running)
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "deleted", bare=bare)
    wd = int((folder / "watchdog.pid").read_text())
    for f in ("status.json", "main.pid", "main.start", "watchdog.pid"):
        (folder / f).unlink()
    st_ = m.status(s.name)
    assert (st_.state, st_.main_pid, st_.supervised) == ("active", main, True), st_
    m.stop(s.name)
    wait_for(lambda: not pid_alive(main) and not pid_alive(wd), 10, "role and watchdog to die")
    assert m.status(s.name).state == "inactive"


def test_a_stopped_role_whose_status_file_is_deleted_reads_inactive_not_failed(tmp_path, cleanup):
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "gone")
    m.stop(s.name)
    (folder / "status.json").unlink()
    st_ = m.status(s.name)
    assert (st_.state, st_.sub_state, st_.main_pid) == ("inactive", "dead", None), st_


@pytest.mark.parametrize("watchdog", ["alive", "killed"])
@pytest.mark.parametrize("bare", [False, True], ids=["environment", "environment-unreadable"])
def test_a_role_whose_folder_is_removed_is_stopped_by_stop_orphans(tmp_path, cleanup, bare, watchdog):
    # (rm -rf of the unit's folder under a running role: nothing installed, so down stopped nothing and said nothing)
    import shutil

    m, s, folder, main = _running_sleep(tmp_path, cleanup, "orphan", bare=bare)
    wd = int((folder / "watchdog.pid").read_text())
    if watchdog == "killed":
        _kill(wd)
    other = install(tmp_path / "other", s)  # (another state directory's role of the same name: never touched)
    cleanup(other)
    other.start(s.name, wait=True, timeout=20)
    theirs = other.main_pid(s.name)
    shutil.rmtree(folder)
    assert m.status(s.name).sub_state == "not-found"
    stopped = m.stop_orphans(s.name, timeout=10)
    assert main in stopped and (watchdog == "killed" or wd in stopped) and theirs not in stopped, (stopped, main, wd)
    wait_for(lambda: not pid_alive(main) and not pid_alive(wd), 10, "role and watchdog to die")
    assert pid_alive(theirs) and other.status(s.name).state == "active"
    assert m.stop_orphans(s.name) == []


@pytest.mark.parametrize("watchdog", ["alive", "killed"])
def test_a_role_whose_folder_holds_only_its_unit_file_is_stopped_by_stop_orphans(tmp_path, cleanup, watchdog):
    # (every file but unit.json deleted, the logs too: nothing says a watchdog ran, so status reads inactive, and down
    # looked for nothing, leaving the role serving)
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "bare-folder")
    wd = int((folder / "watchdog.pid").read_text())
    if watchdog == "killed":
        _kill(wd)
    for f in folder.iterdir():
        if f.name != "unit.json":
            f.unlink()
    assert m.status(s.name).state == "inactive"
    stopped = m.stop_orphans(s.name, timeout=10)
    assert main in stopped and (watchdog == "killed" or wd in stopped), (stopped, main, wd)
    wait_for(lambda: not pid_alive(main) and not pid_alive(wd), 10, "role and watchdog to die")
    assert m.stop_orphans(s.name) == []


def test_stop_orphans_leaves_an_installed_unit_with_its_records_to_stop(tmp_path, cleanup):
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "kept")
    assert m.stop_orphans(s.name) == [] and pid_alive(main)
    m.stop(s.name)
    assert m.stop_orphans(s.name) == []


def test_another_state_directorys_role_of_the_same_name_is_never_taken_for_this_one(tmp_path, cleanup):
    s = svc("twin", ("/bin/sleep", "300"))
    mine, theirs = install(tmp_path / "a", s), install(tmp_path / "b", s)
    cleanup(mine)
    cleanup(theirs)
    mine.start(s.name, wait=True, timeout=20)
    theirs.start(s.name, wait=True, timeout=20)
    other = theirs.main_pid(s.name)
    folder = Path(mine.state_dir) / "services" / s.name
    main = mine.main_pid(s.name)
    _kill(int((folder / "watchdog.pid").read_text()))
    _kill(main)
    for f in ("main.pid", "main.start", "status.json"):
        (folder / f).write_text("")
    st_ = mine.status(s.name)
    assert st_.main_pid is None and st_.state == "failed", st_
    mine.stop(s.name)
    assert pid_alive(other) and theirs.status(s.name).state == "active"


def test_a_main_pid_naming_some_other_live_process_is_not_believed(tmp_path, cleanup):
    # (main.pid holding an unrelated PID: status said the deployment was applied another way, apply waited 225 s for
    # that process to let go of the port, down signalled it)
    import subprocess
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "wrongpid")
    decoy = subprocess.Popen(["/bin/sleep", "300"])
    try:
        (folder / "main.pid").write_text(f"{decoy.pid}\n")
        assert m.status(s.name).main_pid == main
        _kill(int((folder / "watchdog.pid").read_text()))
        st_ = m.status(s.name)
        assert (st_.state, st_.main_pid, st_.supervised) == ("active", main, False), st_
        m.stop(s.name)
        wait_for(lambda: not pid_alive(main), 10, "role to die")
        assert decoy.poll() is None  # never signalled
    finally:
        decoy.kill()
        decoy.wait(5)


def test_a_process_with_an_empty_environment_is_not_taken_for_the_role_once_main_start_is_gone(tmp_path, cleanup):
    # (any process-group leader whose environment read empty was believed: down "stopped" a sleep's group and left
    # the server serving)
    import subprocess
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "decoyed", bare=True)
    decoy = subprocess.Popen(["/usr/bin/env", "-i", "/bin/sleep", "300"], start_new_session=True, cwd=tmp_path)
    try:
        _kill(int((folder / "watchdog.pid").read_text()))
        (folder / "main.start").unlink()
        (folder / "main.pid").write_text(f"{decoy.pid}\n")
        st_ = m.status(s.name)
        assert (st_.state, st_.main_pid, st_.supervised) == ("active", main, False), st_
        m.stop(s.name)
        wait_for(lambda: not pid_alive(main), 10, "role to die")
        assert decoy.poll() is None  # never signalled
    finally:
        decoy.kill()
        decoy.wait(5)


def test_readiness_gate_timeout_is_a_failed_start(tmp_path, cleanup):
    port = free_port()  # nothing listens there
    s = svc("never", ("/bin/sleep", "300"), readiness_url=f"http://127.0.0.1:{port}/health",
            readiness_python=sys.executable, timeout_start_s=1, start_limit_burst=2)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "failed" and x, 20, "failed")
    assert st_.restarts == 2
    assert any("readiness gate timed out" in line for line in m.logs(s.name))


def test_active_only_after_the_readiness_url_answers(tmp_path, cleanup):
    port = free_port()
    # listens only after 1 s, like a server loading its model
    s = svc("slow", (sys.executable, "-c", f"import time,http.server as h; time.sleep(1); "
                     f"h.HTTPServer(('127.0.0.1',{port}),h.SimpleHTTPRequestHandler).serve_forever()"),
            readiness_url=f"http://127.0.0.1:{port}/", readiness_python=sys.executable)
    m = install(tmp_path, s)
    cleanup(m)
    t0 = time.monotonic()
    m.start(s.name)
    assert m.status(s.name).state == "activating"
    m.wait_active(s.name, timeout=20)
    assert time.monotonic() - t0 >= 1.0


def test_a_role_requiring_a_failed_one_fails_and_never_starts(tmp_path, cleanup):
    bad = svc("bad", ("/bin/sh", "-c", "exit 1"), start_limit_burst=1,  # never ready, then fails
              readiness_url=f"http://127.0.0.1:{free_port()}/health", readiness_python=sys.executable)
    marker = tmp_path / "router-started"
    dep = svc("dep", ("/bin/sh", "-c", f"touch {marker}; sleep 300"), requires=(bad.name,))
    m = install(tmp_path, bad, dep)
    cleanup(m)
    m.start(dep.name)  # starts what it requires first
    wait_for(lambda: m.status(dep.name).state == "failed", 20, "dependent to fail")
    assert m.status(dep.name).sub_state == "dependency" and not marker.exists()


def test_environment_is_clean_and_secrets_arrive_from_the_0600_file(tmp_path, cleanup, monkeypatch):
    monkeypatch.setenv("PDCTL_TEST_LEAK", "should-not-reach-the-role")
    out = tmp_path / "env.json"
    s = svc("env", (sys.executable, "-c", f"import json,os; json.dump(dict(os.environ), open({str(out)!r},'w'))"),
            env={"PLAIN": "a b $c 50%"}, secrets={"HF_TOKEN": "it's \"x\"\n$y"},
            secrets_file=str(tmp_path / "secrets" / "env.env"))
    (tmp_path / "secrets").mkdir(mode=0o755)  # as an older pdctl left it
    (tmp_path / "secrets").chmod(0o755)
    m = install(tmp_path, s)
    cleanup(m)
    assert "HF_TOKEN" not in (m.installed_text(s.name) or "") or "it's" not in m.installed_text(s.name)
    assert oct((tmp_path / "secrets" / "env.env").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "secrets").stat().st_mode & 0o777) == "0o700"  # (it was 0755: the names showed)
    m.start(s.name)
    env = json.loads(wait_for(lambda: out.exists() and out.read_text(), what="env dump"))
    assert env["PLAIN"] == "a b $c 50%" and env["HF_TOKEN"] == "it's \"x\"\n$y"
    assert "PDCTL_TEST_LEAK" not in env and "PATH" in env
    assert env["PDCTL_UNIT"] == s.name  # the tag a stop uses to recognise the role's processes
    assert env["PDCTL_UNIT_DIR"] == os.path.normpath(m._dir(s.name))  # and which state directory's role it is
    # nor the watchdog's own environment (pdctl's, holding the variables [secrets] read: they stayed readable in
    # its /proc/PID/environ for its whole life)
    watchdog = int((Path(m._dir(s.name)) / "watchdog.pid").read_text())
    kept = dict(x.split("=", 1) for x in Path(f"/proc/{watchdog}/environ").read_text().split("\0") if "=" in x)
    assert "PDCTL_TEST_LEAK" not in kept and kept.get("PATH") == os.environ["PATH"], sorted(kept)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or 0 not in os.sched_getaffinity(0), reason="no CPU 0")
def test_cpu_affinity_numa_binding_and_memlock_are_applied(tmp_path, cleanup):
    node0 = Path("/sys/devices/system/node/node0").exists()
    s = svc("pin", ("/bin/sleep", "300"), cpu_affinity="0", memlock_infinity=True,
            numa_node=0 if node0 else None)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    pid = m.main_pid(s.name)
    assert os.sched_getaffinity(pid) == {0}
    memlock = next(line.split()[3:5] for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                   if line.startswith("Max locked memory"))
    assert memlock[0] == memlock[1]  # soft raised to the hard limit (unlimited where permitted)
    if node0 and os.uname().machine in ("x86_64", "aarch64"):
        assert "bind:0" in Path(f"/proc/{pid}/numa_maps").read_text()


def _as_root() -> None:
    from harness import skip_or_fail

    if os.geteuid() != 0:
        skip_or_fail("starting a role as another account needs root (CI runs as root)")


def test_a_role_with_a_user_runs_as_that_account_with_its_groups_home_and_the_limits_set_before(tmp_path, cleanup):
    # (service_user: systemd's User=; the process supervisor switches the same way, after the CPU, NUMA and memlock
    # settings that need the manager's rights)
    import pwd

    _as_root()
    nobody = pwd.getpwnam("nobody")
    s = svc("as-nobody", ("/bin/sleep", "300"), user="nobody", memlock_infinity=True)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    pid = m.main_pid(s.name)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split() == [str(nobody.pw_uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(nobody.pw_gid)] * 4, status["Gid"]
    assert set(map(int, status["Groups"].split())) == set(os.getgrouplist("nobody", nobody.pw_gid)), status["Groups"]
    env = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in x)
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (nobody.pw_dir, "nobody", "nobody"), env
    memlock = next(line.split()[3:5] for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                   if line.startswith("Max locked memory"))
    # raised with root's rights before the switch (CAP_SYS_RESOURCE, which nobody lacks); where root has it not
    # either (a container's bounding set), the soft limit at the hard one, as systemd's LimitMEMLOCK= leaves it there
    import resource
    import subprocess

    raise_it = "import resource as r; r.setrlimit(r.RLIMIT_MEMLOCK, (r.RLIM_INFINITY, r.RLIM_INFINITY))"
    can_raise = subprocess.run([sys.executable, "-c", raise_it], capture_output=True).returncode == 0
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    expected = "unlimited" if can_raise or hard == resource.RLIM_INFINITY else str(hard)
    assert memlock == [expected, expected], (memlock, can_raise)
    m.stop(s.name)
    assert not pid_alive(pid)


def test_a_role_whose_user_does_not_exist_fails_with_systemds_exit_status_and_says_why(tmp_path, cleanup):
    _as_root()
    s = svc("no-account", ("/bin/sleep", "300"), user="pdctl-no-such-account", start_limit_burst=1,
            start_limit_interval_s=60)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "failed" and x, what="failed")
    log = m.logs(s.name, lines=20)
    assert any("User=pdctl-no-such-account: no such account on this host" in line for line in log), log
    assert any("exited, code=217" in line for line in log), log  # systemd's EXIT_USER
    assert st_.main_pid is None


_NO_SET_MEMPOLICY = (os.uname().machine not in ("x86_64", "aarch64")  # (syscall numbers known for these only)
                     or not Path("/sys/devices/system/node").exists())  # (a kernel without NUMA)


@pytest.mark.parametrize(("binding", "said", "code"), [
    # (the syscall's failure was ignored: the role ran unbound and apply called it proven, while systemd failed it)
    pytest.param({"numa_node": 63}, "set_mempolicy(MPOL_BIND, NUMA node 63) failed: Invalid argument", 242,
                 marks=pytest.mark.skipif(_NO_SET_MEMPOLICY, reason="set_mempolicy(2) not known or no NUMA")),
    # (the refused sched_setaffinity was ignored: the role ran on any CPU)
    ({"cpu_affinity": "8000-8001"}, "sched_setaffinity(CPUs 8000-8001) failed: Invalid argument", 214),
], ids=["numa-node", "cpus"])
def test_a_binding_the_host_lacks_fails_the_role_with_systemds_exit_status_and_says_why(tmp_path, cleanup, binding,
                                                                                        said, code):
    s = svc("bind", ("/bin/sleep", "300"), start_limit_burst=1, start_limit_interval_s=60, **binding)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    st_ = wait_for(lambda: (x := m.status(s.name)).state == "failed" and x, what="failed")
    assert st_.main_pid is None
    log = m.logs(s.name, lines=20)
    assert any(said in line for line in log), log
    assert any(f"exited, code={code}" in line for line in log), log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to narrow")
def test_a_role_does_not_inherit_the_cpu_affinity_of_whoever_ran_pdctl(tmp_path, cleanup):
    # (`taskset -c 0 pdctl apply` pinned every role to CPU 0: the watchdog passed its own affinity on, which systemd
    # does not; a role with CPUs of its own got their intersection with it)
    everyone = os.sched_getaffinity(0)
    first = min(everyone)
    pinned = svc("pinned", ("/bin/sleep", "300"), cpu_affinity=",".join(map(str, sorted(everyone))))
    free = svc("free", ("/bin/sleep", "300"))
    m = install(tmp_path, pinned, free)
    cleanup(m)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {first})  # the watchdogs it starts inherit this, as from `taskset -c N pdctl apply`
    try:
        for s in (pinned, free):
            m.start(s.name, wait=True, timeout=20)
    finally:
        os.sched_setaffinity(0, before)
    assert os.sched_getaffinity(m.main_pid(pinned.name)) == everyone
    assert os.sched_getaffinity(m.main_pid(free.name)) == everyone


def test_a_secret_cannot_take_the_marks_status_and_down_find_a_role_by(tmp_path, cleanup):
    s = svc("marks", ("/bin/sleep", "300"), secrets=(("PDCTL_UNIT", "pdctl-other.service"),),
            secrets_file=str(tmp_path / "marks.env"))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    env = dict(x.split("=", 1) for x in Path(f"/proc/{m.main_pid(s.name)}/environ").read_text().split("\0") if "=" in x)
    assert env["PDCTL_UNIT"] == s.name


def test_restart_gives_a_new_main_pid_and_unknown_units_are_inactive(tmp_path, cleanup):
    s = svc("rs", ("/bin/sleep", "300"))
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    first = m.main_pid(s.name)
    m.restart(s.name, wait=True, timeout=20)
    assert m.main_pid(s.name) not in (None, first) and not pid_alive(first)
    assert m.status("pdctl-nope.service").state == "inactive"
    m.remove([s.name, "pdctl-sv.target"])
    assert m.installed_text(s.name) is None


@given(st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
                       st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))))
def test_env_file_round_trips(secrets):
    assert parse_env_file(render_env_file(list(secrets.items()))) == secrets


def test_log_lines_lose_terminal_colours():
    from pdctl.units._manager import clean_log_lines

    text = "a\n\x1b[2m2026-11-29\x1b[0m \x1b[32m INFO\x1b[0m ready\nlast"
    assert clean_log_lines(text, 2) == ["2026-11-29  INFO ready", "last"]
    assert clean_log_lines(text, 0) == []


def test_a_long_log_is_read_from_its_end_only(tmp_path):
    # (the whole output.log was read and split for the last 50 lines: a busy server's log of weeks is gigabytes, and
    # the console's log panel asks for its end every second)
    host = CountingHost()
    m = ProcessSupervisor(host, state_dir=str(tmp_path / "state"))
    s = svc("chatty", ("/bin/true",))
    m.install(UnitSet(target=TargetSpec(name="pdctl-sv.target", description="sv", deployment="sv", wants=(s.name,)),
                      services=(s,)))
    log = tmp_path / "state" / "services" / s.name / "output.log"
    line = "[2026-12-04 10:00:00] Decode batch. #running-req: 64, #token: 91234, gen throughput (token/s): 3000.00\n"
    with open(log, "w") as f:
        for _ in range(200):  # 20 MB
            f.write(line * 1000)
        f.write("\x1b[32mlast\x1b[0m line, no newline")
    got = m.logs(s.name, lines=50)
    assert got == [line.rstrip("\n")] * 49 + ["last line, no newline"]
    assert m.logs(s.name, lines=3) == [line.rstrip("\n")] * 2 + ["last line, no newline"]
    assert host.read <= 2 * 65536, host.read  # (of 20 MB: 64 KiB for each call, lines of ~100 bytes)
    long_line = "server_args=ServerArgs(" + "x" * 3000 + ")"  # (SGLang's longest lines: a few KB)
    with open(log, "a") as f:
        f.write("\n" + "\n".join(f"{i} {long_line}" for i in range(60)) + "\n")
    assert m.logs(s.name, lines=50) == [f"{i} {long_line}" for i in range(10, 60)]
    log.write_text("short\nlog\n")  # (shorter than the bytes asked for: read whole, its first line kept)
    assert m.logs(s.name, lines=50) == ["short", "log"]


def test_following_a_log_reads_every_line_once_however_alike(tmp_path):
    # (follow compared the last 500 lines with the previous read's: a log of one repeated line, an idle server's
    # health checks, read unchanged, and the new lines were never printed; helper-111)
    m = ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "state"))
    s = svc("alike", ("/bin/true",))
    m.install(UnitSet(target=TargetSpec(name="pdctl-sv.target", description="sv", deployment="sv", wants=(s.name,)),
                      services=(s,)))
    folder = tmp_path / "state" / "services" / s.name
    log = folder / "output.log"
    health = 'INFO:     127.0.0.1:48978 - "GET /health HTTP/1.1" 200 OK'

    def write(text: str) -> None:
        with open(log, "a") as f:
            f.write(text)

    write(f"{health}\n" * 600)
    got, mark, missed = m.follow_logs(s.name, None, lines=500)
    assert (got, missed) == ([health] * 500, False)
    assert m.follow_logs(s.name, mark, lines=500) == ([], mark, False)
    write(f"{health}\n" * 5)
    got, mark, missed = m.follow_logs(s.name, mark, lines=500)
    assert (got, missed) == ([health] * 5, False)
    write("half a li")  # (a line still being written: shown once whole)
    assert m.follow_logs(s.name, mark, lines=500)[0] == []
    write("ne\n\x1b[32mgreen\x1b[0m\n")
    got, mark, missed = m.follow_logs(s.name, mark, lines=500)
    assert (got, missed) == (["half a line", "green"], False)
    write(f"{health}\n" * 700)  # (more than a read holds: said)
    got, mark, missed = m.follow_logs(s.name, mark, lines=500)
    assert (got, missed) == ([health] * 500, True)
    # emptied past its limit, as the watchdog does: the copy's rest, then the new file's start
    write("written before the copy\n")
    (folder / "output.log.1").write_bytes(log.read_bytes())
    log.write_bytes(b"")
    write("pdctl-supervise[1]: output.log passed 20000 bytes\nafter\n")
    got, mark, missed = m.follow_logs(s.name, mark, lines=500)
    assert (got, missed) == (["written before the copy", "pdctl-supervise[1]: output.log passed 20000 bytes", "after"],
                             False)
    write("next\n")
    got, mark, _ = m.follow_logs(s.name, mark, lines=500)
    assert got == ["next"]
    write("last words\n")
    m.remove([s.name])  # (taken down: its last lines from the log kept aside, then nothing more)
    got, mark, missed = m.follow_logs(s.name, mark, lines=500)
    assert (got, missed) == (["last words"], False)
    assert m.follow_logs(s.name, mark, lines=500)[:1] == ([],)
    assert not folder.exists() and m.logs(s.name, lines=2) == ["next", "last words"]  # (what pdctl logs shows)
    got, mark, _ = m.follow_logs(s.name, None, lines=2)  # (a follow begun after the removal: the same, then no more)
    assert got == ["next", "last words"] and m.follow_logs(s.name, mark, lines=2)[0] == []
    assert (tmp_path / "state" / "removed" / f"{s.name}.log.1").exists()


_WRITER = """
import os, sys, time
for i in range(3000):
    print(f"line {i}")
sys.stdout.flush()
kept = os.path.join(os.environ["PDCTL_UNIT_DIR"], "output.log.1")
deadline = time.monotonic() + 30
while not os.path.exists(kept) and time.monotonic() < deadline:
    time.sleep(0.05)
print("after the", "copy", flush=True)  # (the words apart: the watchdog's line quotes this command)
time.sleep(300)
"""


def test_a_log_past_its_limit_is_copied_aside_and_emptied_while_the_role_writes_on(tmp_path, cleanup):
    # (output.log grew for as long as the role ran: a busy server's request lines fill the disk in weeks)
    from pdctl.units.supervise import LOG_CHECK_S

    s = svc("writer", (sys.executable, "-c", _WRITER), log_max_bytes=20000)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    folder = Path(m.state_dir) / "services" / s.name
    wait_for(lambda: b"after the copy" in (folder / "output.log").read_bytes(), 2 * LOG_CHECK_S + 20, "the copy")
    kept = (folder / "output.log.1").read_text().splitlines()
    assert [x for x in kept if x.startswith("line ")] == [f"line {i}" for i in range(3000)]
    now = (folder / "output.log").read_bytes()
    assert b"\0" not in now and len(now) < 1000, now  # (written on at its start, not past a hole of 20 KB)
    assert b"output.log passed 20000 bytes" in now and b"its lines before this one are in output.log.1" in now, now
    got = m.logs(s.name, lines=len(now.splitlines()) + 2)  # (the end of the copy leads what the log holds now)
    assert got == ["line 2998", "line 2999", *now.decode().splitlines()], got


def test_a_stopped_role_gets_sigcont_after_sigterm_and_exits_on_its_own_like_under_systemd(tmp_path, cleanup):
    # A server under kill -STOP (a debugger, an operator) holds SIGTERM until continued: systemd sends SIGCONT after
    # SIGTERM; without it the role sat out its whole TimeoutStopSec and was SIGKILLed (132 s for a decode server)
    marker = tmp_path / "termed"
    script = f"trap 'echo termed > {marker}; exit 0' TERM; while :; do sleep 0.1; done"
    s = svc("stopped", ("/bin/sh", "-c", script), timeout_stop_s=5)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name)
    pid = wait_for(lambda: m.status(s.name).main_pid, what="main pid")
    wait_for(lambda: m.status(s.name).state == "active", what="active")
    os.kill(pid, signal.SIGSTOP)
    m.stop(s.name)
    assert marker.read_text().strip() == "termed"  # its TERM handler ran: not SIGKILLed after the timeout
    assert not pid_alive(pid)


def test_a_stopped_watchdog_is_continued_so_stop_does_not_wait_out_its_timeout(tmp_path, cleanup):
    # (a watchdog under kill -STOP held the TERM: down waited timeout_stop_s + 15 s, 135 s for a server, then SIGKILLed it
    # and left its role to the group stop)
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "frozen")
    wd = int((folder / "watchdog.pid").read_text())
    os.kill(wd, signal.SIGSTOP)
    began = time.monotonic()
    m.stop(s.name, timeout=60)
    assert time.monotonic() - began < 30 and not pid_alive(wd) and not pid_alive(main)


def test_a_stopped_watchdog_reads_unsupervised_until_it_is_continued(tmp_path, cleanup):
    # (under kill -STOP the watchdog restarts nothing; status read "active", supervised, as if a crash would be restarted)
    m, s, folder, main = _running_sleep(tmp_path, cleanup, "paused")
    wd = int((folder / "watchdog.pid").read_text())
    assert m.status(s.name).supervised
    stop_process(wd)
    try:
        st = m.status(s.name)
        assert (st.state, st.sub_state, st.supervised, st.main_pid) == ("active", "supervisor-stopped", False, main)
        assert "stopped" in unsupervised_reason(st.sub_state) and unsupervised_reason("unsupervised") == "gone"
    finally:
        os.kill(wd, signal.SIGCONT)
    st = wait_for(lambda: (x := m.status(s.name)).supervised and x, what="supervised again")
    assert (st.state, st.main_pid) == ("active", main)


def test_pending_changes_names_what_install_would_change_unit_or_secrets_and_writes_nothing(tmp_path, cleanup):
    s = svc("pc", ("/bin/sleep", "300"), secrets=(("HF_TOKEN", "hf_a"),), secrets_file=str(tmp_path / "pc.env"))
    m = install(tmp_path, s)
    cleanup(m)
    units = UnitSet(target=TargetSpec(name="pdctl-sv.target", description="sv", deployment="sv", wants=(s.name,)),
                    services=(s,))
    assert m.pending_changes(units) == []
    rotated = UnitSet(target=units.target, services=(dataclasses.replace(s, secrets=(("HF_TOKEN", "hf_b"),)),))
    edited = UnitSet(target=units.target, services=(dataclasses.replace(s, argv=("/bin/sleep", "301")),))
    before = m.installed_text(s.name)
    assert m.pending_changes(rotated) == [s.name] and m.pending_changes(edited) == [s.name]
    assert m.installed_text(s.name) == before  # nothing written
    assert m.install(edited) == [s.name] and m.pending_changes(edited) == []


def test_the_watchdog_cleans_its_environment_once_even_where_python_adds_to_it():
    # Under the C locale (an SSH session without LANG) Python sets LC_CTYPE itself at start (PEP 538): a re-exec
    # that compared the environment with what it keeps re-executed forever, and no role ever started over SSH
    import subprocess

    code = ("import os; from pdctl.units import supervise as s; print('start', flush=True); s._clean_environment(); "
            "print(sorted(os.environ), flush=True)")
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "SECRET_SOURCE": "zzsecret"}  # (no LANG, no LC_*)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines.count("start") == 2, (r.stdout[-500:], r.stderr[-500:])
    assert "SECRET_SOURCE" not in lines[-1] and "'PATH'" in lines[-1], lines[-1]


def test_a_secrets_file_the_new_definition_no_longer_names_is_removed(tmp_path):
    # [secrets] removed from the spec: the new unit.json named no secrets file, so neither this install nor a later
    # remove (down) deleted the old one, and the values stayed on disk
    s = svc("sec", ("/bin/sleep", "300"), secrets=(("HF_TOKEN", "hf_gone"),), secrets_file=str(tmp_path / "sec.env"))
    m = install(tmp_path, s)  # (installed only: nothing is started)
    assert "hf_gone" in (tmp_path / "sec.env").read_text()
    units = UnitSet(target=TargetSpec(name="pdctl-sv.target", description="sv", deployment="sv", wants=(s.name,)),
                    services=(dataclasses.replace(s, secrets=(), secrets_file=None),))
    assert m.install(units) == [s.name]
    assert not (tmp_path / "sec.env").exists()
    # moved (another state directory): the old file goes, the new one is written
    moved = dataclasses.replace(s, secrets_file=str(tmp_path / "moved.env"))
    m.install(UnitSet(target=units.target, services=(s,)))
    m.install(UnitSet(target=units.target, services=(moved,)))
    assert not (tmp_path / "sec.env").exists() and "hf_gone" in (tmp_path / "moved.env").read_text()
    m.remove([s.name, units.target.name])
    assert not (tmp_path / "moved.env").exists()


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="set_mempolicy(2) numbers known there only")
def test_a_numa_binding_refused_for_permission_runs_unbound_and_says_so(capfd):
    # Docker's and containerd's default seccomp profiles answer set_mempolicy with EPERM without CAP_SYS_NICE: that is
    # no missing node, and the role must not die with 242 (only EINVAL does)
    import ctypes
    import errno as errno_

    from pdctl.units.supervise import Watchdog

    class DeniedLibc:
        def syscall(self, *args):  # noqa: ANN002, ANN202
            ctypes.set_errno(errno_.EPERM)
            return -1

    fake = type("W", (), {"libc": DeniedLibc()})()
    Watchdog.bind_memory(fake, 0)  # returns: no os._exit
    err = capfd.readouterr().err
    assert "set_mempolicy(MPOL_BIND, NUMA node 0) failed: Operation not permitted; running without the memory binding" in err


def test_a_status_a_full_disk_refused_is_written_at_a_later_poll(tmp_path, monkeypatch):
    # The watchdog died of ENOSPC; then it lived but kept the unit "activating" for good once the write of "active"
    # failed (status is written only on changes), and an apply waited out role_start for a server long ready
    import errno

    from pdctl.units import supervise

    wd = supervise.Watchdog.__new__(supervise.Watchdog)
    wd.dir, wd.restarts, wd.proc, wd.unwritten = tmp_path, 0, None, None
    wd.log = open(tmp_path / "output.log", "ab", buffering=0)  # noqa: SIM115
    real = Path.write_text
    full = False

    def write_text(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if full and self.name.startswith(".status.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    read = lambda: json.loads((tmp_path / "status.json").read_text())["state"]  # noqa: E731
    wd.status("activating", "start")
    full = True
    wd.status("active", "running")
    wd.retry_status()
    assert read() == "activating" and wd.unwritten == ("active", "running")
    full = False
    wd.retry_status()
    assert read() == "active" and wd.unwritten is None
    assert (tmp_path / "output.log").read_text().count("cannot write status.json") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output.log", "status.json"]


def test_a_start_while_the_role_is_still_stopping_starts_it_once_the_stop_ends_like_systemd(tmp_path, cleanup):
    # (an apply right after an interrupted down started the router while its watchdog still waited for the old smg
    # to exit: start saw a live watchdog, did nothing, and router_exposed waited out its start timeout for a router
    # no one would start; systemd queues the start job behind the running stop job)
    script = "trap 'sleep 2; exit 0' TERM; while :; do sleep 0.1; done"  # (2 s to exit on SIGTERM)
    s = svc("slow", ("/bin/sh", "-c", script), timeout_stop_s=30)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    old = m.status(s.name).main_pid
    os.kill(m._watchdog_pid(s.name), signal.SIGTERM)  # a stop begun, as by a down interrupted once it sent it
    wait_for(lambda: m.status(s.name).state == "deactivating", what="deactivating")
    m.start(s.name, wait=True, timeout=20)
    st_ = m.status(s.name)
    assert st_.state == "active" and st_.main_pid not in (None, old) and not pid_alive(old), st_


def test_a_start_while_a_frozen_watchdog_is_stopping_its_role_finishes_that_stop_then_starts(tmp_path, cleanup):
    # (a down interrupted after it sent SIGTERM, the watchdog then kill -STOPped: start waited its whole stop timeout
    # for a watchdog that could not act, then failed; systemd's manager, which no kill -STOP reaches, would carry the
    # stop job on. start finishes it as stop() does: SIGCONT, and SIGKILL only after the stop timeout)
    script = "trap 'sleep 1; exit 0' TERM; while :; do sleep 0.1; done"
    s = svc("frozen", ("/bin/sh", "-c", script), timeout_stop_s=60)
    m = install(tmp_path, s)
    cleanup(m)
    m.start(s.name, wait=True, timeout=20)
    old, wd = m.status(s.name).main_pid, m._watchdog_pid(s.name)
    os.kill(wd, signal.SIGTERM)
    wait_for(lambda: m.status(s.name).state == "deactivating", what="deactivating")
    os.kill(wd, signal.SIGSTOP)
    t0 = time.monotonic()
    m.start(s.name, wait=True, timeout=20)
    took = time.monotonic() - t0
    st_ = m.status(s.name)
    assert st_.state == "active" and st_.main_pid not in (None, old), st_
    assert not pid_alive(wd) and not pid_alive(old), (wd, old)
    assert took < 40, took  # (the old wait alone was the stop timeout + 15 s, 75 s, and then no start)
