"""The batches every objective draws are pinned bit for bit: training batches of two ranks over two micro-steps,
validation batches, and the sampler state a checkpoint keeps, each hashed (keys, dtypes, shapes and bytes) and
compared with hashes recorded from the same calls on the same tiny data folder. A change to how objectives are
built, composed or registered that moves one masked slot, one span or one sentence pair fails here; a run resumed
from a checkpoint written before such a change would no longer continue exactly.

If a torch upgrade changes its CPU generator's streams, every hash moves together: regenerate with
`python tests/data/test_objective_batches.py` (it rewrites fixtures/objective_batches.json) and check that the
change is torch's, not the code's."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_seq2seq import write_reversed_pairs

from archlab.config import ModelConfig
from archlab.data.batches import TrainBatches, open_splits, validation_batches
from archlab.data.prepare import prepare
from archlab.tokenizer import train as train_tokenizer
from archlab.training.config import TrainConfig

VOCAB = 320            # 20 ids past the tokenizer's 300: T5's sentinels
SENTENCES = ["the fox jumps.", "a dog sleeps!", "seven wizards judge?", "boxing is quick.", "the lazy dog waits.",
             "we sing songs.", "rain falls down."]


def _models() -> dict[str, ModelConfig]:
    small = dict(vocab_size=VOCAB, d_model=32, n_layers=1, max_seq_len=64)
    return {
        "decoder": ModelConfig(**small, attention={"n_heads": 4}),
        "prefix_lm": ModelConfig(**small, attention={"n_heads": 4, "prefix_lm": True}),
        "encoder": ModelConfig(arch="encoder", **small, attention={"n_heads": 4}, type_vocab_size=2, nsp_head=True),
        "encoder_decoder": ModelConfig(arch="encoder_decoder", **small, attention={"n_heads": 4},
                                       decoder_start_token_id=0),
    }


# case -> (model, train settings); every objective of the registry, and the settings that change what it draws
CASES = {
    "next_token": ("decoder", {}),
    "next_token_documents": ("decoder", {"document_masks": True}),
    "mlm": ("encoder", {"objective": "mlm"}),
    "mlm_whole_word": ("encoder", {"objective": "mlm", "whole_word_mask": True, "mlm_probability": 0.3}),
    "next_sentence": ("encoder", {"objective": "next_sentence"}),
    "span_corruption": ("encoder_decoder", {"objective": "span_corruption"}),
    "text_infilling": ("encoder_decoder", {"objective": "text_infilling"}),
    "text_infilling_in_order": ("encoder_decoder", {"objective": "text_infilling", "permute_sentences": False}),
    "continuation_decoder": ("decoder", {"objective": "continuation"}),
    "continuation_prefix_lm": ("prefix_lm", {"objective": "continuation", "prefix_fraction": 0.25}),
    "continuation_encoder_decoder": ("encoder_decoder", {"objective": "continuation"}),
    "pairs": ("encoder_decoder", {}),
}


def make_folders(root: Path) -> dict[str, Path]:
    """A token stream with a sentence index and a tokenizer holding every special token the objectives ask for,
    and a folder of source -> target pairs."""
    from archlab.data.seq2seq import prepare_seq2seq

    rng = np.random.default_rng(0)
    docs = [" ".join(SENTENCES[int(i)] for i in rng.integers(0, len(SENTENCES), int(rng.integers(1, 7))))
            for _ in range(60)]
    (root / "corpus.txt").write_text("\n".join(docs))
    tok = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>", "[MASK]", "[CLS]", "[SEP]", "[PAD]"])
    prepare(docs, tok, root / "stream", num_workers=0, progress=False, sentences=True, val_fraction=0.2)
    pairs = write_reversed_pairs(root / "pairs.jsonl", " ".join(SENTENCES).split(), 80, shortest=2, lengths=6)
    prepare_seq2seq(pairs, "bytes", root / "pairs", progress=False, val_fraction=0.2)
    return {"stream": root / "stream", "pairs": root / "pairs"}


def _digest(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> str:
    inputs, labels = batch
    h = hashlib.sha256()
    for name, t in [*sorted(inputs.items()), ("labels", labels)]:
        t = t.contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def draws(case: str, folders: dict[str, Path]) -> dict:
    """Hashes of what `case` draws: training batches (rank r of 2, step s, micro-step m), validation batches,
    and the sampler state after the training draws."""
    model_name, settings = CASES[case]
    model_cfg = _models()[model_name]
    seq_len = 64 if case == "pairs" else 32
    cfg = TrainConfig(batch_size=4, seq_len=seq_len, seed=7, **settings)
    train_data, val_data = open_splits(folders["pairs" if case == "pairs" else "stream"])
    out: dict = {"train": {}, "state": {}}
    for rank in (0, 1):
        batches = TrainBatches(model_cfg, cfg, train_data, rank=rank, world_size=2)
        for step in range(3):
            for micro in range(2):
                out["train"][f"{rank}/{step}/{micro}"] = _digest(batches.next(step, micro))
        out["state"][str(rank)] = batches.state_dict()
    objective = batches.objective_on(val_data)
    out["val"] = [_digest(b) for b in validation_batches(val_data, batch_size=4, seq_len=seq_len, max_batches=3,
                                                         objective=objective)]
    return out


RECORD = Path(__file__).parents[1] / "fixtures" / "objective_batches.json"
EXPECTED: dict[str, dict] = json.loads(RECORD.read_text()) if RECORD.exists() else {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return make_folders(tmp_path_factory.mktemp("objective_batches"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_objective_draws_the_recorded_batches(case, folders):
    assert draws(case, folders) == EXPECTED[case]


def test_the_cases_cover_every_registered_objective_and_the_config_names_no_other():
    from typing import get_args, get_type_hints

    from archlab.data.batches import DEFAULT_OBJECTIVE, OBJECTIVES
    drawn = {settings.get("objective", DEFAULT_OBJECTIVE[_models()[model].arch])
             for case, (model, settings) in CASES.items() if case != "pairs"}
    assert drawn == set(OBJECTIVES.names())
    named = set(get_args(get_type_hints(TrainConfig)["objective"])) - {"auto", "dpo"}
    assert named == set(OBJECTIVES.names())      # "dpo" reads preference pairs (training/dpo.py), not a registry entry


def test_the_recorded_batches_differ_between_steps_ranks_and_objectives():
    """The pins above could only pass vacuously if the hashes did not depend on what they hash."""
    assert set(EXPECTED) == set(CASES)
    for case, record in EXPECTED.items():
        train = record["train"]
        assert len(set(train.values())) == len(train), case        # every (rank, step, micro) its own batch
    firsts = {record["train"]["0/0/0"] for case, record in EXPECTED.items()}
    assert len(firsts) == len(EXPECTED)


if __name__ == "__main__":      # regenerate the record
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        made = make_folders(Path(tmp))
        RECORD.write_text(json.dumps({case: draws(case, made) for case in sorted(CASES)}, indent=1,
                                     sort_keys=True) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
