"""What rendering chat templates in a worker process costs: the same conversation through the same template,
rendered in this process (chat_sandbox.render, the environment alone) and through archlab.tokenizer.chat's
worker (JSON over a pipe, time/memory/output limits), and through transformers' apply_chat_template (text
only) when it is installed; then chat data (archlab.data.chat) per example, with a template with
{% generation %} (one render) and without (2 renders per assistant turn + 1).

    python benchmarks/chat_render.py                 # 2000 renders, 500 examples
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CONVERSATION = [{"role": "system", "content": "You are a helpful assistant. " * 3},
                {"role": "user", "content": "What is the capital of France? " * 4},
                {"role": "assistant", "content": "The capital of France is Paris. " * 6},
                {"role": "user", "content": "And of Italy?"},
                {"role": "assistant", "content": "Rome. " * 4}]


def per_call(fn, n: int) -> float:
    fn()                                                  # warm: compile, start the worker
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6     # microseconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--renders", type=int, default=2000)
    parser.add_argument("--examples", type=int, default=500)
    args = parser.parse_args()

    from archlab.data.chat import load_chat_data
    from archlab.runs.provenance import provenance_line
    from archlab.tokenizer import train
    from archlab.tokenizer.chat import render_chat
    from archlab.tokenizer.chat_builtin import CHAT_FORMATS, install_chat_template
    from archlab.tokenizer.chat_sandbox import render

    print(provenance_line(), flush=True)
    template = CHAT_FORMATS["chatml"].source("<|endoftext|>")
    context = {"messages": CONVERSATION, "tools": None, "documents": None, "add_generation_prompt": False}
    inproc = per_call(lambda: render(template, context, track=True, max_chars=4_000_000), args.renders)
    worker = per_call(lambda: render_chat(template, CONVERSATION, track_generation=True), args.renders)
    print(f"render chatml, 5 messages: in-process {inproc:.0f} us, worker {worker:.0f} us "
          f"(+{worker - inproc:.0f} us, {worker / inproc:.1f}x)")
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
        theirs = per_call(lambda: render_jinja_template([CONVERSATION], chat_template=template), args.renders)
        print(f"transformers render_jinja_template: {theirs:.0f} us")
    except ImportError:
        pass

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "corpus.txt").write_text(" ".join(m["content"] for m in CONVERSATION) * 50)
        train(root / "corpus.txt", 400, ["<|endoftext|>"]).save(root / "tok")
        install_chat_template(root / "tok", "chatml")
        data = root / "data.jsonl"
        data.write_text((json.dumps({"messages": CONVERSATION}) + "\n") * args.examples)
        untagged = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        for name, source in (("{% generation %} spans", None), ("rendered-prefix differences", untagged)):
            started = time.perf_counter()
            load_chat_data(data, root / "tok", chat_template=source, progress=False)
            seconds = time.perf_counter() - started
            print(f"chat data, {name}: {args.examples / seconds:.0f} examples/s "
                  f"({seconds / args.examples * 1e3:.2f} ms each)")


if __name__ == "__main__":
    main()
