"""What verify's stages share: the options, the opened artifact, the checks collected so far.

A stage is a function ``stage(ctx) -> None`` that reads ``ctx`` and appends
checks (and, for the numbers stage, figures) to it; ``verify()`` runs them in
order. Every offender is its own failed check; a check that found nothing
wrong is recorded once as passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ds4quant.artifact.view import ArtifactView, Problem
from ds4quant.errors import BadInputError
from ds4quant.progress import ProgressFn
from ds4quant.records import Check, FidelityReport


def show_digests(a: str, b: str, least: int = 16) -> tuple[str, str]:
    """Two hex digests cut to a common length that shows where they differ
    (the first differing digit and 7 more, at least ``least`` digits)."""
    a, b = str(a), str(b)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    n = max(least, first + 8)
    cut = lambda d: d if len(d) <= n else d[:n] + "..."  # noqa: E731
    return cut(a), cut(b)


@dataclass(frozen=True)
class Options:
    """verify()'s arguments, checked."""

    source: Optional[Path] = None
    imatrix: Optional[Path] = None
    threshold_db: Optional[float] = None
    progress: Optional[ProgressFn] = None  # ProgressEvents of the decode and fidelity stages
    fidelity: bool = False
    placements: tuple = ()  # (label, runtime Placement) per placement the candidate runs on
    mode: str = "fast"  # a runtime Mode when fidelity is measured
    tokens: Optional[Path] = None
    text: Optional[Path] = None
    protocol: Optional[str] = None
    engines: tuple[str, ...] = ()  # other engines measured beside the runtime (verify/engines.py)
    ctx_size: Optional[int] = None  # llama.cpp's chunking of the evaluation stream (runtime/kl_figures.py)
    copy_sets: int = 5  # seeded identifier sets of the exact-copy protocol (runtime/copy_sets.py)
    experts_per_token: Optional[int] = None  # priced routing shortcut (runtime/routing_approx.py)
    drop_experts: Optional[Path] = None  # JSON {layer: [expert, ...]} never selected
    reference: Optional[Path] = None  # a reference base (runtime/reference_base.py) instead of running it
    stream: bool = False  # both sides through the layer-streamed forward (verify/streamed.py)
    device: str = "cpu"  # where a streamed pass runs each layer (runtime/stream/model.py: parse_device)
    max_memory: Any = None  # a streamed pass's host budget (runtime/stream/memory.py: plan_memory)


def stream_options(stream: bool, device: str, max_memory: Any, where: str) -> tuple[str, Any]:
    """(device, max_memory bytes or None) for the layer-streamed passes; refused without ``stream``."""
    if not stream:
        if device != "cpu" or max_memory is not None:
            raise BadInputError("--device and --max-memory place the layer-streamed passes", where=where,
                                hint="add --stream")
        return device, None
    from ds4quant.runtime.stream.model import parse_device
    from ds4quant.sizes import parse_size

    return parse_device(device), (None if max_memory is None else parse_size(max_memory, "--max-memory",
                                                                              positive=True))


@dataclass
class Context:
    """The state the stages pass along (mutable on purpose: the stages fill it in order)."""

    view: ArtifactView
    options: Options
    checks: list[Check] = field(default_factory=list)
    file_sha: dict[str, str] = field(default_factory=dict)  # folder-relative name -> sha256
    tensor_sha: dict[str, str] = field(default_factory=dict)  # tensor -> payload sha256
    numbers: dict[str, Any] = field(default_factory=dict)  # tensor -> ErrorFigures
    floors: dict[str, Optional[float]] = field(default_factory=dict)
    numbers_from: Optional[str] = None
    source_fingerprint: Optional[str] = None
    fidelity: FidelityReport = field(default_factory=FidelityReport)

    @property
    def first(self) -> str:
        """The first GGUF's folder-relative name (where header checks are reported)."""
        return self.view.first_file

    def ok(self, name: str, detail: str, file: Optional[str] = None) -> None:
        self.checks.append(Check(name, True, detail, file))

    def fail(self, name: str, detail: str, file: Optional[str] = None, tensor: Optional[str] = None) -> None:
        self.checks.append(Check(name, False, detail, file, tensor))

    def failed(self, name: str) -> bool:
        return any(c.name == name and not c.ok for c in self.checks)

    def passed_if_clean(self, name: str, detail: str, file: Optional[str] = None) -> None:
        if not self.failed(name):
            self.ok(name, detail, file)

    def fail_problems(self, check: str) -> list[Problem]:
        """Turn the view's problems of ``check`` into failed checks; returns them."""
        found = [p for p in self.view.problems() if p.check == check]
        for p in found:
            self.fail(p.check, p.detail, p.file, p.tensor)
        return found
