"""BERT's next-sentence head (nsp_head): a tiny random BertForPreTraining -> save_pretrained -> load_hf gives
transformers' prediction_logits (on the real tokens) and seq_relationship_logits on a right-padded batch, save_hf
of ours loads back into BertForPreTraining alike, the loss is MLM + NSP cross-entropy as transformers computes
it, and the parameter count equals BertForPreTraining's, at bert-base-uncased's size too."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_parity_bert import VOCAB, hf_config, padded_batch, randomize_1d  # noqa: E402
from test_published_configs import BERT_BASE_UNCASED, BERT_LARGE_UNCASED, to_config  # noqa: E402

from archlab.config import ConfigError  # noqa: E402
from archlab.interop import FAMILIES, load_hf, save_hf  # noqa: E402
from archlab.models import presets  # noqa: E402
from archlab.models.accounting import param_count  # noqa: E402
from archlab.models.encoder import EncoderLM  # noqa: E402

TOLERANCE = 1e-4


def build_pretraining(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = hf_config("bert", **overrides)
    config._attn_implementation = "eager"
    model = transformers.BertForPreTraining(config)
    randomize_1d(model, seed)
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def assert_both_logits_match(ours: EncoderLM, theirs, ids, mask, types) -> None:
    out = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    mlm = ours(ids, attention_mask=mask, token_type_ids=types)                        # (b, t, v)
    assert relative_error(mlm[real], out.prediction_logits[real]) < TOLERANCE
    hidden = ours(ids, attention_mask=mask, token_type_ids=types, return_hidden=True)  # (b, t, d)
    nsp = ours.next_sentence_logits(hidden)                                            # (b, 2)
    assert nsp.shape == out.seq_relationship_logits.shape == (2, 2)
    assert relative_error(nsp, out.seq_relationship_logits) < TOLERANCE


@pytest.mark.parametrize("tied", [True, False])
def test_pretraining_logits_match_transformers_both_ways(tmp_path, tied):
    hf = build_pretraining(tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert ours.config.nsp_head and ours.nsp_head is not None
    ids, mask, types = padded_batch(pad_id=0, side="right")
    assert_both_logits_match(ours, hf, ids, mask, types)
    # transformers 5 keeps an untied head's unused `bias` beside the decoder's own (test_parity_bert)
    assert ours.num_params() == param_count(ours.config) == hf.num_parameters() - (0 if tied else VOCAB)

    assert save_hf(ours, tmp_path / "back").model_type == "bert"
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "back", attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    assert back.config.architectures == ["BertForPreTraining"]
    assert_both_logits_match(ours, back, ids, mask, types)


def test_loss_is_mlm_plus_next_sentence_cross_entropy_as_transformers(tmp_path):
    hf = build_pretraining(seed=3)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids, mask, types = padded_batch(pad_id=0, side="right")
    labels = torch.full_like(ids, -100)
    labels[0, [1, 4, 7]] = ids[0, [1, 4, 7]]
    labels[1, 2] = ids[1, 2]
    nsp_labels = torch.tensor([1, 0])
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                    next_sentence_label=nsp_labels).loss
        out = ours(ids, attention_mask=mask, token_type_ids=types, targets=labels, next_sentence_labels=nsp_labels)
    assert out.nsp_loss is not None
    assert abs(float(out.total) - float(theirs)) < 1e-4 * float(theirs)
    assert abs(float(out.total) - float(out.ce + out.nsp_loss)) < 1e-6


def test_a_training_step_reaches_the_pooler():
    cfg = dataclasses.replace(presets.tiny("bert-base"), nsp_head=True)
    model = EncoderLM(cfg).train()
    ids = torch.randint(5, cfg.vocab_size, (3, 16))
    mask = torch.ones_like(ids)
    types = (torch.arange(16) >= 8).long().expand(3, 16)
    labels = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.3, ids, -100)
    out = model(ids, mask, types, targets=labels, next_sentence_labels=torch.tensor([0, 1, 1]))
    assert torch.isfinite(out.total) and out.nsp_loss is not None and float(out.nsp_loss) > 0
    out.total.backward()
    for p in (model.nsp_head.pooler.weight, model.nsp_head.classifier.weight, model.mlm_head.dense.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


@pytest.mark.parametrize("hf", [BERT_BASE_UNCASED, BERT_LARGE_UNCASED], ids=["bert-base", "bert-large"])
def test_param_count_equals_bert_for_pretraining_at_published_size(hf):
    cfg = dataclasses.replace(to_config(hf), nsp_head=True)
    with torch.device("meta"):
        model = transformers.BertForPreTraining(transformers.BertConfig(**hf))
    assert param_count(cfg) == model.num_parameters()
    assert param_count(cfg) - param_count(to_config(hf)) == hf["hidden_size"] ** 2 + 3 * hf["hidden_size"] + 2


def test_a_masked_lm_config_reads_without_the_head_and_roberta_refuses_it():
    assert not to_config(BERT_BASE_UNCASED).nsp_head      # bert-base-uncased's config.json: BertForMaskedLM
    assert to_config({**BERT_BASE_UNCASED, "architectures": ["BertForPreTraining"]}).nsp_head
    roberta = dataclasses.replace(presets.tiny("roberta-base"), type_vocab_size=2, nsp_head=True)
    with pytest.raises(ConfigError, match="nsp_head"):
        FAMILIES.get("roberta").from_config(roberta)
    with pytest.raises(ConfigError, match="nsp_head"):
        dataclasses.replace(presets.tiny("gpt2"), type_vocab_size=2, nsp_head=True)
    with pytest.raises(ConfigError, match="type_vocab_size"):
        dataclasses.replace(presets.tiny("roberta-base"), nsp_head=True)
