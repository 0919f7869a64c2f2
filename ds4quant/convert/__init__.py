"""`ds4quant convert`: a DeepSeek-V4 checkpoint -> a ROCmFPX artifact folder.

Stages (a job with a journal, so a killed run resumes), one module each:

1. ``plan``: open + validate the source; build the plan (recipes.plan_tensors;
   for the adaptive recipe, measure every candidate and allocate under the
   budget, ds4quant.plan). Nothing is written until the plan is valid, so
   bad input leaves OUTDIR untouched;
2. ``resume``: the journal under ``OUTDIR/.ds4quant-work`` and the table of
   options that may and may not change on ``--resume``;
3. ``encode``: each output tensor into a piece file (atomic per piece),
   recording its size, sha256 and error figures in the journal;
4. ``assemble``: the GGUF (or splits) from the pieces with the codebook
   tables, atomically, then ``manifest.json`` and ``SHA256SUMS``; the work
   folder goes last, so every state a killed run leaves either has its
   journal (``--resume`` re-assembles from the checked pieces) or is a
   finished artifact (``--resume`` recognises it).

Around them, ``outdir``: OUTDIR never overlaps the source, ``--force``
removes only convert's own files, and an exclusive lock keeps a second run
out. File-system errors (a full disk, a read-only folder) are one line
(``OutputError``) saying whether the work folder was kept for ``--resume``.

    rep = convert("samples/ds4-tiny", "out/tiny", "rocmfp2-strix")
    rep.bpw_experts, rep.runtimes       # 2.8333..., ("ds4quant", "lucebox")
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from ds4quant.version import VERSION as __version__  # the package's own attribute: the journal reads it at call time
from ds4quant.plan import AdaptiveOptions, Books, Override, Recipe, get_recipe, plan_tensors
from ds4quant.artifact import sha256_file, write_manifest
from ds4quant.convert.assemble import assemble, codebook_table, manifest
from ds4quant.convert.encode import mxfp4_payload, run_encode
from ds4quant.convert.plan import fit_fixed_mix_books, plan_fingerprint, tensor_specs
from ds4quant.convert.outdir import WORK_DIR, OutLock, check_no_overlap, clear_for_force, make_out_dir
from ds4quant.convert.report import ConvertReport, TensorResult, build_report
from ds4quant.convert.tokenizer import tokenizer_kvs
from ds4quant.convert.resume import (
    FIXED,
    JOURNAL,
    MAY_CHANGE,
    Journal,
    check_outdir,
    check_resume,
    finished_report,
    fs_error,
    is_finished,
    resume_options,
)
from ds4quant.errors import BadInputError, Ds4quantError, OutputError
from ds4quant.formats import get_qtype, numba_threads
from ds4quant.progress import Meter, ProgressEvent, ProgressFn
from ds4quant.sizes import parse_size
from ds4quant.plan.recipes import GATE_UP_BOOKS
from ds4quant.sources.naming import deepseek4_kvs

MANIFEST = "manifest.json"

__all__ = [
    "FIXED", "MANIFEST", "MAY_CHANGE", "WORK_DIR",
    "ConvertReport", "ProgressEvent", "ProgressFn", "TensorResult", "convert", "mxfp4_payload",
]


def convert(
    source: "str | os.PathLike",
    outdir: "str | os.PathLike",
    recipe: str = "rocmfp2-strix",
    *,
    threads: Optional[int] = None,
    imatrix: "str | os.PathLike | None" = None,
    tensor_types: Sequence[str] = (),
    dense_qtype: Optional[str] = None,
    gate_up_books: str = "separate",
    name: Optional[str] = None,
    split_max_size: "str | int | None" = None,
    adaptive: Optional[AdaptiveOptions] = None,
    loose_sidecars: bool = True,
    resume: bool = False,
    force: bool = False,
    command: Optional[Sequence[str]] = None,
    progress: Optional[ProgressFn] = None,
) -> ConvertReport:
    """Convert a DeepSeek-V4 checkpoint (official folder or GGUF) into an artifact folder.

    ``adaptive`` (an AdaptiveOptions) is required by the ``adaptive`` recipe.
    ``gate_up_books="joint"`` fits one codebook pair per expert over its gate
    and up and shares it (as Lucebox's converter does) for MIX qtypes chosen
    with ``tensor_types``; the default fits each matrix on its own.
    ``progress`` gets a ProgressEvent per measured expert (stage "measure"),
    per fitted codebook of a MIX qtype chosen outright (stage "codebooks"),
    per encoded tensor (stage "encode"), and stage "convert" phases (writing
    the GGUF, the manifest and sums) with its end. Returns a ConvertReport; raises a
    Ds4quantError for bad input, leaving no artifact in ``outdir``. The bytes
    never depend on ``threads``.
    """
    from ds4quant.sources import open_any_source

    t_start = time.perf_counter()
    out = Path(outdir)
    # first of all: an OUTDIR overlapping the source could be emptied by --force
    check_no_overlap(source, out, imatrix)
    rec = get_recipe(recipe)
    if dense_qtype is not None:
        get_qtype(dense_qtype)
        rec = replace(rec, dense_qtype=dense_qtype)
    if gate_up_books not in GATE_UP_BOOKS:
        raise BadInputError(f"must be one of {', '.join(GATE_UP_BOOKS)}, got {gate_up_books!r}",
                            where="--gate-up-books")
    if gate_up_books != "separate":
        if rec.adaptive:
            raise BadInputError("the adaptive recipe fits its own codebooks; --gate-up-books applies to MIX "
                                "qtypes chosen with --tensor-type", where="--gate-up-books")
        rec = replace(rec, gate_up_books=gate_up_books)
    if rec.adaptive:
        if adaptive is None:
            raise BadInputError("the adaptive recipe needs --target-bpw or --max-bytes")
        adaptive.validate()
    elif adaptive is not None and (adaptive.target_bpw is not None or adaptive.max_bytes is not None):
        raise BadInputError(f"--target-bpw/--max-bytes only apply to --recipe adaptive, not {rec.name}")
    overrides = [Override.parse(t) for t in tensor_types]
    split_bytes = None if split_max_size is None else parse_size(split_max_size, "--split-max-size", positive=True)
    if threads is not None and threads < 1:
        raise BadInputError(f"must be >= 1, got {threads}", where="--threads")

    src = open_any_source(source)
    try:
        imx = imx_sha = None
        if imatrix is not None:
            from ds4quant.calib.imatrix import read_imatrix

            imx = read_imatrix(imatrix)
            imx_sha = sha256_file(imatrix)
        specs = tensor_specs(src)
        plan = plan_tensors(rec, [s for s, _ in specs], overrides)
        members = {s.name: m for s, m in specs}
        art_name = name or f"{src.name}-{rec.name}"
        if "/" in art_name or art_name.startswith(".") or not art_name:
            raise BadInputError(f"bad artifact name {art_name!r}", where="--name")
        check_outdir(out, resume, force)
        source_fp = src.fingerprint()
        routing_sha = None
        if rec.adaptive and adaptive.routing is not None and Path(adaptive.routing).is_file():
            routing_sha = sha256_file(adaptive.routing)
        sens_sha = None
        if rec.adaptive and adaptive.sensitivity is not None and Path(adaptive.sensitivity).is_file():
            sens_sha = sha256_file(adaptive.sensitivity)
        options = resume_options(
            source_fingerprint=source_fp, tool_version=__version__, recipe=rec.name,
            tensor_types=[o.pattern + "=" + o.qtype for o in overrides], dense_type=rec.dense_qtype,
            imatrix_sha=imx_sha, routing_sha=routing_sha, adaptive=adaptive if rec.adaptive else None,
            sensitivity_sha=sens_sha)
        created_out = make_out_dir(out)
        lock = OutLock(out)
        try:
            lock.acquire()
        except Ds4quantError:
            if created_out:
                shutil.rmtree(out, ignore_errors=True)
            raise
        work = out / WORK_DIR
        refused = finished = False
        try:
            job = _Job(src, out, work, art_name, rec, plan, members, overrides, imx, imx_sha, imatrix, source_fp,
                       options, split_bytes, loose_sidecars, adaptive, threads, command, progress)
            rep = job.run(resume, force, created_out, t_start)
            finished = True
            return rep
        except Ds4quantError:
            # refused before any work was recorded: leave no folder (or lock file) behind that we made
            refused = not (work / JOURNAL).exists()
            if created_out and refused:
                shutil.rmtree(out, ignore_errors=True)
            raise
        finally:
            lock.release(remove=finished, remove_created=refused)
    finally:
        src.close()


@dataclass(frozen=True)
class _Job:
    """One convert run inside a locked OUTDIR (the stages of the module docstring)."""

    src: Any
    out: Path
    work: Path
    art_name: str
    rec: Recipe
    plan: list
    members: dict
    overrides: list
    imx: Any
    imx_sha: Optional[str]
    imatrix: Any
    source_fp: str
    options: dict
    split_bytes: Optional[int]
    loose_sidecars: bool
    adaptive: Optional[AdaptiveOptions]
    threads: Optional[int]
    command: Optional[Sequence[str]]
    progress: Optional[ProgressFn]

    def run(self, resume: bool, force: bool, created_out: bool, t_start: float) -> ConvertReport:
        out, work, rec = self.out, self.work, self.rec
        journal_path = work / JOURNAL
        for p in (work, work / "pieces", journal_path):
            if p.is_symlink():  # a planted link would have pieces and journal written outside OUTDIR
                raise OutputError("is a symbolic link; convert never follows one in its work folder", where=str(p),
                                  hint="remove the link, or start over in another output folder")
        # refuse a mismatched resume before the (long) adaptive measurement
        old = Journal.load(journal_path) if resume and journal_path.exists() else None
        if old is not None:
            check_resume(old, self.options, old.plan_fingerprint)
        finished = resume and old is None and is_finished(out)
        if force and old is None:
            clear_for_force(out, self.art_name)  # before any long work: refuses foreign files untouched

        books = Books()
        adaptive_info = figures = None
        plan, adaptive = self.plan, self.adaptive
        # the phases between the counted stages (measure, codebooks, encode): long at full scale
        phases = Meter("convert", 0, "phase")

        def say(ev) -> None:
            if self.progress is not None:
                self.progress(ev)
        with numba_threads(self.threads):
            if rec.adaptive:
                from ds4quant.plan import plan_adaptive

                plan, adaptive_info, figures = plan_adaptive(self.src, plan, self.members, adaptive, self.imx,
                                                             self.imx_sha, books, self.progress)
            else:
                fit_fixed_mix_books(plan, self.members, self.src, self.imx, books,
                                    joint_gate_up=rec.gate_up_books == "joint", progress=self.progress)
        plan_fp = plan_fingerprint(rec, plan, self.imx_sha, adaptive.key() if rec.adaptive else None)
        if finished:
            return finished_report(out, self.art_name, self.src, rec, plan, self.options, self.overrides,
                                   self.imx_sha, self.source_fp, adaptive_info, t_start)

        try:
            if old is not None:
                check_resume(old, self.options, plan_fp)
                journal = old
            else:
                journal = Journal(journal_path, self.options, plan_fp)
            pieces = work / "pieces"
            pieces.mkdir(parents=True, exist_ok=True)
            journal.save()
            results: list[TensorResult] = []
            try:
                # the adaptive recipe's --device runs the encode's searches there too (the same bytes)
                results = run_encode(self.src, plan, self.members, self.imx, books, pieces, journal, self.threads,
                                     self.progress, figures, adaptive.backend() if rec.adaptive else None)
                table = codebook_table(plan, books, self.src.config.n_routed_experts)
                say(phases.phase(f"writing {self.art_name} GGUF from {len(results)} encoded tensors"))
                files, cb_bytes, decision, oversize, file_sha = assemble(
                    out, self.art_name, rec, plan,
                    deepseek4_kvs(self.src.config) + tokenizer_kvs(self.src.path, self.src.config.vocab_size),
                    pieces, self.split_bytes,
                    self.source_fp, table, self.loose_sidecars, adaptive_info)
            except Ds4quantError:
                # bad input mid-run: leave no artifact and no half-made folder
                shutil.rmtree(work, ignore_errors=True)
                if created_out:
                    shutil.rmtree(out, ignore_errors=True)
                raise
            runtimes = tuple(sorted(decision.runtimes))
            say(phases.phase(f"writing {MANIFEST} and SHA256SUMS"))
            man = manifest(out, files, self.src, rec, plan, results, self.overrides, self.imatrix, self.imx_sha,
                           self.command, self.source_fp, runtimes, adaptive_info, table, file_sha)
            write_manifest(out / MANIFEST, man)
            from ds4quant.artifact.sums import write_sums

            # a folder with SHA256SUMS and no work folder is complete; the sums list the artifact's
            # own files only (never a stale temp file or the lock)
            write_sums(out, known={f.name: f.sha256 for f in man.files},
                       names=[f.name for f in man.files] + [MANIFEST])
            shutil.rmtree(work, ignore_errors=True)
        except OSError as e:
            raise fs_error(e, out, work, created_out) from None
        say(phases.finish())

        return build_report(out, files, plan, results, cb_bytes, rec, self.source_fp, runtimes, adaptive_info,
                            t_start, oversize, decision.excluded)
