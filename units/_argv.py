"""Command lines: the exact argv and environment a host runs for a server or the router.

Flags follow SGLang 0.5.23's ``launch_server`` parser and smg 1.13.0's ``launch`` parser (see
``shared/reference``). Choices made here, each for a reason:

* ``--enable-metrics`` always: the telemetry and the router's ``/engine_metrics`` need ``/metrics``.
* GPUs: ``CUDA_VISIBLE_DEVICES=<physical ids>`` plus ``--base-gpu-id 0``. SGLang counts
  ``--base-gpu-id`` inside the visible set, so the two together can never point outside it. With
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: the ids are nvidia-smi's (PCI bus order), which the NUMA binding and
  the GPU checks read; CUDA's default order is fastest first (CUDA C Programming Guide, "CUDA Environment
  Variables"), which on a host with mixed GPUs names other devices.
* ``--tp-size`` always (it is what ``/server_info`` is checked against); ``--attn-dp-size`` and
  ``--ep-size`` only above 1 (1 is SGLang's default and the flags stay short).
* Older targets spell two things otherwise (``ServerLaunch.legacy_dp_attention``,
  ``sparse_attention_prefix``): ``--dp-size N --enable-dp-attention`` up to 0.5.20, ``--nsa-*`` up to 0.5.12.
* ``--disaggregation-mode`` for prefill and decode; a ``single`` server passes no
  ``--disaggregation-*`` flag at all.
* ``--kv-cache-dtype auto`` is SGLang's default and is left out.
* The router's ``--prefill URL BOOTSTRAP_PORT`` always carries the port: without it the router
  sends ``bootstrap_port: null`` and decode substitutes its own default (8998).
* Extra args come last, so an operator's flag can override one pdctl rendered (argparse: last wins).

Nothing here quotes: argv is a list. Quoting happens once, when a unit file is rendered.
"""

from __future__ import annotations

from ._types import RouterLaunch, ServerLaunch

__all__ = ["router_argv", "router_env", "server_argv", "server_env"]


def _num(x: float) -> str:
    """``0.85`` → ``"0.85"``, ``1.0`` → ``"1.0"`` (``repr``: the shortest exact float text)."""
    return repr(float(x))


def server_argv(s: ServerLaunch) -> list[str]:
    """The argv of one SGLang server: ``PYTHON -m MODULE --model-path … --enable-metrics [extra]``."""
    a = [s.python, "-m", s.module, "--model-path", s.model_path]
    if s.served_name:
        a += ["--served-model-name", s.served_name]
    if s.context_length is not None:
        a += ["--context-length", str(s.context_length)]
    if s.page_size is not None:
        a += ["--page-size", str(s.page_size)]
    if s.kv_cache_dtype and s.kv_cache_dtype != "auto":
        a += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.trust_remote_code:
        a.append("--trust-remote-code")
    if s.load_format:
        a += ["--load-format", s.load_format]
    if s.attention_backend:
        a += ["--attention-backend", s.attention_backend]
    if s.dsa_prefill_backend:
        a += [f"{s.sparse_attention_prefix}-prefill-backend", s.dsa_prefill_backend]
    if s.dsa_decode_backend:
        a += [f"{s.sparse_attention_prefix}-decode-backend", s.dsa_decode_backend]
    a += ["--tp-size", str(s.tp)]
    if s.attn_dp > 1:
        a += ["--dp-size", str(s.attn_dp), "--enable-dp-attention"] if s.legacy_dp_attention else ["--attn-dp-size", str(s.attn_dp)]
    if s.ep > 1:
        a += ["--ep-size", str(s.ep)]
    if s.gpu_ids:
        a += ["--base-gpu-id", "0"]
    a += ["--host", s.http_host, "--port", str(s.http_port)]
    if s.nccl_port is not None:
        a += ["--nccl-port", str(s.nccl_port)]
    if s.kind in ("prefill", "decode"):
        a += ["--disaggregation-mode", s.kind]
        if s.transfer_backend:
            a += ["--disaggregation-transfer-backend", s.transfer_backend]
        if s.bootstrap_port is not None:
            a += ["--disaggregation-bootstrap-port", str(s.bootstrap_port)]
        if s.ib_device:
            a += ["--disaggregation-ib-device", s.ib_device]
    if s.mem_fraction is not None:
        a += ["--mem-fraction-static", _num(s.mem_fraction)]
    if s.reasoning_parser:
        a += ["--reasoning-parser", s.reasoning_parser]
    if s.tool_call_parser:
        a += ["--tool-call-parser", s.tool_call_parser]
    if s.chat_template:
        a += ["--chat-template", s.chat_template]
    a.append("--enable-metrics")
    a += list(s.extra_args)
    return a


def server_env(s: ServerLaunch) -> dict[str, str]:
    """The server's environment additions, in this order: ``CUDA_DEVICE_ORDER`` and ``CUDA_VISIBLE_DEVICES``,
    ``SGLANG_CACHE_DIR``, ``UCX_NET_DEVICES`` (each only when known), then the role's own env
    (which may override any of them)."""
    env: dict[str, str] = {}
    if s.gpu_ids:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in s.gpu_ids)
    if s.cache_dir:
        env["SGLANG_CACHE_DIR"] = s.cache_dir
    if s.ucx_net_devices:
        env["UCX_NET_DEVICES"] = s.ucx_net_devices
    env.update(dict(s.env))
    return env


def router_argv(r: RouterLaunch) -> list[str]:
    """The router's argv: ``smg launch …`` or ``PYTHON -m sglang_router.launch_router …``."""
    if r.impl == "smg":
        a = [r.executable, "launch"]
    else:
        a = [r.executable, "-m", "sglang_router.launch_router"]
    if r.is_pd:
        a.append("--pd-disaggregation")
        for url, port in r.prefill:
            a += ["--prefill", url, str(port)]
        for url in r.decode:
            a += ["--decode", url]
    elif r.workers:
        a += ["--worker-urls", *r.workers]
    a += ["--host", r.host, "--port", str(r.port)]
    if r.policy:
        a += ["--policy", r.policy]
    if r.prometheus_host:
        a += ["--prometheus-host", r.prometheus_host]
    if r.prometheus_port is not None:
        a += ["--prometheus-port", str(r.prometheus_port)]
    for flag, v in (
        ("--health-check-interval-secs", r.health_check_interval_s),
        ("--health-check-timeout-secs", r.health_check_timeout_s),
        ("--health-failure-threshold", r.health_failure_threshold),
        ("--health-success-threshold", r.health_success_threshold),
        ("--worker-startup-timeout-secs", r.worker_startup_timeout_s),
        ("--worker-startup-check-interval", r.worker_startup_check_interval_s),
    ):
        if v is not None:
            a += [flag, str(v)]
    a += list(r.extra_args)
    return a


def router_env(r: RouterLaunch) -> dict[str, str]:
    """The router's environment additions (its spec ``env``)."""
    return dict(r.env)
