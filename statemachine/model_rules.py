"""Model-aware rules: what the spec's model cannot do in PD, refused or warned before any host is touched, and the
deprecated names SGLang 0.5.23 still accepts, warned with the name to use.

``model_findings(dep)`` is called once, at the end of :func:`pdctl.statemachine.rules.validate`; like every rule it
is pure: it reads the spec and the built-in facts (:func:`pdctl.statemachine.models.builtin_facts`, by the model
path's name; a local checkpoint's config.json is read only by ``pdctl capacity``), and the GPU memory a host
declares (``gpu_name``), never a host.

Rules, each with its SGLang 0.5.23 source:

* prefill and decode with different TP sizes: an error for a non-MLA sliding-window hybrid (the first KV transfer
  raises, ``disaggregation/nixl/conn.py``), a warning for plain GQA ("Performance is NOT guaranteed",
  ``disaggregation/common/conn.py``);
* ``model.context_length`` above the model's (``get_context_length``): an error, SGLang stops at start
  (``configs/model_config.py _derive_context_length``) unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is set in
  the roles' environment (then a warning);
* with the GPU memory declared: weights that leave no memory for the KV cache at the role's ``mem_fraction`` (an
  error: "Loaded weights leave no GPU memory for the KV cache", ``mem_cache/kv_cache_configurator.py``), and a KV
  pool smaller than ``context_length`` (a warning: "KV pool holds N tokens, fewer than --context-length … long
  requests will be refused or truncated", ``managers/tp_worker.py``; in PD an aborted prefill made decode answer
  garbage, sgl-project/sglang#30233);
* deprecated aliases: ``parsers.tool_call_parser`` ``qwen25`` / ``glm45`` (``arg_groups/serving_hook.py``),
  ``model.attention_backend`` ``nsa`` / ``compressed`` / ``tokenspeed_mla`` (``arg_groups/choices.py``), deprecated
  launch flags in ``extra_args`` (``server_args.py``), and environment variables with the legacy ``SGL_`` prefix or
  a deprecated name (``environ.py _handle_deprecated_envs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdctl.statemachine.models import (
    DEPRECATED_ATTENTION_BACKENDS,
    DEPRECATED_FLAGS,
    DEPRECATED_TOOL_CALL_PARSERS,
    builtin_facts,
)
from pdctl.statemachine.rules import Finding

if TYPE_CHECKING:  # pragma: no cover
    from pdctl.statemachine.spec import Deployment

__all__ = ["DEPRECATED_ENV", "model_findings"]

DEPRECATED_ENV: dict[str, str] = {
    "SGLANG_SCHEDULER_DECREASE_PREFILL_IDLE": "the launch flag --enable-prefill-delayer",
    "SGLANG_PREFILL_DELAYER_MAX_DELAY_PASSES": "the launch flag --prefill-delayer-max-delay-passes",
    "SGLANG_PREFILL_DELAYER_TOKEN_USAGE_LOW_WATERMARK": "the launch flag --prefill-delayer-token-usage-low-watermark",
}
"""Environment variables SGLang 0.5.23 deprecates in favour of a launch flag (``environ.py _DEPRECATED_ENVS``)."""

_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def _field(dep: Deployment, role) -> str:  # noqa: ANN001
    for kind in ("prefill", "decode", "server"):
        for i, r in enumerate(getattr(dep, kind)):
            if r is role:
                return f"{kind}[{i}]"
    return "?"


def model_findings(dep: Deployment) -> list[Finding]:
    """Every model-aware finding for *dep* (errors and warnings, in no particular order: ``validate`` sorts)."""
    out: list[Finding] = []

    def err(field: str, message: str, fix: str) -> None:
        out.append(Finding("error", field, message, fix))

    def warn(field: str, message: str, fix: str) -> None:
        out.append(Finding("warning", field, message, fix))

    roles = dep.roles()
    # --- deprecated names ----------------------------------------------------------------------------------------
    said: set[str] = set()
    for where, parsers in [("parsers", dep.parsers)] + [(f"{_field(dep, r)}.parsers", r.parsers)
                                                         for _n, _k, r in roles if r.parsers is not None]:
        name = parsers.tool_call_parser
        if name in DEPRECATED_TOOL_CALL_PARSERS and where not in said:
            said.add(where)
            new = DEPRECATED_TOOL_CALL_PARSERS[name]
            warn(f"{where}.tool_call_parser", f"{name!r} is a deprecated alias: SGLang {dep.sglang_version} rewrites it "
                 f"to {new!r} with a warning", f'write tool_call_parser = "{new}"')
    backend = dep.model.attention_backend
    if backend in DEPRECATED_ATTENTION_BACKENDS:
        new = DEPRECATED_ATTENTION_BACKENDS[backend]
        warn("model.attention_backend", f"{backend!r} is a deprecated alias of {new!r} in SGLang's --attention-backend",
             f'write attention_backend = "{new}"')
    for _n, _k, role in roles:
        f = _field(dep, role)
        for arg in role.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in DEPRECATED_FLAGS and flag != "--enable-dp-attention":  # (that one is refused: pdctl sets it)
                warn(f"{f}.extra_args", f"{flag} is deprecated in SGLang {dep.sglang_version} (it still parses it, with "
                     "a warning)", f"use {DEPRECATED_FLAGS[flag]} instead")
    tables = [("engine.env", dep.engine.env)] + [(f"{_field(dep, r)}.env", r.env) for _n, _k, r in roles]
    for where, env in tables:
        for key in env:
            if key.startswith("SGL_"):
                new = "SGLANG_" + key[4:]
                warn(f"{where}.{key}", f"the SGL_ prefix is deprecated: SGLang copies {key} to {new} with a warning",
                     f"name it {new}")
            elif key in DEPRECATED_ENV:
                warn(f"{where}.{key}", f"{key} is deprecated in SGLang {dep.sglang_version}",
                     f"use {DEPRECATED_ENV[key]} instead (in extra_args)")

    facts = builtin_facts(dep.model.path)
    if facts is None:
        return out
    # --- different TP on prefill and decode ------------------------------------------------------------------------
    if dep.is_pd:
        sizes = {(k, r.tp // max(r.attn_dp, 1)) for _n, k, r in roles if k in ("prefill", "decode")}
        pre = {t for k, t in sizes if k == "prefill"}
        dec = {t for k, t in sizes if k == "decode"}
        if len(pre | dec) > 1:
            where = "decode[0].tp"
            said_tp = f"prefill attention TP {sorted(pre)}, decode {sorted(dec)}"
            pd = facts.pd
            if pd.hetero_tp == "no":
                err(where, f"{said_tp}: SGLang {dep.sglang_version} cannot transfer {facts.name}'s KV cache between "
                    "different TP sizes ('PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA "
                    "hybrid models yet': the first request fails, clients hang)",
                    "give prefill and decode the same tp (and attn_dp)")
            elif pd.hetero_tp == "warn":
                warn(where, f"{said_tp}: SGLang transfers {facts.name}'s GQA KV cache between different TP sizes head "
                     "slice by head slice ('Performance is NOT guaranteed when using different TP sizes for non-MLA "
                     "models')", "give prefill and decode the same tp, unless measured")
    # --- context length --------------------------------------------------------------------------------------------
    ctx = dep.model.context_length
    if ctx is not None and ctx > facts.max_context:
        allowed = any(_LONGER_CONTEXT_ENV in env for _w, env in tables)
        (warn if allowed else err)(
            "model.context_length",
            f"{ctx} is longer than {facts.name}'s context ({facts.max_context}, from its config)"
            + (f": {_LONGER_CONTEXT_ENV} lets SGLang start with it ('may lead to incorrect model outputs or CUDA "
               "errors')" if allowed else f": SGLang stops the server at start (ValueError) unless "
                                          f"{_LONGER_CONTEXT_ENV}=1"),
            f"set context_length to at most {facts.max_context}, or leave it out")
    # --- memory, where the GPUs are declared ----------------------------------------------------------------------
    from pdctl.statemachine.capacity import RoleInput, declared_gpu_memory, estimate

    for name, kind, role in roles:
        rt = RoleInput.of_spec(dep, name, kind, role)
        gpu = declared_gpu_memory(dep.hosts.get(rt.host))
        if gpu is None:
            continue
        cap = estimate(facts, rt, gpu)
        f = _field(dep, role)
        if cap.kv_bytes is not None and cap.kv_bytes <= 0:
            err(f"{f}.gpus", f"{rt.name}: {facts.name}'s weights take {cap.weights_per_gpu_bytes / 2**30:.1f} GiB of each "
                f"of its {cap.tp} GPUs ({cap.gpu_memory_mib / 1024:.1f} GiB, {dep.hosts[rt.host].gpu_name}), more than "
                f"mem_fraction {cap.mem_fraction:g} leaves them: SGLang stops at start ('Loaded weights leave no GPU "
                "memory for the KV cache')",
                f"give {rt.name} more GPUs (a larger tp)" + (
                    f", or raise mem_fraction above {cap.min_mem_fraction:g}" if cap.min_mem_fraction
                    and cap.min_mem_fraction < 0.95 else ""))
        elif cap.kv_pool_tokens is not None and ctx is not None and cap.kv_pool_tokens < ctx:
            warn("model.context_length", f"{rt.name}'s KV pool is estimated at {cap.kv_pool_tokens} tokens, fewer than "
                 f"context_length {ctx}: SGLang refuses or truncates longer requests ('One full-length request cannot "
                 "fit'), and an aborted prefill left decode answering garbage (sgl-project/sglang#30233)",
                 "lower context_length, give the role more GPUs, or use fp8 KV (`pdctl capacity SPEC` shows the "
                 "options)")
    return out
