"""LocalHost: the Host surface the managers, probes and steps use, and its errors."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from harness.systemd import pid_alive
from pdctl.statemachine.errors import CommandFailed, CommandTimeout, HostError
from pdctl.statemachine.hosts import CommandResult, Host, LocalHost, host_for
from pdctl.units import HostLike


@pytest.fixture
def host():
    return LocalHost()


def test_localhost_is_a_host_and_satisfies_the_units_protocol(host):
    assert isinstance(host, Host) and isinstance(host, HostLike)
    from pdctl.statemachine.spec import Host as HostSpec
    from pdctl.statemachine.ssh import SshHost

    assert isinstance(host_for(None), LocalHost) and isinstance(host_for(HostSpec(address="::1")), LocalHost)
    remote = host_for(HostSpec(address="gpu-7.example", ssh_user="ops", ssh_port=2200), name="gpu7")
    assert isinstance(remote, SshHost) and (remote.address, remote.user, remote.port, remote.name) == (
        "gpu-7.example", "ops", 2200, "gpu7")


def test_run_returns_output_and_status(host):
    r = host.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert isinstance(r, CommandResult)
    assert (r.returncode, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
    assert host.run(["cat"], input="fed").stdout == "fed"


def test_run_check_raises_command_failed_with_context(host):
    with pytest.raises(CommandFailed) as err:
        host.run(["sh", "-c", "echo nope >&2; exit 4"])
    assert err.value.returncode == 4 and "nope" in err.value.stderr and err.value.argv[0] == "sh"
    assert isinstance(err.value, HostError) and isinstance(err.value, OSError)


def test_run_timeout_kills_the_whole_group(host, tmp_path):
    pidfile = tmp_path / "child"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout):
        host.run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert time.monotonic() - t0 < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)


def test_run_interrupted_before_popen_returns_still_ends_the_child(host, tmp_path, monkeypatch):
    # (an interrupt that lands after the fork, while Popen waits for the exec, left the child running in its own
    # session: seen as a `true` stand-in outliving the apply that a SIGTERM stopped)
    pidfile = tmp_path / "child"
    execute = subprocess.Popen._execute_child

    def interrupted_after_the_fork(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        execute(self, *a, **k)
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:  # (the child runs its command)
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "_execute_child", interrupted_after_the_fork)
    with pytest.raises(KeyboardInterrupt):
        host.run(["sh", "-c", f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 30"])
    child = int(pidfile.read_text())
    assert not pid_alive(child)  # (ended and reaped before run raised)


def test_an_interrupt_deferred_while_the_child_starts_is_raised_once_its_pid_is_known_and_ends_it(host, tmp_path,
                                                                                                  monkeypatch):
    # (CPython runs a signal handler as the fork call returns, before Popen stores the PID: a KeyboardInterrupt
    # raised there lost the PID, and the child ran on in its own session; seen under load as an nvidia-smi that
    # outlived `pdctl apply` stopped by SIGTERM). Here the CLI's handler runs at that moment, the PID not yet stored.
    from pdctl.statemachine import hosts

    pidfile = tmp_path / "child"
    execute = subprocess.Popen._execute_child

    def a_signal_as_the_fork_returns(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        execute(self, *a, **k)
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not hosts.defer_interrupt():  # (the CLI's handler: raise, unless deferred)
            del self.pid
            raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "_execute_child", a_signal_as_the_fork_returns)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        host.run(["sh", "-c", f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 30"])
    assert time.monotonic() - t0 < 10  # (raised as it started, not after the command)
    assert not pid_alive(int(pidfile.read_text()))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute)
    assert host.run(["true"]).returncode == 0  # (raised once: the next command runs)


def test_run_missing_executable_is_a_host_error(host):
    with pytest.raises(HostError, match="cannot run"):
        host.run(["/nonexistent/pdctl-nothing"])


def test_files_are_written_atomically_with_their_mode(host, tmp_path):
    p = tmp_path / "a" / "b" / "secret.env"
    host.write_file(str(p), b"X=1\n", mode=0o600)
    assert p.read_bytes() == b"X=1\n" and stat.S_IMODE(p.stat().st_mode) == 0o600
    host.write_text(str(p), "X=2\n", mode=0o600)
    assert host.read_text(str(p)) == "X=2\n"
    assert [e for e in os.listdir(p.parent)] == ["secret.env"]  # no temp file left
    host.remove_file(str(p))
    host.remove_file(str(p))  # missing: fine
    assert not host.exists(str(p))


def test_reading_a_missing_file_is_file_not_found_other_failures_are_host_errors(host, tmp_path):
    with pytest.raises(FileNotFoundError):
        host.read_file(str(tmp_path / "nope"))
    with pytest.raises(HostError):
        host.read_file(str(tmp_path))  # a directory
    (tmp_path / "f").write_text("x")
    with pytest.raises(HostError):
        host.write_file(str(tmp_path / "f" / "under-a-file"), b"")
    with pytest.raises(FileNotFoundError):  # a file where a folder should be: absent, as exists() and SFTP say
        host.read_file(str(tmp_path / "f" / "under-a-file"))
    assert not host.exists(str(tmp_path / "f" / "under-a-file"))


def test_proc_and_sysfs_read_through_the_host(host):
    assert host.read_text(f"/proc/{os.getpid()}/stat").startswith(str(os.getpid()))
    assert str(os.getpid()) in host.list_dir("/proc")
    assert host.which("sh")


def test_spawn_detached_outlives_its_parent(host, tmp_path):
    code = (
        "import sys; from pdctl.statemachine.hosts import LocalHost; "
        f"print(LocalHost().spawn_detached(['sleep', '30'], log_path={str(tmp_path / 'log')!r}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    pid = int(r.stdout.strip())
    try:
        assert pid_alive(pid)  # its parent is gone; it is not
        assert os.getsid(pid) == pid  # its own session
    finally:
        assert host.signal(pid, signal.SIGKILL)


def test_signal_reports_a_missing_process_and_refuses_pid_1(host):
    p = subprocess.Popen(["true"])
    p.wait()
    assert host.signal(p.pid, 0) is False
    with pytest.raises(ValueError):
        host.signal(1, signal.SIGTERM)


def test_read_tail_reads_a_files_last_bytes(host, tmp_path):
    f = tmp_path / "output.log"
    f.write_bytes(b"0123456789" * 10)
    assert host.read_tail(str(f), 15) == b"567890123456789"
    assert host.read_tail(str(f), 1000) == f.read_bytes()
    assert host.read_tail(str(f), 0) == b""
    stat_ = host.read_tail("/proc/self/stat", 4096)  # (size 0 in stat(2): read to its end)
    assert stat_.split(b" ", 1)[0].isdigit() and stat_.endswith(b"\n")
    with pytest.raises(FileNotFoundError):
        host.read_tail(str(tmp_path / "nope"), 10)
    with pytest.raises(FileNotFoundError):  # a file where a folder should be: absent, as read_file says
        host.read_tail(str(f / "x"), 10)


def test_read_from_reads_what_a_file_gained_since_an_offset(host, tmp_path):
    f = tmp_path / "output.log"
    f.write_bytes(b"0123456789")
    assert host.read_from(str(f), 4, 100) == (b"456789", 10)
    assert host.read_from(str(f), 4, 3) == (b"789", 10)  # (only the last max_bytes)
    assert host.read_from(str(f), 10, 100) == (b"", 10)
    assert host.read_from(str(f), 12, 100) == (b"", 10)  # (truncated since: the size says so)
    assert host.read_from(str(f), 0, 0) == (b"", 10)
    with pytest.raises(FileNotFoundError):
        host.read_from(str(tmp_path / "nope"), 0, 10)
