"""SGLang plugin: route DSA decode attention and the paged lightning indexer to ``pdctl.kernels``.

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
decode call goes to SGLang's own kernel (a shape or layout it does not take). It does nothing for DeepSeek-V4:
SGLang serves V4 with its own ``dsv4`` attention backend (``arg_groups/model_overrides/deepseek_v4.py``), which
calls none of the functions above, and pdctl's rules refuse ``kernels.enabled`` for a V4 checkpoint.

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

KNOWN_VERSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.5.23": {
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


_ROUTES = {
    "decode": {"forward_decode": _forward_decode_hook, "_forward_flashmla_sparse": _flashmla_sparse_hook,
               "_forward_flashmla_kv": _flashmla_kv_hook},
    "indexer": {"_get_topk_paged": _get_topk_paged_hook},
}


def planned_hooks(version: str, routes: tuple[str, ...] = ("decode", "indexer")) -> dict[str, Any]:
    """Target -> hook function for a known SGLang version (pure; raises PluginRefusedError for unknown ones)."""
    targets = KNOWN_VERSIONS.get(version)
    if targets is None:
        raise PluginRefusedError(f"sglang {version} is not a version this plugin knows ({sorted(KNOWN_VERSIONS)})")
    plan = {}
    for route in routes:
        for leaf, fn in _ROUTES[route].items():
            target = next(t for t in targets if t.endswith("." + leaf))
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
    if any(r not in _ROUTES for r in routes):
        _refuse(f"PDCTL_KERNELS_ROUTE={os.environ.get('PDCTL_KERNELS_ROUTE')!r}: routes are {sorted(_ROUTES)}")
    plan = planned_hooks(version, routes)
    for target in plan:
        try:
            params = tuple(inspect.signature(_resolve(target)).parameters)
        except Exception as e:  # noqa: BLE001 - any failure to resolve is a refusal
            _refuse(f"cannot resolve {target}: {e}")
        if params != KNOWN_VERSIONS[version][target]:
            _refuse(f"{target} takes {params}, expected {KNOWN_VERSIONS[version][target]}")
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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn in plan.items():
        HookRegistry.register(target, fn, HookType.AROUND)
    _say_once(("register", ""), "pdctl_kernels: routing %s to pdctl.kernels in PID %d (sglang %s, manifest built %s s "
              "on %s)", ",".join(routes), os.getpid(), version, manifest.get("elapsed_s"), manifest["gpu"]["name"])
