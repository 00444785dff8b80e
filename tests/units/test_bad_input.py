"""Bad input to the managers: each refusal is a clear error and changes nothing.

* the unit directory cannot be written;
* a unit of the same name exists and pdctl did not write it (never overwritten, never removed);
* ``systemctl`` is missing, or no manager answers it.

These need no running systemd: a stub ``systemctl`` that only answers ``show`` stands in for a
manager, and every check runs before ``systemctl`` would be asked to act.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.launch import unit_set_for
from pdctl.statemachine.spec import load_spec
from pdctl.units import (
    ForeignUnit,
    ManagerUnavailable,
    ProcessSupervisor,
    SystemdManager,
    UnitDirNotWritable,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def units():
    return unit_set_for(load_spec(EXAMPLES / "demo.toml"), scope="user")


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


needs_systemctl = pytest.mark.skipif(shutil.which("systemctl") is None, reason="systemctl not installed")

STUB_SYSTEMCTL = """#!/bin/sh
# answers what install asks before it writes; records every other call
for a in "$@"; do case "$a" in Version) echo Version=252; exit 0;; esac; done
echo "$@" >> "$0.calls"
"""


@pytest.fixture
def stub_systemctl(tmp_path_factory) -> tuple[str]:
    p = tmp_path_factory.mktemp("bin") / "systemctl"
    p.write_text(STUB_SYSTEMCTL)
    p.chmod(0o755)
    return (str(p),)


@needs_systemctl
def test_unit_dir_under_a_regular_file_is_not_writable(tmp_path, units, stub_systemctl):
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    m = SystemdManager(LocalHost(), scope="user", unit_dir=str(tmp_path / "file" / "units"), systemctl=stub_systemctl)
    with pytest.raises(UnitDirNotWritable, match="cannot write units to") as err:
        m.install(units)
    assert err.value.hint
    assert snapshot(tmp_path) == before


@needs_systemctl
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits")
def test_read_only_unit_dir_is_not_writable(tmp_path, units, stub_systemctl):
    d = tmp_path / "units"
    d.mkdir()
    d.chmod(0o555)
    try:
        with pytest.raises(UnitDirNotWritable):
            SystemdManager(LocalHost(), scope="user", unit_dir=str(d), systemctl=stub_systemctl).install(units)
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o755)


@needs_systemctl
def test_foreign_unit_of_the_same_name_is_refused_and_nothing_changes(tmp_path, units, stub_systemctl):
    d = tmp_path / "units"
    d.mkdir()
    foreign = d / "pdctl-demo-decode.service"
    foreign.write_text("[Service]\nExecStart=/usr/bin/someone-elses\n")
    before = snapshot(tmp_path)
    m = SystemdManager(LocalHost(), scope="user", unit_dir=str(d), systemctl=stub_systemctl)
    with pytest.raises(ForeignUnit, match="not written by pdctl") as err:
        m.install(units)
    assert err.value.unit == "pdctl-demo-decode.service"
    assert snapshot(tmp_path) == before


@needs_systemctl
def test_remove_refuses_a_foreign_unit_and_removes_nothing(tmp_path, units, stub_systemctl):
    d = tmp_path / "units"
    d.mkdir()
    (d / "pdctl-demo-router.service").write_text("[Service]\nExecStart=/bin/true\n")
    (d / "pdctl-demo.target").write_text("# pdctl-managed: deployment=demo role=target\n[Unit]\n")
    before = snapshot(tmp_path)
    with pytest.raises(ForeignUnit):
        SystemdManager(LocalHost(), scope="user", unit_dir=str(d), systemctl=stub_systemctl).remove(list(units.names))
    assert snapshot(tmp_path) == before
    assert not Path(stub_systemctl[0] + ".calls").exists()  # nothing was stopped either


@pytest.mark.parametrize("systemctl", [("no-such-systemctl-pdctl",), ("/nonexistent/bin/systemctl",)])
def test_missing_systemctl_is_a_clear_error_that_changes_nothing(tmp_path, units, systemctl):
    d = tmp_path / "units"
    m = SystemdManager(LocalHost(), scope="user", unit_dir=str(d), systemctl=systemctl)
    for call in (lambda: m.install(units), lambda: m.start("pdctl-demo.target"), lambda: m.status("x.service")):
        with pytest.raises(ManagerUnavailable, match="not found on host") as err:
            call()
        assert "service_manager" in (err.value.hint or "")
    assert not d.exists()


def test_an_unrenderable_value_is_refused_before_anything_is_written(tmp_path):
    import dataclasses

    from pdctl.units import UnitSet

    dep = load_spec(EXAMPLES / "demo.toml")
    good = unit_set_for(dep, scope="user")
    bad = dataclasses.replace(good.services[0], env=(("BAD-NAME", "1"),))
    units = UnitSet(target=good.target, services=(bad, *good.services[1:]))
    d = tmp_path / "units"
    with pytest.raises(ValueError, match="BAD-NAME"):
        SystemdManager(LocalHost(), scope="user", unit_dir=str(d), systemctl=("echo", "Version=1")).install(units)
    assert not d.exists()


def test_supervisor_state_dir_not_writable(tmp_path, units):
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    with pytest.raises(UnitDirNotWritable, match="supervisor state"):
        ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "file" / "state")).install(units)
    assert snapshot(tmp_path) == before


def test_supervisor_refuses_a_foreign_unit_directory(tmp_path, units):
    d = tmp_path / "state" / "services" / "pdctl-demo-prefill.service"
    d.mkdir(parents=True)
    (d / "unit.json").write_text('{"someone": "else"}')
    before = snapshot(tmp_path)
    m = ProcessSupervisor(LocalHost(), state_dir=str(tmp_path / "state"))
    with pytest.raises(ForeignUnit):
        m.install(units)
    with pytest.raises(ForeignUnit):
        m.remove(["pdctl-demo-prefill.service"])
    assert snapshot(tmp_path) == before


@needs_systemctl
def test_systemctl_without_a_manager_is_a_clear_error_that_changes_nothing(tmp_path, units):
    """systemctl is there, but nothing answers it (no user manager at this runtime dir; on CI
    PID 1 is not systemd either)."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    d = tmp_path / "units"
    m = SystemdManager(LocalHost(), scope="user", unit_dir=str(d),
                       env={"XDG_RUNTIME_DIR": str(xdg), "DBUS_SESSION_BUS_ADDRESS": f"unix:path={xdg}/bus"})
    with pytest.raises(ManagerUnavailable, match="no systemd user manager answers") as err:
        m.install(units)
    assert "process" in (err.value.hint or "")
    # how to get a user manager (it said "systemd-user with a running user manager" to a user-scope spec)
    assert "loginctl enable-linger" in err.value.hint and "XDG_RUNTIME_DIR=/run/user/" in err.value.hint, err.value.hint
    assert not d.exists()


def test_user_units_go_to_the_hosts_users_config_folder_not_this_machines(monkeypatch, tmp_path):
    # (over SSH the units went to the local operator's ~/.config/systemd/user on the remote host, where the login's
    # user manager never looks: `systemctl --user start` then said "Unit … not found")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "svc"))
    assert SystemdManager(LocalHost(), scope="user").unit_dir == f"{tmp_path}/svc/.config/systemd/user"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))  # (systemd.unit(5): $XDG_CONFIG_HOME/systemd/user)
    assert SystemdManager(LocalHost(), scope="user").unit_dir == f"{tmp_path}/cfg/systemd/user"
    assert SystemdManager(LocalHost(), scope="system").unit_dir == "/etc/systemd/system"

    class Remote(LocalHost):  # a host whose login's home is not this process's
        def run(self, argv, **kw):  # noqa: ANN001, ANN003, ANN201
            return super().run(argv, **{**kw, "env": {"PATH": os.environ["PATH"], "HOME": "/home/svc"}})

    assert SystemdManager(Remote(), scope="user").unit_dir == "/home/svc/.config/systemd/user"

    class Homeless(LocalHost):
        def run(self, argv, **kw):  # noqa: ANN001, ANN003, ANN201
            return super().run(argv, **{**kw, "env": {"PATH": os.environ["PATH"]}})

    with pytest.raises(ManagerUnavailable, match="cannot tell where the user units go on host"):
        SystemdManager(Homeless(), scope="user").unit_dir  # noqa: B018


def test_a_journal_that_cannot_be_read_is_said_in_the_log_lines_not_left_blank(tmp_path):
    # (a host without journald, or a user outside systemd-journal: the console's log panel and a failed step's
    # "last log lines" showed nothing at all, as if the server had printed nothing)
    journal = ("sh", "-c", 'echo "No journal files were found." >&2; echo "-- No entries --"; exit 1', "journalctl")
    m = SystemdManager(LocalHost(), scope="user", unit_dir=str(tmp_path), journalctl=journal)
    [line] = m.logs("pdctl-x-prefill.service", lines=5)
    assert line.startswith("(no log lines: sh -c ") and "--user-unit pdctl-x-prefill.service" in line
    assert line.endswith("exited 1: No journal files were found.)")
    ok = ("sh", "-c", 'printf "one\\ntwo\\n"', "journalctl")
    assert SystemdManager(LocalHost(), scope="user", unit_dir=str(tmp_path), journalctl=ok).logs("u", lines=5) == [
        "one", "two"]
