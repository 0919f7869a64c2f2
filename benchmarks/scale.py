"""The pipeline at DeepSeek-V4 Flash's real dimensions: cost per layer and peak memory.

    python benchmarks/scale.py --layers 2 --seqs 4 --tokens 64 --max-memory 6G         # CPU, small
    python benchmarks/scale.py --layers 4 --seqs 64 --tokens 2048 --device cuda --max-memory 32G \\
        --json-out benchmarks/results/scale_flash4_h200.json

On a slice of N layers of DS4 Flash (``samples/make_synthetic.py --preset
ds4-flash --layers N``: real shapes, random weights; or ``--source DIR``),
each step runs in its own child process:

1. reference: the layer-streamed reference forward (``runtime.stream``,
   ``SourceWeights``) over S sequences x T tokens, one sequence per batch
   (``--batch-size``: that many), as ``ds4quant reference --stream`` runs it
   (no observer but the logits' sum);
2. calibrate: ``ds4quant calibrate`` itself over the same S x T tokens
   (imatrix, routing profile, and the streamed sensitivity probes over the
   first ``--sensitivity-seqs`` sequences; all in calibrate's batches),
   seconds per layer from its progress events;
3. uniform convert (``ds4quant convert --recipe R``, default --jobs/threads);
4. adaptive convert (``--recipe adaptive``, candidates ``--adaptive-candidates``,
   with calibrate's imatrix, routing profile and sensitivity when step 2 ran);
5. candidate: the same streamed pass as step 1 over an artifact
   (``ArtifactWeights``: dense tensors decoded, experts on the ``--owner``
   owner, default ``cuda:0`` on a CUDA device, in ``--mode``): the adaptive
   artifact when step 4 ran, else the uniform one (``--candidate-of uniform``:
   the uniform one, before the adaptive convert).

For each: wall seconds, seconds per layer (streamed passes: measured per
layer; convert: wall / N, an upper bound since it includes the embedding
and head), peak RSS of that child (its VmHWM: ru_maxrss would start from this
process's size at fork), and on CUDA the peak GPU memory the child allocated.
Then a PROJECTION to DS4 Flash's 43 layers (``scale_projection.project``): each of its
layers at the rate the slice measured for its attention type (sliding window,
CSA, HCA: ``--ratio-offset 2`` gives a CSA and an HCA layer) + the measured
fixed part; peak memory is per layer, so it is projected flat (the hidden
states grow with S x T, not with N). Printed as a projection.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from scale_clocks import (  # noqa: E402
    ModuleClock, calibrate_marks, layer_parts, profiled, stage_clock, step_clock,
)
from scale_projection import FLASH_LAYERS, project  # noqa: E402


def _status(pid="self") -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in text.splitlines())
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process: on a shared machine the wall clock
    measures the neighbours as much as the work."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _gpu_peak() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


# --------------------------------------------------------------------------
# children


def _token_seqs(vocab: int, seqs: int, tokens: int) -> list:
    """The passes' seeded token ids: ``seqs`` sequences of ``tokens`` uniform draws."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, tokens)] for _ in range(seqs)]


def _child_stream(a) -> int:
    from ds4quant.runtime.stream import (ArtifactWeights, Observer, SourceWeights, StreamedModel, plan_memory,
                                         stream_forward)

    t0 = time.perf_counter()
    if a.artifact:
        from ds4quant.artifact.view import open_artifact
        from ds4quant.runtime.placement import placement_for_one_owner

        view = open_artifact(a.artifact)
        h = view.header
        plc = placement_for_one_owner(h.n_layer, h.n_expert, a.owner, h.n_expert_used or 1)
        weights = ArtifactWeights(view, plc, a.mode, source_dir=a.source)
    else:
        weights = SourceWeights(a.source)
    with weights as w:
        sm = StreamedModel(w, device=a.device, threads=a.threads)
        seqs = _token_seqs(w.config.vocab_size, a.seqs, a.tokens)
        batches = sm.batches(seqs, batch_size=a.batch_size or 1)
        plan = plan_memory(w, [b.shape for b in batches], a.max_memory, a.device)
        logit_sum = [0.0]
        decoded: list = []  # experts decoded per layer: reached experts once each when the cache holds them

        clock = ModuleClock() if a.profile else None

        class Obs(Observer):
            def on_layer_start(self, layer, module):
                if clock is not None:
                    clock.attach(module)

            def on_layer_end(self, layer, module):
                if clock is not None:
                    clock.detach()
                decoded.append(int(getattr(module.mlp.experts, "decoded", -1)))

            def on_logits(self, index, batch, logits):
                logit_sum[0] += float(logits.double().sum())

        progress, steps = step_clock()
        t1 = time.perf_counter()
        with profiled(a.profile):
            stream_forward(sm, batches, observer=Obs(), plan=plan, work_dir=a.work, progress=progress,
                           keep_logits=False)
        t2 = time.perf_counter()
        if clock is not None:
            with open(a.profile, "a") as f:
                f.write("\nwall seconds by layer part (device synchronized around each)\n" + clock.table() + "\n")
    per_layer = [s["seconds"] for s in steps if s["item"].startswith("layer")]
    print(json.dumps({"seconds": t2 - t0, "setup_seconds": t1 - t0, "steps": steps,
                      "seconds_per_layer": per_layer, "head_seconds": steps[-1]["seconds"] if steps else 0.0,
                      "plan": plan.to_json(), "peak_rss_bytes": _status().get("VmHWM", 0),
                      "peak_gpu_bytes": _gpu_peak(), "cpu_seconds": _cpu_seconds(), "logit_sum": logit_sum[0],
                      "experts_decoded": decoded}))
    return 0


def _child_calibrate(a) -> int:
    from ds4quant.calibrate import calibrate

    t0 = time.perf_counter()
    progress, steps = step_clock()
    origin = time.perf_counter()
    events: list = []

    def record(ev):
        events.append((str(getattr(ev.kind, "value", ev.kind)), str(ev.item), time.perf_counter()))
        progress(ev)

    clock = ModuleClock() if a.profile else None
    with calibrate_marks(events, clock), profiled(a.profile):
        rep = calibrate(a.source, a.token_file, a.out, device=a.device, max_memory=a.max_memory,
                        sensitivity_seqs=a.sensitivity_seqs, force=True, progress=record, batch_size=a.batch_size)
    if clock is not None:
        with open(a.profile, "a") as f:
            f.write("\nwall seconds by layer part, every run of a layer (main pass and branches)\n"
                    + clock.table() + "\n")
    per_layer = [s["seconds"] for s in steps if s["item"].startswith("layer")]
    print(json.dumps({"seconds": time.perf_counter() - t0, "steps": steps, "seconds_per_layer": per_layer,
                      "layer_parts": layer_parts(events, origin, min(a.sensitivity_seqs, a.seqs)),
                      "batch": rep.batch,
                      "tokens": rep.tokens, "sensitivity_seqs": a.sensitivity_seqs,
                      "peak_rss_bytes": _status().get("VmHWM", 0), "peak_gpu_bytes": _gpu_peak(),
                      "cpu_seconds": _cpu_seconds()}))
    return 0


def _child_convert(a) -> int:
    import ds4quant.cli.convert as convert_cmd
    from ds4quant.cli import main as cli

    t0 = time.perf_counter()
    # the command's progress goes to a stage clock instead of the (absent) terminal: where its time goes
    progress, stages = stage_clock(t0)
    convert_cmd.command_progress = lambda as_json, wanted=True: progress
    args = ["convert", a.source, a.out, "--recipe", a.recipe, "--force", "--json"] + list(json.loads(a.extra))
    try:
        cli(args)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_bytes": _status().get("VmHWM", 0),
                      "peak_gpu_bytes": _gpu_peak(), "cpu_seconds": _cpu_seconds(), "stages": stages}))
    return 0


# --------------------------------------------------------------------------
# parent


def _run(cmd: list, env: dict) -> dict:
    """A child's last JSON line, with its wall time and the peaks of its RSS and anonymous RSS
    (polled every 50 ms; the kernel updates VmHWM lazily, so the peak is the larger of both)."""
    peak_anon = peak_rss = 0
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env)
        while True:
            pid, status, _ = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            st = _status(p.pid)
            peak_anon = max(peak_anon, st.get("RssAnon", 0))
            peak_rss = max(peak_rss, st.get("VmRSS", 0))
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {code}):\n{err[-3000:]}")
    d = json.loads(out.strip().splitlines()[-1])
    d["wall_seconds"] = wall
    d["peak_anon_bytes"] = peak_anon
    d["peak_rss_bytes"] = max(d.get("peak_rss_bytes", 0), peak_rss)
    return d


def _generate(out: Path, env: dict, preset: str, *opts: str) -> None:
    """samples/make_synthetic.py ``preset`` into ``out`` on every core."""
    subprocess.run([sys.executable, str(REPO / "samples" / "make_synthetic.py"), str(out), "--preset", preset,
                    "--workers", str(os.cpu_count() or 1), "--force", *opts], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def _adaptive_args(a, cache: Path) -> list:
    """The adaptive convert's own options (calibration files aside)."""
    extra = ["--target-bpw", a.target_bpw, "--cache-dir", str(cache)]
    if a.adaptive_candidates != "default":
        extra += ["--candidates", a.adaptive_candidates]
    if a.device != "cpu":
        extra += ["--device", a.device]
    return extra


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("stream", "convert", "calibrate"), help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="[]", help=argparse.SUPPRESS)  # JSON list: convert's own options
    ap.add_argument("--layers", type=int, default=2, help="slice of DS4 Flash to generate (default 2)")
    ap.add_argument("--preset", default="ds4-flash", choices=("ds4-flash", "ds4-flash-mini"),
                    help="generator preset (ds4-flash-mini: the same layer pattern at small width, to try the script)")
    ap.add_argument("--ratio-offset", type=int, default=0, help="first DS4 Flash layer of the slice's pattern")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per layer of the generated slice (default DS4 Flash's 256; fewer keeps "
                         "every matrix's shape, for memory figures at a fraction of the time)")
    ap.add_argument("--source", help="an existing checkpoint folder instead of generating one")
    ap.add_argument("--work", help="work folder (default: a new temp folder, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--seqs", type=int, default=4, help="sequences of the streamed passes")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--max-memory", default=None, help="streamed passes' budget, e.g. 6G")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (streamed passes and adaptive convert)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the streamed passes")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="sequences per batch: calibrate's --batch-size (default its own: 1 on the CPU, on a GPU "
                         "as many as fit up to 8) and the streamed passes' (default 1)")
    ap.add_argument("--recipe", default="rocmfp2-strix", help="uniform recipe (default rocmfp2-strix)")
    ap.add_argument("--adaptive-candidates", default="rocmfp2,rocmfp3,rocmfp4",
                    help="adaptive convert's --candidates ('default': convert's own list)")
    ap.add_argument("--target-bpw", default="2.6", help="adaptive convert's --target-bpw")
    ap.add_argument("--sensitivity-seqs", type=int, default=8, help="calibrate's sensitivity sequences (default 8)")
    ap.add_argument("--owner", default=None,
                    help="the candidate's expert owner (default: the CUDA device, cuda:0 for 'cuda'; else cpu:0)")
    ap.add_argument("--mode", default="exact", help="the candidate's numeric mode (default exact)")
    ap.add_argument("--candidate-of", choices=("auto", "uniform", "adaptive"), default="auto",
                    help="artifact of the candidate pass (auto: adaptive when it was converted, else uniform)")
    ap.add_argument("--project-seqs", type=int, default=None,
                    help="also project calibrate to this many calibration sequences (e.g. 128)")
    ap.add_argument("--profile", default=None,
                    help="write torch.profiler's top operators and the seconds by layer part of the reference "
                         "step to this file (calibrate's beside it, NAME_calibrate.EXT)")
    ap.add_argument("--skip", default="",
                    help="comma list of steps to skip: reference,calibrate,uniform,adaptive,candidate")
    ap.add_argument("--json-out", help="write the results here")
    a = ap.parse_args(argv)
    if a.child == "stream":
        return _child_stream(a)
    if a.child == "convert":
        return _child_convert(a)
    if a.child == "calibrate":
        return _child_calibrate(a)
    if a.owner is None:
        a.owner = (a.device if ":" in a.device else "cuda:0") if a.device.startswith("cuda") else "cpu:0"

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ds4-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = [sys.executable, str(Path(__file__).resolve())]
    skip = {s for s in a.skip.split(",") if s}

    def save_partial() -> None:
        # a run cut off by its time limit still leaves every finished step's figures (and their
        # projection) behind
        if a.json_out:
            part = dict(res, partial=True)
            if "layers_in_slice" in res:
                part["projection_43_layers"] = project(res, res["layers_in_slice"])
            Path(a.json_out).write_text(json.dumps(part, indent=2) + "\n")

    res: dict = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
                 "settings": {k: v for k, v in vars(a).items() if k not in ("child", "artifact", "out", "extra")}}
    try:
        if a.source:
            src = Path(a.source)
        else:
            src = work / f"flash{a.layers}"
            t0 = time.perf_counter()
            _generate(src, env, a.preset, "--layers", str(a.layers), "--ratio-offset", str(a.ratio_offset),
                      *(["--experts", str(a.experts)] if a.experts else []))
            res["generate_seconds"] = time.perf_counter() - t0
            save_partial()
        res["source_bytes"] = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        cfg = json.loads((src / "config.json").read_text())
        n = res["layers_in_slice"] = cfg["num_hidden_layers"]
        common = ["--source", str(src), "--seqs", str(a.seqs), "--tokens", str(a.tokens), "--device", a.device,
                  "--work", str(work / "hidden")]
        if a.max_memory:
            common += ["--max-memory", a.max_memory]
        if a.threads:
            common += ["--threads", str(a.threads)]
        if a.batch_size:
            common += ["--batch-size", str(a.batch_size)]
        uni, ada, cal = work / "uniform", work / "adaptive", work / "calib"
        if "reference" not in skip:
            res["reference"] = _run(me + ["--child", "stream"] + common
                                    + (["--profile", str(Path(a.profile).resolve())] if a.profile else []), env)
            save_partial()
        if "calibrate" not in skip:
            tok = work / f"tokens-{a.seqs}x{a.tokens}.txt"  # the reference step's tokens
            tok.write_text("".join(" ".join(map(str, q)) + "\n" for q in _token_seqs(cfg["vocab_size"], a.seqs,
                                                                                     a.tokens)))
            prof = Path(a.profile).resolve() if a.profile else None
            res["calibrate"] = _run(me + ["--child", "calibrate", "--token-file", str(tok), "--out", str(cal),
                                          "--sensitivity-seqs", str(a.sensitivity_seqs)] + common
                                    + (["--profile", str(prof.with_name(prof.stem + "_calibrate" + prof.suffix))]
                                       if prof else []), env)
            save_partial()
        if not {"uniform", "adaptive"} <= skip:
            # numba compiles its kernels on a machine's first convert (100-150 s on a fresh GPU host) and
            # caches them: a two-layer tiny convert pays that once, outside the timed steps
            t0 = time.perf_counter()
            tiny = work / "warmup-source"
            # on a GPU at DS4 Flash's expert shapes: the measure stage's Triton kernels compile per shape
            # (matrices under job.DEVICE_MIN_WEIGHTS would stay on the cores and compile nothing)
            _generate(tiny, env, "tiny", "--layers", "2", "--experts", "4",
                      *(["--hidden", "4096", "--moe-inter", "2048"] if a.device != "cpu" else []))
            for recipe, extra in ((a.recipe, []), ("adaptive", _adaptive_args(a, work / "warmup-cache"))):
                _run(me + ["--child", "convert", "--source", str(tiny), "--out", str(work / "warmup"),
                           "--recipe", recipe, "--extra=" + json.dumps(extra)], env)
            res["warmup_seconds"] = time.perf_counter() - t0
        if "uniform" not in skip:
            res["uniform_convert"] = _run(me + ["--child", "convert", "--source", str(src), "--out", str(uni),
                                                "--recipe", a.recipe], env)
            save_partial()

        def candidate(pick: Path) -> None:
            if "candidate" not in skip and "candidate" not in res and any(pick.glob("*.gguf")):
                res["candidate"] = _run(me + ["--child", "stream", "--artifact", str(pick), "--owner", a.owner,
                                              "--mode", a.mode] + common, env)
                res["candidate"]["artifact"] = pick.name
                save_partial()

        if a.candidate_of == "uniform":  # before the adaptive convert, the longest step
            candidate(uni)
        if "adaptive" not in skip:
            shutil.rmtree(work / "measure-cache", ignore_errors=True)  # a fresh machine's cost, not a cached one
            extra = _adaptive_args(a, work / "measure-cache")
            if (cal / "imatrix.gguf").is_file():
                extra += ["--imatrix", str(cal / "imatrix.gguf"), "--routing", str(cal / "routing.json")]
            res["adaptive_convert"] = _run(me + ["--child", "convert", "--source", str(src), "--out", str(ada),
                                                 "--recipe", "adaptive", "--extra=" + json.dumps(extra)], env)
            res["adaptive_convert"]["calibrated"] = (cal / "imatrix.gguf").is_file()
            save_partial()
        candidate({"adaptive": ada}.get(a.candidate_of) or (ada if any(ada.glob("*.gguf")) else uni))
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)
    res["projection_43_layers"] = project(res, n)
    _print(res, n)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _print(res: dict, n: int) -> None:
    print(f"DS4 Flash slice: {n} layers, source {res.get('source_bytes', 0) / 1e9:.2f} GB"
          + (f"; convert warm-up (numba compiles, once a machine) {res['warmup_seconds']:.1f} s"
             if "warmup_seconds" in res else ""))
    print(f"{'step':18s} {'wall s':>9s} {'s/layer':>9s} {'CPU s':>8s} {'peak RSS':>11s} {'peak anon':>11s} "
          f"{'peak GPU':>10s}")
    for key in ("reference", "calibrate", "uniform_convert", "adaptive_convert", "candidate"):
        r = res.get(key)
        if not r:
            continue
        per = r.get("seconds_per_layer")
        spl = sum(per) / len(per) if per else r["wall_seconds"] / n
        print(f"{key:18s} {r['wall_seconds']:9.1f} {spl:9.1f} {r.get('cpu_seconds', 0.0):8.1f} "
              f"{_gib(r['peak_rss_bytes']):>11s} "
              f"{_gib(r['peak_anon_bytes']):>11s} {_gib(r.get('peak_gpu_bytes', 0)):>10s}")
    print(f"PROJECTION to {FLASH_LAYERS} layers (streamed passes: each layer at its attention type's rate in the "
          f"slice, the first layer's one-time costs once; convert: its set-up once, the rest / N x {FLASH_LAYERS}; "
          "memory flat in the layer count):")
    proj = res["projection_43_layers"]
    for key, p in proj.items():
        print(f"  {key:18s} {p['seconds'] / 60:8.1f} min   peak RSS {_gib(p['peak_rss_bytes'])}")
    if "calibrate" in proj:
        print("  (calibrate: " + ("by parts: the main pass per sequence-layer, the noise and local errors once a "
                                  "layer, the probe branches per branch sequence-layer, each at its type's worst rate"
                                  if proj["calibrate"].get("by_parts") else
                                  "by sequence-layers, the probe branches growing with depth, at the slice's worst "
                                  "rate per sequence-layer: an upper bound") + ")")
    whole = [k for k in ("calibrate", "adaptive_convert", "candidate") if k in proj]
    if len(whole) == 3:
        print(f"  whole pipeline (calibrate + adaptive convert + candidate pass): "
              f"{sum(proj[k]['seconds'] for k in whole) / 60:.1f} min, peak RSS "
              f"{_gib(max(proj[k]['peak_rss_bytes'] for k in whole))}")


if __name__ == "__main__":
    sys.exit(main())
