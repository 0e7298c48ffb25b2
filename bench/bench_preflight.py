"""The memory preflight's estimate against the peak a real run reaches.

    python bench/bench_preflight.py [--real DIR]    # DIR: from bench/make_real_size_checkpoint.py

Each case runs `tarsier caption` in a fresh process that reports its own VmHWM (peak resident
memory) at exit, and reads the estimate from the loading line. The test and demo checkpoints
caption sample_data and the shared demo clip; with --real, the real-size Tarsier2 checkpoint
captions one image in bfloat16 (4 new tokens), and the float32 default is run to see it refused
(exit 2) and how long the refusal takes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402

SAMPLE_DATA = REPO / "sample_data"
CLIP = REPO.parent / "shared" / "media" / "demo_test.mp4"
PROBE = """
import sys
from tarsier_batch.cli import app

if __name__ == "__main__":
    try:
        app(sys.argv[1:])
    finally:
        print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")), file=sys.stderr)
"""


def run_case(workdir: Path, model: str, inputs: list[str], extra: list[str]) -> dict:
    probe = workdir / "probe.py"
    probe.write_text(PROBE)
    out = workdir / f"out-{time.monotonic_ns()}.parquet"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(probe), "caption", *inputs, "--model", model, "-o", str(out), *extra],
                          capture_output=True, text=True, cwd=workdir)
    seconds = round(time.perf_counter() - start, 1)
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", done.stderr).group(1)) * 1024
    if done.returncode != 0:
        return {"exit": done.returncode, "seconds": seconds,
                "message": next(line for line in done.stderr.splitlines() if line.startswith("Error"))}
    estimated = float(re.search(r"~([\d.]+) GB at the peak \(estimated\)", done.stderr).group(1)) * 1e9
    return {"exit": 0, "seconds": seconds, "estimated_gb": round(estimated / 1e9, 3),
            "measured_peak_gb": round(peak / 1e9, 3), "estimate_over_peak": round(estimated / peak, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, help="a real-size checkpoint (bench/make_real_size_checkpoint.py)")
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        inputs = [str(SAMPLE_DATA), str(CLIP)]
        for name, family in (("tiny-random", "tarsier"), ("tiny-random-tarsier2", "tarsier2")):
            checkpoint = make_tiny_model(workdir / name, "tiny", seed=0, family=family)
            results[name] = run_case(workdir, str(checkpoint), inputs, ["--max-new-tokens", "16"])
        results["demo"] = run_case(workdir, "demo", inputs, ["--max-new-tokens", "16"])
        if args.real:
            image = [str(SAMPLE_DATA / "still.png")]
            results["real-size bfloat16"] = run_case(workdir, str(args.real), image,
                                                     ["--dtype", "bfloat16", "--max-new-tokens", "4"])
            results["real-size float32 (default)"] = run_case(workdir, str(args.real), image, [])
    print(json.dumps({**measured_on(), **results}, indent=1))


if __name__ == "__main__":
    main()
