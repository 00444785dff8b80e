#!/usr/bin/env bash
# One device-machine call for the GPU acceptance runs that are not the kernels' own benchmark:
# the kernels_built step of examples/dsv32.toml, then text captures of the console's GPU/NUMA panel.
# Usage (device tool, repo root, .whl carried): bash benchmarks/device_acceptance.sh [kernels|smi]
# .whl holds, besides sgl-flash-mla (not installed here), what pdctl imports that the machine's image lacks (KINDS.md's
# list): pydantic, pydantic-core, annotated-types, typing-inspection; for the panel captures also textual, platformdirs,
# mdit-py-plugins, linkify-it-py, uc-micro-py, markdown-it-py (the versions of the local .venv, cp312 manylinux wheels).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v flash_mla)
[ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
tree=/tmp/tree/pdctl; mkdir -p $tree
for f in pdctl/*.py; do ln -sf "$PWD/$f" $tree/; done
for s in console statemachine kernels units sim; do ln -sfn "$PWD/$s" $tree/$s; done
export PYTHONPATH=/tmp/tree:/tmp/site
nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -5
if [ "${1:-}" = smi ]; then  # the GPU panel read both ways: NVML here, and nvidia-smi through a Host (the SSH path)
  timeout 60 python3 benchmarks/gpu_panel_capture.py --smi 2>&1 | tee "$OUT/gpu_panel_smi.txt"; exit "${PIPESTATUS[0]}"
fi
timeout 300 python3 benchmarks/device_kernels_step.py 2>&1 | tee "$OUT/kernels_step.log" | tail -40
[ "${1:-}" = kernels ] && exit 0
timeout 60 python3 benchmarks/gpu_panel_capture.py 2>&1 | tee "$OUT/gpu_panel_plain.txt"
timeout 90 python3 benchmarks/gpu_panel_capture.py --app --size 120x40 --self-as decode 2>&1 | tee "$OUT/gpu_panel_app.txt"
