"""The deployment spec: what an operator writes (TOML), as pydantic v2 models.

A spec describes one deployment: its hosts, the model, its serving roles and how they connect.
Two shapes are expressible:

* **PD disaggregation** — one or more ``[[prefill]]`` groups, one or more ``[[decode]]`` groups,
  a ``[kv_transfer]`` link between them and a ``[router]`` (smg) in front;
* **single server** — one or more ``[[server]]`` entries (SGLang's ``--disaggregation-mode null``),
  with or without a router. This is what a *collapsed* PD deployment looks like, and the plan
  names such a change as a topology change.

Every model forbids unknown keys (``extra="forbid"``) so a typo is an error naming the field,
never a silently ignored setting. Structural checks that need the whole spec live in
:mod:`pdctl.statemachine.rules`; this module only checks shapes and single fields.

``load_spec(path)`` reads TOML with :mod:`tomllib`; a syntax error becomes a :class:`SpecError`
whose message carries the line and column.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import re
import socket
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdctl.statemachine.errors import SpecError
from pdctl.statemachine.sglang_facts import DEFAULT_SGLANG_VERSION
from pdctl.units import cpu_list, env_name

__all__ = [
    "Deployment",
    "Engine",
    "Host",
    "KVTransfer",
    "Kernels",
    "Model",
    "Parsers",
    "Router",
    "ServerRole",
    "load_spec",
    "parse_spec",
]

# Numbers and switches are strict: TOML writes them bare, and lax parsing would take `port = true` as port 1 or
# `trust_remote_code = "no"` as False.
Int = Annotated[int, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an integer is still a number here; inf/nan are not
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]


def _node_key(key: Any) -> Any:
    # A numa_cpus key as TOML gives it (text): a NUMA node number written plainly ("0", "1"); "1.0", "+1", " 1" or
    # "01" (which would collide with "1") are refused rather than converted.
    if isinstance(key, str) and not re.fullmatch(r"0|[1-9][0-9]*", key):
        raise ValueError("not a NUMA node number")
    return key


# A CPU list in sysfs cpulist syntax (commas; spaces read as separators too), kept in the canonical comma form that
# the unit renderer and the supervisor read with the same function (pdctl.units.cpu_list); "" = a node without CPUs.
CpuList = Annotated[str, Field(strict=True), AfterValidator(cpu_list)]
EnvName = Annotated[str, AfterValidator(env_name)]  # a key of an env table: what Environment= and env files take
# Linux numbers NUMA nodes below MAX_NUMNODES = 2**CONFIG_NODES_SHIFT, at most 1024 (include/linux/numa.h).
NODE_MAX = 1023
NumaNode = Annotated[int, BeforeValidator(_node_key), Field(ge=0, le=NODE_MAX)]

# The field that holds the port of each address field (a port written into the address is moved there).
_PORT_FIELD = {"address": "ssh_port", "http_host": "port", "host": "port", "prometheus_host": "prometheus_port"}
# RFC 1123 §2.1 (after RFC 952): a host name label is letters, digits and '-', 1-63 characters, neither starting nor
# ending with '-'; the whole name at most 253 characters (255 octets on the wire, RFC 1035 §2.3.4).
_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
# ('_' too, which RFC 1123 leaves out: ~/.ssh/config aliases and container service names use it, and they resolve.)


def _address(v: str, info: ValidationInfo) -> str:
    """An address as SGLang's ``--host``, smg's ``--host`` / ``--prometheus-host`` and ssh take it: an IP literal
    (:mod:`ipaddress`; IPv6 written bare, ``::1``, as those flags take it: pdctl brackets it where it builds a URL)
    or an RFC 1123 host name (with '_' allowed). A port, a URL scheme, a user, brackets, a prefix length or spaces
    written into it are refused with what to write instead (they passed validation and failed only at apply). An IP
    literal is kept in its canonical form (``::0`` becomes ``::``)."""
    key = info.field_name or "address"
    port_field = _PORT_FIELD.get(key, "port")

    def split(host: str, port: str | int) -> str:
        return f'host and port are separate fields: write {key} = "{host}" and {port_field} = {port}'

    if v == "":
        raise FieldError("", "must not be empty", "write an IP address (127.0.0.1, ::1) or a host name")
    if any(c.isspace() for c in v):
        words = v.split()
        fix = f'write {key} = "{words[0]}"' if len(words) == 1 else "write one host name or IP address"
        raise FieldError("", f"{v!r} contains whitespace, which no address has", fix)
    if "://" in v:
        url = urllib.parse.urlsplit(v)
        host = url.hostname or "HOST"
        try:
            port = url.port
        except ValueError:
            port = None
        if port and (key != "address" or url.scheme == "ssh"):
            fix = split(host, port)
        elif port:  # a server's URL given as the host's address: its port is a role's, not ssh's
            fix = f'write address = "{host}" (the servers\' ports are each role\'s port)'
        else:
            fix = f'write {key} = "{host}"'
        raise FieldError("", f"{v!r} is a URL, not an address", f"{fix} (pdctl builds the URLs)")
    if "@" in v:
        user, _, host = v.rpartition("@")
        if key == "address":
            raise FieldError("", f"{v!r} includes a user", f'write address = "{host}" and ssh_user = "{user}"')
        raise FieldError("", f"{v!r} includes a user, which a bind address has not", f'write {key} = "{host}"')
    if v.startswith("["):
        m = re.fullmatch(r"\[([^\]]*)\](?::([0-9]+))?", v)
        if m and m.group(2):
            raise FieldError("", f"{v!r} includes a port", split(m.group(1), int(m.group(2))))
        inner = m.group(1) if m else v.strip("[]")
        raise FieldError("", f"{v!r} is in brackets", f'write an IPv6 address without brackets, {key} = "{inner}" '
                         "(pdctl adds them where it builds a URL)")
    if v == "*":
        raise FieldError("", f"{v!r} is no address", f'for every interface write {key} = "0.0.0.0" (IPv4) or "::" (IPv6)')
    if "/" in v:
        try:
            ip = ipaddress.ip_interface(v).ip
        except ValueError:
            raise FieldError("", f"{v!r} is neither an IP address nor a host name", "write one without '/'") from None
        raise FieldError("", f"{v!r} carries a prefix length, which an address has not", f'write {key} = "{ip}"')
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        pass
    else:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            # an IPv6-only socket (uvicorn's, smg's) cannot bind it (EINVAL), and ssh reaches the IPv4 form alike
            raise FieldError("", f"{v!r} is an IPv4 address written as IPv6", f'write {key} = "{ip.ipv4_mapped}"')
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id and not ip.is_link_local:
            # getaddrinfo refuses it ("Name or service not known"): the server would never start
            raise FieldError("", f"{v!r}: a zone (%{ip.scope_id}) belongs to a link-local address (fe80::/10) only",
                             f'write {key} = "{str(ip).split("%")[0]}"')
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id and key != "address":
            # a bind address ends up in the URLs the router, the decode side and pdctl dial, where a zone needs
            # RFC 6874's %25 escape that not every client takes: ssh (hosts.*.address) takes it as it is
            raise FieldError("", f"{v!r}: a link-local address with a zone cannot be dialled through the URLs built from "
                             f"{key}", f'bind a loopback, global or wildcard address instead, e.g. {key} = "::"')
        # the canonical form (::0 -> ::, 0:0:0:0:0:0:0:1 -> ::1), which the loopback and every-interface checks
        # compare against
        return str(ip)
    m = re.fullmatch(r"([^:]+):([0-9]+)", v)
    if m:
        raise FieldError("", f"{v!r} includes a port", split(m.group(1), int(m.group(2))))
    if ":" in v:
        raise FieldError("", f"{v!r} is not an IPv6 address", "write one as ip -6 addr prints it, e.g. ::1 or fe80::1")
    name = v.removesuffix(".")
    if re.fullmatch(r"[0-9.]+", name):  # RFC 1123 §2.1: a host name never has the dotted-decimal form
        try:
            ipaddress.IPv4Address(v)
        except ValueError as exc:
            raise FieldError("", f"{v!r} is not an IPv4 address ({exc})", "write four numbers 0-255, e.g. 127.0.0.1") \
                from None
    labels = name.split(".")
    if all(re.fullmatch(r"0[xX][0-9a-fA-F]+|[0-9]+", label) for label in labels):  # 0x7f000001, 0x7f.1: inet_aton's
        try:                                                                        # shorthands, not host names
            means = f" (inet_aton reads it as {ipaddress.IPv4Address(socket.inet_aton(name))})"
        except OSError:
            means = ""
        raise FieldError("", f"{v!r} is an IPv4 address in hexadecimal shorthand{means}, which not every resolver "
                         "and tool reads alike", "write four decimal numbers 0-255, e.g. 127.0.0.1")
    if len(labels) == 4 and sum(label.isdigit() for label in labels) == 3:  # 127.0.0.l, 10.O.0.1: a typo'd IPv4
        raise FieldError("", f"{v!r} looks like an IPv4 address with a typo in it (three of its four labels are "
                         "numbers)", "write four numbers 0-255, e.g. 127.0.0.1")
    if len(name) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        raise FieldError("", f"{v!r} is neither an IP address nor a host name",
                         "write a host name (RFC 1123): labels of letters, digits and '-' (and '_', which ssh aliases "
                         "and container names use) joined by '.', e.g. gpu1.example.com")
    return v


def secret_value(value: str, environ: Mapping[str, str]) -> str | None:
    """A ``[secrets]`` value as the units get it: ``env:NAME`` read from *environ* (None when unset), anything else
    as written."""
    return environ.get(value[4:]) if value.startswith("env:") else value


Address = Annotated[str, AfterValidator(_address)]
"""A host's address or a bind address: an IP literal (IPv6 bare) or an RFC 1123 host name (:func:`_address`)."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_ROLE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9\-]{0,31}$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")
"""An account name for ``User=`` and ``runuser -u``: systemd's strict "valid user name" (no dots, no numeric UID,
which ``runuser`` does not take)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Host(_Model):
    """A machine that runs roles. ``address`` "localhost" (or 127.0.0.1, ::1) means this machine, driven
    directly; any other address is reached over SSH (``pdctl.statemachine.ssh``), public-key login only."""

    address: Address = "localhost"
    ssh_user: str | None = None
    ssh_port: Port = 22
    ssh_identity: str | None = None
    """Private key file on the machine running pdctl; None: the SSH agent and ``~/.ssh/id_*``."""
    ssh_known_hosts: str | None = None
    """known_hosts file that must hold the host's key; None: ``~/.ssh/known_hosts``. Never trust-on-first-use."""
    connect: Literal["auto", "local", "ssh"] = "auto"
    """``auto``: directly for a loopback address, over SSH otherwise; ``ssh``: over SSH even to a loopback
    address (another account on this machine, or an sshd on loopback); ``local``: directly."""
    inventory: Literal["declared", "discover"] = "declared"
    """``declared``: trust ``gpu_numa``/``numa_cpus`` below (left out = unknown; an empty list or table declares
    no GPUs / no NUMA nodes);
    ``discover``: read the host's GPUs (nvidia-smi) and NUMA layout (sysfs) when planning or applying
    (``pdctl.statemachine.inventory``; ``pdctl validate`` never contacts hosts)."""
    gpu_name: str | None = None
    gpu_numa: list[Annotated[int, Field(strict=True, ge=-1, le=NODE_MAX)]] | None = None
    """NUMA node of each GPU, indexed by GPU id (``nvidia-smi`` order); -1: none reported (sysfs ``numa_node``).
    None: unknown."""
    numa_cpus: dict[NumaNode, CpuList] | None = None
    """CPU list of each NUMA node in sysfs ``cpulist`` syntax, e.g. ``{0 = "0-31,64-95"}``."""

    @property
    def is_local(self) -> bool:
        """Driven directly (no SSH)."""
        if self.connect != "auto":
            return self.connect == "local"
        return self.address in ("localhost", "127.0.0.1", "::1")


class Model(_Model):
    """The model every server loads. ``page_size`` and ``kv_cache_dtype`` must match on P and D."""

    path: str
    served_name: str | None = None
    context_length: Int | None = Field(default=None, ge=1, le=2**31 - 1)
    """Tokens; at most 2**31 − 1: SGLang 0.5.23 keeps each request's token slots in int32 tensors sized by it
    (``mem_cache/memory_pool.py`` ``ReqToTokenPool``)."""
    page_size: Int | None = Field(default=None, ge=1, le=2**31 - 1)
    kv_cache_dtype: Literal[
        "auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"
    ] = "auto"
    trust_remote_code: Bool = False
    attention_backend: str | None = None
    dsa_prefill_backend: str | None = None
    dsa_decode_backend: str | None = None
    load_format: str | None = None


class Parsers(_Model):
    """Reasoning parser, tool-call parser and chat template of the SGLang servers.

    Set once at the top level, they apply to every prefill, decode and single server. A role may
    restate them (``[prefill.parsers]``) but the rules refuse any difference between roles.
    """

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None


class ServerRole(_Model):
    """One SGLang server group: a prefill, a decode, or a single (non-PD) server.

    GPU ids are the host's physical ids; the launch exports ``CUDA_VISIBLE_DEVICES`` with them and
    passes ``--base-gpu-id 0`` (SGLang 0.5.23 ``--base-gpu-id`` counts inside the visible set).
    """

    name: str | None = None
    host: str = "local"
    gpus: list[Int] = Field(min_length=1)
    tp: Int = Field(default=1, ge=1)
    attn_dp: Int = Field(default=1, ge=1)
    ep: Int = Field(default=1, ge=1)
    numa_node: Int | None = Field(default=None, ge=0, le=NODE_MAX)
    http_host: Address = "127.0.0.1"
    port: Port
    bootstrap_port: Port | None = None
    nccl_port: Port | None = None
    mem_fraction: Float | None = Field(default=None, gt=0, le=1)
    env: dict[EnvName, str] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)
    parsers: Parsers | None = None
    """Restates the deployment's parsers for this role; any difference between roles is refused."""
    page_size: Int | None = Field(default=None, ge=1)
    """Override of ``model.page_size`` (must still match between prefill and decode)."""
    kv_cache_dtype: str | None = None
    """Override of ``model.kv_cache_dtype`` (must still match between prefill and decode)."""
    expected_cold_start_s: Float | None = Field(default=None, gt=0, le=2**31 - 2)
    """At most 2**31 − 2 s: the router's ``worker_startup_timeout_s`` (≤ 2**31 − 1) must be able to exceed it."""

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, v: list[int]) -> list[int]:
        if any(g < 0 for g in v):
            raise FieldError("", f"GPU ids are >= 0, not {min(v)}", "use the ids nvidia-smi lists (0, 1, …)")
        if len(set(v)) != len(v):
            raise FieldError("", f"GPU ids repeat in {v}", "list each GPU once")
        return v

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str | None) -> str | None:
        if v is not None and not _ROLE_NAME_RE.fullmatch(v):
            raise FieldError("", f"role name {v!r} cannot be part of a unit name",
                             "use lower-case letters, digits and '-', at most 32")
        return v


class KVTransfer(_Model):
    """The KV-cache link between prefill and decode (``--disaggregation-transfer-backend``)."""

    backend: Literal["nixl", "mooncake", "mooncake_tcp", "fake", "mori", "ascend"] = "nixl"
    ib_device: str | None = None
    """``--disaggregation-ib-device`` (``mlx5_0``, ``mlx5_0,mlx5_1`` or per-GPU JSON)."""
    ucx_net_devices: str | None = None
    """``UCX_NET_DEVICES`` for NIXL/UCX (wins over ib_device in SGLang 0.5.23)."""


class Router(_Model):
    """The router (smg) in front of the servers: the deployment's one exposed port."""

    on: str | None = None
    """Host key (in ``[hosts]``) the router runs on; default: the first prefill's host."""
    host: Address = "127.0.0.1"
    """Bind address: the deployment's exposure (``0.0.0.0`` = every interface)."""
    port: Port = 30001
    policy: str = "cache_aware"
    prometheus_host: Address = "127.0.0.1"
    prometheus_port: Port = 29000
    allow_public_prometheus: Bool = False
    # (at most 2**31 - 1: smg crashed converting 10**20 and left the router failed)
    worker_startup_timeout_s: Int = Field(default=1800, ge=1, le=2**31 - 1)
    health_check_interval_s: Int = Field(default=10, ge=1, le=2**31 - 1)
    health_check_timeout_s: Int = Field(default=5, ge=1, le=2**31 - 1)
    health_failure_threshold: Int = Field(default=3, ge=1, le=2**31 - 1)
    health_success_threshold: Int = Field(default=2, ge=1, le=2**31 - 1)
    executable: str | None = None
    """Path of the router executable (``smg``); default: found next to pdctl's Python or on PATH."""
    extra_args: list[str] = Field(default_factory=list)
    env: dict[EnvName, str] = Field(default_factory=dict)
    # Present only so that the rules can refuse them with a clear message: parsers belong on the
    # SGLang servers, never on the router (in HTTP mode the router is a proxy).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None


class Kernels(_Model):
    """pdctl's Triton kernels, built and verified on the target GPUs before any server starts."""

    enabled: Bool = False
    which: list[Literal["sparse_mla_decode", "lightning_indexer"]] = Field(
        default_factory=lambda: ["sparse_mla_decode", "lightning_indexer"]
    )


class Engine(_Model):
    """Which executable runs the SGLang servers.

    ``launcher = "sglang"`` runs ``PYTHON -m sglang.launch_server``; ``"sim"`` runs pdctl's engine
    stand-in ``PYTHON -m pdctl.sim`` with the very same flags. ``python`` defaults to the
    interpreter running pdctl.
    """

    launcher: Literal["sglang", "sim"] = "sglang"
    python: str | None = None
    cache_dir: str | None = None
    """``SGLANG_CACHE_DIR`` (also where kernels are built). Unset: ``/var/cache/sglang`` under systemd-system;
    in the user and process scopes SGLang's own default, the server user's ``~/.cache/sglang`` on its host (with
    ``[kernels]`` enabled, pdctl's user's, where the kernels are built)."""
    env: dict[EnvName, str] = Field(default_factory=dict)


class Secret(_Model):
    """A ``[secrets]`` entry given only to some roles: ``HF_TOKEN = { value = "env:HF_TOKEN", roles = ["prefill",
    "decode"] }``. A plain string (``HF_TOKEN = "env:HF_TOKEN"``) goes to every role and the router."""

    value: str
    """As a plain entry's value: ``env:NAME`` (read from pdctl's environment at apply time) or the value itself."""
    roles: list[str] = Field(min_length=1)
    """Who gets it: role names (``prefill``, ``decode-1``…, ``router``), or a kind (``prefill``, ``decode``,
    ``server``) for every role of it."""


# a plain string, or a table: chosen by the value's shape, so that a finding names one of them, not both (the tags are
# left out of findings' field paths, _loc)
_SECRET_TAGS = ("secret-text", "secret-table")
SecretEntry = Annotated[
    Annotated[str, Tag(_SECRET_TAGS[0])] | Annotated[Secret, Tag(_SECRET_TAGS[1])],
    Discriminator(lambda v: _SECRET_TAGS[1] if isinstance(v, (dict, Secret)) else _SECRET_TAGS[0]),
]


class Console(_Model):
    """Console, status and telemetry settings (in place: changing them restarts nothing)."""

    refresh_s: Float = Field(default=1.0, gt=0, le=3600)
    canary: Bool = True
    """Send a canary through the router (one token of ``/generate``) in ``status`` (each refresh of ``--watch``) and
    every ``canary_interval_s`` in the console: a failed one makes the deployment not healthy, saying what clients
    get."""
    canary_interval_s: Float = Field(default=2.0, gt=0, le=3600)
    canary_timeout_s: Float = Field(default=5.0, gt=0, le=600)


class Deployment(_Model):
    """A whole deployment: the root of a spec file."""

    name: str
    sglang_version: str = DEFAULT_SGLANG_VERSION
    router_impl: Literal["smg", "sglang-router"] = "smg"
    service_manager: Literal["systemd-system", "systemd-user", "process"] = "process"
    service_user: str | None = None
    """The account every role and the router run as (the units' ``User=``: its UID, groups and ``HOME``; the process
    supervisor switches to it the same way), with pdctl run as root; None: the manager's own account (root for
    ``systemd-system``). Not with ``systemd-user``. The kernels' build runs as it too (``runuser -u``), so that the
    cache the servers extend is theirs. Apply checks that it exists on the host and can bind the spec's ports; it must
    also be able to read the model and write ``engine.cache_dir`` and its ``HOME`` (the Hugging Face cache)."""
    hosts: dict[str, Host] = Field(default_factory=lambda: {"local": Host()})
    engine: Engine = Field(default_factory=Engine)
    model: Model
    prefill: list[ServerRole] = Field(default_factory=list)
    decode: list[ServerRole] = Field(default_factory=list)
    server: list[ServerRole] = Field(default_factory=list)
    kv_transfer: KVTransfer | None = None
    router: Router | None = None
    parsers: Parsers = Field(default_factory=Parsers)
    kernels: Kernels = Field(default_factory=Kernels)
    console: Console = Field(default_factory=Console)
    secrets: dict[EnvName, SecretEntry] = Field(default_factory=dict)
    """Environment secrets (``HF_TOKEN``, the router's API key…). A value ``env:NAME`` is read from
    pdctl's own environment at apply time. They reach processes only through an
    ``EnvironmentFile=`` written 0600 and show as ``***`` in plans, journals and logs. A plain value goes to every
    role and the router; a :class:`Secret` table (``{ value = …, roles = […] }``) only to the roles it names."""

    def secret_refs(self) -> dict[str, str]:
        """Every ``[secrets]`` key with its reference (``env:NAME`` or the value as written), whoever gets it."""
        return {k: v if isinstance(v, str) else v.value for k, v in self.secrets.items()}

    def secret_scoped(self, key: str) -> bool:
        """Whether ``secrets.<key>`` names the roles that get it (otherwise every role and the router do)."""
        return not isinstance(self.secrets[key], str)

    def secrets_for(self, role_name: str) -> dict[str, str]:
        """The ``[secrets]`` keys (with their references) that role *role_name* (``"router"`` for the router) gets."""
        kinds = {name: kind for name, kind, _r in self.roles()}
        kinds["router"] = "router"
        out = {}
        for k, v in self.secrets.items():
            if isinstance(v, str):
                out[k] = v
            elif role_name in v.roles or kinds.get(role_name) in v.roles:
                out[k] = v.value
        return out

    @field_validator("service_user")
    @classmethod
    def _user_name(cls, v: str | None) -> str | None:
        if v is not None and not _USER_RE.fullmatch(v):
            raise FieldError("", f"{v!r} is not an account name for the units' User= (a login name, not a UID)",
                             "write the account's name as `id -un` prints it on the host (letters, digits, '_', "
                             "'-', starting with a letter or '_', at most 32), or leave service_user unset for root")
        return v

    @field_validator("name")
    @classmethod
    def _name_is_unit_safe(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise FieldError(
                "", f"{v!r} cannot become a systemd unit name (pdctl-{v}-prefill.service)",
                "use letters, digits, '_', '.' and '-', starting with a letter or digit, at most 64 characters",
            )
        return v

    @model_validator(mode="after")
    def _shape(self) -> Deployment:
        pd = bool(self.prefill or self.decode)
        if pd and self.server:
            raise FieldError("server", "a spec is either PD ([[prefill]] + [[decode]]) or single-server ([[server]]), "
                                       "not both", "remove [[server]], or the [[prefill]] and [[decode]] groups")
        if not pd and not self.server:
            raise FieldError("server", "no serving role", "add [[prefill]] and [[decode]] groups, or a [[server]]")
        if pd and (not self.prefill or not self.decode):
            missing = "decode" if self.prefill else "prefill"
            raise FieldError(missing, "PD disaggregation needs both prefill and decode groups; there is no "
                                      f"[[{missing}]]", f"add [[{missing}]]")
        return self

    @property
    def is_pd(self) -> bool:
        return bool(self.prefill)

    def roles(self) -> list[tuple[str, str, ServerRole]]:
        """``(role_name, kind, role)`` for every server, names defaulted and unique.

        Default names, by position: ``prefill``/``decode``/``server`` for the first group, ``prefill-1``,
        ``prefill-2``… after it, so that adding a group at the end (or removing the last one) renames no running
        role (a role's name is its unit's); give ``name`` to keep a name when a group before it is removed.
        """
        return [(name, kind, role) for name, kind, role, _where in self._named_roles()]

    def _named_roles(self) -> list[tuple[str, str, ServerRole, str]]:
        """:meth:`roles` with where each name comes from (``prefill[1].name``, or ``prefill[1]`` for a default)."""
        out = []
        for kind, group in (("prefill", self.prefill), ("decode", self.decode), ("server", self.server)):
            for i, role in enumerate(group):
                name = role.name or (kind if i == 0 else f"{kind}-{i}")
                out.append((name, kind, role, f"{kind}[{i}]" + (".name" if role.name else "")))
        return out

    @model_validator(mode="after")
    def _role_names_unique(self) -> Deployment:
        # (a role's name is its unit's, pdctl-<deployment>-<name>.service: two alike made one unit of two roles, and
        # "router" is the router's)
        seen: dict[str, str] = {}
        for name, _kind, role, where in self._named_roles():
            said = f"{where} = {name!r}" if role.name else f"{where} (named {name!r} by its position)"
            field = where if role.name else f"{where}.name"
            this = repr(name) if role.name else f"unset, so the role is named {name!r} by its position, which"
            if name == "router":
                raise FieldError(field, f"{this} is the router's unit name", "give the role another name")
            if name in seen:
                raise FieldError(field, f"{this} repeats the name of {seen[name]}: each role needs its own name, its "
                                        f"unit's (pdctl-{self.name}-{name}.service)",
                                 "set `name` on one of them to another")
            seen[name] = said
        return self

    @model_validator(mode="after")
    def _secrets_well_formed(self) -> Deployment:
        # (a misspelt role would silently keep the secret from the role that needs it: a model download failing late.
        # Any kind is taken, and the router, so that one [secrets] table serves a spec before and after a change of
        # shape, PD to a single server, say)
        valid = list(dict.fromkeys([*(n for n, _k, _r in self.roles()), "prefill", "decode", "server", "router"]))
        for key, v in self.secrets.items():
            ref = v if isinstance(v, str) else v.value
            if ref.startswith("env:"):
                try:
                    env_name(ref[4:])
                except ValueError as e:
                    field = f"secrets.{key}" + ("" if isinstance(v, str) else ".value")
                    raise FieldError(field, f"{ref!r} names no environment variable ({e})",
                                     f'write "env:NAME" with the variable that holds it, e.g. "env:{key}"') from None
            if isinstance(v, str):
                continue
            for i, who in enumerate(v.roles):
                if who not in valid:
                    raise FieldError(f"secrets.{key}.roles[{i}]",
                                     f"{who!r} is neither a role of this spec nor a kind of role",
                                     f"name roles ({', '.join(valid)}), or remove {who!r}")
        return self


class FieldError(ValueError):
    """A check of a whole table (a model validator) that fails at one of its fields: pydantic gives such an error the
    table's own location ("(root)" for the spec's top level) and no fix, so it carries both, for :func:`parse_spec`'s
    finding (``{field, message, fix}``). *field* is relative to the table ("" from a field's own validator: the
    field itself)."""

    def __init__(self, field: str, message: str, fix: str) -> None:
        super().__init__(f"{message}: {fix}")
        self.field, self.message, self.fix = field, message, fix


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if p in _SECRET_TAGS:
            continue
        if isinstance(p, int):
            parts[-1] = f"{parts[-1]}[{p}]" if parts else f"[{p}]"
        else:
            parts.append(str(p))
    return ".".join(parts) or "(root)"


# Messages for a value of the wrong shape (pydantic error type -> (what is wrong, what to write instead)).
_SHAPE_FIXES = {
    "string_type": ("must be text", "put it in quotes"),
    "dict_type": ("must be a table", "write it as [section] or { key = value }"),
    "too_short": ("must not be empty", "give at least one"),
    "finite_number": ("must be a finite number", "write a number, not inf or nan"),
}


def _list_fix(loc: tuple) -> tuple[str, str]:
    # A list written as something else: (message, fix) with an example that fits the field.
    name = loc[-1] if loc else ""
    if name in ("prefill", "decode", "server"):
        return "must be a list of tables", f"write each one as [[{name}]] (double brackets)"
    example = {"gpus": "[0, 1, 2, 3]", "gpu_numa": "[0, 0, 1, 1]", "which": '["sparse_mla_decode"]',
               "extra_args": '["--flag", "value"]'}.get(name, '["a", "b"]')
    return "must be a list", f"write it in brackets, e.g. {example}"


def _choice_fix(value: Any, expected: str) -> tuple[str, str | None]:
    """``(message, fix)`` for a value outside a field's fixed choices (a ``Literal``), worded as the other messages
    are; the fix names the nearest choices (:func:`difflib.get_close_matches`, case ignored) when one is close, else
    says to write one of them (the message lists them all).
    *expected* is pydantic's rendering of the choices (``"'a', 'b' or 'c'"``); pdctl's choices are plain names
    without quotes in them."""
    choices = re.findall(r"'([^']*)'", expected)
    shown = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    msg = f"must be one of {', '.join(repr(c) for c in choices)}, not {shown}"
    fix = f"write one of them, e.g. {choices[0]!r}" if len(choices) > 2 else f"write {' or '.join(map(repr, choices))}"
    if isinstance(value, str):
        lower = {c.lower(): c for c in choices}
        # the choices a short value begins ("fp8": fp8_e4m3, fp8_e5m2), then the closest by spelling
        starts = [c for c in choices if value and c.lower().startswith(value.lower() + "_")]
        near = list(dict.fromkeys([*starts, *(lower[n] for n in difflib.get_close_matches(
            value.lower(), list(lower), n=3, cutoff=0.6))]))[:max(3, len(starts))]
        if near:
            fix = f"did you mean {' or '.join(repr(n) for n in near)}?"
    return msg, fix


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose table holds the key at *loc* (a pydantic error location, from :class:`Deployment` down
    through fields, list indices and table keys), or None where no model is found there."""
    ann: Any = Deployment
    for part in loc[:-1]:
        ann = _item_type(ann, part)
        if ann is None:
            return None
    return _as_model(ann)


def _as_model(ann: Any) -> type[BaseModel] | None:
    # `Parsers | None` -> Parsers; Annotated[...] -> its type; anything else that is not a model -> None.
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType, typing.Annotated):
        return next((m for a in typing.get_args(ann) if (m := _as_model(a)) is not None), None)
    return None


def _item_type(ann: Any, part: Any) -> Any:
    # The type of the value at `part` (a field name, list index or table key) inside a value of type `ann`.
    model = _as_model(ann)
    if model is not None:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else None
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return next((t for a in args if a is not type(None) and (t := _item_type(a, part)) is not None), None)
    if origin is list and isinstance(part, int) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None


def _near_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys valid where the unknown key at *loc* was written that are spelled closest to it
    (:func:`difflib.get_close_matches`, case ignored): the fields of the model at that place, by the name a spec
    writes them with (the alias where a field has one)."""
    if not loc or not isinstance(loc[-1], str):
        return []
    names = _keys_at(loc)
    lower = {n.lower(): n for n in names}
    return [lower[n] for n in difflib.get_close_matches(loc[-1].lower(), list(lower), n=3, cutoff=0.6)]


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """Every key valid where the unknown key at *loc* was written, as a spec writes them (the alias where a field has
    one), in the model's order; empty where the place has no model."""
    model = _model_at(loc)
    return [] if model is None else [f.alias or n for n, f in model.model_fields.items()]


def _is_toml_number(text: str, *, whole: bool) -> bool:
    # Would `text` without its quotes be a TOML integer (whole) or number? (TOML's digits are ASCII only.)
    try:
        v = tomllib.loads(f"v = {text}").get("v")
    except tomllib.TOMLDecodeError:
        return False
    if isinstance(v, bool):
        return False
    return isinstance(v, int) if whole else isinstance(v, (int, float))


def _type_fix(kind: str, value: Any, check: Callable[[Any], dict[str, Any] | None] = lambda v: None,
              ) -> tuple[str, str]:
    """``(message, fix)`` for a number or switch written as another TOML type (strict fields above). ``check(v)``
    gives the validation error the field would raise for the value ``v`` (None if it would pass): a fix that
    proposes a value (the number without its quotes, a whole number for an integral float, a percentage as a
    fraction) names the field's range instead when that value would fail it, so that following it leads somewhere."""
    want = {"int_type": "a whole number", "float_type": "a number"}.get(kind, "true or false")
    shown = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    proposed: Any = None
    if isinstance(value, str):
        text = value.strip()
        if kind == "bool_type" and text.lower() in ("true", "false"):
            fix = f"write {text.lower()}, without quotes"  # TOML's booleans are lower case
        elif kind != "bool_type" and _is_toml_number(text, whole=kind == "int_type"):
            fix, proposed = "remove the quotes", tomllib.loads(f"v = {text}")["v"]
        elif kind == "float_type" and text.endswith("%") and _is_fraction(check, text[:-1].strip()):
            proposed = tomllib.loads(f"v = {text[:-1].strip()}")["v"] / 100
            fix = f"for {text[:-1].strip()} %, write {proposed:g}"
        else:
            fix = f"write {want}, without quotes"
    elif isinstance(value, float) and kind == "int_type" and value.is_integer():
        fix, proposed = f"write {int(value)}", int(value)
    else:
        fix = f"write {want}"
    if proposed is not None:
        err = check(proposed)
        if err is not None and err["type"] in _BOUNDS:
            words, bound, hint = _range_parts(err["type"], proposed, err.get("ctx", {}))
            return f"must be {want} {words} {bound}, not {shown}", hint
        if err is not None:  # e.g. "inf" or "1e400" unquoted: not a finite number either
            fin = err["type"] == "finite_number"
            return f"must be {want}, not {shown}", f"write {'a finite number, not inf or nan' if fin else want}"
    return f"must be {want}, not {shown}", fix


def _is_fraction(check: Callable[[Any], dict[str, Any] | None], text: str) -> bool:
    # Is `text` a TOML number, and the field a fraction (at most 1: a value of 1 or more is refused by its bound)?
    if not _is_toml_number(text, whole=False):
        return False
    err = check(max(float(tomllib.loads(f"v = {text}")["v"]), 2.0))
    return err is not None and err["type"] in ("less_than", "less_than_equal") and err.get("ctx", {}).get(
        "le", err.get("ctx", {}).get("lt")) == 1


def _error_at(data: dict[str, Any], loc: tuple, value: Any) -> dict[str, Any] | None:
    # The validation error that `value` written at `loc` of the parsed TOML `data` would get (None if none): what a
    # proposed fix would run into.
    d = copy.deepcopy(data)
    try:
        node: Any = d
        for k in loc[:-1]:
            node = node[k]
        node[loc[-1]] = value
    except (KeyError, IndexError, TypeError):
        return None
    try:
        Deployment.model_validate(d)
    except ValidationError as exc:
        return next((e for e in exc.errors() if tuple(e["loc"]) == tuple(loc)), None)
    return None


_BOUNDS = {"greater_than": ("more than", "gt"), "greater_than_equal": ("at least", "ge"),
           "less_than": ("less than", "lt"), "less_than_equal": ("at most", "le")}


def _range_fix(kind: str, value: Any, ctx: dict[str, Any]) -> tuple[str, str]:
    """``(message, fix)`` for a number outside its field's range: the bound, the value, and for a fraction written as
    a percentage (e.g. ``mem_fraction = 90``) the fraction meant."""
    words, bound, hint = _range_parts(kind, value, ctx)
    return f"must be {words} {bound}, not {value}", hint


def _range_parts(kind: str, value: Any, ctx: dict[str, Any]) -> tuple[str, Any, str]:
    # (the bound in words, the bound, the fix) for a number outside its field's range.
    words, key = _BOUNDS[kind]
    bound = ctx.get(key)
    if isinstance(bound, float) and bound.is_integer():
        bound = int(bound)
    if key in ("le", "lt") and bound == 1 and isinstance(value, (int, float)) and 2 <= value <= 100:
        return words, bound, f"it is a fraction; for {value:g} %, write {value / 100:g}"
    return words, bound, "write a value in range"


def _nul_fields(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[str, str, str]]:
    """The fields of *value* (parsed TOML) whose text, or a key of whose table, holds a NUL character, as
    ``(field, message, fix)``."""
    out: list[tuple[str, str, str]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and "\x00" in k:
                out.append((_loc(loc), f"key {k!r} holds a NUL character (\\u0000), which no file name, argument or "
                                       "environment variable can carry", "remove it"))
            out += _nul_fields(v, (*loc, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nul_fields(v, (*loc, i))
    elif isinstance(value, str) and "\x00" in value:
        out.append((_loc(loc), "holds a NUL character (\\u0000), which no command-line argument, environment "
                               "variable or unit file can carry", "remove it"))
    return out


# Optional names and paths whose empty value reads as unset to SGLang and smg yet differs from unset in a plan (a
# restart for nothing): refused, so that leaving the key out is the one way to say "unset"
_NO_EMPTY = (("model", "served_name"), ("model", "path"), ("engine", "python"), ("engine", "cache_dir"),
             ("router", "executable"), ("parsers", "chat_template"))


def _empty_fields(data: Any) -> list[tuple[str, str, str]]:
    """The names and paths of :data:`_NO_EMPTY` (and hosts' ssh settings) that are empty or hold a control character,
    as ``(field, message, fix)``."""
    out = []
    unset = "leave the key out to leave it unset, or write a value"
    for table, key in _NO_EMPTY:
        section = data.get(table) if isinstance(data, dict) else None
        if isinstance(section, dict) and isinstance(section.get(key), str) and not section[key].strip():
            out.append((f"{table}.{key}", "empty", unset))
        elif (isinstance(section, dict) and isinstance(section.get(key), str)
              and any(c < " " or c == "\x7f" for c in section[key].replace("\x00", ""))):
            # (a model path "org/name\n" reached SGLang's loader as given: no name or path holds a line break)
            out.append((f"{table}.{key}", f"{section[key]!r} holds a control character (a line break, a tab…), which "
                                          "no model name, path or file name here has", "remove it"))
    hosts = data.get("hosts") if isinstance(data, dict) else None
    for name, host in (hosts.items() if isinstance(hosts, dict) else ()):
        # (ssh_user = "" read as unset: pdctl logged in as this machine's user, in silence)
        for key in ("ssh_user", "address", "ssh_identity", "ssh_known_hosts"):
            if isinstance(host, dict) and isinstance(host.get(key), str) and not host[key].strip():
                out.append((f"hosts.{name}.{key}", "empty", unset))
    return out


def parse_spec(data: dict[str, Any], *, path: str | None = None) -> Deployment:
    """Build a :class:`Deployment` from parsed TOML. Raises :class:`SpecError` naming each field (a text with a NUL
    character too: TOML's ``\\u0000`` escape reads, and a process would then be handed a truncated argument)."""
    bad = _nul_fields(data) + _empty_fields(data)
    if bad:
        where = f"{path}: " if path else ""
        raise SpecError(f"{where}invalid spec\n  " + "\n  ".join(f"{f}: {m}: {x}" for f, m, x in bad),
                        findings=list(bad), path=path)
    try:
        return Deployment.model_validate(data)
    except ValidationError as exc:
        lines = []
        found: list[str | tuple[str, str, str]] = []  # (a line, or (field, message, fix) where the fix is its own)
        for err in exc.errors():
            field = _loc(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            fix = None
            if len(err["loc"]) >= 2 and err["loc"][-1] == "[key]":  # a table's key, e.g. numa_cpus = { zero = … }
                field = _loc(err["loc"][:-2])
                if err["type"] in _BOUNDS:
                    msg, fix = _range_fix(err["type"], err["input"], err.get("ctx", {}))
                    msg = f"key {err['loc'][-2]!r} {msg}"
                elif err["loc"][-3:-2] == ("numa_cpus",):
                    msg = (f"key {err['loc'][-2]!r} must be a NUMA node number (0, 1, …): write e.g. "
                           f'{{ 0 = "0-31", 1 = "32-63" }}')
                else:
                    msg = f"key {err['loc'][-2]!r}: {msg}"
            elif isinstance(cause := err.get("ctx", {}).get("error"), FieldError):
                field = ".".join(x for x in (_loc(err["loc"]) if err["loc"] else "", cause.field) if x) or "(root)"
                msg, fix = cause.message, cause.fix
            elif err["type"] == "extra_forbidden":
                msg, fix = "unknown key", "remove it or check its spelling"
                near = _near_keys(err["loc"])
                if near:
                    fix += f": did you mean {' or '.join(repr(n) for n in near)}?"
                elif known := _keys_at(err["loc"]):  # (nothing close: what the table does take)
                    where = _loc(err["loc"][:-1]) if len(err["loc"]) > 1 else "the top level"
                    fix += f"; {where} takes {', '.join(known)}"
            elif err["type"] == "missing":
                msg, fix = "required", "add it"
            elif err["type"] in ("int_type", "bool_type", "float_type"):
                msg, fix = _type_fix(err["type"], err["input"], lambda v, loc=err["loc"]: _error_at(data, loc, v))
            elif err["type"] == "list_type":
                msg, fix = _list_fix(err["loc"])
            elif err["type"] == "literal_error":
                msg, fix = _choice_fix(err["input"], err.get("ctx", {}).get("expected", ""))
            elif err["type"] in _BOUNDS:
                msg, fix = _range_fix(err["type"], err["input"], err.get("ctx", {}))
            elif err["type"] == "string_type" and isinstance(err["input"], dict):
                # e.g. numa_cpus = { 1.0 = "32-63" }: TOML reads the dotted key as the table { 1 = { 0 = "32-63" } }
                msg = (f"must be text, not the table {err['input']!r}: a dotted key (like 1.0 or a.b) makes a "
                       "nested table in TOML; put the whole key in quotes")
            elif err["type"] in _SHAPE_FIXES:
                msg, fix = _SHAPE_FIXES[err["type"]]
            lines.append(f"{field}: {msg}" + (f": {fix}" if fix else ""))
            found.append((field, msg, fix) if fix else lines[-1])
        where = f"{path}: " if path else ""
        raise SpecError(f"{where}invalid spec\n  " + "\n  ".join(lines), findings=found, path=path) from None


def load_spec(path: str | Path) -> Deployment:
    """Read and validate the TOML spec at *path*.

    Raises :class:`SpecError` for an unreadable file, one that is not UTF-8 text (TOML 1.0 files are UTF-8; a
    byte-order mark is named too), a TOML syntax error (message with line and column, from :mod:`tomllib`) or a
    field that fails validation. Contacts no host.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        fix = {IsADirectoryError: "give the spec's file, e.g. examples/demo.toml, not a directory",
               FileNotFoundError: "check the path (relative paths start where pdctl runs), e.g. examples/demo.toml",
               PermissionError: "make it readable by this user, or run pdctl as a user who can read it"}
        hint = next((h for kind, h in fix.items() if isinstance(exc, kind)), "check the path and the file")
        raise SpecError(f"{p}: cannot read spec: {exc.strerror or exc}: {hint}", path=str(p)) from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{p}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): save the "
                        "spec as UTF-8", path=str(p)) from None
    if text.startswith("\ufeff"):
        raise SpecError(f"{p}: starts with a byte-order mark (U+FEFF), which TOML does not allow: save the spec as "
                        "UTF-8 without one", path=str(p))
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        if _a_saved_plan(text):
            raise SpecError(f"{p} is a plan saved by `pdctl plan -o`, not a spec", path=str(p),
                            hint=f"`pdctl apply {p}` applies it; `pdctl plan` and `validate` take the spec it was "
                                 "made from (its spec_path)") from None
        message, hint = _toml_error_words(str(exc), text)
        raise SpecError(f"{p}: TOML syntax error: {message}", path=str(p), hint=hint) from None
    return _resolve_host_paths(parse_spec(data, path=str(p)), p.parent)


def _a_saved_plan(text: str) -> bool:
    """Whether *text* is a JSON object with a plan's ``plan_id`` and ``spec_path`` (what ``plan -o`` writes)."""
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and "plan_id" in data and "spec_path" in data


def _toml_error_words(said: str, text: str) -> tuple[str, str]:
    """``(message, hint)`` for :mod:`tomllib`'s error *said* about *text*: its words with the line it points at quoted
    (tomllib 3.11–3.13 give ``… (at line N, column M)`` only), and the fix: a key given twice in one table (``Cannot
    overwrite a value``, ``Cannot declare … twice``) named, else how to check the line."""
    import re

    m = re.search(r"\(at line (\d+), column \d+\)", said)
    line = text.splitlines()[int(m.group(1)) - 1].strip() if m and 0 < int(m.group(1)) <= len(text.splitlines()) else ""
    # (quoted as the terminal should show it: an escape sequence in the file retitled or recoloured it)
    line = re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", lambda c: f"\\x{ord(c.group()):02x}", line)
    message = f"{said}: {line}" if line else said
    if "overwrite" in said or "twice" in said:
        key = re.match(r"\s*\[*\s*([^=\]]+?)\s*[=\]]", line) if line else None
        if line.startswith("[") and key:
            return message, f"table [{key.group(1)}] is declared twice: merge the two into one"
        what = f"{key.group(1)!r}" if key else "a key"
        return message, (f"{what} is given twice in the same table (TOML allows each key once): remove one of them, or "
                         "move it under the table it belongs to")
    return message, ("fix that line (TOML: key = value; strings in double quotes; tables as [name] or [[name]]); "
                     "examples/demo.toml in pdctl's repository is a complete spec")


def _resolve_host_paths(dep: Deployment, base: Path) -> Deployment:
    """``ssh_identity`` / ``ssh_known_hosts`` with ``~`` expanded and relative to the spec's folder (not to
    wherever pdctl runs)."""
    import os

    def fix(v: str | None) -> str | None:
        if not v:
            return v
        v = os.path.expanduser(v)
        return v if os.path.isabs(v) else os.path.normpath(os.path.join(os.path.abspath(base), v))

    hosts = {k: h.model_copy(update={"ssh_identity": fix(h.ssh_identity), "ssh_known_hosts": fix(h.ssh_known_hosts)})
             for k, h in dep.hosts.items()}
    return dep.model_copy(update={"hosts": hosts})
