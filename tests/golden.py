"""Loader for the golden vectors of the independent reference codec.

The vectors ship in tests/data/golden/public (a copy of shared/golden/public).
Set DS4QUANT_GOLDEN_DIRS to a path list (os.pathsep-separated) of split folders,
each holding an index.json, to run the same tests over other splits.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SPLIT = HERE / "data" / "golden" / "public"

# golden "format" -> our qtype name
FORMAT_TO_QTYPE = {
    "fp2": "rocmfp2",
    "fp2_affine": "rocmfp2_affine",
    "fp3": "rocmfp3",
    "fp6": "rocmfp6",
    "fp8": "rocmfp8",
    "fp4": "rocmfp4",
    "fp4fast": "rocmfp4_fast",
    "mix106": "rocmfp2_mix",
    "mix105": "rocmfp3_mix",
}


def split_dirs() -> list[Path]:
    env = os.environ.get("DS4QUANT_GOLDEN_DIRS")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [DEFAULT_SPLIT]


@dataclass(frozen=True)
class Case:
    root: Path
    record: dict

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def kind(self) -> str:
        return self.record["kind"]

    @property
    def qtype(self) -> str:
        return FORMAT_TO_QTYPE.get(self.record["format"], self.record["format"])

    def has(self, name: str) -> bool:
        return name in self.record.get("files", {})

    def array(self, name: str) -> np.ndarray:
        meta = self.record["files"][name]
        raw = (self.root / meta["file"]).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        assert digest == meta["sha256"], f"{self.id}: {name} file does not match its sha256"
        dtype = {"float32": np.float32, "uint8": np.uint8}.get(meta["dtype"], np.uint16)
        return np.frombuffer(raw, dtype=dtype).reshape(meta["shape"]).copy()

    def books(self) -> np.ndarray:
        """bf16 words -> float32 (2, L)."""
        bits = self.array("books").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(2, -1)


def load_cases() -> list[Case]:
    cases = []
    for root in split_dirs():
        index = json.loads((root / "index.json").read_text())
        cases.extend(Case(root, rec) for rec in index["cases"])
    return cases


def describe_mismatch(got: np.ndarray, want: np.ndarray, block_bytes: int) -> str:
    """Name the bad blocks, the worst one, and both blocks in hex."""
    got = np.asarray(got, dtype=np.uint8).reshape(-1, block_bytes)
    want = np.asarray(want, dtype=np.uint8).reshape(-1, block_bytes)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.nonzero(np.any(got != want, axis=1))[0]
    if not len(bad):
        return "identical"
    first = bad[0]
    diff_bits = int(np.unpackbits(got[first] ^ want[first]).sum())
    return (
        f"{len(bad)}/{len(got)} blocks differ; first is block {first} ({diff_bits} bits):\n"
        f"  got  {got[first].tobytes().hex(' ')}\n  want {want[first].tobytes().hex(' ')}"
    )


def describe_float_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    g = np.asarray(got, dtype=np.float32).reshape(-1).view(np.uint32)
    w = np.asarray(want, dtype=np.float32).reshape(-1).view(np.uint32)
    bad = np.nonzero(g != w)[0]
    if not len(bad):
        return "identical"
    i = bad[0]
    return (
        f"{len(bad)}/{len(g)} values differ; first at {i}: got {g[i:i+1].view(np.float32)[0]!r} "
        f"(0x{g[i]:08x}) want {w[i:i+1].view(np.float32)[0]!r} (0x{w[i]:08x})"
    )
