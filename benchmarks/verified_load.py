"""What verifying a checkpoint costs on the load path: archlab.runs.model_folder.load_run (generate, serve and
convert --to-hf load through it) hashes model.safetensors against meta.json's sha256 before reading it. Timed
against the same load_run with the hash skipped (sizes checked only), interleaved in one process; and the
sha256 of the file alone.

    .venv/bin/python benchmarks/verified_load.py [--layers 4] [--rounds 9] [--threads 2]

The model is a LLaMA-like config of random weights (d=512, vocab 8192; 4 layers give a ~100 MB fp32 file),
saved as a one-checkpoint run folder in a temporary folder. The ratio is the median of per-round ratios.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from unittest import mock

import yaml
from bench import interleaved, parser, start  # benchmarks/bench.py: one call of each per round, the order rotating


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    start(args)

    from archlab.config import ModelConfig
    from archlab.models import build_model
    from archlab.runs import checkpoint as ck
    from archlab.runs import model_folder

    cfg = ModelConfig(vocab_size=8192, d_model=512, n_layers=args.layers, max_seq_len=256, attention={"n_heads": 8})
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
        ckpt = ck.save_checkpoint(run / "checkpoints", 1, build_model(cfg).state_dict(), {})
        weights = ckpt / ck.MODEL_FILE
        recorded = ck.read_meta(ckpt)["sha256"][ck.MODEL_FILE]

        def sizes_only():
            with mock.patch.object(ck, "sha256_file", lambda *a, **k: recorded):
                model_folder.load_run(run)

        times = interleaved({"sha256 alone": lambda: ck.sha256_file(weights),
                             "load_run verified": lambda: model_folder.load_run(run),
                             "load_run sizes only": sizes_only},
                            args.rounds)
        size = weights.stat().st_size
    print(f"model.safetensors {size / 1e6:.0f} MB; {args.rounds} interleaved rounds")
    for name, seconds in times.items():
        print(f"{name:20s} median {statistics.median(seconds):.3f} s  best {min(seconds):.3f} s")
    ratio = statistics.median(v / s for v, s in zip(times["load_run verified"], times["load_run sizes only"]))
    print(f"verified / sizes-only load_run: {ratio:.2f}x; sha256 {size / 1e6 / min(times['sha256 alone']):.0f} MB/s")


if __name__ == "__main__":
    main()
