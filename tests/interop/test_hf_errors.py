"""load_hf / save_hf refuse bad input with errors that name the problem; sharded checkpoints load."""
import json

import pytest
import torch

from archlab import ConfigError, ModelConfig, TransformerLM
from archlab.interop import WeightsError, infer_family, load_hf, save_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture
def llama_folder(tmp_path, tiny_kwargs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**tiny_kwargs())
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "llama"
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _rewrite_tensors(folder, edit):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_unknown_model_type_lists_known_ones(llama_folder):
    folder, _ = llama_folder
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "not_a_family"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not_a_family.*known:.*llama"):
        load_hf(folder)


def test_missing_tensor_is_named(llama_folder):
    folder, _ = llama_folder
    _rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(folder)


def test_extra_tensor_is_named(llama_folder):
    folder, _ = llama_folder
    _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(WeightsError, match=r"does not use.*model\.layers\.0\.mystery\.weight"):
        load_hf(folder)


def test_ignorable_buffers_are_ignored(llama_folder):
    """Old checkpoints store rotary inv_freq buffers: not weights, skipped silently."""
    folder, model = llama_folder
    _rewrite_tensors(folder, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.allclose(load_hf(folder)(ids), model(ids).logits, atol=1e-5)


def test_wrong_shape_is_named(llama_folder):
    folder, _ = llama_folder
    _rewrite_tensors(folder, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 64)}))
    with pytest.raises(WeightsError, match=r"blocks\.0\.attn\.q_proj\.weight.*shape"):
        load_hf(folder)


def test_absent_and_corrupt_config(tmp_path, llama_folder):
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf(tmp_path / "nothing")
    folder, _ = llama_folder
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        load_hf(folder)


def test_no_weights_file(llama_folder):
    folder, _ = llama_folder
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="neither model.safetensors"):
        load_hf(folder)


def test_unsupported_hf_switch_is_named(llama_folder):
    folder, _ = llama_folder
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="proportional"):
        load_hf(folder)


def test_sharded_checkpoint_loads(tmp_path, llama_folder):
    _, model = llama_folder
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.allclose(load_hf(sharded)(ids), model(ids).logits, atol=1e-5)


def test_save_hf_names_the_switch_no_family_expresses(tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, attention={"n_heads": 4},
                      position={"kind": "alibi"}, norm={"kind": "rmsnorm"})
    with pytest.raises(ConfigError, match="position.kind"):
        save_hf(TransformerLM(cfg), tmp_path / "out")


def test_save_hf_with_explicit_family_checks_it(tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, attention={"n_heads": 4, "window": 8})
    assert infer_family(cfg).model_type == "mistral"
    with pytest.raises(ConfigError, match="attention.window"):
        save_hf(TransformerLM(cfg), tmp_path / "out", family="llama")
