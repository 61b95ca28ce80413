"""A tiny run folder with the built-in ChatML template, shared by the `archlab chat` and chat-endpoint tests.

Its head is edited so that greedy answers end with <|im_end|> (the template's end of turn) before the token
limit: the <|im_end|> row is twice the row of a token the model would write a few steps into its first answer,
so <|im_end|> wins where that token would (its logit doubles). Stopping at the end of turn is then exercised."""
from __future__ import annotations

import torch
from variants import BASE

import archlab
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import write_run_config
from archlab.tokenizer import Tokenizer
from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template
from archlab.tokenizer.chat_builtin import install_chat_template

END = "<|im_end|>"
FIRST = "hello there"


def render(root, messages: list[dict]) -> str:
    """The prompt text of `messages` with the generation prompt: the reference every test compares with."""
    return apply_chat_template(ChatTokenizer.of(root / "tokenizer"), messages, tokenize=False,
                               add_generation_prompt=True)


def make_chat_run(root, max_seq_len: int = 256, step: int = 3):
    """(run folder, model, tokenizer): a decoder whose tokenizer carries the chatml template and tokens."""
    torch.manual_seed(0)
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(root / "tokenizer")
    install_chat_template(root / "tokenizer", "chatml")
    tok = archlab.tokenizer.load(root / "tokenizer")
    cfg = BASE.with_overrides({"vocab_size": tok.vocab_size, "init.std": 0.2, "max_seq_len": max_seq_len,
                               "tie_embeddings": False})
    model = archlab.TransformerLM(cfg).eval()
    prompt = tok.encode(render(root, [{"role": "user", "content": FIRST}]))
    plain = archlab.generate(model, torch.tensor(prompt), 12)[len(prompt):].tolist()
    end = tok.token_to_id(END)
    with torch.no_grad():
        model.lm_head.weight[end] = 2 * model.lm_head.weight[plain[step]]
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 1, model.state_dict(), {})
    return root, model, tok
