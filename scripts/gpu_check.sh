#!/usr/bin/env bash
# GPU check of the native KV copy kernels, for a machine with an NVIDIA GPU, a
# CUDA build of torch and a CUDA toolkit (nvcc, g++, ninja). About 3-5 minutes;
# every step has a time limit so the whole run ends within 8 minutes.
#
#   scripts/gpu_check.sh [OUTDIR]          (default /tmp/lmi-cache-gpu-check)
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# 1. builds the extension with its CUDA kernel for this GPU's architecture only;
# 2. runs the kernel correctness tests on CUDA tensors (native and torch paths
#    against a reference, byte for byte; the paged copier with real streams),
#    failing if any CUDA test was skipped;
# 3. runs the bandwidth benchmark against a device-to-device copy.
# Logs land in OUTDIR (build.txt, tests.txt, bench.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUTDIR=${1:-/tmp/lmi-cache-gpu-check}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LMI_CACHE_KERNELS=native
export LMI_CACHE_KERNELS_DIR=${LMI_CACHE_KERNELS_DIR:-$OUTDIR/kernels-cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
step() { echo "== $* ($(date +%T))"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(nvidia-smi not available)"
"$PY" - <<'EOF'
import shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "torch cuda", torch.version.cuda)
print("nvcc", shutil.which("nvcc"), "c++", shutil.which("c++"), "ninja", shutil.which("ninja"))
if not (torch.version.cuda and torch.cuda.is_available()):
    sys.exit("gpu_check: needs a CUDA build of torch and a visible GPU")
print("device", torch.cuda.get_device_name(0), "capability %d.%d" % torch.cuda.get_device_capability(0))
EOF
# One architecture: this GPU's (compiling for all of them takes far longer).
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')
fi
export TORCH_CUDA_ARCH_LIST

step "build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, cache $LMI_CACHE_KERNELS_DIR)"
timeout 200 "$PY" - <<'EOF' 2>&1 | tee "$OUTDIR/build.txt"
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from lmi_cache.transfer import kernels, native_build
start = time.perf_counter()
try:
    ext = kernels.load_extension()
except native_build.NativeBuildError as err:
    sys.exit(f"gpu_check: build failed: {err}")
print(f"built/loaded in {time.perf_counter() - start:.1f} s; with_cuda={ext.with_cuda}; backend={kernels.backend()}")
sys.exit(0 if ext.with_cuda and kernels.backend() == "native" else "gpu_check: extension has no CUDA kernel")
EOF

step "correctness on CUDA tensors"
timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/lmi_cache/test_kernels.py tests/lmi_cache/test_transfer.py \
  tests/lmi_cache/test_indexer_groups.py 2>&1 | tee "$OUTDIR/tests.txt"
if grep -q "SKIPPED.*CUDA" "$OUTDIR/tests.txt"; then
  echo "gpu_check: CUDA tests were skipped" >&2
  exit 1
fi

step "bandwidth vs a device-to-device copy"
timeout 100 "$PY" benchmarks/bench_kernels.py --device cuda 2>&1 | tee "$OUTDIR/bench.txt"

step "done: logs in $OUTDIR"
