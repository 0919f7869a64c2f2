"""The shipped ds4-tiny sample: small, described by its README, and reproducible."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import pytest

from tests.sources._util import REPO, SAMPLE


def test_sample_is_small_and_matches_its_readme():
    files = {p.name: p for p in SAMPLE.iterdir()}
    assert sum(p.stat().st_size for p in files.values()) < 20 * 2**20
    readme = files["README.md"].read_text()
    rows = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \| `([0-9a-f]{64})` \|$", readme, re.M)
    assert {r[0] for r in rows} == set(files) - {"README.md"}
    for name, size, digest in rows:
        data = files[name].read_bytes()
        assert len(data) == int(size.replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == digest, name


@pytest.mark.slow
def test_regenerating_the_sample_gives_the_same_bytes():
    pytest.importorskip("accelerate", reason="the script verifies the sample through transformers")
    r = subprocess.run([sys.executable, str(REPO / "samples" / "make_ds4_tiny.py"), "--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical" in r.stdout
