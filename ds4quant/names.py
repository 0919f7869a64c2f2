"""Every tensor-name rule and every key name the project writes or reads.

A leaf (imports nothing of ours but ``errors``): the pipeline, the artifact
view, verify and the runtime take names and keys from here, so a rule is
written once. Routed-expert stacks (docs/formats.md#ds4-gguf)::

    blk.L.ffn_{gate,up,down}_exps.weight            full stack, experts 0..E-1
    blk.L.ffn_{gate,up,down}_exps.<qtype>.weight    compact stack (expert granularity),
                                                    global ids in KEY_EXPERT_IDS + name

Example::

    stack_name(3, Proj.DOWN)                  # "blk.3.ffn_down_exps.weight"
    stack_name(3, "down", "rocmfp3_mix")      # "blk.3.ffn_down_exps.rocmfp3_mix.weight"
    parse_stack("blk.3.ffn_down_exps.rocmfp3_mix.weight")  # StackName(3, Proj.DOWN, "rocmfp3_mix")
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple, Optional

from ds4quant.errors import BadInputError


class Proj(str, Enum):
    """The three matrices of a routed expert (official w1 / w3 / w2)."""

    GATE = "gate"
    UP = "up"
    DOWN = "down"


PROJS: tuple[Proj, ...] = (Proj.GATE, Proj.UP, Proj.DOWN)

# ---------------------------------------------------------------------------
# GGUF keys: the architecture

ARCH = "deepseek4"
KEY_ARCH = "general.architecture"
KEY_BLOCK_COUNT = f"{ARCH}.block_count"
KEY_EMBEDDING_LENGTH = f"{ARCH}.embedding_length"
KEY_VOCAB_SIZE = f"{ARCH}.vocab_size"
KEY_EXPERT_COUNT = f"{ARCH}.expert_count"
KEY_EXPERT_USED_COUNT = f"{ARCH}.expert_used_count"
KEY_EXPERT_FFN_LENGTH = f"{ARCH}.expert_feed_forward_length"
KEY_HASH_LAYER_COUNT = f"{ARCH}.hash_layer_count"
KEY_EXPERT_WEIGHTS_SCALE = f"{ARCH}.expert_weights_scale"
KEY_SWIGLU_CLAMP = f"{ARCH}.swiglu_clamp_exp"
KEY_EXPERT_WEIGHTS_NORM = f"{ARCH}.expert_weights_norm"
KEY_EXPERT_GATING_FUNC = f"{ARCH}.expert_gating_func"
KEY_CONTEXT_LENGTH = f"{ARCH}.context_length"
KEY_COMPRESS_RATIOS = f"{ARCH}.attention.compress_ratios"
KEY_ROPE_SCALING_TYPE = f"{ARCH}.rope.scaling.type"
KEY_ROPE_SCALING_FACTOR = f"{ARCH}.rope.scaling.factor"
KEY_ROPE_SCALING_ORIG_CTX = f"{ARCH}.rope.scaling.original_context_length"
KEY_ROPE_YARN_BETA_FAST = f"{ARCH}.rope.scaling.yarn_beta_fast"
KEY_ROPE_YARN_BETA_SLOW = f"{ARCH}.rope.scaling.yarn_beta_slow"
KEY_ROPE_YARN_EXT_FACTOR = f"{ARCH}.rope.scaling.yarn_ext_factor"
KEY_ROPE_YARN_ATTN_FACTOR = f"{ARCH}.rope.scaling.yarn_attn_factor"

# deepseek4.expert_gating_func values (llama.cpp's expert gating enum)
GATING_FUNC = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}

# The one DS4 header table: every UINT32 ``deepseek4.*`` key convert writes, and
# whether the Lucebox loader requires it (LOADER ``kRequiredU32Keys``,
# docs/formats.md#ds4-gguf). ``attention.value_length`` is written (newer loaders
# read it) but that loader's list does not require it.
DS4_U32_KEYS: tuple[tuple[str, bool], ...] = tuple((f"{ARCH}.{k}", req) for k, req in (
    ("block_count", True),
    ("embedding_length", True),
    ("vocab_size", True),
    ("attention.head_count", True),
    ("attention.head_count_kv", True),
    ("attention.key_length", True),
    ("attention.q_lora_rank", True),
    ("attention.output_lora_rank", True),
    ("attention.output_group_count", True),
    ("attention.sliding_window", True),
    ("attention.indexer.head_count", True),
    ("attention.indexer.key_length", True),
    ("attention.indexer.top_k", True),
    ("rope.dimension_count", True),
    ("expert_count", True),
    ("expert_used_count", True),
    ("expert_shared_count", True),
    ("expert_feed_forward_length", True),
    ("hash_layer_count", True),
    ("hyper_connection.count", True),
    ("hyper_connection.sinkhorn_iterations", True),
    ("attention.value_length", False),
))
LOADER_U32_KEYS: tuple[str, ...] = tuple(k for k, req in DS4_U32_KEYS if req)
WRITTEN_U32_KEYS: tuple[str, ...] = tuple(k for k, _ in DS4_U32_KEYS)

# Lucebox codebook blobs (embedded copies of the loose sidecar files)
LUCEBOX_KINDS = ("p4mix", "gumix", "dmix")


def sidecar_key(kind: str) -> str:
    """``deepseek4.<kind>.sidecar`` for kind in p4mix / gumix / dmix."""
    if kind not in LUCEBOX_KINDS:
        raise BadInputError(f"sidecar kind must be one of {', '.join(LUCEBOX_KINDS)}, got {kind!r}")
    return f"{ARCH}.{kind}.sidecar"


def sidecar_suffix(kind: str) -> str:
    """Loose sidecar file suffix after ``NAME.gguf``: ``.gumix.bin`` etc."""
    sidecar_key(kind)
    return f".{kind}.bin"


KEY_GUMIX = sidecar_key("gumix")
KEY_P4MIX = sidecar_key("p4mix")
KEY_DMIX = sidecar_key("dmix")

# ---------------------------------------------------------------------------
# GGUF keys: the tokenizer (llama.cpp's names, written from the source's tokenizer.json)

KEY_TOK_MODEL = "tokenizer.ggml.model"
KEY_TOK_PRE = "tokenizer.ggml.pre"
KEY_TOK_TOKENS = "tokenizer.ggml.tokens"
KEY_TOK_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_TOK_SCORES = "tokenizer.ggml.scores"
KEY_TOK_MERGES = "tokenizer.ggml.merges"
KEY_TOK_BOS = "tokenizer.ggml.bos_token_id"
KEY_TOK_EOS = "tokenizer.ggml.eos_token_id"
KEY_TOK_PAD = "tokenizer.ggml.padding_token_id"
KEY_TOK_UNK = "tokenizer.ggml.unknown_token_id"
KEY_TOK_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_TOK_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_TOK_PREFIX = "tokenizer.ggml."

# ---------------------------------------------------------------------------
# artifact folder files

MANIFEST_NAME = "manifest.json"
SUMS_NAME = "SHA256SUMS"
WORK_DIR_NAME = ".ds4quant-work"  # convert's journal and pieces while a run is unfinished
LOCK_NAME = ".ds4quant.lock"  # convert's exclusive lock on its output folder

# ---------------------------------------------------------------------------
# GGUF keys: ds4quant's own

KEY_FORMAT_VERSION = "ds4quant.format_version"
KEY_QTYPE_VARIANTS = "ds4quant.qtype_variants"
KEY_QTYPE_TAG_PREFIX = "ds4quant.qtype."
KEY_CODEBOOKS = "ds4quant.codebooks"
KEY_EXPERT_IDS_PREFIX = "ds4quant.expert_ids."
KEY_RUNTIMES = "ds4quant.runtimes"
KEY_PLAN = "ds4quant.plan"
KEY_RECIPE = "ds4quant.recipe"
KEY_TOOL_VERSION = "ds4quant.tool_version"
KEY_SOURCE_FINGERPRINT = "ds4quant.source_fingerprint"


def expert_ids_key(tensor: str) -> str:
    """KV holding the global expert ids (local order) of a compact stack."""
    return KEY_EXPERT_IDS_PREFIX + tensor


def qtype_tag_key(tensor: str) -> str:
    """KV holding the explicit qtype variant tag of one tensor."""
    return KEY_QTYPE_TAG_PREFIX + tensor


# ---------------------------------------------------------------------------
# tensor names

_LAYER = re.compile(r"^blk\.(0|[1-9][0-9]*)\.")
_STACK = re.compile(r"^blk\.(?P<layer>0|[1-9][0-9]*)\.ffn_(?P<proj>gate|up|down)_exps"
                    r"(?:\.(?P<qtype>[a-z0-9_]+))?\.weight$")


class Group(str, Enum):
    """The groups verify and the reports sum tensors under (per layer)."""

    GATE_EXPS = "gate_exps"
    UP_EXPS = "up_exps"
    DOWN_EXPS = "down_exps"
    SHEXP = "shexp"
    ATTN = "attn"
    OTHER = "other"


GROUPS: tuple[Group, ...] = tuple(Group)
EXPERT_GROUPS: tuple[Group, ...] = (Group.GATE_EXPS, Group.UP_EXPS, Group.DOWN_EXPS)


def group_of(name: str) -> Group:
    """The group of a GGUF tensor: its stack's projection, shared expert, attention, or other."""
    s = parse_stack(name)
    if s is not None:
        return Group(f"{s.proj.value}_exps")
    if layer_of(name) is None:
        return Group.OTHER
    stem = name.split(".", 2)[2]
    if "_shexp" in stem:
        return Group.SHEXP
    if stem.startswith(("attn_", "indexer")):
        return Group.ATTN
    return Group.OTHER


class StackName(NamedTuple):
    """A parsed routed-expert stack name; ``qtype`` is set for compact stacks."""

    layer: int
    proj: Proj
    qtype: Optional[str]

    @property
    def compact(self) -> bool:
        return self.qtype is not None

    @property
    def base(self) -> str:
        """The full-stack name of the same layer and projection."""
        return stack_name(self.layer, self.proj)


def _check_layer(layer: object) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise BadInputError(f"layer must be an int >= 0, got {layer!r}")
    return layer


def as_proj(proj: "str | Proj") -> Proj:
    """``Proj`` from its value; a clear error for anything else."""
    try:
        return Proj(proj)
    except ValueError:
        raise BadInputError(f"expert projection must be one of gate, up, down, got {proj!r}") from None


def stack_name(layer: int, proj: "str | Proj", qtype: Optional[str] = None) -> str:
    """``blk.L.ffn_P_exps.weight`` (full) or ``blk.L.ffn_P_exps.<qtype>.weight`` (compact)."""
    p = as_proj(proj).value
    _check_layer(layer)
    if qtype is None:
        return f"blk.{layer}.ffn_{p}_exps.weight"
    if not re.fullmatch(r"[a-z0-9_]+", qtype or ""):
        raise BadInputError(f"qtype in a compact stack name must be [a-z0-9_]+, got {qtype!r}")
    return f"blk.{layer}.ffn_{p}_exps.{qtype}.weight"


def parse_stack(name: str) -> Optional[StackName]:
    """The layer, projection and (compact) qtype of a stack name, else None."""
    m = _STACK.match(name)
    if m is None:
        return None
    return StackName(int(m.group("layer")), Proj(m.group("proj")), m.group("qtype"))


def base_name(name: str) -> str:
    """``blk.L.ffn_P_exps.<qtype>.weight`` -> ``blk.L.ffn_P_exps.weight``; other names unchanged."""
    s = parse_stack(name)
    return s.base if s is not None else name


def layer_of(name: str) -> Optional[int]:
    """The block index of a ``blk.L.*`` tensor, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# Non-expert tensors of a MoE block (sources/naming.py maps the official names onto these)
def router_name(layer: int) -> str:
    """Router weight [E, H]."""
    return f"blk.{_check_layer(layer)}.ffn_gate_inp.weight"


def router_bias_name(layer: int) -> str:
    """Router selection bias [E] (score-routed layers)."""
    return f"blk.{_check_layer(layer)}.exp_probs_b.bias"


def tid2eid_name(layer: int) -> str:
    """Hash table token -> expert ids [vocab, k] (hash-routed layers)."""
    return f"blk.{_check_layer(layer)}.ffn_gate_tid2eid.weight"


def shared_name(layer: int, proj: "str | Proj") -> str:
    """Shared expert matrix: gate/up [I, H], down [H, I]."""
    return f"blk.{_check_layer(layer)}.ffn_{as_proj(proj).value}_shexp.weight"
