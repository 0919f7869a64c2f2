"""benchmarks/adaptive.py's output: the PNG of the curve and the printed tables."""

from __future__ import annotations

from pathlib import Path

# Uniform points Lucebox cannot load (it takes rocmfp3_mix on down experts only).
NOT_LUCEBOX = {"rocmfp3_mix"}


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    style = {"tensor": ("C0", "o", "-"), "expert": ("C3", "s", "--")}
    for g, pts in r["curve"].items():
        c, m, ls = style.get(g, ("C2", "^", ":"))
        ax.plot([p["bpw"] for p in pts], [p["predicted_db"] for p in pts], color=c, marker=m, ls=ls,
                label=f"adaptive, granularity {g}")
    for label, u in sorted(r["uniform"].items(), key=lambda kv: kv[1]["bpw"]):
        if u["weighted_sqnr_db"] is None:
            continue
        ax.scatter([u["bpw"]], [u["weighted_sqnr_db"]], color="k", marker="x", zorder=3)
        ax.annotate(label + ("*" if label in NOT_LUCEBOX else ""), (u["bpw"], u["weighted_sqnr_db"]),
                    textcoords="offset points", xytext=(5, -11), fontsize=8)
    ax.axvline(r["strix_bpw"], color="0.7", lw=0.8, ls=":")
    ax.set_xlabel("routed-expert bits per weight (tensor payload)")
    ax.set_ylabel("importance- and routing-weighted SQNR (dB)")
    src = r["generated"]["preset"] + " synthetic" if r["generated"] else Path(r["source"]["path"]).name
    ax.set_title(f"ds4quant adaptive vs uniform recipes: {src} "
                 f"({r['source']['expert_weights'] / 1e6:.1f} M expert weights)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.text(0.01, 0.99, "x: uniform recipes (priced from the same measurements); *: not loadable by Lucebox",
            transform=ax.transAxes, fontsize=7, color="0.35", va="top")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    # no Software/date chunks: the same numbers give the same file
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)


def print_cost(r: dict) -> None:
    c = r["cost"]
    print(f"\nmeasure stage per GB of FP4 source ({c['fp4_source_gb'] * 1e3:.2f} MB; warm-up excluded; "
          f"wall and CPU seconds; the 1-min load average beside each, the machine may be shared):")
    sp = c.get("speedup", {})
    rows = [("path", "threads", "jobs", "s", "s/GB", "CPU s/GB", "x anchor", "load", "dB @2.7", "dB @2.8333")]
    for label, v in c["paths"].items():
        rows.append((label, v["threads"], v.get("jobs", "-"), _f(v["measure_s"]), _f(v["s_per_gb"], ",.0f"),
                     _f(v["cpu_s_per_gb"], ",.0f"), _f(sp.get(label), ".1f"), f"{v['load_average'][0]:.1f}",
                     _f(v["db_2.7"], ".4f"), _f(v["db_2.8333"], ".4f")))
    print(_table(rows))
    if "speedup_1_thread" in c:
        print(f"speedup at 1 thread: {c['speedup_1_thread']:.1f}x wall, {c['cpu_speedup_1_thread']:.1f}x CPU")
    print(f"plans, errors and GGUF bytes identical across the default-effort paths: {c['same_plans_and_bytes']}")
    for label, v in c["paths"].items():
        if "same_plans_as_default" in v:
            print(f"  {label}: same plans as the default effort: {v['same_plans_as_default']}")
    d = r.get("ds4_shape")
    if d:
        print(f"\nmeasure_matrix at DeepSeek-V4 Flash shapes ({d['experts']} synthetic experts, gate/up "
              f"{d['shape_gate_up']}, down {d['shape_down']}, {d['fp4_gb'] * 1e3:.1f} MB FP4):")
        rows = [("path", "jobs", "s", "s/GB", "CPU s/GB", "DS4 Flash hours (138 GB)")]
        for label, v in d["paths"].items():
            rows.append((label, v["jobs"], _f(v["s"]), _f(v["s_per_gb"], ",.0f"), _f(v["cpu_s_per_gb"], ",.0f"),
                         _f(v["s_per_gb"] * 138 / 3600, ",.1f")))
        print(_table(rows))
        print(f"  identical figures and books across paths: {d['identical']}")


def print_report(r: dict) -> None:
    if "curve" not in r:
        s = r["source"]
        print(f"source   {s['path']}: FP4 routed experts {s['expert_bytes'] / 1e6:,.2f} MB "
              f"({s['expert_weights'] / 1e6:,.2f} M weights)")
        print_cost(r)
        return
    s = r["source"]
    g = r["generated"]
    how = f"synthetic {g['preset']} preset, seed {g['spec']['seed']}" if g else "given with --source"
    print(f"source   {s['path']} ({how})")
    print(f"         {s['bytes'] / 1e6:,.1f} MB; FP4 routed experts {s['expert_bytes'] / 1e6:,.2f} MB "
          f"({s['expert_weights'] / 1e6:,.2f} M weights)")
    imp = r["importance"]
    print(f"importance imatrix {imp['imatrix']}, routing {imp['routing']}"
          + (" (synthesized: heavy-tailed columns, Zipf routing, 1 unreached expert/layer)" if imp.get("synthetic")
             else ""))
    t = r["timing"]
    c, w = t["cold"], t["warm"]
    print(f"\nstages (cold cache, threads {r['threads']}; warm-up {r['warmup_seconds']:.1f} s excluded):")
    print(_table([
        ("stage", "cold s", "cold s/GB", "warm s (2.7)", "warm s/GB"),
        ("measure", _f(c["measure"]), _f(t["s_per_gb"]["measure"], ",.0f"), _f(w["measure"]),
         _f(t["warm_s_per_gb"]["measure"], ",.1f")),
        ("allocate", _f(c["allocate"]), _f(t["s_per_gb"]["allocate"], ",.1f"), _f(w["allocate"]), ""),
        ("encode", _f(c["encode"]), _f(t["s_per_gb"]["encode"], ",.0f"), _f(w["encode"]), ""),
        ("measure+allocate+encode", _f(c["measure"] + c["allocate"] + c["encode"]),
         _f(t["s_per_gb"]["measure+allocate+encode"], ",.0f"), _f(w["measure"] + w["allocate"] + w["encode"]),
         _f(t["warm_s_per_gb"]["measure+allocate+encode"], ",.0f")),
        ("whole convert", _f(c["total"]), _f(t["s_per_gb"]["total"], ",.0f"), _f(w["total"]), ""),
    ]))
    print(f"cold measure: {t['cold_cpu']['measure']:.1f} CPU s ({t['cpu_s_per_gb_measure']:,.0f} CPU s/GB); "
          f"1-min load average {t['cold_load_average'][0]:.2f} before, {t['cold_load_average'][1]:.2f} after "
          f"(the machine is shared: wall times grow with others' load)")
    print(f"measures reused: cold {t['cold_measures_reused']}, warm {t['warm_measures_reused']} (expert matrices)")
    print_cost(r)
    print(f"  cold: {t['cold_command']}\n  warm: {t['warm_command']}")

    print("\nerror vs bpw (dB = importance- and routing-weighted SQNR; 'imatrix' columns: no routing "
          "weights, reached experts only, predicted from measures vs the written artifact):")
    rows = [("kind", "target", "bpw", "dB", "slack %", "imatrix pred", "imatrix actual", "shares")]
    for gname, pts in r["curve"].items():
        for p in pts:
            x = p["cross_check"]
            rows.append((f"adaptive/{gname}", f"{p['target_bpw']:.4f}", f"{p['bpw']:.4f}", _f(p["predicted_db"]),
                         f"{100 * p['slack']:.3f}", _f(x["imatrix_predicted_db"], ".4f"),
                         _f(x["imatrix_actual_db"], ".4f"),
                         " ".join(f"{q}:{v:.2f}" for q, v in p["qtype_share"].items())))
    for label, u in sorted(r["uniform"].items(), key=lambda kv: kv[1]["bpw"]):
        real = r["uniform_converted"].get(label)
        rows.append((f"uniform {label}" + ("*" if label in NOT_LUCEBOX else ""), "", f"{u['bpw']:.4f}",
                     _f(u["weighted_sqnr_db"]), "",
                     _f(u["imatrix_sqnr_db"], ".4f"), _f(real["imatrix_actual_db"], ".4f") if real else "(cache)", ""))
    print(_table(rows))
    print("(cache): priced from the measurement cache only (MIX with the optimized books); "
          "*: not loadable by Lucebox (rocmfp3_mix on gate/up), so outside the tensor-granularity choices")

    print("\nallocation checks:")
    for gname, ch in r["checks"].items():
        a, b = ch["at_strix"], ch["at_2.7"]
        print(f"  [{gname}] target {r['strix_bpw']:.6f} (rocmfp2-strix): adaptive {_f(a['adaptive_db'], '.3f')} dB "
              f"at {a['bpw_experts']:.4f} bpw ({a['adaptive_bytes']:,} B) vs rocmfp2-strix "
              f"{_f(a['strix_db'], '.3f')} dB at {_f(a['strix_bpw'], '.4f')} bpw ({a['strix_bytes']:,} B): "
              f"{_f(a['gain_db'], '+.3f')} dB")
        print(f"  [{gname}] target 2.7: {b['bpw_experts']:.6f} bpw, {100 * b['under_fraction']:.3f}% under 2.7 "
              f"(allocator slack {100 * b['slack']:.3f}% of {b['budget_bytes']:,} B; {b['n_items']} items): "
              f"{'within 0.5% under' if b['within_0.5%_under'] else 'NOT within 0.5% under'}")
    f = r.get("fitter")
    if f:
        print("\nMIX codebook fitter, reference vs optimized:")
        for q, v in (f["same_books_all_experts"] or {}).items():
            print(f"  {q}: all {v['experts']} reached experts, same encoder: reference "
                  f"{v['reference_weighted_error']:.6g}, optimized {v['optimized_weighted_error']:.6g} "
                  f"weighted error ({_f(v['gain_db'], '+.3f')} dB)")
        ip = f["in_plan"]
        if ip:
            print(f"  in the plan at B ({ip['experts']} MIX experts): reference {ip['reference_weighted_error']:.6g}, "
                  f"optimized {ip['optimized_weighted_error']:.6g} ({_f(ip['gain_db'], '+.3f')} dB)")
        rr, oo = f["reference_run"], f["optimized_run"]
        print(f"  whole plan at B: --fitter reference {_f(rr['predicted_db'], '.3f')} dB (measure "
              f"{rr['measure_seconds']:.1f} s), --fitter optimized {_f(oo['predicted_db'], '.3f')} dB (measure "
              f"{oo['measure_seconds']:.1f} s)\n  {rr['command']}")
    print("\ndeterminism (sha256 of the GGUF at B):")
    for gname, d in r["determinism"].items():
        if not isinstance(d, dict):
            continue
        print(f"  [{gname}] {'identical' if d['identical'] else 'DIFFERENT'}: "
              + ", ".join(f"{k} {v[:16]}" for k, v in d["sha256"].items()))
    if "cold_t1_cache_identical" in r["determinism"]:
        print(f"  cold 1-thread measurement cache byte-identical to the 2-thread one: "
              f"{r['determinism']['cold_t1_cache_identical']}")
    print(f"\nbenchmark {r['seconds']:.0f} s; PNG {r['png']}; JSON {Path(r['out']) / 'adaptive-bench.json'}")
