"""Time to first token across a chat's turns, with the conversation's KV cache kept between turns (PrefixCache, as
`archlab chat` does) and without it (every turn prefills the whole history); where turn 1's and the last turn's
time goes; and the server's per-slot prefix cache on the same conversation.

    .venv/bin/python benchmarks/chat_cache.py [--threads 1] [--turns 10] [--rounds 5] [--user 60] [--answer 60]
                                              [--d-model 256] [--no-server] [--breakdown-only] [--clock cpu]
    .venv/bin/python benchmarks/chat_cache.py --model FOLDER [--threads 1] [--turns 10] [--rounds 3] [--answer 60]
    .venv/bin/python benchmarks/chat_cache.py [--model FOLDER] --growth-only [--growth 1000] [--repeats 15]

The model: the decode benchmark's LLaMA shape (8 layers, d_model 256, GQA 8:2, random weights; only shapes matter
for time; --d-model widens it, heads of 32). A turn appends --user tokens to the history, streams an answer of
--answer tokens (greedy, EOS off) and appends it; the time to first token is from the call to the first streamed
token, the prefill included. Both conversations run in interleaved rounds (one whole conversation each per round,
the order alternating); each turn's figure is the median over rounds, and the answers of both are asserted
identical. Then turn 1 alone by the cache it allocates: a fresh prefill's (prompt + 1 slots), the PrefixCache's
(grown by doubling from 128 slots: what it needs) and the PrefixCache holding the model's whole context from the
start (what it did before it grew), interleaved.

--model FOLDER: a real conversation with a run or HF folder that has a chat template (e.g. SmolLM2-135M-Instruct:
`archlab convert --from-gguf smollm2-135m-instruct --out /tmp/smollm2`), through `archlab chat`'s own session
(cli/chat._Session: generation.chat.Conversation renders and encodes the history, `stream` decodes with the
conversation's PrefixCache, or with none for the fresh side): ten fixed user questions of 20-60 tokens, answers
greedy and capped at --answer tokens (they stop at the template's end of turn). The time to first token runs from
the user's line (the render and encoding included) to the first streamed token; the answers of both sides are
asserted identical; the breakdown is that of the turns' real prompts (the held tokens as the chat's cache held them).

The breakdown (turn 1 and the last turn, the cache holding what it holds in the chat; each part the least of
interleaved repeats): setup (the prompt's tensors, the cache's common prefix), the prefill forward, of it the
attention (the prefill's time less that of the same prefill with SDPA's calls answering zeros at once: the other
operations' time does not depend on their values), and the first token's sampling. Then the floor: the attention's
arithmetic at each turn (4·t·s·h·e per layer over the pairs a causal query sees) and the least turn N / turn 1 that
any attention kernel could give on this machine: turn 1 as measured, the last turn's attention done at this
machine's large-matmul rate (a 512x512 float32 matmul, the same threads), nothing else changed.

The growth table (--growth HELD, 0 skips it; --growth-only prints it alone): a turn whose cache holds HELD tokens
(1,000: a capacity of 1,024) adds --user tokens with --answer to decode, crossing the capacity; its time to first
token with the cache growing inside the turn against the cache grown ahead between turns (PrefixCache.ahead, which
`archlab chat` calls after each answer), interleaved.

--clock cpu times this process's CPU time (time.process_time; with one torch thread the computation's own time), so
a shared machine's other tenants drop out of the figures; --clock wall (the default) is what a user waits.

The server (archlab.serve.Engine, one decoding row): the same turns as requests of one token each (prefill + the
first token), with the prefix cache and without (prefix_cache=False), interleaved; ids below 256 (a byte
tokenizer) and fixed answers, so the row holds the previous prompt and each follow-up prefills the answer and the
user's turn.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from bench import parser, start  # benchmarks/bench.py: the opening every benchmark shares

import archlab
from archlab.generation import PrefixCache, stream

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter          # set from --clock in main()


CHAT_TURNS = [   # fixed user turns of a realistic length (20-60 tokens with SmolLM2's tokenizer)
    "I am planning a three-day trip to Lisbon in early spring. What neighbourhoods should I stay in if I want to "
    "walk to most of the sights and still sleep well at night?",
    "Thanks. How do the trams and the metro compare for getting around, and is a day pass worth it for someone "
    "who walks a lot?",
    "What are two or three day trips from the city that can be done by train, and roughly how long does each "
    "journey take?",
    "I would like to try traditional food without spending too much. Which dishes should I look for, and where "
    "do locals usually eat them?",
    "Is it easy to get by with English, or should I learn a few phrases in Portuguese before I go? Which ones "
    "would help most?",
    "How warm is it usually in March, and what should I pack if I expect some rain but also long walks on steep, "
    "slippery streets?",
    "Can you suggest a rough plan for the first day that starts at the castle and ends somewhere with a good view "
    "of the sunset?",
    "Are there any museums that are free on certain days, or discounts for students that I should ask about at "
    "the ticket office?",
    "What is the best way to get from the airport to the centre late at night, and how much should a taxi cost?",
    "Finally, could you summarise the whole plan in a short list I can keep on my phone, with one line for each "
    "day of the trip?",
]


@contextlib.contextmanager
def first_token_times(marks: list[float]):
    """`archlab.generation.stream` records the clock at each call's first token in `marks` (the chat session
    imports it at each turn, so it gets the recording one)."""
    import archlab.generation as generation

    real = generation.stream

    def recording(*args, **kwargs):
        for i, tokens in enumerate(real(*args, **kwargs)):
            if i == 0:
                marks.append(clock())
            yield tokens

    generation.stream = recording           # type: ignore[assignment]
    try:
        yield
    finally:
        generation.stream = real            # type: ignore[assignment]


def chat_session(folder: str, answer: int):
    """(model, chat tokenizer, a function starting a fresh `archlab chat` session: greedy, --max-new-tokens answer)."""
    from archlab.cli import build_parser
    from archlab.cli.chat import _Session
    from archlab.runs.chat_folder import chat_tokenizer
    from archlab.runs.model_folder import load_model_and_tokenizer

    args = build_parser().parse_args(["chat", folder, "--max-new-tokens", str(answer), "--temperature", "0"])
    for name in ("num_beams", "sink_window", "sink_tokens", "no_repeat_ngram_size", "length_penalty",
                 "early_stopping", "stop"):
        setattr(args, name, None)                    # as cli/chat.run does
    model, tok = load_model_and_tokenizer(folder, "cpu", purpose="chat", generation_config=True)
    chat = chat_tokenizer(folder, tok)
    if chat is None:
        raise SystemExit(f"{folder} has no chat template")
    return model, chat, lambda: _Session.start(args, model, chat)


def chat_conversation(start, users: list[str], cached: bool) -> tuple[list[float], list[str], list[list[int]],
                                                                      list[int]]:
    """One `archlab chat` conversation: (seconds from each user line to its first token, the answers, each turn's
    prompt ids, the tokens the cache held of each prompt)."""
    import io

    from archlab.generation.chat import Conversation

    session = start()
    if not cached:
        session.cache = None                         # every turn prefills the whole history
    prompts: list[list[int]] = []
    real_prompt = Conversation.prompt

    def prompt(self, user):                          # the ids the turn decodes from, as the session builds them
        ids = real_prompt(self, user)
        prompts.append(ids)
        return ids

    ttft, reused, marks = [], [], []
    Conversation.prompt = prompt                     # type: ignore[method-assign]
    try:
        with first_token_times(marks), contextlib.redirect_stdout(io.StringIO()):
            for text in users:
                start_at = clock()
                session.reply(text)
                ttft.append(marks[-1] - start_at)
                reused.append(session.cache.reused if cached else 0)
    finally:
        Conversation.prompt = real_prompt            # type: ignore[method-assign]
    answers = [m["content"] for m in session.convo.messages if m["role"] == "assistant"]
    return ttft, answers, prompts, reused


def model_chat(args) -> tuple:
    """The conversations through `archlab chat`'s session on --model, printed; (model, config, breakdown cases)."""
    model, chat, start = chat_session(args.model, args.answer)
    users = CHAT_TURNS[:args.turns]
    if len(users) < args.turns:
        raise SystemExit(f"--model has {len(CHAT_TURNS)} fixed user turns: --turns {len(CHAT_TURNS)} at most")
    lengths = [len(chat.tokenizer.encode(u)) for u in users]
    chat_conversation(start, users[:2], True)                                         # warm-up
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            ttft, answers, prompts, reused = chat_conversation(start, users, cached)
            times[cached].append(ttft)
            if cached:
                kept = (answers, prompts, reused)
            else:
                fresh = answers
        assert fresh == kept[0], "the cached conversation answered differently"
    answers, prompts, reused = kept
    med = {c: [statistics.median(t[i] for t in times[c]) for i in range(args.turns)] for c in (True, False)}
    last = args.turns - 1
    print(f"{args.model}: time to first token (ms, {args.clock} clock, from the user's line: render and encoding "
          f"included), median of {args.rounds} interleaved rounds; user turns of {min(lengths)}-{max(lengths)} "
          f"tokens, answers of at most {args.answer} (greedy, identical with and without the cache)")
    print(f"{'turn':>4} {'user':>5} {'prompt':>7} {'held':>6} {'answer':>7} {'cached':>8} {'fresh':>8}")
    for i in range(args.turns):
        print(f"{i + 1:>4} {lengths[i]:>5} {len(prompts[i]):>7} {reused[i]:>6} "
              f"{len(chat.tokenizer.encode(answers[i])):>7} {1e3 * med[True][i]:>8.1f} {1e3 * med[False][i]:>8.1f}")
    print(f"turn {args.turns} / turn 1: cached {med[True][last] / med[True][0]:.2f}x (against the fresh turn 1 "
          f"{med[True][last] / med[False][0]:.2f}x), fresh {med[False][last] / med[False][0]:.2f}x; at turn "
          f"{args.turns} the cache is {med[False][last] / med[True][last]:.1f}x faster to the first token")
    return model, model.config, {1: (prompts[0], 0), args.turns: (prompts[last], reused[last])}


def conversation(model, users: list[list[int]], answer: int, cached: bool) -> tuple[list[float], list[int]]:
    """(seconds to the first token of each turn, the final history)."""
    cache = PrefixCache() if cached else None
    history: list[int] = []
    ttft = []
    for user in users:
        history = history + user
        start = clock()
        tokens = stream(model, history, answer, eos_token_id=[], prefix_cache=cache)
        first = next(tokens)
        ttft.append(clock() - start)
        history = history + [int(first[0])] + [int(t[0]) for t in tokens]
    return ttft, history


@contextlib.contextmanager
def attention_skipped():
    """SDPA's calls answer zeros at once: what is left of a forward's time is everything but the attention itself
    (the time of the other operations does not depend on the values they get)."""
    from archlab.nn import attention_backends

    real = attention_backends.SDPA.__call__
    attention_backends.SDPA.__call__ = lambda self, call: (torch.zeros_like(call.q), None)   # type: ignore
    try:
        yield
    finally:
        attention_backends.SDPA.__call__ = real                                                # type: ignore


@contextlib.contextmanager
def whole_context():
    """PrefixCache allocates the model's whole context at its first call (what it did before it grew by doubling)."""
    from archlab.generation import prefix

    real = prefix.capacity
    prefix.capacity = lambda need, limit, have=prefix.CHUNK: limit          # type: ignore[assignment]
    try:
        yield
    finally:
        prefix.capacity = real                                               # type: ignore[assignment]


def first_turn(model, prompt: list[int], repeats: int) -> dict[str, tuple[float, int]]:
    """Turn 1's time to first token (ms, the median of `repeats` interleaved) and the KV cache's bytes: a fresh
    prefill (prompt + 1 slots), the PrefixCache growing by doubling (what it needs, rounded up to a power of two), the
    PrefixCache holding the model's whole context from the start."""
    ways = {"fresh": contextlib.nullcontext, "grown": contextlib.nullcontext, "whole": whole_context}
    times: dict[str, list[float]] = {w: [] for w in ways}
    size = {"fresh": 0, "grown": 0, "whole": 0}
    for r in range(repeats + 1):
        for way in (list(ways) if r % 2 else list(ways)[::-1]):
            cache = None if way == "fresh" else PrefixCache()
            with ways[way]():
                start = clock()
                next(stream(model, prompt, 1, eos_token_id=[], prefix_cache=cache))
                seconds = clock() - start
            if r:                                                           # the first round warms up
                times[way].append(seconds)
            if cache is not None and cache.cache is not None:
                size[way] = cache.cache.nbytes
    cfg = model.config
    width = next(model.parameters()).element_size()
    size["fresh"] = (len(prompt) + 1) * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * width
    return {w: (1e3 * statistics.median(times[w]), size[w]) for w in ways}


def print_first_turn(model, prompt: list[int], repeats: int) -> None:
    got = first_turn(model, prompt, repeats)
    print(f"turn 1 ({len(prompt)} tokens): time to first token (ms, median of {repeats} interleaved) by the KV cache "
          "it allocates: " + "; ".join(f"{way} {ms:.1f} ms ({size / 2**20:.1f} MiB)" for way, (ms, size) in
                                      zip(("fresh prefill", "PrefixCache grown by doubling",
                                           "PrefixCache of the whole context"), got.values())))


def growth_turn(model, held: int, added: int, answer: int, repeats: int) -> dict[str, list[float]]:
    """A turn that crosses the kept cache's capacity: the cache holds `held` random tokens (capacity: held + 1 rounded
    up to a power of two), the turn adds `added` and may decode `answer`, more than that capacity holds. Its time to
    first token (seconds, `repeats` interleaved, after one warm-up round) with the cache growing inside the turn (as
    before PrefixCache.ahead) and grown ahead between turns (ahead(added + answer), untimed, as `archlab chat` does
    after each answer); the first tokens are asserted equal."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (held + added,), generator=g).tolist()
    times: dict[str, list[float]] = {"in the turn": [], "ahead": []}
    first = set()
    for r in range(repeats + 1):
        for way in (list(times) if r % 2 else list(times)[::-1]):
            cache = PrefixCache()
            list(stream(model, ids[:held], 1, eos_token_id=[], prefix_cache=cache))      # the conversation so far
            grown = cache.cache.max_len if cache.cache is not None else 0
            if way == "ahead":
                cache.ahead(added + answer)
            start = clock()
            first.add(int(next(stream(model, ids, answer, eos_token_id=[], prefix_cache=cache))[0]))
            seconds = clock() - start
            assert cache.cache is not None and cache.cache.max_len > grown, "the turn did not cross a growth"
            if r:
                times[way].append(seconds)
    assert len(first) == 1, "the first tokens differ"
    return times


def print_growth_turn(model, held: int, added: int, answer: int, repeats: int) -> None:
    times = growth_turn(model, held, added, answer, repeats)
    med = {way: 1e3 * statistics.median(t) for way, t in times.items()}
    ratios = [a / b for a, b in zip(times["in the turn"], times["ahead"])]
    print(f"a turn crossing the kept cache's capacity ({held} tokens held, {added} added, up to {answer} new): time "
          f"to first token (ms, median of {repeats} interleaved) with the growth in the turn {med['in the turn']:.1f}, "
          f"grown ahead between turns {med['ahead']:.1f}: {med['in the turn'] - med['ahead']:+.1f} ms "
          f"({statistics.median(ratios):.2f}x, per round {min(ratios):.2f}-{max(ratios):.2f}x)")


def breakdown(model, prompt: list[int], held: int, repeats: int) -> dict[str, float]:
    """Milliseconds of a turn whose cache holds prompt[:held], each the least of `repeats` (a shared machine's noise
    only adds): setup, prefill, sample (the first token), total, and `rest`: the prefill with attention skipped."""
    from archlab.generation.sampling import SamplingParams, next_token
    from archlab.generation.stepper import Stepper, prepare_prompts
    from archlab.nn import attention_backends

    cache = PrefixCache()
    list(stream(model, prompt[:max(held, 1)], 1, eos_token_id=[], prefix_cache=cache))
    best: dict[str, float] = {}

    def prefill() -> tuple[float, float, torch.Tensor, list]:
        assert cache.cache is not None
        cache.cache.crop(held)
        del cache.ids[held:]
        calls: list = []
        start = clock()
        ids, mask, _ = prepare_prompts(prompt)
        stepper = Stepper(model, ids, mask, 2, prefix=cache)
        setup = clock()
        with attention_backends.observe(calls.append):
            logits = stepper.prefill()
        return setup - start, clock() - setup, logits, calls

    for _ in range(repeats):
        with torch.inference_mode():
            setup, forward, logits, calls = prefill()
            start = clock()
            int(next_token(logits, SamplingParams(temperature=0.0))[0])
            sample = clock() - start
            assert {attention_backends.choose(c).name for c in calls} == {"sdpa"}
            with attention_skipped():
                rest = prefill()[1]
        for key, seconds in (("total", setup + forward + sample), ("setup", setup), ("prefill", forward),
                             ("sample", sample), ("rest", rest)):
            best[key] = min(best.get(key, float("inf")), seconds)
    return {k: 1e3 * v for k, v in best.items()}


def attention_work(cfg, new: int, keys: int) -> tuple[float, float]:
    """(FLOPs, exponentials) of a prefill's attention: `new` queries, the last `new` of `keys` positions, each over the
    keys a causal query sees: q·k and p·v (2 multiply-adds per pair and head dimension) and one exp per score, every
    query head, every layer."""
    pairs = (new * (keys - new) + new * (new + 1) // 2) * cfg.attention.n_heads * cfg.n_layers
    return 4.0 * pairs * cfg.head_dim, float(pairs)


def machine_rates(repeats: int = 30) -> tuple[float, float]:
    """(FLOP/s of a 512x512 float32 matmul, exponentials/s of torch.exp over 2^20 floats) at the set threads, each the
    best of `repeats`: what this CPU's kernels sustain, the ceilings for attention's products and its softmax."""
    a, b, x = torch.randn(512, 512), torch.randn(512, 512), torch.randn(1 << 20)
    best = [float("inf"), float("inf")]
    for _ in range(repeats + 3):
        for i, fn in enumerate((lambda: a @ b, lambda: torch.exp(x))):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return 2 * 512 ** 3 / best[0], (1 << 20) / best[1]


def server_turns(model, users: list[list[int]], answers: list[list[int]], cached: bool) -> tuple[list[float], list]:
    """(seconds per one-token request of each turn, (text, cached tokens) of each) through a fresh Engine."""
    from archlab.serve import CompletionRequest, Engine
    from archlab.tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    engine = Engine(model, tokenizer, "bench", max_batch=1, prefix_cache=cached)
    _, settings = engine.prepare(CompletionRequest("x", max_tokens=1, temperature=0))
    history: list[int] = []
    times, out = [], []
    for user, answer in zip(users, answers):
        history = history + user
        start = clock()
        deltas = list(engine.complete(CompletionRequest("", max_tokens=1, temperature=0),
                                      prepared=(list(history), settings)))
        times.append(clock() - start)
        out.append(("".join(d.text for d in deltas), deltas[-1].cached_tokens))
        history = history + answer
    return times, out


def toy_model(args):
    """The decode benchmark's LLaMA shape at --d-model (heads of 32, GQA 4:1), random weights."""
    heads = args.d_model // 32
    cfg = archlab.presets.tiny("llama3-8b", vocab_size=4096, d_model=args.d_model, max_seq_len=2048).with_overrides(
        {"n_layers": 8, "attention.n_heads": heads, "attention.n_kv_heads": max(1, heads // 4),
         "mlp.d_ff": round(args.d_model * 2.6875)})
    return archlab.TransformerLM(cfg).eval()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, metavar="FOLDER",
                    help="a run or HF folder with a chat template: a real conversation through archlab chat's "
                    "session (the toy model's --user, --d-model and the server's table do not apply)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--user", type=int, default=60, help="tokens each user turn adds")
    ap.add_argument("--answer", type=int, default=60, help="tokens of each answer")
    ap.add_argument("--d-model", type=int, default=256, help="model width (heads of 32, GQA 4:1, d_ff 2.69x)")
    ap.add_argument("--repeats", type=int, default=15, help="repeats of the breakdown (min taken)")
    ap.add_argument("--growth", type=int, default=1000, metavar="HELD",
                    help="the growth table: a turn whose cache holds HELD tokens crosses its capacity (0: skip it)")
    ap.add_argument("--growth-only", action="store_true", help="the growth table alone (with --model: no chat)")
    ap.add_argument("--no-server", action="store_true", help="skip the server's table")
    ap.add_argument("--breakdown-only", action="store_true",
                    help="the breakdown alone (no conversations, no server): for wide models, e.g. --d-model 1024")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (a shared machine's load drops out)")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    start(args)
    if args.growth_only:
        from archlab.runs.model_folder import load_model_and_tokenizer
        model = load_model_and_tokenizer(args.model, "cpu", purpose="chat")[0] if args.model else toy_model(args)
        print_growth_turn(model.eval(), args.growth, args.user, args.answer, args.repeats)
        return
    if args.model:
        model, cfg, cases = model_chat(args)
    else:
        model = toy_model(args)
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        users = [torch.randint(0, cfg.vocab_size, (args.user,), generator=g).tolist() for _ in range(args.turns)]
        last = args.turns - 1
        if args.breakdown_only:        # the history's tokens drawn at random: the breakdown's times depend on lengths
            kept = torch.randint(0, cfg.vocab_size, (args.turns * (args.user + args.answer),), generator=g).tolist()
        else:
            conversation(model, users[:2], 4, True)                                         # warm-up
            times: dict[bool, list[list[float]]] = {True: [], False: []}
            for r in range(args.rounds):
                for cached in ((True, False) if r % 2 == 0 else (False, True)):
                    ttft, history = conversation(model, users, args.answer, cached)
                    times[cached].append(ttft)
                    if cached:
                        kept = history
                    else:
                        assert history == kept, "the cached conversation decoded different answers"
            med = {c: [statistics.median(t[i] for t in times[c]) for i in range(args.turns)] for c in (True, False)}
            print(f"d_model {args.d_model}: time to first token (ms, {args.clock} clock), median of {args.rounds} "
                  f"interleaved rounds; {args.user} user + {args.answer} answer tokens a turn")
            print(f"{'turn':>4} {'prompt':>7} {'cached':>8} {'fresh':>8}")
            for i in range(args.turns):
                print(f"{i + 1:>4} {(i + 1) * args.user + i * args.answer:>7} {1e3 * med[True][i]:>8.1f} "
                      f"{1e3 * med[False][i]:>8.1f}")
            print(f"turn {args.turns} / turn 1: cached {med[True][last] / med[True][0]:.2f}x (against the fresh turn 1 "
                  f"{med[True][last] / med[False][0]:.2f}x), fresh {med[False][last] / med[False][0]:.2f}x; at turn "
                  f"{args.turns} the cache is {med[False][last] / med[True][last]:.1f}x faster to the first token")

        last_prompt = kept[:args.turns * args.user + last * args.answer]
        cases = {1: (users[0], 0), args.turns: (last_prompt, len(last_prompt) - args.user - 1)}
    if not args.breakdown_only:
        print_first_turn(model, cases[1][0], args.repeats)
        if args.growth:
            print_growth_turn(model, args.growth, args.user, args.answer, args.repeats)
    parts: dict[int, list[dict[str, float]]] = {t: [] for t in cases}
    for _ in range(3):                                 # interleaved: turn 1, the last turn, again
        for turn, (prompt, held) in cases.items():
            parts[turn].append(breakdown(model, prompt, held, max(1, args.repeats // 3)))
    print(f"where the time to first token goes (ms, each the least of {3 * max(1, args.repeats // 3)} interleaved "
          "repeats): setup | prefill = attention + the rest of the forward (timed with attention skipped) | "
          "the first token")
    print(f"{'turn':>4} {'keys':>5} {'total':>7} {'setup':>6} {'prefill':>8} {'attn':>6} {'other':>6} {'sample':>6}")
    best = {t: {k: min(p[k] for p in parts[t]) for k in parts[t][0]} for t in parts}
    for turn, (prompt, _) in cases.items():
        b = best[turn]
        print(f"{turn:>4} {len(prompt):>5} {b['total']:>7.1f} {b['setup']:>6.2f} {b['prefill']:>8.1f} "
              f"{b['prefill'] - b['rest']:>6.1f} {b['rest']:>6.1f} {b['sample']:>6.2f}")
    first, end = best[1], best[args.turns]
    grew = {k: end[k] - first[k] for k in end}
    print(f"turn {args.turns} - turn 1: {grew['total']:+.1f} ms ({end['total'] / first['total']:.2f}x), of which "
          f"attention {grew['prefill'] - grew['rest']:+.1f} ms, the rest of the forward {grew['rest']:+.1f} ms, "
          f"setup {grew['setup']:+.2f} ms, the first token {grew['sample']:+.2f} ms")
    work = {turn: attention_work(cfg, len(prompt) - held, len(prompt)) for turn, (prompt, held) in cases.items()}
    (flops, exps), (rate, exp_rate) = work[args.turns], machine_rates()
    floor = 1e3 * (flops / rate + exps / exp_rate)      # ms: the last turn's attention at the kernels' rates
    first_rest = first['total'] - (first['prefill'] - first['rest'])     # turn 1 less its attention
    print(f"attention's work: turn 1 {work[1][0] / 1e9:.3f} GFLOP, turn {args.turns} {flops / 1e9:.3f} GFLOP and "
          f"{exps / 1e6:.2f}M exponentials ({flops / 1e6 / (end['prefill'] - end['rest']):.0f} GFLOP/s as measured); "
          f"at this machine's rates ({rate / 1e9:.0f} GFLOP/s for a 512x512 float32 matmul, {exp_rate / 1e9:.1f}G "
          f"exp/s) it takes at least {floor:.1f} ms: turn {args.turns} / turn 1 >= "
          f"{(first_rest + floor) / first['total']:.2f}x with any attention kernel (turn 1 as measured)")

    if args.no_server or args.breakdown_only or args.model:
        return
    g = torch.Generator().manual_seed(1)
    small = [torch.randint(0, 256, (args.user,), generator=g).tolist() for _ in range(args.turns)]
    answers = [torch.randint(0, 256, (args.answer,), generator=g).tolist() for _ in range(args.turns)]
    server_turns(model, small[:2], answers[:2], True)                              # warm-up
    serve: dict[bool, list[list[float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, out = server_turns(model, small, answers, cached)
            serve[cached].append(seconds)
            if cached:
                found = out
            else:
                assert [t for t, _ in out] == [t for t, _ in found], "the server's answers differ with the cache"
    smed = {c: [statistics.median(t[i] for t in serve[c]) for i in range(args.turns)] for c in (True, False)}
    print(f"the server (Engine, one row): a one-token request per turn (ms, median of {args.rounds} interleaved "
          "rounds), with the prefix cache and without; cached tokens as usage reports them")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>8} {'found':>6} {'uncached':>9}")
    for i in range(args.turns):
        print(f"{i + 1:>4} {(i + 1) * args.user + i * args.answer:>7} {1e3 * smed[True][i]:>8.1f} "
              f"{found[i][1]:>6} {1e3 * smed[False][i]:>9.1f}")
    print(f"turn {args.turns}: the prefix cache answers {smed[False][last] / smed[True][last]:.1f}x sooner; "
          f"turn {args.turns} / turn 1 with it {smed[True][last] / smed[True][0]:.2f}x")


if __name__ == "__main__":
    main()
