"""SGLang plugin: route DSA decode attention and the paged lightning indexer to ``pdctl.kernels`` (DeepSeek-V3.2's
``dsa`` backend, or DeepSeek-V4's ``dsv4`` backend: the manifest's ``model`` chooses).

Registered as entry point ``pdctl_kernels = "pdctl.kernels.sglang_plugin:register"`` in the group
``sglang.srt.plugins`` (SGLang's plugin framework, ``sglang/srt/plugins/__init__.py``, PR #21388: every process
calls ``load_plugins()``, which runs each allowed entry point and then ``HookRegistry.apply_hooks()``).

Environment a unit must carry to enable it:

* ``SGLANG_PLUGINS=pdctl_kernels`` — SGLang's comma-separated allowlist of general plugins (without it SGLang
  would load *every* installed plugin; with it, only the listed ones);
* ``PDCTL_KERNELS_DIR=<dir>`` — the cache directory given to ``python -m pdctl.kernels build --cache-dir <dir>``
  on this host; the plugin refuses to activate without a verified manifest from the same GPU model there, and
  installs the launch configs tuned in it;
* ``TRITON_CACHE_DIR=<dir>/triton`` — reuse the binaries compiled by the build step (optional, saves start time);
* optional ``PDCTL_KERNELS_ROUTE=decode,indexer`` (default: both) and ``PDCTL_KERNELS_REQUIRED=1`` (refusal
  becomes fatal: ``SystemExit`` escapes SGLang's ``except Exception`` around plugins, so the server does not start
  on a path the deployment did not ask for).

Known SGLang versions and the functions hooked (all ``HookType.AROUND``; read from the sglang 0.5.23 PyPI wheel,
``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``, built 2026-10-30):

=====================================================================================  =========================
target (sglang 0.5.23)                                                                 routed to
=====================================================================================  =========================
``sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode``   marks "in decode" only
``…DeepseekSparseAttnBackend._forward_flashmla_sparse`` (decode calls only)             :func:`sparse_mla_decode`
``…DeepseekSparseAttnBackend._forward_flashmla_kv`` (decode calls only)                 :func:`sparse_mla_decode`
``sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged`` (decode only)  :func:`lightning_indexer`
=====================================================================================  =========================

Server flags: only the decode impls above are hooked, so the unit must select one of them —
``--dsa-decode-backend flashmla_kv`` with ``--kv-cache-dtype fp8_e4m3`` (656-byte FP8 rows) or
``--dsa-decode-backend flashmla_sparse`` (bf16 rows). SGLang's default decode impl on an H200 with bf16 KV is
``fa3``, which is *not* hooked. Both impls take the FP8 656-byte rows or bf16 576-element rows. The indexer hook
applies whatever the decode impl, wherever SGLang calls ``_get_topk_paged``: its short-context CUDA-graph variants
(``DSA_DENSE``, dsa_indexer.py) never call it, and run SGLang's own indexer. Not done: SGLang still computes
FlashMLA's scheduling metadata for ``flashmla_kv`` in ``init_forward_metadata*`` (``_compute_flashmla_metadata``);
on a GPU where SGLang's FlashMLA import/metadata fails (e.g. sm_120) that needs one more hook. The plugin has been
exercised by unit tests with stand-in objects only, not inside a running SGLang server.

What each hook keeps from SGLang: ``forward_decode`` still stores the new KV and builds ``page_table_1``
(physical slots, −1 padded) before calling the impl; we replace only the attention kernel, passing
``metadata.dsa_cache_seqlens_int32`` (valid index count per row) as ``topk_length``. The impls are routed only
inside ``forward_decode``: ``forward_extend`` calls ``_forward_flashmla_kv`` too (prefill chunks whenever the prefill
backend is ``flashmla_kv``, SGLang's default for FP8 KV on Hopper; MTP target-verify and draft-extend), and those
shapes are not the ones ``kernels_built`` verified. Extend/prefill calls,
attention sinks, target-verify/draft-extend indexer calls, models with ``index_init_tokens`` /
``index_local_tokens``, and non-64 index pages go to the original functions. The indexer hook emits physical slots
exactly when SGLang's own top-k would (``SGLANG_DSA_FUSE_TOPK`` on and not ``force_unfused_topk``), logical
positions otherwise, and pads rows past the batch with −1 as the original does.

CUDA graphs: a manifest may choose ``DecodeConfig.merge`` (the split programs merge their own partials after a
grid barrier), whose barrier counters are zeroed at the first such call on the device and must not first be
reached inside a capture. SGLang 0.5.23 runs each batch size twice eagerly before capturing it
(``sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py``, called from
``model_executor/runner/decode_cuda_graph_runner.py``), so the decode hook's first call is always eager; a first
call inside a capture is refused with a ``RuntimeError``.

Seeing it work: SGLang loads plugins before it configures logging, so the plugin says what it does at WARNING (the
level Python's last-resort handler prints to stderr, i.e. the unit's journal): once when it registers (routes, PID,
SGLang version, GPU), once per hooked function at its first routed call, and once per function and reason when a
decode call goes to SGLang's own kernel (a shape or layout it does not take).

DeepSeek-V4 (``--attention-backend dsv4``): a manifest built with ``--model deepseek-v4`` selects these hooks
instead (the manifest's ``model`` picks the set; both sets are checked against the same SGLang version):

==========================================================================================  ======================
target (sglang 0.5.23)                                                                      routed to
==========================================================================================  ======================
``sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend._forward_attention``  marks "in decode" and
                                                                                            the layer's real heads
``sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache`` (decode only)     :func:`sparse_decode_v4`
``sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120`` (decode only)  :func:`sparse_decode_v4`
``sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer``        :func:`lightning_indexer`
``sglang.srt.layers.attention.dsv4.indexer.C4Indexer.compute_q``                             hands q8 and weights over
==========================================================================================  ======================

V4 decode: ``DeepseekV4AttnBackend.__init__`` binds ``functools.partial(flash_mla_interface.flash_mla_with_kvcache,
use_legacy=...)`` after plugins are loaded, so the partial holds the hooked function; ``_forward_attention`` calls it
for decode (and for extend chunks that do not take the sparse-prefill path, and MTP verify, which are left to
FlashMLA). A routed call takes FlashMLA's arguments as they are: q ``[T, 1, h_pad, 512]`` (h padded to 64 with
garbage rows, ``deepseek_v4.py`` ``_kernel_num_heads`` / ``q_padded``), the SWA cache ``[pages, 256, 1, 584]``
with ``indices`` and ``topk_length``, the c4 or c128 cache as ``extra_k_cache`` with ``extra_indices_in_kvcache``
and ``extra_topk_length``, ``attn_sink [h_pad]`` and ``softmax_scale``; we compute only the layer's
``tp_q_head_num`` real heads and return FlashMLA's ``(out [T, 1, h_pad, 512], lse [T, h_pad, 1])`` (the padded heads'
rows are left unwritten: the model slices them off, ``o[:, tp_slice, :]``). Calls it does not take (another cache
format such as V4.1's 528/288 bytes, s_q > 1, descales, non-bf16 q, indices or lengths not int32) go to FlashMLA,
logged once per reason.

V4 decode on sm_120 (RTX PRO 6000 Blackwell, GeForce RTX 50xx), where FlashMLA's CUDA kernels do not exist:
``_forward_attention`` (``srt/layers/attention/deepseek_v4_backend.py``, branch ``if get_platform().is_sm120``)
imports ``flash_mla_with_kvcache_sm120`` from ``kernels/ops/attention/flash_mla_sm120.py`` at each call (so it
gets the hooked function) and calls it with keywords only — ``q, k_cache, head_dim_v, softmax_scale, indices,
topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length`` — FlashMLA's names with
FlashMLA's meanings: the same 584-byte caches ([pages, 256, 1, 584] SWA, c4/c128 extra; the module's
``_gather_and_dequant`` reads 576 data bytes a row, then the page's 8-byte scale rows, as ``_reference`` does),
indices ``[T, 1, K]`` with −1 padding and per-row lengths, the sink applied as ``1 / (1 + exp(sink − lse))``
(its PyTorch path ``_sm120_sparse_decode_fwd``), ``softmax_scale`` None meaning ``q.shape[-1] ** -0.5``. Its q is
padded to 64 heads unless FlashInfer decodes the real head count (``deepseek_v4.py`` ``_kernel_num_heads``), and
above ``SM120_DECODE_MAX_TOKENS`` (64) rows the caller slices q and the sink to the real heads; either way the hook
computes the layer's real heads and returns ``(out [T, 1, h_q, 512], lse [T, h_q, 1])`` (SGLang keeps ``[0]``; its
FlashInfer path returns no lse). A call with other keywords, positional arguments or anything the FlashMLA hook
refuses goes to SGLang's sm_120 kernel, logged once per reason. The parameter check can only see ``(**kwargs)``
there; the keywords are checked at each call. Not hooked on sm_120: nothing else is needed, SGLang makes no
FlashMLA scheduling metadata there (``_create_flashmla_metadata`` returns None).

V4 indexer: ``forward_c4_indexer`` (decode batches only; FP8 index keys: sglang 0.5.23 on SM90 runs the FP8 C4
indexer, its FP4 one needs SM100/SM120/gfx95, ``arg_groups/serving_hook.py``) runs SGLang's own preparation — the
index query and weights (``C4Indexer.compute_q``, whose result the compute_q hook hands over) and the compressor,
which writes this step's compressed index key — with the backend's ``debug_use_external_c4_sparse_indices`` set, so
that it returns before DeepGEMM's ``fp8_paged_mqa_logits`` and the top-k transform; then
:func:`lightning_indexer` scores exactly each request's ``compressed_seq_lens[b]`` rows of the c4 index-K cache
(``[pages, 64·132]``, the same 64-row page as V3.2's) through ``indexer_metadata.page_table`` and writes the exact
top-``index_topk`` (512 Flash, 1024 Pro) physical c4 slots into ``core_metadata.c4_sparse_page_indices``, which the
attention reads as its extra indices. Falls back (logged) with the FP4 indexer, HiSparse, the indexer-top-k
capturer, raw indices wanted (prefill), a compressed page other than 64 rows, or a flag someone else set.

Any other SGLang version (``importlib.metadata.version("sglang")``) is refused: the hooked functions' names
and argument lists change between releases (``nsa_*`` → ``dsa_*`` rename in 0.5.15–0.5.20, see
``shared/reference/sglang-pd.md`` §1.4), so the plugin also checks each target's parameter names before
registering anything.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
from typing import Any

__all__ = ["KNOWN_VERSIONS", "PluginRefusedError", "register"]

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"

_V4_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_FLASH_MLA = "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache"
_FLASH_MLA_SM120 = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
_V4_INDEXER = "sglang.srt.layers.attention.dsv4.indexer"

KNOWN_VERSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.5.23": {
        f"{_V4_BACKEND}._forward_attention": ("self", "q", "k", "v", "layer", "forward_batch", "compress_ratio",
                                              "save_kv_cache", "attn_sink", "cos_sin_cache", "_"),
        _FLASH_MLA: ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                     "num_splits", "softmax_scale", "causal", "descale_q", "descale_k", "is_fp8_kvcache", "indices",
                     "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length",
                     "kv_format", "use_legacy"),
        _FLASH_MLA_SM120: ("kwargs",),
        f"{_V4_INDEXER}.C4IndexerBackendMixin.forward_c4_indexer": (
            "self", "x", "q_lora", "c4_indexer", "forward_batch", "alt_streams", "enable_multi_stream",
            "q_lora_ready", "skip_compressor", "q_lora_quant"),
        f"{_V4_INDEXER}.C4Indexer.compute_q": ("self", "q_lora", "positions", "weight", "q_lora_quant"),
        f"{_BACKEND}.forward_decode": ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache", "q_rope",
                                       "k_rope", "topk_indices", "cos_sin_cache", "is_neox", "llama_4_scaling",
                                       "attn_sink"),
        f"{_BACKEND}._forward_flashmla_sparse": ("self", "q_all", "kv_cache", "v_head_dim", "page_table_1",
                                                 "sm_scale", "topk_length", "attn_sink"),
        f"{_BACKEND}._forward_flashmla_kv": ("self", "q_all", "kv_cache", "v_head_dim", "sm_scale", "layer",
                                             "metadata", "page_table_1"),
        f"{_INDEXER}._get_topk_paged": ("self", "forward_batch", "layer_id", "q_fp8", "weights", "metadata"),
    },
}
"""SGLang version -> hooked target -> its expected parameter names (checked before hooking)."""

_IN_DECODE: contextvars.ContextVar[bool] = contextvars.ContextVar("pdctl_kernels_in_decode", default=False)


class PluginRefusedError(RuntimeError):
    """The plugin will not route anything to pdctl.kernels in this process; the message says why."""


def _refuse(msg: str) -> None:
    if os.environ.get("PDCTL_KERNELS_REQUIRED") == "1":
        raise SystemExit(f"pdctl_kernels: refusing to activate: {msg} (PDCTL_KERNELS_REQUIRED=1)")
    raise PluginRefusedError(msg)


def _sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _resolve(target: str) -> Any:
    import pkgutil

    obj_path, attr = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), attr)


def _bind(original, args, kwargs) -> dict[str, Any]:
    ba = inspect.signature(original).bind(*args, **kwargs)
    ba.apply_defaults()
    return ba.arguments


_SAID: set[tuple[str, str]] = set()


def _say_once(key: tuple[str, str], msg: str, *args: Any) -> None:
    # WARNING: SGLang loads plugins before it configures logging (0.5.23 launch_server.py, scheduler.py), when only
    # Python's last-resort handler prints, and it prints WARNING and above: an INFO line would never reach the log
    if key not in _SAID:
        _SAID.add(key)
        logger.warning(msg, *args)


def _routed(target: str, shape: str) -> None:
    """Say, once per hooked function and process, that a call of it ran on pdctl's kernels."""
    _say_once((target, ""), "pdctl_kernels: first %s call routed to pdctl.kernels (%s)", target, shape)


def _fell_back(target: str, why: str) -> None:
    """Say, once per hooked function, reason and process, that a decode call went to SGLang's own kernel."""
    _say_once((target, why), "pdctl_kernels: a decode call of %s went to SGLang's own kernel: %s", target, why)


# --- hooks -----------------------------------------------------------------------------------------------------

def _forward_decode_hook(original, *args, **kwargs):
    token = _IN_DECODE.set(True)
    try:
        return original(*args, **kwargs)
    finally:
        _IN_DECODE.reset(token)


def _topk_length(candidate, rows: int):
    import torch

    if isinstance(candidate, torch.Tensor) and candidate.shape == (rows,) and candidate.dtype == torch.int32:
        return candidate
    return None


def _latent_cache(kv_cache):
    """SGLang's latent KV buffer as ``uint8 [slots, 656]`` (FP8) or ``bf16 [slots, 576]``; None if neither."""
    import torch

    last = kv_cache.shape[-1]
    if kv_cache.element_size() == 1 and last == 656:
        return kv_cache.reshape(-1, 656).view(torch.uint8)
    if kv_cache.dtype == torch.bfloat16 and last == 576:
        return kv_cache.reshape(-1, 576)
    return None


def _flashmla_sparse_hook(original, *args, **kwargs):
    if not _IN_DECODE.get():
        return original(*args, **kwargs)
    a = _bind(original, args, kwargs)
    kv = _latent_cache(a["kv_cache"])
    if a["attn_sink"] is not None or a["v_head_dim"] != 512 or kv is None:
        _fell_back("_forward_flashmla_sparse", "an attention sink" if a["attn_sink"] is not None else
                   f"v_head_dim {a['v_head_dim']}, kv cache {getattr(a['kv_cache'], 'dtype', '?')} "
                   f"{tuple(getattr(a['kv_cache'], 'shape', ()))}")
        return original(*args, **kwargs)
    from pdctl.kernels._sparse_mla import sparse_mla_decode

    q = a["q_all"]
    _routed("_forward_flashmla_sparse", f"{q.shape[0]} rows, {q.shape[1]} heads")
    o, _ = sparse_mla_decode(q, kv, a["page_table_1"], a["sm_scale"], _topk_length(a["topk_length"], q.shape[0]))
    return o


def _flashmla_kv_hook(original, *args, **kwargs):
    if not _IN_DECODE.get():
        # forward_extend calls this impl too: prefill chunks when the prefill backend is flashmla_kv (the FP8 default
        # on Hopper, 0.5.23 arg_groups/overrides.py), and MTP target-verify / draft-extend; those shapes are not
        # the ones the kernels_built step verified
        return original(*args, **kwargs)
    a = _bind(original, args, kwargs)
    kv = _latent_cache(a["kv_cache"])
    layer = a["layer"]
    if a["v_head_dim"] != 512 or kv is None or getattr(layer, "head_dim", 576) != 576:
        _fell_back("_forward_flashmla_kv", f"v_head_dim {a['v_head_dim']}, head_dim {getattr(layer, 'head_dim', '?')}, "
                   f"kv cache {getattr(a['kv_cache'], 'dtype', '?')} {tuple(getattr(a['kv_cache'], 'shape', ()))}")
        return original(*args, **kwargs)
    from pdctl.kernels._sparse_mla import sparse_mla_decode

    q = a["q_all"].reshape(-1, layer.tp_q_head_num, 576)
    tl_ = _topk_length(getattr(a["metadata"], "dsa_cache_seqlens_int32", None), q.shape[0])
    _routed("_forward_flashmla_kv", f"{q.shape[0]} rows, {q.shape[1]} heads, {'FP8' if kv.element_size() == 1 else 'bf16'} KV")
    o, _ = sparse_mla_decode(q, kv, a["page_table_1"], a["sm_scale"], tl_)
    return o.unsqueeze(1)  # flash_mla_with_kvcache's [T, s_q = 1, h, 512]


def _get_topk_paged_hook(original, *args, **kwargs):
    import torch

    a = _bind(original, args, kwargs)
    self, fb, metadata = a["self"], a["forward_batch"], a["metadata"]
    q8, weights = a["q_fp8"], a["weights"]
    if not fb.forward_mode.is_decode():
        return original(*args, **kwargs)
    if (
        getattr(self, "num_init_tokens", 0)
        or getattr(self, "num_local_tokens", 0)
        or q8.dtype != torch.float8_e4m3fn
        or tuple(q8.shape[1:]) != (64, 128)
    ):
        per_row = ", ".join(map(str, q8.shape[1:]))  # (not the token count: one line per reason, not per batch size)
        _fell_back("_get_topk_paged", f"q {q8.dtype} [T, {per_row}], init/local index tokens "
                   f"{getattr(self, 'num_init_tokens', 0)}/{getattr(self, 'num_local_tokens', 0)}")
        return original(*args, **kwargs)
    mod = inspect.getmodule(original)
    pool = mod.get_token_to_kv_pool()
    if getattr(pool, "index_page_size", None) != 64:
        _fell_back("_get_topk_paged", f"index page size {getattr(pool, 'index_page_size', None)}")
        return original(*args, **kwargs)
    cache = self._get_index_k_read_buffer(pool, a["layer_id"])
    if cache.element_size() != 1 or cache.numel() % 8448:
        _fell_back("_get_topk_paged", f"index-K cache {cache.dtype} of {cache.numel()} elements (not 132 B per token)")
        return original(*args, **kwargs)
    from pdctl.kernels._indexer import lightning_indexer

    cache = cache.reshape(-1, 8448).view(torch.uint8)
    seq_lens = metadata.get_seqlens_int32()
    block_table = metadata.get_page_table_64()
    b, t = seq_lens.shape[0], q8.shape[0]
    _routed("_get_topk_paged", f"{b} rows")
    envs = mod.envs
    physical = bool(envs.SGLANG_DSA_FUSE_TOPK.get()) and not getattr(metadata, "force_unfused_topk", False)
    out = torch.full((t, self.index_topk), -1, dtype=torch.int32, device=q8.device)
    lightning_indexer(
        q8[:b].contiguous(), weights[:b].reshape(b, 64).float().contiguous(), cache, block_table, seq_lens,
        self.index_topk, physical=physical, out=out[:b],
    )
    return out


# --- DeepSeek-V4 hooks (dsv4 backend) ----------------------------------------------------------------------

_V4_DECODE: contextvars.ContextVar[int] = contextvars.ContextVar("pdctl_kernels_v4_decode_heads", default=0)
"""Inside ``DeepseekV4AttnBackend._forward_attention`` of a decode batch: the layer's real (unpadded) head count."""
_V4_CAPTURE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pdctl_kernels_v4_capture", default=None)
"""Inside a routed ``forward_c4_indexer``: where ``C4Indexer.compute_q``'s result is handed over."""


def _v4_forward_attention_hook(original, *args, **kwargs):
    a = _bind(original, args, kwargs)
    fb, layer = a["forward_batch"], a["layer"]
    heads = getattr(layer, "tp_q_head_num", 0) if fb.forward_mode.is_decode() else 0
    token = _V4_DECODE.set(int(heads or 0))
    try:
        return original(*args, **kwargs)
    finally:
        _V4_DECODE.reset(token)


def _v4_cache(cache) -> bool:
    return cache is not None and cache.dim() == 4 and cache.shape[-1] == 584 and cache.element_size() == 1


def _v4_decode_refusal(a: dict[str, Any], heads: int) -> str | None:
    """Why a V4 decode call (FlashMLA's argument names, *a*) is not one :func:`sparse_decode_v4` computes as SGLang's
    kernel would; None when it is. Anything else goes to SGLang's own kernel: never a silently different result."""
    import torch

    q, extra = a["q"], a["extra_k_cache"]
    if a["indices"] is None or not _v4_cache(a["k_cache"]) or (extra is not None and not _v4_cache(extra)):
        return (f"KV cache {tuple(getattr(a['k_cache'], 'shape', ()))} / extra "
                f"{tuple(getattr(extra, 'shape', ())) if extra is not None else None} (not the 584-byte V4 format)")
    if q.dim() != 4 or q.shape[1] != 1 or q.shape[-1] != 512 or q.dtype != torch.bfloat16 or q.shape[2] < heads:
        return f"q {q.dtype} {tuple(q.shape[1:])} (need bf16 [T, 1, h >= {heads}, 512])"
    if a["head_dim_v"] != 512 or a["descale_q"] is not None or a["kv_format"] not in (None, "V4") or a["causal"]:
        return f"head_dim_v {a['head_dim_v']}, kv_format {a['kv_format']}, descales or causal"
    t = q.shape[0]
    for name, idx, length in (("indices", a["indices"], a["topk_length"]),
                              ("extra indices", a["extra_indices_in_kvcache"], a["extra_topk_length"])):
        if name != "indices" and extra is None:
            break
        if idx is None or idx.dtype != torch.int32 or (t and idx.numel() % t):
            return f"{name} {getattr(idx, 'dtype', None)} {tuple(getattr(idx, 'shape', ()))} (need int32 [T, 1, K])"
        if length is not None and (length.dtype != torch.int32 or length.numel() != t):
            return f"{name}' lengths {length.dtype} {tuple(length.shape)} (need int32 [T])"
    sink = a["attn_sink"]
    if sink is not None and (sink.dim() != 1 or sink.shape[0] < heads or not sink.is_floating_point()):
        return f"attn_sink {sink.dtype} {tuple(sink.shape)} (need float [h >= {heads}])"
    return None


def _v4_decode(target: str, a: dict[str, Any], heads: int):
    """Compute a routed V4 decode call (FlashMLA's argument names, *a*) with :func:`sparse_decode_v4`; return what
    FlashMLA returns: ``(out [T, 1, h_pad, 512], lse [T, h_pad, 1])``, only the first *heads* heads written."""
    import torch

    from pdctl.kernels._sparse_mla import sparse_decode_v4

    q, extra = a["q"], a["extra_k_cache"]
    t, _, h_pad, _ = q.shape
    _routed(target, f"{t} rows, {heads} heads (of {h_pad}), "
            f"{'SWA + extra' if extra is not None else 'SWA only'} V4 cache")
    out = torch.empty(t, 1, h_pad, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h_pad, 1, dtype=torch.float32, device=q.device)
    sink = a["attn_sink"]
    ei = a["extra_indices_in_kvcache"]
    scale = a["softmax_scale"]
    length = a["topk_length"]
    e_length = a["extra_topk_length"] if extra is not None else None
    sparse_decode_v4(
        q[:, 0, :heads], a["k_cache"], a["indices"].reshape(t, -1), scale if scale is not None else q.shape[-1] ** -0.5,
        length.reshape(t) if length is not None else None, sink.float().contiguous() if sink is not None else None,
        extra, ei.reshape(t, -1) if extra is not None else None,
        e_length.reshape(t) if e_length is not None else None,
        out=out[:, 0, :heads], lse=lse[:, :heads, 0],
    )
    return out, lse


def _v4_flash_mla_hook(original, *args, **kwargs):
    heads = _V4_DECODE.get()
    if not heads:
        return original(*args, **kwargs)
    a = _bind(original, args, kwargs)
    why = _v4_decode_refusal(a, heads)
    if why is not None:
        _fell_back("flash_mla_with_kvcache", why)
        return original(*args, **kwargs)
    return _v4_decode("flash_mla_with_kvcache", a, heads)


_SM120_ARGS = ("q", "k_cache", "head_dim_v", "softmax_scale", "indices", "topk_length", "attn_sink", "extra_k_cache",
               "extra_indices_in_kvcache", "extra_topk_length")
"""The keywords sglang 0.5.23's one V4 call of ``flash_mla_with_kvcache_sm120`` passes (``deepseek_v4_backend.py``
``DeepseekV4AttnBackend._forward_attention``, ``if get_platform().is_sm120``), FlashMLA's names for FlashMLA's
meanings; the function reads exactly these (``kernels/ops/attention/flash_mla_sm120.py``)."""


def _v4_flash_mla_sm120_hook(original, *args, **kwargs):
    # sglang 0.5.23 flash_mla_sm120.flash_mla_with_kvcache_sm120(**kwargs): keyword arguments only, named as
    # flash_mla_with_kvcache's; softmax_scale None means q.shape[-1] ** -0.5 there too. What FlashMLA takes and this
    # function has no keyword for (block_table, causal, descales, kv_format) is absent: FlashMLA's defaults.
    heads = _V4_DECODE.get()
    if not heads:
        return original(*args, **kwargs)
    unknown = sorted(set(kwargs) - set(_SM120_ARGS))
    missing = [k for k in ("q", "k_cache", "indices", "head_dim_v") if k not in kwargs]
    if args or unknown or missing:
        _fell_back("flash_mla_with_kvcache_sm120", f"a call unlike sglang 0.5.23's ({len(args)} positional, "
                   f"unknown {unknown}, missing {missing})")
        return original(*args, **kwargs)
    a = {**dict.fromkeys(_SM120_ARGS), "causal": False, "descale_q": None, "kv_format": None, **kwargs}
    why = _v4_decode_refusal(a, heads)
    if why is not None:
        _fell_back("flash_mla_with_kvcache_sm120", why)
        return original(*args, **kwargs)
    return _v4_decode("flash_mla_with_kvcache_sm120", a, heads)


def _v4_compute_q_hook(original, *args, **kwargs):
    result = original(*args, **kwargs)
    holder = _V4_CAPTURE.get()
    if holder is not None:
        holder["q"], holder["weights"] = result
    return result


def _v4_c4_indexer_hook(original, *args, **kwargs):
    a = _bind(original, args, kwargs)
    self, fb, c4 = a["self"], a["forward_batch"], a["c4_indexer"]
    if not fb.forward_mode.is_decode():
        return original(*args, **kwargs)
    mod = inspect.getmodule(original)
    metadata = self.forward_metadata
    im = getattr(metadata, "indexer_metadata", None)
    core = getattr(metadata, "core_metadata", None)
    why = None
    if getattr(c4, "use_fp4_indexer", False):
        why = "the FP4 indexer"
    elif getattr(self, "hisparse_coordinator", None) is not None:
        why = "HiSparse"
    elif mod.get_global_indexer_capturer() is not None:
        why = "the indexer top-k capturer"
    elif im is None or core is None or getattr(im, "compressed_page_size", None) != 64:
        why = f"compressed page size {getattr(im, 'compressed_page_size', None)}"
    elif getattr(core, "c4_sparse_raw_indices", None) is not None:
        why = "raw top-k indices wanted"
    elif getattr(self, "debug_use_external_c4_sparse_indices", False):
        why = "external c4 sparse indices (debug_use_external_c4_sparse_indices)"
    if why is not None:
        _fell_back("forward_c4_indexer", why)
        return original(*args, **kwargs)
    import torch

    holder: dict = {}
    token = _V4_CAPTURE.set(holder)
    self.debug_use_external_c4_sparse_indices = True  # SGLang's own seam: return after the preparation
    try:
        original(*args, **kwargs)
    finally:
        self.debug_use_external_c4_sparse_indices = False
        _V4_CAPTURE.reset(token)
    if "q" not in holder:
        raise RuntimeError("pdctl_kernels: forward_c4_indexer did not compute the index query (C4Indexer.compute_q "
                           "was not reached); the sglang 0.5.23 code path changed")
    q8 = holder["q"]
    weights = holder["weights"]
    rows = q8.shape[0]
    if weights.dim() == 3:
        weights = weights.squeeze(2)

    def match(x, value):  # as forward_c4_indexer's match_num_queries
        if x.shape[0] >= rows:
            return x[:rows]
        return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])

    seq = match(im.compressed_seq_lens.reshape(-1), 1).to(torch.int32)
    table = match(im.page_table, 0).to(torch.int32)
    out = core.c4_sparse_page_indices
    topk = int(c4.index_topk)
    cache = self.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id=c4.layer_id)
    from pdctl.kernels._indexer import lightning_indexer

    _routed("forward_c4_indexer", f"{rows} rows, top-{topk}")
    lightning_indexer(q8.reshape(rows, 64, 128).contiguous(), weights.reshape(rows, 64).float().contiguous(),
                      cache.reshape(-1, 8448).view(torch.uint8), table.contiguous(), seq.contiguous(), topk,
                      physical=True, out=out[:rows, :topk])
    if out.shape[1] > topk:
        out[:rows, topk:].fill_(-1)
    return None


_ROUTES = {
    "deepseek-v3.2": {
        "decode": {f"{_BACKEND}.forward_decode": _forward_decode_hook,
                   f"{_BACKEND}._forward_flashmla_sparse": _flashmla_sparse_hook,
                   f"{_BACKEND}._forward_flashmla_kv": _flashmla_kv_hook},
        "indexer": {f"{_INDEXER}._get_topk_paged": _get_topk_paged_hook},
    },
    "deepseek-v4": {
        "decode": {f"{_V4_BACKEND}._forward_attention": _v4_forward_attention_hook,
                   _FLASH_MLA: _v4_flash_mla_hook,
                   _FLASH_MLA_SM120: _v4_flash_mla_sm120_hook},
        "indexer": {f"{_V4_INDEXER}.C4IndexerBackendMixin.forward_c4_indexer": _v4_c4_indexer_hook,
                    f"{_V4_INDEXER}.C4Indexer.compute_q": _v4_compute_q_hook},
    },
}
"""Model (a manifest's ``model``) -> route -> hooked target -> hook."""


def planned_hooks(version: str, routes: tuple[str, ...] = ("decode", "indexer"),
                  model: str = "deepseek-v3.2") -> dict[str, Any]:
    """Target -> hook function for a known SGLang version and model (pure; raises PluginRefusedError for unknown
    versions or models)."""
    targets = KNOWN_VERSIONS.get(version)
    if targets is None:
        raise PluginRefusedError(f"sglang {version} is not a version this plugin knows ({sorted(KNOWN_VERSIONS)})")
    if model not in _ROUTES:
        raise PluginRefusedError(f"no hooks for model {model!r} ({sorted(_ROUTES)})")
    plan = {}
    for route in routes:
        for target, fn in _ROUTES[model][route].items():
            assert target in targets, target
            plan[target] = fn
    return plan


def register() -> None:
    """Entry point run by SGLang's ``load_plugins()``: check everything, then register the AROUND hooks.

    Raises:
        PluginRefusedError: unknown SGLang version, a target's parameters differ from the known ones, no CUDA
            GPU, or no verified manifest in ``PDCTL_KERNELS_DIR`` for this GPU (``SystemExit`` instead with
            ``PDCTL_KERNELS_REQUIRED=1``). Nothing is hooked in that case.
    """
    version = _sglang_version()
    if version not in KNOWN_VERSIONS:
        _refuse(f"sglang {version or '(not installed)'} is not a version this plugin knows ({sorted(KNOWN_VERSIONS)})")
    routes = tuple(r.strip() for r in os.environ.get("PDCTL_KERNELS_ROUTE", "decode,indexer").split(",") if r.strip())
    if any(r not in ("decode", "indexer") for r in routes):
        _refuse(f"PDCTL_KERNELS_ROUTE={os.environ.get('PDCTL_KERNELS_ROUTE')!r}: routes are ['decode', 'indexer']")
    cache_dir = os.environ.get("PDCTL_KERNELS_DIR")
    if not cache_dir:
        _refuse("PDCTL_KERNELS_DIR is not set (run `python -m pdctl.kernels build --cache-dir DIR` on this host)")
    from pdctl.kernels._build import KernelsBuildError, load_manifest

    try:
        import torch

        if not torch.cuda.is_available():
            _refuse("no CUDA GPU visible")
        manifest = load_manifest(cache_dir)
    except KernelsBuildError as e:
        _refuse(str(e))
    model = manifest.get("model", "deepseek-v3.2")
    plan = planned_hooks(version, routes, model)
    for target in plan:
        try:
            params = tuple(inspect.signature(_resolve(target)).parameters)
        except Exception as e:  # noqa: BLE001 - any failure to resolve is a refusal
            _refuse(f"cannot resolve {target}: {e}")
        if params != KNOWN_VERSIONS[version][target]:
            _refuse(f"{target} takes {params}, expected {KNOWN_VERSIONS[version][target]}")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn in plan.items():
        HookRegistry.register(target, fn, HookType.AROUND)
    _say_once(("register", ""), "pdctl_kernels: routing %s of %s to pdctl.kernels in PID %d (sglang %s, manifest "
              "built %s s on %s)", ",".join(routes), model, os.getpid(), version, manifest.get("elapsed_s"),
              manifest["gpu"]["name"])
