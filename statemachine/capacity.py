"""Capacity: the KV pool each role gets, and what that means for requests — estimated before anything starts.

For each serving role, from the model's facts (:mod:`pdctl.statemachine.models`), the role's GPUs and the spec:

* **GPU memory** per GPU, MiB: ``--gpu-memory`` given to ``pdctl capacity``; else declared (``hosts.<h>.gpu_name`` of
  a GPU in :data:`GPU_MEMORY_MIB`); else read on the host (``nvidia-smi --query-gpu=index,memory.total``, the query
  SGLang 0.5.23 itself sizes from, ``utils/common.py get_nvgpu_memory_capacity``: the smallest of the role's GPUs);
* **weights per GPU**: the checkpoint's weights over TP (:func:`~pdctl.statemachine.models.weights_per_gpu`);
* **the KV pool in tokens** (SGLang's ``max_total_num_tokens``, which ``/server_info`` reports), as SGLang 0.5.23
  computes it (``mem_cache/kv_cache_configurator.py _profile_available_bytes``, ``model_executor/pool_configurator.py``):
  ``available = free memory after the weights − pre_load × (1 − mem_fraction)`` = ``pre_load × mem_fraction −
  weights``, where ``pre_load`` is the GPU's free memory before the weights load, taken as its total less
  :data:`RUNTIME_OVERHEAD_MIB` (an assumption: the CUDA context and NCCL buffers, which SGLang measures rather than
  computes); then ``(available − fixed) / bytes per token``, rounded down to whole pages. ``mem_fraction`` unset is
  SGLang's own default (``arg_groups/memory_hook.py handle_gpu_memory_settings``, :func:`default_mem_fraction`);
* **requests at once**: how many requests of the spec's ``context_length`` (SGLang's default: the model's) the pool
  holds, and SGLang's cap on running requests (``resolve_max_num_reqs``; DeepSeek-V4: 256,
  ``arg_groups/deepseek_v4_hook.py``);
* **whether one request of N tokens fits at all** (``pdctl capacity --context N``), and what would make it fit:
  fp8 KV, more GPUs (twice the TP), a lower context.

The estimate is SGLang's arithmetic on pdctl's numbers: the weights (a table estimate unless read from the
checkpoint's index) and the runtime overhead are the uncertain inputs, so the figure is good to a few percent, not to
the token; ``/server_info``'s ``max_total_num_tokens`` is the truth once a server runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pdctl.statemachine.models import (
    DSV4_RING,
    DSV4_STATE_BYTES,
    ModelFacts,
    ModelFactsError,
    _dsv4_per_layer,
    builtin_facts,
    facts_for,
    human_tokens,
    kv_layer_bytes,
    resolve_kv_dtype,
    weights_per_gpu,
)

if TYPE_CHECKING:  # pragma: no cover
    from pdctl.statemachine.hosts import Host
    from pdctl.statemachine.plan import Plan
    from pdctl.statemachine.spec import Deployment, ServerRole
    from pdctl.statemachine.spec import Host as HostSpec
    from pdctl.statemachine.topology import RoleTopology

__all__ = ["GPU_MEMORY_MIB", "CapacityReport", "GpuMemory", "RoleCapacity", "RoleInput", "capacity_report",
           "default_mem_fraction", "estimate", "plan_capacity", "render_plan_capacity", "render_report"]

GIB = 1 << 30
RUNTIME_OVERHEAD_MIB = 1024
"""GPU memory taken before SGLang measures ``pre_model_load_memory`` (CUDA context, NCCL communicators), MiB: pdctl's
assumption, not a SGLang number (it measures). 1 GiB: a Hopper context with lazy module loading is ~0.5 GiB, NCCL's
buffers for a TP group of 4–8 a few hundred MiB more."""

_SMI = "nvidia-smi memory.total as public nvidia-smi output of this GPU shows it"
GPU_MEMORY_MIB: dict[str, tuple[int, str]] = {
    "nvidia h100 80gb hbm3": (81559, _SMI),
    "nvidia h200": (143771, _SMI),
    "nvidia b200": (183359, _SMI),
    "nvidia rtx pro 6000 blackwell workstation edition": (97887, _SMI),
    "nvidia rtx pro 6000 blackwell max-q workstation edition": (97887, _SMI),
    "nvidia rtx pro 6000 blackwell server edition": (97887, _SMI),
}
"""A GPU's total memory by the name nvidia-smi gives it (``hosts.<h>.gpu_name``, case ignored), with the source."""

GPU_QUERY = ("nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's total memory as pdctl knows it."""

    mib: float
    source: str


def declared_gpu_memory(host: HostSpec | None) -> GpuMemory | None:
    """The memory of *host*'s GPUs from its declared ``gpu_name`` (None: none declared, or a GPU pdctl's table lacks)."""
    if host is None or not host.gpu_name:
        return None
    hit = GPU_MEMORY_MIB.get(host.gpu_name.strip().lower())
    return None if hit is None else GpuMemory(hit[0], f"declared gpu_name {host.gpu_name!r}")


def discovered_gpu_memory(host: Host, gpus: list[int]) -> GpuMemory | None:
    """The smallest total memory among *gpus* on *host* (``nvidia-smi``), None where the host has no nvidia-smi or
    it fails or lists none of them."""
    from pdctl.statemachine.errors import HostError

    try:
        res = host.run(list(GPU_QUERY), timeout=60, check=False)
    except (HostError, OSError):
        return None
    if res.returncode != 0:
        return None
    found: dict[int, float] = {}
    for line in res.stdout.splitlines():
        idx, _sep, mib = (p.strip() for p in line.partition(","))
        if idx.isdigit() and re.fullmatch(r"\d+(\.\d+)?", mib):
            found[int(idx)] = float(mib)
    mine = [found[g] for g in gpus if g in found]
    name = getattr(host, "name", "?")
    return GpuMemory(min(mine), f"nvidia-smi on host {name}") if mine else None


# --- what a role runs with ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoleInput:
    """What sizes one role's pool: the spec's (or a journal's) settings of it."""

    name: str
    kind: str
    host: str
    gpus: tuple[int, ...]
    tp: int
    attn_dp: int
    model_path: str
    context_length: int | None
    page_size: int | None
    kv_cache_dtype: str
    mem_fraction: float | None
    extra_args: tuple[str, ...] = ()

    @classmethod
    def of(cls, r: RoleTopology) -> RoleInput:
        """From a role's topology (the spec's, or the journal's record of what was deployed)."""
        model = r.settings.get("model") or {}
        return cls(name=r.name, kind=r.kind, host=r.host, gpus=tuple(r.gpus), tp=r.tp, attn_dp=r.attn_dp,
                   model_path=str(model.get("path") or ""), context_length=model.get("context_length"),
                   page_size=model.get("page_size"), kv_cache_dtype=str(model.get("kv_cache_dtype") or "auto"),
                   mem_fraction=r.settings.get("mem_fraction"), extra_args=tuple(r.settings.get("extra_args") or ()))

    @classmethod
    def of_spec(cls, dep: Deployment, name: str, kind: str, r: ServerRole) -> RoleInput:
        """From a spec's role (as :func:`~pdctl.statemachine.topology.topology_of` would record it)."""
        m = dep.model
        return cls(name=name, kind=kind, host=r.host, gpus=tuple(r.gpus), tp=r.tp, attn_dp=r.attn_dp,
                   model_path=m.path, context_length=m.context_length,
                   page_size=r.page_size if r.page_size is not None else m.page_size,
                   kv_cache_dtype=r.kv_cache_dtype if r.kv_cache_dtype is not None else m.kv_cache_dtype,
                   mem_fraction=r.mem_fraction, extra_args=tuple(r.extra_args))

    def flag(self, name: str) -> str | None:
        """The value of launch flag *name* in ``extra_args`` (``--flag V`` or ``--flag=V``; the last wins)."""
        got = None
        for i, a in enumerate(self.extra_args):
            if a == name and i + 1 < len(self.extra_args):
                got = self.extra_args[i + 1]
            elif a.startswith(name + "="):
                got = a.split("=", 1)[1]
        return got

    def number(self, name: str) -> float | None:
        v = self.flag(name)
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None


# --- SGLang's defaults --------------------------------------------------------------------------------------------
def default_chunked_prefill(gpu_mib: float) -> int:
    """``--chunked-prefill-size`` by GPU memory (SGLang 0.5.23 ``handle_gpu_memory_settings``)."""
    if gpu_mib < 20 * 1024:
        return 2048
    if gpu_mib < 60 * 1024:
        return 4096
    if gpu_mib < 160 * 1024:
        return 8192
    return 16384


def default_decode_max_bs(gpu_mib: float, tp: int) -> int:
    """The decode CUDA graph's largest batch by GPU memory and TP (the same function)."""
    if gpu_mib < 20 * 1024:
        return 8
    if gpu_mib < 35 * 1024:
        return 48 if tp < 4 else 160
    if gpu_mib < 60 * 1024:
        return 32 if tp < 4 else 160
    if gpu_mib < 160 * 1024:
        return 256 if tp < 4 else 512
    return 512


def _prefill_graph_sizes(max_bs: int) -> int:
    # generate_prefill_cuda_graph_batch_sizes (arg_groups/cuda_graph_hook.py): how many sizes it captures
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return sum(1 for s in sizes if s <= max_bs)


def default_mem_fraction(facts: ModelFacts, role: RoleInput, gpu_mib: float) -> float:
    """SGLang 0.5.23's ``--mem-fraction-static`` when none is given (``handle_gpu_memory_settings``, the path without
    post-capture KV sizing, ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`` off by default): ``(gpu − reserved) / gpu``
    rounded to 3 places, reserved (MiB) = 512 + 1.5 × activation tokens + TP/8 × 1024 + the CUDA graphs' reserve
    (``reserve_for_graph_mb``), at least 10 GiB on a GPU over 60 GiB."""
    chunked = int(role.number("--chunked-prefill-size") or default_chunked_prefill(gpu_mib))
    max_bs = default_decode_max_bs(gpu_mib, role.tp)
    mrr = role.number("--max-running-requests")
    if mrr is not None and max_bs > mrr:
        max_bs = int(mrr)
    mla = facts.attention in ("mla", "mla+dsa")
    if role.kind == "decode":
        activation = max(int(mrr or max_bs), 2048)
    else:
        activation = max(chunked, 2048)
    reserved = 512 + activation * 1.5 + role.tp / 8 * 1024
    if role.kind != "prefill":  # the decode graph
        reserved += max_bs * 2
        if role.attn_dp > 1:
            reserved += max_bs * role.attn_dp * 3 + (max_bs * role.attn_dp * 1.5 if max_bs > 300 else 0)
    if role.kind != "decode":  # the prefill graph (breakable on CUDA by default)
        reserved += 1.5 * 1024 if mla else _prefill_graph_sizes(chunked) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


# --- the estimate -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoleCapacity:
    """One role's estimate. Byte figures are per GPU; token figures per attention-DP worker unless said."""

    role: str
    kind: str
    host: str
    gpus: int
    tp: int
    attn_dp: int
    gpu_memory_mib: float | None
    gpu_memory_source: str
    mem_fraction: float | None
    mem_fraction_source: str
    kv_cache_dtype: str
    page_size: int
    weights_per_gpu_bytes: float | None
    kv_bytes: float | None
    """Bytes left for the KV pool per GPU (SGLang's ``available_bytes``); negative: the weights do not fit."""
    fixed_bytes: float
    """Of :attr:`kv_bytes`, what does not scale with tokens (DeepSeek-V4's compress-state rings)."""
    bytes_per_token: float | None
    kv_pool_tokens: int | None
    """SGLang's ``max_total_num_tokens`` for one worker (``/server_info``)."""
    context_length: int
    """The servers' context length (``model.context_length``, else the model's): SGLang's longest request."""
    requests_at_context: int | None
    """Requests of :attr:`context_length` tokens the pools hold at once, over all attention-DP workers."""
    max_running_requests: int | None
    """SGLang's cap on running requests, over all attention-DP workers (``resolve_max_num_reqs``)."""
    problem: str | None = None
    """Why there is no estimate (the GPU memory or weights unknown), or why the role cannot start."""
    min_mem_fraction: float | None = None
    """The smallest mem_fraction that leaves the KV pool any memory (SGLang's own hint when it refuses)."""

    @property
    def concurrent_requests(self) -> int | None:
        """Requests of :attr:`context_length` that run at once: what the pools hold, at most SGLang's cap."""
        if self.requests_at_context is None or self.max_running_requests is None:
            return None
        return min(self.requests_at_context, self.max_running_requests)

    def requests_of(self, tokens: int) -> int | None:
        """Requests of *tokens* tokens the pools hold at once, over all attention-DP workers (None: no estimate)."""
        if self.kv_pool_tokens is None:
            return None
        return self.kv_pool_tokens // max(tokens, 1) * max(self.attn_dp, 1)

    def fits(self, tokens: int) -> bool | None:
        """Whether one request of *tokens* tokens fits this role's pool (None: no estimate)."""
        return None if self.kv_pool_tokens is None else tokens <= self.kv_pool_tokens

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "concurrent_requests": self.concurrent_requests}


def _pool_dsv4(facts: ModelFacts, role: RoleInput, available: float, page: int) -> tuple[int, float, float]:
    """``(full tokens, bytes per full token, fixed bytes)`` as SGLang 0.5.23 ``DSV4PoolConfigurator`` sizes them on
    CUDA: ratio mode (``swa_full_tokens_ratio`` 0.1, set by ``model_overrides/deepseek_v4.py`` and so taken as given),
    no speculative decoding, the default V4 layout and fp32 compress state."""
    per = _dsv4_per_layer(facts)
    by_ratio = facts.layers_by_ratio()
    layers = facts.num_layers
    head = facts.qk_nope_head_dim + facts.qk_rope_head_dim
    ratio = role.number("--swa-full-tokens-ratio")
    swa_ratio = 0.1 if ratio is None else ratio
    # _get_bytes_per_swa_token: the window's rows on every layer, plus the ratio-4 compress state per SWA page
    c4_state = 2 * 2 * head * DSV4_STATE_BYTES + 2 * 2 * facts.index_head_dim * DSV4_STATE_BYTES
    per_swa = per["swa"] * layers + DSV4_RING[4] / page * c4_state * by_ratio.get(4, 0)
    per_full = swa_ratio * per_swa + sum(per.get(f"c{r}", 0.0) * n for r, n in by_ratio.items() if r)
    # fixed: the ratio-128 (and ratio-2) compress-state pools, one ring per request slot
    mrr = int(role.number("--max-running-requests") or 256) // max(role.attn_dp, 1)
    slots = max(mrr, 1) + 1  # _get_num_req_slots (decode extra slots default to 0 above 32 requests per worker)
    fixed = 0.0
    if by_ratio.get(128):
        rows = math.ceil((slots * DSV4_RING[128] + DSV4_RING[128] + 1) / 128) * 128
        fixed += rows * 2 * head * DSV4_STATE_BYTES * by_ratio[128]
    if by_ratio.get(2):
        rows = math.ceil((slots * DSV4_RING[2] + DSV4_RING[2] + 1) / 2) * 2
        fixed += rows * 2 * head * 4 * by_ratio[2]
    full = int(max(available - fixed, 0) / per_full) // page * page
    return full, per_full, fixed


def estimate(facts: ModelFacts, role: RoleInput, gpu: GpuMemory | None, *,
             weights_bytes: float | None = None) -> RoleCapacity:
    """*role*'s capacity on GPUs of *gpu* memory (None: unknown, no estimate). *weights_bytes*: the weights per GPU
    instead of the facts' (a what-if)."""
    try:
        dtype = resolve_kv_dtype(facts, role.kv_cache_dtype)
        kv_layer_bytes(facts, dtype)
    except ModelFactsError as exc:
        dtype, problem = role.kv_cache_dtype, str(exc)
    else:
        problem = None
    page = facts.pd.page_size or role.page_size or 1
    ctx = role.context_length or facts.max_context
    weights = weights_bytes if weights_bytes is not None else weights_per_gpu(facts, role.tp)
    base = dict(role=role.name, kind=role.kind, host=role.host, gpus=len(role.gpus), tp=role.tp, attn_dp=role.attn_dp,
                kv_cache_dtype=dtype, page_size=page, weights_per_gpu_bytes=weights, context_length=ctx)
    if gpu is None or weights is None or problem is not None:
        why = problem or ("the GPU memory is unknown: declare hosts.<h>.gpu_name of a GPU pdctl knows, give --gpu-memory, "
                          "or let pdctl read it on the host (nvidia-smi)" if gpu is None else
                          "the model's weights are unknown (no safetensors index and no table entry)")
        return RoleCapacity(gpu_memory_mib=gpu.mib if gpu else None, gpu_memory_source=gpu.source if gpu else "unknown",
                            mem_fraction=role.mem_fraction, mem_fraction_source="spec" if role.mem_fraction else "",
                            kv_bytes=None, fixed_bytes=0.0, bytes_per_token=None, kv_pool_tokens=None,
                            requests_at_context=None, max_running_requests=None, problem=why, **base)
    if role.mem_fraction is not None:
        frac, frac_src = role.mem_fraction, "spec (mem_fraction)"
    else:
        frac, frac_src = default_mem_fraction(facts, role, gpu.mib), "SGLang 0.5.23's default for this GPU and role"
    pre_gib = (gpu.mib - RUNTIME_OVERHEAD_MIB) / 1024
    avail_gib = pre_gib * frac - weights / GIB
    available = avail_gib * GIB
    min_frac = round((weights / GIB) / pre_gib, 4)
    fixed = 0.0
    attn_tp = max(role.tp // max(role.attn_dp, 1), 1)
    if facts.attention == "dsv4":
        pool, per_token, fixed = _pool_dsv4(facts, role, available, page) if available > 0 else (0, 0.0, 0.0)
        if not per_token:
            per_token = _pool_dsv4(facts, role, 0.0, page)[1]
    else:
        per = kv_layer_bytes(facts, dtype, attn_tp=attn_tp)
        if facts.attention in ("mla", "mla+dsa"):
            per_token = per["latent"] * facts.num_layers + per.get("index", 0.0) * facts.indexer_layers
        elif facts.attention == "gqa":
            per_token = per["full"] * facts.num_layers
        else:
            ratio = role.number("--swa-full-tokens-ratio")
            per_token = per["full"] * facts.full_layers + (0.8 if ratio is None else ratio) * per["sliding"] * \
                facts.swa_layers
        pool = int(max(available, 0) // per_token) // page * page
    cap = role.number("--max-total-tokens")
    if cap is not None:
        pool = min(pool, int(cap) // page * page)
    cannot = None
    if available <= 0:
        cannot = (f"the weights ({weights / GIB:.1f} GiB per GPU) leave no memory for the KV cache at mem_fraction "
                  f"{frac:g}: SGLang stops at start ('Loaded weights leave no GPU memory for the KV cache')")
    elif pool <= 0:
        cannot = "no KV pool is left after the fixed pools: SGLang stops at start ('Not enough memory')"
    # resolve_max_num_reqs, per attention-DP worker
    requested = role.number("--max-running-requests") or (256 if facts.attention == "dsv4" else None)
    if requested is not None:
        mrr = min(max(1, int(requested) // max(role.attn_dp, 1)), pool // 2)
    else:
        mrr = min(max(min(int(pool / max(ctx, 1) * 512), 4096), 2048), pool // 2)
    dp = max(role.attn_dp, 1)
    return RoleCapacity(gpu_memory_mib=gpu.mib, gpu_memory_source=gpu.source, mem_fraction=frac,
                        mem_fraction_source=frac_src, kv_bytes=available, fixed_bytes=fixed,
                        bytes_per_token=per_token, kv_pool_tokens=max(pool, 0),
                        requests_at_context=max(pool, 0) // max(ctx, 1) * dp, max_running_requests=max(mrr, 0) * dp,
                        problem=cannot, min_mem_fraction=min_frac, **base)


# --- a whole deployment ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    """A change that would make a request of the asked length fit, with the pool it gives."""

    change: str
    role: str
    kv_pool_tokens: int
    fits: bool


@dataclass(frozen=True)
class CapacityReport:
    """``pdctl capacity``'s answer."""

    deployment: str
    model: ModelFacts | None
    model_path: str
    context: int
    """The request length asked about (``--context``, else the spec's context_length, else the model's)."""
    roles: tuple[RoleCapacity, ...]
    suggestions: tuple[Suggestion, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.model is not None and all(r.kv_pool_tokens is not None for r in self.roles)

    @property
    def fits_kv_pool(self) -> bool | None:
        """Whether one request of :attr:`context` tokens fits every role's KV pool (None: unknown)."""
        if not self.known:
            return None
        return all(r.problem is None and r.fits(self.context) for r in self.roles)

    @property
    def context_allowed(self) -> bool:
        """Whether the servers accept a request that long: at most their context_length (and the model's)."""
        if self.model is None:
            return True
        return self.context <= self.model.max_context and all(self.context <= r.context_length for r in self.roles)

    @property
    def fits(self) -> bool | None:
        """Whether the deployment as specified serves one request of :attr:`context` tokens: it fits every role's
        pool and the servers accept it (None: unknown)."""
        pool = self.fits_kv_pool
        return None if pool is None else pool and self.context_allowed

    def to_json(self) -> dict[str, Any]:
        roles = [{**r.to_json(), "requests_of_context": r.requests_of(self.context),
                  "fits_context": r.fits(self.context)} for r in self.roles]
        return {"deployment": self.deployment, "model_path": self.model_path,
                "model": self.model.to_json() if self.model else None, "context": self.context, "fits": self.fits,
                "fits_kv_pool": self.fits_kv_pool, "context_allowed": self.context_allowed, "roles": roles,
                "suggestions": [asdict(s) for s in self.suggestions], "notes": list(self.notes),
                "runtime_overhead_mib": RUNTIME_OVERHEAD_MIB}


def _inputs(dep: Deployment) -> list[RoleInput]:
    return [RoleInput.of_spec(dep, n, k, r) for n, k, r in dep.roles()]


def capacity_report(dep: Deployment, *, context: int | None = None, gpu_memory_mib: float | None = None,
                    hosts: dict[str, Host] | None = None) -> CapacityReport:
    """The capacity of every serving role of *dep*. *gpu_memory_mib* overrides every GPU's memory; *hosts* (host key
    -> an open :class:`~pdctl.statemachine.hosts.Host`) are where undeclared GPU memory is read and a local
    checkpoint's config.json; without them nothing is contacted."""
    roles = _inputs(dep)
    first_host = (hosts or {}).get(roles[0].host) if roles else None
    facts = facts_for(dep.model.path, first_host)
    ctx = context or dep.model.context_length or (facts.max_context if facts else 0)
    notes: list[str] = []
    out: list[RoleCapacity] = []
    for r in roles:
        gpu = GpuMemory(gpu_memory_mib, "--gpu-memory") if gpu_memory_mib else declared_gpu_memory(dep.hosts.get(r.host))
        if gpu is None and hosts and r.host in hosts:
            gpu = discovered_gpu_memory(hosts[r.host], list(r.gpus))
        if facts is None:
            out.append(RoleCapacity(role=r.name, kind=r.kind, host=r.host, gpus=len(r.gpus), tp=r.tp, attn_dp=r.attn_dp,
                                    gpu_memory_mib=gpu.mib if gpu else None,
                                    gpu_memory_source=gpu.source if gpu else "unknown", mem_fraction=r.mem_fraction,
                                    mem_fraction_source="spec" if r.mem_fraction else "", kv_cache_dtype=r.kv_cache_dtype,
                                    page_size=r.page_size or 1, weights_per_gpu_bytes=None, kv_bytes=None,
                                    fixed_bytes=0.0, bytes_per_token=None, kv_pool_tokens=None, context_length=ctx,
                                    requests_at_context=None, max_running_requests=None,
                                    problem=f"pdctl knows no facts of {dep.model.path!r}: give a local checkpoint "
                                            "directory (config.json), or a model of its table"))
            continue
        out.append(estimate(facts, r, gpu))
    report = CapacityReport(deployment=dep.name, model=facts, model_path=dep.model.path, context=ctx, roles=tuple(out))
    if facts is not None and facts.attention == "dsv4":
        notes.append("DeepSeek-V4 on CUDA: SGLang 0.5.23 sizes the FlashMLA V4 layout (584-byte rows) whatever "
                     "kv_cache_dtype says, so fp8 KV changes nothing here")
    if facts is not None and ctx > facts.max_context:
        notes.append(f"{ctx} tokens exceed the model's context ({facts.max_context}): SGLang refuses a longer "
                     "--context-length at start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    longer = [r.role for r in out if ctx > r.context_length]
    if longer and facts is not None and ctx <= facts.max_context:
        notes.append(f"{ctx} tokens exceed model.context_length ({out[0].context_length}) of {', '.join(longer)}: the "
                     f"servers refuse longer requests; set model.context_length = {ctx} (the pools' requests at once "
                     "are then counted at that length)")
    sugg = tuple(_suggestions(facts, dep, roles, out, ctx)) if facts is not None and report.known else ()
    return CapacityReport(deployment=dep.name, model=facts, model_path=dep.model.path, context=ctx, roles=tuple(out),
                          suggestions=sugg, notes=tuple(notes))


def _suggestions(facts: ModelFacts, dep: Deployment, roles: list[RoleInput], got: list[RoleCapacity],
                 ctx: int) -> list[Suggestion]:
    out: list[Suggestion] = []
    for r, cap in zip(roles, got):
        if cap.problem is None and cap.fits(ctx):
            continue  # (a request the servers refuse for its length is said in the notes)
        gpu = GpuMemory(cap.gpu_memory_mib or 0, cap.gpu_memory_source)
        if facts.attention != "dsv4" and cap.kv_cache_dtype in ("bf16", "float16"):
            alt = estimate(facts, _replace(r, kv_cache_dtype="fp8_e4m3"), gpu)
            out.append(Suggestion("kv_cache_dtype = \"fp8_e4m3\"", r.name, alt.kv_pool_tokens or 0,
                                  alt.problem is None and bool(alt.fits(ctx))))
        for factor in (2, 4):
            tp = r.tp * factor
            if tp > 16:
                break
            alt = estimate(facts, _replace(r, tp=tp, gpus=tuple(range(tp))), gpu)
            ok = alt.problem is None and bool(alt.fits(ctx))
            out.append(Suggestion(f"{tp} GPUs (TP{tp})", r.name, alt.kv_pool_tokens or 0, ok))
            if ok:
                break
        if cap.problem is None and cap.kv_pool_tokens:
            out.append(Suggestion(f"context of at most {cap.kv_pool_tokens} tokens", r.name, cap.kv_pool_tokens, True))
    return out


def _replace(r: RoleInput, **kw: Any) -> RoleInput:
    from dataclasses import replace

    return replace(r, **kw)


# --- capacity in the plan -------------------------------------------------------------------------------------------
def plan_capacity(plan: Plan, dep: Deployment) -> tuple[dict[str, Any], ...] | None:
    """How the plan moves each kept role's KV pool and requests at once (roles on both sides whose estimate
    differs), with the GPU memory *dep* declares; None where nothing can be estimated (no model facts, or no GPU
    memory declared for any role's host) or nothing was deployed. Contacts no host."""
    if plan.from_topology is None:
        return None
    old = {r.name: r for r in plan.from_topology.roles}
    out: list[dict[str, Any]] = []
    estimated = False
    for new in plan.to_topology.roles:
        was = old.get(new.name)
        if was is None:
            continue
        gpu = declared_gpu_memory(dep.hosts.get(new.host))
        a, b = RoleInput.of(was), RoleInput.of(new)
        fa, fb = builtin_facts(a.model_path), builtin_facts(b.model_path)
        if gpu is None or fa is None or fb is None:
            continue
        estimated = True
        ca, cb = estimate(fa, a, gpu), estimate(fb, b, gpu)
        if (ca.kv_pool_tokens, ca.requests_at_context, ca.max_running_requests) == \
                (cb.kv_pool_tokens, cb.requests_at_context, cb.max_running_requests):
            continue
        out.append({"role": new.name,
                    "before": {k: getattr(ca, k) for k in ("kv_pool_tokens", "requests_at_context",
                                                           "max_running_requests", "context_length")},
                    "after": {k: getattr(cb, k) for k in ("kv_pool_tokens", "requests_at_context",
                                                          "max_running_requests", "context_length")},
                    "words": _change_words(new.name, ca, cb)})
    return tuple(out) if estimated else None


def _change_words(name: str, a: RoleCapacity, b: RoleCapacity) -> str:
    pa, pb = a.kv_pool_tokens or 0, b.kv_pool_tokens or 0
    words = f"{name} KV pool {human_tokens(pa)} → {human_tokens(pb)} tokens"
    ra, rb = a.requests_at_context or 0, b.requests_at_context or 0
    if a.context_length == b.context_length and ra != rb:
        words += f"; requests of {b.context_length} tokens at once {ra} → {rb}"
        if ra > 0 and rb == 0:
            words += f" ({b.context_length} × 1 no longer fits)"
    elif a.context_length != b.context_length:
        words += f"; {a.context_length} × {ra} → {b.context_length} × {rb}"
    if b.problem:
        words += f"; {b.problem}"
    return words


def render_plan_capacity(entries: tuple[dict[str, Any], ...]) -> str:
    """The plan's capacity lines (:attr:`Plan.capacity`)."""
    lines = ["Capacity (estimated from the model's facts and the declared GPU memory; `pdctl capacity SPEC` shows "
             "all of it):"]
    lines += [f"  ~ {e['words']}" for e in entries]
    return "\n".join(lines)


# --- text ---------------------------------------------------------------------------------------------------------
def _gib(b: float | None) -> str:
    return "?" if b is None else f"{b / GIB:.1f} GiB"


def render_report(rep: CapacityReport) -> str:
    """``pdctl capacity``'s text."""
    lines: list[str] = []
    f = rep.model
    if f is None:
        lines.append(f"model {rep.model_path}: unknown to pdctl (not a local checkpoint directory, not in its table)")
    else:
        w = "unknown" if f.weights_bytes is None else f"{f.weights_bytes / 1e9:.1f} GB"
        lines.append(f"model {rep.model_path}: {f.family}")
        lines.append(f"  {f.architecture}, {f.num_layers} layers, context up to {f.max_context}, weights {w} "
                     f"({f.origin})")
        dt = rep.roles[0].kv_cache_dtype if rep.roles else f.default_kv_dtype
        names = {"latent": "latent row", "index": "indexer K", "swa": "window row (every layer)",
                 "c4": "CSA rows + index (ratio 4)", "c128": "HCA rows (ratio 128)", "c1": "ratio-1 rows",
                 "c2": "ratio-2 rows", "full": "full layer", "sliding": "window layer"}
        try:
            per = kv_layer_bytes(f, dt)
            said = ", ".join(f"{names.get(k, k)} {v:g}" for k, v in per.items())
            lines.append(f"  KV bytes per token per layer ({dt}): {said}"
                         + (" (per GPU at TP1)" if f.attention in ("gqa", "swa-hybrid") else ""))
        except ModelFactsError as exc:
            lines.append(f"  KV bytes per token: {exc}")
        if f.attention == "dsv4":
            by = f.layers_by_ratio()
            lines.append(f"  layers: {f.num_layers}, each with a {f.sliding_window}-token window; CSA {by.get(4, 0)}, "
                         f"HCA {by.get(128, 0)}, window only {by.get(0, 0)}")
        pd = f.pd
        lines.append(f"  PD in SGLang 0.5.23: different prefill/decode TP: {pd.hetero_tp}; page size: "
                     f"{pd.page_size or 'any (the same on both)'}")
    lines.append("")
    lines.append(f"{'role':<10} {'GPUs':>4} {'GPU memory':>11} {'mem_frac':>8} {'weights/GPU':>11} {'KV/GPU':>9} "
                 f"{'KV pool':>9} {'x' + str(rep.context):>9} {'max run':>7}")
    for r in rep.roles:
        mem = "?" if r.gpu_memory_mib is None else f"{r.gpu_memory_mib / 1024:.1f} GiB"
        frac = "?" if r.mem_fraction is None else f"{r.mem_fraction:g}" + ("*" if "default" in r.mem_fraction_source
                                                                           else "")
        pool = "?" if r.kv_pool_tokens is None else human_tokens(r.kv_pool_tokens)
        at = r.requests_of(rep.context)
        run = "?" if r.max_running_requests is None else str(r.max_running_requests)
        lines.append(f"{r.role:<10} {r.gpus:>4} {mem:>11} {frac:>8} {_gib(r.weights_per_gpu_bytes):>11} "
                     f"{_gib(r.kv_bytes):>9} {pool:>9} {'?' if at is None else at:>9} {run:>7}")
    lines.append("")
    for r in rep.roles:
        if r.problem:
            lines.append(f"! {r.role}: {r.problem}")
            continue
        lines.append(f"  {r.role}: {r.kv_pool_tokens} tokens ({r.bytes_per_token:,.0f} B per token per GPU"
                     f"{f', {r.fixed_bytes / GIB:.2f} GiB fixed' if r.fixed_bytes else ''}); "
                     f"{r.concurrent_requests} request(s) of its context length {r.context_length} at once "
                     f"(SGLang runs at most {r.max_running_requests}); GPU memory from {r.gpu_memory_source}")
    if any("default" in r.mem_fraction_source for r in rep.roles):
        lines.append("  * mem_fraction unset: SGLang 0.5.23's default for this GPU and role")
    for n in rep.notes:
        lines.append(f"note: {n}")
    least = min((r.requests_of(rep.context) or 0 for r in rep.roles), default=0)
    if rep.fits_kv_pool is True and rep.context_allowed:
        lines.append(f"one request of {rep.context} tokens fits on every role ({least} at once on the smallest pool)")
    elif rep.fits_kv_pool is True:
        lines.append(f"one request of {rep.context} tokens fits every role's KV pool ({least} at once on the "
                     "smallest), but the servers as specified refuse it (see the note)")
    elif rep.fits_kv_pool is False:
        lines.append(f"one request of {rep.context} tokens does NOT fit")
        for s in rep.suggestions:
            lines.append(f"  - {s.role}: {s.change}: KV pool {human_tokens(s.kv_pool_tokens)} tokens"
                         + (" — fits" if s.fits else " — still does not fit"))
    else:
        lines.append("no estimate: see above")
    lines.append(f"(estimate: SGLang 0.5.23's sizing of pdctl's figures, {RUNTIME_OVERHEAD_MIB} MiB per GPU taken "
                 "for the CUDA context; /server_info max_total_num_tokens is the truth once a server runs)")
    return "\n".join(lines)


def capacity_of_spec(path: str, *, context: int | None = None, gpu_memory_gib: float | None = None,
                     contact_hosts: bool = True) -> CapacityReport:
    """``pdctl capacity SPEC``: the spec read (not rule-checked: a spec the model rules refuse for its memory is
    exactly one to size), then :func:`capacity_report`, asking the hosts (where *contact_hosts*) for what the spec
    does not declare: the GPU memory of roles whose host declares no known ``gpu_name``, and a local checkpoint's
    config.json. A host that cannot be reached is left out (its roles get no GPU memory). Raises SpecError."""
    from pdctl.statemachine.errors import HostError
    from pdctl.statemachine.hosts import host_for
    from pdctl.statemachine.spec import load_spec

    dep = load_spec(path)
    mib = gpu_memory_gib * 1024 if gpu_memory_gib else None
    hosts: dict[str, Host] = {}
    try:
        if contact_hosts:
            used = [r.host for _n, _k, r in dep.roles()]
            for key in dict.fromkeys(used):
                spec = dep.hosts.get(key)
                needs = (mib is None and declared_gpu_memory(spec) is None) or (
                    dep.model.path.startswith("/") and key == used[0])
                if spec is None or not needs:
                    continue
                try:
                    hosts[key] = host_for(spec, name=key)
                except (HostError, OSError):
                    continue
        return capacity_report(dep, context=context, gpu_memory_mib=mib, hosts=hosts)
    finally:
        for h in hosts.values():
            try:
                h.close()
            except (HostError, OSError):
                pass
