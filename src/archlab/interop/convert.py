"""Conversions between archlab run folders and other formats, as library calls (`archlab convert` and
`archlab verify` are their command line; the real-model demo calls them too): HF folder <-> run folder, run
folder <-> GGUF file, and archlab's logits against transformers' on an HF folder.

A converted run folder is an ordinary run folder (archlab.runs.checkpoint): config.yaml with the model
under `model`, tokenizer/ (copied when the HF folder has a tokenizer.json that archlab.tokenizer.load
reads: natively, or through the `tokenizers` library; otherwise put aside in tokenizer_hf/) and one checkpoint
`checkpoints/step_0000000/model.safetensors` holding our parameter names, so `archlab generate`,
`archlab eval` and `archlab diagnose` read it like a trained run.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from archlab.config import ModelConfig

# files of an HF folder that make up its tokenizer (copied beside tokenizer.json when present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")

def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    if not (src / "tokenizer.json").is_file():
        return []
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def convert_from_hf(hf_dir: str | Path, run_dir: str | Path, dtype: torch.dtype | None = None,
                    overwrite: bool = False) -> Path:
    """HF folder -> run folder (config.yaml, tokenizer/, checkpoints/step_0000000/). An existing non-empty
    run_dir is refused unless `overwrite`, which replaces it atomically (archlab.runs.outputs)."""
    from archlab.interop.hf import load_hf, read_hf_config
    from archlab.runs.hub import resolve_model
    from archlab.runs.outputs import check_output, fresh_output

    run_dir = Path(run_dir)
    source_id = str(hf_dir)
    local = None if source_id.startswith("hf:") else hf_dir
    check_output(run_dir, inputs=[local], overwrite=overwrite)      # before the (long) load or download
    hf_dir = resolve_model(hf_dir)
    model = load_hf(hf_dir, dtype=dtype)
    hf_cfg = read_hf_config(hf_dir)
    source = {"hf_folder": str(hf_dir.resolve()), "model_type": hf_cfg["model_type"]}
    if source_id.startswith("hf:"):
        source["hub_id"] = source_id
    with fresh_output(run_dir, overwrite=overwrite, inputs=[hf_dir]) as tmp:
        _write_converted_run(tmp, model, source)
        if (hf_dir / "tokenizer.json").is_file():
            _place_tokenizer(hf_dir, tmp, run_dir)
    return run_dir


def _write_converted_run(tmp: Path, model: torch.nn.Module, source: dict) -> None:
    """config.yaml and checkpoints/step_0000000 of a run converted from `source` (its provenance)."""
    from archlab.runs.checkpoint import CHECKPOINT_DIR, save_checkpoint
    from archlab.runs.model_folder import write_run_config

    cfg: ModelConfig = model.config       # type: ignore[assignment]
    write_run_config(tmp, model=cfg.to_dict(), train={"seq_len": cfg.max_seq_len}, data={"converted_from": source})
    save_checkpoint(tmp / CHECKPOINT_DIR, 0, model.state_dict(), {}, keep_last=0, extra_meta={"converted_from": source})


def _place_tokenizer(src: Path, tmp: Path, run_dir: Path) -> None:
    """The tokenizer files of folder `src` into tmp/tokenizer, or tmp/tokenizer_hf when archlab cannot load them."""
    problem = _tokenizer_problem(src)
    if problem is None:
        _copy_tokenizer(src, tmp / "tokenizer")
    else:  # keep it, but where load_run does not trip over it
        _copy_tokenizer(src, tmp / "tokenizer_hf")
        print(f"note: archlab's tokenizer cannot read {src / 'tokenizer.json'} ({problem}); "
              f"copied to {run_dir / 'tokenizer_hf'} instead of tokenizer/", file=sys.stderr)


def convert_from_gguf(gguf_file: str | Path, run_dir: str | Path, dtype: torch.dtype = torch.float32,
                      overwrite: bool = False) -> Path:
    """GGUF file -> run folder: the weights dequantized (archlab.interop.gguf.load_gguf), tokenizer/ rebuilt from
    the file's tokenizer.ggml.* metadata with its chat template, generation_config.json from its token ids (and
    sampling defaults). Everything is read and checked before anything is written; an existing non-empty run_dir
    is refused unless `overwrite` (replaced atomically).
    Example: convert_from_gguf(packaged_model("smollm2-135m-instruct"), "runs/smollm2")"""
    import json
    import tempfile

    from archlab.interop.gguf.load import load_gguf_spec, read_spec
    from archlab.interop.gguf.tokenizer import tokenizer_files
    from archlab.runs.outputs import check_output, fresh_output

    run_dir, gguf_file = Path(run_dir), Path(gguf_file)
    check_output(run_dir, inputs=[gguf_file], overwrite=overwrite)
    spec = read_spec(gguf_file)
    tok_files = tokenizer_files(spec.file, spec.config.vocab_size)
    model = load_gguf_spec(spec, dtype=dtype)
    source = {"gguf_file": str(gguf_file.resolve()), "architecture": spec.arch.name,
              "model_type": spec.arch.model_type, "bytes": gguf_file.stat().st_size}
    with tempfile.TemporaryDirectory(prefix="archlab-gguf-tok-") as tok_dir:
        for name, content in tok_files.items():
            (Path(tok_dir) / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
        with fresh_output(run_dir, overwrite=overwrite, inputs=[gguf_file]) as tmp:
            _write_converted_run(tmp, model, source)
            if "tokenizer.json" in tok_files:
                _place_tokenizer(Path(tok_dir), tmp, run_dir)
            else:
                print(f"note: {gguf_file} holds no tokenizer; the run has no tokenizer/", file=sys.stderr)
            generation = json.dumps(tok_files["generation_config.json"], indent=2)
            (tmp / "generation_config.json").write_text(generation + "\n")
    return run_dir


def convert_to_gguf(run_dir: str | Path, out_file: str | Path, qtype: str = "f16", overwrite: bool = False,
                    check: bool = True) -> dict:
    """Run folder (latest checkpoint) -> one GGUF file (archlab.interop.gguf.write.save_gguf) with the run's
    tokenizer, chat template and sampling defaults; with `check`, read back by archlab and by transformers
    (archlab.interop.gguf.validate), returning that report. An existing out_file is replaced only with `overwrite`.
    Example: convert_to_gguf("runs/smollm2", "smollm2-q8_0.gguf", qtype="q8_0")"""
    from archlab.errors import UserError
    from archlab.generation.config import FILE as GENERATION_FILE
    from archlab.interop.gguf.validate import readback, sample_ids
    from archlab.interop.gguf.write import save_gguf
    from archlab.runs.model_folder import load_run, refuse_quantized, refuse_score_head
    from archlab.runs.outputs import check_output

    # a folder there, or a name ending in a slash (Path() drops it: the folder's name would become a file)
    if str(out_file).endswith(("/", os.sep)) or Path(out_file).is_dir():
        raise UserError(f"--out {out_file} names a folder; --to-gguf writes one .gguf file (e.g. "
                        f"{Path(out_file) / 'model.gguf'})")
    run_dir, out_file = Path(run_dir), Path(out_file)
    check_output(out_file, inputs=[run_dir], overwrite=overwrite)
    refuse_quantized(run_dir, "convert --to-gguf")     # its int8 layers have no float weight to write
    model, tokenizer = load_run(run_dir)
    refuse_score_head(model, run_dir, "GGUF")
    drop_value_head(model)
    tok_dir = run_dir / "tokenizer"
    generation_file = run_dir / GENERATION_FILE
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    save_gguf(model, out_file, qtype=qtype, generation=generation,
              tokenizer_dir=tok_dir if (tok_dir / "tokenizer.json").is_file() else None)
    return readback(model, out_file, sample_ids(model, tokenizer)) if check else {}


def _tokenizer_problem(folder: Path) -> str | None:
    """None when archlab.tokenizer loads folder/tokenizer.json, else the reason."""
    from archlab.data.tokenizer_adapter import load_tokenizer as load  # what load_run uses
    try:
        load(folder)
    except Exception as exc:  # any failure means a run folder could not load it
        return f"{type(exc).__name__}: {exc}"
    return None


def drop_value_head(model: torch.nn.Module) -> None:
    """A PPO policy exports as the policy: its value head (training state, nn/heads.VALUE_HEAD) is left behind."""
    from archlab.nn.heads import VALUE_HEAD

    if hasattr(model, VALUE_HEAD):
        delattr(model, VALUE_HEAD)


def convert_to_hf(run_dir: str | Path, out_dir: str | Path, family: str | None = None,
                  overwrite: bool = False) -> str:
    """Run folder (latest checkpoint) -> HF folder with the tokenizer files transformers reads
    (tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json: an HF tokenizer's
    own, as `--from-hf` copied them, else written from the tokenizer's special tokens, archlab.interop.
    tokenizer_files); returns the HF model_type used. An existing non-empty out_dir is replaced only with
    `overwrite` (atomically)."""
    from archlab.interop.hf import save_hf, write_tokenizer_files
    from archlab.runs.model_folder import load_run, refuse_quantized, refuse_score_head
    from archlab.runs.outputs import check_output, fresh_output

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    refuse_quantized(run_dir, "convert --to-hf")
    check_output(out_dir, inputs=[run_dir], overwrite=overwrite)
    model, _ = load_run(run_dir)
    refuse_score_head(model, run_dir, "an HF causal-LM folder")
    drop_value_head(model)
    with fresh_output(out_dir, overwrite=overwrite, inputs=[run_dir]) as tmp:
        fam = save_hf(model, tmp, family=family)
        tok = run_dir / "tokenizer"
        if (tok / "tokenizer.json").is_file():
            _copy_tokenizer(tok, tmp)       # an HF tokenizer's own files (roles, post-processing) come along
            seq2seq = model.config.arch == "encoder_decoder"
            write_tokenizer_files(tmp, model.config.max_seq_len,
                                  decoder_start_token_id=model.config.decoder_start_token_id if seq2seq else None)
    return fam.model_type


def no_hf_tokenizer(run_dir: Path) -> str:
    """Why a run's HF export has no tokenizer.json, and what encodes text for it instead."""
    byte_file = run_dir / "tokenizer" / "byte_tokenizer.json"
    if byte_file.is_file():
        try:
            specials = json.loads(byte_file.read_text()).get("special_tokens") or {}
        except (ValueError, AttributeError):
            specials = {}
        extra = "".join(f", {i} = {name}" for name, i in specials.items())
        return (f"the run's tokenizer is archlab's byte tokenizer ({byte_file}), which has no Hugging Face file: "
                f"encode text as its UTF-8 bytes (token id = byte value{extra})")
    return f"the run has no tokenizer ({run_dir / 'tokenizer'} holds no tokenizer.json)"


def compare_with_transformers(hf_dir: str | Path, seq_len: int = 32, batch: int = 2, seed: int = 0,
                              dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Logits of archlab.load_hf and transformers on the same random tokens:
    max_abs, max_rel (max|a-b| / max|b|) and mean_kl = mean over positions of KL(p_hf || p_ours).
    A decoder is compared with AutoModelForCausalLM, an encoder (BERT, RoBERTa) with
    AutoModelForMaskedLM on unpadded rows free of the pad token (RoBERTa numbers positions by it), an
    encoder-decoder (T5) with AutoModelForSeq2SeqLM, the tokens as its source and, shifted by one, as its
    decoder's inputs."""
    import transformers

    from archlab.interop.hf import load_hf, read_hf_config
    from archlab.runs.hub import resolve_model

    hf_dir = resolve_model(hf_dir)
    ours = load_hf(hf_dir, dtype=dtype)
    encoder = ours.config.arch == "encoder"
    seq2seq = ours.config.arch == "encoder_decoder"
    auto = (transformers.AutoModelForMaskedLM if encoder else transformers.AutoModelForSeq2SeqLM if seq2seq
            else transformers.AutoModelForCausalLM)
    kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    theirs = auto.from_pretrained(hf_dir, attn_implementation="eager", **{kw: dtype}).eval()
    seq_len = min(seq_len, ours.config.max_seq_len)
    gen = torch.Generator().manual_seed(seed)
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    pad = read_hf_config(hf_dir).get("pad_token_id")
    if encoder and isinstance(pad, int) and vocab > 1:
        ids = torch.where(ids == pad, (pad + 1) % vocab, ids)
    with torch.no_grad():
        if seq2seq:
            dec = ids.roll(1, -1)
            a = ours(ids, dec).float()
            b = theirs(input_ids=ids, decoder_input_ids=dec, use_cache=False).logits.float()
        else:
            a = ours(ids).float()
            b = (theirs(input_ids=ids) if encoder else theirs(input_ids=ids, use_cache=False)).logits.float()
    diff = (a - b).abs()
    return {"max_abs": float(diff.max()), "max_rel": float(diff.max() / b.abs().max()),
            "mean_kl": mean_kl(b, a)}


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) from logits (..., v). Each position's KL is clamped at 0: it is never
    negative, and float rounding on near-identical logits gives -1e-8 otherwise."""
    log_p, log_q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0).mean())      # (...,) -> scalar


# ---- command entry points ------------------------------------------------------------------------
