"""`archlab generate`: load a run folder or an HF folder and decode text from a prompt (a decoder-only LM) or
from a source text (an encoder-decoder: --source)."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Iterator

from archlab.runs.model_folder import load_model_and_tokenizer  # noqa: F401 - re-exported: the old import path

EXAMPLE = """example:
  archlab generate runs/demo --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0
  archlab generate runs/demo --prompt "ROMEO:" --max-new-tokens 2000 --compile    # a compiled decode step
  archlab generate path/to/hf_llama --prompt "Once upon a time" --num-beams 4 --no-stream
  archlab generate path/to/hf_t5 --source "translate English to German: Hello." --num-beams 4
  archlab generate runs/demo --prompt "..." --sink-window 252 --max-new-tokens 5000   # StreamingLLM:
      4 sink tokens + 252 recent ones fill a 256-token context; decoding goes on past it
  archlab generate runs/demo --prompt "Repeat: ..." --draft prompt-lookup --draft-tokens auto --compare-plain
  archlab generate runs/big --prompt "..." --draft runs/small --draft-tokens 4     # speculative decoding:
      greedy output equals plain greedy's; the acceptance rate and tokens per target forward go to stderr
"""


def add_sampling_flags(p) -> None:
    """The sampling flags `generate` and `chat` share (each overrides the folder's generation config)."""
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default, unless the folder's generation config samples)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep this much probability mass")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats (CTRL)")
    p.add_argument("--sampling-order", default=None, metavar="ORDER",
                   help="the order of the filters: transformers (default: temperature, top_k, top_p, min_p), notes "
                   "(top_k, top_p, temperature, min_p), or steps comma-separated, e.g. top_k,top_p,temperature")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a run folder or an HF folder",
        description="Decode text from a trained run folder (config.yaml + checkpoints/ + tokenizer/) "
        "or a Hugging Face folder (config.json + *.safetensors + tokenizer.json), streaming tokens "
        "to the terminal as they come. An encoder-decoder (T5) takes --source instead of --prompt: the source "
        "is encoded once (with the tokenizer's special tokens, e.g. T5's trailing </s>) and the target decoded "
        "from the decoder start token. A generation_config.json in the folder is applied as transformers "
        "applies it: eos/pad ids, max_new_tokens (or max_length), beams, length_penalty, early_stopping, "
        "sampling (do_sample), repetition_penalty, no_repeat_ngram_size, bad_words_ids, forced bos/eos, "
        "min lengths; the flags below override it, and fields archlab does not apply are named in a warning.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="run folder or HF model folder")
    p.add_argument("--prompt", default=None, help="prompt text (a decoder-only model)")
    p.add_argument("--source", default=None, help="source text to encode (an encoder-decoder, e.g. T5)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate (default: the folder's generation config, else 100)")
    add_sampling_flags(p)
    p.add_argument("--no-repeat-ngram-size", type=int, default=None, help="never repeat an n-gram of this size")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--num-beams", type=int, default=None, help="beam search when > 1 (not streamed)")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="beam score = sum(log p) / generated_length**penalty (default 1)")
    p.add_argument("--early-stopping", choices=["true", "false", "never"], default=None,
                   help="beam search: stop a row when it has num-beams finished hypotheses (true), when none can "
                   "beat them at the current length (false, default), or never before it is certain (never)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sink-window", type=int, default=None,
                   help="StreamingLLM: keep --sink-tokens first tokens + this many recent ones, "
                   "so generation can run past the context (the two must fit max_seq_len)")
    p.add_argument("--sink-tokens", type=int, default=4, help="with --sink-window: first tokens kept (default 4)")
    p.add_argument("--draft", default=None, metavar="RUN|prompt-lookup|ngram[:ORDER]",
                   help="speculative decoding: a draft model folder sharing the tokenizer, prompt lookup (copy what "
                   "followed the last 1-3 tokens earlier in the text), or archlab's Kneser-Ney n-gram model of the "
                   "prompt (order 3 unless given); greedy output is plain greedy's, sampling keeps the model's law")
    p.add_argument("--draft-tokens", default=None, metavar="K|auto",
                   help="tokens drafted per check (default auto: transformers' heuristic, +2 after a fully "
                   "accepted round, -1 otherwise)")
    p.add_argument("--draft-data", default=None, metavar="DIR",
                   help="with --draft ngram: also count a prepared data folder's train split (archlab data prepare)")
    p.add_argument("--compile", action="store_true",
                   help="decode through the model's compiled step (torch.compile, inductor; tested equal to the "
                   "eager step): the first use compiles for tens of seconds, then each step runs ~1.5-2x faster on "
                   "small models; worth it for long generations (docs/benchmarks.md)")
    p.add_argument("--compare-plain", action="store_true",
                   help="with --draft: decode once more without it and print the measured speed-up (and, greedy, "
                   "whether the outputs are identical)")
    p.add_argument("--stream", dest="stream", action="store_true", default=True,
                   help="print tokens as they are decoded (default)")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


class _TextPrinter:
    """Decode the growing token list and print only the new text (holds back a partial UTF-8 char).

    The prompt ids are decoded with it but not printed: SentencePiece-style decoders drop the leading
    space of the first token, so the continuation alone would lose the space after the prompt."""

    def __init__(self, tokenizer, out=None, prefix: list[int] | None = None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = list(prefix or [])
        self.printed = self.start = len(tokenizer.decode(self.ids)) if self.ids else 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()

    def text(self) -> str:
        """All the text the tokens after the prefix add (what finish() has printed)."""
        return self.tokenizer.decode(self.ids)[self.start:]


# generation's arguments that this command sets by a flag of the same name: its errors name the flag instead
_AS_FLAGS = ("draft_tokens", "max_new_tokens", "sink_window", "sink_tokens")
_SWITCHES = ("compile",)     # NAME=True is the flag --NAME


def _in_flags(message: str) -> str:
    """A generation error in this command's words: each argument of _AS_FLAGS as its flag, with its value.
    Example: _in_flags("draft_tokens=80 is longer than ...") -> "--draft-tokens 80 is longer than ..."."""
    import re

    for name in _SWITCHES:
        message = re.sub(rf"\b{name}=True\b", "--" + name.replace("_", "-"), message)
    for name in _AS_FLAGS:
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"\b{name}=", f"{flag} ", message)
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


@contextlib.contextmanager
def warnings_in_flags() -> Iterator[None]:
    """Warnings raised inside, in this command's words (_in_flags): generation warns in its Python arguments'
    names (compile=True), which a command-line user did not type."""
    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, *rest, **kw: previous(_in_flags(str(message)), *rest, **kw)
    try:
        yield
    finally:
        warnings.formatwarning = previous


_POSITIVE_INT = (lambda v: v >= 1, "at least 1")
_CHECKS = {   # flag -> (test, what it must be); None values are "not given"
    "max_new_tokens": _POSITIVE_INT, "num_beams": _POSITIVE_INT, "top_k": _POSITIVE_INT, "sink_window": _POSITIVE_INT,
    "sink_tokens": (lambda v: v >= 0, "at least 0"),
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda v: 0 < v < math.inf, "a finite number > 0"),
    "no_repeat_ngram_size": (lambda v: v >= 0, "at least 0"),
    "length_penalty": (lambda v: math.isfinite(v), "a finite number"),
}


def check_args(args) -> None:
    """Every argument checked before the model loads: a mistake costs nothing and prints nothing else."""
    from archlab.errors import UserError

    for name, (ok, what) in _CHECKS.items():
        value = getattr(args, name)
        if value is not None and not ok(value):
            raise UserError(f"--{name.replace('_', '-')} {value} must be {what}")
    if args.sampling_order is not None:
        from archlab.generation.sampling import sampling_order
        try:
            sampling_order(args.sampling_order)
        except ValueError as exc:
            raise UserError(f"--sampling-order: {exc}") from None
    check_device(args.device)
    check_draft_args(args)


def check_draft_args(args) -> None:
    """--draft, --draft-tokens, --draft-data, --compare-plain: their values and what they combine with."""
    from archlab.errors import UserError

    given = [f for f in ("draft_tokens", "draft_data") if getattr(args, f, None) is not None]
    if getattr(args, "draft", None) is None:
        if given or getattr(args, "compare_plain", False):
            raise UserError(f"--{(given or ['compare_plain'])[0].replace('_', '-')} needs --draft")
        return
    args.draft_tokens = parse_draft_tokens(args.draft_tokens)
    if (args.num_beams or 1) > 1:
        raise UserError(f"--draft (speculative decoding) checks one continuation; it does not combine with beam "
                        f"search (--num-beams {args.num_beams})")
    if args.sink_window is not None:
        raise UserError("--draft does not combine with --sink-window (StreamingLLM)")
    if args.draft_data is not None and not args.draft.startswith("ngram"):
        raise UserError("--draft-data is the n-gram draft's training data: use it with --draft ngram[:ORDER]")
    draft_order(args.draft)


def parse_draft_tokens(text: str | int | None) -> int | str:
    """--draft-tokens: a whole number >= 1, or auto (the default)."""
    from archlab.errors import UserError

    if text is None or text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        raise UserError(f"--draft-tokens {text!r} must be a whole number >= 1 or auto") from None
    if k < 1:
        raise UserError(f"--draft-tokens {k} must be at least 1 (or auto)")
    return k


def draft_order(draft: str) -> int | None:
    """The ORDER of --draft ngram[:ORDER] (3 when not given); None for another draft."""
    from archlab.cli.ngram import MAX_ORDER
    from archlab.errors import UserError

    name, _, order = draft.partition(":")
    if name != "ngram":
        if order and name == "prompt-lookup":
            raise UserError(f"--draft {draft}: prompt-lookup takes no :ORDER")
        return None
    try:
        n = int(order) if order else 3
    except ValueError:
        raise UserError(f"--draft {draft}: ORDER must be a whole number, e.g. ngram:4") from None
    if not 1 <= n <= MAX_ORDER:
        raise UserError(f"--draft {draft}: ORDER must be in 1..{MAX_ORDER}")
    return n


def build_draft(args, model, tok):
    """The draft --draft names: a PromptLookupDraft, an NgramDraft (with --draft-data's train tokens), or a
    ModelDraft over another folder whose tokenizer is the same (its vocabulary compared id by id)."""
    import numpy as np

    from archlab.errors import UserError
    from archlab.generation import NgramDraft, PromptLookupDraft
    from archlab.generation.speculative import check_target

    try:
        check_target(model)                 # before the prompt is echoed
    except ValueError as exc:
        raise UserError(f"--draft {args.draft}: {args.path}: {exc}") from None
    if args.draft == "prompt-lookup":
        return PromptLookupDraft()
    order = draft_order(args.draft)
    if order is not None:
        data = None
        if args.draft_data is not None:
            from archlab.data.tokens import TokenDataset
            from archlab.runs.model_folder import load_run_tokenizer
            try:
                data = np.asarray(TokenDataset(args.draft_data, "train").tokens, dtype=np.int64)
            except UserError as exc:             # named as --draft-data, the option that gave the folder
                text = str(exc)
                raise UserError(text.replace(str(args.draft_data), f"--draft-data {args.draft_data}", 1)
                                if str(args.draft_data) in text else f"--draft-data {args.draft_data}: {text}") \
                    from None
            data_tok = load_run_tokenizer(args.draft_data)              # DIR/tokenizer, as archlab data prepare
            if tok is not None and data_tok is not None and not same_vocabulary(tok, data_tok):   # writes it
                raise UserError(f"--draft-data {args.draft_data} was prepared with another tokenizer than "
                                f"{args.path}'s: its ids would stand for other tokens")
            if data.size and int(data.max()) >= model.config.vocab_size:
                raise UserError(f"--draft-data {args.draft_data} holds token ids past the model's vocabulary "
                                f"({model.config.vocab_size}): it was prepared with another tokenizer")
        return NgramDraft(order=order, data=data)
    try:
        draft, draft_tok = load_model_and_tokenizer(args.draft, args.device, purpose="drafting")
    except UserError as exc:                  # named as the draft, not as if it were the model to generate with
        text = str(exc)
        raise UserError(f"--draft {text}" if text.startswith(str(args.draft)) else f"--draft {args.draft}: {text}") \
            from None
    if not same_vocabulary(tok, draft_tok):
        raise UserError(f"--draft {args.draft}: its tokenizer differs from {args.path}'s (a draft must propose the "
                        "target's token ids)")
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(f"--draft {args.draft}: its embedding has {draft.config.vocab_size} rows, the target's "
                        f"{model.config.vocab_size}")
    return draft


def same_vocabulary(a, b) -> bool:
    """Two tokenizers map every id to the same token (compared id by id)."""
    if a.vocab_size != b.vocab_size:
        return False
    token = (lambda t, i: t.id_to_token(i)) if all(hasattr(t, "id_to_token") for t in (a, b)) else \
        (lambda t, i: t.decode([i]))
    return all(token(a, i) == token(b, i) for i in range(a.vocab_size))


def check_device(device: str) -> None:
    """A device torch knows and this machine has (one line otherwise)."""
    import torch

    from archlab.errors import UserError
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device} is not a device (cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine")
    if kind not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: archlab runs on cpu or cuda")


def run(args) -> int:
    with warnings_in_flags():
        return _run(args)


def _run(args) -> int:
    import archlab
    from archlab.errors import UserError
    from archlab.generation import GenerationConfig, stream

    check_args(args)
    if args.prompt is None and args.source is None:
        raise UserError("give --prompt TEXT (a decoder-only model) or --source TEXT (an encoder-decoder)")
    model, tok = load_model_and_tokenizer(args.path, args.device, archs=("decoder", "encoder_decoder"),
                                          purpose="generate", generation_config=True)
    if model.config.arch == "encoder_decoder":
        return _run_encoder_decoder(args, model, tok)
    if args.source is not None:
        raise UserError(f"--source is for encoder-decoders; {args.path} holds a decoder-only LM: use --prompt")
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise UserError("--prompt encodes to no tokens")
    context = model.config.max_seq_len
    if args.sink_window is not None and args.sink_tokens + args.sink_window > context:
        raise UserError(f"--sink-tokens {args.sink_tokens} + --sink-window {args.sink_window} must fit the model's "
                        f"context max_seq_len={context}: use --sink-window {context - args.sink_tokens}")
    folder = getattr(model, "generation_config", None)
    cfg = _settings(folder or GenerationConfig(), args, getattr(tok, "eot_id", None))
    eos = cfg.eos
    from archlab.generation.stepper import vocab_limit
    limit = vocab_limit(model, tok)
    draft_kw: dict = {}
    if args.draft is not None:
        from archlab.generation import SpeculativeStats
        draft_kw = dict(draft=build_draft(args, model, tok), draft_tokens=args.draft_tokens, stats=SpeculativeStats())
    try:
        if (cfg.num_beams or 1) > 1:
            ids = archlab.generate(model, prompt, generation_config=cfg, vocab_limit=limit, compile=args.compile)
            print(args.prompt + _continuation(tok, prompt, _strip(ids[len(prompt):].tolist(), eos)))
            return 0
        kw = dict(seed=args.seed, tokenizer=tok if cfg.stop_strings else None, sink_window=args.sink_window,
                  sink_tokens=args.sink_tokens if args.sink_window is not None else None, vocab_limit=limit,
                  generation_config=cfg, compile=args.compile)
        sys.stdout.write(args.prompt)
        printer = _TextPrinter(tok, prefix=prompt)
        if args.stream:
            for tokens in stream(model, prompt, **kw, **draft_kw):
                if int(tokens[0]) in eos:
                    break
                printer.add(int(tokens[0]))
            printer.finish()
        else:
            ids = archlab.generate(model, prompt, **kw, **draft_kw)
            printer.ids = prompt + _strip(ids[len(prompt):].tolist(), eos)
            printer.finish()
        if draft_kw:
            _report_speculation(args, model, prompt, kw, draft_kw["stats"], printer.ids[len(prompt):], eos,
                                greedy=not (cfg.temperature or 0.0) > 0.0)
    except ValueError as exc:  # a prompt past the context: say it plainly, naming the flags
        print(file=sys.stderr)
        raise UserError(_in_flags(str(exc))) from exc
    return 0


def _report_speculation(args, model, prompt, kw, stats, new: list[int], eos, *, greedy: bool) -> None:
    """The draft's figures on stderr; with --compare-plain, the same generation without the draft, timed."""
    import time

    import archlab

    print(stats.summary(), file=sys.stderr)
    if not args.compare_plain:
        return
    start = time.perf_counter()
    ids = archlab.generate(model, prompt, **kw)
    seconds = time.perf_counter() - start
    plain = _strip(ids[len(prompt):].tolist(), eos)
    rate = len(plain) / seconds if seconds else 0.0
    same = (f"; output identical: {'yes' if plain == new else 'NO'}" if greedy
            else " (sampled: the outputs differ by design)")
    print(f"plain decoding: {rate:.1f} tokens/s; speed-up {stats.tokens_per_second / rate if rate else 0.0:.2f}x "
          f"measured, {stats.theory:.2f}x by the theory (tokens per check, draft cost ignored){same}", file=sys.stderr)


def _run_encoder_decoder(args, model, tok) -> int:
    """Encode --source once, decode the target from the decoder start token, print the target's text."""
    import archlab
    from archlab.errors import UserError
    from archlab.generation import GenerationConfig, stream
    from archlab.generation.stepper import check_source, vocab_limit

    if args.source is None or args.prompt is not None:
        raise UserError(f"{args.path} holds an encoder-decoder: give --source TEXT (the text to encode), not --prompt")
    if args.sink_window is not None:
        raise UserError("--sink-window (StreamingLLM) is for decoder-only models")
    source = _encode_source(tok, args.path, args.source)
    if not source:
        raise UserError("--source encodes to no tokens")
    import torch
    try:
        check_source(model, torch.tensor([source]), None)
    except ValueError as exc:
        raise UserError(f"--source: {exc}") from None
    cfg = _settings(getattr(model, "generation_config", None) or GenerationConfig(), args, getattr(tok, "eot_id", None))
    kw = dict(generation_config=cfg, vocab_limit=vocab_limit(model, tok), compile=args.compile)
    if (cfg.num_beams or 1) == 1:
        kw.update(seed=args.seed, tokenizer=tok if cfg.stop_strings else None)
    try:
        if args.stream and (cfg.num_beams or 1) == 1:
            printer = _TextPrinter(tok)
            for tokens in stream(model, source, **kw):
                if int(tokens[0]) in cfg.eos:
                    break
                printer.add(int(tokens[0]))
            printer.finish()
        else:
            ids = archlab.generate(model, source, **kw)
            print(tok.decode(_strip(ids[1:].tolist(), cfg.eos)))
    except ValueError as exc:
        print(file=sys.stderr)
        raise UserError(_in_flags(str(exc))) from exc
    return 0


def _encode_source(tok, path: str, text: str) -> list[int]:
    """Source ids as the model was trained on them: through the tokenizer's post-processor where the folder's
    tokenizer.json has one (T5 appends </s>)."""
    from pathlib import Path

    from archlab.runs.hub import resolve_model
    from archlab.runs.model_folder import _with_post_processor
    from archlab.tokenizer import HFTokenizer

    folder = resolve_model(path)
    folder = folder / "tokenizer" if (folder / "config.yaml").is_file() else Path(folder)
    tok = _with_post_processor(tok, folder)
    return tok.encode(text, add_special_tokens=True) if isinstance(tok, HFTokenizer) else tok.encode(text)


def _settings(folder, args, eot_id):
    """The folder's generation config (its EOS ids, else the tokenizer's end-of-text token) with the flags that
    were given in its place; 100 new tokens when neither names a length."""
    import dataclasses
    import warnings

    if folder.eos_token_id is None and eot_id is not None:
        folder = folder.merged(eos_token_id=eot_id)
    early = {"true": True, "false": False, "never": "never"}.get(args.early_stopping)
    cfg = folder.merged(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                        no_repeat_ngram_size=args.no_repeat_ngram_size, num_beams=args.num_beams,
                        length_penalty=args.length_penalty, early_stopping=early,
                        stop_strings=tuple(args.stop) if args.stop else None, sampling_order=args.sampling_order)
    if cfg.max_new_tokens is None and cfg.max_length is None:
        cfg = cfg.merged(max_new_tokens=100)
    if (cfg.num_beams or 1) > 1:        # beams are deterministic: the sampling settings do not apply
        if args.temperature or args.top_k or args.top_p or args.min_p or args.stop:
            warnings.warn("--num-beams > 1 is deterministic beam search: --temperature, --top-k, --top-p, --min-p "
                          "and --stop do not apply", stacklevel=2)
        cfg = dataclasses.replace(cfg, temperature=None, top_k=None, top_p=None, min_p=None, stop_strings=None,
                                  sampling_order=None)
    elif args.temperature is None and (folder.temperature or 0.0) > 0.0:
        warnings.warn(f"sampling as the folder's generation_config.json asks (temperature {folder.temperature}"
                      + "".join(f", {k} {getattr(folder, k)}" for k in ("top_k", "top_p", "min_p")
                                if getattr(folder, k) is not None)
                      + "): --temperature 0 for greedy decoding", stacklevel=2)
    return cfg


def _continuation(tok, prompt: list[int], new: list[int]) -> str:
    """Text that `new` adds after `prompt` (decoded together, so a leading space is kept)."""
    head, whole = tok.decode(prompt), tok.decode(prompt + new)
    return whole[len(head):] if whole.startswith(head) else tok.decode(new)


def _strip(ids: list[int], eos: list[int]) -> list[int]:
    """`ids` up to the first EOS id."""
    ends = [i for i, t in enumerate(ids) if t in eos]
    return ids[:ends[0]] if ends else ids

