"""Benchmark `ds4quant convert` on a synthetic DeepSeek-V4 source against the I/O ceiling.

    python benchmarks/convert.py                        # bench preset (~1 GB FP4 experts), rocmfp2-strix
    python benchmarks/convert.py --recipe rocmfp4 --json
    python benchmarks/convert.py --source /path/to/ds4-checkpoint --threads 1,4
    python benchmarks/convert.py --preset medium --profile

Steps, all in one run (the source stays in the page cache throughout, so the
ceiling and the conversions see the same cache state):

1. generate the synthetic source (samples/make_synthetic.py; skipped with --source);
2. the I/O ceiling: read every shard and sha256 it (8 MB reads);
3. the fixed overhead: peak RSS of the same child converting a tiny synthetic
   source (interpreter, imports, numba code, buffers);
4. per thread count (default 1 and all cores): convert in a child process;
   peak RSS from os.wait4's rusage of that child; wall and encode times;
5. sha256 of each run's GGUF file(s): the bytes must not depend on --threads.

Figures: source MB/s = source bytes / conversion seconds; encode MB/s =
source FP4 expert bytes (codes + scales) / seconds spent in routed-expert
tensors (read, dequantize, encode, error figures, piece write); "x ceiling" =
source MB/s / read-and-hash MB/s. The memory target is peak RSS
within about 2x the largest tensor plus a fixed overhead: the table shows
(peak - overhead) / largest tensor, with the largest tensor counted as its
float32 values (what the converter holds while encoding it), for the total
peak RSS (VmHWM: includes the source pages the converter memory-maps) and for
the anonymous part alone (heap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

import make_synthetic  # noqa: E402

_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")
_READ = 8 << 20
RSS_FACTOR = 2.0  # memory target: peak RSS within about 2x the largest tensor plus a fixed overhead


# --------------------------------------------------------------------------
# child: one conversion


def _child(args) -> int:
    """Convert, print one JSON line of figures (runs in its own process)."""
    from ds4quant.convert import convert

    def run():
        return convert(args.source, args.out, args.recipe, threads=args.threads,
                       command=["benchmarks/convert.py", "--child"])

    if args.profile_out:
        import cProfile

        prof = cProfile.Profile()
        rep = prof.runcall(run)
        prof.dump_stats(args.profile_out)
    else:
        rep = run()
    kinds = [c.tensor_class for c in rep.plan]
    expert_s = sum(r.seconds for r, k in zip(rep.results, kinds) if k == "routed_expert")
    print(json.dumps({
        "seconds": rep.seconds,
        "expert_seconds": expert_s,
        "bpw_experts": rep.bpw_experts,
        "expert_sqnr_db": rep.to_json()["expert_sqnr_db"],
        "bytes": rep.bytes,
        "files": [str(p) for p in rep.files],
        "vm_hwm_bytes": _proc_status("self").get("VmHWM", 0),
    }))
    return 0


def _proc_status(pid) -> dict:
    """VmHWM / VmRSS / RssAnon / RssFile of a process in bytes ({} once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _run_child(source: Path, out: Path, recipe: str, threads: int, profile: "Path | None") -> dict:
    """Run one conversion in a child process and measure it.

    Peak RSS is the child's own VmHWM (the kernel's high-water mark of its
    address space, read by the child just before it exits). Not rusage: on
    Linux a child's ru_maxrss starts from the parent's RSS at fork (kept
    across exec), so it would report this process's size. The parent also
    polls /proc every 20 ms for the peak of RssAnon (heap; excludes the
    page-cache pages of memory-mapped source shards, which VmHWM counts).
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--source", str(source), "--out", str(out),
           "--recipe", recipe, "--threads", str(threads)]
    if profile is not None:
        cmd += ["--profile-out", str(profile)]
    peak_anon = peak_file = 0
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe)
        while True:
            pid, status, _ = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            st = _proc_status(p.pid)
            peak_anon = max(peak_anon, st.get("RssAnon", 0))
            peak_file = max(peak_file, st.get("RssFile", 0))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        stdout, stderr = fo.read(), fe.read()
    if p.returncode != 0:
        raise SystemExit(f"conversion with {threads} thread(s) failed (exit {p.returncode}):\n"
                         f"{stderr.decode(errors='replace')[-4000:]}")
    d = json.loads(stdout.decode().strip().splitlines()[-1])
    d["wall_seconds"] = wall
    d["peak_rss_bytes"] = d.pop("vm_hwm_bytes")
    d["peak_anon_bytes"] = peak_anon
    d["peak_file_bytes"] = peak_file
    d["threads"] = threads
    return d


# --------------------------------------------------------------------------
# measurements


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_READ)
            if not b:
                return h.hexdigest()
            h.update(b)


def read_and_hash(files) -> tuple[int, float]:
    """(bytes, seconds) to read and sha256 every file: the I/O ceiling."""
    t0 = time.perf_counter()
    n = 0
    for p in files:
        n += Path(p).stat().st_size
        _sha256(Path(p))
    return n, time.perf_counter() - t0


def source_facts(path: Path) -> dict:
    """Shards, bytes, FP4 expert bytes/weights and the largest tensor of a source."""
    from ds4quant.sources.official import open_source

    with open_source(path) as src:
        infos = [src.info(n) for n in src.tensor_names()]
        shards = sorted({i.shard for i in infos})
    expert = [i for i in infos if _EXPERT.search(i.name)]
    stored = max(infos, key=lambda i: i.nbytes)
    values = max(infos, key=lambda i: _numel(i.shape_logical))
    return {
        "shards": [str(path / s) for s in shards],
        "bytes": sum(i.nbytes for i in infos),
        "file_bytes": sum((path / s).stat().st_size for s in shards),
        "expert_bytes": sum(i.nbytes for i in expert),
        "expert_weights": sum(_numel(i.shape_logical) for i in expert if i.name.endswith(".weight")),
        "largest_stored": [stored.name, stored.nbytes],
        "largest_f32": [values.name, 4 * _numel(values.shape_logical)],
    }


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _gguf_sha(files) -> str:
    """sha256 over the run's GGUF file(s), in name order."""
    h = hashlib.sha256()
    for p in sorted(files, key=lambda p: Path(p).name):
        h.update(Path(p).name.encode() + b"\0" + _sha256(Path(p)).encode())
    return h.hexdigest()


def _top_profile(path: Path, n: int = 12) -> str:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return "\n".join(lines[start:])


# --------------------------------------------------------------------------
# parent


def benchmark(args) -> dict:
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ds4-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"recipe": args.recipe, "workdir": str(work)}
    try:
        if args.source:
            source = Path(args.source)
            result["generated"] = None
        else:
            spec = make_synthetic.spec_from_args(args)
            source = work / f"synthetic-{args.preset}"
            info = make_synthetic.make_synthetic(source, spec, overwrite=True)
            result["generated"] = {"preset": args.preset, "seconds": info.seconds,
                                   "mb_per_s": info.total_bytes / 1e6 / info.seconds, "spec": info.to_json()["spec"]}
        facts = source_facts(source)
        result["source"] = {"path": str(source), **facts}

        n, secs = read_and_hash(facts["shards"])
        result["ceiling"] = {"bytes": n, "seconds": secs, "mb_per_s": n / 1e6 / secs}

        # fixed overhead: the same child on a tiny source
        tiny_src = work / "synthetic-tiny-baseline"
        make_synthetic.make_synthetic(tiny_src, make_synthetic.preset("tiny"), overwrite=True)
        base = _run_child(tiny_src, work / "out-baseline", args.recipe, 1, None)
        result["overhead_rss_bytes"] = base["peak_rss_bytes"]
        result["overhead_anon_bytes"] = base["peak_anon_bytes"]
        shutil.rmtree(work / "out-baseline", ignore_errors=True)

        threads = sorted(set(args.threads)) if args.threads else sorted({1, os.cpu_count() or 1})
        runs = []
        largest = facts["largest_f32"][1]
        for t in threads:
            out = work / f"out-t{t}"
            shutil.rmtree(out, ignore_errors=True)
            prof = (work / f"profile-t{t}.pstats") if args.profile else None
            d = _run_child(source, out, args.recipe, t, prof)
            d["gguf_sha256"] = _gguf_sha(d["files"])
            d["source_mb_per_s"] = facts["bytes"] / 1e6 / d["seconds"]
            d["encode_mb_per_s"] = facts["expert_bytes"] / 1e6 / d["expert_seconds"] if d["expert_seconds"] else None
            d["x_ceiling"] = d["source_mb_per_s"] / result["ceiling"]["mb_per_s"]
            d["rss_over_largest"] = (d["peak_rss_bytes"] - base["peak_rss_bytes"]) / largest
            d["rss_bound_bytes"] = base["peak_rss_bytes"] + RSS_FACTOR * largest
            d["rss_within_bound"] = d["peak_rss_bytes"] <= d["rss_bound_bytes"]
            d["anon_over_largest"] = (d["peak_anon_bytes"] - base["peak_anon_bytes"]) / largest
            if prof is not None:
                d["profile_top"] = _top_profile(prof)
            runs.append(d)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        result["runs"] = runs
        result["identical_across_threads"] = len({r["gguf_sha256"] for r in runs}) == 1
        return result
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def _mb(b: float) -> str:
    return f"{b / 1e6:,.1f}"


def print_table(r: dict) -> None:
    s = r["source"]
    g = r["generated"]
    how = (f"synthetic {g['preset']} preset, seed {g['spec']['seed']}, generated in {g['seconds']:.1f} s "
           f"({g['mb_per_s']:,.0f} MB/s)") if g else "given with --source"
    print(f"source  {s['path']} ({how})")
    print(f"        {_mb(s['bytes'])} MB in {len(s['shards'])} shard(s); FP4 experts {_mb(s['expert_bytes'])} MB "
          f"({s['expert_weights'] / 1e9:.3f} G weights)")
    print(f"        largest tensor: {s['largest_stored'][0]} {_mb(s['largest_stored'][1])} MB stored, "
          f"{s['largest_f32'][0]} {_mb(s['largest_f32'][1])} MB as float32")
    c = r["ceiling"]
    print(f"ceiling read + sha256 of every shard: {_mb(c['bytes'])} MB in {c['seconds']:.2f} s = "
          f"{c['mb_per_s']:,.0f} MB/s (warm page cache)")
    print(f"overhead peak RSS of the same child on a tiny source: {_mb(r['overhead_rss_bytes'])} MB "
          f"({_mb(r['overhead_anon_bytes'])} MB anonymous)")
    print(f"recipe  {r['recipe']}")
    head = ("threads", "convert s", "wall s", "src MB/s", "enc MB/s", "x ceiling", "bpw", "SQNR dB",
            "peak RSS MB", "anon MB", "file MB", "(RSS-ovh)/largest", f"<= ovh+{RSS_FACTOR:g}x",
            "(anon-ovh)/largest", "gguf sha256")
    rows = [head]
    for d in r["runs"]:
        rows.append((str(d["threads"]), f"{d['seconds']:.1f}", f"{d['wall_seconds']:.1f}",
                     f"{d['source_mb_per_s']:,.1f}",
                     f"{d['encode_mb_per_s']:,.1f}" if d["encode_mb_per_s"] else "-",
                     f"{d['x_ceiling']:.4f}", f"{d['bpw_experts']:.4f}",
                     f"{d['expert_sqnr_db']:.2f}" if d["expert_sqnr_db"] is not None else "-",
                     _mb(d["peak_rss_bytes"]), _mb(d["peak_anon_bytes"]), _mb(d["peak_file_bytes"]),
                     f"{d['rss_over_largest']:.2f}", "yes" if d["rss_within_bound"] else "NO",
                     f"{d['anon_over_largest']:.2f}", d["gguf_sha256"][:16]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    print(f"identical GGUF bytes across thread counts: {'yes' if r['identical_across_threads'] else 'NO'}")
    for d in r["runs"]:
        if "profile_top" in d:
            print(f"\nprofile, {d['threads']} thread(s), by own time:\n{d['profile_top']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", help="an existing official-layout checkpoint folder (default: generate one)")
    make_synthetic.add_spec_args(ap, "bench")
    ap.add_argument("--recipe", default="rocmfp2-strix", help="conversion recipe (default rocmfp2-strix)")
    ap.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")],
                    help="comma-separated thread counts (default: 1 and all cores)")
    ap.add_argument("--workdir", help="keep generated source and outputs here (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir and the artifacts")
    ap.add_argument("--profile", action="store_true", help="cProfile each conversion; print the top functions")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--save", help="also write the JSON object to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.threads = args.threads[0]
        return _child(args)
    result = benchmark(args)
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
