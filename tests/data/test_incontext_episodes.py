"""The k-shot mapping task's data (archlab.data.incontext): episodes, their value slots, the mixed corpus."""
from __future__ import annotations

import random
from collections import Counter

from archlab.data import arithmetic, incontext


def test_an_episode_shows_each_of_its_keys_shots_plus_one_times_with_one_value_each():
    pairs = incontext.episode(random.Random(0), keys=3, shots=3)
    counts = Counter(k for k, _ in pairs)
    assert len(counts) == 3 and set(counts.values()) == {4}
    assert all(len({v for k2, v in pairs if k2 == k}) == 1 for k in counts)     # one value per key in an episode
    text = incontext.line(pairs)
    assert len(text) == 4 * 12 - 1 and text.count(">") == 12


def test_mappings_are_fresh_per_episode():
    eps = incontext.episodes(200)
    mappings = {tuple(sorted(set(pairs))) for pairs in eps}
    assert len(mappings) == 200                                 # no mapping repeats: nothing to memorise
    assert incontext.episodes(5) == incontext.episodes(5)       # the same scored episodes for every run


def test_value_slots_point_at_the_values_and_count_earlier_occurrences_by_hand():
    pairs = [("q", "m"), ("f", "c"), ("q", "m"), ("q", "m"), ("f", "c")]
    text = "\n" + incontext.line(pairs)                         # "\nq>m f>c q>m q>m f>c"
    slots = incontext.value_slots(pairs)
    assert slots == [(3, 0), (7, 0), (11, 1), (15, 2), (19, 1)]
    assert [text[o] for o, _ in slots] == ["m", "c", "m", "m", "c"]
    assert [text[o - 1] for o, _ in slots] == [">"] * 5


def test_the_mixed_corpus_keeps_every_addition_line_and_adds_episodes_at_about_the_rate():
    docs = list(arithmetic.documents(2, n_docs=3, per_doc=500))
    mixed = list(incontext.interleave(docs, seed=1))
    assert incontext.split_corpus("addition-2+icl") == ("addition-2", True)
    assert incontext.split_corpus("addition-2") == ("addition-2", False)
    for doc, mix in zip(docs, mixed):
        lines = mix.splitlines()
        episodes = [x for x in lines if ">" in x]
        assert [x for x in lines if ">" not in x] == doc.splitlines()
        assert 60 <= len(episodes) <= 140                      # 500 lines x 1/5
        assert all(len(x) == 47 for x in episodes)
