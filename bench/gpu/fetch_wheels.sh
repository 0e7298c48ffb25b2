#!/usr/bin/env bash
# Here, before a device call: the wheels the device image lacks, for its Python (3.12, x86-64), into .whl/
# (ignored by git through .git/info/exclude; name it in the call's `carry`), about 50 MB; and .whl/COMMIT, the
# commit the working tree is of (the device gets a copy of the tree without git: run.sh records this in the
# results). Run it again before each call: wheels already there are not fetched again, the commit is written anew.
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")" .whl
grep -qxF "/.whl/" "$EXCLUDE" 2>/dev/null || echo "/.whl/" >> "$EXCLUDE"
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- || echo -dirty)" > .whl/COMMIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux1_x86_64 -d .whl "decord==0.6.0" "av==19.0.2" "pebble==5.2.3" \
    "nvidia-ml-py==13.615.71"
ls -la .whl
cat .whl/COMMIT
