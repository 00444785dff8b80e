"""systemd unit files for a deployment: one ``.service`` per role, one ``.target`` grouping them.

Readiness gate: ``ExecStartPost=`` health-wait, not a separate readiness unit
----------------------------------------------------------------------------
SGLang never notifies systemd (no ``sd_notify``), so ``Type=exec`` alone would call a server
"started" the moment its Python begins importing, twenty minutes before ``/health`` answers.
Each role therefore carries an ``ExecStartPost=`` that polls its readiness URL (servers:
``/health``, 503 while loading; router: ``/readiness``, 503 until it has healthy workers) and exits
0 on the first 200. systemd keeps the unit ``activating`` until that command returns, so:

* ``active`` *means* ready — one unit, one state; ``systemctl is-active`` and every
  ``After=`` on it (the router on both servers) need no second unit to consult;
* the gate runs again on every (re)start, including ``Restart=on-failure`` — a restarted server is
  not "up" again until it can serve;
* it is bounded by the unit's own ``TimeoutStartSec=`` (and passes the same number to the script),
  and a gate that times out fails the unit, which ``Restart=on-failure`` and the start limit treat
  like any failed start; the main process dying while the gate waits fails the start at once.

A separate ``*-ready.service`` (oneshot, ``RemainAfterExit=``) would double the units, stay
``active`` after its server died (it has no main process to lose) and need its own restart wiring
(``PartOf=``/``BindsTo=``) to re-run after a restart. The gate is a short inline Python program
run by the engine's own interpreter (``readiness_python``), so it needs nothing on the host that
the role does not already need — not curl, not pdctl.

Ordering and restarts
---------------------
Prefill and decode have no ordering between them (decode contacts the prefill bootstrap only at
the first request), so they start in parallel. The router ``Wants=`` and is ``After=`` both: a
start of the router pulls them in and starts once their start jobs ended (a server that failed does
not stop it; its own readiness gate then waits for workers). Not ``Requires=``:
systemd propagates a stop or restart of a server along it (seen on systemd 252), so every restart
of one replica — ``Restart=on-failure``, or pdctl's rolling restart — restarted the router and cut
off the replicas still serving. The router keeps running, as under the process supervisor, and
sees the worker leave and come back. ``PartOf=`` the target makes
``systemctl stop/restart pdctl-<name>.target`` reach every role.

Quoting
-------
Values reach the process unchanged: argv words and ``Environment=`` assignments are written
bare when they only hold ``[A-Za-z0-9_+=:,./@-]``, otherwise in double quotes with C escapes
(``\\\\``, ``\\"``, ``\\n``, ``\\t``, ``\\xNN`` for other control characters); ``%`` is doubled
everywhere (specifiers) and ``$`` is doubled in ``ExecStart=`` (systemd expands ``$VAR`` there,
not in ``Environment=``). Secrets never enter a unit: they go to the ``EnvironmentFile=``,
rendered by :func:`render_env_file` and written 0600 by the manager.

Ownership
---------
Every file starts with :data:`MARKER`. A manager never overwrites or removes a unit file that
lacks it (:func:`is_pdctl_unit`): that unit is someone else's.
"""

from __future__ import annotations

import re

from ._types import ServiceSpec, TargetSpec, UnitSet, cpu_list

__all__ = [
    "MARKER",
    "unit_deployment",
    "READINESS_GATE",
    "env_assignment",
    "exec_line",
    "exec_word",
    "is_pdctl_unit",
    "render_env_file",
    "render_service",
    "render_target",
    "unit_files",
]

MARKER = "# pdctl-managed:"
"""First characters of every file pdctl writes; a file without them is foreign."""

READINESS_GATE = (
    "import sys,time,urllib.request as r\n"
    "o=r.build_opener(r.ProxyHandler({}));d=time.monotonic()+float(sys.argv[2])\n"
    "while time.monotonic()<d:\n"
    " try:o.open(sys.argv[1],timeout=5);sys.exit(0)\n"
    " except Exception:time.sleep(1)\n"
    "sys.exit(1)"
)
"""``python -c READINESS_GATE URL TIMEOUT_S``: exit 0 on the first 2xx from URL (no proxy),
1 after TIMEOUT_S seconds. urllib raises on 4xx/5xx, so 503-while-loading keeps it waiting."""

_SAFE = re.compile(r"[A-Za-z0-9_+=:,./@%$-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _c_escape(s: str) -> str:
    out = []
    for ch in s:
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _check_text(s: str, what: str) -> None:
    if "\x00" in s:
        raise ValueError(f"{what}: a NUL byte cannot reach a process ({s!r})")


def exec_word(s: str) -> str:
    """One argv word for ``ExecStart=``/``ExecStartPost=``: ``%``→``%%``, ``$``→``$$``, quoted
    with C escapes unless it only holds safe characters. ``""`` for the empty string."""
    _check_text(s, "argv word")
    t = s.replace("%", "%%").replace("$", "$$")
    if t and _SAFE.fullmatch(t):
        return t
    return '"' + _c_escape(t) + '"'


def exec_line(argv: tuple[str, ...] | list[str]) -> str:
    """A whole command line for an ``Exec*=`` setting."""
    if not argv or not argv[0].startswith("/"):
        raise ValueError(f"argv[0] must be an absolute path: {list(argv[:1])!r}")
    return " ".join(exec_word(w) for w in argv)


def env_name(key: str) -> str:
    """Check an environment variable name as units and env files take it (POSIX portable names: letters, digits
    and ``_``, not starting with a digit; systemd.exec(5) ``Environment=``) and return it. Raises ValueError."""
    if not _ENV_KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not an environment variable name: use letters, digits and '_', not starting "
                         "with a digit")
    return key


def env_assignment(key: str, value: str) -> str:
    """One ``Environment=`` value, ``KEY=VALUE``: ``%`` doubled, quoted when not all safe."""
    env_name(key)
    _check_text(value, f"environment variable {key}")
    t = f"{key}={value}".replace("%", "%%")
    if _SAFE.fullmatch(t) and "$" not in t:
        return t
    return '"' + _c_escape(t) + '"'


def _plain(value: str, what: str) -> str:
    """A single-valued setting (description, path): no newlines; ``%`` doubled."""
    if any(ord(c) < 0x20 for c in value):
        raise ValueError(f"{what}: control characters cannot appear in a unit setting ({value!r})")
    return value.replace("%", "%%")


def _path(value: str, what: str) -> str:
    if not value.startswith("/") or re.search(r"[\s\"'\\]", value):
        raise ValueError(f"{what}: need an absolute path without spaces, quotes or backslashes: {value!r}")
    return _plain(value, what)


def _secs(x: float) -> str:
    return f"{x:g}"


def _header(deployment: str, role: str) -> list[str]:
    return [
        f"{MARKER} deployment={deployment} role={role}",
        "# Written by pdctl, which rewrites or removes this file: change the spec, not this file.",
    ]


def render_service(spec: ServiceSpec, *, scope: str = "system") -> str:
    """The ``.service`` file of one role. ``scope`` "system" adds the network-online ordering
    (a user manager has no network-online.target)."""
    u = [*_header(spec.deployment, spec.role), "[Unit]", f"Description={_plain(spec.description, 'Description')}"]
    if spec.part_of:
        u.append(f"PartOf={spec.part_of}")
    after = []
    if scope == "system":
        u.append("Wants=network-online.target")
        after.append("network-online.target")
    if spec.requires:
        u.append("Wants=" + " ".join(spec.requires))
        after.extend(spec.requires)
    if after:
        u.append("After=" + " ".join(after))
    u.append(f"StartLimitIntervalSec={spec.start_limit_interval_s}")
    u.append(f"StartLimitBurst={spec.start_limit_burst}")

    s = ["", "[Service]", "Type=exec", f"ExecStart={exec_line(spec.argv)}"]
    if spec.readiness_url:
        if not spec.readiness_python:
            raise ValueError(f"{spec.name}: a readiness URL needs readiness_python to run the gate")
        gate = (spec.readiness_python, "-c", READINESS_GATE, spec.readiness_url, str(spec.timeout_start_s))
        s.append(f"ExecStartPost={exec_line(gate)}")
    for k, v in spec.env:
        s.append(f"Environment={env_assignment(k, v)}")
    if spec.secrets_file and spec.secrets:
        s.append(f"EnvironmentFile={_path(spec.secrets_file, 'EnvironmentFile')}")
    if spec.working_dir:
        s.append(f"WorkingDirectory={_path(spec.working_dir, 'WorkingDirectory')}")
    if spec.log_path:
        s.append(f"StandardOutput=append:{_path(spec.log_path, 'StandardOutput')}")
    s.append(f"SyslogIdentifier={spec.name.removesuffix('.service')}")
    if spec.user is not None:
        if scope != "system":
            raise ValueError(f"{spec.name}: User={spec.user} needs the system manager (a user manager runs every unit "
                             "as its own user)")
        s.append(f"User={_plain(spec.user, 'User')}")
    if spec.numa_node is not None:
        s += ["NUMAPolicy=bind", f"NUMAMask={int(spec.numa_node)}"]
    if spec.cpu_affinity:
        try:
            s.append(f"CPUAffinity={cpu_list(spec.cpu_affinity)}")
        except ValueError as exc:
            raise ValueError(f"{spec.name}: {exc}") from None
    if spec.memlock_infinity:
        s.append("LimitMEMLOCK=infinity")
    s += [
        "Restart=on-failure",
        f"RestartSec={_secs(spec.restart_sec)}",
        *([f"RestartPreventExitStatus={' '.join(str(c) for c in spec.restart_prevent_exit_status)}"]
          if spec.restart_prevent_exit_status else []),
        f"TimeoutStartSec={spec.timeout_start_s}",
        f"TimeoutStopSec={spec.timeout_stop_s}",
        "KillMode=control-group",
    ]
    return "\n".join(u + s) + "\n"


def render_target(target: TargetSpec, *, scope: str = "system") -> str:
    """The deployment's ``.target``: ``Wants=`` every service (targets order themselves after what
    they want, so the target is active once every role passed its gate)."""
    lines = [*_header(target.deployment, "target"), "[Unit]", f"Description={_plain(target.description, 'Description')}"]
    if target.wants:
        lines.append("Wants=" + " ".join(target.wants))
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if scope == 'system' else 'default.target'}"]
    return "\n".join(lines) + "\n"


def render_env_file(secrets: tuple[tuple[str, str], ...] | list[tuple[str, str]], *, deployment: str = "") -> str:
    """An ``EnvironmentFile=`` body: ``KEY='value'`` (single quotes keep everything literal,
    newlines too), or double quotes with ``\\ " ` $`` escaped when the value holds a ``'``."""
    lines = [f"{MARKER} deployment={deployment} role=secrets", "# Secrets: mode 0600. Written by pdctl."]
    for k, v in secrets:
        if not _ENV_KEY.fullmatch(k):
            raise ValueError(f"environment variable name {k!r}: use letters, digits and '_'")
        _check_text(v, f"secret {k}")
        if "'" not in v:
            lines.append(f"{k}='{v}'")
        else:
            esc = "".join("\\" + c if c in '\\"`$' else c for c in v)
            lines.append(f'{k}="{esc}"')
    return "\n".join(lines) + "\n"


def is_pdctl_unit(text: str | bytes) -> bool:
    """True when a file's first line is pdctl's :data:`MARKER`."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text.startswith(MARKER)


def unit_deployment(text: str | bytes) -> str | None:
    """The deployment a pdctl unit (or secrets) file belongs to, from its :data:`MARKER` line
    (``# pdctl-managed: deployment=NAME role=ROLE``); None for a file pdctl did not write."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not is_pdctl_unit(text):
        return None
    first = text.split("\n", 1)[0][len(MARKER):].split()
    return next((w.removeprefix("deployment=") for w in first if w.startswith("deployment=")), None)


def unit_files(units: UnitSet, *, scope: str = "system") -> dict[str, str]:
    """``{unit name: file text}`` for a whole :class:`UnitSet`, services first, target last."""
    out = {s.name: render_service(s, scope=scope) for s in units.services}
    out[units.target.name] = render_target(units.target, scope=scope)
    return out
