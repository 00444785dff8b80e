"""pdctl.sim: a GPU-free stand-in for SGLang 0.5.23's ``python -m sglang.launch_server``.

Run it with SGLang's own flags: ``python -m pdctl.sim --model-path M --disaggregation-mode prefill ...``;
a unit or process differs from production only in its executable.  Shaped after SGLang 0.5.23 (each
module's docstring names the SGLang files it follows); it imports nothing else of pdctl.

Environment knobs (all optional):

* ``PDCTL_SIM_LOAD_SECONDS`` (default 1.0): "weight loading" time; the HTTP port is not open yet
  (SGLang starts uvicorn only after the scheduler has loaded), the prefill bootstrap server is up and
  answers ``/route`` with 503 until the ranks register at the end of loading.
* ``PDCTL_SIM_WARMUP_SECONDS`` (default 0.5): HTTP port open, ``/health`` 503 until the warm-up
  request has run.
* ``PDCTL_SIM_MODEL_FAMILY`` (``deepseek-v32``, ``deepseek-v4``, ``deepseek-v31``): the native
  reasoning / tool-call markup the "model" emits.  Unset, it follows the model like SGLang does:
  ``MODEL_PATH/config.json``'s ``model_type`` if that file exists, else the name (``*V4*`` ->
  deepseek-v4, ``*V3.2*`` -> deepseek-v32, ``*V3.1*``/``*V3*``/``*R1*`` -> deepseek-v31), else
  deepseek-v32.
* ``PDCTL_SIM_ENSURE_RETRY_INTERVAL`` (default 1.0): seconds between decode's 15 attempts to fetch the
  prefill ``/route`` (SGLang's ``_ensure_retry_interval``; a sim knob so tests can fail fast).
* SGLang's own: ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (decode, 300 s),
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (prefill, 300 s), ``SGLANG_DEFAULT_THINKING``,
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``.

Sim-only surface: ``GET /sim/kv?room=R&wait=S`` on the prefill bootstrap port stands in for the
NIXL/Mooncake data plane (decode pulls room R's KV through it).  Everything else is SGLang's.
"""
