#!/usr/bin/env bash
# One device-machine call for pdctl.kernels (issue 6; DeepSeek-V4: issue 43): GPU tests, the kernels_built step, then
# the benchmark.
# Usage (device tool, repo root, .whl carried): bash benchmarks/kernels_device_run.sh [tests|build|bench ...] -- [bench args]
# DeepSeek-V4 stages: v4tests (tests/kernels/test_gpu_v4.py, FlashMLA required), v4build (kernels_built with
# --model deepseek-v4 at the seed's shapes), v4bench (benchmarks/bench_kernels_v4.py; its args after --).
# (stage py: the args after -- are a python command line, e.g. benchmarks/decode_pdl.py --cases ...)
# Logs and results go to $OUT. Each stage is bounded by `timeout` so one hang cannot eat the whole call.
set -u
export PYTHONUNBUFFERED=1 PDCTL_KERNELS_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stages=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do stages+=("$1"); shift; done; [ "${1:-}" = "--" ] && shift
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export TRITON_CACHE_DIR=/tmp/triton-cache
# pdctl as an importable package (the build's compiling processes are spawned and import pdctl.kernels by name)
tree=/tmp/tree/pdctl; mkdir -p $tree
for f in pdctl/*.py; do ln -sf "$PWD/$f" $tree/; done
for s in console statemachine kernels units sim; do ln -sfn "$PWD/$s" $tree/$s; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
for s in "${stages[@]}"; do
  case "$s" in
    tests) timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    build) PYTHONPATH=$PWD/.devpkg:${PYTHONPATH:-} timeout 300 python3 -c "
import sys; sys.argv=['pdctl.kernels','build','--cache-dir','$OUT/kcache','--heads','16']
sys.path.insert(0,'tests/kernels'); import conftest  # maps kernels/ -> pdctl.kernels on a bare checkout
from pdctl.kernels.__main__ import main; rc=main(); print('build rc', rc); sys.exit(rc)" 2>&1 | tee "$OUT/build.log" | tail -5
       cp "$OUT/kcache/pdctl-kernels-manifest.json" "$OUT/manifest.json" 2>/dev/null; rm -rf "$OUT/kcache" ;;
    buildtime)  # the kernels_built step's wall time with and without compiling processes, each on a fresh cache
       for w in ${BUILD_WORKERS:-16 0}; do
         rm -rf /tmp/kc$w
         env -C /tmp -u TRITON_CACHE_DIR PYTHONPATH=/tmp/tree:${PYTHONPATH:-} PDCTL_KERNELS_COMPILE_WORKERS=$w timeout ${BUILD_TIMEOUT:-280} \
           python3 -m pdctl.kernels build --cache-dir /tmp/kc$w ${BUILD_ARGS:---heads 32 --kv-formats fp8 --max-context 131072} \
           > "$OUT/build_w$w.log" 2>&1; echo "workers $w: rc $?"
         python3 -c "
import json; m = json.load(open('/tmp/kc$w/pdctl-kernels-manifest.json'))
print('  ok', m['ok'], 'elapsed_s', m['elapsed_s'], 'compile', m.get('compile'), 'kernels in cache',
      len(__import__('os').listdir('/tmp/kc$w/triton')))
for e in m['decode']: print('  ', e['heads'], e['kv'], e['rows'], e.get('config'), round(e.get('us', 0), 2), e['ok'])
print('   indexer', m['indexer']['config'], round(m['indexer']['us_B64_L8K'], 2), m['indexer']['ok'])" 2>&1 | tee -a "$OUT/buildtime.txt"
         cp /tmp/kc$w/pdctl-kernels-manifest.json "$OUT/manifest_w$w.json" 2>/dev/null
       done ;;
    ncu) timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --section SpeedOfLight --section Occupancy \
           --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
           -k regex:'decode|topk|indexer|combine' python3 benchmarks/ncu_targets.py ${NCU_ARGS:-} > "$OUT/ncu.txt" 2>&1
         echo "ncu rc $?"; grep -E "^  [a-z_]+.*\(|Duration|Stall|Registers Per|Achieved Occupancy|Issue Slots Busy|Memory Throughput" \
           "$OUT/ncu.txt" | head -80 ;;
    stages) timeout 200 python3 benchmarks/indexer_stages.py 2>&1 | tee "$OUT/stages.log" | tail -30 ;;
    py) PYTHONPATH=/tmp/tree:${PYTHONPATH:-} timeout ${PY_TIMEOUT:-400} python3 "$@" 2>&1 | tee -a "$OUT/py.log" | tail -80 ;;
    v4smoke)  # one V4 decode and one top-512 indexer call against the references; the call stops here if they fail
       timeout 180 python3 -c "
import sys; sys.path.insert(0, 'tests/kernels'); import conftest, torch
from pdctl.kernels._build import make_v4_decode_case, _decode_tolerance_check, V4_SM_SCALE, make_indexer_case, check_topk
from pdctl.kernels._reference import reference_sparse_decode_v4, reference_indexer_logits
from pdctl.kernels._sparse_mla import sparse_decode_v4, LAST_LAUNCH
from pdctl.kernels._indexer import lightning_indexer
c = make_v4_decode_case(16, 8, topk=512, slots=1 << 15)
o, l = sparse_decode_v4(sm_scale=V4_SM_SCALE, **c); ro, rl = reference_sparse_decode_v4(sm_scale=V4_SM_SCALE, compute_dtype=torch.float32, **c)
e = _decode_tolerance_check(o, l, ro, rl); print('v4 decode', e, LAST_LAUNCH)
q8, w, cache, bt, sl = make_indexer_case([100, 600, 5000], max_context=262144)
out = lightning_indexer(q8, w, cache, bt, sl, 512); t = check_topk(out, reference_indexer_logits(q8, w, cache, bt, sl, compute_dtype=torch.float32), bt, sl, 512)
print('v4 indexer', t); sys.exit(0 if e['ok'] and t['ok'] else 1)" 2>&1 | tee "$OUT/v4smoke.log" | tail -8
       [ "${PIPESTATUS[0]}" = 0 ] || { echo "v4smoke failed: stopping"; exit 3; } ;;
    v4tests) PDCTL_KERNELS_FLASHMLA=1 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gpu_v4.py -m gpu -q \
           -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/v4tests.log" | tail -25 ;;
    v4build) PYTHONPATH=/tmp/tree:${PYTHONPATH:-} timeout ${BUILD_TIMEOUT:-240} env -C /tmp python3 -m pdctl.kernels build \
           --cache-dir /tmp/kc4 --model deepseek-v4 ${V4_BUILD_ARGS:---heads 16 --max-context 1048576} > "$OUT/v4build.log" 2>&1
       echo "v4 build rc $?"; tail -3 "$OUT/v4build.log"; cp /tmp/kc4/pdctl-kernels-manifest.json "$OUT/manifest_v4.json" 2>/dev/null
       python3 -c "
import json; m = json.load(open('/tmp/kc4/pdctl-kernels-manifest.json'))
print('ok', m['ok'], 'model', m.get('model'), 'elapsed_s', m['elapsed_s'], m.get('compile'))
for e in m['decode']: print('  ', e['heads'], e['kv'], e['rows'], e.get('config'), round(e.get('us', 0), 2), e['ok'])
print('   indexer', {k: v for k, v in m['indexer'].items() if k != 'topk'})" 2>&1 | tee "$OUT/v4build.txt" ;;
    v4bench) PYTHONPATH=/tmp/tree:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_kernels_v4.py "$@" 2>&1 | tail -45 ;;
    bench) PYTHONPATH=/tmp/tree:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_kernels.py "$@" 2>&1 | tail -60 ;;
  esac
done
