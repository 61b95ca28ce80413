"""Packed documents (`document_ids`): at every position a packed row gives the logits of its document run alone,
on every attention backend that takes the call (the others refuse and the chooser falls back), gradients
included; positions restart per document for every position kind; windows, dilation and strided patterns apply
within a document; padding and documents together; the encoder and both sides of the encoder-decoder; the
accounting counts only in-document pairs."""
import pytest
import torch
from variants import BASE

from archlab import presets
from archlab.models import build_model
from archlab.models.accounting import keys_per_query, packed_keys_per_query
from archlab.models.encoder_decoder import shift_right
from archlab.nn import attention_backends as backends
from archlab.nn.attention_backends import forced
from archlab.nn.local_attention import BlockLocal
from archlab.nn.masks import MaskSpec, document_positions

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

BACKENDS = list(backends.BACKENDS.names())
FORWARD_ONLY = {"flex"}            # torch 2.13: no FlexAttention backward on CPU
ROWS = [[5, 1, 9, 4], [7, 6]]      # document lengths per row; the second row ends in 6 padded slots (id -1)
T = 19

DECODERS = {
    "llama": lambda: presets.tiny("llama2-7b"),
    "mistral-window": lambda: presets.tiny("mistral-7b"),
    "gemma2-local-global-softcap": lambda: presets.tiny("gemma2-2b"),
    "command-a-nope-global": lambda: presets.tiny("command-a"),
    "bloom-alibi": lambda: presets.tiny("bloom-176b"),
    "gpt2-learned": lambda: presets.tiny("gpt2"),
    "t5-buckets": lambda: BASE.with_overrides({"position.kind": "t5"}),
    "sinusoidal": lambda: BASE.with_overrides({"position.kind": "sinusoidal"}),
    "alibi-window": lambda: BASE.with_overrides({"position.kind": "alibi", "attention.window": 4}),
    "dilated-window": lambda: BASE.with_overrides({"attention.window": 3, "attention.dilation": 2}),
    "strided": lambda: BASE.with_overrides({"attention.sparse": "strided", "attention.sparse_stride": 3}),
}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(BlockLocal, "block", 4)        # several blocks per row, documents across their edges


def _model(cfg):
    cfg = cfg.with_overrides({"attention.dropout": 0.0, "embedding_dropout": 0.0, "block.residual_dropout": 0.0})
    return build_model(cfg).eval()


def _packed(lengths_per_row, vocab, t=T, seed=0):
    """(docs per row as id tensors, (b, t) ids, (b, t) document ids with -1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, vocab, (n,), generator=g) for n in row] for row in lengths_per_row]
    ids = torch.zeros(len(docs), t, dtype=torch.long)
    doc_ids = torch.full((len(docs), t), -1)
    for r, row in enumerate(docs):
        at = 0
        for i, doc in enumerate(row):
            ids[r, at:at + len(doc)], doc_ids[r, at:at + len(doc)] = doc, i
            at += len(doc)
    return docs, ids, doc_ids


class _Ran:
    """Which backend ran each call, and whether `wanted` said it supports the call."""

    def __init__(self, monkeypatch, wanted):
        self.pairs = []
        choose = backends.choose

        def counted(call):
            backend = choose(call)
            self.pairs.append((backend.name, backends.BACKENDS.get(wanted).supports(call)))
            return backend
        monkeypatch.setattr(backends, "choose", counted)

    def check(self, wanted):
        for ran, why in self.pairs:          # forced wherever it supports the call, the usual choice elsewhere
            assert (ran == wanted) == (why is None), (ran, why)
        return [ran for ran, _ in self.pairs]


def _weights(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_positions_restart_at_each_document_and_padding_is_minus_one():
    ids = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [-1, 4, 4, 2, 7, 7, 7]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, -1, -1], [-1, 0, 1, 0, 0, 1, 2]]
    real = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    assert document_positions(torch.tensor([[0, 0, 1, 1, 1, 1, 1]]), real).tolist() == [[0, 1, 0, 1, -1, -1, -1]]
    with pytest.raises(ValueError, match="one run of slots"):
        document_positions(torch.tensor([[0, 0, 1, 0]]))          # document 0 comes back after document 1


def test_the_predicate_keeps_pairs_inside_their_document():
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    pos = document_positions(seg)
    allowed = MaskSpec(causal=True, segment_ids=seg).allows(pos, pos)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert allowed.int().tolist() == expected.tolist()
    cross = MaskSpec(causal=False, segment_ids=torch.tensor([[0, 1]]), key_segment_ids=torch.tensor([[0, 0, 1]]))
    assert cross.allows(torch.tensor([[0, 0]]), torch.tensor([[0, 1, 0]]))[0, 0].int().tolist() == [[1, 1, 0],
                                                                                                     [0, 0, 1]]
    with pytest.raises(ValueError, match="key_segment_ids needs"):
        MaskSpec(key_segment_ids=torch.tensor([[0]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_a_packed_decoder_row_gives_each_documents_logits_and_gradients_alone(family, backend, monkeypatch):
    model = _model(DECODERS[family]())
    docs, ids, doc_ids = _packed(ROWS, model.config.vocab_size)
    grads = backend not in FORWARD_ONLY
    weights = _weights((*ids.shape, model.config.vocab_size))
    with torch.set_grad_enabled(grads), forced("eager"):
        alone = [[model(doc[None])[0] for doc in row] for row in docs]          # each (n, v)
        if grads:
            model.zero_grad()
            sum((a * weights[r, _span(docs[r], i)]).sum() for r, row in enumerate(alone)
                for i, a in enumerate(row)).backward()
            ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ran = _Ran(monkeypatch, backend)
    with torch.set_grad_enabled(grads), forced(backend):
        model.zero_grad()
        packed = model(ids, document_ids=doc_ids)                              # (b, t, v)
        real = (doc_ids >= 0)[..., None]
        if grads:
            (packed * weights * real).sum().backward()
    ran.check(backend)
    for r, row in enumerate(alone):
        for i, a in enumerate(row):
            torch.testing.assert_close(packed[r, _span(docs[r], i)], a, rtol=1e-5, atol=2e-5)
    if grads:
        for name, grad in ref_grads.items():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=2e-5,
                                       msg=name)


def _span(row, i):
    start = sum(len(d) for d in row[:i])
    return slice(start, start + len(row[i]))


@pytest.mark.parametrize("family,backend", [("mistral-window", "block_local"), ("dilated-window", "block_local"),
                                            ("alibi-window", "block_local"), ("strided", "strided"),
                                            ("llama", "tiled"), ("mistral-window", "tiled")])
def test_the_blocked_and_tiled_kernels_take_document_calls_themselves(family, backend, monkeypatch):
    model = _model(DECODERS[family]())
    _, ids, doc_ids = _packed(ROWS, model.config.vocab_size)
    ran = _Ran(monkeypatch, backend)
    with forced(backend), torch.no_grad():
        model(ids, document_ids=doc_ids)
    assert backend in ran.check(backend)


def test_documents_refuse_a_kv_cache():
    from archlab.nn.kv_cache import KVCache
    model = _model(DECODERS["llama"]())
    with pytest.raises(ValueError, match="not with a KV cache"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=KVCache(), document_ids=torch.zeros(1, 3))


ENCODERS = {"bert-learned": lambda: presets.tiny("bert-base"),
            "roberta-learned": lambda: presets.tiny("roberta-base"),
            "encoder-t5-window": lambda: BASE.with_overrides({"arch": "encoder", "position.kind": "t5",
                                                              "attention.window": 5})}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_a_packed_encoder_row_gives_each_documents_logits_alone(family, backend, monkeypatch):
    model = _model(ENCODERS[family]())
    docs, ids, doc_ids = _packed(ROWS, model.config.vocab_size, seed=2)
    mask = (doc_ids >= 0).long()                     # padding said both ways: the mask and id -1
    with torch.no_grad():
        with forced("eager"):
            alone = [[model(doc[None])[0] for doc in row] for row in docs]
        ran = _Ran(monkeypatch, backend)
        with forced(backend):
            packed = model(ids, attention_mask=mask, document_ids=doc_ids)
    ran.check(backend)
    for r, row in enumerate(alone):
        for i, a in enumerate(row):
            torch.testing.assert_close(packed[r, _span(docs[r], i)], a, rtol=1e-5, atol=2e-5)


ENCODER_DECODERS = {"t5-buckets": "t5-11b", "transformer-2017-sinusoidal": "transformer-2017",
                    "bart-learned-per-stack": "bart-large"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(ENCODER_DECODERS))
def test_a_packed_encoder_decoder_row_gives_each_pairs_logits_alone(family, backend, monkeypatch):
    model = _model(presets.tiny(ENCODER_DECODERS[family]))
    v = model.config.vocab_size
    sources, src, src_docs = _packed([[4, 6, 3], [5, 2]], v, t=15, seed=3)
    targets, tgt, tgt_docs = _packed([[3, 5, 2], [6, 1]], v, t=11, seed=4)
    with torch.no_grad():
        with forced("eager"):
            alone = [[model(s[None], decoder_input_ids=d[None])[0] for s, d in zip(srow, trow)]
                     for srow, trow in zip(sources, targets)]
        ran = _Ran(monkeypatch, backend)
        with forced(backend):
            packed = model(src, decoder_input_ids=tgt, attention_mask=(src_docs >= 0).long(),
                           document_ids=src_docs, decoder_document_ids=tgt_docs)
    ran.check(backend)
    for r, row in enumerate(alone):
        for i, a in enumerate(row):
            torch.testing.assert_close(packed[r, _span(targets[r], i)], a, rtol=1e-5, atol=2e-5)


def test_packed_targets_shift_right_per_document_and_the_loss_is_the_documents():
    labels = torch.tensor([[7, 8, 9, 5, 6, -100]])
    docs = torch.tensor([[0, 0, 0, 1, 1, -1]])
    assert shift_right(labels, 0, document_ids=docs).tolist() == [[0, 7, 8, 0, 5, 0]]
    model = _model(presets.tiny("t5-11b"))
    src, src_docs = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[0, 0, 0, 1, 1]])
    with torch.no_grad():
        packed = model.loss(src, labels, document_ids=src_docs, decoder_document_ids=docs).ce
        ce = [model.loss(s, y).ce for s, y in ((src[:, :3], labels[:, :3]), (src[:, 3:], labels[:, 3:5]))]
    torch.testing.assert_close(packed, (3 * ce[0] + 2 * ce[1]) / 5, rtol=1e-5, atol=1e-6)


def test_documents_on_one_side_of_an_encoder_decoder_are_refused():
    model = _model(presets.tiny("t5-11b"))
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match="one side only"):
        model(ids, decoder_input_ids=ids, document_ids=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("overrides", [{}, {"attention.window": 3}, {"attention.window": 3, "attention.dilation": 2},
                                       {"attention.sparse": "strided", "attention.sparse_stride": 3}])
def test_the_accounting_counts_only_in_document_pairs(overrides):
    from archlab.nn.masks import LocalPattern
    cfg = BASE.with_overrides(overrides)
    lengths = [5, 1, 9, 4]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = document_positions(seg)
    spec = MaskSpec(causal=True, segment_ids=seg).restricted(LocalPattern.of(cfg.attention) if cfg.is_local(0)
                                                              else None)
    counted = int(spec.allows(pos, pos).sum()) / sum(lengths)
    assert packed_keys_per_query(cfg, 0, lengths) == pytest.approx(counted)
    assert packed_keys_per_query(cfg, 0, lengths) < keys_per_query(cfg, 0, sum(lengths))


# ---- pretraining with document masks (train.document_masks) ------------------------------------------------------
def test_document_masks_split_a_window_at_its_end_of_text_tokens_by_hand():
    from archlab.data.objectives import IGNORE, DocumentMasks
    eot = 256
    x = torch.tensor([[5, 6, eot, 7, 8, eot, 9], [eot, 1, 2, 3, 4, 5, 6]])
    y = torch.tensor([[6, eot, 7, 8, eot, 9, 4], [1, 2, 3, 4, 5, 6, eot]])
    inputs, labels = DocumentMasks(eot).batch(x, targets=y)
    assert torch.equal(inputs["input_ids"], x)
    assert inputs["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1]]
    assert labels.tolist() == [[6, eot, IGNORE, 8, eot, IGNORE, 4], [IGNORE, 2, 3, 4, 5, 6, eot]]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    import random

    from archlab.data.prepare import prepare
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    path = tmp_path_factory.mktemp("docs") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def _lm():
    return BASE.with_overrides({"vocab_size": 257, "attention.window": 6, "position.kind": "alibi"})


FAST = dict(batch_size=4, seq_len=32, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1, lr=3e-3,
            checkpoint_every=5, device="cpu")


def test_a_training_batch_with_document_masks_scores_each_document_alone(short_docs):
    from archlab.data.batches import TrainBatches, open_splits
    from archlab.training.config import TrainConfig
    train_data, _ = open_splits(short_docs)
    batches = TrainBatches(_lm(), TrainConfig(document_masks=True, **FAST), train_data)
    inputs, labels = batches.next(step=0, micro=0)
    docs = inputs["document_ids"]
    assert int(docs.max()) >= 2                                          # several documents in a row
    model = _model(_lm())
    with torch.no_grad():
        got = model(**inputs, targets=labels).ce
        nats, n = 0.0, 0
        for r in range(docs.shape[0]):                                   # each document run alone
            for d in docs[r].unique():
                slots = docs[r] == d
                logits = model(inputs["input_ids"][r, slots][None])[0]
                scored = labels[r, slots] != -100
                nats += torch.nn.functional.cross_entropy(logits[scored], labels[r, slots][scored],
                                                          reduction="sum").item()
                n += int(scored.sum())
    assert n == int((labels != -100).sum()) < labels.numel()
    assert float(got) == pytest.approx(nats / n, rel=1e-5)


def test_pretraining_with_document_masks_learns_and_resumes_exactly(short_docs, tmp_path):
    from run_checks import assert_resume_is_exact

    from archlab.training.config import TrainConfig
    from archlab.training.trainer import read_metrics
    cfg = TrainConfig(budget=10, document_masks=True, **FAST)
    assert_resume_is_exact(_lm(), cfg, short_docs, tmp_path)
    rows = read_metrics(tmp_path / "full" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    assert any("val_loss" in r and r["val_bpb"] > 0 for r in rows)


def test_document_masks_with_another_objective_is_one_line(short_docs, tmp_path):
    from archlab.errors import UserError
    from archlab.training.config import TrainConfig
    from archlab.training.trainer import train
    cfg = TrainConfig(budget=1, document_masks=True, objective="continuation", **FAST)
    with pytest.raises(UserError, match="document_masks .* not with train.objective=continuation"):
        train(_lm(), cfg, short_docs, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_flops_per_token_of_packed_documents_count_their_pairs_only():
    from archlab.config import ConfigError
    from archlab.models.accounting import flops_per_token
    lengths = [5, 1, 9, 4]
    full, packed = flops_per_token(BASE, 19), flops_per_token(BASE, 19, document_lengths=lengths)
    per_key = 4.0 * BASE.attention.n_heads * BASE.head_dim * BASE.n_layers          # QK^T and PV, every layer
    fewer_keys = keys_per_query(BASE, 0, 19) - packed_keys_per_query(BASE, 0, lengths)
    assert full - packed == pytest.approx(per_key * fewer_keys)
    with pytest.raises(ConfigError, match="sum to 19, not seq_len=20"):
        flops_per_token(BASE, 20, document_lengths=lengths)
