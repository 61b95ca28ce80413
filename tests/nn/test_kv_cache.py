"""KV caches: rolling buffers hold exactly the window, GQA stores kv heads only, sizes match the
analytic estimate, and the StreamingLLM cache keeps sinks + recent tokens with in-cache positions."""
import pytest
import torch
from variants import BASE, variant

import archlab
from archlab import TransformerLM
from archlab.nn import attention_backends as backends
from archlab.nn.kv_cache import KVCache, SinkKVCache, StaticKVCache
from archlab.nn.position import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _kv(b, k, t, e, start=0):
    x = torch.arange(start, start + t, dtype=torch.float32)[None, None, :, None]
    return x.expand(b, k, t, e).clone()


def test_rolling_buffer_keeps_the_last_window_and_global_layer_everything():
    cfg = BASE.with_overrides({"attention.window": 3, "attention.layer_pattern": "LG",
                               "attention.n_kv_heads": 2})
    cache = StaticKVCache(cfg, batch=1, max_len=10)
    local, glob = cache.layers
    assert local.k.shape == (1, 2, 3, cfg.head_dim)        # kv heads only, window slots
    assert glob.k.shape == (1, 2, 10, cfg.head_dim)
    for p in range(7):
        k = _kv(1, 2, 1, cfg.head_dim, p)
        pos = torch.tensor([[p]])
        _, _, kpos_local = cache.update(0, k, k, pos)
        ks, _, kpos_global = cache.update(1, k, k, pos)
    assert sorted(kpos_local[0].tolist()) == [4, 5, 6]
    assert kpos_global[0].tolist() == list(range(7))
    assert sorted(local.k[0, 0, :, 0].tolist()) == [4.0, 5.0, 6.0]  # slot values follow positions
    assert len(cache) == 7


def test_global_layers_share_one_positions_buffer_written_once_per_forward_and_reordered_once():
    cfg = BASE.with_overrides({"n_layers": 3, "attention.window": 2, "attention.layer_pattern": "GLG"})
    cache = StaticKVCache(cfg, batch=2, max_len=6)
    first, local, last = cache.layers
    assert first.pos is last.pos is cache.shared_pos and local.pos is not cache.shared_pos
    for p in range(4):                                     # row 1 is padding until position 2
        pos = torch.tensor([[p], [p - 2 if p >= 2 else -1]])
        got = [cache.update(layer, _kv(2, 4, 1, 8, p), _kv(2, 4, 1, 8, p), pos)[2] for layer in range(3)]
        assert got[0] is got[2]                            # written and sliced once, by the first global layer
    assert got[0].tolist() == [[0, 1, 2, 3], [-1, -1, 0, 1]]
    assert sorted(got[1][0].tolist()) == [2, 3]            # the local layer keeps its own rolling positions
    cache.reorder(torch.tensor([1, 1]))                    # beam search: both rows become old row 1
    assert first.pos is last.pos is cache.shared_pos
    _, _, k_pos = cache.update(0, _kv(2, 4, 1, 8, 4), _kv(2, 4, 1, 8, 4), torch.tensor([[2], [2]]))
    assert k_pos.tolist() == [[-1, -1, 0, 1, 2]] * 2
    assert cache.update(2, _kv(2, 4, 1, 8, 4), _kv(2, 4, 1, 8, 4), torch.tensor([[2], [2]]))[2] is k_pos
    assert first.k[:, 0, :5, 0].tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]] * 2


def test_rolling_buffer_chunk_that_wraps_returns_old_and_new_keys():
    cfg = BASE.with_overrides({"attention.window": 4})
    cache = StaticKVCache(cfg, batch=1, max_len=20)
    cache.update(0, _kv(1, 4, 3, 8), _kv(1, 4, 3, 8), torch.arange(3)[None])
    k_all, _, k_pos = cache.update(0, _kv(1, 4, 5, 8, 3), _kv(1, 4, 5, 8, 3), torch.arange(3, 8)[None])
    assert k_pos[0].tolist() == list(range(8))                 # this chunk's queries need them all
    assert sorted(cache.layers[0].pos[0].tolist()) == [4, 5, 6, 7]


def test_full_cache_overflow_is_a_clear_error():
    cache = StaticKVCache(BASE, batch=1, max_len=4)
    cache.update(0, _kv(1, 4, 4, 8), _kv(1, 4, 4, 8), torch.arange(4)[None])
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(0, _kv(1, 4, 1, 8), _kv(1, 4, 1, 8), torch.tensor([[4]]))


@pytest.mark.parametrize("name", ["base", "gqa", "mqa", "local-global", "window", "head-dim"])
def test_cache_bytes_match_analytic_estimate(name):
    from archlab.models.accounting import kv_cache_bytes
    cfg = variant(name)
    model = TransformerLM(cfg).eval()
    cache = StaticKVCache(cfg, batch=3, max_len=20)
    with torch.inference_mode():
        model(torch.randint(0, 97, (3, 20)), cache=cache)
    assert cache.nbytes == kv_cache_bytes(cfg, 20, batch=3, dtype="float32")


def test_static_cache_logits_equal_concat_cache():
    model = TransformerLM(variant("gqa")).eval()
    ids = torch.randint(0, 97, (2, 12))
    outs = []
    for cache in (KVCache(), StaticKVCache(model.config, 2, 12)):
        outs.append(torch.cat([model(ids[:, :5], cache=cache)] +
                              [model(ids[:, i:i + 1], cache=cache) for i in range(5, 12)], dim=1))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[1], model(ids), rtol=1e-5, atol=1e-5)


def test_reorder_selects_rows():
    cache = StaticKVCache(BASE, batch=3, max_len=5)
    k = torch.arange(3.0)[:, None, None, None].expand(3, 4, 2, 8)
    cache.update(0, k, k, torch.arange(2).expand(3, 2))
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.layers[0].k[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]


def test_sink_cache_keeps_sinks_and_recent_tokens_with_in_cache_positions():
    cfg = BASE.with_overrides({"attention.n_kv_heads": 2})
    cache = SinkKVCache(cfg, batch=1, sink_tokens=2, window=3)
    rope = RotaryEmbedding(cfg, cfg.layer_spec(0))
    identity = lambda x, pos: x  # noqa: E731
    for p in range(9):
        k = _kv(1, 2, 1, cfg.head_dim, p)
        keys, values, k_pos, q_pos = cache.update(0, k, k, torch.tensor([[p]]), rotate=identity)
    assert values[0, 0, :, 0].tolist() == [0.0, 1.0, 6.0, 7.0, 8.0]   # 2 sinks + last 3, in order
    assert k_pos[0].tolist() == [0, 1, 2, 3, 4] and q_pos[0].tolist() == [4]
    # keys come back rotated with their in-cache positions
    raw = torch.randn(1, 2, 1, cfg.head_dim)
    keys, _, k_pos, _ = cache.update(0, raw, raw, torch.tensor([[9]]), rotate=rope.rotate)
    torch.testing.assert_close(keys[:, :, -1:], rope.rotate(raw, torch.tensor([[4]])))


def test_sink_mode_equals_normal_decoding_while_nothing_is_evicted():
    model = TransformerLM(BASE.with_overrides({"init.std": 0.2})).eval()
    prompt = list(range(1, 9))
    normal = archlab.generate(model, prompt, max_new_tokens=20)
    sink = archlab.generate(model, prompt, max_new_tokens=20, sink_tokens=4, sink_window=40)
    assert torch.equal(normal, sink)


@pytest.mark.parametrize("kind", ["rope", "alibi", "t5", "none"])
def test_sink_mode_decodes_past_max_seq_len(kind):
    model = TransformerLM(BASE.with_overrides({"position.kind": kind, "max_seq_len": 16})).eval()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        archlab.generate(model, [1, 2, 3], max_new_tokens=40)
    out = archlab.generate(model, list(range(20)), max_new_tokens=40, sink_tokens=4, sink_window=8)
    assert out.shape == (60,)


def test_sink_mode_rejects_absolute_positions_and_padding():
    model = TransformerLM(BASE.with_overrides({"position.kind": "learned"})).eval()
    with pytest.raises(ValueError, match="StreamingLLM mode needs positions inside attention"):
        archlab.generate(model, [1, 2], sink_window=8)
    model = TransformerLM(BASE).eval()
    with pytest.raises(ValueError, match="padded"):
        archlab.generate(model, [[1, 2], [3]], sink_window=8)


def _decoded(model, ids, cache):                                             # (b, t) -> (b, t, v)
    """The logits of feeding `ids` through `cache` one token at a time: what decoding computes (the reference)."""
    b, t = ids.shape
    return torch.cat([model(ids[:, i:i + 1], positions=torch.full((b, 1), i), cache=cache) for i in range(t)], 1)


@pytest.mark.parametrize("name", ["base", "pos-none", "softcap", "learned-sinks", "qk-norm-per-head", "gqa"])
@pytest.mark.parametrize("sinks, window", [(0, 6), (2, 5), (4, 1)])
def test_sink_cache_stretch_in_one_forward_equals_feeding_it_token_by_token(name, sinks, window):
    torch.manual_seed(0)
    cfg = variant(name).with_overrides({"init.std": 0.2, "max_seq_len": 32})
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    stepwise, at_once = (SinkKVCache(cfg, 2, sink_tokens=sinks, window=window) for _ in range(2))
    with torch.no_grad():
        ref = _decoded(model, ids, stepwise)
        once = model(ids, cache=at_once)                      # one forward: SinkKVCache.stretch
        with backends.forced("eager", strict=True):
            eager = model(ids, cache=SinkKVCache(cfg, 2, sink_tokens=sinks, window=window))
        plain = model(ids)
    torch.testing.assert_close(once, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(eager, ref, atol=2e-5, rtol=2e-5)
    cap = sinks + window
    torch.testing.assert_close(once[:, :cap], plain[:, :cap], atol=2e-5, rtol=2e-5)   # nothing evicted yet
    assert not torch.allclose(once[:, cap:], plain[:, cap:], atol=1e-3)               # past it, the eviction shows
    # the cache holds what decoding left: the sinks and the last `window` tokens, and decoding goes on alike
    assert len(at_once) == len(stepwise) == 21
    for layer_once, layer_ref in zip(at_once.layers, stepwise.layers):
        torch.testing.assert_close(layer_once.k, layer_ref.k)
        torch.testing.assert_close(layer_once.v, layer_ref.v)
    more = torch.randint(0, cfg.vocab_size, (2, 3))
    with torch.no_grad():
        torch.testing.assert_close(_decoded(model, more, at_once), _decoded(model, more, stepwise),
                                   atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["base", "gqa", "learned-sinks"])
@pytest.mark.parametrize("sinks, window", [(0, 6), (2, 5)])
@pytest.mark.parametrize("chunks", [(3, 9, 1, 6, 2), (7, 14), (10, 2, 9)])
def test_sink_cache_stretches_in_chunks_equal_feeding_it_token_by_token(name, sinks, window, chunks):
    """Chunks that overflow a partly filled or a full cache: each scored in one forward as decoding would."""
    torch.manual_seed(0)
    cfg = variant(name).with_overrides({"init.std": 0.2, "max_seq_len": 32})
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, sum(chunks)))
    stepwise, chunked = (SinkKVCache(cfg, 2, sink_tokens=sinks, window=window) for _ in range(2))
    bounds = torch.tensor((0, *chunks)).cumsum(0).tolist()
    with torch.no_grad():
        ref = _decoded(model, ids, stepwise)
        once = torch.cat([model(ids[:, a:z], cache=chunked) for a, z in zip(bounds, bounds[1:])], 1)
    torch.testing.assert_close(once, ref, atol=2e-5, rtol=2e-5)
    assert len(chunked) == len(stepwise) == ids.shape[1]
    for layer_once, layer_ref in zip(chunked.layers, stepwise.layers):
        torch.testing.assert_close(layer_once.k, layer_ref.k)
        torch.testing.assert_close(layer_once.v, layer_ref.v)


@pytest.mark.parametrize("overrides", [{"position.kind": "alibi"}, {"attention.window": 4}])
def test_sink_cache_stretch_refuses_what_it_cannot_score_as_decoding_would(overrides):
    cfg = BASE.with_overrides(overrides)
    model = TransformerLM(cfg).eval()
    with pytest.raises(ValueError, match="one at a time"):
        model(torch.zeros(1, 12, dtype=torch.long), cache=SinkKVCache(cfg, 1, sink_tokens=2, window=4))
    with torch.no_grad():   # within its capacity a stretch is an ordinary prefill
        model(torch.zeros(1, 6, dtype=torch.long), cache=SinkKVCache(cfg, 1, sink_tokens=2, window=4))


def test_slot_cache_rows_of_different_lengths_decode_as_each_would_alone():
    """Continuous batching's cache: two prompts prefilled into their own rows, then decoded together one
    forward per step, give archlab.generate's greedy tokens for each."""
    from variants import BASE

    import archlab
    from archlab.nn.kv_cache import SlotKVCache
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    torch.manual_seed(0)
    model = archlab.TransformerLM(cfg).eval()
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([40, 41])]
    expected = [archlab.generate(model, p, 10)[len(p):].tolist() for p in prompts]
    slots = SlotKVCache(cfg, rows=3, capacity=64)
    got: list[list[int]] = [[], []]
    with torch.no_grad():
        for row, p in enumerate(prompts):                        # rows join one at a time
            logits = model(p[None], positions=torch.arange(len(p))[None], cache=slots.view([row]))
            got[row].append(int(logits[0, -1].argmax()))
        for _ in range(9):                                       # then decode together
            last = torch.tensor([[got[0][-1]], [got[1][-1]]])
            positions = torch.tensor([[slots.length[0]], [slots.length[1]]])
            logits = model(last, positions=positions, cache=slots.view([0, 1]))
            for row in range(2):
                got[row].append(int(logits[row, -1].argmax()))
    assert got == expected
    slots.reset(0)
    assert slots.length[0] == 0 and bool((slots.pos[0] == -1).all())


def test_slot_cache_batches_scattered_rows_as_views_moved_once_per_composition():
    """Rows that join and leave out of order (5 rows, prompts in rows 4, 1, 3; row 1 leaves, row 0 joins) decode
    together to archlab.generate's greedy tokens for each prompt alone; every step's keys are views of the slot
    cache (no copy per step): rows are moved to consecutive places once per batch composition, not per step."""
    from variants import BASE

    import archlab
    from archlab.nn.kv_cache import SlotKVCache
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    torch.manual_seed(0)
    model = archlab.TransformerLM(cfg).eval()
    prompts = {4: [5, 6, 7, 8, 9], 1: [40, 41], 3: [7, 1, 2, 3, 4, 5, 6, 9, 9], 0: [100, 3, 30]}
    expected = {row: archlab.generate(model, torch.tensor(p), 8)[len(p):].tolist() for row, p in prompts.items()}
    slots = SlotKVCache(cfg, rows=5, capacity=64)
    got: dict[int, list[int]] = {}
    storage = slots.k.untyped_storage().data_ptr()

    def join(row: int) -> None:
        p = torch.tensor([prompts[row]])
        logits = model(p, positions=torch.arange(p.shape[1])[None], cache=slots.view([row]))
        got[row] = [int(logits[0, -1].argmax())]

    def step(rows: list[int]) -> None:
        view, keys = slots.view(rows), []
        update = view.update

        def recorded(*args):                                         # what each layer attends over
            out = update(*args)
            keys.append(out[0])
            return out
        view.update = recorded                                       # type: ignore[method-assign]
        last = torch.tensor([[got[r][-1]] for r in rows])
        positions = torch.tensor([[slots.length[r]] for r in rows])
        logits = model(last, positions=positions, cache=view)
        for i, r in enumerate(rows):
            got[r].append(int(logits[i, -1].argmax()))
        assert len(keys) == cfg.n_layers and all(k.untyped_storage().data_ptr() == storage for k in keys)

    with torch.no_grad():
        for row in (4, 1, 3):
            join(row)
        for n in range(4):
            step([4, 1, 3])
            if n == 0:
                moved = slots.moved
                assert moved > 0                                     # scattered: arranged once...
        assert slots.moved == moved                                  # ...and never again for this batch
        assert got[1] == expected[1][:5]
        slots.reset(1)
        join(0)
        for _ in range(7):
            step([4, 3, 0])
        assert slots.moved > moved
    assert {r: got[r][:8] for r in (4, 3, 0)} == {r: expected[r] for r in (4, 3, 0)}
    assert sorted(slots.physical(r) for r in range(5)) == list(range(5))


def test_growing_a_cache_keeps_what_it_holds_and_continues_like_a_larger_one():
    """StaticKVCache.grow: the held keys, values and positions copied, the new slots empty (zeros at position -1, so
    a compiled step reading them stays finite), and a forward after the growth gives the logits a cache built at
    the larger size gives; a cache with rolling buffers refuses."""
    cfg = BASE.with_overrides({"attention.window": 3, "attention.layer_pattern": "LG", "max_seq_len": 64})
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    small = StaticKVCache(cfg, 2, 12, rolling=False)
    large = StaticKVCache(cfg, 2, 40, rolling=False)
    with torch.no_grad():
        for cache in (small, large):
            model(ids[:, :10], cache=cache)
        held = [(b.k[:, :, :10].clone(), b.v[:, :, :10].clone()) for b in small.layers]
        small.grow(10)                                     # holds as many already: nothing changes
        assert small.max_len == 12 and small.layers[0].k.shape[2] == 12
        small.grow(40)
        assert len(small) == 10 and small.max_len == 40
        for buf, (k, v) in zip(small.layers, held):
            assert buf.k.shape[2] == buf.capacity == 40 and buf.pos is small.shared_pos
            assert torch.equal(buf.k[:, :, :10], k) and torch.equal(buf.v[:, :, :10], v)
            assert not buf.k[:, :, 10:].any() and not buf.v[:, :, 10:].any()
        assert torch.equal(small.shared_pos[:, :10], large.shared_pos[:, :10])
        assert (small.shared_pos[:, 10:] == -1).all()
        torch.testing.assert_close(model(ids[:, 10:], cache=small), model(ids[:, 10:], cache=large), rtol=0, atol=0)
    rolling = StaticKVCache(cfg, 1, 12)
    with pytest.raises(ValueError, match="rolling"):
        rolling.grow(24)
