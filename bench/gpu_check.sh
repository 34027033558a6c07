#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent machine, where device time is short
# (minutes) and the machine starts bare: run from the repo root there, no install needed
# (the image's python3 has torch and transformers; the CPU kernels are not built).
#
#   bash bench/gpu_check.sh                 # writes $OUT (the device tool's folder) or OUT_DIR
#   DEVICE=cpu QUICK=1 bash bench/gpu_check.sh   # a dry run here: every step, on the CPU
#
# Steps, each under its own time limit, each run even if an earlier one failed:
#   env           the GPU, driver, torch and transformers versions
#   gpu_tests     every test marked `gpu` (CUDA against the CPU reference: model fp32 and
#                 bf16, Dual-Flow, the paged engine, the transformers baseline, phase_limits)
#   phase_limits  bench/phase_limits.py on the device: bf16, measured and datasheet peaks,
#                 transformers on the same GPU, two rounds
# Exit status 0 only if every step passed.
set -uo pipefail
device=${DEVICE:-cuda}
out=${OUT:-${OUT_DIR:-/tmp/splitphase-gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPLITPHASE_KERNELS=0  # the native kernels are CPU code: compiling them costs device time
py=${PYTHON:-python3}
failed=()

step() {  # step NAME SECONDS COMMAND...: its output to the screen and to $out/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || failed+=("$name")
}

step env 60 "$py" -c '
import platform, subprocess, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
else:
    print("no CUDA device")'

step gpu_tests 200 "$py" -m pytest -m gpu -o addopts= -q -p no:cacheprovider -rs \
  tests/model/test_transformer.py tests/model/test_dual_flow.py \
  tests/engine/test_engine_golden.py tests/engine/test_kv_cache_dtype.py \
  tests/perf/test_hf_baseline.py \
  tests/bench/test_phase_limits.py

limits=(--device "$device" --skip-llamacpp --rounds 2 --out "$out/phase_limits_$device.json")
[ -n "${QUICK:-}" ] && limits+=(--quick)
step phase_limits 240 "$py" bench/phase_limits.py "${limits[@]}"

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all steps passed; logs and JSON in $out"
