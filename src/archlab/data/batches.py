"""What a training step and an evaluation feed the model, whatever the kind of model and data.

A batch is (inputs, labels): `inputs` a dict of the model's forward keywords (always input_ids (b, s); an
attention_mask, prefix_lengths, token_type_ids where the objective makes them), `labels` (b, t) with -100 on
unscored slots, passed as `targets=`. Two kinds of data make them:

    token stream (archlab.data.tokens)    BatchSampler windows, turned by the objective (objectives.py): next-token
                                   targets as sampled, BERT's masks, T5's spans, BART's infilling, a continuation;
                                   BERT's next-sentence rows are drawn from the split's sentence index instead
    pairs (archlab.data.pairs)          source -> target rows, padded; the objective is the pairing itself
    SFT examples (archlab.data.sft)     chat examples packed into rows with document_ids (or padded one per row),
                                   labels on the slots the loss mask scores

Every batch is a pure function of (seed, step, micro-step, rank): the trainer's checkpoint holds the sampler's
step counter and nothing else, so a resumed run sees exactly the batches the uninterrupted one would have.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from archlab.data import objectives
from archlab.data.noising import span_corruption_for, text_infilling_for
from archlab.data.pairs import PairDataset, PairSampler, is_pairs, pair_eval_batches
from archlab.data.sft import SFTDataset, SFTSampler, is_sft, sft_eval_batches
from archlab.data.tokens import BatchSampler, TokenDataset, eval_batches
from archlab.errors import UserError

__all__ = ["Batch", "open_splits", "SamplerState", "TrainBatches", "validation_batches", "tokens_processed",
           "scores_text", "objective_for", "objective_name", "OBJECTIVES"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- objectives by name
def _mlm(model_cfg: Any, train_cfg: Any, dataset: Any) -> Any:
    return objectives.masked_lm_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                                    whole_word=train_cfg.whole_word_mask, mask_id=train_cfg.mask_token_id,
                                    prob=train_cfg.mlm_probability)


def _next_sentence(model_cfg: Any, train_cfg: Any, dataset: Any) -> Any:
    if not model_cfg.nsp_head:
        raise UserError("train.objective=next_sentence needs the next-sentence head: --set nsp_head=true")
    return objectives.next_sentence_for(dataset, dataset.load_tokenizer(), model_cfg.vocab_size,
                                        seq_len=train_cfg.seq_len, seed=train_cfg.seed,
                                        batch_size=train_cfg.batch_size, whole_word=train_cfg.whole_word_mask,
                                        mask_id=train_cfg.mask_token_id, prob=train_cfg.mlm_probability)


def _span_corruption(model_cfg: Any, train_cfg: Any, dataset: Any) -> Any:
    return span_corruption_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                               eos_id=dataset.eot_id, density=train_cfg.noise_density or 0.15,
                               mean_span=train_cfg.mean_span or 3.0)


def _text_infilling(model_cfg: Any, train_cfg: Any, dataset: Any) -> Any:
    return text_infilling_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                              mask_id=train_cfg.mask_token_id, ratio=train_cfg.noise_density or 0.3,
                              poisson_lambda=train_cfg.mean_span or 3.5,
                              permute_sentences=train_cfg.permute_sentences)


def _continuation(model_cfg: Any, train_cfg: Any, dataset: Any) -> objectives.Continuation:
    prefix = int(round(train_cfg.seq_len * train_cfg.prefix_fraction))
    if not 0 < prefix < train_cfg.seq_len:
        raise UserError(f"train.prefix_fraction={train_cfg.prefix_fraction} leaves no prefix or no continuation "
                        f"in a window of train.seq_len={train_cfg.seq_len}")
    return objectives.Continuation(prefix, model_cfg.arch, model_cfg.attention.prefix_lm)


def _next_token(model_cfg: Any, train_cfg: Any, dataset: Any) -> objectives.DocumentMasks | None:
    """The sampler's (x, y) as they are (None), or with train.document_masks its documents kept apart."""
    return objectives.DocumentMasks(dataset.eot_id) if train_cfg.document_masks else None


# objective name -> (the kinds of model it trains, its builder from (model_cfg, train_cfg, a TokenDataset))
OBJECTIVES: dict[str, tuple[tuple[str, ...], Any]] = {
    "next_token": (("decoder",), _next_token),
    "mlm": (("encoder",), _mlm),
    "next_sentence": (("encoder",), _next_sentence),     # draws its own [CLS] A [SEP] B [SEP] rows (NextSentence)
    "span_corruption": (("encoder_decoder",), _span_corruption),
    "text_infilling": (("encoder_decoder",), _text_infilling),
    "continuation": (("decoder", "encoder_decoder"), _continuation),
}
DEFAULT_OBJECTIVE = {"decoder": "next_token", "encoder": "mlm", "encoder_decoder": "span_corruption"}


def objective_name(model_cfg: Any, train_cfg: Any) -> str:
    """train.objective, with "auto" read as the kind's own (GPT's next token, BERT's MLM, T5's span corruption);
    an objective the kind cannot train is a UserError. Example: objective_name(bert_cfg, TrainConfig()) -> "mlm" """
    name = train_cfg.objective
    if name == "auto":
        return DEFAULT_OBJECTIVE[model_cfg.arch]
    archs, _ = OBJECTIVES[name]
    if model_cfg.arch not in archs:
        raise UserError(f"train.objective={name} trains {' or '.join(archs)} models, not arch={model_cfg.arch}")
    return name


def objective_for(model_cfg: Any, train_cfg: Any, dataset: Any) -> Any:
    """What the trainer turns each window batch with (None: next-token targets as sampled): train.objective's
    builder, given the tokenizer of `dataset` (an archlab.data.tokens.TokenDataset, loaded only when the objective needs
    it). Example: objective_for(model_cfg, train_cfg, TokenDataset(data_dir, "val"))"""
    name = objective_name(model_cfg, train_cfg)
    if train_cfg.document_masks and name != "next_token":
        raise UserError(f"train.document_masks keeps next-token documents apart: not with train.objective={name}")
    return OBJECTIVES[name][1](model_cfg, train_cfg, dataset)


# --------------------------------------------------------------------------- datasets and batches
def open_splits(data_dir: str | Path) -> tuple[Any, Any]:
    """(train, val) datasets of a prepared folder: archlab.data.tokens.TokenDataset for a token stream,
    archlab.data.pairs.PairDataset for source/target pairs. Example: train_data, val_data = open_splits("data/pairs")"""
    kind = PairDataset if is_pairs(data_dir) else SFTDataset if is_sft(data_dir) else TokenDataset
    return kind(data_dir, "train"), kind(data_dir, "val")


def _draws_own_rows(objective: Any) -> bool:
    return isinstance(objective, objectives.NextSentence)


def _turn(objective: Any, x: torch.Tensor, y: torch.Tensor, step: int, micro: int = 0, rank: int = 0) -> Batch:
    """A window batch x (its next-token targets y) as `objective` turns it (y given where it reads them)."""
    if getattr(objective, "reads_targets", False):
        return _as_batch(objective.batch(x, step, micro, rank, targets=y))
    return _as_batch(objective.batch(x, step, micro, rank))


def _as_batch(out: Any) -> Batch:
    """An objective's (inputs, labels), inputs given as a dict or as the input_ids tensor alone."""
    inputs, labels = out
    return (inputs if isinstance(inputs, dict) else {"input_ids": inputs}), labels


def _check_pairs_objective(model_cfg: Any, train_cfg: Any) -> None:
    if model_cfg.arch != "encoder_decoder":
        raise UserError(f"paired source/target data trains encoder-decoders, not arch={model_cfg.arch}: "
                        "prepare a token stream for it (archlab data prepare without --pairs)")
    if train_cfg.objective != "auto" or train_cfg.document_masks:
        setting = ("train.document_masks" if train_cfg.document_masks
                   else f"train.objective={train_cfg.objective}")
        raise UserError(f"{setting} reads a token stream; paired data is its own "
                        "objective (source -> target): leave train.objective=auto")


def _check_sft_objective(model_cfg: Any, train_cfg: Any) -> None:
    if model_cfg.arch != "decoder":
        raise UserError(f"chat examples (an SFT folder) train decoders, not arch={model_cfg.arch}")
    if train_cfg.objective not in ("auto", "next_token") or train_cfg.document_masks:
        raise UserError("an SFT folder is its own objective (the loss mask's tokens): leave train.objective=auto "
                        "and train.document_masks=false")


class SamplerState:
    """Batches whose whole state is their sampler's: the epoch and a checkpoint's state pass through to it.
    Example: class DPOBatches(SamplerState) sets self.sampler; its state_dict() is the sampler's"""
    sampler: Any

    @property
    def epoch(self) -> float:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class TrainBatches(SamplerState):
    """The training batches of one rank: `next(step, micro)` -> (inputs, labels); its state is the sampler's.
    Example: inputs, labels = TrainBatches(model_cfg, train_cfg, train_data).next(step=0, micro=0)"""

    def __init__(self, model_cfg: Any, train_cfg: Any, dataset: Any, *, rank: int = 0, world_size: int = 1):
        local_batch = train_cfg.batch_size // world_size        # batch_size is global
        self.model_cfg, self.train_cfg, self.rank, self.local_batch = model_cfg, train_cfg, rank, local_batch
        self.objective: Any = None
        if isinstance(dataset, SFTDataset):
            _check_sft_objective(model_cfg, train_cfg)
            self.sampler = SFTSampler(dataset, local_batch, train_cfg.seq_len, packing=train_cfg.packing,
                                      seed=train_cfg.seed, rank=rank, world_size=world_size)
        elif isinstance(dataset, PairDataset):
            _check_pairs_objective(model_cfg, train_cfg)
            self.sampler: Any = PairSampler(dataset, local_batch, max_source_len=train_cfg.seq_len,
                                            max_target_len=train_cfg.seq_len, seed=train_cfg.seed, rank=rank,
                                            world_size=world_size, setting="train.seq_len")
        else:
            self.objective = self.objective_on(dataset)
            self.sampler = BatchSampler(dataset, local_batch, train_cfg.seq_len, seed=train_cfg.seed, rank=rank,
                                        world_size=world_size)

    def objective_on(self, dataset: Any) -> Any:
        """The objective over `dataset`'s split (None for pairs): the training one for every objective that only
        turns the windows it is given, a new one for next-sentence rows, which come from the split's own
        sentences (validation rows from the validation split)."""
        if isinstance(dataset, (PairDataset, SFTDataset)):
            return None
        objective = objective_for(self.model_cfg, self.train_cfg, dataset)
        if _draws_own_rows(objective):
            objective.batch_size = self.local_batch
        return objective

    def next(self, step: int, micro: int) -> Batch:
        """The batch of this optimizer step's micro-step (advances the sampler by one)."""
        if self.objective is None:
            return _as_batch(next(self.sampler))
        if _draws_own_rows(self.objective):   # rows from the sentence index: only the counter a checkpoint keeps
            self.sampler.step += 1
            return _as_batch(self.objective.batch(step, micro, self.rank))
        x, y = next(self.sampler)
        return _turn(self.objective, x, y, step, micro, self.rank)


def validation_batches(dataset: Any, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                       objective: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
    """The deterministic validation batches: pairs in order, SFT examples packed in order, or token windows in
    order turned by `objective` (batch i with the fixed step -1 - i: the same masks / spans at every evaluation).
    Example: for inputs, labels in validation_batches(val, batch_size=8, seq_len=128, objective=obj): ..."""
    if isinstance(dataset, PairDataset):
        yield from pair_eval_batches(dataset, batch_size, max_batches, rank=rank, world_size=world_size,
                                     max_source_len=seq_len, max_target_len=seq_len, setting="train.seq_len")
        return
    if isinstance(dataset, SFTDataset):
        yield from sft_eval_batches(dataset, batch_size, seq_len, max_batches, rank=rank, world_size=world_size)
        return
    if _draws_own_rows(objective):          # next-sentence rows of the validation split, fixed per batch
        for i in range(rank, max_batches or 1, world_size):
            yield _as_batch(objective.batch(-1 - i))
        return
    for i, (x, y) in enumerate(eval_batches(dataset, batch_size, seq_len, max_batches,
                                            rank=rank, world_size=world_size)):
        if objective is None:
            yield {"input_ids": x}, y
        else:
            yield _turn(objective, x, y, step=-1 - (i * world_size + rank))


def tokens_processed(inputs: dict[str, torch.Tensor], labels: torch.Tensor, arch: str) -> int:
    """Real tokens the model reads for this batch: the source (its attention_mask's ones, else every slot), plus
    an encoder-decoder's target tokens (the decoder reads the labels shifted right; padding is unscored).
    Example: tokens_processed({"input_ids": src}, labels, "encoder_decoder") -> src.numel() + scored labels"""
    source = inputs.get("attention_mask")
    if source is None and "document_ids" in inputs:          # packed or padded examples: -1 marks padding
        source = inputs["document_ids"] >= 0
    n = int(source.sum()) if source is not None else inputs["input_ids"].numel()
    if arch == "encoder_decoder":
        n += int((labels != objectives.IGNORE).sum())
    return n


def scores_text(objective: Any) -> bool:
    """Whether the loss is a code length of the text (next-token prediction, with document masks too, a
    continuation): bits per byte means something; masked or noised slots are not a compression of the text.
    Example: scores_text(None) -> True"""
    return objective is None or isinstance(objective, (objectives.Continuation, objectives.DocumentMasks))
