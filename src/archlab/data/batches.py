"""What a training step and an evaluation feed the model, whatever the kind of model and data.

A batch is (inputs, labels): `inputs` a dict of the model's forward keywords (always input_ids (b, s); an
attention_mask, prefix_lengths, token_type_ids where the objective makes them), `labels` (b, t) with -100 on
unscored slots, passed as `targets=`. Two kinds of data make them:

    token stream (archlab.data.tokens)    BatchSampler windows, turned by the objective (objectives.py): next-token
                                   targets as sampled, BERT's masks, T5's spans, BART's infilling, a continuation;
                                   BERT's next-sentence pairs come from their own sampler over the split's
                                   sentence index (next_sentence.py), masked as any window
    pairs (archlab.data.seq2seq)          source -> target rows, padded; the objective is the pairing itself
    SFT examples (archlab.data.sft)     chat examples packed into rows with document_ids (or padded one per row),
                                   labels on the slots the loss mask scores

train.objective names a Task: an objective, and the sampler of its own rows where it draws them (OBJECTIVES, a
registry filled by the @register_objective decorator below: adding one is a builder here and a literal in
TrainConfig.objective).

Every batch is a pure function of (seed, step, micro-step, rank): the trainer's checkpoint holds the sampler's
step counter and nothing else, so a resumed run sees exactly the batches the uninterrupted one would have.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from archlab.data import objectives
from archlab.data.formats import detect
from archlab.data.next_sentence import NextSentencePairs, next_sentence_for
from archlab.data.noising import span_corruption_for, text_infilling_for
from archlab.data.objectives import Batch, Objective
from archlab.data.seq2seq import Seq2SeqDataset, Seq2SeqSampler, seq2seq_eval_batches
from archlab.data.sft import SFTDataset, SFTSampler, sft_eval_batches
from archlab.data.tokens import BatchSampler, Rows, StepSampler, TokenDataset, eval_batches
from archlab.errors import UserError
from archlab.nn.registry import Registry

if TYPE_CHECKING:
    from archlab.config import ModelConfig
    from archlab.training.config import TrainConfig

__all__ = ["Batch", "open_splits", "SamplerState", "TrainBatches", "validation_batches", "tokens_processed",
           "scores_text", "objective_for", "objective_name", "OBJECTIVES", "Task", "Shard", "register_objective"]

Dataset = TokenDataset | Seq2SeqDataset | SFTDataset


# --------------------------------------------------------------------------- objectives by name
@dataclass(frozen=True)
class Task:
    """What a split of a token stream trains on: the objective that turns rows into (inputs, labels), and the
    sampler of its own rows where it draws them (next-sentence pairs); None: the split's token windows."""

    objective: Objective
    rows: NextSentencePairs | None = None


class Shard(NamedTuple):
    """One rank's share of the global batch: the rows it draws per micro-step, its rank, the world size."""

    batch_size: int
    rank: int = 0
    world_size: int = 1


Builder = Callable[["ModelConfig", "TrainConfig", TokenDataset, Shard], Task]


@dataclass(frozen=True)
class ObjectiveKind:
    trains: tuple[str, ...]        # the kinds of model (ModelConfig.arch) it trains
    build: Builder                 # (model_cfg, train_cfg, a split, this rank's shard) -> Task


OBJECTIVES: Registry[ObjectiveKind] = Registry("train.objective")
DEFAULT_OBJECTIVE = {"decoder": "next_token", "encoder": "mlm", "encoder_decoder": "span_corruption"}


def register_objective(name: str, *, trains: tuple[str, ...]) -> Callable[[Builder], Builder]:
    """Register a builder as train.objective=`name`, for the kinds of model it trains."""
    def add(build: Builder) -> Builder:
        OBJECTIVES.register(name)(ObjectiveKind(trains, build))
        return build
    return add


@register_objective("next_token", trains=("decoder",))
def _next_token(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    """The sampler's (x, y) as they are, or with train.document_masks its documents kept apart."""
    return Task(objectives.DocumentMasks(dataset.eot_id) if train_cfg.stream.document_masks else objectives.NextToken())


@register_objective("mlm", trains=("encoder",))
def _mlm(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    return Task(objectives.masked_lm_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                                         whole_word=train_cfg.mlm.whole_word_mask, mask_id=train_cfg.mlm.mask_token_id,
                                         prob=train_cfg.mlm.probability))


@register_objective("next_sentence", trains=("encoder",))
def _next_sentence(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    """[CLS] A [SEP] B [SEP] rows from the split's sentence index (NextSentencePairs), masked as MLM."""
    if not model_cfg.nsp_head:
        raise UserError("train.objective=next_sentence needs the next-sentence head: --set nsp_head=true")
    pairs, masked_lm = next_sentence_for(dataset, dataset.load_tokenizer(), model_cfg.vocab_size,
                                         seq_len=train_cfg.seq_len, seed=train_cfg.seed, batch_size=shard.batch_size,
                                         whole_word=train_cfg.mlm.whole_word_mask, mask_id=train_cfg.mlm.mask_token_id,
                                         prob=train_cfg.mlm.probability, rank=shard.rank,
                                         world_size=shard.world_size)
    return Task(masked_lm, rows=pairs)


@register_objective("span_corruption", trains=("encoder_decoder",))
def _span_corruption(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    return Task(span_corruption_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                                    eos_id=dataset.eot_id, density=train_cfg.noising.density or 0.15,
                                    mean_span=train_cfg.noising.mean_span or 3.0))


@register_objective("text_infilling", trains=("encoder_decoder",))
def _text_infilling(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    return Task(text_infilling_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                                   mask_id=train_cfg.mlm.mask_token_id, ratio=train_cfg.noising.density or 0.3,
                                   poisson_lambda=train_cfg.noising.mean_span or 3.5,
                                   permute_sentences=train_cfg.noising.permute_sentences))


@register_objective("continuation", trains=("decoder", "encoder_decoder"))
def _continuation(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset, shard: Shard) -> Task:
    prefix = int(round(train_cfg.seq_len * train_cfg.stream.prefix_fraction))
    if not 0 < prefix < train_cfg.seq_len:
        raise UserError(f"train.prefix_fraction={train_cfg.stream.prefix_fraction} leaves no prefix or no "
                        f"continuation in a window of train.seq_len={train_cfg.seq_len}")
    return Task(objectives.Continuation(prefix, model_cfg.arch, model_cfg.attention.prefix_lm))


def objective_name(model_cfg: ModelConfig, train_cfg: TrainConfig) -> str:
    """train.objective, with "auto" read as the kind's own (GPT's next token, BERT's MLM, T5's span corruption);
    an objective the kind cannot train is a UserError. Example: objective_name(bert_cfg, TrainConfig()) -> "mlm" """
    name = train_cfg.objective
    if name == "auto":
        return DEFAULT_OBJECTIVE[model_cfg.arch]
    archs = OBJECTIVES.get(name).trains
    if model_cfg.arch not in archs:
        raise UserError(f"train.objective={name} trains {' or '.join(archs)} models, not arch={model_cfg.arch}")
    return name


def objective_for(model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: TokenDataset,
                  shard: Shard | None = None) -> Task:
    """train.objective's Task over `dataset` (an archlab.data.tokens.TokenDataset, its tokenizer loaded only when
    the objective needs it) for `shard` (default: one rank drawing train.batch_size rows).
    Example: inputs, labels = objective_for(model_cfg, train_cfg, val).objective.turn(Rows(x, y), step=0)"""
    name = objective_name(model_cfg, train_cfg)
    if train_cfg.stream.document_masks and name != "next_token":
        raise UserError(f"train.document_masks keeps next-token documents apart: not with train.objective={name}")
    return OBJECTIVES.get(name).build(model_cfg, train_cfg, dataset, shard or Shard(train_cfg.batch_size))


# --------------------------------------------------------------------------- datasets and batches
# the split reader of each prepared-folder format a training step reads (data/formats.py names the formats)
SPLIT_READERS: dict[str, Any] = {"token_stream": TokenDataset, "seq2seq_pairs": Seq2SeqDataset,
                                 "chat_examples": SFTDataset}


def open_splits(data_dir: str | Path) -> tuple[Dataset, Dataset]:
    """(train, val) datasets of a prepared folder: archlab.data.tokens.TokenDataset for a token stream,
    archlab.data.seq2seq.Seq2SeqDataset for source/target pairs, archlab.data.sft.SFTDataset for chat examples.
    Example: train_data, val_data = open_splits("data/pairs")"""
    held = detect(data_dir).format if Path(data_dir).is_dir() else "token_stream"   # else TokenDataset says why
    reader = SPLIT_READERS.get(held, TokenDataset)          # a folder of another format: TokenDataset names it
    return reader(data_dir, "train"), reader(data_dir, "val")


def _check_pairs_objective(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    if model_cfg.arch != "encoder_decoder":
        raise UserError(f"paired source/target data trains encoder-decoders, not arch={model_cfg.arch}: "
                        "prepare a token stream for it (archlab data prepare without --seq2seq)")
    if train_cfg.objective != "auto" or train_cfg.stream.document_masks:
        setting = ("train.document_masks" if train_cfg.stream.document_masks
                   else f"train.objective={train_cfg.objective}")
        raise UserError(f"{setting} reads a token stream; paired data is its own "
                        "objective (source -> target): leave train.objective=auto")


def _check_sft_objective(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    if model_cfg.arch != "decoder":
        raise UserError(f"chat examples (an SFT folder) train decoders, not arch={model_cfg.arch}")
    if train_cfg.objective not in ("auto", "next_token") or train_cfg.stream.document_masks:
        raise UserError("an SFT folder is its own objective (the loss mask's tokens): leave train.objective=auto "
                        "and train.document_masks=false")


class CheckpointedSampler(Protocol):
    """What a checkpoint keeps of a sampler, and how far through its data it is."""

    @property
    def epoch(self) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class SamplerState:
    """Batches whose whole state is their sampler's: the epoch and a checkpoint's state pass through to it.
    Example: class DPOBatches(SamplerState) sets self.sampler; its state_dict() is the sampler's"""
    sampler: CheckpointedSampler

    @property
    def epoch(self) -> float:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class TrainBatches(SamplerState):
    """The training batches of one rank: `next(step, micro)` -> (inputs, labels); its state is the sampler's.
    A token stream's rows (windows, or the objective's own rows) are turned by train.objective's objective;
    pairs and SFT examples are their own objective: the sampler's batches go to the model as they are.
    Example: inputs, labels = TrainBatches(model_cfg, train_cfg, train_data).next(step=0, micro=0)"""

    sampler: StepSampler

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, dataset: Dataset, *, rank: int = 0,
                 world_size: int = 1):
        local_batch = train_cfg.batch_size // world_size        # batch_size is global
        self.model_cfg, self.train_cfg, self.rank, self.local_batch = model_cfg, train_cfg, rank, local_batch
        self.world_size = world_size
        self.objective: Objective | None = None                 # None: pairs, SFT examples
        self.rows: BatchSampler | NextSentencePairs | None = None   # what draws the rows the objective turns
        if train_cfg.stream.unique_tokens is not None and not isinstance(dataset, TokenDataset):
            raise UserError("train.stream.unique_tokens cuts a token stream's training split: not paired or chat data")
        if isinstance(dataset, SFTDataset):
            _check_sft_objective(model_cfg, train_cfg)
            self.sampler = SFTSampler(dataset, local_batch, train_cfg.seq_len, packing=train_cfg.sft.packing,
                                      seed=train_cfg.seed, rank=rank, world_size=world_size)
        elif isinstance(dataset, Seq2SeqDataset):
            _check_pairs_objective(model_cfg, train_cfg)
            self.sampler = Seq2SeqSampler(dataset, local_batch, max_source_len=train_cfg.seq_len,
                                       max_target_len=train_cfg.seq_len, seed=train_cfg.seed, rank=rank,
                                       world_size=world_size, setting="train.seq_len")
        else:
            stream = train_cfg.stream
            if stream.unique_tokens is not None and stream.unique_spread:   # repeated data from across the split
                dataset = dataset.spread(stream.unique_tokens, stream.unique_chunk_windows * train_cfg.seq_len)
            elif stream.unique_tokens is not None:                         # repeated data: the split's head
                dataset = dataset.head(stream.unique_tokens)
            task = objective_for(model_cfg, train_cfg, dataset, Shard(local_batch, rank, world_size))
            self.objective = task.objective
            self.rows = task.rows if task.rows is not None else BatchSampler(
                dataset, local_batch, train_cfg.seq_len, seed=train_cfg.seed, rank=rank, world_size=world_size)
            self.sampler = self.rows

    def objective_on(self, dataset: Dataset) -> Task | None:
        """The Task over `dataset`'s split, as validation_batches reads it (None for pairs and SFT examples): an
        objective that draws its own rows draws them from this split (validation rows from the validation split)."""
        if isinstance(dataset, (Seq2SeqDataset, SFTDataset)):
            return None
        return objective_for(self.model_cfg, self.train_cfg, dataset,
                             Shard(self.local_batch, self.rank, self.world_size))

    def next(self, step: int, micro: int) -> Batch:
        """The batch of this optimizer step's micro-step (advances the sampler by one)."""
        if self.objective is None or self.rows is None:
            return next(self.sampler)
        return self.objective.turn(self.rows.next_rows(step, micro), step, micro, self.rank)


def as_task(objective: Task | Objective | None) -> Task:
    """What evaluation is given, as a Task: an objective turns the split's windows; None is next-token prediction."""
    if isinstance(objective, Task):
        return objective
    return Task(objective if objective is not None else objectives.NextToken())


def validation_batches(dataset: Dataset, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                       objective: Task | Objective | None = None, rank: int = 0, world_size: int = 1
                       ) -> Iterator[Batch]:
    """The deterministic validation batches: pairs in order, SFT examples packed in order, or token windows in
    order turned by `objective` (a Task or an Objective; None: next-token targets), batch i with the fixed step
    -1 - i: the same masks / spans at every evaluation. A Task that draws its own rows draws batch i's at step -1 - i.
    Example: for inputs, labels in validation_batches(val, batch_size=8, seq_len=128, objective=obj): ..."""
    if isinstance(dataset, Seq2SeqDataset):
        yield from seq2seq_eval_batches(dataset, batch_size, max_batches, rank=rank, world_size=world_size,
                                     max_source_len=seq_len, max_target_len=seq_len, setting="train.seq_len")
        return
    if isinstance(dataset, SFTDataset):
        yield from sft_eval_batches(dataset, batch_size, seq_len, max_batches, rank=rank, world_size=world_size)
        return
    task = as_task(objective)
    if task.rows is not None:               # next-sentence rows of the validation split, fixed per batch
        for i in range(rank, max_batches or 1, world_size):
            yield task.objective.turn(task.rows.rows(-1 - i), -1 - i)
        return
    for i, (x, y) in enumerate(eval_batches(dataset, batch_size, seq_len, max_batches,
                                            rank=rank, world_size=world_size)):
        yield task.objective.turn(Rows(x, y), step=-1 - (i * world_size + rank))


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


def scores_text(objective: Task | Objective | None) -> bool:
    """Whether the loss is a code length of the text (next-token prediction, with document masks too, a
    continuation): bits per byte means something; masked or noised slots are not a compression of the text.
    Example: scores_text(None) -> True"""
    return as_task(objective).objective.scores_text
