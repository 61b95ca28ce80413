"""No checkpoint tensor is dropped unchecked. A tensor transformers ties to another (a tied head, BERT's decoder and
its bias, T5's and BART's per-stack embeddings) or computes (Marian's sinusoids) is read, proven equal to what is
read, or -- when it differs -- used as transformers uses it (the head unties) or refused by name. Checked against
transformers loading the same folder: tiny random llama, gpt2, bert and t5 saved by transformers with perturbed
copies, then every family, each candidate tensor taken from transformers' own tie table and state dict."""
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from archlab.interop import FAMILIES, WeightsError, load_hf, save_hf  # noqa: E402
from archlab.interop.convert import compare_with_transformers  # noqa: E402
from archlab.models import build_model, presets  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOLERANCE = 1e-4   # max |ours - theirs| / max |theirs|, fp32
FILE = "model.safetensors"


def _edit(folder, **tensors) -> None:
    """Add or replace tensors of folder/model.safetensors."""
    state = load_file(folder / FILE)
    state.update({name.replace("__", "."): t.contiguous() for name, t in tensors.items()})
    save_file(state, str(folder / FILE), metadata={"format": "pt"})


def _set(folder, name: str, value: torch.Tensor) -> None:
    _edit(folder, **{name.replace(".", "__"): value})


def _noise(like: torch.Tensor, seed: int = 7) -> torch.Tensor:
    return like + torch.randn(like.shape, generator=torch.Generator().manual_seed(seed))


def _max_rel(folder) -> float:
    return compare_with_transformers(folder, seq_len=10)["max_rel"]


def _save_hf_model(model, folder):
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# ---- the four families the defect was found in, saved by transformers ------------------------------------------
def _llama(folder):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return _save_hf_model(transformers.LlamaForCausalLM(config), folder)


def _gpt2(folder):
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return _save_hf_model(transformers.GPT2LMHeadModel(config), folder)


def _bert(folder):
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32)
    return _save_hf_model(transformers.BertForMaskedLM(config), folder)


def _t5(folder):
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0)
    return _save_hf_model(transformers.T5ForConditionalGeneration(config), folder)


# (builder, the copy written with other values, the tensor it copies)
UNTIES = {
    "llama lm_head": (_llama, "lm_head.weight", "model.embed_tokens.weight"),
    "gpt2 lm_head": (_gpt2, "lm_head.weight", "transformer.wte.weight"),
    "bert decoder weight": (_bert, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
    "bert decoder bias": (_bert, "cls.predictions.decoder.bias", "cls.predictions.bias"),
    "t5 lm_head": (_t5, "lm_head.weight", "shared.weight"),
}


@pytest.mark.parametrize("case", sorted(UNTIES))
def test_a_stored_copy_that_differs_is_used_as_transformers_uses_it(tmp_path, case):
    build, copy, source = UNTIES[case]
    folder = build(tmp_path / "hf")
    assert copy not in load_file(folder / FILE)          # transformers 5 writes no tied copy
    assert _max_rel(folder) < TOLERANCE
    _set(folder, copy, load_file(folder / FILE)[source].clone())   # an equal copy (older writers): dropped
    assert load_hf(folder).config.tie_embeddings
    assert _max_rel(folder) < TOLERANCE
    _set(folder, copy, _noise(load_file(folder / FILE)[source]))   # its own values: transformers uses them
    ours = load_hf(folder)
    assert ours.config.tie_embeddings == (case == "bert decoder bias")   # the bias alone keeps the head tied
    assert _max_rel(folder) < TOLERANCE


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_a_t5_stack_embedding_of_its_own_is_refused_by_name(tmp_path, side):
    """transformers embeds each stack's tokens with its own `embed_tokens` when it differs from `shared`;
    archlab's encoder-decoder has one embedding, so the load names the tensor instead of dropping it."""
    folder = _t5(tmp_path / "hf")
    shared = load_file(folder / FILE)["shared.weight"]
    _edit(folder, encoder__embed_tokens__weight=shared.clone(), decoder__embed_tokens__weight=shared.clone())
    assert _max_rel(folder) < TOLERANCE
    _set(folder, f"{side}.embed_tokens.weight", _noise(shared))
    with pytest.raises(WeightsError, match=rf"^t5 checkpoint tensor {side}\.embed_tokens\.weight differs") as err:
        load_hf(folder)
    assert "\n" not in str(err.value)


def test_a_file_holding_only_the_head_copy_reads_it_as_the_embedding(tmp_path):
    """transformers ties the other way round when only the tied copy is stored; so does archlab."""
    folder = _llama(tmp_path / "hf")
    state = load_file(folder / FILE)
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(folder / FILE), metadata={"format": "pt"})
    assert load_hf(folder).config.tie_embeddings
    assert _max_rel(folder) < TOLERANCE


# ---- every family: each tensor transformers would read is read by archlab, or refused by name ------------------
def _hf_built(model_type: str, **kw):
    return FAMILIES.get(model_type).to_config(transformers.AutoConfig.for_model(model_type, **kw).to_dict())


TINY_HF = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
PRESET = {"bert": "bert-base", "roberta": "roberta-base", "gpt2": "gpt2", "t5": "t5-11b", "bart": "bart-large",
          "marian": "marian", "gptj": "gpt-j-6b", "gpt_neox": "gpt-neox-20b", "opt": "opt-175b", "llama": "llama2-7b",
          "mistral": "mistral-7b", "ministral": "mistral-7b", "phi3": "phi3-mini", "mixtral": "mixtral-8x7b",
          "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-8b", "olmo": "olmo-7b", "olmo2": "olmo2-7b", "gemma2": "gemma2-2b",
          "gemma3_text": "gemma3-27b", "nemotron": "nemotron4-340b", "falcon": "falcon-7b",
          "cohere": "command-r-plus", "cohere2": "command-a"}
BUILT = {"gemma": lambda: _hf_built("gemma", head_dim=8, num_key_value_heads=2, **TINY_HF),
         "phi": lambda: _hf_built("phi", **TINY_HF),
         "olmoe": lambda: _hf_built("olmoe", num_experts=4, num_experts_per_tok=2, **TINY_HF),
         "qwen2_moe": lambda: _hf_built("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=40, num_key_value_heads=2,
                                        **TINY_HF),
         "bloom": lambda: presets.tiny("bloom-176b").with_overrides({"mlp.d_ff": 4 * 64})}   # HF's 4 * d


def _family_folder(model_type: str, folder, tied: bool = True):
    cfg = BUILT[model_type]() if model_type in BUILT else presets.tiny(PRESET[model_type])
    model = build_model(cfg.with_overrides({"tie_embeddings": tied}))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen)) if p.dim() == 1 else p.mul_(3.0)
    save_hf(model, folder, family=model_type)
    return folder


@pytest.mark.parametrize("model_type", sorted(FAMILIES.names()))
def test_an_untied_export_gives_transformers_every_tensor_it_reads(tmp_path, model_type):
    """tie_word_embeddings=false ties nothing in transformers: BART's and Marian's stacks read their own
    embed_tokens, which save_hf writes (a file without them loads with random embeddings)."""
    folder = _family_folder(model_type, tmp_path / model_type, tied=False)
    assert _max_rel(folder) < TOLERANCE


def _transformers_tensors(folder) -> tuple[dict[str, str], dict[str, torch.Size]]:
    """(tied copy -> what it copies, from every `_tied_weights_keys` in the model, whatever the config says;
    name -> shape of each tensor transformers' model holds)."""
    arch = {"encoder": "AutoModelForMaskedLM", "encoder_decoder": "AutoModelForSeq2SeqLM"}.get(
        load_hf(folder).config.arch, "AutoModelForCausalLM")
    model = getattr(transformers, arch).from_pretrained(folder)
    ties = {}
    for prefix, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel):
            dot = f"{prefix}." if prefix else ""
            ties.update({dot + k: dot + v for k, v in (module._tied_weights_keys or {}).items()})
    return ties, {name: t.shape for name, t in model.state_dict().items()}


@pytest.mark.parametrize("model_type", sorted(FAMILIES.names()))
def test_no_family_drops_a_tensor_transformers_would_use(tmp_path, model_type):
    """Every tensor transformers' class ties or holds that archlab's file lacks, written with values of its own:
    archlab's logits equal transformers' on the same folder, or the load refuses naming it. Written equal to
    what it copies, it loads (dropped as a proven copy)."""
    folder = _family_folder(model_type, tmp_path / model_type)
    stored = load_file(folder / FILE)
    ties, shapes = _transformers_tensors(folder)
    declared = FAMILIES.get(model_type).stored_copies(load_hf(folder).config)
    copies = {c.name: stored[c.source].clone() for c in declared if c.source in stored}
    copies.update({c.name: c.compute() for c in declared if c.compute is not None})
    assert copies, "a tied model without a declared copy"
    _edit(folder, **{n.replace(".", "__"): t for n, t in copies.items()})
    assert _max_rel(folder) < TOLERANCE, f"equal copies {sorted(copies)} change the logits"
    candidates = sorted((set(ties) | set(shapes) | set(copies)) - set(stored))
    for i, name in enumerate(candidates):
        original = load_file(folder / FILE).get(name)
        like = original if original is not None else stored.get(ties.get(name), torch.zeros(shapes[name]))
        _set(folder, name, _noise(like, seed=i))
        try:
            err = _max_rel(folder)
        except WeightsError as exc:
            assert name in str(exc) and "\n" not in str(exc)
        else:
            assert err < TOLERANCE, f"{name} with values of its own: archlab's logits differ by {err:.2e}"
        if original is not None:
            _set(folder, name, original)
        else:
            state = load_file(folder / FILE)
            del state[name]
            save_file(state, str(folder / FILE), metadata={"format": "pt"})


def test_convert_from_hf_keeps_a_head_of_its_own(tmp_path):
    """The run folder `convert --from-hf` writes (what generate and serve then load) holds the file's own head."""
    from archlab.interop.convert import convert_from_hf
    from archlab.runs.model_folder import load_run

    folder = _llama(tmp_path / "hf")
    _set(folder, "lm_head.weight", _noise(load_file(folder / FILE)["model.embed_tokens.weight"]))
    convert_from_hf(folder, tmp_path / "run")
    ours, _ = load_run(tmp_path / "run")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids), theirs(input_ids=ids, use_cache=False).logits
    assert not ours.config.tie_embeddings
    assert float((a - b).abs().max() / b.abs().max()) < TOLERANCE
