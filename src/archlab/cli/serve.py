"""`archlab serve`: an OpenAI-compatible HTTP server over a run folder or an HF folder."""
from __future__ import annotations

import argparse
import math
import sys

from archlab.serve.limits import MB, Limits

SERVE_EXAMPLE = """example:
  archlab serve runs/demo --port 8000
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "ROMEO:", "max_tokens": 32, "temperature": 0.8}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \\
             print(c.completions.create(model='demo', prompt='ROMEO:', max_tokens=32).choices[0].text)"
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API (FastAPI + uvicorn)",
                              description="OpenAI-compatible completions (and chat where the tokenizer has a "
                              "chat template) over a run folder or an HF folder holding a decoder-only LM; streaming "
                              "as server-sent events. The folder's generation_config.json (EOS ids, sampling, stop "
                              "strings, no_repeat_ngram_size, bad_words_ids, forced bos/eos, min lengths, "
                              "repetition_penalty, max_new_tokens) gives the defaults a request's own fields "
                              "override; the startup line and /v1/models list them. A field the server does not honour "
                              "is refused as OpenAI refuses it (a JSON 400 naming it); a request body past "
                              "--max-request-mb is a 413; on SIGTERM a request whose body is still arriving is "
                              "answered 503 at once, and requests generating are cancelled after --shutdown-timeout "
                              "seconds. Finished requests leave their keys and values in the KV cache's rows: a "
                              "request whose prompt shares a token prefix with a row (a chat's next turn, a shared "
                              "system prompt) prefills only the rest (usage.prompt_tokens_details.cached_tokens "
                              "counts them); the least recently used row is evicted first.",
                              epilog=SERVE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="RUN_OR_HF_FOLDER", help="a run folder or a Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--max-request-mb", type=float, default=Limits.max_body_bytes / MB,
                   help="largest request body in MB; a larger one is refused with 413 (default %(default)g)")
    p.add_argument("--shutdown-timeout", type=float, default=Limits.shutdown_timeout_s,
                   help="seconds SIGTERM waits for open requests before cancelling them (default %(default)g)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together at most (continuous batching; default %(default)s)")
    p.add_argument("--cache-rows", type=int, default=None,
                   help="rows of KV cache, each --context tokens long (default: --max-batch); the rows not "
                   "decoding keep finished requests' prefixes for later ones, e.g. --cache-rows 32 keeps 24 "
                   "conversations while 8 decode")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="tokens each KV cache row holds: a prompt plus its max_tokens must fit (default: the "
                   "model's context, cut so the whole cache fits in 2 GiB or a quarter of the free memory, the "
                   "smaller; the startup line says what was chosen), e.g. --context 32768")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (no reuse of what a row holds)")
    p.set_defaults(func=run)


def run(args) -> int:
    from archlab.errors import UserError

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} must be in 0..65535")
    if not 0 < args.max_request_mb < math.inf:
        raise UserError(f"--max-request-mb {args.max_request_mb:g} must be a number of MB > 0")
    if not 0 <= args.shutdown_timeout < math.inf:
        raise UserError(f"--shutdown-timeout {args.shutdown_timeout:g} must be a number of seconds >= 0")
    try:
        import uvicorn  # noqa: F401 - the serve extra's, checked before the model loads
    except ImportError:
        raise UserError("archlab serve needs the serve extra: pip install 'archlab[serve]'") from None
    from archlab.cli.generate import check_device
    from archlab.serve import Engine, create_app
    from archlab.serve.server import make_server

    if args.max_batch < 1:
        raise UserError(f"--max-batch {args.max_batch} must be >= 1")
    if args.cache_rows is not None and args.cache_rows < args.max_batch:
        raise UserError(f"--cache-rows {args.cache_rows} must be at least --max-batch {args.max_batch}")
    check_device(args.device)
    if args.context is not None and args.context < 1:
        raise UserError(f"--context {args.context} must be >= 1")
    engine = Engine.from_folder(args.path, args.device, args.max_batch, cache_rows=args.cache_rows,
                                context=args.context, prefix_cache=not args.no_prefix_cache)
    print(f"serving {engine.name} (context {engine.context}) on http://{args.host}:{args.port}/v1", flush=True)
    if engine.applied:
        print("generation_config.json, the defaults under each request's fields: "
              + ", ".join(f"{k}={v}" for k, v in engine.applied.items()), flush=True)
    if engine.not_applied:
        print("generation_config.json, not applied (one sequence a request, no beam search): "
              + ", ".join(engine.not_applied), flush=True)
    print(cache_line(engine), flush=True)
    shared = int8_warning(engine.model, engine.max_batch, prefix_cache=not args.no_prefix_cache)
    if shared:
        print(shared, file=sys.stderr, flush=True)
    print(f"up to {engine.max_batch} decoding at once; prefix cache "
          + ("off" if args.no_prefix_cache else "on (rows not decoding keep finished requests' tokens; the least "
                                              "recently used is evicted first)"),
          flush=True)
    limits = Limits(max_body_bytes=int(args.max_request_mb * MB), shutdown_timeout_s=args.shutdown_timeout)
    # a client holding a half-sent body is answered 503 as the server starts stopping (archlab.serve.server);
    # requests already generating get the graceful-shutdown timeout to finish
    make_server(create_app(engine, limits), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=limits.shutdown_timeout_s).run()
    return 0


def cache_line(engine) -> str:
    """What the KV cache holds and, where the model's context was cut to fit, how to change it."""
    from archlab.units import human_bytes

    rows = len(engine.slots.length)
    line = (f"KV cache: {rows} {'row' if rows == 1 else 'rows'} x {engine.context:,} tokens, "
            f"{human_bytes(engine.slots.nbytes)}")
    most = engine.model.config.max_seq_len
    if engine.plan.cut and engine.plan.budget:
        line += (f" (the model's context {most:,} cut to fit {human_bytes(engine.plan.budget)}: 2 GiB or a quarter "
                 f"of the free memory; --context {most} for all of it, fewer --cache-rows / --max-batch for "
                 "longer rows)")
    elif engine.plan.cut:
        line += f" (--context; the model's is {most:,})"
    return line


def int8_warning(model, max_batch: int, prefix_cache: bool) -> str | None:
    """A warning where the answers can depend on what is batched beside them: int8 layers whose kernel
    quantizes a forward's rows with one scale (archlab.nn.int8.rows_quantized_together: fbgemm's dynamic int8)."""
    from archlab.nn.int8 import rows_quantized_together

    if not rows_quantized_together(model) or (max_batch == 1 and not prefix_cache):
        return None
    return ("warning: this model's int8 layers quantize the activations of a forward's rows with one scale, so a "
            "greedy answer can change with the requests decoded beside it (and with the prefix a row held); "
            "--max-batch 1 --no-prefix-cache gives every request the answer `archlab generate` gives")
