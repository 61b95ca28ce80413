"""An exported HF folder carries the run's chat template: `convert --to-hf` of a run whose tokenizer was given a
built-in chat format writes it into tokenizer_config.json's chat_template (and chat_template.jinja), and
transformers' AutoTokenizer on the export renders and tokenizes a conversation as archlab does on the run."""
from __future__ import annotations

import json

import pytest
import torch

from archlab.cli import main
from archlab.tokenizer import train
from archlab.tokenizer.chat import apply_chat_template
from archlab.tokenizer.chat_builtin import install_chat_template

transformers = pytest.importorskip("transformers")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse cat"},
        {"role": "assistant", "content": "tac"}, {"role": "user", "content": "and dog?"}]


# a template of the user's own that reads the special tokens' roles: a tokenizer trained here has no
# tokenizer_config.json, so the roles come from its special tokens, here as in the export
OWN = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
       "{{ m.content + eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
       "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.mark.parametrize("name", ["chatml", "llama3", "own"])
def test_convert_to_hf_carries_the_chat_template(tmp_path, name):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("reverse the word cat and the word dog, please: tac god\n" * 30)
    tok = train([corpus], 300, ["<|endoftext|>"])
    source = tmp_path / "source"             # a tiny HF decoder, converted to a run folder given our tokenizer
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.vocab_size + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64)).save_pretrained(source)
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(source), "--out", str(run)]) == 0
    tok.save(run / "tokenizer")
    if name == "own":
        (run / "tokenizer" / "chat_template.jinja").write_text(OWN)
    else:
        install_chat_template(run / "tokenizer", name)
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (run / "tokenizer" / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").unlink()            # tokenizer_config.json alone carries it
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for prompt in (False, True):
        kw = {"add_generation_prompt": prompt}
        assert (theirs.apply_chat_template(CHAT, tokenize=False, **kw)
                == apply_chat_template(run / "tokenizer", CHAT, tokenize=False, **kw))
        ref = theirs.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True, **kw)
        ours = apply_chat_template(run / "tokenizer", CHAT, return_dict=True, return_assistant_tokens_mask=True, **kw)
        assert ours["input_ids"] == list(ref["input_ids"]) and ours["assistant_masks"] == list(ref["assistant_masks"])
