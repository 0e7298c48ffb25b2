#!/usr/bin/env bash
# The GPU run in one call (see bench/gpu/gpu_bench.py and the "GPU" section of bench/README.md):
#
#   bash bench/gpu/run.sh [--stages a,b|targets|user] [--budget-s S]   # on the device machine, wheels in .whl/
#   bash bench/gpu/run.sh --cpu-dry-run                   # here, on the CPU, at tiny sizes
#
# The device image has torch and transformers but not the decoders (decord, PyAV), pebble or NVML's bindings: wheels
# travel in .whl/ (bench/gpu/fetch_wheels.sh puts them there) and are installed beside the repository,
# which is used in place. Figures and the log go to $OUT (the device tool's folder that comes back).
set -uo pipefail
STARTED_AT=$(date +%s.%N)   # the budget counts from here: installing the wheels and starting Python count too
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
SITE="${TMPDIR:-/tmp}/tarsier-gpu-site"
# The carried wheels are built for the device image (Python 3.12): a dry run here uses this venv's own.
if [[ " $* " != *" --cpu-dry-run "* ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# The commit the results are of: git's, where the repository itself is here; else the one fetch_wheels.sh wrote
# beside the wheels before the call (the device gets a copy of the working tree without git).
if [[ "$(git rev-parse --show-toplevel 2>/dev/null)" == "$PWD" ]]; then
    COMMIT="$(git rev-parse HEAD)$(git diff --quiet HEAD -- || echo -dirty)"
elif [[ -f .whl/COMMIT ]]; then
    COMMIT="$(cat .whl/COMMIT) (from .whl/COMMIT)"
else
    COMMIT="unknown"
fi
# Nothing outside the device machine can be reached: never wait on the Hub.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" bench/gpu/gpu_bench.py --out "$OUT" --started-at "$STARTED_AT" --commit "$COMMIT" "$@" 2>&1 \
    | tee "$OUT/gpu-bench.log"
exit "${PIPESTATUS[0]}"
