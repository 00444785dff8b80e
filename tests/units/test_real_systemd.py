"""Through a real systemd (the harness's private user manager): values reach the process unchanged,
secrets arrive through the 0600 EnvironmentFile, and foreign units are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdctl.units import ForeignUnit, ServiceSpec, SystemdManager, TargetSpec, UnitSet

pytestmark = pytest.mark.systemd

DUMP = (
    "import json,os,sys\n"
    "tmp=sys.argv[1]+'.tmp'\n"
    "json.dump({'argv':sys.argv[2:],'env':os.environ.get('PDCTL_PROP'),'secret':os.environ.get('PROP_TOKEN')},"
    "open(tmp,'w'))\n"
    "os.replace(tmp,sys.argv[1])"
)

# Everything a Python str can carry to a process: no NUL, no lone surrogates.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
NASTY = ['a b', '"', "'", "$HOME", "${X}", "$$", "%n", "%%", "%", "\\", "\\n", "\n", "\t", "\r", ";", "\\;",
         "-", "", " lead", "trail ", "@x", "\x1b[0m", "é€𝄞", "a\\\nb", "'$x'\"\\`"]


def _service(tmp: Path, name: str, args: list[str], env_value: str, secret: str) -> ServiceSpec:
    return ServiceSpec(
        name=name, description="pdctl property probe", deployment="prop", role="probe",
        argv=(sys.executable, "-c", DUMP, str(tmp / "out.json"), *args),
        env={"PDCTL_PROP": env_value}, secrets={"PROP_TOKEN": secret},
        secrets_file=str(tmp / "secrets" / "probe.env"), restart_sec=1, timeout_start_s=30,
    )


def _roundtrip(m: SystemdManager, tmp: Path, args: list[str], env_value: str, secret: str) -> dict:
    out = tmp / "out.json"
    out.unlink(missing_ok=True)
    svc = _service(tmp, "pdctl-prop-probe.service", args, env_value, secret)
    m.install(UnitSet(target=TargetSpec(name="pdctl-prop.target", description="p", deployment="prop",
                                        wants=(svc.name,)), services=(svc,)))
    m.start(svc.name)
    deadline = time.monotonic() + 20
    while not out.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"probe wrote nothing; status {m.status(svc.name)}")
        time.sleep(0.02)
    got = json.loads(out.read_text())
    m.stop(svc.name)  # the next example's start must not find it still exiting
    return got


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(TEXT | st.sampled_from(NASTY), max_size=5), env_value=TEXT | st.sampled_from(NASTY),
       secret=TEXT | st.sampled_from(NASTY))
@example(args=NASTY, env_value="".join(NASTY), secret="".join(NASTY))
def test_spec_strings_reach_the_process_unchanged_through_systemd(clean_user_systemd, tmp_path, args,
                                                                   env_value, secret):
    m = clean_user_systemd.manager()
    got = _roundtrip(m, tmp_path, args, env_value, secret)
    assert got == {"argv": args, "env": env_value, "secret": secret}


def test_secrets_file_is_0600_and_the_unit_never_holds_the_secret(clean_user_systemd, tmp_path):
    m = clean_user_systemd.manager()
    got = _roundtrip(m, tmp_path, ["x"], "plain", "s3cr3t-value")
    assert got["secret"] == "s3cr3t-value"
    assert stat.S_IMODE((tmp_path / "secrets" / "probe.env").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700  # (created so; it was 0755)
    unit = (clean_user_systemd.unit_dir / "pdctl-prop-probe.service").read_text()
    assert "s3cr3t-value" not in unit and f"EnvironmentFile={tmp_path}/secrets/probe.env" in unit


def test_a_secrets_file_the_new_unit_no_longer_names_is_removed(clean_user_systemd, tmp_path):
    # [secrets] removed from the spec: the new unit had no EnvironmentFile=, so neither this install nor a later
    # remove (down) deleted the old file, and the values stayed on disk
    m = clean_user_systemd.manager()
    svc = _service(tmp_path, "pdctl-prop-probe.service", [], "", "s3cr3t-gone")
    target = TargetSpec(name="pdctl-prop.target", description="p", deployment="prop", wants=(svc.name,))
    m.install(UnitSet(target=target, services=(svc,)))
    env_file = tmp_path / "secrets" / "probe.env"
    assert "s3cr3t-gone" in env_file.read_text()
    plain = dataclasses.replace(svc, secrets={}, secrets_file=None)
    assert svc.name in m.install(UnitSet(target=target, services=(plain,)))
    assert not env_file.exists() and "EnvironmentFile=" not in m.installed_text(svc.name)
    m.remove([svc.name, target.name])


def test_a_unit_another_deployment_installed_is_neither_overwritten_nor_removed(clean_user_systemd, tmp_path):
    m = clean_user_systemd.manager()
    svc = _service(tmp_path, "pdctl-prop-probe.service", [], "", "s")
    target = TargetSpec(name="pdctl-prop.target", description="p", deployment="prop", wants=(svc.name,))
    m.install(UnitSet(target=target, services=(svc,)))
    before = m.installed_text(svc.name)
    assert m.installed_deployment(svc.name) == "prop" and m.installed_deployment("pdctl-none.service") is None
    other = dataclasses.replace(svc, deployment="prop-x", argv=(sys.executable, "-c", "pass"))
    other_target = TargetSpec(name="pdctl-prop-x.target", description="p", deployment="prop-x", wants=(svc.name,))
    with pytest.raises(ForeignUnit, match="belongs to pdctl deployment 'prop', not 'prop-x'"):
        m.install(UnitSet(target=other_target, services=(other,)))
    with pytest.raises(ForeignUnit, match="belongs to pdctl deployment 'prop', not 'prop-x'"):
        m.remove([svc.name], deployment="prop-x")
    assert m.installed_text(svc.name) == before
    m.remove([svc.name, target.name], deployment="prop")
    assert m.installed_text(svc.name) is None


def test_a_foreign_unit_loaded_from_elsewhere_is_refused_and_nothing_changes(clean_user_systemd, tmp_path):
    sd = clean_user_systemd
    other = sd.runtime_dir / "systemd" / "user"  # a lower-priority user unit path the manager reads
    other.mkdir(parents=True, exist_ok=True)
    foreign = other / "pdctl-prop-probe.service"
    foreign.write_text("[Service]\nExecStart=/bin/sleep 1\n")
    try:
        sd.systemctl("daemon-reload")
        m = sd.manager()
        svc = _service(tmp_path, "pdctl-prop-probe.service", [], "", "")
        units = UnitSet(target=TargetSpec(name="pdctl-prop.target", description="p", deployment="prop",
                                          wants=(svc.name,)), services=(svc,))
        before = sorted(p.name for p in sd.unit_dir.iterdir())
        with pytest.raises(ForeignUnit, match="already loaded from"):
            m.install(units)
        assert sorted(p.name for p in sd.unit_dir.iterdir()) == before
        assert not (tmp_path / "secrets").exists()
        assert foreign.read_text() == "[Service]\nExecStart=/bin/sleep 1\n"
    finally:
        foreign.unlink()
        sd.systemctl("daemon-reload")


def _start_until_failed(m: SystemdManager, svc: ServiceSpec) -> None:
    m.install(UnitSet(target=TargetSpec(name="pdctl-lim.target", description="l", deployment="lim",
                                        wants=(svc.name,)), services=(svc,)))
    m.start(svc.name)
    deadline = time.monotonic() + 30
    while m.status(svc.name).state != "failed":
        assert time.monotonic() < deadline, m.status(svc.name)
        time.sleep(0.1)


def test_a_failing_service_stops_at_the_start_limit(clean_user_systemd, tmp_path):
    m = clean_user_systemd.manager()
    svc = ServiceSpec(name="pdctl-lim-crash.service", description="crashes", deployment="lim", role="crash",
                      argv=("/bin/sh", "-c", "exit 3"), restart_sec=0.2, start_limit_burst=3,
                      start_limit_interval_s=60, timeout_start_s=10)
    _start_until_failed(m, svc)
    # three starts (burst 3); systemd counts the third, refused, restart too
    assert m.status(svc.name).restarts == 3
    time.sleep(1.0)  # five restart delays: it stays down
    assert (m.status(svc.name).state, m.status(svc.name).restarts) == ("failed", 3)
    assert m.status(svc.name).sub_state == "start-limit-hit"  # systemd's Result: why, as the process backend says


def test_status_without_a_reachable_manager_is_an_error_not_inactive(clean_user_systemd, tmp_path):
    # (XDG_RUNTIME_DIR unset, as after sudo -i: `systemctl --user show` printed nothing, read as "inactive", and the
    # deployment's own servers became "another process on its port")
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.units import SystemdManager
    from pdctl.units.errors import ManagerUnavailable

    (tmp_path / "xdg").mkdir(mode=0o700)
    lost = SystemdManager(LocalHost(), scope="user", unit_dir=str(clean_user_systemd.unit_dir),
                          env={**clean_user_systemd.env, "XDG_RUNTIME_DIR": str(tmp_path / "xdg")})
    with pytest.raises(ManagerUnavailable, match="no systemd user manager answers"):
        lost.status("pdctl-any-prefill.service")
    assert clean_user_systemd.manager().status("pdctl-any-prefill.service").state == "inactive"  # reachable: unknown


def test_a_refused_command_line_is_not_restarted(clean_user_systemd, tmp_path):
    """RestartPreventExitStatus=2 (argparse's exit code for a refused command line): one start, failed, no restart; the
    process supervisor does the same (test_supervisor)."""
    m = clean_user_systemd.manager()
    svc = ServiceSpec(name="pdctl-lim-usage.service", description="bad flag", deployment="lim", role="usage",
                      argv=("/bin/sh", "-c", "exit 2"), restart_sec=0.2, restart_prevent_exit_status=(2,),
                      start_limit_burst=3, start_limit_interval_s=60, timeout_start_s=10)
    _start_until_failed(m, svc)
    time.sleep(1.0)  # five restart delays: none happens
    assert (m.status(svc.name).state, m.status(svc.name).restarts) == ("failed", 0)


def test_install_enables_the_target_and_remove_disables_it(clean_user_systemd, tmp_path):
    """The target's WantedBy= (default.target here, multi-user.target in system scope) only brings the deployment back
    at boot once enabled; a target installed but not enabled is a pending change; remove leaves no dangling link."""
    sd = clean_user_systemd
    m = sd.manager()
    svc = ServiceSpec(name="pdctl-boot-role.service", description="sleeps", deployment="boot", role="role",
                      argv=("/bin/sleep", "300"), timeout_start_s=10)
    units = UnitSet(target=TargetSpec(name="pdctl-boot.target", description="b", deployment="boot",
                                      wants=(svc.name,)), services=(svc,))
    assert "pdctl-boot.target" in m.install(units)
    assert sd.systemctl("is-enabled", "pdctl-boot.target").stdout.strip() == "enabled"
    assert m.pending_changes(units) == [] and m.install(units) == []
    sd.systemctl("disable", "pdctl-boot.target")  # as a pdctl that did not enable it left it
    assert m.pending_changes(units) == ["pdctl-boot.target"]
    assert m.install(units) == ["pdctl-boot.target"]
    assert sd.systemctl("is-enabled", "pdctl-boot.target").stdout.strip() == "enabled"
    m.remove(list(units.names))
    assert not os.path.lexists(sd.unit_dir / "default.target.wants" / "pdctl-boot.target")


def test_a_unit_that_logs_to_a_file_is_followed_by_offset(clean_user_systemd, tmp_path):
    """StandardOutput=append: (what pdctl writes for a service with a log_path): follow_logs reads the file by offset,
    every line once however alike, across a restart of the unit; emptied by logrotate's copytruncate, it reads the
    file again from its start and says lines may be missing."""
    m = clean_user_systemd.manager()
    log = tmp_path / "logs" / "pdctl-flog-role.service.log"
    svc = ServiceSpec(name="pdctl-flog-role.service", description="logs to a file", deployment="flog", role="role",
                      argv=("/bin/sh", "-c", "echo started $$; exec sleep 300"), log_path=str(log), timeout_start_s=10)
    m.install(UnitSet(target=TargetSpec(name="pdctl-flog.target", description="f", deployment="flog",
                                        wants=(svc.name,)), services=(svc,)))
    assert m.follow_logs(svc.name, None, lines=500) == ([], 0, False)  # (not written yet)

    def until_started(mark: object) -> tuple[list[str], object]:
        deadline = time.monotonic() + 20
        seen: list[str] = []
        while not any(line.startswith("started ") for line in seen):
            assert time.monotonic() < deadline, seen
            got, mark, missed = m.follow_logs(svc.name, mark, lines=500)
            assert not missed
            seen += got
            time.sleep(0.05)
        return seen, mark

    m.start(svc.name, wait=True)
    first, mark = until_started(0)
    assert first == [f"started {m.main_pid(svc.name)}"]
    health = 'INFO:     127.0.0.1:48978 - "GET /health HTTP/1.1" 200 OK'
    with open(log, "a") as f:  # (appended, as the server's own writes are)
        f.write(f"{health}\n" * 600)
    got, mark, missed = m.follow_logs(svc.name, mark, lines=500)
    assert (got, missed) == ([health] * 500, True)  # (more than a read holds: the newest, and said)
    with open(log, "a") as f:
        f.write(f"{health}\n" * 5)
    got, mark, missed = m.follow_logs(svc.name, mark, lines=500)
    assert (got, missed) == ([health] * 5, False)
    m.restart(svc.name, wait=True)
    again, mark = until_started(mark)
    assert again == [f"started {m.main_pid(svc.name)}"] and again != first  # (the new process's line, once)
    log.write_bytes(b"")  # (copytruncate: copied elsewhere, then emptied)
    with open(log, "a") as f:
        f.write("after the rotation\n")
    got, mark, missed = m.follow_logs(svc.name, mark, lines=500)
    assert (got, missed) == (["after the rotation"], True)
    assert m.follow_logs(svc.name, mark, lines=500) == ([], mark, False)
