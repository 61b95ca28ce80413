"""The reverse-a-word task's text: held-out words never reach a training line of any stage, the answers are the
reversals in the two annotators' cases, and the lab's task folder holds the base corpus and the SFT examples."""
import json

from archlab.data import reverse_words as rw
from archlab.data.tokens import load_meta


def test_held_out_words_never_reach_any_training_line(tmp_path):
    sft, dpo = rw.write_task_data(tmp_path, sft_examples=2000, dpo_pairs=500)
    held = set(rw.reverse_problems(200))
    assert len(held) > 150 and all(len(w) == rw.WORD_LENGTH for w in held)
    seen = set()
    for line in sft.read_text().splitlines():
        row = json.loads(line)
        word = row["messages"][0]["content"].removeprefix(rw.INSTRUCTION)
        answer = row["messages"][1]["content"]
        assert answer in (word[::-1], word[::-1].upper())
        seen.add(word)
    for line in dpo.read_text().splitlines():
        row = json.loads(line)
        word = row["prompt"][0]["content"].removeprefix(rw.INSTRUCTION)
        assert row["chosen"][0]["content"] == word[::-1] and row["rejected"][0]["content"] == word[::-1].upper()
        seen.add(word)
    docs = rw.base_documents(2000)
    assert all(doc == rw.plain_prompt(doc.split()[1]) + doc.split()[1][::-1] for doc in docs)
    base_words = {doc.split()[1] for doc in docs}
    assert not held & (seen | base_words)
    capitals = sum(json.loads(line)["messages"][1]["content"].isupper() for line in sft.read_text().splitlines())
    assert 0.4 < capitals / 2000 < 0.6                      # two annotators, one in capitals


def test_the_task_folder_holds_the_base_corpus_and_the_sft_examples_only(tmp_path):
    folder = rw.prepare_task_folder(tmp_path / "task", quick=True, progress=False)
    assert load_meta(folder)["vocab_size"] > 256                             # bytes + ChatML's tokens
    assert (folder / "tokenizer").is_dir() and not (folder / rw.DPO_FILE).exists()
    lines = (folder / rw.SFT_FILE).read_text().splitlines()
    assert len(lines) == rw.SIZES["quick"]["sft_examples"]
