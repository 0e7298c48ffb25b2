#!/usr/bin/env bash
# Here, before a device call: the wheels the device image lacks, for its Python (3.12, x86-64), into .whl/
# (ignored by git through .git/info/exclude; name it in the call's `carry`). About 49 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux1_x86_64 -d .whl "decord==0.6.0" "av==19.0.2" "pebble==5.2.3"
ls -la .whl
