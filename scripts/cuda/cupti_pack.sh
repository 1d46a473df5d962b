#!/usr/bin/env bash
# Builds scripts/cuda/cupti_trace.c against CUPTI 13.0 (the nvidia-cuda-cupti wheel from
# PyPI: headers and libcupti.so.13; 13.0 for the lent machines' driver 580, CUDA 13.0) and
# puts the library with libcupti beside it into .cuda/xc, which `device.sh ct` carries.
#   bash scripts/cuda/cupti_pack.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
C=$ROOT/.cuda
mkdir -p "$C/dl/cupti" "$C/xc"
whl=$(ls "$C"/dl/cupti/nvidia_cuda_cupti-13.0.85-*.whl 2>/dev/null || true)
if [ -z "$whl" ]; then
  python3 -m pip download -q --no-deps -d "$C/dl/cupti" nvidia-cuda-cupti==13.0.85
  whl=$(ls "$C"/dl/cupti/nvidia_cuda_cupti-13.0.85-*.whl)
fi
[ -d "$C/cupti/nvidia/cu13/include" ] || python3 -m zipfile -e "$whl" "$C/cupti"
# cuda.h (cupti_activity.h includes it) comes with the runtime headers build.sh fetches
H=$C/cudart/nvidia/cu13/include
[ -f "$H/cuda.h" ] || { echo "no $H/cuda.h: run scripts/cuda/build.sh first"; exit 1; }
L=$C/cupti/nvidia/cu13/lib
gcc -O2 -fPIC -shared -Wall -Werror -I"$C/cupti/nvidia/cu13/include" -I"$H" \
  "$ROOT/scripts/cuda/cupti_trace.c" -o "$C/xc/libcupti_trace.so" \
  -L"$L" -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN' -lpthread
cp "$L/libcupti.so.13" "$C/xc/"
ls -la "$C/xc"
