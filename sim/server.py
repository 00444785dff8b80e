"""The stand-in SGLang 0.5.23 server process: HTTP surface, PD bootstrap and KV transfer.

Where each behaviour comes from (SGLang 0.5.23):

* ``sglang/srt/entrypoints/http_server.py``: the routes and their JSON shapes. ``/health`` and
  ``/health_generate`` share one handler: 503 while starting or shutting down, else a 1-token generation
  (in PD mode with ``bootstrap_host=2.2.2.2``, the fake-transfer path, so it never touches the KV link);
  ``/ready``; ``/server_info`` (``build_server_info``: resolved args + ``launch_command`` + scheduler
  info + ``kv_events``, then ``startup_time``, ``internal_states``, ``version``, ``frontend``) and the
  deprecated ``/get_server_info`` (logs a warning); ``/model_info`` and ``/get_model_info``;
  ``/v1/models``; ``/flush_cache`` (GET and POST); ``/generate``; ``/v1/chat/completions``;
  ``/v1/completions``.  Unknown paths get FastAPI's ``{"detail":"Not Found"}``.  An aborted request
  answers ``HTTPException(status, message)`` -> ``{"object":"error","message",...,"type":"500",
  "param":null,"code":500}``; a 400 abort answers ``{"error":{"message":...}}`` on ``/generate``.
* ``sglang/srt/entrypoints/v1_loads.py`` + ``managers/load_snapshot.py``: ``/v1/loads``.
* ``sglang/srt/entrypoints/http_server.py`` ``launch_server``/``_wait_and_warmup``: the HTTP port opens
  only after the weights are loaded (``_launch_subprocesses`` blocks); ``/health`` answers 503 until the
  warm-up request has run; then "The server is fired up and ready to roll!".
* ``sglang/srt/disaggregation/common/conn.py`` ``CommonKVBootstrapServer``: the prefill bootstrap
  server on ``--host:--disaggregation-bootstrap-port`` (``GET /health`` -> ``OK``; ``PUT``/``GET /route``;
  400 ``Missing inputs for bootstrap server.``; 503 ``Prefill server not fully registered yet (N
  workers registered).`` until dp*cp*tp*pp ranks have registered; ``PrefillServerInfo`` JSON).
  ``try_ensure_parallel_info``: decode fetches ``/route?...=-1`` (5 s timeout), retried once per second
  up to 15 times (``disaggregation/decode.py`` ``_max_ensure_retries``), then the request is aborted
  (``receiver.abort()`` -> "Aborted by AbortReq.", reported as "Decode handshake failed ...",
  ``num_bootstrap_failed_reqs_total``).  A page-size or KV-cache-dtype mismatch raises ``RuntimeError``
  inside the decode scheduler loop, which is not caught: the scheduler logs "Scheduler hit an
  exception", SIGQUITs its parent, and ``kill_process_tree`` SIGKILLs the whole server.
  ``_check_waiting_timeout`` / ``_check_bootstrap_timeout``: ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
  (decode) and ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (prefill), both 300 s by default
  (``sglang/srt/environ.py``), failing with ``KVTransferError(bootstrap_room=R): Request R timed out
  after Xs in KVPoll.WaitingForInput`` / ``...Bootstrapping``; decode counts
  ``num_transfer_failed_reqs_total``, prefill ``num_bootstrap_failed_reqs_total``.
* ``sglang/srt/managers/scheduler.py``: a PD request without ``bootstrap_room`` (transfer backend not
  ``fake``) is aborted with 400 "Invalid request: Disaggregated request received without bootstrap room
  id."; ``sglang/srt/disaggregation/utils.py`` ``_is_fake_transfer``: ``bootstrap_host == "2.2.2.2"``
  (or no host with the ``fake`` backend) skips the transfer.
* ``sglang/srt/managers/scheduler_components/metrics_reporter.py``: the "Prefill batch, ..." and
  "Decode batch, ..." log lines; ``sglang/srt/utils/common.py`` ``configure_logger``: the
  ``[YYYY-mm-dd HH:MM:SS] message`` format.

* torch.distributed's rendezvous: each server's rank 0 initialises the process group with
  ``tcp://127.0.0.1:<--nccl-port>`` (the ``--dist-init-addr`` port where given), whose ``TCPStore`` server
  (torch ≥ 2.4, libuv backend, ``TCPStoreLibUvBackend.cpp``) listens on every address, ``[::]`` dual-stack, else
  ``0.0.0.0``, with ``SO_REUSEADDR`` (libuv's ``uv_tcp_bind``), for the server's life. A port in use fails the
  scheduler with ``torch.distributed.DistNetworkError: The server socket has failed to listen on any local network
  address. port: P, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use``; the scheduler
  logs ``Scheduler hit an exception: …`` and sends SIGQUIT to the launcher, which logs ``Received sigquit from a
  child process. It usually means the child failed.`` and kills its process tree, itself included (SIGKILL;
  ``sglang/srt/entrypoints/engine.py``). Without ``--nccl-port`` SGLang 0.5.23 takes a free port below the
  ephemeral range (``shared/reference/sglang-pd.md``); the stand-in draws one at random from 10000 up to it.

SIM-ONLY: the prefill bootstrap server also serves ``GET /sim/kv?room=R&wait=S``, the stand-in for the
NIXL/Mooncake data plane: decode long-polls it for the KV of bootstrap room R; it is not an SGLang route.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import model as mdl
from . import parsers
from .flags import StartupError, parse
from .metrics import Metrics

VERSION = "0.5.23"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
MAX_ENSURE_RETRIES = 15
KV_BYTES_PER_TOKEN = 61 * 656  # DeepSeek-V3 MLA: 61 layers x (512 + 64 rope + 80 fp8 scales) bytes

log = logging.getLogger("sglang")
access_log = logging.getLogger("uvicorn.access")
uvicorn_log = logging.getLogger("uvicorn.error")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None


def _trunc(v: Any, max_length: int = 2048) -> str:
    """``request_logger._dataclass_to_string_truncated`` for the values the stand-in logs."""
    if isinstance(v, str) and len(v) > max_length:
        return f"{v[: max_length // 2]!r} ... {v[-(max_length // 2):]!r}"
    if isinstance(v, list) and len(v) > max_length:
        return f"{v[: max_length // 2]} ... {v[-(max_length // 2):]}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"'{k}': {_trunc(x, max_length)}" for k, x in v.items()) + "}"
    return repr(v)


class Abort(Exception):
    """A request finished with FINISH_ABORT(message, status_code)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


# --------------------------------------------------------------------------------------------------
# Prefill side: rooms waiting for decode, and the bootstrap server


@dataclass
class Room:
    payload: dict[str, Any] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    fetched: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)


class RoomStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}

    def get(self, room: int) -> Room:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                r = self._rooms[room] = Room()
            return r

    def drop(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def gc(self, max_age: float) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, r in self._rooms.items() if now - r.created > max_age]:
                del self._rooms[k]


class Sim:
    """One stand-in SGLang server (any disaggregation mode)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.args, _ = parse(argv)
        self.family = mdl.model_family(self.args.model_path)
        self.args, self.resolved = parse(argv, mdl.DEFAULT_PAGE_SIZE[self.family])
        a = self.resolved
        self._startup_warnings: list[str] = []
        self._startup_info: list[str] = []
        if self.args.tool_call_parser != a.get("tool_call_parser"):  # server_args._handle_deprecated_args
            self._startup_warnings.append(f"The tool_call_parser '{self.args.tool_call_parser}' is deprecated. "
                                          f"Please use '{a['tool_call_parser']}' instead.")
        if self.args.disaggregation_transfer_backend == "mooncake_tcp":
            # arg_groups/pd_disaggregation_hook.handle_pd_disaggregation: mooncake with the TCP transport forced
            os.environ.setdefault("MC_FORCE_TCP", "1")
            self._startup_info.append("disaggregation transfer backend 'mooncake_tcp' -> mooncake with "
                                      "MC_FORCE_TCP=1 (TCP transport, no RDMA)")
        try:  # ModelConfig.from_server_args (reached from ServerArgs.__post_init__'s model-specific adjustments)
            json.loads(a.get("json_model_override_args") or "{}")
        except json.JSONDecodeError as e:
            raise StartupError(f"json.decoder.JSONDecodeError: {e}") from None
        arch = mdl.ARCHITECTURE[self.family]
        if arch[0] == "deepseek_v4":
            # model_overrides/deepseek_v4.py declares these over the command line's values on CUDA (a declaration
            # wins over a raw input: model_override_base.ResolvingConfig)
            a["attention_backend"], a["page_size"] = "dsv4", mdl.DSV4_PAGE_SIZE
            self._startup_info.append(f"Use dsv4 attention backend for {arch[1]}, setting page_size to "
                                      f"{mdl.DSV4_PAGE_SIZE}.")
            # overrides._deepseek_v4_kv_cache_dtype (CUDA): auto -> fp8_e4m3, then only fp8_e4m3 or bfloat16
            if a["kv_cache_dtype"] == "auto":
                a["kv_cache_dtype"] = "fp8_e4m3"
                self._startup_warnings.append(f"Setting KV cache dtype to fp8_e4m3 for {arch[1]}.")
            if a["kv_cache_dtype"] not in ("fp8_e4m3", "bfloat16"):
                raise StartupError(f"AssertionError: {a['kv_cache_dtype']} is not supported for {arch[1]}")
        if self.family in mdl.DSA_FAMILIES:
            # overrides._dsa_kv_cache_dtype_default (an H200-class SM90 device: auto -> bfloat16)
            kv = a["kv_cache_dtype"]
            if kv == "auto":
                kv = "bfloat16"
                self._startup_warnings.append("Setting KV cache dtype to bfloat16 for DeepSeek DSA on SM90 device.")
            if kv == "bf16":
                kv = "bfloat16"
            if kv not in ("bfloat16", "fp8_e4m3"):
                raise StartupError("AssertionError: DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 "
                                   "kv_cache_dtype")
            a["kv_cache_dtype"] = kv
        self.mode: str = a["disaggregation_mode"]
        self.served_model_name: str = a["served_model_name"]
        self.max_total_num_tokens = int(a.get("max_total_tokens") or 524288)
        self.metrics = Metrics(self.served_model_name, self.mode, self.max_total_num_tokens)
        self.enable_metrics = bool(a.get("enable_metrics"))
        self.status = "Starting"
        self.gracefully_exit = False
        self.startup_time = 0.0
        self.rooms = RoomStore()
        self.registered = 0
        tp = int(a.get("tp_size") or 1)
        attn_dp = int(a.get("attn_dp_size") or 1)
        # attention-DP splits TP into attn_dp groups of attn_tp ranks; plain --dp-size replicates TP.
        self.dp = attn_dp if attn_dp > 1 else int(a.get("dp_size") or 1)
        self.attn_tp = tp // attn_dp if attn_dp > 1 else tp
        self.expected_ranks = (self.dp * self.attn_tp * int(a.get("attn_cp_size") or 1)
                               * int(a.get("pp_size") or 1))
        self.prefill_info: dict[str, dict[str, Any]] = {}
        self._info_lock = threading.Lock()
        # decode: rooms in flight per bootstrap addr, and failures recorded by the heartbeat checker
        self.addr_rooms: dict[str, set[int]] = {}
        self.failure_records: dict[int, str] = {}
        self.heartbeat_interval = max(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0), 2.0)
        self.heartbeat_max_failures = max(int(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1)
        self._heartbeat_failures: dict[str, int] = {}
        self._heartbeat_thread: threading.Thread | None = None
        self.load_seconds = _env_float("PDCTL_SIM_LOAD_SECONDS", 1.0)
        self.warmup_seconds = _env_float("PDCTL_SIM_WARMUP_SECONDS", 0.5)
        self.waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
        self.bootstrap_timeout = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        self.ensure_retry_interval = _env_float("PDCTL_SIM_ENSURE_RETRY_INTERVAL", 1.0)
        self.http: ThreadingHTTPServer | None = None
        self.bootstrap: ThreadingHTTPServer | None = None
        self.nccl_store: socket.socket | None = None  # (rank 0's TCPStore port, held for the process's life)
        self.stop_event = threading.Event()
        self.running = 0
        self.forward_ct = 0
        self._stats_lock = threading.Lock()
        self.last_gen_throughput = 0.0

    # ---------------------------------------------------------------- values served

    @property
    def kv_cache_dtype_str(self) -> str:
        """``server_args.kv_cache_dtype`` as the server holds it after its overrides: what a prefill registers
        on its bootstrap server and a decode compares with its own (0.5.23 ``disaggregation/common/conn.py``,
        ``register_to_bootstrap`` / ``try_ensure_parallel_info``); ``auto`` stays ``auto`` outside DeepSeek DSA."""
        return str(self.resolved.get("kv_cache_dtype") or "auto")

    @property
    def page_size(self) -> int:
        return int(self.resolved["page_size"])

    def server_info(self) -> dict[str, Any]:
        info = dict(self.resolved)
        info.update({
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": int(self.resolved["context_length"]) - 1,
            "kv_events": None,
            "startup_time": self.startup_time,
            "internal_states": [self._internal_state(r) for r in range(self.dp)],
            "version": VERSION,
            "frontend": "python",
        })
        return info

    def _internal_state(self, rank: int) -> dict[str, Any]:
        return {
            "world_size": self.attn_tp,
            "effective_max_running_requests_per_dp": int(self.resolved.get("max_running_requests") or 4096),
            "last_gen_throughput": self.last_gen_throughput,
            "memory_usage": {"weight": 0.0, "kv_cache": 0.0, "graph": 0.0,
                             "token_capacity": self.max_total_num_tokens},
            "disaggregation_mode": self.mode,
            "decode_cuda_graph_bs": None,
            "dp_rank": rank,
        }

    def model_info(self) -> dict[str, Any]:
        arch = mdl.ARCHITECTURE[self.family]
        a = self.resolved
        return {
            "model_path": a["model_path"],
            "served_model_name": self.served_model_name,
            "tokenizer_path": a["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": a.get("preferred_sampling_params"),
            "weight_version": a.get("weight_version", "default"),
            "load_format": a.get("load_format"),
            "reasoning_parser": a.get("reasoning_parser"),
            "tool_call_parser": a.get("tool_call_parser"),
            "disaggregation_mode": self.mode,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": arch[0],
            "architectures": [arch[1]],
        }

    def v1_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(self.startup_time or time.time()),
            "owned_by": "sglang", "root": self.served_model_name, "parent": None,
            "max_model_len": int(self.resolved["context_length"]),
        }]}

    def v1_loads(self, include: str | None) -> dict[str, Any]:
        inc = {s.strip() for s in include.split(",")} if include else None
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if inc is not None and not inc <= valid:
            raise Abort(f"Invalid include sections: {inc - valid}. Valid options: {sorted(valid)}", 400)
        loads = []
        for rank in range(self.dp):
            d: dict[str, Any] = {
                "timestamp": time.time(), "dp_rank": rank, "num_running_reqs": self.running,
                "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                "num_total_tokens": 0, "num_active_tokens": 0, "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": self.max_total_num_tokens,
                "max_running_requests": int(self.resolved.get("max_running_requests") or 4096),
                "token_usage": 0.0, "gen_throughput": self.last_gen_throughput, "cache_hit_rate": 0.0,
                "utilization": 0.0, "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
                "decode_moments": None,
            }
            everything = inc is None or "all" in inc
            if inc != {"core"}:
                if everything or "memory" in inc:
                    d["memory"] = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0,
                                   "token_capacity": self.max_total_num_tokens}
                if everything or "disagg" in inc:
                    d["disaggregation"] = {
                        "mode": self.mode, "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                        "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                        "kv_transfer_latency_ms": 0.0}
                if everything or "queues" in inc:
                    d["queues"] = {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0,
                                   "prealloc_ready": 0}
            loads.append(d)
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION,
                "accelerator": None, "num_accelerators": int(self.resolved.get("tp_size") or 1),
                "loads": loads}

    # ---------------------------------------------------------------- the request pipeline

    def prepare(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Tokenize and resolve sampling limits: the tokenizer manager's part."""
        chat_kwargs = body.get("chat_template_kwargs") or {}
        default_thinking = os.environ.get("SGLANG_DEFAULT_THINKING", "").lower() in ("1", "true")
        thinking = bool(chat_kwargs.get("thinking", default_thinking)) if kind == "chat" else False
        tools = body.get("tools") if kind == "chat" else None
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise Abort("messages: Field required", 400)
            prompt = mdl.render_chat(messages, tools, thinking)
            ids = mdl.tokenize(prompt)
            max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        elif kind == "completion":
            p = body.get("prompt", "")
            prompt = p if isinstance(p, str) else " ".join(map(str, p))
            ids = mdl.tokenize(prompt)
            max_new = body.get("max_tokens", 16)
        else:
            sp = body.get("sampling_params") or {}
            if body.get("input_ids") is not None:
                ids = [int(x) for x in body["input_ids"]]
                prompt = None
            else:
                text = body.get("text")
                if text is None:
                    raise Abort("Either text, input_ids or input_embeds should be provided.", 400)
                prompt = text if isinstance(text, str) else str(text)
                ids = mdl.tokenize(prompt)
            max_new = sp.get("max_new_tokens", 128)
        ctx = int(self.resolved["context_length"])
        if len(ids) >= ctx:
            raise Abort(f"The input ({len(ids)} tokens) is longer than the model's context length "
                        f"({ctx} tokens).", 400)
        if max_new is None:
            max_new = ctx - len(ids)
        return {"ids": ids, "max_new": int(max_new), "thinking": thinking, "tools": tools,
                "tool_choice": body.get("tool_choice", "auto"), "rid": body.get("rid") or uuid.uuid4().hex,
                "kind": kind}

    def obtain_kv(self, req: dict[str, Any], body: dict[str, Any]) -> tuple[str, bool]:
        """The KV for this prompt: computed here (null/prefill) or received from prefill (decode).

        Returns (kv_digest, prefill_only)."""
        ids = req["ids"]
        host = body.get("bootstrap_host")
        room = body.get("bootstrap_room")
        fake = host == FAKE_BOOTSTRAP_HOST or (
            host is None and self.resolved["disaggregation_transfer_backend"] == "fake")
        if self.mode == "null":
            return mdl.kv_digest(ids), False
        if room is None and self.resolved["disaggregation_transfer_backend"] != "fake":
            msg = ("Invalid request: Disaggregated request received without bootstrap room id. "
                   f"req.rid={req['rid']!r}")
            log.error(msg)
            raise Abort(msg, 400)
        if isinstance(room, list):
            room = room[0]
        digest = mdl.kv_digest(ids)
        if self.mode == "prefill":
            self._log_prefill_batch(len(ids))
            if fake:
                return digest, True
            self._prefill_hold(int(room), req, digest)
            return digest, True
        # decode (with the ``fake`` backend every receiver is a FakeKVReceiver)
        if fake or self.resolved["disaggregation_transfer_backend"] == "fake":
            # FakeKVReceiver: nothing moves, the KV pages hold whatever was there (garbage), so the
            # output is not the prompt's; only warm-up and health checks take this path.
            return mdl.kv_digest([]), False
        port = body.get("bootstrap_port")
        if port is None:
            port = self.resolved["disaggregation_bootstrap_port"]
        addr = f"{host}:{port}"
        return self._decode_receive(addr, int(room), req), False

    def _prefill_hold(self, room: int, req: dict[str, Any], digest: str) -> None:
        """Prefill: publish this room's KV and wait (bounded) until decode has taken it."""
        entry = self.rooms.get(room)
        n = len(req["ids"])
        entry.payload = {
            "bootstrap_room": room, "kv_digest": digest, "num_tokens": n,
            "first_token_id": mdl.first_token_id(digest), "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype_str, "num_pages": -(-n // self.page_size),
            "nbytes": n * KV_BYTES_PER_TOKEN,
        }
        entry.ready.set()
        m = self.metrics
        m.s(m.num_prefill_bootstrap_queue_reqs).inc()
        t0 = time.monotonic()
        try:
            while not entry.fetched.wait(min(0.2, max(self.bootstrap_timeout - (time.monotonic() - t0), 0))):
                if time.monotonic() - t0 >= self.bootstrap_timeout:
                    break
                if req["client_gone"]() or self.stop_event.is_set():
                    log.info(f"Abort request {req['rid']}: the client went away")
                    raise Abort("The client disconnected.", 499)
            else:
                return
            elapsed = time.monotonic() - t0
            log.warning(
                "Some requests timed out when bootstrapping, which means prefill instances fail to receive "
                "the KV indices from the decode instance of this request. If a greater mean TTFT is "
                "acceptable, you can 'export SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=600' (10 minutes) to "
                "relax the timeout condition. ")
            msg = (f"Prefill bootstrap failed for request rank=0 req.rid={req['rid']!r} "
                   f"req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): "
                   f"Request {room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping")
            log.warning(msg)
            m.s(m.num_bootstrap_failed_reqs).inc()
            raise Abort(msg, 500)
        finally:
            m.s(m.num_prefill_bootstrap_queue_reqs).dec()
            self.rooms.drop(room)

    def serve_kv(self, room: int, wait: float) -> dict[str, Any] | None:
        """SIM-ONLY transfer channel (prefill side): hand the room's KV to decode once computed."""
        self.rooms.gc(max_age=max(self.bootstrap_timeout, self.waiting_timeout, 60.0) * 2)
        entry = self.rooms.get(room)
        if not entry.ready.wait(max(0.0, min(wait, 5.0))):
            return None
        payload = entry.payload
        entry.fetched.set()
        m = self.metrics
        latency_ms = max((time.monotonic() - entry.created) * 1000.0, 0.01)
        m.s(m.kv_transfer_latency_ms).observe(latency_ms)
        mb = payload["nbytes"] / 1e6
        m.s(m.kv_transfer_total_mb).observe(mb)
        m.s(m.kv_transfer_speed_gb_s).observe(mb / 1000.0 / (latency_ms / 1000.0))
        return payload

    def _fetch_route(self, addr: str) -> dict[str, Any] | None:
        url = (f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
               "target_tp_rank=-1&target_pp_rank=-1")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            log.error(f"Failed to get prefill server info: {e.code}, {e.read().decode(errors='replace')}")
        except Exception as e:  # noqa: BLE001 - SGLang logs any failure and retries
            log.error(f"Error fetching prefill server info from bootstrap: {e}")
        return None

    def _ensure_parallel_info(self, addr: str) -> bool:
        with self._info_lock:
            if addr in self.prefill_info:
                return True
        info = self._fetch_route(addr)
        if info is None:
            return False
        if info.get("page_size") is not None and info["page_size"] != self.page_size:
            self._scheduler_crash(RuntimeError(
                f"Page size mismatch: prefill server has page_size={info['page_size']}, "
                f"but decode server has page_size={self.page_size}. "
                f"Both servers must use the same --page-size value."))
        if info.get("kv_cache_dtype") is not None and info["kv_cache_dtype"] != self.kv_cache_dtype_str:
            self._scheduler_crash(RuntimeError(
                f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info['kv_cache_dtype']}, "
                f"but decode server has kv_cache_dtype={self.kv_cache_dtype_str}. "
                f"Both servers must use the same --kv-cache-dtype value."))
        with self._info_lock:
            self.prefill_info[addr] = info
            if self._heartbeat_thread is None:
                self._heartbeat_thread = threading.Thread(target=self._heartbeat_checker, daemon=True,
                                                          name="HeartbeatChecker")
                self._heartbeat_thread.start()
        return True

    def _heartbeat_checker(self) -> None:
        """``CommonKVManager._start_heartbeat_checker_thread``: decode polls each known prefill
        bootstrap ``/health``; after ``max_failures`` misses the prefill is dropped and its in-flight
        rooms fail with "Lost connection with prefill instance"."""
        while not self.stop_event.wait(self.heartbeat_interval):
            with self._info_lock:
                addrs = list(self.prefill_info)
            for addr in addrs:
                ok = False
                try:
                    with urllib.request.urlopen(f"http://{addr}/health", timeout=3) as resp:
                        ok = resp.status == 200
                except Exception:  # noqa: BLE001
                    ok = False
                if ok:
                    self._heartbeat_failures[addr] = 0
                    continue
                log.info(f"Attempting to reconnect to {addr}...")
                self._heartbeat_failures[addr] = self._heartbeat_failures.get(addr, 0) + 1
                if self._heartbeat_failures[addr] >= self.heartbeat_max_failures:
                    self._handle_node_failure(addr)

    def _handle_node_failure(self, addr: str) -> None:
        with self._info_lock:
            self.prefill_info.pop(addr, None)
            self._heartbeat_failures.pop(addr, None)
            rooms = list(self.addr_rooms.pop(addr, set()))
            for room in rooms:
                self.failure_records[room] = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
        log.error(f"Lost connection with prefill instance (bootstrap_addr: {addr}), {len(rooms)} requests affected")

    def _scheduler_crash(self, exc: BaseException) -> None:
        """An uncaught exception in the scheduler loop: SGLang kills the whole server (SIGKILL)."""
        tb = "".join(traceback.format_exception_only(type(exc), exc))
        log.error("Scheduler hit an exception: Traceback (most recent call last):\n"
                  '  File "sglang/srt/disaggregation/common/conn.py", in try_ensure_parallel_info\n' + tb)
        log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        for h in log.handlers:
            h.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)  # pragma: no cover

    def _decode_receive(self, addr: str, room: int, req: dict[str, Any]) -> str:
        m = self.metrics
        rid = req["rid"]
        m.s(m.num_decode_prealloc_queue_reqs).inc()
        t_boot = time.monotonic()
        try:
            attempts = 0
            while not self._ensure_parallel_info(addr):
                attempts += 1
                if attempts >= MAX_ENSURE_RETRIES:
                    log.error(f"Could not fetch prefill parallel info from {addr} after {attempts} attempts")
                    msg = (f"Decode handshake failed for request rank=0 decode_req.req.rid={rid!r} "
                           f"decode_req.req.bootstrap_room={room} with exception "
                           f"KVTransferError(bootstrap_room={room}): Aborted by AbortReq.")
                    log.error(msg)
                    m.s(m.num_bootstrap_failed_reqs).inc()
                    raise Abort(msg, 500)
                if self.stop_event.wait(self.ensure_retry_interval):
                    raise Abort("Server is shutting down.", 503)
        finally:
            m.s(m.num_decode_prealloc_queue_reqs).dec()
        m.s(m.kv_transfer_bootstrap_ms).observe((time.monotonic() - t_boot) * 1000.0)
        m.s(m.kv_transfer_alloc_ms).observe(0.1)
        m.s(m.num_decode_transfer_queue_reqs).inc()
        init = time.monotonic()
        with self._info_lock:
            self.addr_rooms.setdefault(addr, set()).add(room)
        try:
            while True:
                with self._info_lock:
                    reason = self.failure_records.pop(room, None)
                if reason is not None:
                    msg = (f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
                           f"decode_req.req.bootstrap_room={room} with exception "
                           f"KVTransferError(bootstrap_room={room}): {reason}")
                    log.error(msg)
                    m.s(m.num_transfer_failed_reqs).inc()
                    raise Abort(msg, 500)
                remaining = self.waiting_timeout - (time.monotonic() - init)
                if remaining <= 0:
                    elapsed = time.monotonic() - init
                    log.warning(
                        "Some requests fail to receive KV Cache transfer done signal after bootstrapping. "
                        "If a greater mean TTFT is acceptable, you can 'export "
                        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600' (10 minutes) to relax the timeout "
                        "condition. ")
                    msg = (f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
                           f"decode_req.req.bootstrap_room={room} with exception "
                           f"KVTransferError(bootstrap_room={room}): Request {room} timed out after "
                           f"{elapsed:.1f}s in KVPoll.WaitingForInput")
                    log.error(msg)
                    m.s(m.num_transfer_failed_reqs).inc()
                    raise Abort(msg, 500)
                wait = min(0.5, remaining)
                url = f"http://{addr}/sim/kv?room={room}&wait={wait:.3f}"
                try:
                    with urllib.request.urlopen(url, timeout=wait + 5) as resp:
                        if resp.status == 200:
                            payload = json.loads(resp.read())
                            return str(payload["kv_digest"])
                except urllib.error.HTTPError as e:
                    e.read()
                except Exception:  # noqa: BLE001 - the data plane is retried until the timeout
                    if self.stop_event.wait(min(0.05, max(remaining, 0))):
                        raise Abort("Server is shutting down.", 503) from None
        finally:
            m.s(m.num_decode_transfer_queue_reqs).dec()
            with self._info_lock:
                self.addr_rooms.get(addr, set()).discard(room)
                self.failure_records.pop(room, None)

    def _req_repr(self, req: dict[str, Any], body: dict[str, Any]) -> str:
        fields = {"rid": req["rid"], "text": body.get("text"), "input_ids": None if body.get("text") else req["ids"],
                  "sampling_params": body.get("sampling_params") or {}, "stream": bool(body.get("stream")),
                  "bootstrap_host": body.get("bootstrap_host"), "bootstrap_port": body.get("bootstrap_port"),
                  "bootstrap_room": body.get("bootstrap_room")}
        return "GenerateReqInput(" + ", ".join(f"{k}={_trunc(v)}" for k, v in fields.items()) + ")"

    def run(self, kind: str, body: dict[str, Any], client_gone=None) -> dict[str, Any]:
        """Run one request to completion; returns the pieces and accounting.

        ``client_gone()`` tells whether the HTTP client has disconnected (the tokenizer manager
        aborts such a request)."""
        t0 = time.monotonic()
        req = self.prepare(kind, body)
        req["client_gone"] = client_gone or (lambda: False)
        if self.resolved.get("log_requests") and not str(req["rid"]).startswith("HEALTH_CHECK"):
            log.info(f"Receive: obj={self._req_repr(req, body)}")
        with self._stats_lock:
            self.running += 1
        m = self.metrics
        m.s(m.num_running_reqs).set(self.running)
        try:
            digest, prefill_only = self.obtain_kv(req, body)
        finally:
            with self._stats_lock:
                self.running -= 1
            m.s(m.num_running_reqs).set(self.running)
        gen = mdl.generate(digest, family=self.family, chat=(kind == "chat"), thinking=req["thinking"],
                           tools=req["tools"], tool_choice=req["tool_choice"])
        pieces = gen.pieces
        max_new = max(req["max_new"], 0)
        if prefill_only:
            # prefill samples the first token, hands it to decode, and finishes with FINISH_LENGTH(0)
            out = pieces[:1] if max_new else []
            finish = {"type": "length", "length": 0}
        elif len(pieces) > max_new:
            out = pieces[:max_new]
            finish = {"type": "length", "length": max_new}
        else:
            out = pieces
            finish = {"type": "stop", "matched": 1}
        if self.mode == "null":
            self._log_prefill_batch(len(req["ids"]))
        if self.mode != "prefill" and len(out) > 1:  # decode lines are logged every few steps
            self._log_decode_batch(len(req["ids"]), len(out), time.monotonic() - t0)
        if self.resolved.get("log_requests") and not str(req["rid"]).startswith("HEALTH_CHECK"):
            out_d = {"text": "".join(out), "meta_info": {"id": req["rid"], "finish_reason": finish,
                                                         "prompt_tokens": len(req["ids"]),
                                                         "completion_tokens": len(out)}}
            log.info(f"Finish: obj={self._req_repr(req, body)}, out={_trunc(out_d)}")
        return {"req": req, "pieces": out, "finish": finish, "t0": t0,
                "prompt_tokens": len(req["ids"]), "digest": digest}

    def account(self, result: dict[str, Any], streaming: bool) -> None:
        m = self.metrics
        n_out = len(result["pieces"])
        e2e = time.monotonic() - result["t0"]
        m.t(m.prompt_tokens_total, streaming).inc(result["prompt_tokens"])
        m.t(m.generation_tokens_total, streaming).inc(n_out)
        m.t(m.num_requests_total).inc()
        m.t(m.time_to_first_token, streaming).observe(e2e / max(n_out, 1) if n_out else e2e)
        if n_out > 1:
            for _ in range(min(n_out - 1, 64)):
                m.t(m.inter_token_latency).observe(e2e / n_out)
        m.t(m.e2e_request_latency, streaming).observe(e2e)

    # ---------------------------------------------------------------- logging in SGLang's style

    def _log_prefill_batch(self, n_tokens: int) -> None:
        self.forward_ct += 1
        msg = (f"Prefill batch, #new-seq: 1, #new-token: {n_tokens}, #cached-token: 0, "
               f"token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, ")
        if self.mode == "prefill":
            msg += f"#bootstrap-req: 0, #inflight-req: {max(self.running - 1, 0)}, #optimistic-req: 0, "
        msg += f"cuda graph: False, input throughput (token/s): {n_tokens / 0.01:.2f}"
        log.info(msg)

    def _log_decode_batch(self, n_in: int, n_out: int, dt: float) -> None:
        self.last_gen_throughput = n_out / max(dt, 1e-3)
        self.metrics.s(self.metrics.gen_throughput).set(self.last_gen_throughput)
        msg = (f"Decode batch, #running-req: 1, #token: {n_in + n_out}, "
               f"token usage: {(n_in + n_out) / self.max_total_num_tokens:.2f}, ")
        if self.mode == "decode":
            msg += "pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, "
        msg += f"cuda graph: True, gen throughput (token/s): {self.last_gen_throughput:.2f}, #queue-req: 0"
        log.info(msg)

    # ---------------------------------------------------------------- lifecycle

    def init_torch_distributed(self) -> None:
        """Hold the rendezvous store's port as rank 0's ``TCPStore`` does (module docstring); on EADDRINUSE, fail as
        SGLang's launcher does: log the scheduler's exception and the SIGQUIT, then SIGKILL this process."""
        a = self.resolved
        if a.get("dist_init_addr"):
            port = int(str(a["dist_init_addr"]).rsplit(":", 1)[1])
        elif a.get("nccl_port"):
            port = int(a["nccl_port"])
        else:
            port = _free_port_below_ephemeral()
        log.info("Init torch distributed begin.")
        try:
            self.nccl_store = _tcp_store_listener(port)
        except OSError as e:
            code, name = -(e.errno or 0), _ERRNO_NAMES.get(e.errno or 0, "UNKNOWN")
            message = (os.strerror(e.errno) if e.errno else str(e)).lower()
            log.error("Scheduler hit an exception: Traceback (most recent call last):\n"
                      '  File "sglang/srt/distributed/parallel_state.py", in init_distributed_environment\n'
                      '  File "torch/distributed/rendezvous.py", in _create_c10d_store\n'
                      "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                      f"network address. port: {port}, useIpv6: false, code: {code}, name: {name}, "
                      f"message: {message}")
            log.error("Received sigquit from a child process. It usually means the child failed.")
            for h in log.handlers:
                h.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            raise
        log.info("Init torch distributed ends. mem usage=0.00 GB")

    def bootstrap_ready(self) -> bool:
        return self.registered >= self.expected_ranks

    def start(self) -> None:
        a = self.resolved
        host, port = a["host"], int(a["port"])
        t_start = time.monotonic()
        log.info(f"server_args={{disaggregation_mode={self.mode!r}, model_path={a['model_path']!r}, "
                 f"tp_size={a['tp_size']}, host={host!r}, port={port}}}")
        if self.args.page_size is None and self.page_size != 1 and mdl.ARCHITECTURE[self.family][0] != "deepseek_v4":
            log.warning(f"Setting page size to {self.page_size} for {self.model_info()['architectures'][0]}.")
        for w in self._startup_info:
            log.info(w)
        for w in self._startup_warnings:
            log.warning(w)
        self.init_torch_distributed()
        if self.mode == "prefill":
            bport = int(a["disaggregation_bootstrap_port"])
            self.bootstrap = _Server((host, bport), BootstrapHandler, self)
            threading.Thread(target=self.bootstrap.serve_forever, kwargs={"poll_interval": 0.1},
                             daemon=True, name="bootstrap").start()
            log.info(f"Bootstrap server started on {host}:{bport}")
        log.info("Load weight begin. avail mem=139.80 GB")
        if self.stop_event.wait(self.load_seconds):
            return
        log.info(f"Load weight end. type={self.model_info()['architectures'][0]}, dtype=torch.bfloat16, "
                 f"avail mem=79.80 GB, mem usage=60.00 GB.")
        log.info(f"KV Cache is allocated. #tokens: {self.max_total_num_tokens}, "
                 f"KV size: {self.max_total_num_tokens * KV_BYTES_PER_TOKEN / 2**30:.2f} GB")
        if self.mode == "prefill":
            for r in range(self.expected_ranks):
                self.registered += 1
                log.debug(f"Register prefill bootstrap: DP{r // self.attn_tp % self.dp} CP0 "
                          f"TP{r % self.attn_tp} PP0 "
                          f"({self.registered}/{self.expected_ranks} registered)")
        self.http = _Server((host, port), ApiHandler, self)
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.1},
                         daemon=True, name="http").start()
        for line in (f"Started server process [{os.getpid()}]", "Waiting for application startup.",
                     "Application startup complete.",
                     f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)"):
            uvicorn_log.info(f"INFO:     {line}")
        if a.get("skip_server_warmup"):
            self.startup_time = time.time()
            self.status = "Up"
            log.info("The server is fired up and ready to roll!")
            return
        if self.stop_event.wait(self.warmup_seconds):
            return
        # Warm-up: one /generate of 8 tokens (fake bootstrap in PD mode), as _execute_server_warmup does.
        warm = {"input_ids": [0, 1, 2], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        if self.mode != "null":
            warm.update({"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0})
        self.run("generate", warm)
        self.startup_time = time.time()
        self.status = "Up"
        log.info("End of prefill warmup with status 200, resp: [{}]" if self.mode == "prefill"
                 else "End of warmup with status 200")
        log.info("The server is fired up and ready to roll!")
        log.debug(f"startup took {time.monotonic() - t_start:.2f}s")

    def shutdown(self) -> None:
        self.gracefully_exit = True
        self.stop_event.set()
        for srv in (self.http, self.bootstrap):
            if srv is not None:
                srv.shutdown()
                srv.server_close()


_ERRNO_NAMES = {98: "EADDRINUSE", 13: "EACCES", 99: "EADDRNOTAVAIL"}


def _tcp_store_listener(port: int) -> socket.socket:
    """A listening socket on every address at *port*, as torch's libuv ``TCPStore`` server binds: ``[::]`` dual-stack
    first, else ``0.0.0.0``; ``SO_REUSEADDR`` set. Raises the IPv4 attempt's :class:`OSError`."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", port))
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    except OSError:  # (no IPv6 on this host)
        pass
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _free_port_below_ephemeral() -> int:
    """A port no socket holds, drawn at random from 10000 up to the ephemeral range's start (at most 100 draws)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randint(10000, max(low - 1, 10001))
        try:
            _tcp_store_listener(port).close()
            return port
        except OSError:
            continue
    raise OSError(98, f"no free port in 10000-{low - 1} after 100 draws")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, handler, sim: Sim) -> None:
        self.sim = sim
        if ":" in addr[0]:  # an IPv6 literal (--host ::1), which uvicorn binds too; socketserver's default is IPv4
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            log.debug(f"client {client_address} went away: {exc!r}")
            return
        super().handle_error(request, client_address)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # IPv6 only, as SGLang's uvicorn binds: asyncio's create_server sets IPV6_V6ONLY on an AF_INET6
            # socket, so a server on --host :: is not reached through 127.0.0.1
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # HTTPServer.server_bind would resolve socket.getfqdn(host): a DNS round trip we do not need.
        import socketserver
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


# --------------------------------------------------------------------------------------------------
# HTTP plumbing


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    @property
    def sim(self) -> Sim:
        return self.server.sim  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(status)
        if body or ctype:
            self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode("utf-8"))

    def _text(self, status: int, text: str, ctype: str = "text/plain; charset=utf-8") -> None:
        self._send(status, text.encode("utf-8"), ctype)

    def _client_gone(self) -> bool:
        """True once the peer has closed the connection (readable with nothing to read)."""
        import select
        import socket as _socket
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, _socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _raw(self) -> bytes:
        """The request body, read once (so a keep-alive connection stays in sync whatever we answer)."""
        if not hasattr(self, "_raw_body"):
            n = int(self.headers.get("content-length") or 0)
            self._raw_body = self.rfile.read(n) if n > 0 else b""
        return self._raw_body

    def _body(self) -> Any:
        raw = self._raw()
        if not raw:
            return {}
        return json.loads(raw)

    def handle_one_request(self) -> None:
        if hasattr(self, "_raw_body"):
            del self._raw_body
        super().handle_one_request()


class BootstrapHandler(_Base):
    """``CommonKVBootstrapServer`` (aiohttp) on the prefill server, plus the SIM-ONLY ``/sim/kv``."""

    server_version = "Python/3.11 aiohttp/3.13.2"

    def do_GET(self) -> None:  # noqa: N802
        u = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True))
        if u.path == "/health":
            return self._text(200, "OK")
        if u.path == "/route":
            return self._route_get(q)
        if u.path == "/sim/kv":
            try:
                room = int(q["room"])
                wait = float(q.get("wait", "1"))
            except (KeyError, ValueError):
                return self._text(400, "room and wait must be numbers")
            payload = self.sim.serve_kv(room, wait)
            if payload is None:
                return self._json(202, {"status": "pending", "bootstrap_room": room})
            return self._json(200, payload)
        return self._text(404, "404: Not Found")

    def do_PUT(self) -> None:  # noqa: N802
        self._raw()
        if urllib.parse.urlsplit(self.path).path == "/route":
            # A rank registering itself (CommonKVBootstrapServer._handle_route_put).
            try:
                data = self._body()
                for key in ("attn_tp_size", "attn_tp_rank", "attn_dp_rank", "pp_rank", "rank_ip", "rank_port",
                            "page_size", "kv_cache_dtype"):
                    data[key]
            except (ValueError, KeyError, TypeError):
                return self._text(500, "500 Internal Server Error\n\nServer got itself in trouble")
            self.sim.registered += 1
            return self._text(200, "OK")
        return self._text(405 if self.path.startswith("/health") else 404, "404: Not Found")

    def do_POST(self) -> None:  # noqa: N802
        self._raw()
        p = urllib.parse.urlsplit(self.path).path
        if p == "/register_dp_rank":
            self._body()
            return self._text(200, "OK")
        if p == "/query_dp_ranks":
            body = self._body()
            rooms = body.get("bootstrap_rooms", []) if isinstance(body, dict) else []
            return self._json(200, {str(r): int(r) % self.sim.dp for r in rooms})
        if p == "/route":
            return self._text(405, "Method not allowed", "application/json")
        return self._text(404, "404: Not Found")

    def _route_get(self, q: dict[str, str]) -> None:
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if any(not q.get(k) for k in keys):
            return self._text(400, "Missing inputs for bootstrap server.")
        sim = self.sim
        if not sim.bootstrap_ready():
            return self._text(503, f"Prefill server not fully registered yet ({sim.registered} workers "
                                   "registered).")
        try:
            vals = [int(q[k]) for k in keys]
        except ValueError:
            return self._text(500, "500 Internal Server Error\n\nServer got itself in trouble")
        a = sim.resolved
        if all(v == -1 for v in vals):
            return self._json(200, {
                "attn_tp_size": sim.attn_tp,
                "attn_cp_size": int(a.get("attn_cp_size") or 1),
                "dp_size": sim.dp,
                "pp_size": int(a.get("pp_size") or 1),
                "page_size": sim.page_size,
                "kv_cache_dtype": sim.kv_cache_dtype_str,
                "follow_bootstrap_room": True,
                "enable_dsa_cache_layer_split": bool(a.get("enable_dsa_cache_layer_split")),
                "enable_kv_cache_sharding": bool(a.get("enable_kv_cache_sharding")),
                "prefill_http_port": int(a["port"]),
                "decode_allocation_policy": a.get("disaggregation_decode_allocation_policy") or "early",
            })
        host = a["host"]
        return self._json(200, {"rank_ip": host, "rank_port": 17000 + vals[2]})


_GET_ROUTES = {"/health", "/health_generate", "/ready", "/server_info", "/get_server_info", "/model_info",
               "/get_model_info", "/v1/models", "/v1/loads", "/metrics", "/flush_cache"}
_POST_ROUTES = {"/generate", "/v1/chat/completions", "/v1/completions", "/flush_cache"}


class ApiHandler(_Base):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:  # noqa: ARG002
        """uvicorn's access line: ``INFO:     127.0.0.1:50786 - "GET /health HTTP/1.1" 200 OK``."""
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        access_log.info(f'INFO:     {host}:{port} - "{self.requestline}" {code} {phrase}'.rstrip())

    def _authorized(self) -> bool:
        """``sglang/srt/utils/auth.py`` ``decide_request_auth``: with ``--api-key``/``--admin-api-key``
        set, every route but /health*, /ready* and /metrics* needs ``Authorization: Bearer <key>``
        (``/flush_cache`` is admin-optional: the admin key when one is set); else 401."""
        a = self.sim.resolved
        api_key, admin_key = a.get("api_key"), a.get("admin_api_key")
        path = urllib.parse.urlsplit(self.path).path
        if not (api_key or admin_key) or path.startswith(("/health", "/ready", "/metrics")):
            return True
        expected = (admin_key or api_key) if path == "/flush_cache" else api_key
        if not expected:
            return True
        parts = (self.headers.get("authorization") or "").split(" ", 1)
        if len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == expected:
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        u = urllib.parse.urlsplit(self.path)
        path = u.path
        q = dict(urllib.parse.parse_qsl(u.query))
        sim = self.sim
        if path in ("/health", "/health_generate"):
            if sim.gracefully_exit:
                log.info("Health check request received during shutdown. Returning 503.")
                return self._send(503, b"", "")
            if sim.status == "Starting":
                return self._send(503, b"", "")
            if path == "/health" and os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in (
                    "0", "false", "no", "off"):
                return self._send(200, b"", "")
            warm = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}"}
            if sim.mode != "null":
                warm.update({"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0})
            try:
                sim.run("generate", warm)
            except Abort:
                return self._send(503, b"", "")
            return self._send(200, b"", "")
        if path == "/ready":
            return self._send(200 if sim.status == "Up" and not sim.gracefully_exit else 503, b"", "")
        if path == "/get_server_info":
            log.warning("Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
                        "Please use '/server_info' instead.")
            return self._json(200, sim.server_info())
        if path == "/server_info":
            return self._json(200, sim.server_info())
        if path == "/get_model_info":
            log.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                        "Please use '/model_info' instead.")
            return self._json(200, sim.model_info())
        if path == "/model_info":
            return self._json(200, sim.model_info())
        if path == "/v1/models":
            return self._json(200, sim.v1_models())
        if path.startswith("/v1/models/"):
            name = urllib.parse.unquote(path[len("/v1/models/"):])
            if name != sim.served_model_name:
                return self._json(404, {"error": {"message": f"The model '{name}' does not exist",
                                                  "type": "invalid_request_error", "param": "model",
                                                  "code": "model_not_found"}})
            return self._json(200, sim.v1_models()["data"][0])
        if path == "/v1/loads":
            try:
                body = sim.v1_loads(q.get("include"))
            except Abort as e:
                return self._error(e)
            return self._json(200, body)
        if path == "/metrics" and sim.enable_metrics:
            return self._send(200, sim.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/flush_cache":
            return self._flush()
        if path in _POST_ROUTES:
            return self._json(405, {"detail": "Method Not Allowed"})
        return self._json(404, {"detail": "Not Found"})

    def do_PUT(self) -> None:  # noqa: N802
        self._raw()
        if not self._authorized():
            return
        if urllib.parse.urlsplit(self.path).path == "/generate":
            return self.do_POST()
        return self._not_allowed_or_missing()

    def do_DELETE(self) -> None:  # noqa: N802
        self._raw()
        return self._not_allowed_or_missing()

    def _not_allowed_or_missing(self) -> None:
        p = urllib.parse.urlsplit(self.path).path
        if p in _GET_ROUTES or p in _POST_ROUTES:
            return self._json(405, {"detail": "Method Not Allowed"})
        return self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        self._raw()
        if not self._authorized():
            return
        path = urllib.parse.urlsplit(self.path).path
        if path == "/flush_cache":
            return self._flush()
        kind = {"/generate": "generate", "/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        if kind is None:
            return self._not_allowed_or_missing()
        try:
            body = self._body()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            return self._json(400, {"object": "error", "message": f"JSON decode error: {e}",
                                    "type": "Bad Request", "param": None, "code": 400})
        stream = bool(body.get("stream"))
        self._streaming = False
        try:
            if kind == "generate":
                return self._generate(body, stream)
            return self._openai(kind, body, stream)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not take the connection down silently
            log.exception(f"Error in request: {e}")
            if not self._streaming:
                return self._json(500, {"object": "error", "message": f"Internal server error: {e}",
                                         "type": "InternalServerError", "param": None, "code": 500})
            raise

    def _flush(self) -> None:
        if self.sim.running:
            return self._text(400, "Flush cache failed.\n")
        log.info("Cache flushed successfully!")
        return self._text(200, "Cache flushed.\nPlease check backend logs for more details. (When there are "
                               "running or waiting requests, the operation will not be performed.)\n")

    def _error(self, e: Abort, openai: bool = False) -> None:
        self.sim.metrics.t(self.sim.metrics.num_aborted_requests_total).inc()
        if e.status == 400:
            if openai:
                # OpenAIServingBase.handle_request: ValueError -> err_type "BadRequest"
                return self._json(400, {"object": "error", "message": e.message, "type": "BadRequest",
                                        "param": None, "code": 400})
            return self._json(400, {"error": {"message": e.message}})
        return self._json(e.status, {"object": "error", "message": e.message, "type": str(e.status),
                                     "param": None, "code": e.status})

    # ---- streaming helpers (chunked transfer encoding, as uvicorn sends a StreamingResponse)

    def _start_stream(self) -> None:
        self._streaming = True
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _sse(self, obj: Any) -> None:
        self._chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n")

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # ---- /generate

    def _meta(self, result: dict[str, Any], rid: str, n_out: int) -> dict[str, Any]:
        return {"id": rid, "finish_reason": result["finish"], "prompt_tokens": result["prompt_tokens"],
                "weight_version": "default", "total_retractions": 0, "completion_tokens": n_out,
                "cached_tokens": 0, "e2e_latency": time.monotonic() - result["t0"]}

    def _generate(self, body: dict[str, Any], stream: bool) -> None:
        sim = self.sim
        try:
            result = sim.run("generate", body, self._client_gone)
        except Abort as e:
            if stream:
                self._start_stream()
                rid = body.get("rid") or uuid.uuid4().hex
                self._sse({"text": "", "output_ids": [], "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": e.message, "status_code": e.status},
                    "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}})
                sim.metrics.t(sim.metrics.num_aborted_requests_total).inc()
                return self._end_stream()
            return self._error(e)
        sim.account(result, stream)
        rid = result["req"]["rid"]
        pieces = result["pieces"]
        ids = [mdl.piece_id(p) for p in pieces]
        if not stream:
            return self._json(200, {"text": "".join(pieces), "output_ids": ids,
                                    "meta_info": self._meta(result, rid, len(pieces))})
        self._start_stream()
        for i in range(len(pieces)):
            meta = self._meta(result, rid, i + 1)
            if i < len(pieces) - 1:
                meta["finish_reason"] = None
            self._sse({"text": "".join(pieces[: i + 1]), "output_ids": ids[: i + 1], "meta_info": meta})
        if not pieces:
            self._sse({"text": "", "output_ids": [], "meta_info": self._meta(result, rid, 0)})
        self._end_stream()

    # ---- OpenAI chat / completions

    def _openai(self, kind: str, body: dict[str, Any], stream: bool) -> None:
        sim = self.sim
        try:
            result = sim.run(kind, body, self._client_gone)
        except Abort as e:
            if stream:
                self._start_stream()
                # serving_chat: an abort with a status code becomes one error chunk, type = status name
                self._sse({"error": {"object": "error", "message": e.message, "type": HTTPStatus(e.status).name,
                                     "param": None, "code": e.status}})
                sim.metrics.t(sim.metrics.num_aborted_requests_total).inc()
                return self._end_stream()
            return self._error(e, openai=True)
        sim.account(result, stream)
        created = int(time.time())
        rid = result["req"]["rid"]
        model = body.get("model") or sim.served_model_name
        n_out = len(result["pieces"])
        usage = {"prompt_tokens": result["prompt_tokens"], "total_tokens": result["prompt_tokens"] + n_out,
                 "completion_tokens": n_out, "prompt_tokens_details": None, "reasoning_tokens": 0,
                 "completion_tokens_details": None}
        if kind == "completion":
            text = "".join(result["pieces"])
            fr = result["finish"]["type"]
            if not stream:
                return self._json(200, {"id": rid, "object": "text_completion", "created": created,
                                        "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                                     "finish_reason": fr, "matched_stop": None}],
                                        "usage": usage})
            self._start_stream()
            for i, p in enumerate(result["pieces"]):
                last = i == n_out - 1
                self._sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": p, "logprobs": None,
                                        "finish_reason": fr if last else None}]})
            return self._end_stream()
        parsed = self._parse_chat(body, result)
        if not stream:
            # serving_chat: ChatMessage(content=text if text else None, ...)
            message = {"role": "assistant", "content": parsed["content"] or None,
                       "reasoning_content": parsed["reasoning"] or None,
                       "tool_calls": parsed["tool_calls"] or None}
            return self._json(200, {
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": parsed["finish_reason"], "matched_stop": parsed["matched_stop"]}],
                "usage": usage, "metadata": {"weight_version": "default"}})
        self._stream_chat(body, result, parsed, rid, created, model, usage)

    def _parse_chat(self, body: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        sim = self.sim
        text = "".join(result["pieces"])
        rparser = sim.resolved.get("reasoning_parser")
        tparser = sim.resolved.get("tool_call_parser")
        reasoning = None
        if rparser and body.get("separate_reasoning", True):
            forced = parsers.reasoning_forced(rparser, body.get("chat_template_kwargs"))
            reasoning, text = parsers.split_reasoning(rparser, text, forced)
        finish = result["finish"]
        fr = finish["type"]
        matched = finish.get("matched")
        tool_calls = []
        tools = body.get("tools") or []
        if tparser and tools and body.get("tool_choice", "auto") != "none":
            normal, calls = parsers.parse_tool_calls(tparser, text, tools)
            if calls:
                text = normal
                for i, (name, args) in enumerate(calls):
                    tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
                                       "function": {"name": name, "arguments": args}})
                if fr == "stop":
                    fr, matched = "tool_calls", None
        return {"content": text, "reasoning": reasoning, "tool_calls": tool_calls, "finish_reason": fr,
                "matched_stop": matched if fr == "stop" else None}

    def _stream_chat(self, body, result, parsed, rid, created, model, usage) -> None:
        def chunk(delta: dict[str, Any], finish: str | None = None, matched=None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                 "matched_stop": matched}]}

        self._start_stream()
        self._sse(chunk({"role": "assistant", "content": ""}))
        pieces = result["pieces"]
        # Reasoning deltas up to </think>, then content deltas; tool-call markup is replaced by
        # tool_calls deltas (name first, then the complete arguments), as the DSML detectors stream.
        reasoning_end = 0
        if parsed["reasoning"] is not None:
            if parsers.THINK_END in pieces:
                reasoning_end = pieces.index(parsers.THINK_END) + 1
                for p in pieces[: reasoning_end - 1]:
                    self._sse(chunk({"reasoning_content": p}))
            else:
                reasoning_end = len(pieces)
                for p in pieces:
                    self._sse(chunk({"reasoning_content": p}))
        rest = pieces[reasoning_end:]
        if parsed["tool_calls"]:
            content = parsed["content"]
            if content:
                self._sse(chunk({"content": content}))
            for tc in parsed["tool_calls"]:
                self._sse(chunk({"tool_calls": [{"id": tc["id"], "index": tc["index"], "type": "function",
                                                 "function": {"name": tc["function"]["name"], "arguments": ""}}]}))
                self._sse(chunk({"tool_calls": [{"index": tc["index"],
                                                 "function": {"arguments": tc["function"]["arguments"]}}]}))
        else:
            first = True
            for p in rest:
                if first and reasoning_end:
                    p = p.lstrip()
                    if not p:
                        continue
                first = False
                self._sse(chunk({"content": p}))
        self._sse(chunk({}, parsed["finish_reason"], parsed["matched_stop"]))
        so = body.get("stream_options") or {}
        if so.get("include_usage"):
            self._sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage})
        self._end_stream()


# --------------------------------------------------------------------------------------------------


def _configure_logging(resolved: dict[str, Any]) -> None:
    """``--log-level`` for the server's lines, ``--log-level-http`` (else ``--log-level``) for uvicorn's
    access lines, as SGLang passes them to ``configure_logger`` and ``uvicorn.Config``."""
    level = str(resolved.get("log_level") or "info").upper()
    http_level = str(resolved.get("log_level_http") or resolved.get("log_level") or "info").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(getattr(logging, level, logging.INFO))
    log.propagate = False
    plain = logging.StreamHandler(sys.stderr)
    plain.setFormatter(logging.Formatter("%(message)s"))
    for lg, lvl in ((access_log, http_level), (uvicorn_log, http_level)):
        lg.addHandler(plain)
        lg.setLevel(getattr(logging, lvl, logging.INFO))
        lg.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        sim = Sim(argv)  # argparse exits 2 on bad flags, like SGLang
    except StartupError as e:
        print(f"Traceback (most recent call last):\n  File \"sglang/srt/server_args.py\", in prepare_server_args\n"
              f"{e}", file=sys.stderr)
        return 1
    _configure_logging(sim.resolved)

    done = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        # tokenizer_manager.SignalHandler.sigterm_handler; SGLang's sigterm_watchdog then drains the
        # running requests (polling every 5 s) before exiting 0. The stand-in drains for under a second.
        log.warning(f"{signal.Signals(signum).name} received. signum=None frame=None. "
                    "Draining requests and shutting down...")
        sim.gracefully_exit = True
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def starter() -> None:
        try:
            sim.start()
        except OSError as e:
            log.error(f"ERROR: {e}")
            os._exit(1)
        except Exception:  # noqa: BLE001
            log.error("Initialization failed: " + traceback.format_exc())
            os._exit(1)

    threading.Thread(target=starter, daemon=True, name="launch").start()
    # (in short waits: a signal the kernel hands to another thread — which one takes a SIGTERM pending while the
    # process was stopped, once SIGCONT wakes them all, is up to the scheduler — runs its Python handler only when the
    # main thread next runs bytecode; a wait with no timeout never did, and the server ignored the SIGTERM until the
    # SIGKILL. SGLang's main thread runs uvicorn's event loop, which a signal wakes through its wakeup fd)
    while not done.wait(0.2):
        pass
    sim.gracefully_exit = True
    deadline = time.monotonic() + 0.6
    while sim.running and time.monotonic() < deadline:
        time.sleep(0.02)
    log.info(f"Gracefully exiting... Remaining number of requests {sim.running}.")
    sim.stop_event.set()
    threading.Thread(target=sim.shutdown, daemon=True).start()
    time.sleep(0.1)
    if sim.http is not None:
        for line in ("Shutting down", "Waiting for application shutdown.", "Application shutdown complete.",
                     f"Finished server process [{os.getpid()}]"):
            uvicorn_log.info(f"INFO:     {line}")
    for h in log.handlers + access_log.handlers:
        h.flush()
    sys.stderr.flush()
    os._exit(0)
