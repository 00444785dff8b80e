"""The same spec on Kubernetes: RoleBasedGroup or LeaderWorkerSet manifests, a record to plan from, and the
addresses the proofs reach there.

``export(dep, fmt=..., image=...)`` turns a validated spec into manifests, pure and deterministic (the same spec and
options give the same bytes); :func:`write` puts them in a folder, planning the change from the export already there
(a topology change needs ``--confirm-topology``, as on hosts); :func:`plan_from` plans a spec against a folder without
writing. No cluster is contacted: the manifests are validated against the pinned CRD schemas and Kubernetes' own
(:mod:`pdctl.statemachine.k8s_validate`), not run.

Formats (the external facts each rests on, read in the upstream source at the pinned tag):

* ``rbg``: one ``RoleBasedGroup`` (``workloads.x-k8s.io/v1alpha2``, sgl-project/rbg v0.7.0), a role per server group
  and the router, each ``standalonePattern`` (one pod, replicas 1: pdctl runs each role on one host, and refuses the
  multi-node flags), the router's role ``dependencies`` naming every server role (it is created once they are ready:
  ``examples/basic/rbg/dependency/role-dependencies.yaml``). RBG names role R's pod ``NAME-R-0`` and gives it the
  headless Service ``s-NAME-R`` (``api/workloads/v1alpha2/helper.go`` ``GetServiceName``;
  ``pkg/reconciler/roleinstance/core/instance_core.go`` sets ``hostname``/``subdomain``), so a server is dialled at
  ``NAME-R-0.s-NAME-R``, as in RBG's own ``examples/inference/pd-disagg-standalone.yaml``.
* ``lws``: one ``LeaderWorkerSet`` (``leaderworkerset.x-k8s.io/v1``, kubernetes-sigs/lws v0.10.0) per server group,
  ``size: 1`` (the leader alone, from ``workerTemplate``), dialled at ``NAME-R-0.NAME-R`` (its shared headless Service:
  ``api/leaderworkerset/v1/leaderworkerset_types.go``, ``SubdomainShared``); the router is an ``apps/v1`` Deployment
  whose init containers wait for every server's ``/health`` with the same readiness gate the systemd units run
  (``pdctl.units.READINESS_GATE``): LWS has no ordering between sets.

What stays as on a GPU host: each container's command is the argv the units run (``pdctl.units.server_argv`` /
``router_argv`` on the launch :mod:`pdctl.statemachine.launch` builds), environment included, parsers on the servers
only. What changes, and why:

* GPUs are a count (``nvidia.com/gpu``); the device plugin picks them and the container sees them as 0..N-1, so the
  ids become ``0..N-1`` (``CUDA_VISIBLE_DEVICES`` likewise) and no NUMA binding is rendered. ``hosts.*.gpu_name``
  becomes a ``nvidia.com/gpu.product`` node selector (spelt as NVIDIA's GPU feature discovery writes it,
  NVIDIA/k8s-device-plugin v0.20.0 ``internal/lm/resource.go`` ``sanitise``), a host's address that is a host name
  (not loopback, not an IP) a ``kubernetes.io/hostname`` one.
* A server behind the router listens on ``0.0.0.0`` in its pod (its peers are other pods). Where the spec keeps it on
  loopback (only the host's own processes reach it), a NetworkPolicy admits only the deployment's own pods. The entry
  point (the router, or a single server without one) keeps the spec's exposure: loopback stays loopback in its pod
  (``kubectl port-forward`` reaches it, nothing else) with no Service; every interface becomes a ClusterIP Service.
  An address of a host's own (``10.0.0.5``) has no meaning in a pod and is refused.
* Readiness probes are the proofs' endpoints: servers ``/health``, the router ``/readiness`` (never its ``/health``);
  a loopback listener is probed from inside the pod by the units' readiness gate (the kubelet dials the pod IP).
* ``[secrets]``, and environment variables whose name says secret, are ``secretKeyRef``s to one Secret,
  ``NAME-secrets``, never values; ``pdctl export`` says which keys it needs.
* ``engine.python`` unset is ``python3`` and ``router.executable`` unset is ``smg``, found on the image's PATH (on a
  host: pdctl's own interpreter, smg beside it). ``service_user`` is the image's or a securityContext's business:
  dropped.
* With ``[kernels]`` enabled, an init container builds and verifies them on the pod's GPUs (the ``kernels_built``
  step's command; it exits non-zero when verification fails) into a volume the server then reads.

The record: a ConfigMap ``NAME-pdctl`` (``pdctl-record.json``, JSON so that pdctl reads it back without a YAML parser)
holds the topology exported, in the terms the plan compares on hosts (spec addresses, roles, TP…), with the GPU ids as
the pods see them, secrets as their references, the router's workers and the KV bootstrap at their cluster addresses,
and the sha256 of every manifest written beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.statemachine import launch
from pdctl.statemachine.errors import PdctlError, SpecError, TopologyNotConfirmed
from pdctl.statemachine.k8s_yaml import dump
from pdctl.statemachine.plan import Plan, make_plan
from pdctl.statemachine.spec import Deployment, load_spec
from pdctl.statemachine.topology import Topology, dial_host, is_wildcard, topology_of
from pdctl.units import MARKER, READINESS_GATE, is_pdctl_unit, router_argv, router_env, server_argv, server_env

__all__ = [
    "FORMATS",
    "LWS_API",
    "RBG_API",
    "RECORD_FILE",
    "Export",
    "Record",
    "Written",
    "cluster_topology",
    "edited",
    "export",
    "export_spec",
    "load",
    "plan_from",
    "plan_spec",
    "probe_topology",
    "read_record",
    "write",
]

FORMATS = ("rbg", "lws")
RBG_API = "workloads.x-k8s.io/v1alpha2"
"""sgl-project/rbg v0.7.0 (its storage version; v1alpha1 is deprecated from v0.8)."""
LWS_API = "leaderworkerset.x-k8s.io/v1"
"""kubernetes-sigs/lws v0.10.0."""
RECORD_FILE = "pdctl-record.json"

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_GATE_S = 3600
"""How long the router's init gate waits for a server without ``expected_cold_start_s`` (the units' start bound)."""


@dataclass(frozen=True)
class Export:
    """One export: ``objects`` (file name → the Kubernetes object written there) and ``files`` (file name → its bytes
    as text), in the order written; the record's ``topology``; the Secret the pods reference and its keys; notes for
    the operator (what the export does not cover for this spec)."""

    name: str
    format: str
    objects: dict[str, dict[str, Any]]
    files: dict[str, str]
    topology: Topology
    secret: str
    secret_keys: tuple[str, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Record:
    """What a folder's ``pdctl-record.json`` says: the export's format, topology and manifests' digests."""

    path: Path
    format: str
    topology: Topology
    manifests: dict[str, str] = field(default_factory=dict)


# --- the spec as pods see it -----------------------------------------------------------------------


def load(path: str | os.PathLike[str]) -> tuple[Deployment, list]:
    """Read *path* and check pdctl's rules for Kubernetes: ``(deployment, warnings)``. The rules are the hosts' but
    one: roles on several ``[hosts.*]`` are refused on hosts (pdctl drives one machine per deployment) and are what a
    cluster schedules. Raises :class:`SpecError` (every error found). Contacts no host: an ``inventory = "discover"``
    host keeps what the spec declares."""
    from pdctl.statemachine.rules import validate

    dep = load_spec(path)
    found = [f for f in validate(dep) if f.field != "hosts"]
    errors = [f for f in found if f.level == "error"]
    if errors:
        body = "\n  ".join(f"{f.field}: {f.message}\n    fix: {f.fix}" for f in errors)
        raise SpecError(f"spec {dep.name!r} breaks {len(errors)} rule(s):\n  {body}", findings=found, path=str(path))
    return dep, [f for f in found if f.level == "warning"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


def _refuse(field_: str, message: str, fix: str) -> SpecError:
    return SpecError(f"{field_}: {message}: {fix}", findings=[(field_, message, fix)])


def _pod_bind(host: str, field_: str, *, entry: bool) -> str:
    """Where a listener binds in its pod: see the module docstring."""
    if is_wildcard(host):
        return "0.0.0.0"
    if _loopback(host):
        return host if entry and host != "localhost" else ("127.0.0.1" if entry else "0.0.0.0")
    raise _refuse(field_, f"{host!r} is an address of a host, which no pod has",
                  "write 127.0.0.1 (on Kubernetes: reached only by the deployment's own pods, or by `kubectl "
                  "port-forward` for the entry point) or 0.0.0.0 (a Service, for the entry point)")


def _check_names(dep: Deployment, fmt: str) -> None:
    """The names Kubernetes derives from the deployment's and roles' names must be DNS labels (RFC 1035, at most 63)."""
    if not _DNS1035.fullmatch(dep.name):
        raise _refuse("name", f"{dep.name!r} cannot name Kubernetes objects and DNS records",
                      "use lower-case letters, digits and '-', starting with a letter (e.g. 'dsv4-flash')")
    roles = [n for n, _k, _r in dep.roles()] + (["router"] if dep.router else [])
    for r in roles:
        longest = f"s-{dep.name}-{r}" if fmt == "rbg" else f"{dep.name}-{r}-0"
        if len(longest) > 63:
            raise _refuse("name", f"{longest!r} ({len(longest)} characters) is longer than a DNS label's 63",
                          "give the deployment (or the role) a shorter name")


def _view(dep: Deployment) -> Deployment:
    """*dep* as the pods run it, before the bind addresses: GPU ids 0..N-1, no NUMA facts, no service user, the
    interpreter and router on the image's PATH where the spec leaves them to pdctl's machine, and the kernels' cache
    dir fixed where it would be this machine's home."""

    def role(r):  # noqa: ANN001, ANN202
        return r.model_copy(update={"gpus": list(range(len(r.gpus))), "numa_node": None})

    engine = dep.engine.model_copy(update={
        "python": dep.engine.python or "python3",
        "cache_dir": dep.engine.cache_dir or ("/var/cache/sglang" if dep.kernels.enabled else None)})
    router = (dep.router.model_copy(update={"executable": dep.router.executable or "smg"})
              if dep.router is not None else None)
    return dep.model_copy(update={
        "prefill": [role(r) for r in dep.prefill], "decode": [role(r) for r in dep.decode],
        "server": [role(r) for r in dep.server],
        "hosts": {k: h.model_copy(update={"gpu_numa": None, "numa_cpus": None}) for k, h in dep.hosts.items()},
        "engine": engine, "router": router, "service_user": None})


def _bound(view: Deployment) -> Deployment:
    """*view* with the bind addresses the pods use (:func:`_pod_bind`)."""
    update: dict[str, Any] = {}
    for group in ("prefill", "decode", "server"):
        update[group] = [r.model_copy(update={"http_host": _pod_bind(r.http_host, f"{group}[{i}].http_host",
                                                                     entry=view.router is None)})
                         for i, r in enumerate(getattr(view, group))]
    if view.router is not None:
        update["router"] = view.router.model_copy(update={
            "host": _pod_bind(view.router.host, "router.host", entry=True),
            "prometheus_host": _pod_bind(view.router.prometheus_host, "router.prometheus_host", entry=True)})
    return view.model_copy(update=update)


# --- addresses -------------------------------------------------------------------------------------------


def _dns(fmt: str, name: str, role: str) -> str:
    """The cluster DNS name (within the namespace) of role *role*'s one pod."""
    return f"{name}-{role}-0.s-{name}-{role}" if fmt == "rbg" else f"{name}-{role}-0.{name}-{role}"


def _secret_name(name: str) -> str:
    return f"{name}-secrets"


def _ref(name: str, key: str) -> str:
    return f"secretKeyRef:{_secret_name(name)}/{key}"


def _env_refs(env: dict, name: str) -> dict:
    """*env* with the value of each variable whose name says secret replaced by its Secret reference."""
    plain, secret = launch.split_secrets(dict(env))
    return {k: (_ref(name, k) if k in secret else v) for k, v in env.items()}


def cluster_topology(dep: Deployment, fmt: str, *, image: str | None = None,
                     router_image: str | None = None) -> Topology:
    """The topology an export of *dep* records (see the module docstring): what ``plan --target k8s`` compares."""
    if fmt not in FORMATS:
        raise PdctlError(f"format {fmt!r}: pdctl exports {' or '.join(FORMATS)}", hint="give --format rbg or lws")
    view = _view(dep)
    topo = topology_of(view)
    name = dep.name

    def url(role: str, port: int) -> str:
        return f"http://{_dns(fmt, name, role)}:{port}"

    def settings(s: dict) -> dict:
        s = dict(s)
        if "env" in s:
            s["env"] = _env_refs(s["env"], name)
        if "secrets" in s:
            s["secrets"] = {k: _ref(name, k) for k in s["secrets"]}
        return s

    roles = tuple(r.model_copy(update={"settings": settings(r.settings)}) for r in topo.roles)
    engine = dict(topo.deployment["engine"])
    engine["env"] = _env_refs(engine.get("env") or {}, name)
    deployment = {**topo.deployment, "engine": engine,
                  "secrets": {k: _ref(name, k) for k in topo.deployment.get("secrets", {})},
                  "kubernetes": {"format": fmt, "image": image}}
    kv = topo.kv_link
    if kv is not None:
        kv = kv.model_copy(update={"bootstrap": tuple((n, _dns(fmt, name, n), p) for n, _h, p in kv.bootstrap)})
    router = topo.router
    if router is not None:
        # (the router's lists follow the roles' order, kind by kind: topology_of builds them so)
        pre, dec, reg = (topo.roles_of(k) for k in ("prefill", "decode", "server"))
        router = router.model_copy(update={
            "prefill": tuple((url(r.name, r.port), p) for r, (_u, p) in zip(pre, router.prefill, strict=True)),
            "decode": tuple(url(r.name, r.port) for r in dec),
            "regular": tuple(url(r.name, r.port) for r in reg),
            "settings": {**settings(router.settings),
                         "kubernetes": {"format": fmt, "image": router_image or image}}})
    return topo.model_copy(update={"roles": roles, "kv_link": kv, "router": router, "deployment": deployment})


def probe_topology(record: Topology) -> Topology:
    """*record* with every role and the router at its cluster address (``http_host`` its pod's DNS name, the router
    ``NAME-router``): the addresses ``pdctl verify --target k8s`` maps to the endpoints it is given, one per role."""
    fmt = (record.deployment.get("kubernetes") or {}).get("format", "rbg")
    roles = tuple(r.model_copy(update={"http_host": _dns(fmt, record.name, r.name)}) for r in record.roles)
    router = record.router.model_copy(update={"host": f"{record.name}-router"}) if record.router else None
    return record.model_copy(update={"roles": roles, "router": router})


# --- manifests -----------------------------------------------------------------------------------------


def _labels(name: str, component: str, app: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": app, "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "pdctl"}


def _lit(s: str) -> str:
    """*s* as a container's command or env value that Kubernetes hands over unchanged: ``$`` doubled, since it
    expands ``$(VAR)`` there and reads ``$$`` as ``$``."""
    return s.replace("$", "$$")


def _env(plain: dict[str, str], secret: list[str], name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": k, "value": _lit(v)} for k, v in plain.items()]
    out += [{"name": k, "valueFrom": {"secretKeyRef": {"name": _secret_name(name), "key": k}}} for k in secret]
    return out


def _split(env: dict[str, str], scoped: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``(plain env, secret variable names)``, as ``launch.services_for`` splits a unit's environment."""
    plain, secret = launch.split_secrets(env)
    names = sorted(set(secret) | set(scoped))
    return {k: v for k, v in plain.items() if k not in names}, names


def _gpu_product(gpu_name: str) -> str:
    """``nvidia.com/gpu.product`` as GPU feature discovery writes it: characters outside ``A-Za-z0-9-_.`` and space
    dropped, runs of spaces joined by '-' (NVIDIA/k8s-device-plugin v0.20.0, ``internal/lm/resource.go``)."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", gpu_name).split())


def _node_selector(dep: Deployment, host_key: str | None, *, gpus: bool) -> tuple[dict[str, str], list[str]]:
    host = dep.hosts.get(host_key) if host_key else None
    sel: dict[str, str] = {}
    notes: list[str] = []
    if host is None:
        return sel, notes
    if gpus and host.gpu_name:
        product = _gpu_product(host.gpu_name)
        if len(product) <= 63 and _LABEL_VALUE.fullmatch(product):
            sel["nvidia.com/gpu.product"] = product
        else:
            notes.append(f"hosts.{host_key}.gpu_name {host.gpu_name!r} is no node label value: no GPU model selector")
    addr = host.address
    try:
        ipaddress.ip_address(addr)
        is_ip = True
    except ValueError:
        is_ip = False
    if not is_ip and not _loopback(addr):
        if len(addr) <= 63 and _LABEL_VALUE.fullmatch(addr):
            sel["kubernetes.io/hostname"] = addr
    return sel, notes


def _http_probe(path: str, port: int, period: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": 3}


def _gate_probe(python: str, url: str, period: int) -> dict[str, Any]:
    """A loopback listener's readiness: the units' gate, run in the container (one try: exit 0 on a 2xx)."""
    return {"exec": {"command": [_lit(python), "-c", _lit(READINESS_GATE), _lit(url), "1"]},
            "periodSeconds": period, "timeoutSeconds": 10, "failureThreshold": 3}


def _probe(bind: str, port: int, path: str, python: str, period: int) -> dict[str, Any]:
    if _loopback(bind):
        return _gate_probe(python, f"http://{dial_host(bind)}:{port}{path}", period)
    return _http_probe(path, port, period)


def _server_pod(dep: Deployment, run: Deployment, name: str, kind: str, image: str,
                notes: list[str]) -> dict[str, Any]:
    role = next(r for n, _k, r in run.roles() if n == name)
    s = launch.launch_for_role(run, name)
    plain, secret = _split(server_env(s), dep.secrets_for(name))  # type: ignore[arg-type]
    ports = [{"name": "http", "containerPort": role.port, "protocol": "TCP"}]
    if s.bootstrap_port is not None and kind == "prefill":  # type: ignore[union-attr]
        ports.append({"name": "bootstrap", "containerPort": s.bootstrap_port,  # type: ignore[union-attr]
                      "protocol": "TCP"})
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    gpus = {"nvidia.com/gpu": len(role.gpus)}
    container: dict[str, Any] = {
        "name": "sglang",
        "image": image,
        "command": [_lit(w) for w in server_argv(s)],  # type: ignore[arg-type]
        "env": _env(plain, secret, dep.name),
        "ports": ports,
        "readinessProbe": _probe(role.http_host, role.port, "/health", launch.python_for(run), 10),
        "resources": {"limits": gpus},
        "volumeMounts": mounts,
    }
    if run.kv_transfer is not None and run.kv_transfer.backend in ("nixl", "mooncake", "mori") and kind != "server":
        # the units' LimitMEMLOCK=infinity for RDMA registration: in a container, the capability to lock memory
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    spec: dict[str, Any] = {}
    if run.kernels.enabled:
        from pdctl.statemachine.service import kernels_build_command

        cmd, _manifest = kernels_build_command(run)
        cache = launch._cache_dir(run)
        mounts.append({"name": "kernels", "mountPath": cache})
        volumes.append({"name": "kernels", "emptyDir": {}})
        spec["initContainers"] = [{
            "name": "kernels-built", "image": image, "command": [_lit(w) for w in cmd],
            "env": _env(plain, [], dep.name), "resources": {"limits": gpus},
            "volumeMounts": [{"name": "kernels", "mountPath": cache}]}]
    selector, said = _node_selector(dep, role.host, gpus=True)
    notes += said
    if selector:
        spec["nodeSelector"] = selector
    spec.update({"terminationGracePeriodSeconds": 120, "containers": [container], "volumes": volumes})
    return {"metadata": {"labels": _labels(dep.name, name, "sglang")}, "spec": spec}


def _router_pod(dep: Deployment, run: Deployment, fmt: str, image: str, engine_image: str, *,
                gates: bool) -> dict[str, Any]:
    assert run.router is not None
    # (router_launch resolves a relative executable on this machine's PATH: any absolute path passes, the image's
    # is put back below; the workers are their pods' cluster addresses, not the host's)
    exe = run.router.executable if dep.router_impl == "smg" else launch.python_for(run)
    r = launch.router_launch(run.model_copy(update={"router": run.router.model_copy(update={"executable": "/"})}))
    assert r is not None
    roles = {n: (k, ro) for n, k, ro in run.roles()}

    def urls(kind: str) -> list[str]:  # (router_launch lists each kind's roles in their order)
        return [f"http://{_dns(fmt, dep.name, n)}:{ro.port}" for n, (k, ro) in roles.items() if k == kind]

    r = dataclasses.replace(r, executable=exe or r.executable,
                            prefill=tuple(zip(urls("prefill"), (p for _u, p in r.prefill), strict=True)),
                            decode=tuple(urls("decode")), workers=tuple(urls("server")))
    plain, secret = _split(router_env(r), dep.secrets_for("router"))
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "command": [_lit(w) for w in router_argv(r)],
        "env": _env(plain, secret, dep.name),
        "ports": [{"name": "http", "containerPort": run.router.port, "protocol": "TCP"}],
        "readinessProbe": _probe(run.router.host, run.router.port, "/readiness", launch.python_for(run), 5),
    }
    if not _loopback(run.router.prometheus_host):  # (a port only the pod itself reaches is not declared)
        container["ports"].append({"name": "metrics", "containerPort": run.router.prometheus_port, "protocol": "TCP"})
    if not container["env"]:
        del container["env"]
    spec: dict[str, Any] = {}
    if gates:
        python = launch.python_for(run)
        spec["initContainers"] = [{
            "name": f"{n}-ready", "image": engine_image,
            "command": [_lit(python), "-c", _lit(READINESS_GATE),
                        f"http://{_dns(fmt, dep.name, n)}:{ro.port}/health",
                        str(int(2 * ro.expected_cold_start_s) if ro.expected_cold_start_s else _GATE_S)]}
            for n, (_k, ro) in roles.items()]
    selector, _ = _node_selector(dep, dep.router.on if dep.router else None, gpus=False)
    if selector:
        spec["nodeSelector"] = selector
    spec.update({"terminationGracePeriodSeconds": 210, "containers": [container]})
    return {"metadata": {"labels": _labels(dep.name, "router", dep.router_impl)}, "spec": spec}


def _service(dep: Deployment, role: str, port: int, app: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{dep.name}-{role}", "labels": _labels(dep.name, role, app)},
            "spec": {"type": "ClusterIP",
                     "selector": {"app.kubernetes.io/instance": dep.name, "app.kubernetes.io/component": role},
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def _network_policy(dep: Deployment, roles: list[str]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{dep.name}-servers", "labels": _labels(dep.name, "servers", "sglang")},
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": dep.name},
                                     "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                           "values": roles}]},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {
                         "matchLabels": {"app.kubernetes.io/instance": dep.name}}}]}]}}


def _header(dep: Deployment, fmt: str, what: str) -> str:
    return (f"{MARKER[2:]} {what} of deployment {dep.name} (pdctl export k8s --format {fmt})\n"
            "written by pdctl from the spec: edit the spec and export again, not this file")


def export(dep: Deployment, *, fmt: str, image: str, router_image: str | None = None) -> Export:
    """The manifests of *dep* (validated by :func:`load`) in format *fmt* (``rbg`` or ``lws``), the servers run from
    *image*, the router from *router_image* (default: *image*, which holds smg beside SGLang as the seed's venv does).
    Pure and deterministic. Raises :class:`SpecError` for what a pod cannot take (a host's own address, a name that
    is no DNS label)."""
    if fmt not in FORMATS:
        raise PdctlError(f"format {fmt!r}: pdctl exports {' or '.join(FORMATS)}", hint="give --format rbg or lws")
    if not image or any(c.isspace() for c in image):
        raise PdctlError(f"image {image!r}: give the container image that holds engine.python and SGLang",
                         hint="--image REGISTRY/NAME:TAG")
    _check_names(dep, fmt)
    view = _view(dep)
    run = _bound(view)
    router_image = router_image or image
    notes: list[str] = []
    name = dep.name
    servers = [(n, k) for n, k, _r in run.roles()]
    pods = {n: _server_pod(dep, run, n, k, image, notes) for n, k in servers}
    objects: dict[str, dict[str, Any]] = {}
    headers: dict[str, str] = {}
    router_pod = None
    if run.router is not None:
        router_pod = _router_pod(dep, run, fmt, router_image, image, gates=fmt == "lws")
    if fmt == "rbg":
        roles = [{"name": n, "replicas": 1, "standalonePattern": {"template": pods[n]}} for n, _k in servers]
        if router_pod is not None:
            roles.append({"name": "router", "replicas": 1, "dependencies": [n for n, _k in servers],
                          "standalonePattern": {"template": router_pod}})
        objects["rolebasedgroup.yaml"] = {
            "apiVersion": RBG_API, "kind": "RoleBasedGroup",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/instance": name,
                                                  "app.kubernetes.io/managed-by": "pdctl"}},
            "spec": {"roles": roles}}
        headers["rolebasedgroup.yaml"] = "RoleBasedGroup"
    else:
        for n, _k in servers:
            file = f"leaderworkerset-{n}.yaml"
            objects[file] = {
                "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
                "metadata": {"name": f"{name}-{n}", "labels": _labels(name, n, "sglang")},
                "spec": {"replicas": 1, "startupPolicy": "LeaderCreated",
                         "leaderWorkerTemplate": {"size": 1, "workerTemplate": pods[n]}}}
            headers[file] = f"LeaderWorkerSet of role {n}"
        if router_pod is not None:
            objects["deployment-router.yaml"] = {
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": f"{name}-router", "labels": _labels(name, "router", dep.router_impl)},
                "spec": {"replicas": 1,
                         "selector": {"matchLabels": {"app.kubernetes.io/instance": name,
                                                      "app.kubernetes.io/component": "router"}},
                         "template": router_pod}}
            headers["deployment-router.yaml"] = "Deployment of the router"
    # the entry point's exposure: a Service only where the spec listens on every interface
    if dep.router is not None:
        if is_wildcard(dep.router.host):
            objects["service-router.yaml"] = _service(dep, "router", dep.router.port, dep.router_impl)
            headers["service-router.yaml"] = "Service exposing the router (router.host listens on every interface)"
    else:
        for n, _k, r in dep.roles():
            if is_wildcard(r.http_host):
                objects[f"service-{n}.yaml"] = _service(dep, n, r.port, "sglang")
                headers[f"service-{n}.yaml"] = f"Service exposing {n} (its http_host listens on every interface)"
    hidden = [n for n, _k, r in dep.roles() if dep.router is not None and _loopback(r.http_host)]
    if hidden:
        objects["networkpolicy-servers.yaml"] = _network_policy(dep, hidden)
        headers["networkpolicy-servers.yaml"] = ("NetworkPolicy: the servers the spec keeps on loopback admit only "
                                                 "this deployment's pods")
    files = {f: dump(o, header=_header(dep, fmt, headers[f])) for f, o in objects.items()}
    topo = cluster_topology(dep, fmt, image=image, router_image=router_image)
    keys = sorted({e["name"] for o in objects.values() for e in _containers_env(o)
                   if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]})
    record = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{name}-pdctl", "labels": _labels(name, "pdctl-record", "pdctl")},
        "data": {"format": fmt,
                 "manifests.json": json.dumps({f: _digest(t) for f, t in files.items()}, indent=1, sort_keys=True),
                 "topology.json": json.dumps(topo.model_dump(mode="json"), indent=1, sort_keys=True)}}
    objects[RECORD_FILE] = record
    files[RECORD_FILE] = json.dumps(record, indent=1) + "\n"
    if view.kv_transfer is not None and view.kv_transfer.backend in ("nixl", "mooncake", "mori"):
        notes.append(f"kv_transfer.backend {view.kv_transfer.backend!r} moves the KV cache over RDMA: the server pods "
                     "need the NICs (an RDMA device plugin's resource, or hostNetwork), which the export does not add")
    if dep.service_user is not None:
        notes.append(f"service_user {dep.service_user!r} is left out: the image's USER (or a securityContext) says "
                     "whom the containers run as")
    return Export(name=name, format=fmt, objects=objects, files=files, topology=topo, secret=_secret_name(name),
                  secret_keys=tuple(keys), notes=tuple(dict.fromkeys(notes)))


def _containers_env(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every env entry of every container and init container in *obj* (found wherever a pod spec sits)."""
    out: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in ("containers", "initContainers"):
                for c in node.get(k, []) if isinstance(node.get(k), list) else []:
                    out.extend(c.get("env", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(obj)
    return out


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# --- a folder of exports -------------------------------------------------------------------------------


def read_record(folder: str | os.PathLike[str]) -> Record | None:
    """The record of the export in *folder* (None: no ``pdctl-record.json`` there). It may also be the ConfigMap as
    the cluster holds it (``kubectl get configmap NAME-pdctl -o json > DIR/pdctl-record.json``). Raises
    :class:`PdctlError` for a record that cannot be read."""
    path = Path(folder) / RECORD_FILE
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        data = obj["data"]
        return Record(path=path, format=data["format"],
                      topology=Topology.model_validate_json(data["topology.json"]),
                      manifests=json.loads(data.get("manifests.json") or "{}"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PdctlError(f"{path}: not a pdctl export record ({type(exc).__name__}: {exc})",
                         hint="give the folder `pdctl export k8s` wrote, or the ConfigMap NAME-pdctl from the "
                              "cluster as JSON in it") from None


def edited(folder: str | os.PathLike[str], record: Record) -> list[str]:
    """What in *folder* differs from the manifests its record lists: each file edited or missing, in words."""
    out = []
    for f, digest in sorted(record.manifests.items()):
        p = Path(folder) / f
        if not p.exists():
            out.append(f"{f} is not in {folder}")
        elif _digest(p.read_text(encoding="utf-8", errors="replace")) != digest:
            out.append(f"{f} was edited since pdctl exported it")
    return out


def plan_from(dep: Deployment, folder: str | os.PathLike[str], *, fmt: str | None = None, image: str | None = None,
              router_image: str | None = None) -> tuple[Plan, list[str]]:
    """The plan from the export in *folder* to an export of *dep*: ``(plan, notes)``, the notes saying what in the
    folder differs from its record. *fmt* and the images default to the folder's. Raises :class:`PdctlError` when
    the folder holds no export or another deployment's."""
    record = read_record(folder)
    if record is None:
        raise PdctlError(f"{folder}: no pdctl export here (no {RECORD_FILE})",
                         hint="give the folder an earlier `pdctl export k8s SPEC -o DIR` wrote")
    old = record.topology
    if old.name != dep.name:
        raise PdctlError(f"{folder} holds the export of deployment {old.name!r}, not of {dep.name!r}",
                         hint="give the folder of this deployment's export (a deployment is known by its name)")
    k8s_old = old.deployment.get("kubernetes") or {}
    router_old = ((old.router.settings.get("kubernetes") or {}) if old.router else {})
    fmt = fmt or record.format
    image = image or k8s_old.get("image")
    if router_image is None and router_old.get("image") != k8s_old.get("image"):
        router_image = router_old.get("image")
    _check_names(dep, fmt)
    new = cluster_topology(dep, fmt, image=image, router_image=router_image)
    return make_plan(old, new), edited(folder, record)


def write(exp: Export, folder: str | os.PathLike[str], *, confirm: str | None = None) -> tuple[list[Path], list[Path],
                                                                                               Plan]:
    """Write *exp* into *folder* (created if missing): ``(written, removed, plan)``. The plan is from the export
    already there (a first export: from nothing); a topology change to an earlier export is refused
    (:class:`TopologyNotConfirmed`, nothing written) unless *confirm* is the plan's id, as ``apply`` refuses it on
    hosts.
    Files an earlier export wrote that this one does not (the router's Service once it is on loopback) are removed, so
    that ``kubectl apply -f DIR`` applies exactly this export. A file pdctl did not write is never overwritten
    (:class:`PdctlError`) nor removed."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise PdctlError(f"{out} is not a folder: nothing was written", hint="give -o a folder path, e.g. -o ./k8s")
    record = read_record(out) if out.is_dir() else None
    if record is not None and record.topology.name != exp.name:
        raise PdctlError(f"{out} holds the export of deployment {record.topology.name!r}: nothing was written",
                         hint=f"give {exp.name!r} a folder of its own")
    plan = make_plan(record.topology if record else None, exp.topology)
    if record is not None and plan.requires_confirmation and confirm != plan.plan_id:
        words = "; ".join(plan.topology_changes) or "the topology changes"
        given = f" (--confirm-topology {confirm} names another plan)" if confirm else ""
        refused = TopologyNotConfirmed(
            f"the export in {out} has another topology: {words}; nothing was written{given}", plan_id=plan.plan_id,
            hint=f"review the plan, then export again with --confirm-topology {plan.plan_id}")
        refused.plan = plan  # type: ignore[attr-defined]  # (the CLI prints it, as apply prints its refused plan)
        raise refused
    ours: dict[str, Path] = {}
    if out.is_dir():
        for p in sorted(out.iterdir()):
            if p.is_file() and p.suffix in (".yaml", ".yml"):
                if is_pdctl_unit(p.read_bytes()[:64]):
                    ours[p.name] = p
                elif p.name in exp.files:
                    raise PdctlError(f"{p} exists and was not written by pdctl: nothing was written",
                                     hint="give -o another folder, or move that file aside")
    out.mkdir(parents=True, exist_ok=True)
    from pdctl.statemachine.journal import atomic_write

    written = []
    for f, text in exp.files.items():
        atomic_write(out / f, text.encode())
        written.append(out / f)
    removed = []
    for f, p in ours.items():
        if f not in exp.files:
            p.unlink()
            removed.append(p)
    return written, removed, plan


# --- front doors (the CLI parses, calls one of these, renders) -----------------------------------------


@dataclass(frozen=True)
class Written:
    """What :func:`export_spec` did: the export, the files written and removed, the plan from the export that was
    in the folder, the spec's rule warnings, and what the objects were validated against (or why not)."""

    export: Export
    written: list[Path]
    removed: list[Path]
    plan: Plan
    warnings: list
    validated: list[str] | None
    not_validated: str | None = None


def export_spec(path: str | os.PathLike[str], *, fmt: str, image: str, out: str | os.PathLike[str],
                router_image: str | None = None, confirm: str | None = None) -> Written:
    """Load the spec at *path* (:func:`load`), export it (:func:`export`), validate the objects when the ``k8s`` extra
    is installed (:func:`pdctl.statemachine.k8s_validate.validate`; a problem is an error, nothing written) and
    :func:`write` them into *out*."""
    from pdctl.statemachine import k8s_validate

    dep, warnings = load(path)
    exp = export(dep, fmt=fmt, image=image, router_image=router_image)
    validated: list[str] | None = None
    why = None
    try:
        validated = k8s_validate.against()
    except PdctlError as exc:
        why = f"{exc.message} ({exc.hint})"
    if validated is not None:
        problems = k8s_validate.validate(exp.objects)
        if problems:
            raise PdctlError("the export does not validate (a pdctl bug: please report it with the spec); nothing was "
                             "written:\n  " + "\n  ".join(problems))
    written, removed, plan = write(exp, out, confirm=confirm)
    return Written(exp, written, removed, plan, warnings, validated, why)


def plan_spec(path: str | os.PathLike[str], folder: str | os.PathLike[str], *, fmt: str | None = None,
              image: str | None = None, router_image: str | None = None) -> tuple[Plan, list[str], list]:
    """``pdctl plan SPEC --target k8s --from DIR``: ``(plan, notes, warnings)`` (:func:`plan_from`)."""
    dep, warnings = load(path)
    plan, notes = plan_from(dep, folder, fmt=fmt, image=image, router_image=router_image)
    return plan, notes, warnings

