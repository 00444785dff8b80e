"""Topology: what a spec deploys, resolved into roles, GPUs, NUMA nodes, ports and links.

A :class:`Topology` is derived from a validated :class:`~pdctl.statemachine.spec.Deployment` and
is what the journal records as *deployed* and what the plan compares. It is a frozen pydantic
model so it round-trips through JSON unchanged (``Topology.model_validate_json``).

Every attribute belongs to one change class (see :mod:`pdctl.statemachine.plan`): the shape
(roles, hosts, GPU sets, parallel sizes, NUMA nodes, the transfer backend, the router's exposure)
is *topology*; what a role runs with (model, parsers, ports, env, flags) is *disruptive*; console
settings are *in place*. Secrets appear only as a fingerprint (``scrypt:…``, :func:`_fingerprint`), never in clear.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from pdctl.statemachine.spec import Deployment, ServerRole, secret_value

__all__ = ["KVLink", "RoleTopology", "RouterTopology", "Topology", "dial_host", "is_wildcard", "topology_of",
           "url_host"]


def is_wildcard(host: str) -> bool:
    """Whether a bind address listens on every interface: ``0.0.0.0``, ``::`` or the IPv4-mapped ``::ffff:0.0.0.0``,
    however written (:mod:`ipaddress`: the unspecified address). A host name is not."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def dial_host(bind: str) -> str:
    """Where a server bound to *bind* is dialled from its own host, as a URL's host part: ``::`` → ``[::1]``
    (uvicorn, SGLang's default HTTP server, binds it through asyncio's ``create_server``, which sets
    ``IPV6_V6ONLY``: 127.0.0.1 would not reach it; ``[::1]`` reaches a dual-stack socket too), any other wildcard (``0.0.0.0``, ``::ffff:0.0.0.0``) → 127.0.0.1, else *bind*
    itself (:func:`url_host`)."""
    if bind == "" or not is_wildcard(bind):
        return "127.0.0.1" if bind == "" else url_host(bind)
    return "[::1]" if ipaddress.ip_address(bind.strip("[]")) == ipaddress.IPv6Address("::") else "127.0.0.1"


def url_host(host: str) -> str:
    """*host* as the host part of a URL: an IPv6 literal in brackets (RFC 3986 §3.2.2, ``http://[::1]:30001``),
    anything else as it is. The spec writes IPv6 bare, as SGLang's and smg's ``--host`` take it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _key_sorted(value: Any) -> Any:
    """*value* with every mapping's keys in sorted order, as the journal writes them (``sort_keys``): a topology
    read back from the journal and one derived from a spec then print alike (``plan --json``)."""
    if isinstance(value, dict):
        return {k: _key_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_key_sorted(v) for v in value]
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleTopology(_Frozen):
    """One SGLang server as deployed. ``kind`` is prefill, decode or server (single, non-PD)."""

    name: str
    kind: Literal["prefill", "decode", "server"]
    host: str
    address: str
    gpus: tuple[int, ...]
    numa_node: int | None
    tp: int
    attn_dp: int
    ep: int
    http_host: str
    port: int
    bootstrap_port: int | None
    nccl_port: int | None
    settings: dict[str, Any]
    """What the server runs with (model, page size, kv-cache dtype, parsers, env, flags…)."""

    _sorted_settings = field_validator("settings")(_key_sorted)

    @property
    def url(self) -> str:
        """The server's HTTP base URL as dialled on its own host (``http://127.0.0.1:30010``), where its peers run:
        pdctl drives one host per deployment, so the router, the decode side and pdctl's probes (over an SSH forward
        for a remote host, :mod:`pdctl.statemachine.ssh`) all reach a wildcard bind through loopback
        (:func:`dial_host`: ``::`` through ``[::1]``, which the host's name or IPv4 address would not reach)."""
        return f"http://{dial_host(self.http_host)}:{self.port}"

    @property
    def served_model(self) -> str:
        """The model name the server serves, which the router registers its worker under: ``--served-model-name``,
        else the model path (SGLang's default for ``served_model_name``; smg takes ``served_model_name``, then
        ``model_path``)."""
        model = self.settings.get("model") or {}
        return str(model.get("served_name") or model.get("path") or "")

    def describe(self) -> str:
        gpus = ",".join(str(g) for g in self.gpus)
        numa = f", NUMA {self.numa_node}" if self.numa_node is not None else ""
        dp = f" attn-DP{self.attn_dp}" if self.attn_dp > 1 else ""
        return f"{self.kind} on {self.host}, GPUs {gpus}, TP{self.tp}{dp}{numa}, {url_host(self.http_host)}:{self.port}"


class KVLink(_Frozen):
    """The KV transfer between prefill and decode."""

    backend: str
    ib_device: str | None
    ucx_net_devices: str | None
    bootstrap: tuple[tuple[str, str, int], ...]
    """``(prefill role, host the decode side dials, bootstrap port)`` per prefill group."""


class RouterTopology(_Frozen):
    """The router in front: its exposure (host:port) and the workers it routes to."""

    impl: str
    on: str
    host: str
    port: int
    prefill: tuple[tuple[str, int | None], ...]
    """``(URL, bootstrap port)`` per prefill worker, as given to ``--prefill``."""
    decode: tuple[str, ...]
    regular: tuple[str, ...]
    settings: dict[str, Any]

    _sorted_settings = field_validator("settings")(_key_sorted)

    @property
    def exposure(self) -> str:
        return f"{url_host(self.host)}:{self.port}"

    @property
    def url(self) -> str:
        """The router's base URL as dialled on its own host (bound everywhere: through loopback, :func:`dial_host`)."""
        return f"http://{dial_host(self.host)}:{self.port}"


class Topology(_Frozen):
    """A deployment's resolved shape. ``mode`` is ``pd`` or ``single``."""

    name: str
    mode: Literal["pd", "single"]
    roles: tuple[RoleTopology, ...]
    kv_link: KVLink | None
    router: RouterTopology | None
    deployment: dict[str, Any]
    """Deployment-wide settings that restart every serving role when changed."""
    in_place: dict[str, Any]
    """Settings that change nothing on any host (console refresh…)."""

    _sorted_settings = field_validator("deployment", "in_place")(_key_sorted)

    def role(self, name: str) -> RoleTopology:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(name)

    def roles_of(self, kind: str) -> list[RoleTopology]:
        return [r for r in self.roles if r.kind == kind]

    def entry_points(self) -> tuple[str, ...]:
        """Where clients reach the deployment, in words: the router (``router on 127.0.0.1:30001``) or, without
        one, each single server (``server 'server' on 0.0.0.0:30001 (every interface)``). Prefill and decode
        behind a router are not entry points."""
        if self.router is not None:
            return (f"router on {_where(self.router.host, self.router.port)}",)
        return tuple(f"{r.kind} {r.name!r} on {_where(r.http_host, r.port)}" for r in self.roles if r.kind == "server")


def _where(host: str, port: int) -> str:
    # host:port in words, with the one fact an operator must not miss: a wildcard bind listens on every interface.
    return f"{url_host(host)}:{port}" + (" (every interface)" if is_wildcard(host) else "")


@functools.lru_cache(maxsize=256)
def _fingerprint(value: str, salt: str) -> str:
    """What plans, journals and ``plan -o`` files hold of a secret: enough to see it rotate, not to recover it. scrypt
    (RFC 7914; N = 2^14, r = 8: ~16 MiB and tens of ms a guess) salted with the deployment and the key, so a short
    token cannot be looked up or brute-forced at hash speed the way its SHA-256 prefix could."""
    digest = hashlib.scrypt(value.encode(), salt=f"pdctl secret {salt}".encode(), n=2**14, r=8, p=1, dklen=16)
    return "scrypt:" + digest.hex()


def _secret_now(reference: str) -> str:
    """The value the units get for a ``[secrets]`` entry (an ``env:NAME`` read where pdctl runs); unset: the reference
    itself, which apply then refuses by name."""
    got = secret_value(reference, os.environ)
    return reference if got is None else got


def with_legacy_secrets_bridged(recorded: Topology, dep: Deployment) -> Topology:
    """*recorded* (a journal's topology) with each secret fingerprint an older pdctl wrote (``sha256:`` and 16 hex
    digits of the value's SHA-256) that matches the value *dep* gives the secret now replaced by today's
    :func:`_fingerprint`: an unchanged secret is not taken for a rotation (which would restart every role) after an
    upgrade; one whose value changed keeps the old record and is planned as the rotation it is."""
    old = recorded.deployment.get("secrets") or {}
    if not any(str(v).startswith("sha256:") for v in old.values()):
        return recorded
    new = dict(old)
    for k, v in old.items():
        if k in dep.secrets and str(v).startswith("sha256:"):
            value = _secret_now(dep.secret_refs()[k])
            if v == "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:16]:
                new[k] = _fingerprint(value, f"{dep.name}/{k}")
    return recorded.model_copy(update={"deployment": {**recorded.deployment, "secrets": new}})


def numa_binding(dep: Deployment, role: ServerRole) -> tuple[int | None, str | None]:
    """``(NUMA node, CPU list)`` a role's unit binds to (``NUMAMask=`` / ``CPUAffinity=``): its ``numa_node``, else
    the one node all its GPUs sit on (``hosts.<h>.gpu_numa``); the CPU list from ``hosts.<h>.numa_cpus``. None:
    unknown (nothing rendered)."""
    host = dep.hosts.get(role.host)
    node = role_node(role.numa_node, role.gpus, host.gpu_numa if host is not None else None)
    cpus = host.numa_cpus.get(node) if (node is not None and host is not None and host.numa_cpus) else None
    return node, cpus


def role_node(numa_node: int | None, gpus: list[int], gpu_numa: list[int] | tuple[int, ...] | None) -> int | None:
    """The NUMA node a role binds to: ``numa_node`` if set, else the one node all its GPUs sit on per ``gpu_numa``
    (declared or discovered); None when unknown, split over nodes, or -1 (sysfs: the GPU reports no node)."""
    if numa_node is not None or not gpu_numa:
        return numa_node
    nodes = {gpu_numa[g] for g in gpus if g < len(gpu_numa)}
    if len(nodes) == 1 and gpus and all(g < len(gpu_numa) for g in gpus):
        node = nodes.pop()
        return node if node >= 0 else None
    return None


def topology_of(dep: Deployment) -> Topology:
    """Resolve *dep* (already validated) into its :class:`Topology`."""
    model = dep.model.model_dump()
    # a secret's fingerprint (scrypt, tens of ms) once per key: the value the units get, so a rotation restarts those
    # that get it: every role and the router for a plain entry (deployment-wide), the roles it names for a table
    refs = dep.secret_refs()
    fingerprint = {k: _fingerprint(_secret_now(v), f"{dep.name}/{k}") for k, v in sorted(refs.items())}

    def scoped_secrets(role_name: str) -> dict[str, dict[str, str]]:
        got = {k: fingerprint[k] for k in sorted(dep.secrets_for(role_name)) if dep.secret_scoped(k)}
        return {"secrets": got} if got else {}  # (absent when none: a spec without scoped secrets records as before)

    roles: list[RoleTopology] = []
    for name, kind, r in dep.roles():
        host = dep.hosts.get(r.host)
        address = host.address if host else r.host
        settings = {
            "model": {
                **model,
                "page_size": r.page_size if r.page_size is not None else model["page_size"],
                "kv_cache_dtype": r.kv_cache_dtype if r.kv_cache_dtype is not None else model["kv_cache_dtype"],
            },
            "parsers": (r.parsers or dep.parsers).model_dump(),
            "mem_fraction": r.mem_fraction,
            "env": dict(sorted(r.env.items())),
            "extra_args": list(r.extra_args),
            "expected_cold_start_s": r.expected_cold_start_s,
            # what the unit binds to: changing gpu_numa or numa_cpus re-renders it and restarts the role
            "numa_binding": dict(zip(("node", "cpus"), numa_binding(dep, r))),
            **scoped_secrets(name),
        }
        roles.append(
            RoleTopology(
                name=name,
                kind=kind,  # type: ignore[arg-type]
                host=r.host,
                address=address,
                gpus=tuple(r.gpus),
                numa_node=r.numa_node,
                tp=r.tp,
                attn_dp=r.attn_dp,
                ep=r.ep,
                http_host=r.http_host,
                port=r.port,
                bootstrap_port=(r.bootstrap_port or 8998) if kind == "prefill" else r.bootstrap_port,
                nccl_port=r.nccl_port,
                settings=settings,
            )
        )
    kv = None
    if dep.is_pd and dep.kv_transfer is not None:
        kv = KVLink(
            backend=dep.kv_transfer.backend,
            ib_device=dep.kv_transfer.ib_device,
            ucx_net_devices=dep.kv_transfer.ucx_net_devices,
            bootstrap=tuple(
                (r.name, r.url.split("//", 1)[1].rsplit(":", 1)[0], r.bootstrap_port or 8998)
                for r in roles
                if r.kind == "prefill"
            ),
        )
    router = None
    if dep.router is not None:
        rt = dep.router
        router = RouterTopology(
            impl=dep.router_impl,
            on=rt.on or (roles[0].host if roles else "local"),
            host=rt.host,
            port=rt.port,
            prefill=tuple((r.url, r.bootstrap_port) for r in roles if r.kind == "prefill"),
            decode=tuple(r.url for r in roles if r.kind == "decode"),
            regular=tuple(r.url for r in roles if r.kind == "server"),
            settings={
                "policy": rt.policy,
                "prometheus_host": rt.prometheus_host,
                "prometheus_port": rt.prometheus_port,
                "worker_startup_timeout_s": rt.worker_startup_timeout_s,
                "health_check_interval_s": rt.health_check_interval_s,
                "health_check_timeout_s": rt.health_check_timeout_s,
                "health_failure_threshold": rt.health_failure_threshold,
                "health_success_threshold": rt.health_success_threshold,
                "executable": rt.executable,
                "extra_args": list(rt.extra_args),
                "env": dict(sorted(rt.env.items())),
                **scoped_secrets("router"),
            },
        )
    deployment = {
        "sglang_version": dep.sglang_version,
        "service_manager": dep.service_manager,
        # (only where set: a deployment recorded before the field plans no change)
        **({"service_user": dep.service_user} if dep.service_user is not None else {}),
        "engine": dep.engine.model_dump(),
        "kernels": dep.kernels.model_dump(),
        # the value the units get: a rotated secret restarts the roles
        "secrets": {k: fp for k, fp in fingerprint.items() if not dep.secret_scoped(k)},
        # where each host is; how pdctl reaches it (ssh_user, ssh_port, keys) changes no running process
        "hosts": {k: {"address": h.address} for k, h in sorted(dep.hosts.items())},
    }
    return Topology(
        name=dep.name,
        mode="pd" if dep.is_pd else "single",
        roles=tuple(roles),
        kv_link=kv,
        router=router,
        deployment=deployment,
        in_place={"console": dep.console.model_dump()},
    )
