"""Ahead-of-time compile check: every Triton kernel the runtime and the measure
stage launch compiles for the AMD and NVIDIA targets users run, on this
GPU-less machine, and the kernels that promise the CPU's bits keep the
no-fusion / no-approximation rules in their machine code.

* the catalogue (``runtime/kernels/catalog.py``) is complete: every
  ``@triton.jit`` function of the package is a catalogued kernel or is called
  (transitively) by one, so a new kernel cannot skip the check;
* every catalogued kernel is launched by its scenarios (the specialisations
  are captured from the real launch wrappers);
* every run: a representative subset (one specialisation per kernel and
  scenario) compiles for three targets — hip:gfx1151 (wave32 RDNA), hip:gfx942
  (wave64 CDNA), cuda:86 — and keeps its rules (30 compiles, 10-35 s on two shared
  cores); the measure stage's three slowest kernels to compile (the MIX
  searches and numpy's pairwise leaves, 5-30 s a compile) are left to the full
  matrix;
* ``DS4QUANT_AOT_FULL=1``: the full matrix, every captured specialisation
  (~160) for all seven targets (about half an hour on two cores;
  ``benchmarks/gpu_run.sh`` compiles the subset for all seven targets on the
  GPU host's cores, and the full matrix with ``AOT_FULL=1``);
* the rules catch a planted ``a * b + c`` that the compiler fuses, ``tl.exp``
  and Triton's approximate float32 ``/`` on NVIDIA, and accept correctly
  rounded division and square root on every target.

Compiling needs Triton without its interpreter, so the compiles run in a
subprocess; each run compiles into a fresh cache directory (nothing reused
from an earlier run) once, for all tests of the module.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("runtime", "formats")
#: kernels whose compiles take 5-30 s each (loops unrolled over (BLOCK, 128) tiles, 128-value
#: leaves): only the full matrix compiles them
SLOW_KERNELS = ("_books_kernel", "_fixed_kernel", "_leaves_kernel")
#: the always-on subset's targets: one wave32 RDNA, one wave64 CDNA, one NVIDIA
SUBSET_TARGETS = ("hip:gfx1151", "hip:gfx942", "cuda:86")


def _triton_backends():
    pytest.importorskip("triton")
    import triton

    base = Path(triton.__file__).parent / "backends"
    if not (base / "nvidia" / "bin" / "ptxas").exists() or not (base / "amd").exists():
        pytest.skip("this triton wheel lacks the bundled ptxas or the AMD backend")


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _compile(tmp: Path, *args: str, name: str = "out") -> dict:
    out = tmp / f"{name}.json"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "aot" / "compile_all.py"), *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=3000, env=_env(tmp), cwd=ROOT)
    if not out.exists():
        raise AssertionError(f"compile_all.py wrote nothing (rc {p.returncode}): {p.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    doc["stderr"] = p.stderr
    return doc


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The always-on subset: one specialisation per (kernel, scenario) but the slow ones,
    for the subset's targets, compiled once per run."""
    _triton_backends()
    tmp = tmp_path_factory.mktemp("aot")
    return _compile(tmp, "--first", "--exclude", ",".join(SLOW_KERNELS), "--targets", ",".join(SUBSET_TARGETS))


# -- the catalogue is complete ------------------------------------------------

def _is_jit(dec) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(target, ast.Attribute) and target.attr == "jit") or (
        isinstance(target, ast.Name) and target.id == "jit")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return "ds4quant." + ".".join(rel.parts)


def jit_functions():
    """{(module, name): (called names, imported name -> module)} for every @triton.jit function."""
    found = {}
    for d in PACKAGE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            imports = {}
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module:
                    for a in node.names:
                        imports[a.asname or a.name] = node.module
            mod = _module_name(path)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                    calls = {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call)
                             and isinstance(n.func, ast.Name)}
                    found[(mod, node.name)] = (calls, imports)
    return found


def stray_functions(funcs, entries) -> list:
    """The jit functions neither in ``entries`` nor reached from one through calls."""
    reached = set()
    todo = list(entries)
    while todo:
        key = todo.pop()
        if key in reached or key not in funcs:
            continue
        reached.add(key)
        calls, imports = funcs[key]
        for name in calls:
            todo.append((imports.get(name, key[0]), name))
    return sorted(f"{m}.{n}" for m, n in set(funcs) - reached)


def test_every_jit_function_is_a_catalogued_kernel_or_called_by_one():
    from ds4quant.runtime.kernels import catalog

    funcs = jit_functions()
    entries = {(e.module, e.kernel) for e in catalog.CATALOG}
    missing = entries - set(funcs)
    assert not missing, f"catalogued kernels that do not exist: {sorted(missing)}"
    stray = stray_functions(funcs, entries)
    assert not stray, ("@triton.jit functions neither catalogued (runtime/kernels/catalog.py CATALOG) nor "
                       f"called by a catalogued kernel: {stray}")
    assert len(funcs) >= 30  # the walk really parsed the kernel modules


def test_the_completeness_check_sees_a_new_kernel(tmp_path, monkeypatch):
    """A planted module with an uncatalogued kernel (calling a catalogued kernel's helper) is stray."""
    from ds4quant.runtime.kernels import catalog

    real = jit_functions()
    pkg = tmp_path / "runtime" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "planted.py").write_text("import triton\nfrom ds4quant.runtime.kernels.moe_triton import _tile\n\n"
                                    "@triton.jit\ndef _new_kernel(x):\n    _tile(x)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    planted = jit_functions()
    assert set(planted) == {("ds4quant.runtime.kernels.planted", "_new_kernel")}
    entries = {(e.module, e.kernel) for e in catalog.CATALOG}
    assert stray_functions({**real, **planted}, entries) == ["ds4quant.runtime.kernels.planted._new_kernel"]
    assert stray_functions({**real, **planted}, entries | set(planted)) == []


# -- compiles -------------------------------------------------------------------

def test_every_catalogued_kernel_is_launched_by_its_scenarios(first):
    from ds4quant.runtime.kernels import catalog

    got = {(c["module"], c["kernel"]) for c in first["captured"]}
    assert {(e.module, e.kernel) for e in catalog.CATALOG if e.kernel not in SLOW_KERNELS} <= got
    assert {e.kernel for e in catalog.CATALOG} >= set(SLOW_KERNELS)


def test_representative_subset_compiles_for_every_target(first):
    from ds4quant.runtime.kernels import catalog

    res = first["results"]
    bad = [f"{r['target']} {r['label']}: {r['error'][-400:]}" for r in res if not r["ok"]]
    assert not bad, "\n".join(bad)
    assert set(SUBSET_TARGETS) <= {catalog.target_name(t) for t in catalog.TARGETS}
    kernels = {e.kernel for e in catalog.CATALOG} - set(SLOW_KERNELS)
    for kernel in kernels:
        assert {r["target"] for r in res if r["kernel"] == kernel} == set(SUBSET_TARGETS), kernel
    for r in res:
        assert r["binary"] == ("cubin" if r["target"].startswith("cuda") else "hsaco"), r
        if r["kernel"] == "_prefill_kernel":  # tl.dot on matrix units: mma.sync / WMMA / MFMA
            assert r["mma"] > 0, r
    # the subset's cost, for the record (a run on two shared cores: well under a minute)
    print(f"\naot subset: {len(res)} compiles in {first['seconds']:.1f} s")


def test_kernels_promising_the_cpus_bits_keep_the_rules(first):
    bad = [f"{r['target']} {r['label']}: {r['findings'][:3]}" for r in first["results"] if r["findings"]]
    assert not bad, "\n".join(bad)
    from ds4quant.runtime.kernels import catalog

    ruled = {e.kernel for e in catalog.CATALOG if e.rules.no_fma or e.rules.no_approx}
    assert {"_quant_kernel", "_swiglu_quant_kernel", "_search_kernel", "_books_kernel", "_row_sums_kernel",
            "_gemv_exact_kernel", "_planes_exact_kernel"} <= ruled
    assert ruled - set(SLOW_KERNELS) <= {r["kernel"] for r in first["results"]}


@pytest.mark.slow
def test_full_matrix_compiles_for_every_target(tmp_path):
    """Every captured specialisation for every target (opt-in: ``DS4QUANT_AOT_FULL=1``)."""
    if os.environ.get("DS4QUANT_AOT_FULL") != "1":
        pytest.skip("the full matrix takes about half an hour on two cores: set DS4QUANT_AOT_FULL=1")
    _triton_backends()
    doc = _compile(tmp_path, "--jobs", str(max(1, os.cpu_count() or 1)))
    bad = [f"{r['target']} {r['label']}: {r['error'][-300:] or r['findings'][:2]}" for r in doc["results"]
           if not r["ok"] or r["findings"]]
    assert not bad, "\n".join(bad)
    print(f"\naot full matrix: {len(doc['results'])} compiles in {doc['seconds']:.1f} s")


# -- the rules catch what they must ------------------------------------------

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    _triton_backends()
    tmp = tmp_path_factory.mktemp("planted")
    p = subprocess.run([sys.executable, "-m", "tests.aot._planted", "cuda:86", "cuda:90", "hip:gfx1151",
                        "hip:gfx1100", "hip:gfx942"], capture_output=True, text=True, timeout=600, env=_env(tmp),
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


TARGETS_PLANTED = ("cuda:86", "cuda:90", "hip:gfx1151", "hip:gfx1100", "hip:gfx942")


@pytest.mark.parametrize("target", TARGETS_PLANTED)
def test_a_fused_multiply_add_fails_the_rules(planted, target):
    assert planted[f"planted_fma|True|{target}"] == ["fma"]
    assert planted[f"planted_fma64|True|{target}"] == ["fma"]
    assert planted[f"planted_fma|False|{target}"] == []  # enable_fp_fusion=False: two roundings
    assert planted[f"planted_fma64|False|{target}"] == []


@pytest.mark.parametrize("target", TARGETS_PLANTED)
def test_approximations_fail_and_ieee_expansions_pass(planted, target):
    assert "approx" in planted[f"planted_exp|False|{target}"]
    # Triton's float32 "/" is div.full (approximate) on NVIDIA, the IEEE division on AMD
    assert planted[f"planted_div|False|{target}"] == (["approx"] if target.startswith("cuda") else [])
    assert planted[f"ieee_ops|False|{target}"] == []  # div_rn, sqrt_rn, float64 "/", integer %


def test_rules_on_hand_written_code():
    from ds4quant.runtime.kernels import asm_rules as R

    gcn = "\n".join([
        "\tv_mad_u64_u32 v[2:3], null, s4, v1, v[2:3]",  # address arithmetic
        "\tv_mul_f32_e32 v1, v2, v3",
        "\tv_add_f32_e32 v1, v1, v4",
        "\tv_dual_mul_f32 v5, v6, v7 :: v_dual_fmac_f32 v8, v9, v10",  # a contraction in a VOPD pair
    ])
    got = R.amdgcn_findings(gcn, no_fma=True, no_approx=True)
    assert [f.kind for f in got] == ["fma"] and "v_dual_fmac_f32" in got[0].line
    div = "\n".join([
        "\tv_div_scale_f32 v4, null, v2, v2, v1",
        "\tv_rcp_f32_e32 v6, v4",
        "\tv_fma_f32 v9, -v4, v6, 1.0",
        "\tv_fmac_f32_e32 v6, v9, v6",
        "\tv_div_fmas_f32 v4, v4, v6, v12",
        "\tv_div_fixup_f32 v4, v4, v2, v1",
        "\tv_fmac_f32_e32 v4, v13, v14",  # the quotient v4 is a plain value again: this one is a contraction
    ])
    got = R.amdgcn_findings(div, no_fma=True, no_approx=True)
    assert [f.kind for f in got] == ["fma"] and "v13" in got[0].line
    approx = "\tv_rcp_f32_e32 v6, v4\n\tv_mul_f32_e32 v1, v2, v6\n\tv_mov_b32 v6, 0"
    assert [f.kind for f in R.amdgcn_findings(approx, no_fma=True, no_approx=True)] == ["approx"]
    ptx = "\tmul.rn.f32 %f3, %f1, %f2;\n\tadd.f32 %f4, %f3, %f1;\n\tmad.lo.s32 %r1, %r2, %r3, %r4;\n" \
          "\tfma.rn.f64 %fd1, %fd2, %fd3, %fd4;\n\tdiv.rn.f64 %fd5, %fd1, %fd2;\n\tex2.approx.f32 %f5, %f4;"
    kinds = [f.kind for f in R.ptx_findings(ptx, no_fma=True, no_approx=True)]
    assert sorted(kinds) == ["approx", "fma", "fma"]
    assert R.ptx_findings(ptx, no_fma=False, no_approx=False) == []
