"""Write a synthetic DeepSeek-V4 checkpoint (official layout) of any size, on the fly.

    python samples/make_synthetic.py --preset medium              # into a new temp folder
    python samples/make_synthetic.py /tmp/syn --preset bench --seed 3
    python samples/make_synthetic.py /tmp/syn --layers 4 --experts 32 --hidden 1024 --moe-inter 512
    python samples/make_synthetic.py /tmp/flash --preset ds4-flash --layers 2     # DS4 Flash's real dims

    from make_synthetic import make_synthetic, preset        # with samples/ on sys.path
    info = make_synthetic("/tmp/syn", preset("tiny"))

It holds what samples/ds4-tiny holds (facts: docs/formats.md#ds4-checkpoint,
the same tensor names, dtypes and encodings; the tiny sample's writing helpers
are imported from make_ds4_tiny.py), at a size set by the options, for
benchmarks and allocation tests. It is generated, never committed:

- config.json with the native DeepSeek keys (plus a ``ds4quant_synthetic``
  object recording the generator settings), model.safetensors.index.json and
  N shards of at most ``shard_size`` bytes (a tensor is never split);
- routed experts as I8 FP4 e2m1 pairs (even element in the low nibble) with an
  F8_E8M0 scale per 32 inputs (smallest power of two >= absmax/6, codes rounded
  to nearest, ties to the even code: the rule of make_ds4_tiny.encode_fp4);
  dense attention and shared experts F8_E4M3 with 128x128 E8M0 block scales;
  embeddings, head, router and compressor projections bf16; norms, hyper-
  connection parameters, sinks, ape and router bias fp32; hash layers with a
  filled int64 tid2eid (distinct experts per token, Zipf-like popularity).

Routed experts are heavy-tailed so that adaptive allocation has something to
find: entry = t * expert_scale * matrix_jitter * row_scale[r] * col_scale[c],
with t Student-t (df 4, unit variance), expert_scale log-normal (sigma 0.5),
row/column scales log-normal, a few 3-8x outlier input columns shared by the
experts of a (layer, surface) (as activation outliers are), and a few
near-dead experts per layer (scale x 1e-3).

Determinism: every tensor's values come from a numpy Generator seeded with
sha256(seed, tensor identity), so generation order and worker count never change
bytes and regenerating gives byte-identical files. Streaming: each shard's
header is planned first, then tensors are generated (a few at a time, on
``workers`` threads) and appended in order, so memory stays at a few tensors
whatever the model size.

The spec and tensor list live in _synthetic_spec.py, the values in
_synthetic_values.py; this module writes the shards and is the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import make_ds4_tiny as tiny  # noqa: E402  (the tiny sample's JSON writer)
from _synthetic_spec import (  # noqa: E402,F401  (make_synthetic's public names, re-exported)
    DS4_FLASH_RATIOS, GENERATOR, PRESETS, SyntheticSpec, TensorPlan, Unit, plan_units, preset, shard_units,
)
from _synthetic_values import (  # noqa: E402,F401
    RowBlocks, expert_fp4, expert_values, make_unit, ordered, rng_for, tid2eid,
)

INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------
# streaming safetensors writer


def _header(units: list[Unit]) -> tuple[bytes, list[tuple[int, int]]]:
    entries, spans, off = {}, [], 0
    for u in units:
        for t in u.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            spans.append((off, off + t.nbytes))
            off += t.nbytes
    doc = {"__metadata__": {"format": "pt"}}
    doc.update(sorted(entries.items(), key=lambda kv: _natural_key(kv[0])))
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, spans


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class SyntheticInfo:
    """What make_synthetic wrote."""

    path: Path
    spec: SyntheticSpec
    files: tuple[Path, ...]
    total_bytes: int  # tensor bytes in all shards
    expert_bytes: int  # routed-expert codes + scales
    expert_weights: int
    largest_tensor: tuple[str, int]  # (name, stored bytes)
    largest_values: tuple[str, int]  # (name, number of values) of the largest weight
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "files": [p.name for p in self.files], "total_bytes": self.total_bytes,
            "expert_bytes": self.expert_bytes, "expert_weights": self.expert_weights,
            "largest_tensor": list(self.largest_tensor), "largest_values": list(self.largest_values),
            "seconds": self.seconds, "spec": asdict(self.spec),
        }


def describe(spec: SyntheticSpec) -> SyntheticInfo:
    """Sizes of the checkpoint ``spec`` describes, without writing it."""
    units = plan_units(spec)
    tensors = [t for u in units for t in u.tensors]
    experts = [t for u in units if u.kind == "expert" for t in u.tensors]
    big = max(tensors, key=lambda t: t.nbytes)
    weights = [t for t in tensors if not t.name.endswith(".scale")]
    vals = max(weights, key=lambda t: math.prod(t.shape) * (2 if t.dtype == "I8" else 1))
    n_vals = math.prod(vals.shape) * (2 if vals.dtype == "I8" else 1)
    n_shards = len(shard_units(units, spec.shard_size))
    files = tuple(Path(f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors") for i in range(n_shards))
    return SyntheticInfo(Path("."), spec, files, sum(t.nbytes for t in tensors), sum(t.nbytes for t in experts),
                         sum(math.prod(t.shape) * 2 for t in experts if t.dtype == "I8"),
                         (big.name, big.nbytes), (vals.name, n_vals))


def make_synthetic(out: "str | os.PathLike", spec: SyntheticSpec, *, workers: Optional[int] = None,
                   overwrite: bool = False) -> SyntheticInfo:
    """Write the checkpoint ``spec`` describes into folder ``out`` (created; an
    existing non-empty folder is refused unless ``overwrite``). Byte-identical
    for the same spec whatever ``workers``."""
    t0 = time.perf_counter()
    spec.validate()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out}: folder is not empty (pass overwrite=True / --force)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))
    shards = shard_units(plan_units(spec), spec.shard_size)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, units in zip(names, shards):
        head, spans = _header(units)
        want = [t for u in units for t in u.tensors]
        tmp = out / (name + ".partial")
        with open(tmp, "wb") as f:
            f.write(head)
            i = 0
            # a large tensor's row blocks on at most 8 threads: each block in the making holds about 1.5 GB
            for arrays in ordered(lambda u: make_unit(spec, u, min(workers, 8)), units, workers):
                for a in arrays:
                    t = want[i]
                    made = 0
                    for block in (a if isinstance(a, RowBlocks) else (a,)):
                        b = np.ascontiguousarray(block)
                        f.write(memoryview(b).cast("B"))
                        made += b.nbytes
                    if made != spans[i][1] - spans[i][0]:  # a bug here, not a user error
                        raise RuntimeError(f"{t.name}: made {made} bytes, planned {t.nbytes}")
                    weight_map[t.name] = name
                    i += 1
        os.replace(tmp, out / name)
        total += spans[-1][1] if spans else 0
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    tiny._write_json(out / INDEX, index)
    tiny._write_json(out / "config.json", spec.native_config())
    info = describe(spec)
    return replace(info, path=out, files=tuple(out / n for n in names), seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------
# CLI


def shard_size(text: str) -> int:
    """--shard-size: a positive size as ds4quant reads sizes (256M, 1.5G), for argparse."""
    from ds4quant.errors import Ds4quantError
    from ds4quant.sizes import parse_size

    try:
        return parse_size(text, "--shard-size", positive=True)
    except Ds4quantError as e:
        raise argparse.ArgumentTypeError(e.one_line()) from None


def add_spec_args(ap: argparse.ArgumentParser, default_preset: str) -> None:
    """The generator options (shared with benchmarks/convert.py)."""
    ap.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                    help=f"size preset (default {default_preset}); the options below override it")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--hidden", type=int, help="multiple of 128")
    ap.add_argument("--moe-inter", type=int, help="expert intermediate size, multiple of 128")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--shard-size", type=shard_size, help="max shard size, e.g. 256M")
    ap.add_argument("--ratio-offset", type=int, default=0,
                    help="ds4-flash presets: take DS4 Flash's attention types from this layer on (default 0)")


def spec_from_args(args) -> SyntheticSpec:
    return preset(args.preset, getattr(args, "ratio_offset", 0), layers=args.layers, experts=args.experts, hidden=args.hidden,
                  moe_inter=args.moe_inter, vocab=args.vocab, seed=args.seed, shard_size=args.shard_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="output folder (default: a new folder under the temp dir)")
    add_spec_args(ap, "medium")
    ap.add_argument("--workers", type=int, help="generator threads (bytes do not depend on it)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ds4-synthetic-"))
    try:
        info = make_synthetic(out, spec, workers=args.workers, overwrite=args.force)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
    else:
        mb = info.total_bytes / 1e6
        print(f"wrote {out}: {len(info.files)} shard(s), {mb:,.1f} MB ({info.expert_bytes / 1e6:,.1f} MB FP4 experts, "
              f"{info.expert_weights / 1e9:.3f} G expert weights) in {info.seconds:.1f} s "
              f"({mb / max(info.seconds, 1e-9):,.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
