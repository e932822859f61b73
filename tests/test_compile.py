"""The compiled decode step (minillm.compile) and the packed weight layout against the plain path.

One torch.compile on a tiny CPU model (tens of seconds); the CUDA-graph variant is in test_cuda.py.
"""

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.compile import StaticKVView, compile_decode_step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("compile")), device="cpu")


def _prompt(model, batch=2, n=12):
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(7))


def test_static_view_writes_at_pos_and_masks_the_rest(model):
    cache = KVCache.for_model(model, max_seq_len=10)
    cache.length = 4
    view = StaticKVView(cache, torch.tensor([4]))
    k = torch.ones(1, model.config.n_kv_heads, 1, model.config.head_dim)
    k_all, _ = view.write(1, k, 2 * k)
    assert k_all.shape[2] == 10 and torch.equal(cache.k[1, :, :, 4], k[:, :, 0])
    assert torch.equal(cache.v[1, :, :, 4], 2 * k[:, :, 0])
    assert view.attn_mask.tolist() == [[True] * 5 + [False] * 5]


def test_compiled_decode_matches_decode_step(model):
    ids = _prompt(model)
    plain, static = (KVCache.for_model(model, batch_size=2, max_seq_len=24) for _ in range(2))
    a = prefill(model, ids, plain).argmax(-1)
    b = prefill(model, ids, static).argmax(-1)
    step = compile_decode_step("default")
    for _ in range(6):  # several lengths, one graph
        la, lb = decode_step(model, a, plain), step(model, b, static)
        assert (la - lb).abs().max().item() < 1e-4
        a, b = la.argmax(-1), lb.argmax(-1)
    assert static.length == plain.length == 18
    assert torch.allclose(static.k[:, :, :, :18], plain.k[:, :, :, :18], atol=1e-5)


def test_one_graph_serves_every_cache_size(model):
    """A new request's cache of another size reuses the graph (each size recompiled, 75-115 s on a
    2-core CPU, before its max_seq_len was marked dynamic), and so does a call from inside
    inference mode (a traced step; its inputs failed the guards); logits equal decode_step's."""
    step = compile_decode_step("default")
    ids = _prompt(model, batch=1, n=5)
    first = True
    for size in (9, 16, 31):
        plain, static = (KVCache.for_model(model, max_seq_len=size) for _ in range(2))
        a, b = prefill(model, ids, plain).argmax(-1), prefill(model, ids, static).argmax(-1)
        for i in range(3):
            la = decode_step(model, a, plain)
            with torch._dynamo.config.patch(error_on_recompile=not first), torch.inference_mode(i % 2 == 1):
                lb = step(model, b, static)  # inside inference mode or not (a traced step: inside)
            first = False  # the first call compiles, no other
            assert (la - lb).abs().max().item() < 1e-4
            a, b = la.argmax(-1), lb.argmax(-1)


@pytest.mark.parametrize("long_rows", [True, False])
def test_packed_weights_keep_names_shapes_values_and_bytes(tmp_path, long_rows):
    family, kwargs = CONFIGS["gpt2"]  # biases and an untied-style MLP: the other branch of pack_weights
    folder = save_hf(build_hf(family, kwargs), tmp_path)
    plain = load_model(folder, device="cpu")
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    weights_bytes, tied = plain.weights_bytes(), plain.lm_head.weight is plain.embed.weight
    ids = _prompt(plain, batch=1)
    with torch.no_grad():
        expected = plain(ids)
        plain.pack_weights(long_rows=long_rows)
        got = plain(ids)
    after = plain.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (got - expected).abs().max().item() < 1e-5
    assert plain.weights_bytes() == weights_bytes  # views of the packed matrices: nothing doubled
    assert (plain.lm_head.weight is plain.embed.weight) == tied


def test_a_trace_of_steps_times_the_compiled_step_and_one_of_layers_the_eager_one(model):
    """The trace measures the step a model on a compiled path runs (it used to time the eager
    layers instead); a layers-level trace needs them, and gets them. Logits equal decode_step's."""
    from minillm import Trace

    calls = []
    step = compile_decode_step("default")
    model.compiled_decode = lambda *args: calls.append(1) or step(*args)
    try:
        ids = _prompt(model, batch=1, n=6)
        for level, compiled_calls in (("steps", 3), ("layers", 0)):
            calls.clear()
            traced, plain = (KVCache.for_model(model, max_seq_len=12) for _ in range(2))
            trace = Trace(level)
            a = prefill(model, ids, traced, trace=trace).argmax(-1)
            b = prefill(model, ids, plain).argmax(-1)
            for _ in range(3):
                la = decode_step(model, a, traced, trace=trace)
                with torch.inference_mode():
                    lb = model(b.view(1, 1), cache=plain)[:, -1]  # the eager layers
                assert (la - lb).abs().max().item() < 1e-4
                a, b = la.argmax(-1), lb.argmax(-1)
            decodes = [e for e in trace.events if e["kind"] == "decode"]
            assert (len(calls), len(decodes), traced.length) == (compiled_calls, 3, 9)
            assert all(e["time_ms"] > 0 for e in decodes)
    finally:
        model.compiled_decode = None
