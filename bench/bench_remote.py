"""Decoding from an object store and from WebDataset shards against the same files on local disk.

    python bench/bench_remote.py [--items 24] [--rounds 3] [--big-gb 2]

A local S3 server (moto, in a subprocess on loopback), the GCS emulator and Azurite (the tests' servers)
each hold the same clips as a local folder, as objects and as 3 tar shards; the same 3 shards sit on
local disk too, and a local web server (tests/http_server.py: Range requests, ETags, index pages;
threads of this process) serves both.
Each side decodes all items through the real decoding pool (`workers.DecodePool`, the default worker count, the tiny
Tarsier2 checkpoint's processor at its real frame geometry, 16 frames): decode-bound, so that
reading is what is measured. The sides run interleaved, round after round (this machine is shared
and noisy), and the medians are compared: items/s of each side over local files (target >= 0.9x).

Then memory: a tar of `--big-gb` GB (20 members of ~100 MB each, real video) in the S3 server is
decoded member by member while this process's RSS is sampled every 50 ms: it should stay flat
(bounded by the pool's read-ahead), not grow with the shard. moto reads a whole object for every
GET, so its own cost is not what S3's would be; its CPU time is reported. Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
CLIP = REPO.parent / "shared" / "media" / "demo_test.mp4"


def start_s3() -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for line in server.stderr:
        match = re.search(rb"Running on (http://127\.0\.0\.1:\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()   # drain its log
            return server, match.group(1).decode()
    raise RuntimeError("moto did not start")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_tar(path: Path, files: list[Path]) -> None:
    with tarfile.open(path, "w") as tar:
        for number, file in enumerate(files):
            tar.add(file, arcname=f"sample{number:05d}{file.suffix}")


def decode_rate(job, items: list) -> float:
    from tarsier_batch.workers.pool import DecodePool
    from tarsier_batch.workers.sizing import default_workers

    with DecodePool(job, default_workers()) as pool:
        pool.submit(0, items[0]).result()   # workers started and warm: what is timed is the stream of items
        start = time.perf_counter()
        futures = [pool.submit(index, item) for index, item in enumerate(items)]
        decoded = [future.result() for future in futures]
        elapsed = time.perf_counter() - start
    failed = [one.error for one in decoded if one.error]
    assert not failed, failed[:3]
    return len(items) / elapsed


def noisy_clip(path: Path, megabytes: int) -> None:
    """A real H.264 clip of about `megabytes` MB (noise frames at a lossless quality: big, still decodable)."""
    import av
    import numpy as np

    generator = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25, options={"qp": "0", "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 640, 360, "yuv420p"
        for _ in range(megabytes * 10**6 // (640 * 360 * 3 // 2)):   # noise does not compress: ~a frame's bytes each
            frame = av.VideoFrame.from_ndarray(generator.integers(0, 255, (360, 640, 3), dtype=np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def memory_while_streaming(job, url: str) -> dict[str, float]:
    from tarsier_batch.inputs.sources import discover
    from tarsier_batch.workers.pool import DecodePool

    items = discover([url]).items
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append(int(line.split()[1]) / 1024)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    with DecodePool(job, 1) as pool:
        sampler.start()
        start = time.perf_counter()
        decoded = [pool.submit(index, item).result() for index, item in enumerate(items)]
        elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    assert not [one.error for one in decoded if one.error]
    half = len(samples) // 2
    return {"members": len(items), "seconds": round(elapsed, 1), "rss_mb_start": round(samples[0], 0),
            "rss_mb_max_first_half": round(max(samples[:half]), 0),
            "rss_mb_max_second_half": round(max(samples[half:]), 0),
            "rss_mb_median": round(statistics.median(samples), 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-gb", type=float, default=2.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      XDG_CACHE_HOME=str(work / "cache"))
    server, endpoint = start_s3()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        import boto3

        import azure_server
        import gcs_server
        from http_server import web_server
        from tarsier_batch.families.loading import load_processor
        from tarsier_batch.families.tiny import make_tiny_model
        from tarsier_batch.inputs.sources import discover
        from tarsier_batch.workers.pool import DecodeJob

        model = make_tiny_model(work / "model", "tiny", seed=0, family="tarsier2")
        job = DecodeJob(load_processor(model), 16, None)
        folder = work / "clips"
        folder.mkdir()
        files = [folder / f"{number:03d}.mp4" for number in range(args.items)]
        for file in files:
            shutil.copy(CLIP, file)
        shards = work / "shards"
        shards.mkdir()
        third = len(files) // 3
        for number in range(3):
            write_tar(shards / f"{number:05d}.tar", files[number * third:(number + 1) * third])
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        for file in files:
            client.upload_file(str(file), "bench", f"clips/{file.name}")
        for shard in sorted(shards.iterdir()):
            client.upload_file(str(shard), "bench", f"shards/{shard.name}")
        web = contextlib.ExitStack()
        site = web.enter_context(web_server(work)).url
        # The GCS emulator and Azurite, their buckets holding the same objects and shards.
        gcs = web.enter_context(gcs_server.serve())
        azure = web.enter_context(azure_server.serve())
        os.environ.update(STORAGE_EMULATOR_HOST=gcs.endpoint, AZURE_STORAGE_CONNECTION_STRING=azure.connection_string)
        for store in (gcs, azure):
            fs = store.filesystem()
            fs.mkdir("bench")
            fs.put([str(file) for file in files], "bench/clips/")
            fs.put([str(shard) for shard in sorted(shards.iterdir())], "bench/shards/")
        sides = {"local files": [str(folder)], "S3 objects": ["s3://bench/clips/"], "web files": [f"{site}/clips/"],
                 "GCS objects": ["gs://bench/clips/"], "Azure objects": ["az://bench/clips/"],
                 "local tar shards": [str(shards / "{00000..00002}.tar")],
                 "S3 tar shards": ["s3://bench/shards/{00000..00002}.tar"],
                 "web tar shards": [f"{site}/shards/{{00000..00002}}.tar"],
                 "GCS tar shards": ["gs://bench/shards/{00000..00002}.tar"],
                 "Azure tar shards": ["az://bench/shards/{00000..00002}.tar"]}
        rates: dict[str, list[float]] = {name: [] for name in sides}
        listing: dict[str, float] = {}
        moto_cpu = cpu_seconds(server.pid)
        for _ in range(args.rounds):
            for name, inputs in sides.items():
                start = time.perf_counter()
                items = discover(inputs).items
                listing.setdefault(name, round(time.perf_counter() - start, 3))   # the first (cold) listing
                assert len(items) == 3 * third, (name, len(items))
                rates[name].append(decode_rate(job, items))
        moto_cpu = cpu_seconds(server.pid) - moto_cpu
        web.close()
        medians = {name: statistics.median(values) for name, values in rates.items()}
        report = {"items": 3 * third, "rounds": args.rounds, "clip": CLIP.name, "frames": 16,
                  "items_per_s": {name: [round(value, 3) for value in values] for name, values in rates.items()},
                  "median_over_local": {name: round(value / medians["local files"], 3)
                                        for name, value in medians.items()},
                  "first_listing_s": listing, "moto_cpu_s": round(moto_cpu, 1)}
        if args.big_gb > 0:
            big = work / "big.mp4"
            noisy_clip(big, 100)
            members = max(1, round(args.big_gb * 1e9 / big.stat().st_size))
            big_tar = work / "big.tar"
            write_tar(big_tar, [big] * members)
            client.upload_file(str(big_tar), "bench", "big/big.tar")
            big_tar.unlink()
            report["big_shard"] = {"gb": round(members * big.stat().st_size / 1e9, 2),
                                   **memory_while_streaming(job, "s3://bench/big/big.tar")}
        print(json.dumps({**measured_on(), **report}, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
