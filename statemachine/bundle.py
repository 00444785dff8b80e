"""``pdctl support-bundle``: what an operator attaches to a bug report, as one ``.tar.gz``.

Everything pdctl knows about one deployment, read, never changed (status's canary is one token through the router,
as ``pdctl status`` sends it): the spec, the plan (text and JSON), the journal and
audit log, ``status --json``, each role's and the router's last log lines, each server's ``/server_info``, the
router's ``/workers`` and ``/metrics``, the unit files, ``nvidia-smi -q``, the kernels' manifest and the versions of
pdctl, SGLang, smg and NIXL on the host.

Why the shape: a bundle is asked for when something is broken, so no part of it may stop the rest. Each member is
read by its own function with its own time bound (HTTP reads and host commands ``timeout_s``; status, logs and unit
files the bounds of ``pdctl status`` and the service manager; a log its last *lines* lines read from its end); a failure becomes that member's error, written into ``MANIFEST`` (what each
file is, ok / absent / error, and why), never raised. Secrets are redacted after collection, over every member's
bytes, so that no collector has to remember to: each value pdctl's units would get as a secret (``[secrets]``, read
from pdctl's environment as apply reads them; env-table values whose name says secret), each value in the secrets
files installed on the host (what the running processes got), raw and as JSON and env files escape it, becomes
:data:`REDACTED`. The archive is written to a temporary file beside *out* (mode 0600: logs are operational data) and
renamed over it, so that *out* is either the whole bundle or untouched.

Raises only for what leaves no bundle to write: :class:`OSError` where *out* cannot be written.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import tarfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["REDACTED", "Bundle", "Member", "collect", "redact", "secret_values", "write_bundle"]

REDACTED = "***REDACTED***"
"""What each secret value is replaced with, everywhere in the archive."""

AUDIT_TAIL_BYTES = 1 << 20
"""The most bytes of the audit log taken, from its end (it is appended to for the deployment's whole life)."""


@dataclass
class Member:
    """One file of the bundle: *name* inside it, *what* it is (for ``MANIFEST``), its bytes, and its ``status``:
    ``ok``, ``absent`` (nothing to read: not installed, not deployed; *data* says why) or ``error`` (*error* says
    why; *data* holds the same words)."""

    name: str
    what: str
    data: bytes = b""
    status: str = "ok"
    error: str | None = None
    took_s: float = 0.0


class Absent(Exception):
    """Raised by a collector: nothing of that kind to read here (recorded as ``absent``, not as an error)."""


@dataclass
class Bundle:
    """The collected members (before redaction) and the secret values to redact (key → value)."""

    members: list[Member] = field(default_factory=list)
    secrets: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, what: str, fn: Callable[[], bytes | str | Any]) -> Member:
        """Run *fn* and keep what it returns (bytes, text, or a JSON value) as member *name*; a raised
        :class:`Absent` or any error is recorded as its status, never raised."""
        t0 = time.monotonic()
        m = Member(name, what)
        try:
            got = fn()
            m.data = got if isinstance(got, bytes) else got.encode() if isinstance(got, str) else \
                (json.dumps(got, indent=1, default=str) + "\n").encode()
        except Absent as exc:
            m.status, m.data = "absent", f"absent: {exc}\n".encode()
        except Exception as exc:  # noqa: BLE001 - a bundle is asked for when things are broken: record, go on
            m.status, m.error = "error", f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"
            m.data = f"error: {m.error}\n\n{traceback.format_exc()}".encode()
        m.took_s = time.monotonic() - t0
        self.members.append(m)
        return m


# --- secrets ---------------------------------------------------------------------------------------


def secret_values(dep: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{label: value}`` of every secret value *dep* (a :class:`~pdctl.statemachine.spec.Deployment`) hands its
    processes: ``[secrets]`` entries (``env:NAME`` read from *environ*, default ``os.environ``; unset ones left out)
    and the values of its env tables (engine, router, each role) whose variable name says secret (the units move those
    to the secrets file too, ``launch.split_secrets``; the rules warn about a wider set of names, taken here too),
    except switch values (``0``, ``true``, ``off``…: ``TOKENIZERS_PARALLELISM=false`` is no secret, and replacing
    ``false`` would mangle every JSON member). Empty values are left out."""
    from pdctl.statemachine.launch import split_secrets
    from pdctl.statemachine.rules import is_secret_env, is_switch_value
    from pdctl.statemachine.spec import secret_value

    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, ref in dep.secret_refs().items():
        v = secret_value(ref, env)
        if v:
            out[f"secrets.{key}"] = v
    tables = [("engine.env", dep.engine.env), ("router.env", dep.router.env if dep.router else {})]
    tables += [(f"{name}.env", role.env) for name, _k, role in dep.roles()]
    for where, table in tables:
        moved = split_secrets(dict(table))[1]
        for key, v in table.items():
            if is_secret_env(key, v) or (key in moved and not is_switch_value(v)):
                out[f"{where}.{key}"] = v
    return out


def _recorded_secrets(node: Any, where: str, out: dict[str, str]) -> None:
    """Add to *out* every ``NAME: value`` of an ``env`` table in the JSON *node* whose name and value look like a
    credential (:func:`~pdctl.statemachine.rules.is_secret_env`; ``[secrets]`` are recorded as digests)."""
    from pdctl.statemachine.rules import is_secret_env

    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and where.endswith(".env") and is_secret_env(str(k), v):
                out.setdefault(f"{where}.{k}", v)
            else:
                _recorded_secrets(v, f"{where}.{k}", out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _recorded_secrets(v, f"{where}[{i}]", out)


def _forms(value: str) -> list[bytes]:
    """*value* as it may appear in a member: raw, JSON-escaped, env-file-escaped (UTF-8)."""
    forms = {value, json.dumps(value)[1:-1], "".join("\\" + c if c in '\\"`$' else c for c in value)}
    return [f.encode() for f in forms if f]


def redact(data: bytes, values: Iterable[str]) -> tuple[bytes, int]:
    """*data* with each of *values* (in each of its :func:`_forms`, longest first) replaced by :data:`REDACTED`;
    and how many replacements were made."""
    n = 0
    for form in sorted({f for v in values for f in _forms(v)}, key=len, reverse=True):
        k = data.count(form)
        if k:
            n += k
            data = data.replace(form, REDACTED.encode())
    return data, n


# --- collection ------------------------------------------------------------------------------------

_VERSIONS_PY = """import importlib.metadata as m, json, sys
out = {"python": sys.version.split()[0]}
for group in (("pdctl",), ("sglang",), ("smg",), ("sglang-router",), ("nixl", "nixl-cu12", "nixl-cu13")):
    found = None
    for n in group:
        try:
            found = f"{m.version(n)}" + ("" if n == group[0] else f" ({n})")
            break
        except m.PackageNotFoundError:
            pass
    out[group[0]] = found or "absent"
print(json.dumps(out))
"""
"""Run by the engine's Python on the host: the installed versions of what a deployment runs, ``absent`` for each
distribution not installed (NIXL ships as ``nixl`` or a CUDA-specific ``nixl-cuXX``)."""


def _text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def collect(loaded: Any, *, lines: int = 200, timeout_s: float = 10.0,
            environ: Mapping[str, str] | None = None) -> Bundle:
    """Everything of *loaded* (a :class:`~pdctl.statemachine.service.Loaded`) a bundle holds, each member read
    within *timeout_s* seconds (a log: its last *lines* lines). Never raises for a part that cannot be read."""
    import httpx

    from pdctl.statemachine import launch, probes, service
    from pdctl.statemachine.rules import is_secret_env, is_switch_value
    from pdctl.units import parse_env_file
    from pdctl.statemachine.plan import render_text
    from pdctl.statemachine.topology import dial_host, topology_of

    dep = loaded.deployment
    b = Bundle(secrets=secret_values(dep, environ))
    spec_name = Path(loaded.path).name
    b.add(f"spec/{spec_name}", "the spec, as written", lambda: Path(loaded.path).read_bytes())
    j = loaded.journal
    b.add("journal.json", f"the journal ({j.path})",
          lambda: j.path.read_bytes() if j.path.exists() else _absent(f"{j.path}: not deployed from here"))

    def audit() -> bytes:
        if not j.audit_path.exists():
            raise Absent(f"{j.audit_path}: no apply or down recorded")
        with open(j.audit_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - AUDIT_TAIL_BYTES))
            return f.read()

    b.add("audit.log", f"the audit log, its last {AUDIT_TAIL_BYTES // 1024} KiB ({j.audit_path})", audit)
    try:
        state = j.read()
    except Exception as exc:  # noqa: BLE001 - a damaged journal is what the bundle is for: said in its member
        state = None
        b.add("journal.error", "why the journal could not be read", lambda: f"{type(exc).__name__}: {exc}\n")
    topo = (state.target or state.deployed if state is not None else None) or topology_of(dep)
    try:  # the values the journal records as written (an env table's since changed in the spec), wherever they sit
        _recorded_secrets(json.loads(j.path.read_bytes()), "journal", b.secrets)
    except (OSError, ValueError):
        pass

    logs = None
    opened: list[Any] = []
    try:
        logs = service.RoleLogs(loaded)
        opened.append(logs)
        host = logs.host
    except Exception as exc:  # noqa: BLE001 - another machine's journal, a host that cannot be reached: said, go on
        b.add("host.error", "why the deployment's service manager could not be asked",
              lambda: f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}\n")
        host = service.deployment_host(dep)
        opened.append(host)
    client = httpx.Client(trust_env=False, transport=host.http_transport(), timeout=timeout_s)
    try:
        try:  # the values the running processes got (an earlier apply's, rotated since)
            for svc in launch.unit_set_for(dep, state_dir=str(j.dir)).services:
                if svc.secrets_file and host.exists(svc.secrets_file):
                    text = host.read_file(svc.secrets_file).decode(errors="replace")
                    for key, v in parse_env_file(text).items():
                        if not is_switch_value(v):  # (everything in it is a secret, but a switch value)
                            b.secrets.setdefault(f"{svc.secrets_file}:{key}", v)
        except Exception:  # noqa: BLE001 - unreadable (another account's 0600 file): the spec's values remain
            pass

        def plan() -> Any:
            return service.plan_spec(loaded, state, host=host)

        planned: list[Any] = []
        b.add("plan.json", "the plan from what is deployed to the spec, as `pdctl plan --json`",
              lambda: planned.append(plan()) or planned[0].to_json() + "\n")
        b.add("plan.txt", "the same plan, as `pdctl plan` prints it",
              lambda: render_text(planned[0]) + "\n" if planned else _absent("no plan: see plan.json"))
        b.add("status.json", "`pdctl status --json`", lambda: service.status(loaded, client=client, host=host))

        units = logs.units if logs is not None else service.unit_names(topo)
        for role, unit in units.items():
            b.add(f"logs/{role}.log", f"the last {lines} lines of {unit}'s log",
                  lambda unit=unit: _text(logs.manager.logs(unit, lines=lines)) if logs is not None
                  else _absent("the service manager could not be asked: see host.error"))
        for r in topo.roles:
            b.add(f"server_info/{r.name}.json", f"GET {r.url}/server_info",
                  lambda r=r: probes.server_info(client, r.url, timeout=timeout_s))
        if topo.router is not None:
            rt = topo.router
            s = rt.settings
            metrics_url = (f"http://{dial_host(str(s.get('prometheus_host') or '127.0.0.1'))}:"
                           f"{s.get('prometheus_port') or rt.port}/metrics")
            b.add("router/workers.json", f"GET {rt.url}/workers",
                  lambda: probes.get_json(client, f"{rt.url}/workers", timeout=timeout_s))
            b.add("router/metrics.txt", f"GET {metrics_url}",
                  lambda: probes.metrics(client, metrics_url, timeout=timeout_s))
        for unit in [*units.values(), launch.target_name(dep)]:
            b.add(f"units/{unit}", f"{unit} as installed",
                  lambda unit=unit: (logs.manager.installed_text(unit) or _absent(f"{unit} is not installed"))
                  if logs is not None else _absent("the service manager could not be asked: see host.error"))

        def nvidia_smi() -> str:
            if host.which("nvidia-smi") is None:
                raise Absent(f"nvidia-smi is not on {host.name}'s PATH")
            res = host.run(["nvidia-smi", "-q"], timeout=timeout_s, check=False)
            return res.stdout + (f"\n[exit {res.returncode}] {res.stderr}" if res.returncode else "")

        b.add("nvidia-smi-q.txt", f"`nvidia-smi -q` on {host.name}", nvidia_smi)

        def manifest() -> bytes:
            path = service.kernels_build_command(dep)[1]
            if not host.exists(path):
                raise Absent(f"{path} does not exist on {host.name} (kernels enabled: {dep.kernels.enabled})")
            return host.read_file(path)

        b.add("kernels-manifest.json", "the kernels' manifest", manifest)

        def versions() -> dict[str, Any]:
            from importlib.metadata import version

            out: dict[str, Any] = {"pdctl (writing this bundle)": version("pdctl")}
            try:
                res = host.run([launch.python_for(dep), "-c", _VERSIONS_PY], timeout=timeout_s, check=False)
                out["host"] = json.loads(res.stdout) if res.ok else f"error: exit {res.returncode}: {res.stderr[-500:]}"
            except Exception as exc:  # noqa: BLE001 - recorded where the versions would be
                out["host"] = f"error: {type(exc).__name__}: {exc}"
            if dep.router_impl == "smg":
                try:
                    res = host.run([launch.router_executable(dep), "--version"], timeout=timeout_s, check=False)
                    out["smg --version"] = (res.stdout or res.stderr).strip() if res.ok else \
                        f"error: exit {res.returncode}: {res.stderr.strip()[-500:]}"
                except Exception as exc:  # noqa: BLE001
                    out["smg --version"] = f"absent or failing: {getattr(exc, 'message', None) or exc}"
            return out

        b.add("versions.json", f"versions of pdctl, SGLang, smg and NIXL on {host.name}", versions)
    finally:
        client.close()
        for o in opened:
            o.close()
    return b


def _absent(why: str) -> bytes:
    raise Absent(why)


def _manifest(members: list[Member], redacted: dict[str, int], secrets: Mapping[str, str]) -> bytes:
    rows = [f"{'member':<44} {'status':<7} {'bytes':>9} {'s':>5}  what / error"]
    for m in members:
        rows.append(f"{m.name:<44} {m.status:<7} {len(m.data):>9} {m.took_s:>5.1f}  {m.what}"
                    + (f"\n{'':<44} {'':<7} {'':>9} {'':>5}  error: {m.error}" if m.error else ""))
    said = ", ".join(sorted(k for k in secrets if not k.startswith("/"))) or "none"
    files = sum(1 for k in secrets if k.startswith("/"))
    rows += ["", f"secrets redacted as {REDACTED}: {said}" + (f"; and {files} value(s) of the installed secrets files"
                                                                if files else ""),
             f"replacements made: {sum(redacted.values())} in {len(redacted)} member(s)"]
    return ("\n".join(rows) + "\n").encode()


def write_bundle(loaded: Any, out: str | os.PathLike[str], *, lines: int = 200, timeout_s: float = 10.0,
                 environ: Mapping[str, str] | None = None) -> list[Member]:
    """Collect (:func:`collect`), redact and write the bundle of *loaded* to *out* (gzip'd tar, atomically: a
    temporary file beside it, renamed over it). Members sit under ``pdctl-support-<name>-<UTC time>/``, with
    ``MANIFEST`` (a table) and ``MANIFEST.json``. Returns the members as written. Raises :class:`OSError` where *out*
    cannot be written (nothing is left behind)."""
    b = collect(loaded, lines=lines, timeout_s=timeout_s, environ=environ)
    values = list(b.secrets.values())
    redacted: dict[str, int] = {}
    for m in b.members:
        m.data, n = redact(m.data, values)
        if m.error:
            m.error = redact(m.error.encode(), values)[0].decode(errors="replace")
        if n:
            redacted[m.name] = n
    manifest_json = json.dumps({"deployment": loaded.deployment.name, "created": time.time(),
                                "redacted": sorted(k for k in b.secrets if not k.startswith("/")),
                                "members": [{"name": m.name, "what": m.what, "status": m.status, "error": m.error,
                                             "bytes": len(m.data), "took_s": round(m.took_s, 3)}
                                            for m in b.members]}, indent=1).encode()
    members = [*b.members,
               Member("MANIFEST", "this table", redact(_manifest(b.members, redacted, b.secrets), values)[0]),
               Member("MANIFEST.json", "the same, as JSON", redact(manifest_json, values)[0])]
    top = f"pdctl-support-{loaded.deployment.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    now = time.time()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                for m in members:
                    info = tarfile.TarInfo(posixpath.join(top, m.name))
                    info.size, info.mtime, info.mode = len(m.data), int(now), 0o600
                    tar.addfile(info, io.BytesIO(m.data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return members
