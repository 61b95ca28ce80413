"""Speculative decoding on an input-grounded task: a small model trained here to rewrite a passage (copy it, with
one word class replaced by its synonym) decodes the rewrite plainly and with prompt lookup / the Kneser-Ney n-gram
draft; tokens/s against plain greedy in interleaved rounds, the output asserted identical.

    .venv/bin/python benchmarks/speculative.py [--threads 1] [--steps 500] [--rounds 7] [--batch 1] [--clock cpu]
    .venv/bin/python benchmarks/speculative.py --model runs/smollm2 --rounds 3     # a real chat model rewrites PASSAGE

The task: tokens 2..V/2-1 are words; a prompt is  BOS passage SEP  and the target text is the passage again with
each word below V/16 replaced by word + V/2 (its "synonym", ~1 word in 15), so prompt lookup finds the passage but
misses at each synonym, as when a model rewrites a given text. The model (2-layer LLaMA-style, d_model 128) trains
for --steps AdamW steps (minutes on 2 shared cores; the weights are kept in --weights and reused by the next run
with the same settings). Each decode produces exactly the rewrite's length (EOS off), so every mode does the same
work; the ratio is the median over interleaved rounds of (plain seconds / speculative seconds); acceptance rate,
tokens per target forward and the theory's (1 - a^(k+1)) / (1 - a) come from the speculative call's SpeculativeStats.

With --model, draft models of the same tokenizer join the table: --draft-model RUN (e.g. the int8 copy of the
model, `archlab quantize FOLDER --weights int8 --out RUN`) and --exit-layers K,... (self-speculation, LayerSkip-style
early exit: the model's own first K layers, its final norm and head, their tensors shared, not copied), each at
k=auto and k=--draft-k; --task open asks for a story instead of the rewrite.

    .venv/bin/python benchmarks/speculative.py --model runs/smollm2 --draft-model runs/smollm2-int8 --exit-layers 24,28
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench import interleaved, parser, start  # benchmarks/bench.py: one call of each per round, the order rotating
from safetensors.torch import load_file, save_file

import archlab
from archlab.generation import NgramDraft, SpeculativeStats

BOS, SEP = 0, 1


def task(batch: int, vocab: int, lengths: tuple[int, int], g: torch.Generator) -> list[tuple[list[int], list[int]]]:
    """(prompt, rewrite) pairs: BOS passage SEP, and the passage with its low words swapped for synonyms."""
    out = []
    for _ in range(batch):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        words = torch.randint(2, vocab // 2, (n,), generator=g).tolist()
        rewrite = [w + vocab // 2 if w < vocab // 16 else w for w in words]
        out.append(([BOS, *words, SEP], rewrite))
    return out


def train(cfg, steps: int, lengths, seed: int) -> archlab.TransformerLM:
    """Next-token loss on the rewrite only (the passage is given), AdamW with a short warmup."""
    torch.manual_seed(seed)
    model = archlab.TransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    width = 2 * lengths[1] + 2
    for step in range(steps):
        ids = torch.full((32, width), SEP)
        targets = torch.full((32, width), -100)
        for i, (prompt, rewrite) in enumerate(task(32, cfg.vocab_size, lengths, g)):
            row = prompt + rewrite
            ids[i, :len(row)] = torch.tensor(row)
            targets[i, len(prompt) - 1:len(row) - 1] = torch.tensor(rewrite)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * (1 - step / steps) + 1e-4
        loss = model(ids, targets=targets).total
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {loss.item():.3f}", flush=True)
    return model.eval()


PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed "
           "the narrow stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships passing in "
           "the dark counted its flashes to know where they were, and fishermen said the light had saved more lives "
           "than any doctor in the town.")
INSTRUCTION = "Rewrite the following passage in the past perfect tense, changing nothing else:\n\n"
TASKS = {"rewrite": INSTRUCTION + PASSAGE,       # input-grounded: the answer copies most of the prompt
         "open": "Write a short story about a lighthouse keeper who finds a message in a bottle."}   # open-ended


def trained_model(args):
    """(the rewrite model, its prompts, generate's settings): trained here, or kept from an earlier run."""
    lengths = (args.length // 2, args.length)
    base = archlab.presets.tiny("llama3-8b", vocab_size=args.vocab, d_model=128, max_seq_len=2 * args.length + 8)
    weights = Path(args.weights or Path(tempfile.gettempdir()) /
                   f"archlab_speculative_v{args.vocab}_l{args.length}_s{args.steps}.safetensors")
    if weights.is_file():
        model = archlab.TransformerLM(base).eval()
        model.load_state_dict(load_file(weights))
        print(f"the rewrite model: {weights} (trained by an earlier run)", flush=True)
    else:
        print(f"training the rewrite model ({args.steps} steps) ...", flush=True)
        start = time.perf_counter()
        model = train(base, args.steps, lengths, seed=0)
        print(f"  {time.perf_counter() - start:.0f} s; weights kept in {weights}", flush=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    pairs = task(args.batch, args.vocab, (args.length, args.length), torch.Generator().manual_seed(123))
    prompts = [p for p, _ in pairs]
    kw = dict(max_new_tokens=args.length, eos_token_id=[], pad_token_id=SEP)
    plain = archlab.generate(model, prompts, **kw)
    right = sum(int((plain[i, -args.length:] == torch.tensor(r)).sum()) for i, (_, r) in enumerate(pairs))
    print(f"the model's rewrite: {right / (args.length * args.batch):.1%} of tokens right", flush=True)
    return model, prompts, kw


def folder_model(args):
    """(a chat model folder's model, the rewrite instruction + PASSAGE through its chat template, settings that stop
    at its end of turn)."""
    from archlab.generation.chat import Conversation, end_of_turn_ids
    from archlab.runs.chat_folder import chat_tokenizer
    from archlab.runs.model_folder import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.model, "cpu")
    chat = chat_tokenizer(args.model, tok)
    if chat is None:
        raise SystemExit(f"{args.model} has no chat template")
    prompt = Conversation(chat, context=model.config.max_seq_len, reserve=args.new).prompt(TASKS[args.task])
    eos = end_of_turn_ids(chat) + ([tok.eot_id] if getattr(tok, "eot_id", None) is not None else [])
    kw = dict(max_new_tokens=args.new, eos_token_id=eos)
    plain = archlab.generate(model, prompt, **kw)
    print(f"{args.model}: a {len(prompt)}-token prompt, the answer: {tok.decode(plain[len(prompt):].tolist())!r}",
          flush=True)
    return model, [prompt], kw


def early_exit(model, layers: int) -> archlab.TransformerLM:
    """The model's first `layers` layers, its final norm and its head as a model of their own (LayerSkip-style
    self-speculation, Elhoushi et al. 2024, arXiv 2404.16710, without its early-exit training): built at that depth
    and given the model's own tensors (load_state_dict(assign=True): shared storage, no copy)."""
    if not 1 <= layers < model.config.n_layers:
        raise SystemExit(f"--exit-layers {layers}: must be in 1..{model.config.n_layers - 1}")
    draft = archlab.TransformerLM(model.config.with_overrides({"n_layers": layers}))
    mine = draft.state_dict()
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if k in mine}, assign=True)
    return draft.eval()


def model_drafts(args, model) -> dict[str, dict]:
    """The table's rows for --draft-model and --exit-layers: name -> generate's draft arguments."""
    from archlab.runs.model_folder import load_model_and_tokenizer

    drafts = {}
    for run in args.draft_model or []:
        drafts[Path(run).name] = load_model_and_tokenizer(run, "cpu", purpose="drafting")[0].eval()
    for layers in args.exit_layers:
        drafts[f"exit at layer {layers}"] = early_exit(model, layers)
    return {f"{name}, k={k}": dict(draft=draft, draft_tokens=k)
            for name, draft in drafts.items() for k in ("auto", args.draft_k)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=500, help="training steps of the rewrite model")
    ap.add_argument("--weights", default=None, help="where the trained weights are kept (default: the temp folder)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (left-padded when > 1)")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--length", type=int, default=64, help="passage length (words)")
    ap.add_argument("--model", default=None, help="a chat model folder instead (e.g. SmolLM2-135M-Instruct converted "
                    "by archlab convert --from-gguf): it rewrites PASSAGE, stopping at its end of turn")
    ap.add_argument("--new", type=int, default=128, help="with --model: most new tokens")
    ap.add_argument("--task", choices=sorted(TASKS), default="rewrite",
                    help="with --model: rewrite PASSAGE (input-grounded) or write a story (open-ended)")
    ap.add_argument("--draft-model", action="append", metavar="RUN",
                    help="with --model: a draft model folder of the same tokenizer (repeatable), e.g. its int8 copy")
    ap.add_argument("--exit-layers", type=lambda t: [int(x) for x in t.split(",") if x], default=[], metavar="K,...",
                    help="with --model: self-speculation drafts, the model's first K layers + its final norm and head")
    ap.add_argument("--draft-k", type=int, default=4, help="the fixed draft length of the draft models' rows")
    ap.add_argument("--skip-builtin", action="store_true", help="leave out the prompt lookup and n-gram rows")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (other tenants of a shared machine drop out)")
    args = ap.parse_args()
    start(args, clock=args.clock)
    model, prompts, kw = folder_model(args) if args.model else trained_model(args)
    plain = archlab.generate(model, prompts, **kw)
    tokens = (plain.shape[-1] - len(prompts[0])) * len(prompts)      # every mode decodes exactly these
    modes = {} if args.skip_builtin else {
        "prompt lookup, k=auto": dict(draft="prompt_lookup", draft_tokens="auto"),
        "prompt lookup, k=8": dict(draft="prompt_lookup", draft_tokens=8),
        "n-gram (order 3), k=auto": dict(draft="ngram", draft_tokens="auto"),
        "n-gram (order 3), k=8": dict(draft="ngram", draft_tokens=8),
        "n-gram, no cache, k=auto": dict(draft=NgramDraft(order=3, cache_max=0), draft_tokens="auto")}
    if args.model:
        modes.update(model_drafts(args, model))
    width = max(26, *(len(name) for name in modes))
    print(f"batch {len(prompts)}, {tokens // len(prompts)} new tokens per row, greedy; median of {args.rounds} "
          f"interleaved rounds, {args.clock} clock")
    print(f"{'draft':<{width}} {'tok/s':>8} {'plain':>8} {'speed-up':>8} {'alpha':>6} {'tok/fwd':>8} "
          f"{'per round':>9} {'theory':>7} {'mean k':>6}")
    for name, extra in modes.items():
        stats = SpeculativeStats()
        out = archlab.generate(model, prompts, **kw, **extra, stats=stats)
        assert torch.equal(out, plain), f"{name}: speculative output differs from plain greedy"
        fns = {"plain": lambda: archlab.generate(model, prompts, **kw),
               "draft": lambda extra=extra: archlab.generate(model, prompts, **kw, **extra)}
        times = interleaved(fns, args.rounds, clock=time.process_time if args.clock == "cpu" else time.perf_counter)
        ratios = [p / d for p, d in zip(times["plain"], times["draft"])]
        mean_k = sum(stats.draft_lengths) / max(1, len(stats.draft_lengths))
        print(f"{name:<{width}} {tokens / statistics.median(times['draft']):>8.1f} "
              f"{tokens / statistics.median(times['plain']):>8.1f} {statistics.median(ratios):>7.2f}x "
              f"{stats.alpha:>6.2f} {stats.tokens_per_forward:>8.2f} {stats.tokens_per_round:>9.2f} "
              f"{stats.theory:>7.2f} {mean_k:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
