"""`--set KEY=VALUE` pairs, split into model and train overrides: one rule for every command that takes
them (train, finetune, eval). Its own module so that eval's helpers need not import the train command."""
from __future__ import annotations


def parse_sets(pairs: list[str]) -> tuple[dict, dict]:
    """Split `--set` pairs into (model overrides, train overrides)."""
    from archlab.config import ConfigError

    model, train = {}, {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        key = key.strip()
        if key.startswith("train."):
            train[key[len("train."):]] = value
        elif key.startswith("dist."):          # dist.strategy=fsdp: train.dist_strategy's other spelling
            train[key] = value
        else:
            key = key.removeprefix("model.")
            top = key.split(".")[0]
            if top not in _model_fields() and top in _train_fields():
                raise ConfigError(f"--set {pair}: {top!r} is a training setting, not a model field: "
                                  f"--set train.{key}={value}")
            model[key] = value
    return model, train


def _model_fields() -> set[str]:
    import dataclasses

    from archlab.config import ModelConfig
    return {f.name for f in dataclasses.fields(ModelConfig)}


def _train_fields() -> set[str]:
    import dataclasses

    from archlab.runs.train_section import RENAMES
    from archlab.training.config import TrainConfig
    return {f.name for f in dataclasses.fields(TrainConfig)} | set(RENAMES)    # the earlier flat names too
