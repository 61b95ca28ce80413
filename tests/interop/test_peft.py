"""LoRA adapters in PEFT's format, both ways, against PEFT itself (tiny random HF models saved locally):
our adapter -> save_peft -> PeftModel.from_pretrained(hf_base, DIR) gives our logits; a PEFT adapter ->
load_hf(base, adapter=DIR) gives PEFT's logits. LLaMA, T5 (both stacks: self-, cross-attention and MLP), GPT-2
(c_attn holds q, k and v; Conv1D weights), and adapters for another base."""
from __future__ import annotations

import json

import pytest
import torch

from archlab.config import ConfigError
from archlab.errors import UserError
from archlab.interop import load_hf
from archlab.interop.hf import WeightsError
from archlab.interop.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE, hf_module_names, save_peft
from archlab.nn.lora import LoRAConfig, apply_lora, lora_modules, merge_lora

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
T5 = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False)
GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _hf(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)).eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()


def _base_folder(tmp_path, kind: str):
    folder = tmp_path / f"base-{kind}"
    _hf(kind).save_pretrained(folder, safe_serialization=True)
    return folder


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(1, 128, (2, 9), generator=gen), torch.randint(1, 128, (2, 7), generator=gen)


@torch.no_grad()
def _theirs(model, kind: str) -> torch.Tensor:
    src, dec = _inputs()
    if kind == "t5":
        return model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits
    return model(input_ids=src, use_cache=False).logits


@torch.no_grad()
def _ours(model, kind: str) -> torch.Tensor:
    src, dec = _inputs()
    return model(src, dec) if kind == "t5" else model(src)


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, base: torch.Tensor) -> None:
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err < TOLERANCE, f"logits differ: max relative error {err:.2e}"
    assert float((theirs - base).abs().max()) > 1e-3, "the adapter changed nothing: the test would prove nothing"


def _randomize(params, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


CASES = [
    ("llama", ("q", "v", "down"), {}),
    ("llama", ("all-linear",), {"use_rslora": True}),
    ("llama", ("q_proj", "gate_proj"), {}),                              # the family's HF names
    ("t5", ("q", "k", "v", "o", "gate", "up", "down"), {}),             # both stacks, cross-attention too
    ("t5", ("SelfAttention.q", "EncDecAttention.v", "wo"), {}),          # T5's own module names
    ("gpt2", ("q", "v", "o", "up"), {}),                                 # q, v inside c_attn: rank_pattern
    ("gpt2", ("c_attn", "c_fc"), {}),                                    # c_attn: one shared A, like PEFT's
]


@pytest.mark.parametrize("kind, targets, extra", CASES)
def test_our_adapter_loads_in_peft_with_our_logits(tmp_path, kind, targets, extra):
    base = _base_folder(tmp_path, kind)
    ours = load_hf(base)
    plain = _ours(ours, kind)
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=targets, **extra), module_names=hf_module_names(ours))
    _randomize(p for m in lora_modules(ours).values() for p in (m.lora_A, m.lora_B))
    if targets == ("c_attn", "c_fc"):     # c_attn's q, k, v given one A, as one PEFT module has
        mods = lora_modules(ours)
        for i in range(2):
            a = mods[f"blocks.{i}.attn.q_proj"].lora_A
            for x in "kv":
                mods[f"blocks.{i}.attn.{x}_proj"].lora_A.data.copy_(a)
    save_peft(ours, tmp_path / "adapter", base_model=str(base))
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    if targets == ("c_attn", "c_fc"):
        assert config["rank_pattern"] == {} and config["fan_in_fan_out"] is True
    hf = peft.PeftModel.from_pretrained(_hf(kind), tmp_path / "adapter").eval()
    _assert_close(_ours(ours, kind), _theirs(hf, kind), plain)


@pytest.mark.parametrize("kind, targets, extra", [
    ("llama", ["q_proj", "v_proj", "up_proj"], {}),
    ("llama", "all-linear", {"use_rslora": True, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3}}),
    ("t5", ["q", "k", "v", "o", "wi_0", "wi_1", "wo"], {}),
    ("gpt2", ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}),
])
def test_peft_adapter_loads_here_with_peft_logits(tmp_path, kind, targets, extra):
    base = _base_folder(tmp_path, kind)
    hf = peft.get_peft_model(_hf(kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **extra))
    _randomize(p for n, p in hf.named_parameters() if "lora_" in n)
    hf.save_pretrained(tmp_path / "adapter")
    hf.eval()
    ours = load_hf(base, adapter=tmp_path / "adapter")
    _assert_close(_ours(ours, kind), _theirs(hf, kind), _theirs(_hf(kind), kind))
    merged = _ours(merge_lora(ours), kind)
    _assert_close(merged, _theirs(hf, kind), _theirs(_hf(kind), kind))


def test_adapter_keys_are_peft_names(tmp_path):
    from safetensors.torch import load_file
    ours = apply_lora(load_hf(_base_folder(tmp_path, "llama")), LoRAConfig(r=2, targets=("q",)))
    save_peft(ours, tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / WEIGHTS_FILE))
    assert f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * LLAMA["num_hidden_layers"]
    with pytest.raises(UserError, match="already exists"):
        save_peft(ours, tmp_path / "adapter")


def test_adapter_for_another_base_is_refused(tmp_path):
    base = _base_folder(tmp_path, "llama")
    wide = dict(LLAMA, hidden_size=96, intermediate_size=128)
    torch.manual_seed(0)
    other = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**wide)),
                                peft.LoraConfig(r=2, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "wide")
    with pytest.raises(WeightsError, match=r"adapter for another base: model\.layers\.0\.self_attn\.q_proj lora_A"):
        load_hf(base, adapter=tmp_path / "wide")
    gpt2 = peft.get_peft_model(_hf("gpt2"), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(WeightsError, match=r"transformer\.h\.0\.attn\.c_attn is not a Linear of this llama model"):
        load_hf(base, adapter=tmp_path / "gpt2")
    dora = peft.get_peft_model(_hf("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(tmp_path / "dora")
    with pytest.raises(ConfigError, match="use_dora=True is not supported"):
        load_hf(base, adapter=tmp_path / "dora")


def test_fine_tune_a_loaded_hf_model_with_adapters_then_peft_reads_them(tmp_path):
    """The Python API end to end: an HF base loaded here, adapters by the family's names, a few AdamW steps on a
    fixed batch (the loss falls, the base stays), the adapter saved and read by PEFT with our logits."""
    base = _base_folder(tmp_path, "llama")
    ours = apply_lora(load_hf(base).train(), LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")))
    frozen = {k: v.clone() for k, v in ours.state_dict().items() if not k.endswith(("lora_A", "lora_B"))}
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = _inputs()[0]
    losses = []
    for _ in range(8):
        loss = ours(ids, targets=ids).total
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in frozen.items())
    save_peft(ours.eval(), tmp_path / "adapter")
    hf = peft.PeftModel.from_pretrained(_hf("llama"), tmp_path / "adapter").eval()
    _assert_close(_ours(ours, "llama"), _theirs(hf, "llama"), _theirs(_hf("llama"), "llama"))


# ---- trainable token rows: PEFT's trainable_token_indices --------------------------------------------------------
TOKEN_IDS = [9, 3, 50]          # unsorted, as a user may list them


def _tied(kind: str):
    """The family with its head tied to the embedding (PEFT's tied adapter follows the embedding's rows)."""
    if kind == "llama-tied":
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(LLAMA, tie_word_embeddings=True))).eval()
    return _hf(kind)


def _folder(tmp_path, kind: str):
    folder = tmp_path / f"base-{kind}"
    _tied(kind).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "gpt2", "t5"])
def test_our_trainable_tokens_load_in_peft_with_our_logits(tmp_path, kind):
    model_kind = "t5" if kind == "t5" else "llama" if kind.startswith("llama") else kind
    base = _folder(tmp_path, kind)
    ours = load_hf(base)
    plain = _ours(ours, model_kind)
    targets = ("q", "v")
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=targets, trainable_tokens=tuple(TOKEN_IDS)),
               module_names=hf_module_names(ours))
    _randomize([ours.embed.trainable_tokens_delta, *(m.lora_B for m in lora_modules(ours).values())])
    save_peft(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert config["trainable_token_indices"] == sorted(TOKEN_IDS)
    hf = peft.PeftModel.from_pretrained(_tied(kind), tmp_path / "adapter").eval()
    _assert_close(_ours(ours, model_kind), _theirs(hf, model_kind), plain)
    # the rows alone change the logits: no LoRA, inputs that hold the listed tokens
    for m in lora_modules(ours).values():
        m.lora_B.data.zero_()
    save_peft(ours, tmp_path / "rows")
    hf = peft.PeftModel.from_pretrained(_tied(kind), tmp_path / "rows").eval()
    ids = torch.tensor([TOKEN_IDS + [1, 2] + TOKEN_IDS])
    with torch.no_grad():
        if model_kind == "t5":
            theirs, mine = hf(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits, ours(ids, ids)
            plain = load_hf(base)(ids, ids)
        else:
            theirs, mine, plain = hf(input_ids=ids, use_cache=False).logits, ours(ids), load_hf(base)(ids)
    _assert_close(mine, theirs, plain)


@pytest.mark.parametrize("kind, targets, indices", [
    ("llama", ["q_proj"], TOKEN_IDS),
    ("llama-tied", ["q_proj", "v_proj"], TOKEN_IDS),
    ("llama", ["q_proj"], {"embed_tokens": TOKEN_IDS}),                 # the dict form naming the input embedding
    ("gpt2", ["c_attn"], TOKEN_IDS),
    ("t5", ["q", "v"], TOKEN_IDS),
])
def test_peft_trainable_tokens_load_here_with_peft_logits(tmp_path, kind, targets, indices):
    model_kind = "t5" if kind == "t5" else "llama" if kind.startswith("llama") else kind
    base = _folder(tmp_path, kind)
    hf = peft.get_peft_model(_tied(kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          trainable_token_indices=indices))
    _randomize(p for p in hf.parameters() if p.requires_grad)
    hf.save_pretrained(tmp_path / "adapter")
    hf.eval()
    ours = load_hf(base, adapter=tmp_path / "adapter")
    assert ours.lora_config.trainable_tokens == tuple(sorted(TOKEN_IDS))
    theirs, plain = _theirs(hf, model_kind), _theirs(_tied(kind), model_kind)
    _assert_close(_ours(ours, model_kind), theirs, plain)
    _assert_close(_ours(merge_lora(ours), model_kind), theirs, plain)     # merged: the rows written into E


def test_trainable_tokens_peft_cannot_express_are_refused_naming_the_field(tmp_path):
    base = _base_folder(tmp_path, "llama")
    head = peft.get_peft_model(_hf("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                            trainable_token_indices={"lm_head": [3, 4]}))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ConfigError, match=r"trainable_token_indices for lm_head: archlab trains token rows of this "
                                          r"llama model's input embedding \(model\.embed_tokens\) only") as info:
        load_hf(base, adapter=tmp_path / "head")
    assert "\n" not in str(info.value)
    config = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    config["trainable_token_indices"] = [3, 3]
    (tmp_path / "head" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"trainable_token_indices=\[3, 3\] is not supported by archlab"):
        load_hf(base, adapter=tmp_path / "head")


# ---- whole modules: PEFT's modules_to_save -------------------------------------------------------------------------
@pytest.mark.parametrize("kind, targets, saved, hf_names", [
    ("gpt2", ("q", "v"), ("abs_position",), ["transformer.wpe"]),        # learned positions, by archlab's name
    ("gpt2", ("c_attn",), ("wpe", "ln_f"), ["transformer.ln_f", "transformer.wpe"]),   # by the family's names
    ("llama", ("q", "v"), ("final_norm", "lm_head"), ["lm_head", "model.norm"]),
    ("t5", ("q", "v"), ("final_layer_norm",), ["decoder.final_layer_norm", "encoder.final_layer_norm"]),
])
def test_our_modules_to_save_load_in_peft_with_our_logits(tmp_path, kind, targets, saved, hf_names):
    base = _base_folder(tmp_path, kind)
    ours = load_hf(base)
    plain = _ours(ours, kind)
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=targets, modules_to_save=saved),
               module_names=hf_module_names(ours))
    whole = [p for path in ours.lora_config.modules_to_save for p in ours.get_submodule(path).parameters()]
    assert whole and all(p.requires_grad for p in whole)
    _randomize(whole)
    save_peft(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert config["modules_to_save"] == hf_names
    hf = peft.PeftModel.from_pretrained(_hf(kind), tmp_path / "adapter").eval()
    _assert_close(_ours(ours, kind), _theirs(hf, kind), plain)


@pytest.mark.parametrize("kind, targets, saved", [
    ("gpt2", ["c_attn"], ["wpe"]),
    ("llama", ["q_proj"], ["norm"]),          # PEFT matches the name's end: every layer's norms and the last one
    ("t5", ["q", "v"], ["final_layer_norm"]),  # both stacks
])
def test_peft_modules_to_save_load_here_with_peft_logits(tmp_path, kind, targets, saved):
    base = _base_folder(tmp_path, kind)
    hf = peft.get_peft_model(_hf(kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                        modules_to_save=saved))
    _randomize(p for p in hf.parameters() if p.requires_grad)
    hf.save_pretrained(tmp_path / "adapter")
    hf.eval()
    ours = load_hf(base, adapter=tmp_path / "adapter")
    assert ours.lora_config.modules_to_save
    theirs, plain = _theirs(hf, kind), _theirs(_hf(kind), kind)
    _assert_close(_ours(ours, kind), theirs, plain)
    _assert_close(_ours(merge_lora(ours), kind), theirs, plain)


def test_modules_to_save_peft_cannot_match_are_refused(tmp_path):
    tied = _folder(tmp_path, "llama-tied")
    ours = load_hf(tied)
    apply_lora(ours, LoRAConfig(r=2, targets=("q",), modules_to_save=("embed_tokens",)),
               module_names=hf_module_names(ours))
    with pytest.raises(ConfigError, match=r"modules_to_save embed: the head is tied to it"):
        save_peft(ours, tmp_path / "tied")
    assert not (tmp_path / "tied").exists()
    base = _base_folder(tmp_path, "gpt2")
    hf = peft.get_peft_model(_hf("gpt2"), peft.LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["wpe"]))
    hf.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    config["modules_to_save"] = ["ln_f"]            # the file holds wpe's tensor, the config names another module
    (tmp_path / "adapter" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"tensor base_model\.model\.transformer\.wpe\.weight is not .* "
                                           r"modules_to_save"):
        load_hf(base, adapter=tmp_path / "adapter")
