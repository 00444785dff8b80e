"""Validate an export's objects without a cluster: the custom resources against the pinned CRD schemas in
``statemachine/data/k8s/`` (see its README for their source and version), Kubernetes' own objects and every pod
template against Kubernetes' schemas with PyPI ``kubernetes-validate`` (the ``k8s`` extra), both strictly (an unknown
field is an error, as ``kubectl apply``'s default server-side field validation makes it), and the names and labels
the API server checks by its own rules (Kubernetes, "Object Names and IDs" and "Labels and Selectors").

Not checked (only an API server or a cluster can): the CRDs' CEL rules (``x-kubernetes-validations``), admission
webhooks, and whether anything schedules or runs.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from typing import Any

from pdctl.statemachine.errors import PdctlError

__all__ = ["CRD_SCHEMAS", "KUBERNETES_VERSION", "against", "validate"]

KUBERNETES_VERSION = "1.34.0"
"""The Kubernetes release whose schemas the core objects are validated against: the API version sgl-project/rbg
v0.7.0 builds on (``k8s.io/api v0.34.1`` in its go.mod; kubernetes-sigs/lws v0.10.0 builds on v0.36.3), so the
manifests use nothing newer than either."""

CRD_SCHEMAS = {
    ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"): "rbg-v0.7.0-rolebasedgroup-v1alpha2.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "lws-v0.10.0-leaderworkerset-v1.json",
}

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


def _kubernetes_validate():  # noqa: ANN202
    try:
        import kubernetes_validate
    except ImportError:
        raise PdctlError("validating an export needs kubernetes-validate, which is not installed",
                         hint="pip install 'pdctl[k8s]'") from None
    return kubernetes_validate


def against() -> list[str]:
    """What :func:`validate` checks against, in words (with versions), for the command's output."""
    kv = _kubernetes_validate()
    out = [f"Kubernetes {KUBERNETES_VERSION} schemas (kubernetes-validate {kv.__version__}, strict)"]
    for (api, kind), name in sorted(CRD_SCHEMAS.items()):
        s = _crd(name)["source"]
        out.append(f"{kind} {api} CRD of {s['repository']} {s['tag']} ({s['path']}, strict)")
    return out


@functools.lru_cache(maxsize=None)
def _crd(name: str) -> dict[str, Any]:
    return json.loads(resources.files("pdctl.statemachine").joinpath("data", "k8s", name).read_text())


def _strict(schema: Any) -> Any:
    """*schema* where every object with ``properties`` refuses a property it does not list, unless it preserves
    unknown fields (``x-kubernetes-preserve-unknown-fields``) or says what others may be."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "properties" and isinstance(v, dict):
            out[k] = {name: _strict(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[k] = _strict(v)
        else:
            out[k] = v
    preserved = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserved:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _crd_validator(name: str):  # noqa: ANN202
    import jsonschema

    # (OpenAPI v3.0 schemas: draft 4's keywords, exclusiveMinimum a boolean)
    return jsonschema.Draft4Validator(_strict(copy.deepcopy(_crd(name)["openAPIV3Schema"])))


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def _pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(path, pod template)`` of every pod template *obj* (an export's object) holds."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "RoleBasedGroup":
        return [(f"spec.roles[{i}].standalonePattern.template", r["standalonePattern"]["template"])
                for i, r in enumerate(spec.get("roles", [])) if "template" in (r.get("standalonePattern") or {})]
    if kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [(f"spec.leaderWorkerTemplate.{k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    if kind == "Deployment":
        return [("spec.template", spec["template"])] if "template" in spec else []
    return []


def _names(obj: dict[str, Any]) -> list[str]:
    """The API server's own checks of names and labels that schemas do not carry."""
    bad = []
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    rule, what = ((_DNS1035_LABEL, "a DNS-1035 label") if obj.get("kind") == "Service"
                  else (_DNS1123_SUBDOMAIN, "a DNS-1123 subdomain"))
    if not (rule.fullmatch(name) and len(name) <= (63 if obj.get("kind") == "Service" else 253)):
        bad.append(f"metadata.name: {name!r} is not {what}")

    def labels(where: str, d: dict[str, str]) -> None:
        for k, v in d.items():
            prefix, _, key = k.rpartition("/")
            if prefix and not (_DNS1123_SUBDOMAIN.fullmatch(prefix) and len(prefix) <= 253):
                bad.append(f"{where}: label key {k!r}: prefix is not a DNS-1123 subdomain")
            if not (_LABEL_NAME.fullmatch(key) and len(key) <= 63):
                bad.append(f"{where}: label key {k!r} is not a qualified name")
            if not (isinstance(v, str) and _LABEL_VALUE.fullmatch(v) and len(v) <= 63):
                bad.append(f"{where}: label value {v!r} of {k!r} is not a label value")

    labels("metadata.labels", meta.get("labels") or {})
    for path, tpl in _pod_templates(obj):
        labels(f"{path}.metadata.labels", (tpl.get("metadata") or {}).get("labels") or {})
        labels(f"{path}.spec.nodeSelector", (tpl.get("spec") or {}).get("nodeSelector") or {})
        pod = tpl.get("spec") or {}
        for key in ("initContainers", "containers"):
            for i, c in enumerate(pod.get(key) or []):
                at = f"{path}.spec.{key}[{i}]"
                if not (_DNS1123_LABEL.fullmatch(c.get("name", "")) and len(c.get("name", "")) <= 63):
                    bad.append(f"{at}.name: {c.get('name')!r} is not a DNS-1123 label")
                for p in c.get("ports") or []:
                    n = p.get("name")
                    if n is not None and not (_PORT_NAME.fullmatch(n) and len(n) <= 15 and re.search("[a-z]", n)):
                        bad.append(f"{at}.ports: name {n!r} is not an IANA service name")
                for e in c.get("env") or []:
                    if not _ENV_NAME.fullmatch(e.get("name", "")):
                        bad.append(f"{at}.env: {e.get('name')!r} is not an environment variable name")
    return bad


def validate(objects: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem found in *objects* (file name → object, as :class:`~pdctl.statemachine.k8s.Export` holds
    them), each ``FILE: KIND/NAME: PATH: what``; empty when all validate. Raises :class:`PdctlError` when
    kubernetes-validate is not installed."""
    kv = _kubernetes_validate()
    problems: list[str] = []
    for file, obj in objects.items():
        where = f"{file}: {obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))  # type: ignore[arg-type]
        checks: list[tuple[str, dict[str, Any]]] = []
        if crd is not None:
            for err in sorted(_crd_validator(crd).iter_errors(obj), key=lambda e: list(e.absolute_path)):
                problems.append(f"{where}: {_path(err.absolute_path)}: {err.message} (CRD schema)")
            # the metadata as any object's, and each pod template as Kubernetes' PodTemplate
            checks.append(("", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata") or {}}))
            checks += [(path, {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t})
                       for path, t in _pod_templates(obj)]
        else:
            checks.append(("", obj))
        for path, o in checks:
            try:
                kv.validate(o, KUBERNETES_VERSION, strict=True)
            except kv.utils.ValidationError as err:
                rel = list(err.path)[1:] if path else list(err.path)  # (a pod template's path is under "template")
                at = ".".join(x for x in (path, _path(rel) if rel else "") if x) or "(root)"
                problems.append(f"{where}: {at}: {err.message} (Kubernetes {err.version})")
            except kv.utils.SchemaNotFoundError as err:
                problems.append(f"{where}: {err.message}")
        problems += [f"{where}: {p}" for p in _names(obj)]
    return problems
