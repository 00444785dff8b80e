"""`pdctl verify SPEC --endpoints …`: the steps' own KV-link, router and parsers proofs against endpoints pdctl did not
start, here the demo's running engines and router reached through forwarders (as a `kubectl port-forward` would)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from harness.deploy import ROOT, Demo
from harness.sim import free_ports
from pdctl.statemachine import k8s, verify
from pdctl.statemachine.errors import PdctlError, StepError
from pdctl.statemachine.events import ListSink
from pdctl.statemachine.journal import Journal

pytestmark = pytest.mark.smg


class Forwarder:
    """A TCP forwarder from a free loopback port to *target* (what `kubectl port-forward` is to a pod), counting the
    connections it carried."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_ports(1)[0]
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                a.close()
                continue
            self.open += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for s in self.open:
            s.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """The demo applied once for the whole module (its engines and router run under pdctl's process supervisor), and
    forwarders to its prefill, its bootstrap, decode, the router and the router's metrics."""
    d = Demo(tmp_path_factory.mktemp("verify"))
    fw: dict[str, Forwarder] = {}
    try:
        d.apply()
        fw = {k: Forwarder(d.ports[p]) for k, p in (("prefill", "prefill"), ("prefill.bootstrap", "bootstrap"),
                                                    ("decode", "decode"), ("router", "router"),
                                                    ("router.metrics", "prom"))}
        yield d, fw
    finally:
        for f in fw.values():
            f.close()
        d.down()


def endpoints(fw: dict[str, Forwarder]) -> dict[str, str]:
    return {k: (f.url if not k.endswith(".bootstrap") else f"127.0.0.1:{f.port}") for k, f in fw.items()}


def test_verify_passes_through_the_endpoints_with_the_steps_own_proofs(running):
    d, fw = running
    before = {k: f.connections for k, f in fw.items()}
    sink = ListSink()
    machine = verify.verify(d.load().deployment, endpoints(fw), sink=sink, timeouts=d.timeouts())
    assert machine.state == "parsers_configured"
    verified = [e for e in sink.events if e.kind == "step_verified"]
    assert [e.step for e in verified] == ["kv_link_verified", "router_exposed", "parsers_configured"]
    # (every request went through the endpoints given; the router's metrics are read where its proof reads them)
    used = ("prefill", "prefill.bootstrap", "decode", "router")
    assert all(fw[k].connections > before[k] for k in used), {k: (before[k], f.connections) for k, f in fw.items()}
    # the same proofs as apply's steps: the summaries its journal holds from the demo's apply
    journal = Journal(d.state, d.name).read()
    for e in verified:
        assert e.data["proof"]["summary"] == journal.steps[e.step].proof["summary"], e.step


def test_the_command_says_it_in_the_steps_words(running):
    d, fw = running
    eps = endpoints(fw)
    r = subprocess.run([sys.executable, "-m", "pdctl", "verify", str(d.spec), "--endpoints",
                        ",".join(f"{k}={v}" for k, v in eps.items() if k != "router"), "--endpoints",
                        f"router={eps['router']}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("✓ ")]
    assert [x.split(":")[0] for x in lines] == ["✓ kv_link_verified", "✓ router_exposed", "✓ parsers_configured"]
    assert "verified — KV link proven" in lines[0]
    r = subprocess.run([sys.executable, "-m", "pdctl", "verify", str(d.spec), "--json", "--endpoints",
                        ",".join(f"{k}={v}" for k, v in eps.items())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert [e["step"] for e in events if e["kind"] == "step_verified"] == [
        "kv_link_verified", "router_exposed", "parsers_configured"]


def test_bad_endpoints_are_refused_before_anything_is_asked():
    dep, _ = k8s.load(ROOT / "examples" / "demo.toml")
    with pytest.raises(PdctlError, match="no such role"):
        verify.verify(dep, {"prefil": "http://127.0.0.1:1"})
    with pytest.raises(PdctlError, match="give http://HOST:PORT"):
        verify.parse_endpoints(["decode=https://x:1/health"])
    with pytest.raises(PdctlError, match="given twice"):
        verify.parse_endpoints(["router=http://a:1,router=http://b:2"])
    # on Kubernetes pdctl cannot reach the cluster's own names: every role and the router need an endpoint
    with pytest.raises(PdctlError, match="no endpoint for decode .*demo-decode-0.s-demo-decode:30020"):
        verify.verify(dep, {"prefill": "http://127.0.0.1:1", "router": "http://127.0.0.1:2"}, target="k8s")


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_on_kubernetes_requests_for_cluster_names_go_to_their_endpoints(fmt):
    """The proofs ask the deployment's own addresses (the router registered its workers under the pods' names);
    the transport sends each to its endpoint, the Host header and the bootstrap host in the body left as they were."""
    dep, _ = k8s.load(ROOT / "examples" / "seed.toml")
    topo = verify.verify_topology(dep, "k8s", fmt)
    eps = {"prefill": "http://127.0.0.1:8001", "decode": "http://127.0.0.1:8002", "router": "http://127.0.0.1:8000"}
    to = verify.mapping(topo, eps, every=True)
    seen: list[tuple[str, int, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.port, request.headers["host"]))
        return httpx.Response(200, json={})

    client = httpx.Client(transport=verify._Mapped(to, httpx.MockTransport(handler)))
    pre, dec = (topo.role(n) for n in ("prefill", "decode"))
    boot_host, boot_port = topo.kv_link.bootstrap[0][1:]
    for url in (f"{pre.url}/health", f"{dec.url}/health", f"http://{boot_host}:{boot_port}/route",
                f"{topo.router.url}/readiness", "http://127.0.0.1:29000/metrics"):
        client.get(url)
    pod = "dsv4-flash-prefill-0." + ("s-dsv4-flash-prefill" if fmt == "rbg" else "dsv4-flash-prefill")
    assert pre.url == f"http://{pod}:30010" and boot_host == pod
    assert seen == [("127.0.0.1", 8001, f"{pod}:30010"), ("127.0.0.1", 8002, dec.url[7:]),
                    ("127.0.0.1", 8998, f"{pod}:8998"), ("127.0.0.1", 8000, "dsv4-flash-router:30001"),
                    ("127.0.0.1", 29000, "127.0.0.1:29000")]
    # what the router proof compares /workers with: the same cluster names the exported router was given
    assert [u for u, _p in topo.router.prefill] == [pre.url] and list(topo.router.decode) == [dec.url]


def test_verify_fails_with_the_kv_link_proofs_message_when_decode_is_down(running):
    d, fw = running
    from pdctl.statemachine import launch, service

    loaded = d.load()
    manager = launch.manager_for(loaded.deployment, service.deployment_host(loaded.deployment),
                                 state_dir=str(loaded.journal.dir))
    unit = launch.unit_name(loaded.deployment, "decode")
    manager.stop(unit)
    try:
        sink = ListSink()
        with pytest.raises(StepError) as e:
            verify.verify(loaded.deployment, endpoints(fw), sink=sink, timeouts=d.timeouts())
        assert e.value.step == "kv_link_verified"
        assert f"{fw['decode'].url}" not in e.value.message  # (said at the deployment's address, as the step says it)
        assert f"127.0.0.1:{d.ports['decode']}/server_info" in e.value.message
        failed = [ev for ev in sink.events if ev.kind == "step_failed"]
        assert [ev.step for ev in failed] == ["kv_link_verified"]
        assert failed[0].message.startswith("kv_link_verified: FAILED — ")
        assert not any(ev.kind == "step_started" and ev.step != "kv_link_verified" for ev in sink.events)
        r = subprocess.run([sys.executable, "-m", "pdctl", "verify", str(d.spec), "--endpoints",
                            ",".join(f"{k}={v}" for k, v in endpoints(fw).items())],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 3 and "✗ kv_link_verified: FAILED" in r.stderr, r.stderr
    finally:
        d.apply()  # (decode back for the module's other tests)
