"""From the spec to what a service manager runs: the adapter between ``Deployment`` and
``pdctl.units`` (which imports nothing of pdctl and takes its own small frozen types).

Decisions taken here, each once:

* **Names.** ``pdctl-<name>-<role>.service`` for every server role (role names from
  :meth:`Deployment.roles`), ``pdctl-<name>-router.service``, ``pdctl-<name>.target``.
* **Bootstrap port.** A prefill always passes ``--disaggregation-bootstrap-port`` (its own, or
  SGLang's default 8998 written out), and the router's ``--prefill URL PORT`` names the same port.
  A decode passes one only where its role sets it (the fallback for a request without one; see
  :func:`_bootstrap_port`).
* **NUMA.** ``numa_node`` from the role, else the one NUMA node all its GPUs sit on
  (``hosts.<h>.gpu_numa``); CPU list from ``hosts.<h>.numa_cpus`` (no list → no ``CPUAffinity=``).
* **Secrets.** Environment variables whose name says secret (``*TOKEN*``, ``*SECRET*``,
  ``*PASSWORD*``, ``*API_KEY*``, ``*CREDENTIAL*``) leave the unit and go to an ``EnvironmentFile=``
  written 0600 (system scope: ``/etc/pdctl/<name>/<role>.env``).
* **Memory lock.** ``LimitMEMLOCK=infinity`` for RDMA-capable transfer backends (nixl, mooncake,
  mori); not for ``mooncake_tcp``/``fake``.
* **Timeouts.** A server gets ``TimeoutStartSec`` = 2 × ``expected_cold_start_s`` (3600 s when
  unknown), stop 120 s, restart after 10 s, at most 3 starts per 3 × (start timeout + 10 s) — so
  three failed cold starts in a row trip the limit however long a load takes. The router: start
  300 s (it starts after both servers are ready), stop 210 s (above smg's 180 s drain), restart
  after 1 s, 5 starts per 5 × 305 s.
* **Readiness.** Servers gate on ``/health`` (503 while loading), the router on ``/readiness``
  (503 until it has healthy workers; its ``/health`` is 200 even with none), each probed on the
  role's own host, wildcard bind addresses mapped to loopback.
* **Executables.** ``engine.launcher == "sim"`` runs ``python -m pdctl.sim`` with the very same
  flags; ``engine.python`` defaults to the interpreter running pdctl. The router is
  ``router.executable``, else ``smg`` next to that interpreter, else on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from pdctl.statemachine.errors import PdctlError
from pdctl.statemachine.hosts import Host as HostType
from pdctl.statemachine.sglang_facts import DEFAULT_SGLANG_VERSION, facts_for
from pdctl.statemachine.spec import Deployment, ServerRole, secret_value
from pdctl.statemachine.topology import dial_host, numa_binding, topology_of
from pdctl.units import (
    ForeignUnit,
    ProcessSupervisor,
    RouterLaunch,
    ServerLaunch,
    ServiceManager,
    ServiceSpec,
    SystemdManager,
    TargetSpec,
    UnitSet,
    is_pdctl_unit,
    render_env_file,
    router_argv,
    router_env,
    server_argv,
    server_env,
    unit_files,
)

__all__ = [
    "SGLANG_DEFAULT_BOOTSTRAP_PORT",
    "launch_for_role",
    "manager_for",
    "python_for",
    "router_executable",
    "router_launch",
    "router_unit_name",
    "scope_for",
    "services_for",
    "split_secrets",
    "target_name",
    "unit_name",
    "unit_set_for",
    "write_units",
]

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
_SECRET_KEY = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIAL", re.IGNORECASE)
_RDMA_BACKENDS = ("nixl", "mooncake", "mori")


def unit_name(dep: Deployment, role_name: str) -> str:
    return f"pdctl-{dep.name}-{role_name}.service"


def router_unit_name(dep: Deployment) -> str:
    return f"pdctl-{dep.name}-router.service"


def target_name(dep: Deployment) -> str:
    return f"pdctl-{dep.name}.target"


def scope_for(dep: Deployment) -> str:
    """``"system"``, ``"user"`` or ``"process"`` from ``service_manager``."""
    return {"systemd-system": "system", "systemd-user": "user"}.get(dep.service_manager, "process")


def python_for(dep: Deployment) -> str:
    return dep.engine.python or sys.executable


def router_executable(dep: Deployment) -> str:
    """Absolute path of the router executable (for ``sglang-router``: the engine's Python)."""
    if dep.router_impl == "sglang-router":
        return python_for(dep)
    exe = dep.router.executable if dep.router else None
    if exe:
        found = exe if exe.startswith("/") else shutil.which(exe)
        if found is None:
            raise PdctlError(f"router.executable: {exe!r} is not on PATH where pdctl runs ({os.environ.get('PATH', '')})",
                             hint="write its absolute path on the host, e.g. the venv's bin/smg")
        return found
    beside = Path(sys.executable).parent / "smg"
    if beside.exists():
        return str(beside)
    return shutil.which("smg") or str(beside)


def numa_for(dep: Deployment, role_name: str) -> tuple[int | None, str | None]:
    """``(NUMA node, CPU list)`` the spec asks for *role_name* — what ``NUMAMask=`` and
    ``CPUAffinity=`` render: the role's ``numa_node``, else the one node all its GPUs sit on
    (``hosts.<h>.gpu_numa``); the CPU list from ``hosts.<h>.numa_cpus`` (None: unknown)."""
    for name, _kind, role in dep.roles():
        if name == role_name:
            return numa_binding(dep, role)
    return None, None


def _cache_dir(dep: Deployment) -> str:
    if dep.engine.cache_dir:
        return dep.engine.cache_dir
    if scope_for(dep) == "system":
        return "/var/cache/sglang"
    return os.path.expanduser("~/.cache/sglang")


def _server_cache_dir(dep: Deployment) -> str | None:
    """The ``SGLANG_CACHE_DIR`` a server unit carries: ``engine.cache_dir``; the system scope's
    ``/var/cache/sglang``; with pdctl's kernels, the folder ``kernels_built`` writes them to (:func:`_cache_dir`).
    Else None, unset: SGLang's own default, ``~/.cache/sglang`` of the server's user on its host (SGLang 0.5.23
    ``srt/environ.py``, ``SGLANG_CACHE_DIR = EnvStr(os.path.expanduser("~/.cache/sglang"))``). pdctl wrote this
    machine's user's home there, which over SSH is another user's (or no) folder on the host, and which made the
    units differ, restarting every server, with whoever ran pdctl (``sudo`` against ``sudo -i``)."""
    if dep.engine.cache_dir or scope_for(dep) == "system" or dep.kernels.enabled:
        return _cache_dir(dep)
    return None


def _bootstrap_port(dep: Deployment, kind: str, role: ServerRole) -> int | None:
    """The ``--disaggregation-bootstrap-port`` a server gets: a prefill server's own (SGLang's 8998 unless set); a
    decode server's only where its role sets one. On decode the flag is only the fallback for a request whose
    ``bootstrap_port`` is null (``shared/reference/sglang-pd.md``), and the router pdctl renders names every prefill's
    port: derived from the prefill groups, it changed decode's command line (a restart, a model reload) whenever a
    prefill group was added or removed."""
    if role.bootstrap_port is not None:
        return role.bootstrap_port
    if kind == "prefill":
        return SGLANG_DEFAULT_BOOTSTRAP_PORT
    return None


def split_secrets(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(plain, secret)`` by variable name (see the module docstring)."""
    plain = {k: v for k, v in env.items() if not _SECRET_KEY.search(k)}
    secret = {k: v for k, v in env.items() if _SECRET_KEY.search(k)}
    return plain, secret


def _server_launch(dep: Deployment, kind: str, role: ServerRole) -> ServerLaunch:
    parsers = role.parsers or dep.parsers
    try:  # how the target release spells what differs between releases (an unknown one: the rules refuse it)
        facts = facts_for(dep.sglang_version)
    except KeyError:
        facts = facts_for(DEFAULT_SGLANG_VERSION)
    node, cpus = numa_binding(dep, role)  # as the plan records it
    kv = dep.kv_transfer
    pd = kind in ("prefill", "decode")
    return ServerLaunch(
        kind="single" if kind == "server" else kind,  # type: ignore[arg-type]
        model_path=dep.model.path,
        http_port=role.port,
        python=python_for(dep),
        module="pdctl.sim" if dep.engine.launcher == "sim" else "sglang.launch_server",
        http_host=role.http_host,
        served_name=dep.model.served_name,
        context_length=dep.model.context_length,
        page_size=role.page_size if role.page_size is not None else dep.model.page_size,
        kv_cache_dtype=role.kv_cache_dtype if role.kv_cache_dtype is not None else dep.model.kv_cache_dtype,
        trust_remote_code=dep.model.trust_remote_code,
        load_format=dep.model.load_format,
        attention_backend=dep.model.attention_backend,
        dsa_prefill_backend=dep.model.dsa_prefill_backend,
        dsa_decode_backend=dep.model.dsa_decode_backend,
        tp=role.tp,
        attn_dp=role.attn_dp,
        ep=role.ep,
        bootstrap_port=_bootstrap_port(dep, kind, role) if pd else None,
        nccl_port=role.nccl_port,
        transfer_backend=kv.backend if (kv and pd) else None,
        ib_device=kv.ib_device if (kv and pd) else None,
        ucx_net_devices=kv.ucx_net_devices if (kv and pd) else None,
        mem_fraction=role.mem_fraction,
        reasoning_parser=parsers.reasoning_parser,
        tool_call_parser=parsers.tool_call_parser,
        chat_template=parsers.chat_template,
        gpu_ids=tuple(role.gpus),
        numa_node=node,
        numa_cpus=cpus,
        cache_dir=_server_cache_dir(dep),
        env={**dep.engine.env, **kernels_env(dep, kind), **role.env},
        extra_args=tuple(role.extra_args),
        sparse_attention_prefix=facts.sparse_attention_prefix,  # type: ignore[arg-type]
        legacy_dp_attention=facts.legacy_dp_attention,
    )


def kernels_env(dep: Deployment, kind: str) -> dict[str, str]:
    """The environment that turns pdctl's SGLang plugin on for a serving role when the spec
    enables the kernels (``pdctl.kernels.sglang_plugin``, entry point ``pdctl_kernels``): the
    plugin name, the directory ``kernels_built`` wrote the manifest and Triton binaries into, and
    ``PDCTL_KERNELS_REQUIRED=1`` so that a refused activation stops the server instead of
    silently serving on SGLang's own kernels."""
    if not dep.kernels.enabled or kind not in ("prefill", "decode", "server"):
        return {}
    cache = _cache_dir(dep)
    routes = [r for r, k in (("decode", "sparse_mla_decode"), ("indexer", "lightning_indexer")) if k in dep.kernels.which]
    return {
        "SGLANG_PLUGINS": "pdctl_kernels",
        "PDCTL_KERNELS_DIR": cache,
        "PDCTL_KERNELS_ROUTE": ",".join(routes),
        "PDCTL_KERNELS_REQUIRED": "1",
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
    }


def resolve_secrets(dep: Deployment, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``[secrets]`` with ``env:NAME`` values read from pdctl's environment. Raises :class:`PdctlError` naming each
    ``secrets.KEY`` whose variable is unset or whose value is empty (it went out as an empty value: a model download
    failing much later; a CI system expands a missing secret to an empty string)."""
    environ = os.environ if environ is None else environ
    out = {}
    unset = []
    empty = []
    for k, v in dep.secret_refs().items():
        value = secret_value(v, environ)
        if value is None:
            unset.append(f"secrets.{k} = {v!r}")
        elif not value:
            empty.append(f"secrets.{k} = {v!r}")
        else:
            out[k] = value
    if empty:
        raise PdctlError(f"{'; '.join(empty)}: the value is empty; nothing was changed",
                         hint="give the secret its value (a CI system's missing secret arrives as an empty string), "
                              "or remove the key from [secrets]")
    if unset:
        names = " ".join(sorted({x.split("'env:", 1)[1].rstrip("'") for x in unset}))
        raise PdctlError(f"{'; '.join(unset)}: not set in pdctl's environment; nothing was changed",
                        hint=f"export {names} where pdctl runs (the value is written 0600 for the units only)")
    return out


def router_launch(dep: Deployment) -> RouterLaunch | None:
    """The router's launch, or None when the spec has no ``[router]``."""
    r = dep.router
    if r is None:
        return None
    # The workers' URLs as the topology derives them (RoleTopology.url): what the router proof compares /workers with.
    url = {r.name: r.url for r in topology_of(dep).roles}
    prefill = tuple((url[name], _bootstrap_port(dep, "prefill", role)) for name, kind, role in dep.roles()
                    if kind == "prefill")
    decode = tuple(url[name] for name, kind, _r in dep.roles() if kind == "decode")
    workers = tuple(url[name] for name, kind, _r in dep.roles() if kind == "server")
    return RouterLaunch(
        executable=router_executable(dep),
        impl=dep.router_impl,
        prefill=prefill,  # type: ignore[arg-type]
        decode=decode,
        workers=workers,
        host=r.host,
        port=r.port,
        policy=r.policy,
        prometheus_host=r.prometheus_host,
        prometheus_port=r.prometheus_port,
        health_check_interval_s=r.health_check_interval_s,
        health_check_timeout_s=r.health_check_timeout_s,
        health_failure_threshold=r.health_failure_threshold,
        health_success_threshold=r.health_success_threshold,
        worker_startup_timeout_s=r.worker_startup_timeout_s,
        extra_args=tuple(r.extra_args),
        env=r.env,
    )


def launch_for_role(dep: Deployment, role_name: str) -> ServerLaunch | RouterLaunch:
    """The launch of one role by name (``"prefill"``, ``"decode-1"``, ``"router"``…)."""
    if role_name == "router":
        r = router_launch(dep)
        if r is None:
            raise KeyError(f"{dep.name} has no router")
        return r
    for name, kind, role in dep.roles():
        if name == role_name:
            return _server_launch(dep, kind, role)
    raise KeyError(f"{dep.name} has no role {role_name!r}; roles: {[n for n, _, _ in dep.roles()]}")


def _secrets_file(dep: Deployment, role_name: str, scope: str, state_dir: str | None) -> str:
    if scope == "system":
        return f"/etc/pdctl/{dep.name}/{role_name}.env"
    base = state_dir or os.path.expanduser(f"~/.config/pdctl/{dep.name}")
    return os.path.join(os.path.abspath(base), "secrets", f"{role_name}.env")


def services_for(
    dep: Deployment,
    *,
    scope: str | None = None,
    state_dir: str | Path | None = None,
    log_dir: str | Path | None = None,
) -> list[ServiceSpec]:
    """Every service of *dep*, servers in :meth:`Deployment.roles` order, the router last.

    *scope* (``"system"``, ``"user"``, ``"process"``; default from ``service_manager``) picks
    default paths (cache dir, secrets file). *state_dir* holds user/process-scope secrets files.
    *log_dir*: when given, each role appends its output to ``<log_dir>/<unit>.log`` instead of
    the journal (the test harness has no journald)."""
    scope = scope or scope_for(dep)
    sd = str(state_dir) if state_dir is not None else None
    target = target_name(dep)
    rdma = bool(dep.kv_transfer and dep.kv_transfer.backend in _RDMA_BACKENDS)
    out: list[ServiceSpec] = []
    resolved = resolve_secrets(dep)

    def logp(unit: str) -> str | None:
        return os.path.join(os.path.abspath(str(log_dir)), unit.removesuffix(".service") + ".log") if log_dir else None

    for role_name, kind, role in dep.roles():
        s = _server_launch(dep, kind, role)
        plain, secret = split_secrets(server_env(s))
        secret.update({k: resolved[k] for k in dep.secrets_for(role_name)})
        plain = {k: v for k, v in plain.items() if k not in secret}
        start = int(2 * role.expected_cold_start_s) if role.expected_cold_start_s else 3600
        name = unit_name(dep, role_name)
        host = s.http_host
        out.append(ServiceSpec(
            name=name,
            description=f"pdctl {dep.name} {role_name} (SGLang {s.kind} server)",
            argv=tuple(server_argv(s)),
            deployment=dep.name,
            role=role_name,
            env=plain,
            secrets=secret,
            secrets_file=_secrets_file(dep, role_name, scope, sd) if secret else None,
            numa_node=s.numa_node,
            cpu_affinity=s.numa_cpus,
            memlock_infinity=rdma and kind in ("prefill", "decode"),
            restart_sec=10,
            restart_prevent_exit_status=(2,),  # argparse refused the flags: a restart cannot fix that
            start_limit_burst=3,
            start_limit_interval_s=3 * (start + 10),
            timeout_start_s=start,
            timeout_stop_s=120,
            readiness_url=f"http://{dial_host(host)}:{role.port}/health",
            readiness_python=s.python,
            part_of=target,
            log_path=logp(name),
            user=dep.service_user,
        ))
    r = router_launch(dep)
    if r is not None:
        plain, secret = split_secrets(router_env(r))
        secret.update({k: resolved[k] for k in dep.secrets_for("router")})
        plain = {k: v for k, v in plain.items() if k not in secret}
        name = router_unit_name(dep)
        out.append(ServiceSpec(
            name=name,
            description=f"pdctl {dep.name} router ({dep.router_impl})",
            argv=tuple(router_argv(r)),
            deployment=dep.name,
            role="router",
            env=plain,
            secrets=secret,
            secrets_file=_secrets_file(dep, "router", scope, sd) if secret else None,
            restart_sec=1,  # the router holds no state and smg serves again ~1 s after its start: clients wait less
            restart_prevent_exit_status=(2,),  # smg's argparse refused the flags
            start_limit_burst=5,
            start_limit_interval_s=5 * (300 + 5),
            timeout_start_s=300,
            timeout_stop_s=210,
            readiness_url=f"http://{dial_host(r.host)}:{r.port}/readiness",
            readiness_python=python_for(dep),
            requires=tuple(unit_name(dep, n) for n, _, _ in dep.roles()),
            part_of=target,
            log_path=logp(name),
            user=dep.service_user,
        ))
    return out


def unit_set_for(
    dep: Deployment,
    *,
    scope: str | None = None,
    state_dir: str | Path | None = None,
    log_dir: str | Path | None = None,
) -> UnitSet:
    """:func:`services_for` plus the deployment's target, as one :class:`UnitSet` (what a
    :class:`~pdctl.units.ServiceManager` installs)."""
    services = services_for(dep, scope=scope, state_dir=state_dir, log_dir=log_dir)
    target = TargetSpec(name=target_name(dep), description=f"pdctl deployment {dep.name}",
                        deployment=dep.name, wants=tuple(s.name for s in services))
    return UnitSet(target=target, services=tuple(services))


def manager_for(
    dep: Deployment,
    host: HostType,
    *,
    state_dir: str | Path,
    unit_dir: str | None = None,
    systemctl: tuple[str, ...] = ("systemctl",),
    env: dict[str, str] | None = None,
) -> ServiceManager:
    """The service manager ``dep.service_manager`` names, acting on *host*.

    ``"systemd-system"`` → :class:`SystemdManager` (system scope), ``"systemd-user"`` → the same
    in user scope, ``"process"`` → :class:`ProcessSupervisor` keeping its state under
    ``<state_dir>/supervisor``, its watchdogs run by :func:`python_for` (``engine.python``, else pdctl's own).
    *unit_dir*, *systemctl* and *env* reach a systemd manager (tests point them at a private user manager)."""
    scope = scope_for(dep)
    if scope == "process":
        # (its watchdogs run with the engine's Python, which the host has: pdctl's own path here may not exist there)
        return ProcessSupervisor(host, state_dir=os.path.join(str(state_dir), "supervisor"), python=python_for(dep))
    return SystemdManager(host, scope=scope, unit_dir=unit_dir, systemctl=systemctl, env=env)


def write_units(dep: Deployment, out_dir: str | Path, *, state_dir: str | Path | None = None) -> list[Path]:
    """Write *dep*'s unit files (and its 0600 secrets files, if any) into *out_dir*; return the
    paths written. The units are those ``systemd-system`` would install (``systemd-user`` for a
    user-scope spec), with a user-scope spec's secrets file under *state_dir* as apply keeps it
    (its journal's directory). A file in *out_dir* that pdctl did not write is never overwritten
    (:class:`~pdctl.units.ForeignUnit`, nothing written)."""
    scope = "user" if dep.service_manager == "systemd-user" else "system"
    units = unit_set_for(dep, scope=scope, state_dir=state_dir)
    files = {name: (text, 0o644) for name, text in unit_files(units, scope=scope).items()}
    for s in units.services:
        if s.secrets and s.secrets_file:
            files[os.path.basename(s.secrets_file)] = (render_env_file(s.secrets, deployment=dep.name), 0o600)
    out = Path(out_dir)
    for name in files:
        p = out / name
        if p.exists() and not is_pdctl_unit(p.read_bytes()):
            raise ForeignUnit(f"{p} exists and was not written by pdctl: refusing to overwrite it", unit=name)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (text, mode) in files.items():
        p = out / name
        tmp = out / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
        written.append(p)
    return written
