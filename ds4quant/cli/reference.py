"""``ds4quant reference``: run the reference once and store what fidelity compares against."""

from __future__ import annotations

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, device_option, json_option, protocol_option, size_option
from ds4quant.cli.output import emit_json


@cli.command("reference")
@click.argument("source", type=PATH)
@click.option("--tokens", "tokens_file", default=None, type=PATH,
              help="Evaluation token ids (one sequence per line, or a JSON list of lists).")
@click.option("--text", "text_file", default=None, type=PATH,
              help="Evaluation text (UTF-8; blank-line-separated documents, the source's tokenizer).")
@click.option("--ctx", "ctx_size", type=int, default=None,
              help="Score as llama.cpp's perplexity tool: chunks of this many tokens, the second half of each.")
@protocol_option(help="Also store the reference's exact-copy scores (needs the source's tokenizer.json and task.json).")
@click.option("--copy-sets", "copy_sets", type=int, default=5, show_default=True,
              help="With --protocol exact-copy: seeded identifier sets of 60 trials.")
@click.option("--stream", is_flag=True,
              help="Run the reference layer by layer (DeepSeek-V4-Flash size; no greedy response is stored).")
@device_option(help="With --stream: where each layer runs (cuda[:N]: the layer's weights, the streams and the "
                    "decoded experts on that GPU).")
@size_option("--max-memory", help="With --stream: host budget; a layer that cannot fit is refused up front.")
@click.option("--out", "out", required=True, type=PATH, help="The base file to write (atomically).")
@json_option(help="Print one JSON object {path, tokens, bytes, max_storage_error_nats, seconds, eval}.")
def reference_cmd(source, tokens_file, text_file, ctx_size, protocol, copy_sets, stream, device, max_memory, out,
                  as_json):
    """Run the transformers reference of SOURCE once over the evaluation tokens and
    store, per scored token, its log-probabilities (llama.cpp's uint16 per-token
    quantization), argmax and target, with its greedy response and exact-copy
    scores. `verify --fidelity --reference BASE` and `publish --reference BASE`
    then compare any number of artifacts without running it again.

    \b
    Examples:
      ds4quant reference samples/ds4-copy --protocol exact-copy --out out/copy.base
      ds4quant verify out/copy-strix --source samples/ds4-copy --fidelity --protocol exact-copy \\
          --reference out/copy.base
      ds4quant reference ckpt/ --text my.txt --ctx 512 --stream --device cuda --out ckpt.base
    """
    from ds4quant.verify.reference_side import make_reference_base

    s = make_reference_base(source, out, tokens=tokens_file, text=text_file, ctx_size=ctx_size, protocol=protocol,
                            copy_sets=copy_sets, stream=stream, device=device, max_memory=max_memory)
    if as_json:
        emit_json(s)
    else:
        click.echo(f"reference base {s['path']}: {s['tokens']} tokens ({s['eval']}), {s['bytes']:,} bytes, "
                   f"log-probs stored within {s['max_storage_error_nats']:.2g} nats, {s['seconds']:.1f} s")
