"""`archlab chat`: talk to a run folder or an HF folder through its chat template, one answer streamed per turn.

Each user line is added to the history; the whole history is rendered through the folder's chat template
with the generation prompt (archlab.generation.chat.Conversation), decoded as `archlab generate` decodes that
text, and streamed until the template's end-of-turn token, an EOS token or --max-new-tokens. The KV cache of
the conversation is kept between turns (archlab.generation.PrefixCache): each turn's rendered prompt is compared
token by token with what the cache holds and only the rest is prefilled, so the time to the first token does not
grow with the conversation (and a template that rewrites earlier text still gets a correct, longer prefill). After
each answer the cache grows, if it must, for a next turn up to twice as long as this one (PrefixCache.ahead), so that
growth is not paid inside the next turn's time to first token."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from archlab.cli.generate import add_sampling_flags

EXAMPLE = """example:
  archlab tokenizer chat-template runs/demo/tokenizer --format plain    # a template with no new tokens
  archlab chat runs/sft --system "You answer in one line." --max-new-tokens 64
  archlab chat runs/smollm2 --compile                                   # a compiled decode step
  printf 'Hi\\n/reset\\nWhat is 2+2?\\n' | archlab chat runs/sft      # piped: one user turn per line

in the loop:  /reset  forget the conversation (the system message stays)
              /exit   end (so does end of input, Ctrl-D)
A conversation past the model's context drops its oldest turns (said once); a single message that does
not fit is refused with its token count, and the conversation goes on.
"""

COMMANDS = {"/reset": "reset", "/exit": "exit"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", help="chat with a run folder or an HF folder through its chat template",
        description="An interactive chat: each line you type is a user turn; the history is rendered through the "
        "folder's chat template (a run folder's tokenizer/chat_template.jinja, or an HF folder's "
        "chat_template.jinja / tokenizer_config.json) and the answer is streamed token by token. Greedy unless "
        "--temperature > 0 (or the folder's generation_config.json samples).",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="run folder or HF model folder with a chat template")
    p.add_argument("--system", default=None, help="system message, kept at the head of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="most tokens per answer (default: the folder's generation config, else 100)")
    add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (answer i samples with seed + i)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="answer through the model's compiled decode step (torch.compile; compiled once, at the "
                   "first answer, for tens of seconds; as archlab generate --compile)")
    p.set_defaults(func=run)


def run(args) -> int:
    from archlab.cli.generate import warnings_in_flags

    with warnings_in_flags():
        return _run(args)


def _run(args) -> int:
    from archlab.cli.generate import check_args
    from archlab.errors import UserError
    from archlab.runs.chat_folder import chat_tokenizer, has_chat_template, tokenizer_dir
    from archlab.runs.hub import resolve_model
    from archlab.runs.model_folder import check_vocabulary, folder_arch, load_model_and_tokenizer

    for name in ("num_beams", "sink_window", "sink_tokens", "no_repeat_ngram_size", "length_penalty",
                 "early_stopping", "stop"):
        setattr(args, name, None)        # generate's flags that chat does not take
    check_args(args)
    folder = resolve_model(args.path)
    arch = folder_arch(folder)
    if arch is None:                   # not a model folder: the loader names what is missing
        load_model_and_tokenizer(folder, args.device, purpose="chat")
    if arch != "decoder":
        raise UserError(f"{args.path} holds a model with arch={arch}: archlab chat needs a decoder-only LM")
    if not has_chat_template(folder):
        raise UserError(f"{args.path} has no chat template: add one with `archlab tokenizer chat-template "
                        f"{tokenizer_dir(args.path if Path(args.path).is_dir() else folder)} --format plain` "
                        "(chatml and llama3 add tokens the model must be fine-tuned with)")
    model, tok = load_model_and_tokenizer(folder, args.device, purpose="chat", generation_config=True)
    check_vocabulary(model, tok)
    chat = chat_tokenizer(folder, tok)
    assert chat is not None                     # has_chat_template said so
    session = _Session.start(args, model, chat)
    return session.loop(sys.stdin)


class _Session:
    """The loop's state: the model, the decoding settings, the conversation, whether a drop was reported."""

    def __init__(self, model, convo, settings, seed, limit, compile: bool = False):
        from archlab.generation import PrefixCache

        self.model, self.convo, self.settings, self.seed, self.limit = model, convo, settings, seed, limit
        self.compile = compile
        self.cache = PrefixCache()     # the conversation's KV cache, kept from turn to turn
        self.warned = False
        self.refused = 0
        self.turn = 0

    @classmethod
    def start(cls, args, model, chat) -> _Session:
        import dataclasses

        from archlab.cli.generate import _settings
        from archlab.errors import UserError
        from archlab.generation import GenerationConfig
        from archlab.generation.chat import Conversation, end_of_turn_ids, stopping_at
        from archlab.generation.stepper import vocab_limit

        folder = getattr(model, "generation_config", None) or GenerationConfig()
        cfg = _settings(folder, args, getattr(chat.tokenizer, "eot_id", None))
        cfg = dataclasses.replace(cfg, num_beams=None, length_penalty=None, early_stopping=None)  # one answer
        cfg = stopping_at(cfg, end_of_turn_ids(chat))
        context = model.config.max_seq_len
        reserve = cfg.max_new_tokens if cfg.max_new_tokens is not None else 1    # else max_length bounds it
        if reserve >= context:
            named = "--max-new-tokens" if args.max_new_tokens is not None else \
                "the folder's generation_config.json max_new_tokens"
            raise UserError(f"{named} {reserve} leaves no room for a prompt in the model's context of "
                            f"{context} tokens: use --max-new-tokens {context // 4} (at most {context - 1})")
        convo = Conversation(chat, context=context, reserve=reserve, system=args.system)
        return cls(model, convo, cfg, args.seed, vocab_limit(model, chat.tokenizer), getattr(args, "compile", False))

    def loop(self, lines) -> int:
        """Read user turns until /exit or the end of input; 2 if any turn was refused, else 0."""
        read = _prompted if lines.isatty() else lines.readline
        while True:
            line = read()
            if not line:
                break
            text = line.rstrip("\n")
            command = COMMANDS.get(text.strip())
            if command == "exit":
                break
            if command == "reset":
                self.convo.reset()
                _note("conversation cleared")
                continue
            if text.strip():
                self.reply(text)
        return 2 if self.refused else 0

    def reply(self, text: str) -> None:
        """Decode and stream one answer to `text`; the answer joins the history."""
        from archlab.cli.generate import _TextPrinter
        from archlab.generation import stream
        from archlab.generation.chat import ContextFull

        dropped = self.convo.dropped
        try:
            prompt = self.convo.prompt(text)
        except ContextFull as exc:
            print(f"archlab chat: error: {exc}", file=sys.stderr)
            self.refused += 1
            return
        if self.convo.dropped > dropped and not self.warned:
            _note(f"the conversation is past the model's context of {self.convo.context} tokens: dropping the "
                  "oldest turns")
            self.warned = True
        seed = None if self.seed is None else self.seed + self.turn
        self.turn += 1
        printer = _TextPrinter(self.convo.chat.tokenizer, prefix=prompt)
        try:
            for tokens in stream(self.model, prompt, generation_config=self.settings, seed=seed,
                                 vocab_limit=self.limit, prefix_cache=self.cache, compile=self.compile):
                if int(tokens[0]) in self.settings.eos:
                    break
                printer.add(int(tokens[0]))
        except KeyboardInterrupt:        # Ctrl-C stops this answer (kept as far as it went), not the chat
            pass
        printer.finish()
        self.convo.answer(printer.text())
        if self.cache is not None:   # grow for the next turn now, not inside its time to first token: room for a
            # message up to twice this turn's prefill (the answer's end-of-turn tokens join it) and a whole answer
            self.cache.ahead(2 * self.cache.prefilled + self.convo.reserve)


def _prompted() -> str:
    """One line typed at a `> ` prompt (line editing and history where readline exists); "" at Ctrl-D."""
    try:
        import readline  # noqa: F401 - input() edits lines through it once imported
    except ImportError:
        pass
    try:
        return input("> ") + "\n"
    except EOFError:
        print()
        return ""


def _note(message: str) -> None:
    print(f"archlab chat: {message}", file=sys.stderr)
