"""archlab.runs.model_folder: a run folder laid out as earlier `archlab convert` wrote it (config.yaml and one
model.safetensors, no checkpoints/) still opens, as data, for every kind of model."""
import pytest
import torch
import yaml
from safetensors.torch import save_file

from archlab.models import build_model, presets
from archlab.runs.checkpoint import CheckpointError
from archlab.runs.model_folder import load_model_and_tokenizer


@pytest.mark.parametrize("name", ["gpt2", "bert-base"])
def test_a_flat_run_folder_loads_its_weights(tmp_path, name):
    cfg = presets.tiny(name)
    model = build_model(cfg).eval()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded, tok = load_model_and_tokenizer(tmp_path, need_tokenizer=False, archs=("decoder", "encoder"))
    assert tok is None and type(loaded) is type(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    torch.testing.assert_close(loaded(ids), model(ids))


def test_a_flat_run_folder_with_other_weights_names_the_file(tmp_path):
    cfg = presets.tiny("gpt2")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    save_file({"embed.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors does not match"):
        load_model_and_tokenizer(tmp_path, need_tokenizer=False)
