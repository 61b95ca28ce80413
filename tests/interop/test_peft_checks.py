"""PEFT adapters whose config and tensors disagree are refused with one line naming the key, as PEFT refuses them
(or would silently compute something else); regex target_modules select what PEFT selects."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from archlab.config import ConfigError
from archlab.interop import load_hf
from archlab.interop.hf import WeightsError
from archlab.interop.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE, hf_slots, peft_targeted
from archlab.nn.lora import LoRAConfig, apply_lora, lora_modules

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)


def _hf(kind: str = "llama"):
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


@pytest.fixture
def llama(tmp_path):
    """(the base folder, a PEFT adapter folder on q_proj and v_proj at r=4 with non-zero B)."""
    base = tmp_path / "base"
    _hf().save_pretrained(base, safe_serialization=True)
    model = peft.get_peft_model(_hf(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    return base, tmp_path / "adapter"


def _edit_config(folder, **changes) -> None:
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _peft_loads(folder) -> bool:
    try:
        peft.PeftModel.from_pretrained(_hf(), folder)
    except (RuntimeError, ValueError):
        return False
    return True


Q0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("changes, message", [
    ({"r": 8}, rf"r=8 but {PREFIX}{Q0}\.lora_A\.weight is \(4, 64\) and lora_B \(64, 4\) \(rank 4\)"),
    ({"rank_pattern": {"q_proj": 2}}, r"rank_pattern\['q_proj'\]=2 but .*q_proj\.lora_A\.weight is \(4, 64\)"),
])
def test_a_rank_that_disagrees_with_the_tensors_is_refused_as_peft_refuses(llama, changes, message):
    base, adapter = llama
    assert load_hf(base, adapter=adapter) is not None            # the adapter as saved loads
    _edit_config(adapter, **changes)
    assert not _peft_loads(adapter), "PEFT itself refuses this adapter: the claim rests on it"
    with pytest.raises(ConfigError, match=message):
        load_hf(base, adapter=adapter)


def test_target_modules_that_do_not_name_the_tensors_are_refused(llama):
    base, adapter = llama
    _edit_config(adapter, target_modules=["q_proj"])             # v_proj's tensors would be dropped by PEFT
    with pytest.raises(ConfigError, match=r"target_modules=\['q_proj'\] does not name model\.layers\.0\.self_attn"
                                          r"\.v_proj.*PEFT would drop them"):
        load_hf(base, adapter=adapter)
    _edit_config(adapter, target_modules=["q_proj", "v_proj", "k_proj"])   # k_proj named, no tensors
    with pytest.raises(ConfigError, match=r"names model\.layers\.0\.self_attn\.k_proj, which has no lora_A"):
        load_hf(base, adapter=adapter)
    _edit_config(adapter, target_modules=r".*\.(q|v)_proj")              # the regex form naming the same
    assert len(lora_modules(load_hf(base, adapter=adapter))) == 2 * LLAMA["num_hidden_layers"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_adapter_tensors_are_refused_naming_the_tensor(llama, value):
    base, adapter = llama
    tensors = safetensors_torch.load_file(adapter / WEIGHTS_FILE)
    name = f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name][3, 1] = value
    safetensors_torch.save_file(tensors, adapter / WEIGHTS_FILE)
    with pytest.raises(WeightsError, match=rf"tensor {name} \(32, 4\) holds 1 NaN or inf value"):
        load_hf(base, adapter=adapter)


def _peft_selected(kind: str, target: str) -> set[str]:
    model = peft.get_peft_model(_hf(kind), peft.LoraConfig(r=2, target_modules=target,
                                                            fan_in_fan_out=kind == "gpt2"))
    return {name.removeprefix(PREFIX) for name, m in model.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("kind, target", [
    ("llama", r".*\.(q|v)_proj"),
    ("llama", r"model\.layers\.0\..*_proj"),                       # full match: layer 0 only, mlp too
    ("llama", r".*mlp\.(gate|down)_proj"),
    ("gpt2", r"transformer\.h\.1\.(attn\.c_attn|mlp\.c_fc)"),
])
def test_a_regex_target_selects_the_modules_peft_selects(tmp_path, kind, target):
    base = tmp_path / "base"
    _hf(kind).save_pretrained(base, safe_serialization=True)
    from archlab.interop.peft import hf_module_names

    ours = load_hf(base)
    apply_lora(ours, LoRAConfig(r=2, targets=(target,)), module_names=hf_module_names(ours))
    slots = hf_slots(ours)
    chosen = {slots[path].module for path in lora_modules(ours)}
    expected = _peft_selected(kind, target)
    assert chosen == expected and expected
    assert all(peft_targeted({"target_modules": target}, m) for m in chosen)


def test_an_invalid_regex_target_is_refused_naming_it(tmp_path):
    base = tmp_path / "base"
    _hf().save_pretrained(base, safe_serialization=True)
    with pytest.raises(ConfigError, match=r"lora target '\.\*\(q_proj' is not a valid regular expression"):
        apply_lora(load_hf(base), LoRAConfig(targets=(".*(q_proj",)))


def test_a_rank_above_a_targets_width_warns_in_one_line(tmp_path):
    """r > min(in, out) is legal in PEFT (its adapter loads alike), so archlab warns in one line, not refuses."""
    base = tmp_path / "base"
    _hf().save_pretrained(base, safe_serialization=True)
    with pytest.warns(UserWarning, match=r"lora\.r=40 exceeds min\(in, out\)=32 of blocks\.0\.attn\.k_proj "
                                         r"\(32x64\) \(and 3 more\)") as caught:
        apply_lora(load_hf(base), LoRAConfig(r=40, targets=("q", "k", "v")))
    assert len([w for w in caught if "exceeds" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")                             # r = min(in, out): no warning
        apply_lora(load_hf(base), LoRAConfig(r=32, targets=("q", "k", "v")))
