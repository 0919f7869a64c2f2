"""The MIX search in torch operations: the torch tier of ``formats.search``.

The same candidates, comparisons and float32 arithmetic as the numba tier's
``_choose_nb`` / ``_choose_fixed_nb``, one torch operation per IEEE operation: x * (1/S),
the select chain over the splits, S * level, x - S * level, (w * d) * d, and
the per-half error as the sequential float32 sum over the 16 elements in
element order (16 separate additions, never a reduction kernel, whose order
is the device's). Each operation is its own kernel, so nothing is contracted
into a fused multiply-add, and the argmin keeps the first least candidate in
the numba kernel's visiting order, so books, scale bytes and codes are the
numba kernel's bit for bit on any device (tests/formats/search/test_torch_mix.py
runs it on torch's CPU device; on CUDA where one is present).

``choose`` takes the matrix and its importance already on the device
(``backend.to_device``: the fitter keeps them there across its Lloyd steps)
and returns numpy arrays in ``numba_mix.choose``'s layout; ``torch_batch``
serves many such searches with shared launches.
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.search.numba_mix import max_level, splits
from ds4quant.formats.search.tables import HALF, ue4m3_on

# candidates evaluated in one batch (bounds the device memory of a search:
# about 4 * 20 bytes per weight per candidate in flight)
_BATCH_WEIGHTS = 1 << 26


def _nearest(t, S):
    """``ue4m3.nearest_nb`` per element of float32 t: the first byte 1..126 of
    least float32 |S(e) - t|; 0 for t <= 0 or non-finite (rows in chunks)."""
    import torch

    flat = t.reshape(-1)
    out = torch.zeros(flat.shape, dtype=torch.int64, device=t.device)
    tab = S[1:127]
    step = max(1, (1 << 24) // 126)
    for i in range(0, flat.numel(), step):
        v = flat[i:i + step]
        d = (tab[None, :] - v[:, None]).abs()
        out[i:i + step] = d.argmin(dim=1) + 1  # first least: the smaller byte
    bad = ~(flat > 0) | ~torch.isfinite(flat)
    out[bad] = 0
    return out.reshape(t.shape)


def _seq_sum16(t):
    """The float32 sum over the last axis (16) in element order: 0 + t0 + t1 + ..."""
    err = t[..., 0].clone()  # 0 + t0 == t0 (t0 >= 0 or NaN)
    for i in range(1, HALF):
        err = err + t[..., i]
    return err


def _half_facts(X, W):
    """max |x|, finite, usable weights per half (X (R, H, 16), W (1, H, 16) or None)."""
    import torch

    mx = X.abs().amax(dim=-1)
    fin = torch.isfinite(X).all(dim=-1)
    if W is None:
        wok = torch.ones((1, X.shape[1]), dtype=torch.bool, device=X.device)
    else:
        wok = (torch.isfinite(W) & (W >= 0)).all(dim=-1)
    return mx, fin, wok


def _status(fin, mx, best):
    import torch

    st = torch.zeros(mx.shape, dtype=torch.int8, device=mx.device)
    st[(mx != 0) & (best == float("inf"))] = 2
    st[~fin] = 1
    return st


def _choose_books(X, W, books_np, L):
    """Mode 1 (docs/formats.md#mix-encoder) on the device: (book, byte, codes, status)."""
    import torch

    dev = X.device
    S, INV = ue4m3_on(dev)
    books = torch.from_numpy(np.ascontiguousarray(books_np, np.float32)).to(dev)
    split = torch.from_numpy(np.ascontiguousarray(splits(books_np))).to(dev)
    ml_np = max_level(books_np)
    R, H, _ = X.shape
    mx, fin, wok = _half_facts(X, W)
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=dev)
    best = torch.full((R, H), float("inf"), dtype=torch.float32, device=dev)
    bk = torch.zeros((R, H), dtype=torch.int64, device=dev)
    be = torch.ones((R, H), dtype=torch.int64, device=dev)
    per = max(1, _BATCH_WEIGHTS // max(1, X.numel()))
    cands = [(b, dl) for b in range(2) if ml_np[b] > 0 for dl in range(-2, 3)]  # the kernel's visiting order
    ml = torch.from_numpy(ml_np.copy()).to(dev)
    cen = {b: _nearest(mx / ml[b], S) for b in range(2) if ml_np[b] > 0}
    for c0 in range(0, len(cands), per):
        chunk = cands[c0:c0 + per]
        e = torch.stack([cen[b] + dl for b, dl in chunk])  # (C, R, H)
        valid = (e >= 1) & (e <= 126)
        ec = e.clamp(1, 126)
        s = S[ec].unsqueeze(-1)
        inv = INV[ec].unsqueeze(-1)
        bsel = torch.tensor([b for b, _ in chunk], dtype=torch.int64, device=dev)
        lv = books[bsel].reshape(len(chunk), 1, 1, 1, L)
        sp = split[bsel].reshape(len(chunk), 1, 1, 1, L - 1)
        v = X.unsqueeze(0) * inv
        y = lv[..., 0].expand(v.shape)
        for j in range(1, L):
            y = torch.where(v > sp[..., j - 1], lv[..., j], y)
        d = X.unsqueeze(0) - s * y
        t = (W.unsqueeze(0) * d) * d if W is not None else d * d
        err = _seq_sum16(t)
        err = torch.where(valid & wok.unsqueeze(0), err, inf)
        err = torch.where(torch.isnan(err), inf, err)  # NaN never wins (a refused half)
        ci = err.argmin(dim=0)  # the first least candidate, as the kernel's strict <
        cbest = err.gather(0, ci.unsqueeze(0)).squeeze(0)
        take = cbest < best
        best = torch.where(take, cbest, best)
        bk = torch.where(take, bsel[ci], bk)
        be = torch.where(take, ec.gather(0, ci.unsqueeze(0)).squeeze(0), be)
    zero = mx == 0
    bk = torch.where(zero, torch.zeros_like(bk), bk)
    be = torch.where(zero, torch.zeros_like(be), be)
    inv = INV[be].unsqueeze(-1)
    v = torch.where(be.unsqueeze(-1) > 0, X * inv, torch.zeros((), dtype=torch.float32, device=dev))
    spk = split[bk]  # (R, H, L-1)
    codes = (v.unsqueeze(-1) > spk.unsqueeze(-2)).sum(dim=-1).to(torch.uint8)
    return bk, be, codes, _status(fin, mx, best)


def _fixed_scan(Xl, Wl, start, K, bits, S, INV):
    """First least mode-0 error over the bytes start..start+K-1 (clamped to
    126: repeats of 126 tie and lose) per lane of Xl (N, 16), Wl (N, 16) or
    None: (best float32 (N,), byte int64 (N,); inf and 1 where none is finite)."""
    import torch

    dev = Xl.device
    N = Xl.shape[0]
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=dev)
    zf = torch.zeros((), dtype=torch.float32, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)
    two = torch.full((), 2.0, dtype=torch.float32, device=dev)
    four = torch.full((), 4.0, dtype=torch.float32, device=dev)
    best = torch.full((N,), float("inf"), dtype=torch.float32, device=dev)
    be = torch.ones((N,), dtype=torch.int64, device=dev)
    per = max(1, _BATCH_WEIGHTS // max(1, Xl.numel()))
    for j0 in range(0, K, per):
        js = torch.arange(j0, min(K, j0 + per), device=dev)
        es = (start.unsqueeze(0) + js.unsqueeze(1)).clamp(1, 126)  # (C, N), ascending per lane
        s = S[es].unsqueeze(-1)
        inv = INV[es].unsqueeze(-1)
        q = Xl.unsqueeze(0) * inv
        if bits == 2:  # docs/formats.md#rocmfp2: {-1, 0, 1, 2}, ties to the lower code
            y = torch.full(q.shape, -1.0, dtype=torch.float32, device=dev)
            y = torch.where(q > -0.5, zf, y)
            y = torch.where(q > 0.5, one, y)
            y = torch.where(q > 1.5, two, y)
        else:  # docs/formats.md#rocmfp3: sign + {0, 1, 2, 4}, ties to the lower magnitude
            a = q.abs()
            y = torch.where(a > 0.5, one, torch.zeros(q.shape, dtype=torch.float32, device=dev))
            y = torch.where(a > 1.5, two, y)
            y = torch.where(a > 3.0, four, y)
            y = torch.where(q < 0, -y, y)
        d = Xl.unsqueeze(0) - s * y
        t = (Wl.unsqueeze(0) * d) * d if Wl is not None else d * d
        err = _seq_sum16(t)
        err = torch.where(torch.isnan(err), inf, err)
        ci = err.argmin(dim=0)
        cbest = err.gather(0, ci.unsqueeze(0)).squeeze(0)
        take = cbest < best
        best = torch.where(take, cbest, best)
        be = torch.where(take, es.gather(0, ci.unsqueeze(0)).squeeze(0), be)
    return best, be


_WINDOW = 40  # bytes per lane: 12 below N(max/Vmax), up to the all-zero byte (about 16 or 24 above)


def _choose_fixed(X, W, bits):
    """Mode 0 on the device for X (R, H, 16), W (1, H, 16) or None: (book 0,
    byte, codes, status) shaped (R, H) (codes (R, H, 16))."""
    import torch

    R, H, _ = X.shape
    Xl = X.reshape(-1, HALF)
    Wl = None if W is None else W.expand(R, H, HALF).reshape(-1, HALF)
    be, codes, st = _fixed_flat(Xl, Wl, bits)
    be = be.reshape(R, H)
    return torch.zeros_like(be), be, codes.reshape(R, H, HALF), st.reshape(R, H)


def _fixed_flat(Xl, Wl, bits):
    """Mode 0 on halves Xl (N, 16) with weights Wl (N, 16) or None: the byte
    of least error over 1..126, ties to the smaller; (byte, codes, status).
    Per half only a window of bytes is evaluated, with the answer of all 126,
    as ``numba_mix._choose_fixed_nb`` argues: above the byte from which
    every element quantises to 0 the error is constant (met inside the
    window); below it the clipping bound, less 1e-5, exceeds the half's best.
    Halves where either fails are scanned over all 126 bytes."""
    import torch

    dev = Xl.device
    S, INV = ue4m3_on(dev)
    mxl = Xl.abs().amax(dim=-1)
    finl = torch.isfinite(Xl).all(dim=-1)
    if Wl is None:
        wokl = torch.ones(mxl.shape, dtype=torch.bool, device=dev)
    else:
        wokl = (torch.isfinite(Wl) & (Wl >= 0)).all(dim=-1)
    vmax = torch.full((), 2.0 if bits == 2 else 4.0, dtype=torch.float32, device=dev)
    ok = (mxl > 0) & finl & wokl
    c = _nearest(mxl / vmax, S)
    lo = (c - 12).clamp(min=1)
    ehi = torch.full_like(lo, 126)
    step = max(1, (1 << 24) // 126)
    for i in range(0, mxl.numel(), step):  # the first byte from which every element is level 0
        cond = (mxl[i:i + step].unsqueeze(1) * INV[1:127].unsqueeze(0)) < 0.5
        ehi[i:i + step] = torch.where(cond.any(dim=1), cond.to(torch.int8).argmax(dim=1) + 1, ehi[i:i + step])
    best, be = _fixed_scan(Xl, Wl, lo, _WINDOW, bits, S, INV)
    # the clipping bound below the window (float64; only compared, with a margin)
    sl = S[(lo - 1).clamp(min=1)].to(torch.float64).unsqueeze(-1)
    x64 = Xl.to(torch.float64)
    vside = torch.where(x64 > 0, 2.0 if bits == 2 else 4.0, 1.0 if bits == 2 else 4.0).to(torch.float64)
    clip = (x64.abs() - sl * vside).clamp(min=0)
    w64 = torch.ones_like(x64) if Wl is None else Wl.to(torch.float64)
    lb = (w64 * clip * clip).sum(dim=1)
    passed = (lo == 1) | (lb * (1.0 - 1e-5) > best.to(torch.float64))
    full = ok & ~((ehi <= lo + _WINDOW - 1) & passed)
    idx = torch.nonzero(full).reshape(-1)
    if idx.numel():
        fb, fe = _fixed_scan(Xl[idx], None if Wl is None else Wl[idx], torch.ones_like(idx), 126, bits, S, INV)
        best[idx] = fb
        be[idx] = fe
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=dev)
    best = torch.where(wokl, best, inf)  # unusable weights: nothing is ever adopted
    be = torch.where(wokl, be, torch.ones_like(be))
    be = torch.where(mxl == 0, torch.zeros_like(be), be)
    zf = torch.zeros((), dtype=torch.float32, device=dev)
    v = torch.where(be.unsqueeze(-1) > 0, Xl * INV[be].unsqueeze(-1), zf)
    if bits == 2:
        codes = ((v > -0.5).to(torch.uint8) + (v > 0.5) + (v > 1.5)).to(torch.uint8)
        codes = torch.where(torch.isnan(v), torch.full((), 3, dtype=torch.uint8, device=dev), codes)
    else:
        a = v.abs()
        idx3 = ((a > 0.5).to(torch.uint8) + (a > 1.5) + (a > 3.0)).to(torch.uint8)
        codes = torch.where((v < 0) & (idx3 != 0), idx3 | 4, idx3)
    st = torch.zeros(mxl.shape, dtype=torch.int8, device=dev)
    st[(mxl != 0) & (best == float("inf"))] = 2
    st[~finl] = 1
    return be, codes.to(torch.uint8), st


def choose(X, W, books: np.ndarray, mode: int, bits: int):
    """``numba_mix.choose`` for device tensors from ``backend.to_device``: numpy
    book int64 (G,), byte int64 (G,), codes uint8 (G, 16), status int8 (G,)."""
    import torch

    with torch.no_grad():
        if mode == 1:
            bk, be, codes, st = _choose_books(X, W, np.asarray(books, np.float32), 4 if bits == 2 else 8)
        else:
            bk, be, codes, st = _choose_fixed(X, W, bits)
        G = X.shape[0] * X.shape[1]
        # one transfer each; the fitter's Lloyd sums run on the host
        return (bk.reshape(G).cpu().numpy(), be.reshape(G).cpu().numpy(),
                codes.reshape(G, HALF).cpu().numpy(), st.reshape(G).cpu().numpy())
