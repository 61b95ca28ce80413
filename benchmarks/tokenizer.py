"""Benchmark archlab's byte-level BPE against HF `tokenizers` (and `tiktoken` for encoding), same run.

    python benchmarks/tokenizer.py                      # shakespeare @10k and pystdlib-full @32k
    python benchmarks/tokenizer.py --corpora shakespeare --skip-python-fallback

Training: each trainer runs in its own subprocess on the same files, vocabulary size and special token;
wall time covers reading + pre-tokenization + merges (imports excluded); peak memory is the largest
summed PSS of the subprocess and its children (our pre-tokenization workers, sampled every 20 ms).
Encoding: MB/s of one `encode(text)` call over the corpus text with the tokenizer we trained, through
archlab (tiktoken fast path and pure Python), `tokenizers` loading our tokenizer.json, and a raw
`tiktoken.Encoding` with our ranks; ids are checked to be identical.
Numbers are ratios from the same run, so they survive a busy machine better than absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SPECIAL = "<|endoftext|>"

OURS = """
import json, sys, time
from archlab.tokenizer import train_bpe, Tokenizer
files, vocab_size, out, backend = json.loads(sys.argv[1])
import_pss = sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:")) / 1024
t = time.perf_counter()
vocab, merges = train_bpe(files, vocab_size, ["<|endoftext|>"], backend=backend)
seconds = time.perf_counter() - t
if out:
    Tokenizer(vocab, merges, ["<|endoftext|>"]).save(out)
print(json.dumps({"seconds": seconds, "vocab": len(vocab), "import_mb": import_pss}))
"""

HF = """
import json, sys, time
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
files, vocab_size, out, _ = json.loads(sys.argv[1])
t = time.perf_counter()
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
def texts():  # like tok.train(files), which reads lines, but tolerant of non-UTF-8 bytes as archlab is
    for f in files:
        with open(f, encoding="utf-8", errors="replace", newline="") as fh:
            yield from fh
tok.train_from_iterator(texts(), trainer)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "vocab": tok.get_vocab_size()}))
"""


def _tree_rss(pid: int) -> int:
    """Summed PSS (bytes; pages shared after fork counted once overall) of a process and its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run_trainer(script: str, files: list[str], vocab_size: int, out: str | None, backend: str | None = None):
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps([files, vocab_size, out, backend])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    stop.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(stderr)
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_mb"] = peak / 2**20
    return result


def throughput(fn, text: str, repeats: int = 1) -> tuple[float, list[int]]:
    best, ids = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        ids = fn(text)
        best = min(best, time.perf_counter() - t)
    return len(text.encode("utf-8")) / 1e6 / best, ids


def bench_corpus(name: str, vocab_size: int, args) -> dict:
    from archlab.data.corpora import corpus_files
    files = [str(p) for p in corpus_files(name)]
    size_mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"\n== {name}: {len(files)} files, {size_mb:.1f} MB, vocab {vocab_size} ==", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_trainer(OURS, files, vocab_size, tmp)
        hf = run_trainer(HF, files, vocab_size, None)
        row = {"corpus": name, "mb": size_mb, "vocab": vocab_size, "ours_s": ours["seconds"], "hf_s": hf["seconds"],
               "ours_peak_mb": ours["peak_mb"], "hf_peak_mb": hf["peak_mb"]}
        print(f"train  archlab (C loop) {ours['seconds']:7.2f} s  peak {ours['peak_mb']:7.0f} MB "
              f"(of which {ours['import_mb']:.0f} MB is `import archlab`, i.e. torch)")
        row["ours_import_mb"] = ours["import_mb"]
        print(f"train  tokenizers       {hf['seconds']:7.2f} s  peak {hf['peak_mb']:7.0f} MB")
        print(f"  -> time ratio archlab/tokenizers = {ours['seconds'] / hf['seconds']:.2f}x, "
              f"peak memory ratio = {ours['peak_mb'] / hf['peak_mb']:.2f}x")
        if not args.skip_python_fallback:
            py = run_trainer(OURS, files, vocab_size, None, "python")
            row["py_s"] = py["seconds"]
            print(f"train  archlab (Python loop) {py['seconds']:7.2f} s  "
                  f"-> {py['seconds'] / hf['seconds']:.2f}x tokenizers")
        if args.encode:
            row.update(bench_encode(files, tmp, args))
    return row


def bench_encode(files: list[str], tok_dir: str, args) -> dict:
    import tiktoken
    import tokenizers

    from archlab.tokenizer import load
    text = "".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    if args.encode_mb:
        text = text[: int(args.encode_mb * 1e6)]
    ours = load(tok_dir)
    assert ours.uses_fast_path, ours.fast_path_reason()
    hf = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    ranks = {ours.id_to_bytes[i]: i for i in range(ours.vocab_size) if i not in ours._special_ids}
    enc = tiktoken.Encoding(name="bench", pat_str=ours.pattern, mergeable_ranks=ranks, special_tokens={})
    results = {}
    mbps_ours, ids_ours = throughput(ours.encode, text, 2)
    mbps_hf, ids_hf = throughput(lambda t: hf.encode(t).ids, text, 2)
    mbps_tt, ids_tt = throughput(enc.encode_ordinary, text.replace(SPECIAL, ""), 2)
    assert ids_hf == ids_ours, "tokenizers and archlab ids differ"
    print(f"encode archlab (tiktoken path) {mbps_ours:7.2f} MB/s")
    print(f"encode tokenizers              {mbps_hf:7.2f} MB/s  -> archlab/tokenizers = {mbps_ours / mbps_hf:.2f}x")
    print(f"encode raw tiktoken            {mbps_tt:7.2f} MB/s  -> archlab/tiktoken = {mbps_ours / mbps_tt:.2f}x")
    results.update(enc_ours=mbps_ours, enc_hf=mbps_hf, enc_tiktoken=mbps_tt)
    lines = text.splitlines(keepends=True)
    mbps_ours_l, ids_l = throughput(lambda _: [ours.encode(x) for x in lines], text)
    mbps_hf_l, ids_hf_l = throughput(lambda _: [e.ids for e in hf.encode_batch(lines)], text)
    mbps_tt_l, _ = throughput(lambda _: enc.encode_ordinary_batch(lines), text)
    assert ids_l == ids_hf_l, "per-line ids differ"
    print(f"encode per line ({len(lines)} lines): archlab {mbps_ours_l:.2f} MB/s, tokenizers encode_batch "
          f"{mbps_hf_l:.2f} MB/s ({mbps_ours_l / mbps_hf_l:.2f}x), tiktoken batch {mbps_tt_l:.2f} MB/s")
    results.update(enc_ours_lines=mbps_ours_l, enc_hf_lines=mbps_hf_l, enc_tiktoken_lines=mbps_tt_l)
    sample = text[: 1_000_000]
    slow = load(tok_dir, fast=False)
    mbps_py, ids_py = throughput(slow.encode, sample)
    assert ids_py == ours.encode(sample), "pure-Python and tiktoken paths differ"
    print(f"encode archlab (pure Python)   {mbps_py:7.2f} MB/s (first 1 MB; ids identical to the fast path)")
    results["enc_python"] = mbps_py
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", nargs="+", default=["shakespeare:10000", "pystdlib-full:32000"],
                        help="NAME:VOCAB pairs, e.g. --corpora shakespeare:10000 pystdlib:32000")
    parser.add_argument("--skip-python-fallback", action="store_true",
                        help="do not time the pure-Python merge loop (slow on big corpora)")
    parser.add_argument("--no-encode", dest="encode", action="store_false", help="skip encoding throughput")
    parser.add_argument("--encode-mb", type=float, default=10.0,
                        help="encode at most this many MB of the corpus text (default 10)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON, e.g. --json bench.json")
    args = parser.parse_args()
    from archlab.runs.provenance import provenance_line
    print(provenance_line(threads=getattr(args, 'threads', None)), flush=True)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    rows = []
    for spec in args.corpora:
        name, vocab = spec.rsplit(":", 1)
        rows.append(bench_corpus(name, int(vocab), args))
    print("\nsummary (ratio archlab / tokenizers; < 1 is better for time and memory, > 1 for MB/s):")
    for r in rows:
        line = (f"  {r['corpus']:>14} {r['mb']:5.1f} MB vocab {r['vocab']:>6}: "
                f"train time {r['ours_s'] / r['hf_s']:.2f}x, "
                f"peak memory {r['ours_peak_mb'] / r['hf_peak_mb']:.2f}x")
        if "enc_hf" in r:
            line += (f", encode one string {r['enc_ours'] / r['enc_hf']:.2f}x (raw tiktoken "
                     f"{r['enc_tiktoken'] / r['enc_hf']:.2f}x), "
                     f"per line {r['enc_ours_lines'] / r['enc_hf_lines']:.2f}x")
        print(line + f" (memory above the import: {(r['ours_peak_mb'] - r['ours_import_mb']) / r['hf_peak_mb']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
