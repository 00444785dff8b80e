"""HTTP probes of SGLang servers, the prefill bootstrap server and the router, split into I/O and
pure parsing.

Every probe takes an injected :class:`httpx.Client` (tests drive them through
``httpx.MockTransport``) and raises :class:`~pdctl.statemachine.errors.ProbeError` when the
endpoint cannot be reached or answers something unparseable. The ``parse_*`` functions are pure.

Endpoints and shapes (SGLang 0.5.23 ``srt/entrypoints/http_server.py``; bootstrap server
``srt/disaggregation/common/conn.py``; smg 1.13 router):

* server ``GET /health`` (503 while starting), ``GET /server_info`` (flat resolved args),
  ``GET /metrics`` (Prometheus text, only with ``--enable-metrics``), ``POST /generate`` with
  ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` for a PD pair;
* bootstrap ``GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1``
  → ``PrefillServerInfo`` JSON, 503 "Prefill server not fully registered yet" until registered;
* router ``GET /readiness`` (200/503), ``GET /workers`` (``workers`` with ``worker_type``,
  ``is_healthy``, ``bootstrap_port``, ``metadata``; ``stats``). Its ``/health`` is 200 even with no
  workers, so it is never used as proof.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from pdctl.statemachine.errors import ProbeError
from pdctl.statemachine.sglang_facts import DEFAULT_SGLANG_VERSION, facts_for

__all__ = [
    "BOOTSTRAP_ROUTE_QUERY",
    "RouterWorker",
    "bootstrap_route",
    "chat_probe",
    "get_json",
    "health",
    "metrics",
    "new_bootstrap_room",
    "paired_generate",
    "parse_metric_total",
    "parse_metric_totals",
    "parse_workers",
    "router_readiness",
    "router_workers",
    "server_info",
]

BOOTSTRAP_ROUTE_QUERY = dict(facts_for(DEFAULT_SGLANG_VERSION).bootstrap_route_query)
"""The 0.5.23 query of the bootstrap ``/route`` (other releases: ``SglangFacts.bootstrap_route_query``)."""


def _get(client: httpx.Client, url: str, *, timeout: float = 5.0, params: dict | None = None) -> httpx.Response:
    try:
        return client.get(url, timeout=timeout, params=params)
    except httpx.HTTPError as exc:
        raise ProbeError(f"GET {url}: {type(exc).__name__}: {exc}", url=url, cause=exc) from None


def health(client: httpx.Client, base_url: str, *, timeout: float = 5.0) -> int:
    """Status code of ``GET base_url/health``; 0 when nothing answers."""
    try:
        return client.get(f"{base_url}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def get_json(client: httpx.Client, url: str, *, timeout: float = 5.0, params: dict | None = None) -> Any:
    r = _get(client, url, timeout=timeout, params=params)
    if r.status_code != 200:
        raise ProbeError(f"GET {url}: HTTP {r.status_code}: {r.text[:200]}", url=url, status=r.status_code, body=r.text)
    try:
        return r.json()
    except ValueError:
        raise ProbeError(f"GET {url}: not JSON: {r.text[:200]!r}", url=url) from None


def server_info(client: httpx.Client, base_url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """``GET /server_info`` (flat dict of resolved server args, SGLang 0.5.23)."""
    data = get_json(client, f"{base_url}/server_info", timeout=timeout)
    if not isinstance(data, dict):
        raise ProbeError(f"{base_url}/server_info: expected an object", url=base_url)
    return data


def bootstrap_route(client: httpx.Client, host: str, port: int, *, timeout: float = 5.0,
                    query: dict[str, str] | None = None) -> tuple[int, Any]:
    """``(status, body)`` of the prefill bootstrap server's ``GET /route`` with *query* (the target release's,
    ``SglangFacts.bootstrap_route_query``; default 0.5.23's)."""
    url = f"http://{host}:{port}/route"
    r = _get(client, url, timeout=timeout, params=BOOTSTRAP_ROUTE_QUERY if query is None else query)
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    return r.status_code, body


def new_bootstrap_room() -> int:
    """A fresh random 63-bit bootstrap room, as the router draws one per request."""
    return secrets.randbits(63)


def paired_generate(
    client: httpx.Client,
    prefill_url: str,
    decode_url: str,
    *,
    bootstrap_host: str,
    bootstrap_port: int,
    room: int,
    text: str = "pdctl KV link probe: count to five.",
    max_new_tokens: int = 8,
    timeout: float = 60.0,
) -> tuple[httpx.Response, httpx.Response]:
    """Send one ``/generate`` body with one bootstrap room to prefill and decode at once.

    This is what the router does for every PD request (same body to both, concurrently; the
    client gets decode's answer). Returns ``(prefill_response, decode_response)``.
    """
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "bootstrap_host": bootstrap_host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    results: dict[str, Any] = {}

    def send(which: str, url: str) -> None:
        try:
            results[which] = client.post(f"{url}/generate", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            results[which] = exc

    t = threading.Thread(target=send, args=("prefill", prefill_url), daemon=True)
    t.start()
    send("decode", decode_url)
    t.join(timeout + 5)
    out = []
    for which, url in (("prefill", prefill_url), ("decode", decode_url)):
        r = results.get(which)
        if isinstance(r, Exception) or r is None:
            raise ProbeError(f"POST {url}/generate ({which}): {r!r}", url=url, cause=r)
        out.append(r)
    return out[0], out[1]


def metrics(client: httpx.Client, url: str, *, timeout: float = 5.0) -> str:
    """Prometheus text of ``url`` (``…/metrics``)."""
    r = _get(client, url, timeout=timeout)
    if r.status_code != 200:
        raise ProbeError(f"GET {url}: HTTP {r.status_code}", url=url, status=r.status_code, body=r.text)
    return r.text


def parse_metric_totals(text: str, names: list[str] | tuple[str, ...]) -> dict[str, float]:
    """For each counter/gauge in *names* (e.g. ``sglang:num_transfer_failed_reqs_total``), the
    sum of its samples across label sets; 0.0 when absent. One pass of prometheus-client's text
    parser over *text*."""
    from prometheus_client.parser import text_string_to_metric_families

    bases = {n.removesuffix("_total"): n for n in names}
    totals = {n: 0.0 for n in names}
    for fam in text_string_to_metric_families(text):
        name = bases.get(fam.name)
        if name is None:
            continue
        for s in fam.samples:
            if s.name in (fam.name, fam.name + "_total"):
                totals[name] += s.value
    return totals


def parse_metric_total(text: str, name: str) -> float:
    """:func:`parse_metric_totals` for one metric."""
    return parse_metric_totals(text, (name,))[name]


def router_readiness(client: httpx.Client, base_url: str, *, timeout: float = 5.0) -> tuple[int, Any]:
    r = _get(client, f"{base_url}/readiness", timeout=timeout)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


@dataclass(frozen=True)
class RouterWorker:
    """One entry of the router's ``/workers``."""

    url: str
    worker_type: str
    is_healthy: bool
    bootstrap_port: int | None
    disaggregation_mode: str | None
    model_id: str | None = None
    """The model name the router registered the worker under (smg's ``model_id``); None where not reported."""
    id: str | None = None
    """The router's id of the worker (``DELETE /workers/{id}`` removes it)."""
    status: str | None = None
    """smg 1.13's ``status``: ``ready``, or ``draining`` once ``DELETE /workers/{id}`` asked its removal."""


def parse_workers(data: Any) -> tuple[list[RouterWorker], dict[str, Any]]:
    """``(workers, stats)`` from smg's ``GET /workers`` JSON. Raises ProbeError on another shape.

    A worker's ``disaggregation_mode`` (what its server runs, read from its ``/server_info``) is under ``metadata``
    in sglang-router 0.3.2 and under ``labels`` in smg 1.13.0 (both observed)."""
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise ProbeError(f"router /workers: unexpected body {str(data)[:200]}")
    out = []
    for w in data["workers"]:
        meta = {**(w.get("labels") or {}), **(w.get("metadata") or {})}
        out.append(
            RouterWorker(
                url=str(w.get("url", "")).rstrip("/"),
                worker_type=str(w.get("worker_type", "")),
                is_healthy=bool(w.get("is_healthy")),
                bootstrap_port=w.get("bootstrap_port"),
                disaggregation_mode=meta.get("disaggregation_mode"),
                model_id=w.get("model_id") if isinstance(w.get("model_id"), str) else None,
                id=w.get("id") if isinstance(w.get("id"), str) else None,
                status=w.get("status") if isinstance(w.get("status"), str) else None,
            )
        )
    return out, dict(data.get("stats") or {})


def router_workers(client: httpx.Client, base_url: str, *, timeout: float = 5.0) -> tuple[list[RouterWorker], dict[str, Any]]:
    return parse_workers(get_json(client, f"{base_url}/workers", timeout=timeout))


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}


def chat_probe(client: httpx.Client, base_url: str, model: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """One chat completion with a tool schema and thinking on. Returns the response JSON."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris? Think first, then use the tool."}],
        "tools": [PROBE_TOOL],
        "tool_choice": "auto",
        "max_tokens": 256,
        "temperature": 0,
        "chat_template_kwargs": {"thinking": True},
        "separate_reasoning": True,
    }
    url = f"{base_url}/v1/chat/completions"
    try:
        r = client.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ProbeError(f"POST {url}: {type(exc).__name__}: {exc}", url=url, cause=exc) from None
    if r.status_code != 200:
        raise ProbeError(f"POST {url}: HTTP {r.status_code}: {r.text[:300]}", url=url, status=r.status_code, body=r.text)
    try:
        return r.json()
    except ValueError:
        raise ProbeError(f"POST {url}: not JSON: {r.text[:200]!r}", url=url) from None
