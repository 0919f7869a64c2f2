"""The timing instruments of ``benchmarks/scale.py``'s children: where a step's
seconds go (per layer, per layer part, per convert stage, per calibrate part),
with or without ``torch.profiler``. Importing this module imports no torch."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

__all__ = ["ModuleClock", "calibrate_marks", "layer_parts", "profiled", "stage_clock", "step_clock"]


class profiled:
    """torch.profiler over the pass when ``path`` is given: the top operators by
    self device time and by self host time, written to ``path`` (where a
    sequence-layer's time goes, without a debugger on the lent machine)."""

    def __init__(self, path):
        self.path, self.prof = path, None

    def __enter__(self):
        if self.path:
            import torch
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is None:
            return False
        self.prof.__exit__(*exc)
        ka = self.prof.key_averages()
        parts = []
        import torch

        keys = (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
        for key in keys:
            parts.append(f"sorted by {key}\n" + ka.table(sort_by=key, row_limit=30))
        Path(self.path).write_text("\n\n".join(parts) + "\n")
        return False


class ModuleClock:
    """Wall seconds per layer part (attention, its compressor and indexer, router,
    routed experts, shared expert, hyper-connections), the device synchronized
    around each call: where a sequence-layer's time goes, by module. Only with
    ``--profile`` (the synchronizations cost time of their own)."""

    PARTS = ("", "self_attn", "mlp", "mlp.gate", "mlp.experts",
             "mlp.shared_experts", "attn_hc", "ffn_hc", "input_layernorm", "post_attention_layernorm")

    def __init__(self):
        self.total: dict = {}
        self.calls: dict = {}
        self.handles: list = []

    def attach(self, layer_module) -> None:
        import torch

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        mods = dict(layer_module.named_modules())
        extra = [n for n in mods if n.endswith(("compressor", "indexer")) and n not in self.PARTS]
        for part in self.PARTS + tuple(extra):
            m = mods.get(part)
            if m is None:
                continue
            name = part or "layer"
            start: list = []

            def pre(_m, _args, start=start):
                sync()
                start.append(time.perf_counter())

            def post(_m, _args, _out, start=start, name=name):
                sync()
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - start.pop()
                self.calls[name] = self.calls.get(name, 0) + 1

            self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def table(self) -> str:
        whole = self.total.get("layer", 0.0) or 1.0
        rows = [f"{'part':<28} {'calls':>6} {'seconds':>9} {'share of layer':>15}"]
        for name, sec in sorted(self.total.items(), key=lambda kv: -kv[1]):
            rows.append(f"{name:<28} {self.calls[name]:>6} {sec:>9.3f} {100 * sec / whole:>14.1f}%")
        return "\n".join(rows)


def step_clock():
    """(progress callback, steps): the seconds between a stage's STEP events (a layer, the head)."""
    steps, last = [], [time.perf_counter()]

    def progress(ev):
        if str(getattr(ev.kind, "value", ev.kind)) != "step":
            return
        now = time.perf_counter()
        steps.append({"item": ev.item, "seconds": now - last[0]})
        last[0] = now

    return progress, steps


@contextlib.contextmanager
def calibrate_marks(events: list, clock: "ModuleClock | None" = None):
    """While open, ("tick", "layer L: weights ready", time) when calibrate's
    streamed model has materialized layer L, and ("tick", "layer L: noise and
    local errors", time) when its sensitivity pass has measured the layer,
    appended to ``events`` beside calibrate's own progress events (the
    library's event stream stays as it is); with ``clock``, that clock on every
    layer calibrate materializes (it builds its layers itself)."""
    from ds4quant.calibrate import sensitivity
    from ds4quant.runtime.stream.model import StreamedModel

    real_layer = StreamedModel.layer
    passes = {cls: cls.layer for cls in (sensitivity.StreamedPass, sensitivity.PerTensorPass)}

    @contextlib.contextmanager
    def layer(self, L, *args, **kwargs):
        with real_layer(self, L, *args, **kwargs) as mod:
            events.append(("tick", f"layer {L}: weights ready", time.perf_counter()))
            if clock is not None:
                clock.attach(mod)
            try:
                yield mod
            finally:
                if clock is not None:
                    clock.detach()

    def measured(real):
        def run(self, L, *args, **kwargs):
            out = real(self, L, *args, **kwargs)
            events.append(("tick", f"layer {L}: noise and local errors", time.perf_counter()))
            return out
        return run

    StreamedModel.layer = layer
    for cls, real in passes.items():
        cls.layer = measured(real)
    try:
        yield events
    finally:
        StreamedModel.layer = real_layer
        for cls, real in passes.items():
            cls.layer = real


def layer_parts(events: list, origin: float, sens: int = 0) -> list:
    """Per layer, from calibrate's (kind, item, time) events after ``origin``: the
    weights (to the layer materialized; the first layer's also holds calibrate's
    set-up), the main pass (to its last sequence), the noise and local errors, the
    probe branches (to the layer's end). With ``sens`` (the sensitivity
    sequences, which run first, their experts calls captured) the main pass is
    also split there: ``main_sens`` to sequence ``sens``'s tick, ``main_rest``
    after it."""
    parts, start, ready, main_end, noise_end, single_end = [], origin, None, None, None, None
    for kind, item, t in events:
        if kind == "tick" and item.endswith("weights ready"):
            ready = t
        elif kind == "tick" and ": sequence " in item and item.startswith("layer"):
            main_end = t
            if sens and item.split(": sequence ")[1].split("/")[0] == str(sens):
                single_end = t
        elif kind == "tick" and item.endswith("noise and local errors"):
            noise_end = t
        elif kind == "step" and item.startswith("layer"):
            w = ready if ready is not None else start
            m = main_end if main_end is not None else t
            nz = noise_end if noise_end is not None else m
            part = {"weights": w - start, "main": m - w, "noise_and_local": nz - m, "branches": t - nz}
            if single_end is not None:
                part.update(main_sens=single_end - w, main_rest=m - single_end)
            parts.append(part)
            start, ready, main_end, noise_end, single_end = t, None, None, None, None
    return parts


def stage_clock(t0: float):
    """(progress callback, stages): per convert stage (measure, codebooks, encode, convert's
    phases), the seconds from the start to its first and last event and the event count."""
    stages: dict = {}

    def progress(ev):
        now = time.perf_counter() - t0
        name = str(getattr(ev, "stage", "?"))
        if name == "convert" and getattr(ev, "item", None):
            name = "convert: " + " ".join(str(ev.item).split()[:2])
        st = stages.setdefault(name, {"first": now, "last": now, "events": 0})
        st["last"] = now
        st["events"] += 1

    return progress, stages
