"""Stage 3 of convert: encode each planned tensor into a piece file, hashing as it writes.

Expert stacks are encoded one expert at a time, with the next expert read and
dequantized while the current one encodes, so memory stays at a few experts
whatever the model size. Each piece is written atomically; its size, payload
sha256 (taken from the bytes as they are written) and error sums go into the
journal, so a resumed run skips it.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping, Optional

import numpy as np

from ds4quant.plan import Books, Measure, TensorChoice
from ds4quant.artifact import atomic_write, sha256_file
from ds4quant.convert.plan import importance, load, members_of
from ds4quant.convert.report import TensorResult
from ds4quant.convert.resume import Journal, flush_on_exit
from ds4quant.errors import BadInputError, Ds4quantError
from ds4quant.formats import decode, encode, get_qtype, numba_threads
from ds4quant.metrics import error_sums
from ds4quant.progress import Meter, ProgressFn
from ds4quant.sources.base import Source

# Non-expert 2-D tensors are encoded in row blocks of about this many bytes
# of float32, so an embedding table never needs several full-size copies.
_ROW_BLOCK_BYTES = 16 << 20

# (sse, ssx, wsse | None, wssx | None, n) of one encoded part
Stats = tuple[float, float, Optional[float], Optional[float], int]


def _encode(qt, x: np.ndarray, imp, books, kw: dict, backend) -> np.ndarray:
    """``formats.encode`` of one matrix, its search on ``backend``'s device where
    the device tiers cover the qtype (``formats.search``: the same bytes and
    refusals); on CUDA only matrices the measure stage would send there
    (``plan.job.backend_for``)."""
    if backend is not None:
        from ds4quant.formats import search
        from ds4quant.plan.job import backend_for

        backend = backend_for(backend, x.size)
        if backend.on_device and qt.is_mix and np.ndim(books) == 2:
            return search.encode_mix(qt.name, x, imp, books, kw.get("mode", 1), backend)
        if backend.on_device and not qt.is_mix and search.scale_covers(qt.name):
            return search.encode_scale(qt.name, x, imp, backend)
    return encode(qt.name, x, imp, books, **kw)


# expert matrices read and dequantized ahead of the one encoding (each on its own thread: the FP4
# decode releases the GIL); with the searches on a GPU the reads are what the encode waits for
_READ_AHEAD = 3


def _encode_parts(src: Source, choice: TensorChoice, members, imatrix, books: Optional[Books],
                  pool: ThreadPoolExecutor, measured: Optional[Mapping[int, Measure]], backend=None
                  ) -> Iterator[tuple[bytes, Stats]]:
    """Yield (payload chunk, stats) per matrix (per row block for big non-expert tensors).

    measured: expert id -> the figures adaptive measured for exactly this
    encoding (same source, importance, books, qtype); those experts are not
    decoded again to measure them. backend: where the searches run
    (``_encode``; None: the host).
    """
    qt = get_qtype(choice.qtype)
    cols = choice.shape[0]
    lossless = choice.asked == "source" or not qt.lossy
    dense_members = choice.experts is None and members[0].expert is None
    # read + dequantize the next matrices while this one encodes (k -> future)
    pending: dict = {}

    def loaded(k: int):
        fut = pending.pop(k, None) or pool.submit(load, src, members[k], cols)
        if not dense_members:
            for j in range(k + 1, min(k + 1 + _READ_AHEAD, len(members))):
                if j not in pending:
                    pending[j] = pool.submit(load, src, members[j], cols)
        return fut.result()

    for k, m in enumerate(members):
        # GGUF sources: stored bytes already in the target qtype are copied, never re-encoded
        if qt.name != "i32" and src.payload_qtype(m.name) == qt.name:
            x = loaded(k)
            # the source energy feeds the manifest's error figures; the error is 0
            yield np.ascontiguousarray(src.read(m.name)).view(np.uint8), (0.0, error_sums(x, x).ssx,
                                                                         None, None, x.size)
            src.release(m.name)
            continue
        if choice.asked == "mxfp4-lossless":
            codes, scales = src.expert_fp4(m.layer, m.expert, m.which)
            payload = mxfp4_payload(codes, scales, m.name)
            src.release(m.name)
            yield payload, (0.0, 0.0, None, None, codes.size * 2)
            continue
        if qt.name == "i32":
            raw = np.asarray(src.read(m.name))
            if raw.dtype.kind not in "iu":
                raise BadInputError(f"{raw.dtype} tensor cannot be stored as i32", where=m.name)
            if raw.size and (int(raw.min()) < -(2**31) or int(raw.max()) >= 2**31):
                raise BadInputError("values do not fit in int32", where=m.name)
            yield raw.astype("<i4").tobytes(), (0.0, 0.0, None, None, raw.size)
            continue
        x = loaded(k)
        src.release(m.name)  # x is a copy: the mapped source pages can go now
        imp = importance(imatrix, choice.base, m.expert, cols) if qt.lossy else None
        kw = {}
        bk = None
        if qt.is_mix:
            bk, mode = books.get(choice.base, m.expert, qt.name)
            kw = {"mode": mode} if mode != 1 else {}
        step = max(1, _ROW_BLOCK_BYTES // (4 * cols)) if dense_members else x.shape[0]
        known = measured.get(m.expert) if measured is not None and not lossless and step == x.shape[0] else None
        for r0 in range(0, x.shape[0], step):
            xb = x[r0:r0 + step]
            if not np.all(np.isfinite(xb)):
                bad = np.argwhere(~np.isfinite(xb))[0]
                raise BadInputError(f"source value at {(int(bad[0]) + r0, int(bad[1]))} is not finite", where=m.name)
            try:
                q = _encode(qt, xb, imp, bk, kw, backend)
            except Ds4quantError as exc:
                raise type(exc)(exc.message, where=m.name, hint=exc.hint) from None
            if lossless:
                stats = (0.0, error_sums(xb, xb).ssx, None, None, xb.size)
            elif known is not None:
                # adaptive measured this very encoding (its wsse is weighted by imp
                # where imp exists; without one the artifact records no weighted figure)
                w = (known.wsse, known.wssx) if imp is not None else (None, None)
                stats = (known.sse, known.ssx, w[0], w[1], xb.size)
            else:
                y = decode(qt.name, q, cols, bk, modes=(kw.get("mode", 1) if qt.is_mix else None))
                s = error_sums(xb, y, imp)
                stats = (s.sse, s.ssx, s.wsse, s.wssx, xb.size)
            yield q, stats


def mxfp4_payload(codes, scales, where: str) -> bytes:
    from ds4quant.formats.mxfp4 import mxfp4_from_e2m1

    return mxfp4_from_e2m1(codes, scales, where=where).tobytes()


def encode_tensor(src: Source, choice: TensorChoice, members, imatrix, books, pool, piece: Path,
                  measured: Optional[Mapping[int, Measure]] = None, backend=None) -> TensorResult:
    """Encode one planned tensor into ``piece`` (atomically); sha256 over the bytes as written."""
    t0 = time.perf_counter()
    h = hashlib.sha256()
    nbytes = n = 0
    sse = ssx = 0.0
    wsse = wssx = None
    with atomic_write(piece) as f:
        for chunk, (e, s, we, ws, cnt) in _encode_parts(src, choice, members, imatrix, books, pool, measured,
                                                        backend):
            view = memoryview(chunk).cast("B")  # bytes or a C-contiguous uint8 array, no copy
            f.write(view)
            h.update(view)
            nbytes += view.nbytes
            sse, ssx, n = sse + e, ssx + s, n + cnt
            if we is not None:
                wsse, wssx = (wsse or 0.0) + we, (wssx or 0.0) + ws
    expect = get_qtype(choice.qtype).nbytes(int(np.prod(choice.shape)))
    if nbytes != expect:  # a bug, not a user error
        raise RuntimeError(f"{choice.name}: encoded {nbytes} bytes, expected {expect}")
    return TensorResult(choice.name, choice.qtype, nbytes, h.hexdigest(), n, sse, ssx, wsse, wssx,
                        time.perf_counter() - t0)


def _measured_for(choice: TensorChoice, members, figures) -> Optional[dict[int, Measure]]:
    if not figures:
        return None
    got = {m.expert: figures.get((choice.base, m.expert, choice.qtype)) for m in members}
    return {e: v for e, v in got.items() if v is not None} or None


def run_encode(src: Source, plan, members, imx, books, pieces: Path, journal: Journal, threads,
               progress: Optional[ProgressFn], figures: Optional[Mapping] = None,
               backend=None) -> list[TensorResult]:
    """Encode every planned tensor not already in the journal; results in plan order.
    backend: a ``formats.search.Backend`` the searches may run on (the bytes are the same)."""
    results = []
    mem = {c.name: members_of(c, members) for c in plan}
    src_bytes = {c.name: sum(src.info(m.name).nbytes for m in mem[c.name]) for c in plan}
    # the ETA is over source bytes: one huge embedding and many small norms average out
    meter = Meter("encode", len(plan), "tensor", total_work=sum(src_bytes.values()),
                  then=("writing the GGUF", "writing the manifest and sums"))
    with numba_threads(threads), ThreadPoolExecutor(max_workers=_READ_AHEAD) as pool, flush_on_exit(journal):
        for i, choice in enumerate(plan):
            piece = pieces / f"{i:05d}.bin"
            prev = journal.done.get(choice.name)
            # a piece is reused only when its bytes are the ones the journal hashed: a truncated
            # or damaged piece (same size, other bytes) is encoded again
            if (prev is not None and piece.is_file() and piece.stat().st_size == prev["bytes"]
                    and sha256_file(piece) == prev["sha256"]):
                res = TensorResult.from_journal(prev)
            else:
                res = encode_tensor(src, choice, mem[choice.name], imx, books, pool, piece,
                                    _measured_for(choice, mem[choice.name], figures), backend)
                journal.done[choice.name] = res.to_journal()
                journal.save(force=False)
            results.append(res)
            ev = meter.step(choice.name, work=src_bytes[choice.name], qtype=choice.qtype, bytes=res.nbytes,
                            seconds=res.seconds, reused=res.reused,
                            sqnr_db=res.sqnr_db if res.ssx > 0 else None)
            if progress is not None:
                progress(ev)
    journal.save()
    return results
