"""`archlab presets` (the lecture's table, from the configs) and `archlab inspect PRESET` (accounting)."""
from __future__ import annotations

import argparse

from archlab.config import ConfigError, ModelConfig
from archlab.models import accounting, presets
from archlab.units import human_bytes, human_count, human_flops

PRESETS_EXAMPLE = """\
examples:
  archlab presets
  archlab presets --filter llama

columns: norm kind, where it sits (pre / post / sandwich = pre+post / post_sublayer), serial or
parallel block, position encoding, MLP activation, attention heads (MHA / GQA / MQA, local:global),
stability tricks, published and analytic parameter counts ('=' marks an exact match).
"""

INSPECT_EXAMPLE = """\
examples:
  archlab inspect llama2-7b --seq-len 4096
  archlab inspect llama3-8b --vs llama2-7b
  archlab inspect mistral-7b --seq-len 32768 --vs mistral-7b --set attention.window=none
      # what the 4,096-token window saves at 32k (at or below 4,096 tokens it saves nothing)
  archlab inspect gemma2-9b --tiny                                           # the test-sized twin
"""


# ---- formatting ----------------------------------------------------------------------------------
def format_table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# ---- describing a config -------------------------------------------------------------------------
def describe(cfg: ModelConfig) -> dict[str, str]:
    """The lecture table's columns for one config."""
    att, pos = cfg.attention, cfg.position
    norm = cfg.norm.kind + ("+bias" if cfg.bias.norm and "layernorm" in cfg.norm.kind else "")
    position = pos.kind
    if pos.kind == "rope" and pos.rotary_fraction < 1:
        position += f" {pos.rotary_fraction:g}"
    if pos.global_kind is not None:
        position = f"{pos.kind} local, {pos.global_kind} global"
    kv = cfg.n_kv_heads
    heads = "MHA" if kv == att.n_heads else "MQA" if kv == 1 else f"GQA {att.n_heads}/{kv}"
    if att.window is not None or att.sparse != "none":
        pattern = att.layer_pattern
        local = (f"window {att.window}" + (f" dilated {att.dilation}" if att.dilation > 1 else "")
                 if att.window is not None else f"{att.sparse} {att.sparse_stride}")
        local += f" +{att.global_tokens} global" if att.global_tokens else ""
        heads += f", {local}" + (f" {pattern}" if pattern else "")
    activation = cfg.mlp.activation
    if cfg.mlp.moe is not None:
        activation += f" MoE {cfg.mlp.moe.top_k}/{cfg.mlp.moe.n_experts}"
    tricks = []
    if cfg.z_loss:
        tricks.append(f"z-loss {cfg.z_loss:g}")
    if att.qk_norm != "none":
        tricks.append(f"qk-norm ({att.qk_norm})")
    if att.logit_softcap or cfg.final_logit_softcap:
        tricks.append(f"softcap {att.logit_softcap or '-'}/{cfg.final_logit_softcap or '-'}")
    if cfg.norm.position == "sandwich":
        tricks.append("pre+post norm")
    if cfg.norm.embedding_norm:
        tricks.append("embedding norm")
    if att.gated:
        tricks.append("gated attn")
    if att.learned_sinks:
        tricks.append("sinks")
    block = "serial"
    if cfg.block.parallel:
        block = f"parallel ({cfg.block.parallel_norms} norm{'s' if cfg.block.parallel_norms > 1 else ''})"
    kind = {"decoder": "decoder", "encoder": "encoder+MLM", "encoder_decoder": "enc-dec"}[cfg.arch]
    return {
        "kind": kind, "norm": norm, "norm position": cfg.norm.position, "block": block, "position": position,
        "activation": activation, "attention": heads, "tricks": ", ".join(tricks) or "-",
    }


# ---- commands ------------------------------------------------------------------------------------
def run_presets(args: argparse.Namespace) -> int:
    header = ["name", "year", "kind", "norm", "norm position", "block", "position", "activation",
              "attention", "tricks", "published", "ours"]
    rows = []
    for name in presets.names():
        if args.filter and args.filter.lower() not in name:
            continue
        info = presets.info(name)
        cfg = info.build()
        d = describe(cfg)
        ours = accounting.param_count(cfg)
        published = "-" if info.published_params is None else human_count(info.published_params)
        if info.exact and info.published_params == ours:
            published = "=" + published
        rows.append([name + ("*" if info.approximation else ""), str(info.year), d["kind"], d["norm"],
                     d["norm position"], d["block"], d["position"], d["activation"], d["attention"],
                     d["tricks"], published, human_count(ours)])
    if not rows:
        print(f"no preset matches {args.filter!r}; known: {', '.join(presets.names())}")
        return 1
    print(format_table(header, rows, right={1, 10, 11}))
    print("\n* approximation of the released model (see `archlab inspect NAME`);"
          " '=' published count reproduced exactly")
    return 0


def _load(name: str, overrides: list[str], tiny: bool) -> ModelConfig:
    cfg = presets.tiny(name) if tiny else presets.get(name)
    parsed = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        parsed[key.strip()] = value
    return cfg.with_overrides(parsed) if parsed else cfg


def inspect_rows(cfg: ModelConfig, seq_len: int, batch: int, dtype: str) -> list[tuple[str, float, str]]:
    """(label, value, kind) rows; kind picks the unit: 'count', 'flops', 'bytes'."""
    breakdown = accounting.param_breakdown(cfg)
    rows = [("params", accounting.param_count(cfg), "count")]
    rows += [(f"  {part}", n, "count") for part, n in breakdown.items()]
    if cfg.mlp.moe is not None:
        rows.append(("active params / token", accounting.active_param_count(cfg), "count"))
    rows += [
        (f"forward FLOPs / token @ {seq_len}", accounting.flops_per_token(cfg, seq_len), "flops"),
        (f"training FLOPs / token @ {seq_len}", accounting.training_flops_per_token(cfg, seq_len), "flops"),
        (f"KV cache / token ({dtype})", accounting.kv_bytes_per_token(cfg, dtype), "bytes"),
        (f"KV cache @ {seq_len} x batch {batch}", accounting.kv_cache_bytes(cfg, seq_len, batch, dtype), "bytes"),
    ]
    train_dtype = dtype if accounting.trains_in(dtype) else "bfloat16"     # int4 weights still train in a float
    if train_dtype != dtype:
        rows.append((f"weights ({dtype})", accounting.param_count(cfg) * accounting.dtype_bytes(dtype), "bytes"))
    memory = accounting.training_memory(cfg, batch, seq_len, train_dtype)
    note = "" if train_dtype == dtype else f", {train_dtype}: {dtype} stores, it does not train"
    rows.append((f"training memory (AdamW, batch {batch}{note})", sum(memory.values()), "bytes"))
    rows += [(f"  {part}", n, "bytes") for part, n in memory.items()]
    return rows


def _fmt(value: float, kind: str) -> str:
    if kind == "bytes":
        return human_bytes(value)
    if kind == "flops":
        return human_flops(value)
    return human_count(value) if value >= 1e4 else f"{int(value)}"


def run_inspect(args: argparse.Namespace) -> int:
    if args.seq_len < 1 or args.batch < 1:
        raise ConfigError(f"--seq-len {args.seq_len} and --batch {args.batch} must be >= 1")
    cfg = _load(args.preset, args.set, args.tiny)
    other = presets.tiny(args.vs) if (args.vs and args.tiny) else presets.get(args.vs) if args.vs else None
    rows = inspect_rows(cfg, args.seq_len, args.batch, args.dtype)
    other_rows = inspect_rows(other, args.seq_len, args.batch, args.dtype) if other else None
    title = cfg.name + (" (with --set)" if args.set else "")
    layers = (f"{cfg.n_layers} encoder + {cfg.stack_depth('cross_decoder')} decoder layers"
              if cfg.arch == "encoder_decoder" else f"{cfg.n_layers} layers")
    print(f"{title}: {layers}, d_model {cfg.d_model}, {cfg.attention.n_heads} heads "
          f"(kv {cfg.n_kv_heads}, head_dim {cfg.head_dim}), d_ff {cfg.d_ff}, vocab {cfg.vocab_size}")
    if not args.tiny:
        note = presets.info(args.preset)
        print(f"source: {note.source}")
        if note.approximation:
            print(f"approximation: {note.approximation}")
    print(", ".join(f"{k}: {v}" for k, v in describe(cfg).items()))
    print()
    if other_rows is None:
        table = [[label, _fmt(value, kind)] for label, value, kind in rows]
        print(format_table(["quantity", title], table, right={1}))
        return 0
    table = []
    other_by_label = {label: value for label, value, _ in other_rows}
    for label, value, kind in rows:
        b = other_by_label.get(label)
        ratio = "-" if not b else f"{value / b:.3g}x"
        table.append([label, _fmt(value, kind), "-" if b is None else _fmt(b, kind), ratio])
    print(format_table(["quantity", title, other.name, "ratio"], table, right={1, 2, 3}))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "presets", help="list the model-family presets (the lecture's architecture table)",
        description="Every preset with its architecture choices and parameter count. "
        "Example: archlab presets --filter gemma",
        epilog=PRESETS_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--filter", default=None, metavar="TEXT", help="only presets whose name contains TEXT")
    p.set_defaults(func=run_presets)

    q = subparsers.add_parser(
        "inspect", help="parameters, FLOPs, KV cache and training memory of a preset",
        description="Analytic accounting of a preset (no model is built). "
        "Example: archlab inspect llama2-7b --seq-len 4096 --vs llama3-8b",
        epilog=INSPECT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("preset", metavar="PRESET", help=f"one of: {', '.join(presets.names())}")
    q.add_argument("--seq-len", type=int, default=None,
                   help="sequence length for FLOPs, KV cache and memory (default: max_seq_len, capped at 4096)")
    q.add_argument("--batch", type=int, default=1, help="batch size for KV cache and memory (default 1)")
    q.add_argument("--dtype", default="bfloat16",
                   help="dtype for weights, activations and KV cache (default bfloat16); int8 / int4 / fp8 size the "
                   "weights and cache, training memory then counts bfloat16")
    q.add_argument("--vs", default=None, metavar="OTHER", help="a second preset: two columns and ratios")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of PRESET (repeatable), e.g. attention.n_kv_heads=1")
    q.add_argument("--tiny", action="store_true", help="inspect the test-sized twin(s) instead")
    q.set_defaults(func=_inspect_entry)


def _inspect_entry(args: argparse.Namespace) -> int:
    if args.seq_len is None:
        base = presets.tiny(args.preset) if args.tiny else presets.get(args.preset)
        args.seq_len = min(base.max_seq_len, 4096)
    return run_inspect(args)
