"""What runtime.load's payload check costs (``runtime.integrity``), measured here.

    python benchmarks/payload_hash.py                   # 2 files x 768 MiB, threads 1 and 2
    python benchmarks/payload_hash.py --files 4 --mib 256 --threads 1,2,4 --json

A synthetic payload (seeded random bytes, so nothing compresses or dedups) is
written as ``--files`` files of ``--mib`` MiB, each cut into DS4-expert-sized
spans (a DS4 Flash expert projection at 2.7 bpw is about 2048 x 4096 x 2.7 / 8
bytes: 2.8 MB). Then, from the page cache (warmed by one untimed read):

- anchor: reading every file once without hashing (1 thread);
- ``hash_file`` of every file (the check's path), on 1..N threads; a file is
  one sha256 stream, so threads help only across files;
- per-span hashing (the path that names a damaged tensor), on 1..N threads.

It prints GB/s of wall time, the ratio to the read anchor, GB per CPU-second
(what one free core does: a shared host's other processes steal wall time),
and the seconds projected from the one-thread CPU rate for
a DS4 Flash artifact of ``--artifact-gb`` (default 100 and 150 GB) in files
of at most ``--split-gb`` (default 50 GB, the Hugging Face file limit
``convert --split-max-size 50G`` targets): wall = max(largest file at one
thread's rate, total / (threads x rate)). Cold-cache reads are the disk's
rate, not the hash's: the check then costs the disk read the load does
anyway (the memmaps read the same pages).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4quant.runtime.integrity import _hash_span, hash_file  # noqa: E402

SPAN = 2048 * 4096 * 27 // 80  # one DS4 Flash expert projection at 2.7 bits per weight


def _read(path: Path) -> int:
    buf = bytearray(16 << 20)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def _best(fn, repeat: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds: every thread's, summed)."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--mib", type=int, default=768)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--artifact-gb", default="100,150")
    ap.add_argument("--split-gb", type=float, default=50.0)
    ap.add_argument("--work", default=None, help="folder for the payload (default a temporary one, removed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ds4q-hashbench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rng = np.random.default_rng(0)
        paths = []
        for i in range(a.files):
            p = work / f"payload{i}.bin"
            if not p.is_file() or p.stat().st_size != a.mib << 20:
                with open(p, "wb") as f:
                    for _ in range(a.mib // 16):
                        f.write(rng.integers(0, 256, 16 << 20, dtype=np.uint8).tobytes())
            paths.append(p)
        total = sum(p.stat().st_size for p in paths)
        spans = [(p, off, min(SPAN, p.stat().st_size - off)) for p in paths
                 for off in range(0, p.stat().st_size, SPAN)]
        for p in paths:
            _read(p)  # warm the page cache: what follows measures hashing, not the disk
        gb = total / 1e9
        read_s = _best(lambda: [_read(p) for p in paths], a.repeat)
        rows = {"read (anchor, 1 thread)": read_s}
        for t in threads:
            with ThreadPoolExecutor(t) as pool:
                rows[f"hash_file, {t} thread(s)"] = _best(lambda: list(pool.map(hash_file, paths)), a.repeat)
                rows[f"per-span, {t} thread(s)"] = _best(
                    lambda: list(pool.map(lambda s: _hash_span(*s), spans)), a.repeat)
        # a shared host's other processes steal wall time: one core's rate is the bytes
        # per CPU-second of the one-thread check, and the projection assumes free cores
        one = gb / rows["hash_file, 1 thread(s)"][1]
        res = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} "
                          f"{platform.python_version()}",
               "payload_gb": gb, "files": a.files, "span_bytes": SPAN,
               "wall_gb_s": {k: gb / w for k, (w, _) in rows.items()},
               "cpu_gb_per_cpu_s": {k: gb / c for k, (_, c) in rows.items()},
               "wall_ratio_to_read": {k: read_s[0] / w for k, (w, _) in rows.items()},
               "projection_s": {}}
        for art in (float(x) for x in a.artifact_gb.split(",")):
            n_files = max(1, int(-(-art // a.split_gb)))
            largest = min(art, a.split_gb)
            for t in threads:
                res["projection_s"][f"{art:g} GB in {n_files} file(s), {t} thread(s)"] = max(
                    largest / one, art / (min(t, n_files) * one))
        if a.json:
            print(json.dumps(res, indent=1))
        else:
            print(f"{res['machine']}; payload {gb:.2f} GB in {a.files} file(s), page cache warm")
            for k, r in res["wall_gb_s"].items():
                print(f"  {k:28s} {r:6.2f} GB/s wall ({res['wall_ratio_to_read'][k]:.3f}x the read anchor's), "
                      f"{res['cpu_gb_per_cpu_s'][k]:6.2f} GB per CPU-second")
            for k, s in res["projection_s"].items():
                print(f"  projected check of {k}, free cores: {s:6.1f} s")
        return 0
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
