"""``SshHost`` against a real OpenSSH server on loopback (harness.sshd), and the demo deployment driven over it.

The server runs on this machine, so what a remote command did is checked locally (files, PIDs, listeners).
"""

from __future__ import annotations

import http.server
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid

import httpx
import pytest

from harness import skip_or_fail
from harness.sshd import Sshd
from pdctl.statemachine.errors import CommandFailed, CommandTimeout, HostError
from pdctl.statemachine.hosts import host_for
from pdctl.statemachine.spec import Host as HostSpec
from pdctl.statemachine.ssh import SshHost


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    reason = Sshd.skip_reason()
    if reason:
        skip_or_fail(reason)
    server = Sshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def host(sshd):
    h = host_for(HostSpec(**sshd.host_spec()), name="gpu")
    yield h
    h.close()


def test_a_loopback_address_with_connect_ssh_goes_over_ssh(sshd, host):
    assert isinstance(host, SshHost) and host.name == "gpu"
    assert not HostSpec(**sshd.host_spec()).is_local
    assert HostSpec(address="127.0.0.1").is_local and not HostSpec(address="10.0.0.2").is_local


def test_run_returns_output_status_and_honours_env_cwd_input(host, tmp_path):
    r = host.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    with pytest.raises(CommandFailed) as e:
        host.run(["false"])
    assert e.value.returncode == 1
    r = host.run(["sh", "-c", 'echo "$PDCTL_X|${HOME:-unset}"; pwd'], env={"PDCTL_X": "a b'c"}, cwd=str(tmp_path))
    assert r.stdout.splitlines() == ["a b'c|unset", str(tmp_path)]
    assert host.run(["cat"], input="piped\n").stdout == "piped\n"
    with pytest.raises(HostError, match="cannot run") as e:
        host.run(["/nonexistent/tool"])
    # said as LocalHost says it: the reason alone, not the words of pdctl's own `timeout` wrapper (the GPU panel
    # showed "timeout: failed to run command 'nvidia-smi'" for a host without nvidia-smi)
    assert e.value.message == "cannot run /nonexistent/tool on gpu: No such file or directory"


def test_a_command_past_its_timeout_is_killed_on_the_host(host, tmp_path):
    mark = tmp_path / "alive"
    nap = f"{30 + os.getpid() % 1000 / 1000:.3f}"  # a sleep no other process on the machine is running
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout):
        host.run(["sh", "-c", f"sleep {nap}; touch {mark}"], timeout=1)
    assert time.monotonic() - t0 < 10

    def sleeping() -> bool:
        needle = b"sleep\x00" + nap.encode() + b"\x00"
        found = False
        for p in os.listdir("/proc"):
            try:
                found |= p.isdigit() and needle in open(f"/proc/{p}/cmdline", "rb").read()
            except OSError:  # exited meanwhile
                pass
        return found

    deadline = time.monotonic() + 5  # the kill may land a moment after the timeout's error
    while sleeping() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sleeping()


def test_files_are_written_atomically_with_their_mode(host, tmp_path):
    target = tmp_path / "sub" / "unit.service"
    host.write_file(str(target), b"[Unit]\nDescription=x\n\x00binary", mode=0o600)
    assert target.read_bytes() == b"[Unit]\nDescription=x\n\x00binary"
    assert (target.stat().st_mode & 0o777) == 0o600
    assert host.read_file(str(target)).endswith(b"\x00binary")
    assert [p.name for p in target.parent.iterdir()] == ["unit.service"], "no temp file left behind"
    assert host.exists(str(target)) and sorted(host.list_dir(str(target.parent))) == ["unit.service"]
    host.remove_file(str(target))
    host.remove_file(str(target))  # missing is fine
    assert not target.exists() and not host.exists(str(target))
    with pytest.raises(FileNotFoundError):
        host.read_file(str(target))
    with pytest.raises(FileNotFoundError):
        host.list_dir(str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError):  # a file where a folder should be: absent, as for the local host
        host.read_file(str(tmp_path / "f" / "unit.json"))
    host.write_file(str(tmp_path / "empty"), b"")  # stdin closed at once: no wait for bytes that never come
    assert (tmp_path / "empty").read_bytes() == b""
    assert host.run(["cat"], timeout=5).stdout == ""
    host.make_dirs(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "a" / "b").chmod(0o755)
    host.make_dirs(str(tmp_path / "a" / "b"), private=True)  # one that exists loses group and other permissions
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700
    host.make_dirs(str(tmp_path / "a" / "c"), private=True)
    assert (tmp_path / "a" / "c").stat().st_mode & 0o777 == 0o700
    assert host.which("sh") and host.which("pdctl-no-such-tool") is None


@pytest.mark.parametrize("sftp", [True, False], ids=["sftp", "shell"])
def test_read_tail_and_read_from_read_as_the_local_host_does(host, tmp_path, monkeypatch, sftp):
    from pdctl.statemachine.hosts import LocalHost

    if not sftp:  # (a server without the SFTP subsystem: `tail -c` through a shell)
        monkeypatch.setattr(SshHost, "_sftp_call", lambda self, op, path, fn: (False, None))
    f = tmp_path / "output.log"
    f.write_bytes(bytes(range(256)) * 1024)  # 256 KiB, every byte value
    for n in (1, 1000, 65536, 300000):
        assert host.read_tail(str(f), n) == LocalHost().read_tail(str(f), n) == f.read_bytes()[-n:], n
    assert host.read_tail("/proc/self/status", 100000).startswith(b"Name:")  # (size 0 in stat(2))
    with pytest.raises(FileNotFoundError):
        host.read_tail(str(tmp_path / "nope"), 10)
    for offset, most in ((0, 10**6), (1000, 10**6), (1000, 70000), (262143, 5), (262144, 5), (300000, 5), (7, 0)):
        assert host.read_from(str(f), offset, most) == LocalHost().read_from(str(f), offset, most), (offset, most)
    with pytest.raises(FileNotFoundError):
        host.read_from(str(tmp_path / "nope"), 0, 10)


def test_spawned_processes_outlive_the_command_and_can_be_signalled(host, tmp_path):
    log = tmp_path / "spawn.log"
    t0 = time.monotonic()
    pid = host.spawn_detached(["sh", "-c", "pwd; exec sleep 60"], env={"PATH": "/usr/bin:/bin"},
                              log_path=str(log), cwd=str(tmp_path))
    assert time.monotonic() - t0 < 5, "the session does not wait for the spawned process"
    try:
        # env, setsid and sh exec in turn under that PID; wait for the last one (their command lines all say "sleep").
        deadline = time.monotonic() + 5
        while not open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"sleep\x00") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open(f"/proc/{pid}/cmdline", "rb").read() == b"sleep\x0060\x00"
        assert os.getsid(pid) == pid, "a new session"
        assert log.read_text() == f"{tmp_path}\n"
    finally:
        assert host.signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while host.signal(pid, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.signal(pid, 0) is False


def test_socket_links_find_a_listener_with_one_command(host):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    try:
        inode = str(os.fstat(srv.fileno()).st_ino)
        assert (os.getpid(), inode) in host.socket_links()
        from pdctl.statemachine.ports import listeners

        port = srv.getsockname()[1]
        assert [(lst.port, lst.pid) for lst in listeners(host, {port})] == [(port, os.getpid())]
    finally:
        srv.close()
    assert host.readlink(f"/proc/{os.getpid()}/exe") == os.readlink(f"/proc/{os.getpid()}/exe")


def test_proc_files_read_every_process_in_one_command_as_the_local_host_does(host, monkeypatch):
    # (a /proc scan over SSH was one SFTP read per process: 386 reads for one `down` of the demo on this machine, one
    # per process per scan, which a far host's round trip multiplies)
    from pdctl.statemachine.hosts import LocalHost

    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    odd = subprocess.Popen([sys.executable, "-c", code, "an arg with spaces", "a\nnewline", ":colon:"],
                           env={"PATH": "/usr/bin:/bin", "PDCTL_UNIT": "x.service", "EMPTY": ""}, stdout=subprocess.PIPE)
    try:
        assert odd.stdout.readline() == b"up\n"
        reads = []
        monkeypatch.setattr(SshHost, "read_file", lambda self, path: reads.append(path) or b"")
        over, here = host.proc_files("cmdline"), LocalHost().proc_files("cmdline")
        want = b"\x00".join([sys.executable.encode(), b"-c", code.encode(), b"an arg with spaces", b"a\nnewline",
                              b":colon:"]) + b"\x00"
        assert over[odd.pid] == here[odd.pid] == want, (over.get(odd.pid), here.get(odd.pid))
        assert over[os.getpid()] == here[os.getpid()]
        env = host.proc_files("environ", [odd.pid, 1 << 22])  # (a PID that does not exist is left out)
        assert set(env) == {odd.pid} and env[odd.pid].split(b"\0")[:-1] == [
            b"PATH=/usr/bin:/bin", b"PDCTL_UNIT=x.service", b"EMPTY="], env
        stat = host.proc_files("stat")
        assert stat[odd.pid] == open(f"/proc/{odd.pid}/stat", "rb").read()
        assert reads == [] and host.proc_files("stat", []) == {}
        with pytest.raises(ValueError):
            host.proc_files("../etc")
    finally:
        odd.kill()
        odd.wait(10)


def test_http_reaches_the_hosts_loopback_through_the_connection(host):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = self.path.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):  # noqa: ANN002
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        with httpx.Client(transport=host.http_transport(), trust_env=False) as c:
            r = c.get(f"http://0.0.0.0:{port}/health?x=1")
            assert (r.status_code, r.text) == (200, "/health?x=1")
            assert host.forward("127.0.0.1", port) != port, "the request went through a forward"
    finally:
        srv.shutdown()


def test_wrong_key_and_unknown_or_changed_host_key_are_clear_errors(sshd, tmp_path):
    spec = sshd.host_spec()
    bad = host_for(HostSpec(**{**spec, "ssh_identity": str(sshd.wrong_key)}))
    with pytest.raises(HostError, match="permission denied") as e:
        bad.run(["true"])
    assert "ssh_identity" in (e.value.hint or "")
    with pytest.raises(HostError, match="permission denied"):  # the SFTP path says the same
        bad.read_file("/etc/hostname")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    unknown = host_for(HostSpec(**{**spec, "ssh_known_hosts": str(empty)}))
    with pytest.raises(HostError, match="host key not verifiable") as e:
        unknown.run(["true"])
    assert "ssh-keyscan" in (e.value.hint or "") and "fingerprint matches the host's own" in e.value.hint
    # a known_hosts that records another key for this host: a changed key, said as such and never keyscan'd
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    changed_file = tmp_path / "known_hosts_changed"
    changed_file.write_text(f"[127.0.0.1]:{spec['ssh_port']} {(tmp_path / 'other_host_key.pub').read_text().split(' ')[0]} "
                            f"{(tmp_path / 'other_host_key.pub').read_text().split(' ')[1]}\n")
    changed = host_for(HostSpec(**{**spec, "ssh_known_hosts": str(changed_file)}))
    with pytest.raises(HostError, match="host key CHANGED") as e:
        changed.run(["true"])
    assert "ssh-keyscan" not in (e.value.hint or "") and "out of band" in (e.value.hint or "")
    assert ".ssh_known_hosts)" in e.value.message, e.value.message  # (the spec field, named)
    # a known_hosts that marks the host's key @revoked: never advice to add the key it offers
    # (it said "host key not verifiable" with the hint to add the host's key once its fingerprint matched)
    hostpub = (sshd.root / "host_ed25519.pub").read_text().split()
    revoked_file = tmp_path / "known_hosts_revoked"
    revoked_file.write_text(f"@revoked [127.0.0.1]:{spec['ssh_port']} {hostpub[0]} {hostpub[1]}\n")
    revoked = host_for(HostSpec(**{**spec, "ssh_known_hosts": str(revoked_file)}))
    with pytest.raises(HostError, match="marks a key of this host @revoked") as e:
        revoked.run(["true"])
    assert "do not add the key" in e.value.hint and "ssh-keyscan" not in e.value.hint, e.value.hint
    closed = host_for(HostSpec(**{**spec, "ssh_port": _closed_port()}))
    with pytest.raises(HostError, match="cannot connect"):
        closed.run(["true"])
    for h in (bad, unknown, changed, revoked, closed):
        h.close()


def test_a_given_ssh_identity_is_the_only_key_tried(sshd, tmp_path, monkeypatch):
    # (the agent's keys were tried too: a wrong ssh_identity logged in with whatever key the agent held, as
    # whichever account that key opens)
    import shutil

    if not shutil.which("ssh-agent") or not shutil.which("ssh-add"):
        skip_or_fail("needs ssh-agent and ssh-add (openssh-client)")
    sock = tmp_path / "agent.sock"
    agent = subprocess.run(["ssh-agent", "-a", str(sock), "-s"], capture_output=True, text=True, check=True)
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        subprocess.run(["ssh-add", str(sshd.client_key)], env={**os.environ, "SSH_AUTH_SOCK": str(sock)},
                       capture_output=True, check=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        spec = sshd.host_spec()
        wrong = host_for(HostSpec(**{**spec, "ssh_identity": str(sshd.wrong_key)}))
        with pytest.raises(HostError, match="permission denied") as e:
            wrong.run(["true"])
        assert f"the key {sshd.wrong_key}" in e.value.message, e.value.message
        wrong.close()
        agent_only = host_for(HostSpec(**{k: v for k, v in spec.items() if k != "ssh_identity"}))
        assert agent_only.run(["echo", "agent"]).stdout == "agent\n"  # (unset: the agent's keys, as documented)
        agent_only.close()
    finally:
        os.kill(pid, signal.SIGTERM)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_demo_deploys_checks_and_stops_over_ssh(sshd, make_demo):
    secret = "hub-" + uuid.uuid4().hex

    def over_ssh(d):
        d["hosts"]["local"] = sshd.host_spec()
        d["secrets"] = {"MODEL_HUB_AUTH": secret}  # (its file written over SFTP: a bundle must leave it out)

    demo = make_demo(over_ssh)
    from pdctl.statemachine import service

    res = demo.apply()
    assert res.state == "parsers_configured"
    st = service.status(demo.load())
    assert st["healthy"], st
    assert len(demo.pids()) == 3, "prefill, decode and the router run (started through sshd)"
    # They were started by a command that came in over SSH: sshd's session, not this process, spawned them.
    assert all(os.getsid(p) != os.getsid(0) for p in demo.pids())
    # The CLI reaches the router through the connection too (one chat with the tool, answered by the stand-in).
    r = demo.cli("chat", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert "tool_calls" in r.stdout
    r = demo.cli("status", str(demo.spec), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["healthy"], r.stdout + r.stderr
    r = demo.cli("logs", str(demo.spec), "decode", "-n", "2")  # (the supervisor's log file, read over SFTP)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stdout + r.stderr
    log = (demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-decode.service" / "output.log").read_text()
    assert r.stdout in log, (r.stdout, log[-500:])  # (its end when read: health checks write on)
    # A support bundle, every part read through the connection: status, the supervisor's units and logs, each server
    # and the router, the versions on the host; the secret's value nowhere in it
    bundle = demo.tmp / "bundle.tar.gz"
    r = demo.cli("support-bundle", str(demo.spec), "-o", str(bundle), "-n", "5")
    assert r.returncode == 0 and r.stdout == f"{bundle}\n", r.stdout + r.stderr
    with tarfile.open(bundle, "r:gz") as tar:
        m = {i.name.split("/", 1)[1]: tar.extractfile(i).read() for i in tar.getmembers() if i.isfile()}
    assert [name for name, data in m.items() if secret.encode() in data] == []
    assert secret.encode() in b"".join(p.read_bytes() for p in demo.state.rglob("*.env"))  # (installed: there to leak)
    manifest = json.loads(m["MANIFEST.json"])
    assert [e["name"] for e in manifest["members"] if e["status"] == "error"] == [], manifest
    assert json.loads(m["status.json"])["healthy"] is True
    log = (demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-decode.service" / "output.log").read_text()
    got = m["logs/decode.log"].decode().splitlines()
    assert 0 < len(got) <= 5 and all(line in log.splitlines() for line in got), got
    assert demo.name in json.loads(m[f"units/pdctl-{demo.name}-decode.service"])["service"]["name"]
    assert json.loads(m["server_info/decode.json"])["disaggregation_mode"] == "decode"
    assert str(demo.ports["decode"]) in json.dumps(json.loads(m["router/workers.json"]))
    assert json.loads(m["versions.json"])["host"]["pdctl"] == importlib.metadata.version("pdctl")
    stopped = service.down(demo.load())
    assert len(stopped) == 3
    deadline = time.monotonic() + 20
    while demo.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert demo.pids() == []


def test_an_unreachable_host_stops_the_apply_before_anything_changes(sshd, make_demo):
    def unreachable(d):
        d["hosts"]["local"] = {**sshd.host_spec(), "ssh_port": _closed_port()}

    demo = make_demo(unreachable)
    from pdctl.statemachine.journal import Journal

    with pytest.raises(HostError, match="cannot connect"):
        demo.apply()
    assert demo.pids() == []
    assert Journal(demo.state, demo.name).read().target is None


def test_a_down_that_cannot_reach_its_host_records_no_failed_down(sshd, make_demo):
    # (status then said "the last pdctl down failed … cannot connect" of a deployment that down never touched,
    # leaving the operator to wonder what it had stopped)
    def unreachable(d):
        d["hosts"]["local"] = {**sshd.host_spec(), "ssh_port": _closed_port()}

    demo = make_demo(unreachable)
    from pdctl.statemachine import service
    from pdctl.statemachine.journal import Journal, JournalState
    from pdctl.statemachine.topology import topology_of

    journal = Journal(demo.state, demo.name)
    journal.write(JournalState(name=demo.name, deployed=topology_of(demo.load().deployment)))
    with pytest.raises(HostError, match="cannot connect"):
        service.down(demo.load())
    assert [a["event"] for a in journal.audit_records() if a["event"].startswith("down")] == []
    assert journal.read().deployed is not None


def test_bad_or_missing_key_files_name_the_field(sshd, tmp_path):
    spec = sshd.host_spec()
    pub = host_for(HostSpec(**{**spec, "ssh_identity": str(sshd.client_key) + ".pub"}), name="gpu")
    with pytest.raises(HostError, match="cannot use the key") as e:
        pub.run(["true"])
    assert "hosts.gpu.ssh_identity" in e.value.hint and "ssh-agent" in e.value.hint
    gone = host_for(HostSpec(**{**spec, "ssh_known_hosts": str(tmp_path / "nope")}), name="gpu")
    with pytest.raises(HostError, match="hosts.gpu.ssh_known_hosts .* is not a file"):
        gone.run(["true"])
    for h in (pub, gone):
        h.close()


def test_key_paths_are_relative_to_the_spec_and_checked_by_validate(sshd, tmp_path, monkeypatch):
    from harness.deploy import demo_dict, dump_toml
    from pdctl.statemachine.errors import SpecError
    from pdctl.statemachine.service import load

    (tmp_path / "specs" / "keys").mkdir(parents=True)
    (tmp_path / "specs" / "keys" / "id").write_bytes(sshd.client_key.read_bytes())
    d = demo_dict()
    d["hosts"]["local"] = {**sshd.host_spec(), "ssh_identity": "keys/id"}
    (tmp_path / "specs" / "s.toml").write_text(dump_toml(d))
    monkeypatch.chdir(tmp_path)  # not the spec's folder
    dep = load(tmp_path / "specs" / "s.toml", state_dir=tmp_path / "st").deployment
    assert dep.hosts["local"].ssh_identity == str(tmp_path / "specs" / "keys" / "id")
    h = host_for(dep.hosts["local"], name="local")
    assert h.run(["echo", "ok"]).stdout == "ok\n"
    h.close()
    d["hosts"]["local"]["ssh_identity"] = "keys/missing"
    (tmp_path / "specs" / "s.toml").write_text(dump_toml(d))
    with pytest.raises(SpecError, match="hosts.local.ssh_identity"):
        load(tmp_path / "specs" / "s.toml", state_dir=tmp_path / "st")


def test_how_pdctl_reaches_a_host_changes_nothing_that_runs(sshd):
    from harness.deploy import demo_dict
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.spec import parse_spec
    from pdctl.statemachine.topology import topology_of

    d = demo_dict()
    d["hosts"]["local"] = sshd.host_spec()
    before = topology_of(parse_spec(d))
    d["hosts"]["local"] = {**sshd.host_spec(), "ssh_port": 2201, "ssh_user": "ops", "connect": "auto"}
    after = topology_of(parse_spec(d))
    assert not make_plan(before, after).has_changes
    # A journal written before ssh_user/ssh_port left the topology still plans no restart.
    old = before.model_copy(update={"deployment": {**before.deployment, "hosts": {
        "local": {"address": "127.0.0.1", "ssh_user": "root", "ssh_port": 22}}}})
    assert not make_plan(old, after).has_changes
    d["hosts"]["local"] = {**sshd.host_spec(), "address": "10.0.0.9"}
    assert make_plan(before, topology_of(parse_spec(d))).has_changes


def _lost_at(step: str, monkeypatch, **also):  # noqa: ANN001, ANN003, ANN202
    """A sink that, once *step* starts, makes every command on the SSH connection fail as lost (and patches *also*'s
    ``SshHost`` methods too): the connection dies under that step."""
    import asyncssh

    class LostAt:
        def emit(self, event) -> None:  # noqa: ANN001
            if event.kind == "step_started" and event.step == step:
                async def lost(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
                    raise asyncssh.ConnectionLost("Connection lost")

                monkeypatch.setattr(SshHost, "_exec", lost)
                for name, fn in also.items():
                    monkeypatch.setattr(SshHost, name, fn)

    return LostAt()


def test_a_connection_lost_mid_apply_is_reported_as_such(sshd, make_demo, monkeypatch):
    from pdctl.statemachine.errors import StepError

    demo = make_demo(lambda d: d["hosts"].__setitem__("local", sshd.host_spec()))

    async def refused(self):  # noqa: ANN001
        raise HostError(f"ssh {self.address}:{self.port}: cannot connect: [Errno 111] Connection refused",
                        host=self.name, hint="is sshd running there?")

    with pytest.raises(StepError) as e:
        demo.apply(sink=_lost_at("prefill_up", monkeypatch, _connect=refused))
    assert e.value.step == "prefill_up"
    assert "lost the connection to host local" in e.value.message
    assert e.value.message.count("hint") == 0 and "writable state directory" not in (e.value.hint or "")


def test_a_connection_lost_under_the_kv_links_http_probes_is_reported_as_such(sshd, make_demo, monkeypatch):
    # (the KV link's proof speaks HTTP through SSH forwards only: a connection that died failed it as the link's
    # "Connection refused", with the link's hint about bootstrap ports and UCX devices; helper-112)
    from pdctl.statemachine.errors import StepError

    demo = make_demo(lambda d: d["hosts"].__setitem__("local", sshd.host_spec()))

    def refused(self, host, port):  # noqa: ANN001
        raise HostError(f"ssh {self.name}: cannot open a forward to {host}:{port}", host=self.name)

    with pytest.raises(StepError) as e:
        demo.apply(sink=_lost_at("kv_link_verified", monkeypatch, forward=refused))
    assert e.value.step == "kv_link_verified"
    assert "lost the connection to host local" in e.value.message, e.value.message
    assert "UCX" not in (e.value.hint or ""), e.value.hint


def test_a_port_that_accepts_but_never_speaks_ssh_is_named_as_such(tmp_path):
    # (after the connect timeout the error read "cannot connect: " with nothing after it)
    from pdctl.statemachine.ssh import SshHost

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        h = SshHost("127.0.0.1", name="gpu1", port=port, user="root", connect_timeout=1.0)
        try:
            with pytest.raises(HostError, match=r"cannot connect: no SSH greeting within 1 s \(is it an sshd\?\)") as e:
                h.run(["true"])
            silent.settimeout(2.0)
            silent.accept()[0].close()  # the one connection it made
            # the calls after it in the same command fail with that error at once, without connecting again: a status
            # asked 3-5 times and took 46-77 s against such a host
            for call in (lambda: h.run(["true"]), lambda: h.read_file("/etc/hostname")):
                with pytest.raises(HostError, match="no SSH greeting within 1 s"):
                    call()
            silent.settimeout(0.5)
            with pytest.raises(TimeoutError):
                silent.accept()
        finally:
            h.close()
    assert "hosts.gpu1.address / ssh_port" in (e.value.hint or "")



def test_a_file_the_ssh_user_may_not_read_names_ssh_user_as_the_fix():
    # (a login as another user than the deployment's said only "cannot read …/unit.json on gpu1: Permission denied",
    # with no hint, in status, plan and down; root, as these tests log in, is denied nothing, so the host's answer
    # is the one a shell's cat gives, the path taken without SFTP)
    from pdctl.statemachine.ssh import SshHost

    for user, who in (("nobody", "'nobody'"), (None, "this machine's user name (ssh_user unset)")):
        h = SshHost("gpu1.example.com", name="gpu1", user=user)
        e = h._file_error("read", "/srv/state/unit.json", 1, "cat: /srv/state/unit.json: Permission denied\n")
        assert isinstance(e, HostError) and "cannot read /srv/state/unit.json on gpu1: cat:" in e.message
        assert e.hint == (f"pdctl logs in to host gpu1 as {who}, which may not read it: set hosts.gpu1.ssh_user to the "
                          "user the deployment was applied as, or give this one access"), e.hint
    assert h._file_error("read", "/x", 1, "cat: /x: Is a directory").hint is None


def test_an_ssh_account_that_cannot_run_commands_is_named_by_its_field(tmp_path, monkeypatch):
    # (apply said "true on gpu1 exited 1: Could not chdir to home directory /nonexistent", naming no field; a locked
    # account such as nobody cannot be logged into here, so the host's answer is the one OpenSSH gives a nologin shell)
    from pdctl.statemachine.errors import CommandFailed
    from pdctl.statemachine.service import _can_run_commands
    from pdctl.statemachine.spec import parse_spec

    from .specs import seed_dict

    class NoLogin:
        name = "gpu1"

        def run(self, argv, **kw):  # noqa: ANN001, ANN003, ANN202
            raise CommandFailed("true on gpu1 exited 1", host="gpu1", argv=argv, returncode=1,
                                stderr="Could not chdir to home directory /nonexistent: No such file or directory\n"
                                       "This account is currently not available.\n")

    d = seed_dict()
    for group in ("prefill", "decode"):
        d[group][0]["host"] = "gpu1"
    d["hosts"] = {"gpu1": {"address": "gpu1.example.com", "ssh_user": "nobody"}}
    with pytest.raises(HostError, match=r"host 'gpu1' logs in but cannot run commands \(`true` exited 1: Could not "
                                        r"chdir .* / This account is currently not available.\)") as e:
        _can_run_commands(parse_spec(d), NoLogin())
    assert "hosts.gpu1.ssh_user must be an account with a login shell" in e.value.hint
    # the plan's host checks say the same (they warned of every port "held by PID ? (unknown)" and of nvidia-smi
    # failing, naming no field): plan then notes it could not check, with these words
    from .specs import dump_toml
    from pdctl.statemachine import service

    spec = tmp_path / "nologin.toml"
    spec.write_text(dump_toml(d))
    loaded = service.load(spec, state_dir=tmp_path / "state")
    with pytest.raises(HostError, match="logs in but cannot run commands"):
        service.host_warnings(loaded, loaded.journal.read(), host=NoLogin())
    # ...and down and logs, which said only "true on gpu1 exited 1: Could not chdir…" and "cannot read …/unit.json:
    # Permission denied" after one role's lines (helper-112)
    NoLogin.close = lambda self: None
    monkeypatch.setattr(service, "deployment_host", lambda dep: NoLogin())
    with pytest.raises(HostError, match="logs in but cannot run commands"):
        service.RoleLogs(loaded)
    loaded.journal.dir.mkdir(parents=True)  # (something recorded here: down asks the host)
    with pytest.raises(HostError, match="logs in but cannot run commands") as e:
        service.down(loaded)
    assert "hosts.gpu1.ssh_user" in e.value.hint


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_a_session_cut_under_a_command_is_a_lost_connection_not_an_exit_status(sshd):
    # (asyncssh returns a channel that closed without an exit status as a finished command: run() answered exit 255
    # with nothing on stderr, and each caller blamed its own operation, e.g. "cannot write …/unit.json on local: "
    # with the hint to choose a writable state directory, never "lost the connection")
    h = host_for(HostSpec(**sshd.host_spec()), name="gpu")
    try:
        assert h.run(["echo", "up"]).stdout == "up\n"
        sessions = _children(sshd.proc.pid)  # (this connection's sshd processes, children of our listener)
        assert sessions

        def cut() -> None:
            time.sleep(1.0)
            for pid in sessions:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        threading.Thread(target=cut, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(HostError) as e:
            h.run(["sleep", "20"], timeout=30)
        assert time.monotonic() - t0 < 15, "the cut must end the command's wait, not its own timeout"
        assert not isinstance(e.value, (CommandFailed, CommandTimeout)), e.value
        assert h.connection_error is e.value and "is host gpu up" in (e.value.hint or ""), e.value
        # the next call connects again
        assert h.run(["echo", "back"]).stdout == "back\n" and h.connection_error is None
    finally:
        h.close()


def test_plan_asks_the_host_through_one_connection(sshd, make_demo, monkeypatch, capsys):
    # (plan logged in three times: its machine check, its plan of what runs, and its host checks each connected anew;
    # the machine check's connection was never closed; helper-112)
    from pdctl.console import cli

    demo = make_demo(lambda d: d["hosts"].__setitem__("local", sshd.host_spec()))
    demo.apply()
    connects = []
    real = SshHost._connect

    async def counted(self):  # noqa: ANN001, ANN202
        connects.append(self.name)
        return await real(self)

    monkeypatch.setattr(SshHost, "_connect", counted)
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", str(demo.spec), "--state-dir", str(demo.state)])
    assert e.value.code == 0, capsys.readouterr()
    assert connects == ["local"], connects
