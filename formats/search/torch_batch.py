"""Many MIX searches in one set of torch launches: the torch tier's entry for the measure stage.

One search of ``torch_mix`` is ~100 small kernels; the fitter runs ~22
per expert matrix, so a small matrix on a GPU is bound by the launches, not
the arithmetic. ``choose_batched`` lets the measure stage's worker threads
(one expert each, ``ds4quant.plan``'s workers) share launches: a call
queues its request; the first caller to find the device idle runs every
queued request of the same (mode, bits) as one search over all their halves
(per-half books, splits and weights gathered from small per-request tables),
and keeps serving the queue until it is empty, while the others wait for
their slice.

Every operation is per half and the same IEEE operation as in
``torch_mix`` (and so as the numba kernels): x * (1/S), the select
chain over the splits, S * level, x - S * level, (w * d) * d, the sequential
float32 sum over 16 elements, candidates visited in the kernel's (book,
byte) order with a strict <; a request's books, bytes, codes and refusals do
not depend on what it was batched with (tests/formats/search/test_torch_mix.py). A
request without importance uses weight 1: (1 * d) * d is d * d bit for bit.
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from ds4quant.formats.search.backend import to_host
from ds4quant.formats.search.numba_mix import max_level, splits
from ds4quant.formats.search.tables import HALF, ue4m3_on
from ds4quant.formats.search.torch_mix import _fixed_flat, _nearest, _seq_sum16

# halves per batch: bounds device memory (about 10 float32 copies of a
# (halves, 16) tensor are alive at once: ~5 GiB at this size)
_BATCH_HALVES = 1 << 23
# elements of a (5 candidates, halves, 16) evaluation: ~8 float32 temporaries of
# this size are alive at once (1 GiB); fewer, larger launches than one per candidate
_CANDIDATE_ELEMENTS = 1 << 25


def _flat(X, W):
    """(Xl (N, 16), Wl (N, 16)) of one request (W None: ones)."""
    import torch

    R, H, _ = X.shape
    Xl = X.reshape(-1, HALF)
    if W is None:
        Wl = torch.ones_like(Xl)
    else:
        Wl = W.expand(R, H, HALF).reshape(-1, HALF)
    return Xl, Wl


def _books_batch(Xl, Wl, rid, books_t, split_t, ml_t, L):
    """Mode 1 over the halves of several requests: per half its request's
    books (books_t (n, 2, L)), splits and max levels (ml_t (n, 2)); a book
    whose max level is not > 0 has no candidates (the kernel skips it)."""
    import torch

    dev = Xl.device
    S, INV = ue4m3_on(dev)
    mx = Xl.abs().amax(dim=-1)
    fin = torch.isfinite(Xl).all(dim=-1)
    wok = (torch.isfinite(Wl) & (Wl >= 0)).all(dim=-1)
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=dev)
    N = Xl.shape[0]
    best = torch.full((N,), float("inf"), dtype=torch.float32, device=dev)
    bk = torch.zeros((N,), dtype=torch.int64, device=dev)
    be = torch.ones((N,), dtype=torch.int64, device=dev)
    dls = torch.arange(-2, 3, device=dev).unsqueeze(1)  # a book's 5 bytes, the kernel's order
    step = max(1, _CANDIDATE_ELEMENTS // (5 * HALF))
    for b in range(2):
        mlb = ml_t[:, b][rid]  # (N,)
        ok = (mlb > 0) & wok
        cen = _nearest(mx / mlb, S)  # 0 where the quotient is not a positive finite number
        lv = books_t[:, b, :][rid]  # (N, L)
        sp = split_t[:, b, :][rid]  # (N, L-1)
        for h0 in range(0, N, step):  # the 5 candidates of a book at once, (5, halves, 16)
            h = slice(h0, min(N, h0 + step))
            x = Xl[h]
            e = cen[h].unsqueeze(0) + dls
            valid = (e >= 1) & (e <= 126) & ok[h].unsqueeze(0)
            ec = e.clamp(1, 126)
            s = S[ec].unsqueeze(-1)
            v = x * INV[ec].unsqueeze(-1)
            y = lv[h, 0:1].expand(v.shape)
            for j in range(1, L):
                y = torch.where(v > sp[h, j - 1:j], lv[h, j:j + 1], y)
            d = x - s * y
            err = _seq_sum16((Wl[h] * d) * d)
            err = torch.where(valid, err, inf)
            err = torch.where(torch.isnan(err), inf, err)  # NaN never wins (a refused half)
            ci = err.argmin(dim=0, keepdim=True)  # the first least of the book's 5, as the kernel's strict <
            cb = err.gather(0, ci).squeeze(0)
            take = cb < best[h]  # book 0 before book 1: a tie keeps book 0
            best[h] = torch.where(take, cb, best[h])
            bk[h] = torch.where(take, b, bk[h])
            be[h] = torch.where(take, ec.gather(0, ci).squeeze(0), be[h])
    zero = mx == 0
    bk = torch.where(zero, torch.zeros_like(bk), bk)
    be = torch.where(zero, torch.zeros_like(be), be)
    v = torch.where(be.unsqueeze(-1) > 0, Xl * INV[be].unsqueeze(-1), torch.zeros((), dtype=torch.float32, device=dev))
    spk = split_t[rid, bk]  # (N, L-1): the chosen book's splits
    codes = (v.unsqueeze(-1) > spk.unsqueeze(-2)).sum(dim=-1).to(torch.uint8)
    st = torch.zeros((N,), dtype=torch.int8, device=dev)
    st[(mx != 0) & (best == float("inf"))] = 2
    st[~fin] = 1
    return bk, be, codes, st


class _Request:
    __slots__ = ("X", "W", "books", "mode", "bits", "result", "error", "done")

    def __init__(self, X, W, books, mode, bits):
        self.X, self.W, self.books, self.mode, self.bits = X, W, books, mode, bits
        self.result = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


def _run_group(reqs: list) -> None:
    """One search over the halves of ``reqs`` (same device, mode and bits)."""
    import torch

    dev = reqs[0].X.device
    mode, bits = reqs[0].mode, reqs[0].bits
    L = 4 if bits == 2 else 8
    with torch.no_grad():
        flats = [_flat(r.X, r.W) for r in reqs]
        sizes = [f[0].shape[0] for f in flats]
        Xl = torch.cat([f[0] for f in flats]) if len(flats) > 1 else flats[0][0]
        Wl = torch.cat([f[1] for f in flats]) if len(flats) > 1 else flats[0][1]
        if mode == 1:
            books = np.stack([np.ascontiguousarray(r.books, np.float32) for r in reqs])
            split = np.stack([splits(b) for b in books])
            ml = np.stack([max_level(b) for b in books])
            rid = torch.repeat_interleave(torch.arange(len(reqs), device=dev),
                                          torch.tensor(sizes, device=dev))
            bk, be, codes, st = _books_batch(Xl, Wl, rid, torch.from_numpy(books).to(dev),
                                             torch.from_numpy(split).to(dev), torch.from_numpy(ml).to(dev), L)
        else:
            be, codes, st = _fixed_flat(Xl, Wl, bits)
            bk = torch.zeros_like(be)
        # one transfer each for the whole batch (book 0/1 and byte 0..126 as
        # bytes: an eighth of the int64 copy), then a slice per request
        bk, be = to_host(bk.to(torch.uint8)).astype(np.int64), to_host(be.to(torch.uint8)).astype(np.int64)
        codes, st = to_host(codes), to_host(st)
    o = 0
    for r, n in zip(reqs, sizes):
        r.result = (bk[o:o + n], be[o:o + n], codes[o:o + n], st[o:o + n])
        o += n


class _Batcher:
    """The queue of one process: requests wait here while a search runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list = []
        self._busy = False

    def submit(self, req: _Request):
        with self._lock:
            self._queue.append(req)
            lead = not self._busy
            self._busy = True
        if lead:
            self._serve()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    def _take(self) -> list:
        """The queued requests of the first one's (device, mode, bits), up to
        _BATCH_HALVES halves (at least one), in queue order."""
        with self._lock:
            if not self._queue:
                self._busy = False
                return []
            first = self._queue[0]
            key = (str(first.X.device), first.mode, first.bits)
            got, rest, n = [], [], 0
            for r in self._queue:
                h = r.X.shape[0] * r.X.shape[1]
                if (str(r.X.device), r.mode, r.bits) == key and (not got or n + h <= _BATCH_HALVES):
                    got.append(r)
                    n += h
                else:
                    rest.append(r)
            self._queue = rest
            return got

    def _serve(self) -> None:
        while True:
            group = self._take()
            if not group:
                return
            try:
                _run_group(group)
            except BaseException as exc:  # every waiter of the group sees the failure
                for r in group:
                    r.error = exc
            for r in group:
                r.done.set()


_BATCHER = _Batcher()


def choose_batched(X, W, books: np.ndarray, mode: int, bits: int):
    """``torch_mix.choose`` through the shared queue: numpy book int64 (G,),
    byte int64 (G,), codes uint8 (G, 16), status int8 (G,)."""
    return _BATCHER.submit(_Request(X, W, np.asarray(books, np.float32), int(mode), int(bits)))
