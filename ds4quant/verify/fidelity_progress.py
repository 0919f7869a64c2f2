"""The progress events of ``verify --fidelity`` (stage "fidelity").

The measurement is a fixed list of model passes known before it starts
(reference logits, its greedy response, its exact-copy trials, then per
placement the candidate's), with uncounted phases between them (loading the
reference model, building the candidate, loading the runtime). Each pass is a
counted item; while it runs, a forward hook on every decoder layer sends a
TICK ("reference logits: layer 3/8"), so a pass that takes a minute shows
where it is. Work is weighted per pass (``PASS_WORK``, in units of one
logits pass over the evaluation set) so the ETA of a mixed list means
something; the hooks only read the call count and never touch a tensor.

    fp = FidelityProgress(progress, [("reference logits", "logits"), ("reference response", "response")])
    fp.phase("loading the reference model")
    with fp.run("reference logits", model):
        model(ids)
    fp.finish()

With ``progress=None`` it does nothing (and registers no hooks).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from ds4quant.progress import Meter, ProgressFn

# Relative cost of each kind of pass, in logits passes over the evaluation set
# (the built-in documents on samples/ds4-copy, fast mode, one CPU owner: the
# greedy response's 32 one-token steps cost about as much as a logits pass;
# the 60 exact-copy trials about two; the local per-layer error about half).
PASS_WORK = {"logits": 1.0, "response": 1.0, "exact-copy": 2.0, "local": 0.5}


class FidelityProgress:
    """Counts the planned passes of one fidelity measurement and times them."""

    def __init__(self, progress: Optional[ProgressFn], passes: Sequence[tuple[str, str]]):
        """passes: (name, kind) in the order they run; kind is a PASS_WORK key."""
        self._progress = progress
        self._work = {name: PASS_WORK[kind] for name, kind in passes}
        self._meter = Meter("fidelity", len(passes), "pass", total_work=sum(self._work.values()))

    def _emit(self, ev) -> None:
        if self._progress is not None:
            self._progress(ev)

    def phase(self, name: str, **detail: object) -> None:
        """An uncounted phase begins (a model load, the candidate's build)."""
        if self._progress is not None:
            self._emit(self._meter.phase(name, **detail))

    @contextmanager
    def run(self, name: str, model=None, calls: int = 1) -> Iterator[None]:
        """One planned pass; with ``model``, a TICK per decoder-layer call, the
        pass's work spread over ``calls`` model calls (what is left goes to the STEP)."""
        if self._progress is None:
            yield
            return
        work = self._work[name]
        handles, done = [], [0.0]
        layers = list(getattr(getattr(model, "model", None), "layers", ()) or ()) if model is not None else []
        if layers:
            per_call = work / (len(layers) * max(calls, 1))
            n = len(layers)

            def hook(mod, args, out, i: int) -> None:
                w = min(per_call, work - done[0])
                done[0] += w
                self._emit(self._meter.tick(f"{name}: layer {i + 1}/{n}", work=w))

            for i, layer in enumerate(layers):
                handles.append(layer.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self._emit(self._meter.step(name, work=work - done[0]))

    def finish(self) -> None:
        if self._progress is not None:
            self._emit(self._meter.finish())


def plan_passes(placements: Sequence[str], exact_copy: bool, engines: Sequence[str] = (), *,
                reference: bool = True) -> list[tuple[str, str]]:
    """The passes ``verify.fidelity.measure`` runs, in order: the reference's
    (none when a reference base stands in for it), then each placement's (the
    first also measures the local per-layer error and the exact-copy trials),
    then each other engine's logits."""
    out = [("reference logits", "logits"), ("reference response", "response")] if reference else []
    if exact_copy and reference:
        out.append(("reference exact-copy trials", "exact-copy"))
    for k, label in enumerate(placements):
        out += [(f"candidate logits [{label}]", "logits"), (f"candidate response [{label}]", "response")]
        if k == 0:
            out.append((f"local MoE error [{label}]", "local"))
            if exact_copy:
                out.append((f"candidate exact-copy trials [{label}]", "exact-copy"))
    out += [(f"{e} figures", "logits") for e in engines]
    return out
