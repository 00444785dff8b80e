"""The plan: what is deployed against what is asked, as a value.

``make_plan(deployed, desired)`` compares two :class:`~pdctl.statemachine.topology.Topology`
values (``deployed`` is None when nothing is deployed) and returns a frozen :class:`Plan`:

* one :class:`ResourceChange` per role, the KV link and the router, with Terraform's actions
  (``+`` create, ``~`` update, ``-/+`` replace, ``-`` delete) and every changed attribute;
* a change **class** per difference — ``topology`` (the shape: PD ↔ single server, roles added or
  removed, GPU sets, TP/attention-DP/EP, NUMA nodes, hosts, the transfer backend, the router's
  exposure, a server behind it moved off loopback or onto its port), ``disruptive`` (restarts serving
  roles: parsers, chat template, model, ports, env, flags) or ``in_place`` (restarts nothing);
* the roles each change restarts, topology changes said in words ("PD disaggregation → single
  server", "router exposure 127.0.0.1:30001 → 0.0.0.0:30001");
* a **plan id**: a hash of both sides (canonical JSON) and of the journal's generation (how many applies changed
  what is deployed), so a confirmation given for one plan never applies to another, nor to the same change planned
  again after the deployment went elsewhere and back. ``from_serial`` binds the plan to the journal it was made against;
* with *not_running* (the service layer fills it while an apply is unfinished), what of the "from" side no longer
  runs: such a role (the router, the KV link of a prefill or decode among them) that the spec keeps is planned as
  started again (``+``, ``not_running`` saying why) rather than as no change or an update of a process that is not
  there, and one the spec drops whose unit is gone already has nothing left to destroy. Its class is what comparing
  the two sides gives (a restart with nothing else changed: disruptive), so it never alters whether the plan
  needs a confirmation, and it is not part of the id;
* with *runs* (the service layer fills it too while an apply is unfinished), how that apply left the to side's roles
  and router that still run, where the from side does not say it: one it already started with the definition the
  spec asks is **kept** (``=``, :attr:`ResourceChange.kept`: apply proves it as it stands, creates or restarts
  nothing), and one running a definition other than the from side's, or whose unit file it rewrote without
  restarting it, is restarted (:attr:`ResourceChange.runs` says why, its attributes compared with what runs). Neither
  alters the plan's class, whether it needs a confirmation, or its id.

``render_text(plan)`` prints it in Terraform's manner; ``plan.model_dump_json()`` is the same plan
as data, and ``Plan.model_validate_json`` reads it back.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from pdctl.statemachine.topology import RoleTopology, RouterTopology, Topology, is_wildcard, url_host

__all__ = ["NOT_INSTALLED", "AttrChange", "ChangeClass", "GpuHeld", "Plan", "PortHeld", "ResourceChange", "Runs",
           "format_value", "gpu_holder", "gpus_held_hint", "make_plan", "plan_id_of", "render_gpus_held", "render_text"]

ChangeClass = Literal["topology", "disruptive", "in_place"]
Action = Literal["create", "update", "replace", "delete"]
_RANK = {"in_place": 0, "disruptive": 1, "topology": 2}
SYMBOL = {"create": "+", "update": "~", "replace": "-/+", "delete": "-"}

# RoleTopology attributes that are the deployment's shape.
_ROLE_TOPOLOGY_ATTRS = ("kind", "host", "address", "gpus", "numa_node", "tp", "attn_dp", "ep")
_ROLE_DISRUPTIVE_ATTRS = ("http_host", "port", "bootstrap_port", "nccl_port")


_DERIVED = ("class", "counts", "client_impact")  # keys Plan.to_json adds

NOT_INSTALLED = "not installed"
"""``ResourceChange.not_running`` of a resource whose unit is not installed at all (an unfinished apply removed it)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttrChange(_Frozen):
    """One attribute that differs. ``before``/``after`` are JSON values (None: absent)."""

    path: str
    before: Any
    after: Any
    cls: ChangeClass


class ResourceChange(_Frozen):
    """A change to one resource: ``role.<name>``, ``kv_link`` or ``router``."""

    address: str
    action: Action
    cls: ChangeClass
    changes: tuple[AttrChange, ...] = ()
    restarts: tuple[str, ...] = ()
    """Roles (and ``router``) this change restarts."""
    reason: str = ""
    """Why, for people only (never parsed)."""
    summary: str = ""
    """One line describing the resource (the side that exists)."""
    not_running: str | None = None
    """Why the "from" side's resource does not run now, while an apply is unfinished: :data:`NOT_INSTALLED`, its
    unit's state (``inactive``, ``failed``…), or for the KV link the roles it joins that do not run. A ``create``
    then starts it again; a ``delete`` of one not installed has nothing left to do (:attr:`gone`). None: it runs, or
    the from side has none."""

    kept: str | None = None
    """Why apply keeps this resource as it runs, while an apply is unfinished: that apply already started it with the
    definition the spec asks (and proved it, or it is still loading: apply waits for it). Apply creates, restarts and
    destroys nothing of it; its action and class are still what comparing the two sides gives. None: not kept."""
    kept_restarts: tuple[str, ...] = ()
    """Roles (and ``router``) this change would restart that apply keeps, as an unfinished apply already started them
    with the spec's definition (a deployment-wide change interrupted after prefill restarted: prefill kept, decode in
    :attr:`restarts`); the whole resource kept is :attr:`kept` instead."""
    runs: str | None = None
    """Why apply restarts this role (or the router), running, although the from side alone does not say so, while an
    apply is unfinished: what runs is what that apply started for its own spec, or its unit file differs from the
    running process (that apply rewrote it and had not restarted it). :attr:`changes` then compare the spec with what
    runs. None: what runs is the from side's."""
    asked: str | None = None
    """Why apply restarts this role (or the router) where nothing of it changed: the operator asked for it
    (``pdctl apply --restart NAME``: new weights at the same path, an engine upgraded in place, a leak). None: not
    asked, or restarted by the change itself."""

    @property
    def symbol(self) -> str:
        return "=" if self.kept is not None else SYMBOL[self.action]

    @property
    def gone(self) -> bool:
        """A delete whose resource is gone already: apply has nothing left to destroy. A unit not installed; the KV
        link once prefill or decode does not run (there is no link without both ends)."""
        return self.action == "delete" and self.not_running is not None and (
            self.not_running == NOT_INSTALLED or self.address == "kv_link")


class PortHeld(_Frozen):
    """A port the deployment will listen on that a process outside it holds now: ``pdctl apply`` would refuse before
    its first step, starting nothing (``steps.ports_taken_elsewhere``). ``pdctl plan`` shows it as a warning."""

    port: int
    role: str
    """The role (or ``router``) that listens on it."""
    step: str
    """The step an apply would have failed at."""
    pid: int | None
    """None when the socket's owner cannot be seen (another user's process)."""
    command: str = ""
    applied_elsewhere: str | None = None
    """Set when the holder is this deployment's own process, applied another way (another ``--state-dir``, user or
    service manager): how, in words (``state directory /x (process supervisor)``), "" where that does not tell.
    None: a process of something else."""
    other_deployment: str | None = None
    """Set when the holder runs for another pdctl deployment's unit (another name, e.g. this spec's deployment before
    it was renamed): ``pdctl unit pdctl-<name>-<role>.service``, with how it was applied where that tells."""
    listening: bool = True
    """False where the holder does not listen on the port but holds a connection from it (its local end: an outbound
    connection given the port from the host's ephemeral range), which the server's bind fails against all the same."""


class GpuHeld(_Frozen):
    """A GPU a role will run on that a compute process outside the deployment uses now (nvidia-smi): ``pdctl apply``
    would refuse before its first step, starting nothing (``steps.gpus_taken_elsewhere``), since SGLang sizes its KV
    cache from the memory left and fails to start ("Not enough memory") or starts small. ``pdctl plan`` shows it as
    a warning."""

    gpu: int
    """The GPU's nvidia-smi index (as the spec's ``gpus`` lists it)."""
    role: str
    step: str
    """The step an apply would have failed at."""
    pid: int
    used_mib: int | None = None
    """GPU memory the process holds, MiB (None: nvidia-smi does not tell)."""
    command: str = ""
    """Its command line; "" when the host's ``/proc`` does not show the PID (a process in another PID namespace,
    e.g. a container's, or pdctl's own server seen from one: nvidia-smi may name PIDs of the root namespace): apply
    then warns, not refuses."""
    applied_elsewhere: str | None = None
    """As :attr:`PortHeld.applied_elsewhere`: this deployment's own process, applied another way."""
    other_deployment: str | None = None
    """As :attr:`PortHeld.other_deployment`: another pdctl deployment's process."""


EPHEMERAL_PORT_HINT = ("a port in the host's ephemeral range (`sysctl net.ipv4.ip_local_port_range`) can be taken "
                       "by any outbound connection: reserve the spec's ports with `net.ipv4.ip_local_reserved_ports`, "
                       "or give the roles ports outside that range")
"""Added to the fix where a port is held by a connection from it, not a listener (:attr:`PortHeld.listening`)."""

CONNECTION_WORDS = ", a connection from that port, not a listener"
"""How a holder that does not listen on the port is named after its command (:attr:`PortHeld.listening`)."""

APPLIED_ELSEWHERE_HINT = ("manage it the way it was applied (the same user, service_manager and --state-dir or "
                          "XDG_STATE_HOME), or `pdctl down` it that way before applying here")
"""The fix where this deployment's own processes, applied another way, hold what an apply needs (ports, GPUs)."""

OTHER_DEPLOYMENT_HINT = (
    "another pdctl deployment holds these ports (its unit is named above): `pdctl down` its spec, or give the roles other "
    "ports; a deployment renamed in its spec runs on under its old name: put that name back, `pdctl down`, then rename")
"""The hint where a port's holder runs for another pdctl deployment's unit (apply's refusal, plan's warning)."""


class Runs(_Frozen):
    """How a role (or ``router``) of the plan's to side runs now, while an apply is unfinished, where the from side
    does not say it (the service layer reads it from the journal and the service manager): *kept* or *restart*."""

    kept: str | None = None
    """Apply keeps it as it runs (it runs the definition the spec asks): why, in words."""
    restart: str | None = None
    """Apply restarts it: why, in words."""
    was: RoleTopology | RouterTopology | None = None
    """With *restart*: what runs where that is not the from side's (the unfinished apply's own spec's)."""


class Plan(_Frozen):
    """A frozen plan. See the module docstring."""

    plan_id: str
    deployment: str
    from_serial: int
    generation: int = 0
    """The journal's generation the plan was made at (:func:`plan_id_of`; 0 in plans saved before 2026-12-04)."""
    from_topology: Topology | None
    to_topology: Topology
    changes: tuple[ResourceChange, ...]
    topology_changes: tuple[str, ...]
    unrecorded: tuple[str, ...] = ()
    """With nothing recorded as deployed: this deployment's units installed here all the same (its journal moved
    aside, deleted or replaced), whose topology no journal records. Applying takes them over, a topology change to
    confirm: it stops and removes those the spec lacks, and rewrites and restarts the others. Part of the id."""
    spec_path: str | None = None
    """The spec the plan was made from (``pdctl apply PLANFILE`` re-reads it); not part of the id."""
    since_down: str | None = None
    """A first deployment's: how its topology differs from what ``pdctl down`` last took down (when, and the
    differences in words); None: no such record, or the same topology. Not part of the id: the down confirmed
    stopping that deployment, and a first deployment needs no confirmation of its own."""
    unsettled: str | None = None
    """Why ``pdctl apply`` has work although the plan may have no changes: an apply that did not finish or is running,
    or a unit that does not serve as proven (``pdctl plan`` fills it from the journal and ``status``); not part of
    the id. None: what runs is what was recorded."""
    ports_held: tuple[PortHeld, ...] | None = None
    """Ports of the deployment held outside it when ``pdctl plan`` looked (apply would refuse them, exit 3); not part
    of the id. None: not looked at (the host or service manager could not be asked, or not a CLI plan)."""
    gpus_held: tuple[GpuHeld, ...] | None = None
    """GPUs of the deployment's roles that compute processes outside it use when ``pdctl plan`` looked (apply would
    refuse them, exit 3); not part of the id. None: not looked at (no nvidia-smi on the host, or it could not be
    asked)."""
    gpus_unchecked: str | None = None
    """Why the GPUs could not be checked for processes outside the deployment when ``pdctl plan`` looked (nvidia-smi
    failed, hung, or answered what cannot be read); not part of the id. None: they were, or the host has no
    nvidia-smi (:attr:`gpus_held` None)."""
    binds_unusable: str | None = None
    """Why apply would refuse the spec's bind addresses (or its engine Python, or a unit file that systemd could not
    read back under its state directory) on the host when ``pdctl plan`` looked, with the fix: apply's own words
    (exit 3, nothing changed), one refusal a line; not part of the id. None: it would not, or not looked."""
    ports_ephemeral: str | None = None
    """The spec's ports that lie in the host's ephemeral range (``net.ipv4.ip_local_port_range``) and are not
    reserved (``ip_local_reserved_ports``), in words with the range: any outbound connection may take one, and the
    role then cannot start there; not part of the id, never refused. None: none, or not looked at."""
    secrets_refused: str | None = None
    """Why apply would refuse the spec's ``[secrets]`` in the environment ``pdctl plan`` ran in (an ``env:`` variable
    unset, a value empty), with the fix: apply's own words (exit 1, nothing changed); not part of the id. None: it
    would not, or not looked."""
    warnings: tuple[dict[str, str], ...] = ()
    """The spec's rule warnings, ``{field, message, fix}`` each (as ``pdctl validate --json`` lists them; stderr says
    them too), where the plan was made from a spec; not part of the id."""
    capacity: tuple[dict[str, Any], ...] | None = None
    """How the plan moves each kept role's KV pool and requests at once (:func:`pdctl.statemachine.capacity.
    plan_capacity`: ``{role, before, after, words}`` for each role whose estimate changes); not part of the id. None:
    not estimated (nothing deployed, no model facts or no GPU memory declared)."""

    @model_validator(mode="before")
    @classmethod
    def _derived_out(cls, data: Any) -> Any:
        # what :meth:`to_json` adds is derived from the rest: a plan printed with it reads back without it
        return {k: v for k, v in data.items() if k not in _DERIVED} if isinstance(data, dict) else data

    def to_json(self) -> str:
        """The plan as JSON (``pdctl plan --json`` / ``-o``): the fields, and the derived ``class`` (the most severe
        change class, null: no change; as apply's ``plan`` event says it) and ``counts`` (to add, change, destroy).
        ``Plan.model_validate_json`` reads it back."""
        return json.dumps({**self.model_dump(mode="json"), "class": self.cls, "counts": list(self.counts()),
                           "client_impact": self.client_impact()}, indent=1)

    @property
    def has_changes(self) -> bool:
        return bool(self.changes)

    @property
    def cls(self) -> ChangeClass | None:
        """The most severe class among the changes (None: no change)."""
        if not self.changes:
            return None
        return max((c.cls for c in self.changes), key=_RANK.__getitem__)

    @property
    def requires_confirmation(self) -> bool:
        """A change to a deployed topology needs an explicit, typed confirmation of this plan's id.

        A first deployment (nothing deployed) alters no existing topology and needs none, unless units of the
        deployment that no journal records run in its place (:attr:`unrecorded`): what they serve is unknown.
        """
        return self.cls == "topology" and (self.from_topology is not None or bool(self.unrecorded))

    def counts(self) -> tuple[int, int, int]:
        """``(to add, to change, to destroy)``; a replacement counts as one add and one destroy; a delete of what is
        gone already (:attr:`ResourceChange.gone`), or a change apply keeps as it runs (:attr:`ResourceChange.kept`),
        as nothing."""
        todo = [c for c in self.changes if c.kept is None]
        add = sum(1 for c in todo if c.action in ("create", "replace"))
        change = sum(1 for c in todo if c.action == "update")
        destroy = sum(1 for c in todo if c.action in ("delete", "replace") and not c.gone)
        return add, change, destroy

    def kept(self) -> list[str]:
        """Addresses of the changes apply keeps as they run (:attr:`ResourceChange.kept`)."""
        return [c.address for c in self.changes if c.kept is not None]

    def client_impact(self) -> list[str]:
        """How the deployment's clients fare while apply restarts what this plan restarts, in words (empty: they are
        served throughout). A server restarted behind a router that keeps running is taken out of the router first
        and put back once proven, one replica at a time, so a kind with a second replica keeps serving; the only
        replica of a kind, or every replica while the router itself restarts (it then restarts them in place), leaves
        clients with errors for that long. A first deployment serves nobody yet."""
        new = self.to_topology
        if self.from_topology is None:
            return []
        going = set(self.restarts())
        out: list[str] = []
        router = new.router is not None and "router" in going
        if router:
            out.append(f"clients cannot connect while the router restarts: one router on {new.router.exposure}")
        for kind in ("prefill", "decode", "server"):
            roles = new.roles_of(kind)
            names = [r.name for r in roles if r.name in going]
            if not names:
                continue
            if new.router is None:
                out.append(f"clients of {', '.join(names)} get no answer while {'it restarts' if len(names) == 1 else 'they restart'}"
                           " (no router in front)")
            elif len(roles) == 1:
                out.append(f"clients get 503 while {names[0]} restarts: one {kind}")
            elif router and len(names) == len(roles):
                out.append(f"clients get 503 while the {kind} replicas restart with the router: {', '.join(names)}")
        return out

    def restarts(self) -> list[str]:
        """Roles (and ``router``) apply restarts (a change apply keeps as it runs restarts none)."""
        seen: list[str] = []
        for c in self.changes:
            for r in c.restarts:
                if r not in seen:
                    seen.append(r)
        return seen


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def plan_id_of(deployed: Topology | None, desired: Topology, generation: int = 0,
               unrecorded: Collection[str] = ()) -> str:
    """Hash of both sides (canonical JSON, key order irrelevant), of the journal's *generation* (how many applies
    changed what is deployed, :attr:`JournalState.generation`) and of the *unrecorded* units taken over
    (:attr:`Plan.unrecorded`): 16 hex digits of SHA-256. The same change planned again after the deployment went
    elsewhere and back gets another id."""
    body = _canon(
        {
            "from": deployed.model_dump(mode="json") if deployed else None,
            "to": desired.model_dump(mode="json"),
            **({"generation": generation} if generation else {}),
            **({"unrecorded": sorted(unrecorded)} if unrecorded else {}),
        }
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _diff(prefix: str, before: Any, after: Any, cls: ChangeClass) -> list[AttrChange]:
    """Leaf-level differences between two JSON-like values."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[AttrChange] = []
        for k in sorted(set(before) | set(after), key=str):
            out += _diff(f"{prefix}.{k}" if prefix else str(k), before.get(k), after.get(k), cls)
        return out
    if _canon(before) != _canon(after):
        return [AttrChange(path=prefix, before=before, after=after, cls=cls)]
    return []


def _reach_free(deployment: dict) -> dict:
    """*deployment* without how pdctl reaches each host (journals before 2026-11-30 recorded ssh_user and
    ssh_port there), and each host's address as the machine it names (:func:`_machine`): changing them restarts
    nothing."""
    hosts = deployment.get("hosts")
    if not isinstance(hosts, dict):
        return deployment
    return {**deployment, "hosts": {k: {a: _machine(v) if a == "address" else v for a, v in h.items()
                                        if a not in ("ssh_user", "ssh_port")}
                                    if isinstance(h, dict) else h for k, h in hosts.items()}}


def _machine(address: Any) -> Any:
    """A host's address as the machine it names: every loopback name or address (``localhost``, ``127.0.0.1``,
    ``::1``) is this one, so writing one for another moves nothing (helper-109: it replaced prefill and decode, a
    topology change to confirm, on the same machine)."""
    return "localhost" if isinstance(address, str) and _loopback(address) else address


def _canonical_ip(host: Any) -> Any:
    # An IP literal in the form specs are read into since 2026-12-01 (::0 -> ::, FE80::1 -> fe80::1): a journal
    # written before recorded it as typed, and the same address is no change.
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


def exposes(before: str, after: str) -> bool:
    """Whether moving a server's bind address from *before* to *after* opens it to a network it was not on: any
    move to an address other than loopback (another address, a host name, whose address pdctl does not judge, or
    every interface, IPv4 or IPv6). Behind a router such a server is reachable around it (its engine's API, with no
    router policy in front): a change of the deployment's exposure, confirmed like the router's. A move to loopback
    is not (pdctl drives one host per deployment, whose peers dial loopback)."""
    return before != after and not _loopback(after)


def _role_changes(old: RoleTopology, new: RoleTopology, *, entry_point: bool = False,
                  router_port: int | None = None) -> list[AttrChange]:
    # entry_point: the role is where clients connect (a single server with no router in front), so its bind
    # address and port are the deployment's exposure, a topology change like the router's. router_port: the port
    # the deployed router is exposed on; a server moved onto it takes the clients' port (exposure too).
    o, n = old.model_dump(mode="json"), new.model_dump(mode="json")
    o["http_host"] = _canonical_ip(o["http_host"])
    o["address"], n["address"] = _machine(o["address"]), _machine(n["address"])
    if "numa_binding" not in o["settings"]:  # journals before 2026-11-30 did not record it: nothing to compare
        n["settings"].pop("numa_binding", None)
    else:
        # an explicit numa_node dropped (or written) where gpu_numa gives the same node binds the role as before
        # (the unit is the same): no change
        bound = [(d["settings"].get("numa_binding") or {}).get("node") for d in (o, n)]
        if bound[0] == bound[1] is not None:
            o["numa_node"] = n["numa_node"]
    out: list[AttrChange] = []
    for a in _ROLE_TOPOLOGY_ATTRS:
        out += _diff(a, o[a], n[a], "topology")
    for a in _ROLE_DISRUPTIVE_ATTRS:
        exposure = (entry_point and a in ("http_host", "port") or a == "http_host" and exposes(o[a], n[a])
                    or a == "port" and n[a] == router_port)
        out += _diff(a, o[a], n[a], "topology" if exposure else "disruptive")
    out += _diff("settings", o["settings"], n["settings"], "disruptive")
    return out


def _worst(changes: list[AttrChange]) -> ChangeClass:
    return max((c.cls for c in changes), key=_RANK.__getitem__)


def _mode_words(topology: Topology) -> str:
    if topology.mode == "pd":
        return "PD disaggregation"
    servers = sum(r.kind == "server" for r in topology.roles)
    return "single server" if servers == 1 else f"{servers} regular servers (no PD)"


def _router_changes(orr: RouterTopology, nr: RouterTopology) -> list[AttrChange]:
    o, n = orr.model_dump(mode="json"), nr.model_dump(mode="json")
    o["host"] = _canonical_ip(o["host"])
    diffs: list[AttrChange] = []
    for a in ("host", "port", "on"):
        diffs += _diff(a, o[a], n[a], "topology")
    for a in ("impl", "prefill", "decode", "regular"):
        diffs += _diff(a, o[a], n[a], "disruptive")
    diffs += _diff("settings", o["settings"], n["settings"], "disruptive")
    return diffs


def make_plan(deployed: Topology | None, desired: Topology, *, from_serial: int = 0, generation: int = 0,
              not_running: Mapping[str, str] | None = None, runs: Mapping[str, Runs] | None = None,
              unrecorded: Collection[str] = (), restart: Collection[str] = ()) -> Plan:
    """Compare *deployed* (None: nothing deployed) with *desired*. Pure; contacts nothing. *generation*: the journal's
    (:func:`plan_id_of`). *not_running*: role names
    (and ``router``) of *deployed* that do not run now, each with why (:data:`NOT_INSTALLED`, or its unit's state);
    *runs*: role names (and ``router``) of *desired* that an unfinished apply left running otherwise than *deployed*
    says, each a :class:`Runs`: see the module docstring. *unrecorded*: with *deployed* None, the deployment's unit
    names installed all the same (:attr:`Plan.unrecorded`). *restart*: role names (and ``router``) of *desired* to
    restart although nothing of them changed (:attr:`ResourceChange.asked`; not part of the id); ``ValueError`` for
    a name *desired* lacks."""
    if unknown := not_restartable(desired, restart):
        raise ValueError(f"cannot restart {', '.join(map(repr, unknown))}: deployment {desired.name!r} has no such role")
    if runs and restart:  # (a restart asked of what an unfinished apply left running as the spec asks: restarted)
        runs = {n: how for n, how in runs.items() if not (n in restart and how.kept is not None)}
    changes: list[ResourceChange] = []
    words: list[str] = []
    old_roles = {r.name: r for r in (deployed.roles if deployed else ())}
    new_roles = {r.name: r for r in desired.roles}
    order = {n: i for i, n in enumerate([*(r.name for r in desired.roles), *old_roles])}

    def ordered(names: set[str]) -> list[str]:
        return sorted(names, key=lambda n: order.get(n, len(order)))

    if deployed is not None and deployed.mode != desired.mode:
        words.append(f"{_mode_words(deployed)} → {_mode_words(desired)}")

    # Deployment-wide settings restart every serving role.
    wide: list[AttrChange] = []
    if deployed is not None:
        wide = _diff("deployment", _reach_free(deployed.deployment), _reach_free(desired.deployment), "disruptive")
    wide_restarts = tuple(sorted(set(old_roles) & set(new_roles)))
    # the router's unit carries every plain secret, runs under engine.python too (its readiness gate; sglang-router's
    # executable) and as service_user: such a change restarts it as well (statemachine/launch.py, services_for)
    if (deployed is not None and deployed.router is not None and desired.router is not None
            and any(c.path.startswith(("deployment.secrets", "deployment.engine.python", "deployment.service_user"))
                    for c in wide)):
        wide_restarts = (*wide_restarts, "router")

    for name in ordered(old_roles.keys() - new_roles.keys()):
        r = old_roles[name]
        changes.append(
            ResourceChange(
                address=f"role.{name}",
                action="delete",
                cls="topology",
                restarts=(),
                reason=f"{r.kind} {name!r} is not in the spec",
                summary=r.describe(),
            )
        )
        if deployed is not None and deployed.mode == desired.mode:
            words.append(f"{r.kind} {name!r} removed")
    for name in ordered(new_roles.keys() - old_roles.keys()):
        r = new_roles[name]
        changes.append(
            ResourceChange(
                address=f"role.{name}",
                action="create",
                cls="topology",
                reason=f"{r.kind} {name!r} is new",
                summary=r.describe(),
            )
        )
        if deployed is not None and deployed.mode == desired.mode:
            words.append(f"{r.kind} {name!r} added")
    for name in ordered(old_roles.keys() & new_roles.keys()):
        old, new = old_roles[name], new_roles[name]
        exposed = new.kind == old.kind == "server" and desired.router is None and deployed.router is None
        diffs = _role_changes(old, new, entry_point=exposed,
                              router_port=deployed.router.port if deployed.router is not None else None)
        if not diffs:
            continue
        cls = _worst(diffs)
        action: Action = "replace" if cls == "topology" else "update"
        if cls == "topology":
            for d in diffs:
                if d.cls != "topology" or exposed and d.path in ("http_host", "port"):  # (said as exposure below)
                    continue
                if d.path in ("http_host", "port"):  # a server behind the router reachable around it, or on its port
                    if d.path == "port" and any(e.path == "http_host" and e.cls == "topology" for e in diffs):
                        continue  # (one line for both)
                    public = " (every interface)" if is_wildcard(new.http_host) else ""
                    where = (", the port clients reached the router on" if deployed.router is not None
                             and new.port == deployed.router.port != old.port else "")
                    words.append(f"{new.kind} {name!r} reachable around the router: "
                                 f"{url_host(old.http_host)}:{old.port} → {url_host(new.http_host)}:{new.port}"
                                 f"{public}{where}")
                else:
                    words.append(f"{name} {d.path} {format_value(d.before)} → {format_value(d.after)}")
        changes.append(
            ResourceChange(
                address=f"role.{name}",
                action=action,
                cls=cls,
                changes=tuple(diffs),
                restarts=(name,),
                reason="forces replacement: " + ", ".join(d.path for d in diffs if d.cls == "topology")
                if cls == "topology"
                else "restart with new settings",
                summary=new.describe(),
            )
        )

    # KV link.
    ok, nk = (deployed.kv_link if deployed else None), desired.kv_link
    if ok is None and nk is not None:
        changes.append(ResourceChange(address="kv_link", action="create", cls="topology", reason="new KV link", summary=f"{nk.backend}"))
    elif ok is not None and nk is None:
        changes.append(ResourceChange(address="kv_link", action="delete", cls="topology", reason="no KV link in the spec", summary=f"{ok.backend}"))
    elif ok is not None and nk is not None:
        o, n = ok.model_dump(mode="json"), nk.model_dump(mode="json")
        diffs = _diff("backend", o["backend"], n["backend"], "topology")
        diffs += _diff("ib_device", o["ib_device"], n["ib_device"], "disruptive")
        diffs += _diff("ucx_net_devices", o["ucx_net_devices"], n["ucx_net_devices"], "disruptive")
        # The prefill set (a group added or removed, a bootstrap port moved) restarts no server for the link: each
        # prefill server's bootstrap port is its own setting (its own role restarts for it), and the decode side
        # learns each request's bootstrap host, port and room from the router (which restarts for its worker list),
        # not from its command line (the request fields ``bootstrap_host/port/room`` the router injects, SGLang 0.5.23
        # and smg; pdctl always gives the router each prefill's bootstrap port).
        diffs += _diff("bootstrap", o["bootstrap"], n["bootstrap"], "in_place")
        if diffs:
            if any(d.path == "backend" for d in diffs):
                words.append(f"KV transfer backend {ok.backend} → {nk.backend}")
            link_restarts = any(d.path != "bootstrap" for d in diffs)
            pd_roles = tuple(r.name for r in desired.roles if r.kind in ("prefill", "decode"))
            changes.append(
                ResourceChange(
                    address="kv_link",
                    action="update",
                    cls=_worst(diffs),
                    changes=tuple(diffs),
                    restarts=pd_roles if link_restarts else (),
                    reason="prefill and decode restart to change the link" if link_restarts
                    else "the link is proven again over the new prefill set; no server restarts for it",
                    summary=nk.backend,
                )
            )

    # Router.
    orr, nr = (deployed.router if deployed else None), desired.router
    if orr is None and nr is not None:
        changes.append(
            ResourceChange(address="router", action="create", cls="topology", reason="new router", summary=f"{nr.impl} on {nr.exposure}")
        )
        if deployed is not None:
            words.append(f"router added on {nr.exposure}")
    elif orr is not None and nr is None:
        changes.append(
            ResourceChange(address="router", action="delete", cls="topology", reason="no router in the spec", summary=f"{orr.impl} on {orr.exposure}")
        )
        words.append(f"router on {orr.exposure} removed")
    elif orr is not None and nr is not None:
        diffs = _router_changes(orr, nr)
        if diffs:
            if any(d.path in ("host", "port") for d in diffs):
                public = " (every interface)" if is_wildcard(nr.host) else ""
                words.append(f"router exposure {orr.exposure} → {nr.exposure}{public}")
            if orr.on != nr.on:
                words.append(f"router host {orr.on} → {nr.on}")
            changes.append(
                ResourceChange(
                    address="router",
                    action="update",
                    cls=_worst(diffs),
                    changes=tuple(diffs),
                    restarts=("router",),
                    reason="the router restarts with its new settings",
                    summary=f"{nr.impl} on {nr.exposure}",
                )
            )
    # A router whose workers restart keeps its config (under systemd it restarts with them: see below).

    # Where clients connect, when that moves other than by a router's own host or port (said above): PD collapsed
    # into a server on *:30001 says which server now listens where.
    if deployed is not None and not (orr and nr) and deployed.entry_points() != desired.entry_points():
        words.append(f"exposure {'; '.join(deployed.entry_points()) or 'none'} → "
                     f"{'; '.join(desired.entry_points()) or 'none'}")

    if wide:
        changes.append(
            ResourceChange(
                address="deployment",
                action="update",
                cls="disruptive",
                changes=tuple(wide),
                restarts=wide_restarts,
                reason="deployment-wide settings restart every serving role",
                summary=desired.name,
            )
        )
    if deployed is not None:
        ip = _diff("in_place", deployed.in_place, desired.in_place, "in_place")
        if ip:
            changes.append(
                ResourceChange(address="console", action="update", cls="in_place", changes=tuple(ip), reason="no host is touched", summary="console settings")
            )

    if runs:
        changes = _restarted_as_it_runs(deployed, desired, changes, runs)
    if restart:
        changes = _asked_restarts(desired, changes, restart)

    # A server restart leaves the router running under either manager (units/_systemd.py: Wants=, not Requires=):
    # it sees the worker leave and come back, under the model id it registered it with (smg takes a worker's model
    # id once, at registration): a server that comes back serving another model name needs the router restarted
    # too, or every request for the new name finds no worker.
    if desired.router is not None and deployed is not None and deployed.router is not None:
        was = {r.name: r.served_model for r in deployed.roles}
        servers = {r.name for r in desired.roles if r.kind in ("prefill", "decode", "server")
                   and was.get(r.name, r.served_model) != r.served_model}
        changes = [c.model_copy(update={"restarts": (*c.restarts, "router")})
                   if servers & set(c.restarts) and "router" not in c.restarts else c for c in changes]

    if runs:
        changes = _kept_as_it_runs(desired, changes, runs)
    if deployed is not None and not_running:
        changes = _not_running(deployed, desired, changes, dict(not_running))

    unrecorded = tuple(sorted(unrecorded)) if deployed is None else ()
    if unrecorded:
        changes, words = _taken_over(desired, changes, words, unrecorded)

    return Plan(
        plan_id=plan_id_of(deployed, desired, generation, unrecorded),
        unrecorded=unrecorded,
        deployment=desired.name,
        from_serial=from_serial,
        generation=generation,
        from_topology=deployed,
        to_topology=desired,
        changes=tuple(changes),
        topology_changes=tuple(words),
    )


_ORDER = {"kv_link": 1, "router": 2, "deployment": 3, "console": 4}  # role.* first, as make_plan lists them

UNRECORDED = ("installed here, but no journal records it (the journal moved aside, deleted or replaced?): what it "
              "serves is unknown")
"""Why a unit of :attr:`Plan.unrecorded` is named in a plan."""


def _taken_over(desired: Topology, changes: list[ResourceChange], words: list[str],
                unrecorded: tuple[str, ...]) -> tuple[list[ResourceChange], list[str]]:
    """A first deployment's *changes* and topology *words* where units of the deployment that no journal records are
    installed (*unrecorded*): each the spec lacks is a delete of its own (apply stops and removes it), each the spec
    has again is restarted with the spec's definition, and the takeover is a topology change to confirm."""
    prefix = f"pdctl-{desired.name}-"
    names = {n: n.removeprefix(prefix).removesuffix(".service") for n in unrecorded}
    wanted = {f"{prefix}{r.name}.service" for r in desired.roles} | ({f"{prefix}router.service"} if desired.router
                                                                       else set())
    out = [c.model_copy(update={"runs": f"unit {unit} is installed, but no journal records what it runs: apply "
                                        "rewrites and restarts it"})
           if (unit := f"{prefix}{c.address.removeprefix('role.')}.service") in unrecorded and c.action == "create"
           else c for c in changes]
    for unit in unrecorded:
        if unit not in wanted:
            out.append(ResourceChange(address=f"role.{names[unit]}", action="delete", cls="topology",
                                      reason=f"unit {unit} is {UNRECORDED}", summary=f"unit {unit}: {UNRECORDED}"))
    dropped = [u for u in unrecorded if u not in wanted]
    kept = [u for u in unrecorded if u in wanted]
    doing = ([f"stopping and removing {', '.join(dropped)}"] if dropped else []) \
        + ([f"rewriting and restarting {', '.join(kept)} with this spec"] if kept else [])
    said = (f"units of {desired.name!r} that no journal records are installed here ({', '.join(unrecorded)}): "
            f"applying takes them over, {' and '.join(doing)}")
    return out, [*words, said]


def _not_running(deployed: Topology, desired: Topology, changes: list[ResourceChange],
                 down: dict[str, str]) -> list[ResourceChange]:
    """*changes* (from *deployed* to *desired*) told against what runs, where *down* names what of *deployed* does not
    (role names, ``router``; see :func:`make_plan`): a resource the spec keeps is started again, with no attribute
    changes (no process is there to change) and the class the comparison gave it (disruptive where it gave none); a
    dropped one keeps its delete, marked; none is restarted."""
    if deployed.kv_link is not None:  # the link joins prefill and decode: with one of them down there is none to keep
        joined = [r.name for r in deployed.roles if r.kind in ("prefill", "decode") and r.name in down]
        if joined:
            down["kv_link"] = f"{', '.join(joined)} not running"
    wanted = {f"role.{r.name}": r.describe() for r in desired.roles}  # address → summary
    if desired.kv_link is not None:
        wanted["kv_link"] = desired.kv_link.backend
    if desired.router is not None:
        wanted["router"] = f"{desired.router.impl} on {desired.router.exposure}"
    had = {f"role.{r.name}": r.name for r in deployed.roles}
    had |= {a: a for a, present in (("kv_link", deployed.kv_link), ("router", deployed.router)) if present is not None}
    by_address = {c.address: c for c in changes}
    out = [c for c in changes if c.address not in had or had[c.address] not in down]
    for address, name in had.items():
        if name not in down:
            continue
        why, c = down[name], by_address.get(address)
        if address in wanted:
            out.append(ResourceChange(address=address, action="create", cls=c.cls if c else "disruptive",
                                      reason=f"does not run now ({why}): apply starts it again",
                                      summary=wanted[address], not_running=why))
        elif c is not None:  # (a resource the spec drops is a delete already)
            out.append(c.model_copy(update={"not_running": why}))
    out = [c.model_copy(update={"restarts": tuple(r for r in c.restarts if r not in down)})  # started, not restarted
           if set(down) & set(c.restarts) else c for c in out]
    return sorted(out, key=lambda c: _ORDER.get(c.address, 0))


def _restarted_as_it_runs(deployed: Topology | None, desired: Topology, changes: list[ResourceChange],
                          runs: Mapping[str, Runs]) -> list[ResourceChange]:
    """*changes* with the restarts an unfinished apply's leftovers cause (:attr:`Runs.restart`): a role (or the router)
    the comparison leaves alone gets an update that restarts it, an update its attributes compared with what runs, each
    saying why (:attr:`ResourceChange.runs`); a create restarts it too. A replacement stays as the comparison gives it
    (the attributes a confirmation names)."""
    new = {r.name: r for r in desired.roles} | ({"router": desired.router} if desired.router else {})
    old = {r.name: r for r in deployed.roles} | ({"router": deployed.router} if deployed.router else {}) \
        if deployed is not None else {}
    at = {c.address: i for i, c in enumerate(changes)}
    out = list(changes)
    for name, how in runs.items():
        address = "router" if name == "router" else f"role.{name}"
        if how.restart is None or name not in new:  # (a dropped one: its delete says what apply does)
            continue
        was, want = how.was or old.get(name), new[name]
        attrs: tuple[AttrChange, ...] = ()
        if isinstance(was, RouterTopology) and isinstance(want, RouterTopology):
            attrs = tuple(_router_changes(was, want))
        elif isinstance(was, RoleTopology) and isinstance(want, RoleTopology):
            exposed = want.kind == was.kind == "server" and desired.router is None and (
                deployed is None or deployed.router is None)
            attrs = tuple(_role_changes(was, want, entry_point=exposed))
        c = out[at[address]] if address in at else None
        if c is None:  # (after the roles' changes, or with the router's where make_plan lists it)
            summary = want.describe() if isinstance(want, RoleTopology) else f"{want.impl} on {want.exposure}"
            where = next((i for i, x in enumerate(out) if _ORDER.get(x.address, 0) > _ORDER.get(address, 0)),
                         len(out))
            out.insert(where, ResourceChange(address=address, action="update", cls="disruptive", changes=attrs,
                                             restarts=(name,), reason="apply restarts it: " + how.restart,
                                             summary=summary, runs=how.restart))
            at = {x.address: i for i, x in enumerate(out)}
        elif c.action == "update":
            out[at[address]] = c.model_copy(update={"changes": attrs, "runs": how.restart})
        elif c.action == "create":  # (a first deployment's role, running what another first spec started)
            out[at[address]] = c.model_copy(update={"changes": attrs, "restarts": (name,), "runs": how.restart})
    return out


def not_restartable(desired: Topology, names: Collection[str]) -> list[str]:
    """The names in *names* that are neither a role of *desired* nor ``router`` where it has one."""
    known = {r.name for r in desired.roles} | ({"router"} if desired.router is not None else set())
    return [n for n in names if n not in known]


def _asked_restarts(desired: Topology, changes: list[ResourceChange], restart: Collection[str]) -> list[ResourceChange]:
    """*changes* with a restart of each role (or the router) named in *restart* that they do not start, restart,
    replace or remove already: an update of its own (:attr:`ResourceChange.asked`), in the plan's order."""
    new = {r.name: r for r in desired.roles} | ({"router": desired.router} if desired.router else {})
    out = list(changes)
    for name in dict.fromkeys(restart):
        address = "router" if name == "router" else f"role.{name}"
        own = next((c for c in out if c.address == address), None)
        if own is not None and own.action != "update" or any(name in c.restarts for c in out):
            continue  # (created, replaced or removed by the plan, or restarted by a change already)
        why = f"asked on the command line (--restart {name})"
        if own is not None:  # (an update that restarts nothing: console settings never are a role's)
            out[out.index(own)] = own.model_copy(update={"restarts": (*own.restarts, name), "asked": why,
                                                         "cls": "disruptive" if own.cls == "in_place" else own.cls})
            continue
        want = new[name]
        summary = want.describe() if isinstance(want, RoleTopology) else f"{want.impl} on {want.exposure}"
        where = next((i for i, x in enumerate(out) if _ORDER.get(x.address, 0) > _ORDER.get(address, 0)), len(out))
        out.insert(where, ResourceChange(address=address, action="update", cls="disruptive", restarts=(name,),
                                         reason=why, summary=summary, asked=why))
    return out


def _kept_as_it_runs(desired: Topology, changes: list[ResourceChange],
                     runs: Mapping[str, Runs]) -> list[ResourceChange]:
    """*changes* with what apply keeps as an unfinished apply left it (:attr:`Runs.kept`): the create, update or
    replacement of a role or the router that runs as the spec asks is marked (:attr:`ResourceChange.kept`), the KV
    link's create too once both its ends are kept (apply only proves it again), and so is a deployment-wide or KV link
    change whose restarts are all kept; no change restarts a kept one any more. Not the router, though, while a
    server that is not kept restarts it (under systemd, or to register a new model name)."""
    kept = {n: how.kept for n, how in runs.items() if how.kept is not None}  # role names, router
    if any("router" in c.restarts and any(r != "router" and r not in kept for r in c.restarts) for c in changes):
        kept.pop("router", None)
    why = {("router" if n == "router" else f"role.{n}"): w for n, w in kept.items()}
    ends = [f"role.{r.name}" for r in desired.roles if r.kind in ("prefill", "decode")]
    if ends and all(e in why for e in ends):
        why["kv_link"] = "its prefill and decode run as the unfinished apply started them: apply proves the link again"
    out: list[ResourceChange] = []
    for c in changes:
        left = tuple(r for r in c.restarts if r not in kept)
        said = why.get(c.address) if c.action != "delete" and (c.address != "kv_link" or c.action == "create") else None
        if said is None and c.address in ("deployment", "kv_link") and c.restarts and not left:
            said = f"the unfinished apply started {', '.join(c.restarts)} with this spec's definition already"
        if said is not None:
            out.append(c.model_copy(update={"kept": said, "restarts": left}))
        elif left != c.restarts:
            out.append(c.model_copy(update={"restarts": left,
                                            "kept_restarts": tuple(r for r in c.restarts if r in kept)}))
        else:
            out.append(c)
    return out


def format_value(v: Any) -> str:
    """A plan value as the plan text shows it (GPU lists ``0,1,2,3``, JSON otherwise)."""
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v) if v and all(isinstance(x, int) for x in v) else json.dumps(v)
    return json.dumps(v) if not isinstance(v, int) else str(v)


def render_text(plan: Plan) -> str:
    """Terraform-style text: one block per resource, topology changes in words, a summary line; then, as Terraform
    puts its warnings after the plan, the ports and GPUs apply would refuse (:attr:`Plan.ports_held`,
    :attr:`Plan.gpus_held`), the bind addresses (:attr:`Plan.binds_unusable`) and the secrets
    (:attr:`Plan.secrets_refused`)."""
    text = _render_changes(plan)
    if plan.ports_held:
        text += "\n\n" + _render_ports_held(plan.ports_held)
    if plan.gpus_held:
        text += "\n\n" + render_gpus_held(plan.gpus_held)
    if plan.gpus_unchecked:
        text += (f"\n\nWarning: the GPUs could not be checked for processes outside the deployment: "
                 f"{plan.gpus_unchecked}; `pdctl apply` looks again before its first step, and goes ahead with a "
                 "warning if it cannot tell either")
    if plan.ports_ephemeral:
        text += (f"\n\nWarning: {plan.ports_ephemeral}: any outbound connection on the host may take one, and its "
                 "role then cannot start or restart there; reserve them (`sysctl net.ipv4.ip_local_reserved_ports`) "
                 "or give the roles ports outside that range")
    if plan.binds_unusable:
        text += ("\n\nWarning: `pdctl apply` stops before its first step (exit 3, once any confirmation it needs is "
                 f"given): {plan.binds_unusable}")
    if plan.secrets_refused:
        text += f"\n\nWarning: `pdctl apply` refuses the spec in this environment (exit 1): {plan.secrets_refused}"
    if plan.capacity:
        from pdctl.statemachine.capacity import render_plan_capacity

        text += "\n\n" + render_plan_capacity(plan.capacity)
    return text


def _render_ports_held(held: tuple[PortHeld, ...]) -> str:
    lines = ["Warning: ports this deployment will listen on are held outside it: while they are, `pdctl apply` stops "
             "before its first step (exit 3, once any confirmation it needs is given), starting nothing:"]
    for x in held:
        how = f": it runs under {x.applied_elsewhere}" if x.applied_elsewhere else ""
        own = "" if x.applied_elsewhere is None else f"; this deployment's own process, applied another way{how}"
        other = f", started for {x.other_deployment}" if x.other_deployment else ""
        conn = "" if x.listening else CONNECTION_WORDS
        lines.append(f"  ! {x.role} needs port {x.port} at {x.step}, held by PID {x.pid or '?'} "
                     f"({x.command or 'unknown'}){conn}{own}{other}")
    if all(x.applied_elsewhere is not None for x in held):
        lines.append(f"  hint: {APPLIED_ELSEWHERE_HINT}")
    elif any(x.other_deployment for x in held):
        lines.append(f"  hint: {OTHER_DEPLOYMENT_HINT}")
    else:
        lines.append("  hint: stop those processes (another deployment?) or give the roles other ports in the spec")
    if not all(x.listening for x in held):
        lines.append(f"  hint: {EPHEMERAL_PORT_HINT}")
    return "\n".join(lines)


def gpu_holder(x: GpuHeld) -> str:
    """One held GPU in words, as plan's warning and apply's refusal name it."""
    mem = f", {x.used_mib} MiB" if x.used_mib is not None else ""
    who = x.command or "not in the host's /proc"
    own = "" if x.applied_elsewhere is None else ("; this deployment's own process, applied another way"
                                                  + (f": it runs under {x.applied_elsewhere}" if x.applied_elsewhere else ""))
    other = f", started for {x.other_deployment}" if x.other_deployment else ""
    return f"{x.role} needs GPU {x.gpu} at {x.step}, used by PID {x.pid} ({who}{mem}){own}{other}"


HIDDEN_GPU_PROCESS = ("apply only warns: nvidia-smi may name PIDs of another PID namespace (a container's), this "
                      "deployment's own servers included")


def gpus_held_hint(held: Sequence[GpuHeld]) -> str:
    """The fix for GPUs held outside the deployment, by who holds them."""
    if all(x.applied_elsewhere is not None for x in held):
        return APPLIED_ELSEWHERE_HINT
    if any(x.other_deployment for x in held):
        return ("another pdctl deployment runs on these GPUs (its unit is named above): `pdctl down` its spec, or give "
                "the roles other GPUs in the spec")
    return "stop those processes (nvidia-smi lists them) or give the roles other GPUs in the spec"


def render_gpus_held(held: tuple[GpuHeld, ...]) -> str:
    """Plan's warning of GPUs in use outside the deployment (:attr:`Plan.gpus_held`)."""
    seen = [x for x in held if x.command]
    lines = ["Warning: GPUs this deployment's roles will run on are in use outside it"
             + (": while they are, `pdctl apply` stops before its first step (exit 3, once any confirmation it needs "
                "is given), starting nothing:" if seen else ":")]
    lines += [f"  ! {gpu_holder(x)}" + ("" if x.command else f"; {HIDDEN_GPU_PROCESS}") for x in held]
    lines.append(f"  hint: {gpus_held_hint(held)}")
    return "\n".join(lines)


def _render_changes(plan: Plan) -> str:
    lines: list[str] = []
    if not plan.has_changes and plan.unsettled:
        lines.append(f"No changes to what was recorded as deployed for {plan.deployment!r}, but {plan.unsettled}.")
        lines.append("`pdctl apply` re-proves every step and restarts what does not serve as specified.")
        lines.append(f"plan id: {plan.plan_id}")
        return "\n".join(lines)
    if not plan.has_changes:
        lines.append(f"No changes. Deployment {plan.deployment!r} matches the spec.")
        lines.append(f"plan id: {plan.plan_id}")
        return "\n".join(lines)
    lines.append(f"pdctl will perform the following actions on deployment {plan.deployment!r}:")
    lines.append("")
    verb = {"create": "created", "update": "updated in place", "replace": "replaced", "delete": "destroyed"}
    for c in plan.changes:
        extra = f" ({c.cls})"
        if c.kept is not None:
            lines.append(f"  # {c.address} runs already as specified{extra}: apply keeps it")
        elif c.gone:
            lines.append(f"  # {c.address} is gone already{extra}: nothing left to destroy")
        elif c.not_running is not None and c.action == "create":
            lines.append(f"  # {c.address} will be {'set up' if c.address == 'kv_link' else 'started'} again{extra}")
        elif (c.runs is not None or c.asked is not None) and c.action in ("create", "update"):
            lines.append(f"  # {c.address} will be restarted{extra}")
        else:
            lines.append(f"  # {c.address} will be {verb[c.action]}{extra}")
        lines.append(f"{c.symbol:>3} {c.address}: {c.summary}")
        if c.kept is not None:  # (its attributes are what that apply changed already)
            lines.append(f"      kept: {c.kept}")
            if c.restarts:  # (the router a kept server's new model name needs restarted)
                lines.append(f"      restarts: {', '.join(c.restarts)}")
            lines.append("")
            continue
        if c.not_running is not None:
            lines.append(f"      does not run now: {c.not_running}")
        if c.runs is not None:
            lines.append(f"      runs now: {c.runs}")
        if c.asked is not None:
            lines.append(f"      asked: {c.asked}")
        for a in c.changes:
            mark = "  # forces replacement" if c.action == "replace" and a.cls == "topology" else ""
            lines.append(f"      ~ {a.path}: {format_value(a.before)} → {format_value(a.after)}{mark}")
        if c.restarts and (c.action == "update" or c.runs is not None):
            lines.append(f"      restarts: {', '.join(c.restarts)}")
        if c.kept_restarts:
            lines.append(f"      kept: {', '.join(c.kept_restarts)}, as the unfinished apply started "
                         f"{'it' if len(c.kept_restarts) == 1 else 'them'} with this spec's definition")
        lines.append("")
    if plan.topology_changes:
        lines.append(f"Topology changes (confirm with --confirm-topology {plan.plan_id}):")
        for w in plan.topology_changes:
            lines.append(f"  ! {w}")
        lines.append("")
    impact = plan.client_impact()
    if impact:
        lines.append("Clients while it applies:")
        lines += [f"  ! {w}" for w in impact]
        lines.append("")
    add, change, destroy = plan.counts()
    kept = len(plan.kept())
    lines.append(f"Plan: {add} to add, {change} to change, {destroy} to destroy"
                 + (f", {kept} kept as the unfinished apply left it." if kept else "."))
    first = plan.cls == "topology" and not plan.requires_confirmation
    lines.append(f"plan id: {plan.plan_id}   class: {plan.cls}"
                 + ("   (a first deployment: nothing deployed to alter, no --confirm-topology needed)" if first else ""))
    if plan.since_down:
        lines.append(f"note: {plan.since_down}")
    return "\n".join(lines)
