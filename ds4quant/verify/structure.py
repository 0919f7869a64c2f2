"""Verify stage 1, structure: qtypes and tags, shapes, the DS4 keys, the expert
stacks (from the view), and the runtimes key against the contents."""

from __future__ import annotations

from pathlib import Path

from ds4quant import names
from ds4quant.verify._run import Context


def check_types(ctx: Context) -> None:
    g = ctx.view.gguf
    n = len(g.tensors)
    if g.format_version is None:
        if ctx.view.manifest is not None:
            ctx.fail("types", "the GGUF carries no ds4quant qtype tags; an artifact tags every tensor "
                              "(ggml ids alone are ambiguous: 107 has three codecs)", ctx.first)
            return
        ctx.ok("types", f"{n} tensors; untagged file: qtypes read from ggml type ids"
                        + (f" ({len(g.notes)} note(s): {g.notes[0]})" if g.notes else ""), ctx.first)
        return
    ctx.ok("types", f"{n} tensors, every qtype tag known and matching its ggml type id "
                    f"(ds4quant format version {g.format_version})", ctx.first)


def check_shapes(ctx: Context) -> None:
    from ds4quant.artifact.ds4 import expert_shape
    from ds4quant.artifact.qtypes import row_rule_problem

    v = ctx.view
    H, inter, E, L = v.header.hidden, v.header.expert_ffn, v.header.n_expert, v.header.n_layer
    for name, info in v.tensors.items():
        f = Path(info.path).name
        why = row_rule_problem(info.qtype, info.shape[0])
        if why is not None:
            ctx.fail("shapes", why, f, name)
        sn = names.parse_stack(name)
        layer = names.layer_of(name)
        if L is not None and layer is not None and layer >= L:
            ctx.fail("shapes", f"layer {layer} but {names.KEY_BLOCK_COUNT} = {L}", f, name)
        if sn is None:
            continue
        if sn.compact and sn.qtype != info.qtype:
            ctx.fail("shapes", f"compact stack named for qtype {sn.qtype!r} holds {info.qtype}", f, name)
        if len(info.shape) != 3:
            ctx.fail("shapes", f"an expert stack is [in, out, n_expert], got shape {list(info.shape)}", f, name)
            continue
        if H is not None and inter is not None:
            want = expert_shape(sn.proj, H, inter, 0)[:2]
            if tuple(info.shape[:2]) != want:
                ctx.fail("shapes", f"[in, out] = {list(info.shape[:2])}, but the deepseek4 keys say {list(want)}",
                         f, name)
        if not sn.compact and E is not None and info.shape[2] != E:
            ctx.fail("shapes", f"a full stack holds {info.shape[2]} experts, {names.KEY_EXPERT_COUNT} = {E}", f, name)
    from ds4quant.artifact.ds4 import shape_problems

    for name, detail in shape_problems(v.kv, {n: i.shape for n, i in v.tensors.items()}):
        ctx.fail("shapes", detail, Path(v.tensors[name].path).name, name)
    ctx.passed_if_clean("shapes", f"{len(v.tensors)} tensors: row rules, expert-stack shapes and every tensor's "
                                  "shape against the deepseek4 keys hold", ctx.first)


def check_ds4_keys(ctx: Context) -> None:
    from ds4quant.artifact.ds4 import check_ds4_header

    problems = check_ds4_header(ctx.view.kv)
    for p in problems:
        ctx.fail("ds4_keys", p, ctx.first)
    problems += ctx.fail_problems("ds4_keys")
    if not problems:
        ctx.ok("ds4_keys", f"{names.KEY_ARCH} = {names.ARCH} and every key the DS4 loader requires is a UINT32",
               ctx.first)


def check_experts(ctx: Context) -> None:
    ctx.fail_problems("experts")
    stacks = ctx.view.stacks
    if stacks:
        n_compact = sum(s.compact for s in stacks)
        ctx.passed_if_clean("experts", f"{len(stacks)} expert stacks ({n_compact} compact) cover every expert of "
                                       "every layer exactly once", ctx.first)


def check_runtimes(ctx: Context) -> None:
    """The stored ``ds4quant.runtimes`` must claim no runtime the whole header and tensor list do not
    allow (``artifact.runtimes.decide``); a key that claims fewer passes, with a note."""
    bad = ctx.fail_problems("runtimes")
    v = ctx.view
    if v.stored_runtimes is not None and not bad:
        more = [r for r in v.runtimes if r not in v.stored_runtimes]
        ctx.ok("runtimes", f"{names.KEY_RUNTIMES} = [{', '.join(v.stored_runtimes)}], within what the contents "
                           "allow" + (f" (they also load in {', '.join(more)}, which the key does not claim)"
                                      if more else ""), ctx.first)


def structure(ctx: Context) -> None:
    """Stage: types, shapes, DS4 keys, expert stacks."""
    check_types(ctx)
    check_shapes(ctx)
    check_ds4_keys(ctx)
    check_experts(ctx)
