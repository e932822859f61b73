"""The compiled decode step (minillm/fast/compile.py) against the pure model's eager decode_step.

The compiled step runs the fast model (its stacked, swapped-in modules); the oracle is the same
checkpoint loaded with ``fast=False``. A torch.compile a test on a tiny CPU model (tens of seconds);
the CUDA-graph variant is in test_cuda.py.
"""

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast.choose import apply_decode_path
from minillm.fast.compile import StaticKVView, compile_decode_step

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("compile"))


@pytest.fixture(scope="module")
def model(folder):
    """The fast model on an eager split path: torch.compile of its SplitLinear products must run
    F.linear (was: a graph break on torch.get_num_threads, so ``fullgraph`` refused the step)."""
    return apply_decode_path(load_model(folder, device="cpu", fast=False), "long-rows+split")


@pytest.fixture(scope="module")
def pure(folder):
    """The same weights on the lesson's plain modules: the oracle."""
    return load_model(folder, device="cpu", fast=False)


class CountingStep:
    """A compiled step that records its calls (decode_step asks it first whether it ``applies``)."""

    def __init__(self, step):
        self.step, self.calls = step, []

    def applies(self, model, cache) -> bool:
        return self.step.applies(model, cache)

    def __call__(self, *args):
        self.calls.append(1)
        return self.step(*args)


def _prompt(model, batch=2, n=12):
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(7))


def test_static_view_writes_at_pos_and_masks_the_rest(model):
    cache = KVCache.for_model(model, max_seq_len=10)
    cache.length = 4
    view = StaticKVView(cache, torch.tensor([4]))
    k = torch.ones(1, model.config.n_kv_heads, 1, model.config.head_dim)
    q = torch.randn(1, model.config.n_heads, 1, model.config.head_dim)
    seen = []
    out = view.attend(1, q, k, 2 * k, lambda *args: seen.append(args) or args[0])
    ((q_seen, keys, values, mask),) = seen
    assert out is q_seen is q and keys.shape[2] == values.shape[2] == 10  # the whole buffer, every step
    assert torch.equal(keys, cache.k[1]) and torch.equal(values, cache.v[1])
    assert torch.equal(cache.k[1, :, :, 4], k[:, :, 0]) and torch.equal(cache.v[1, :, :, 4], 2 * k[:, :, 0])
    assert cache.k[0].abs().sum() == cache.k[1, :, :, :4].abs().sum() == 0  # only layer 1's position 4
    assert mask.tolist() == view.attn_mask.tolist() == [[True] * 5 + [False] * 5]


def test_compiled_decode_matches_decode_step(model, pure):
    ids = _prompt(model)
    plain, static = (KVCache.for_model(model, batch_size=2, max_seq_len=24) for _ in range(2))
    a = prefill(pure, ids, plain).argmax(-1)
    b = prefill(model, ids, static).argmax(-1)
    step = compile_decode_step("default")
    for _ in range(6):  # several lengths, one graph
        la, lb = decode_step(pure, a, plain), step(model, b, static)
        assert (la - lb).abs().max().item() < 1e-4
        a, b = la.argmax(-1), lb.argmax(-1)
    assert static.length == plain.length == 18
    assert torch.allclose(static.k[:, :, :, :18], plain.k[:, :, :, :18], atol=1e-5)


def test_one_graph_serves_every_cache_size(model, pure):
    """A new request's cache of another size reuses the graph (each size recompiled, 75-115 s on a
    2-core CPU, before its max_seq_len was marked dynamic), and so does a call from inside
    inference mode (a traced step; its inputs failed the guards); logits equal decode_step's."""
    step = compile_decode_step("default")
    ids = _prompt(model, batch=1, n=5)
    first = True
    for size in (9, 16, 31):
        plain, static = (KVCache.for_model(model, max_seq_len=size) for _ in range(2))
        a, b = prefill(pure, ids, plain).argmax(-1), prefill(model, ids, static).argmax(-1)
        for i in range(3):
            la = decode_step(pure, a, plain)
            with torch._dynamo.config.patch(error_on_recompile=not first), torch.inference_mode(i % 2 == 1):
                lb = step(model, b, static)  # inside inference mode or not (a traced step: inside)
            first = False  # the first call compiles, no other
            assert (la - lb).abs().max().item() < 1e-4
            a, b = la.argmax(-1), lb.argmax(-1)


def test_a_trace_of_steps_times_the_compiled_step_and_one_of_layers_the_eager_one(model, pure):
    """The trace measures the step a model on a compiled path runs (it used to time the eager
    layers instead); a layers-level trace needs them, and gets them. Logits equal decode_step's."""
    from minillm import Trace

    step, before = CountingStep(compile_decode_step("default")), model.compiled_decode
    model.compiled_decode, calls = step, step.calls
    try:
        ids = _prompt(model, batch=1, n=6)
        for level, compiled_calls in (("steps", 3), ("layers", 0)):
            calls.clear()
            traced, plain = (KVCache.for_model(model, max_seq_len=12) for _ in range(2))
            trace = Trace(level)
            a = prefill(model, ids, traced, trace=trace).argmax(-1)
            b = prefill(pure, ids, plain).argmax(-1)
            for _ in range(3):
                la = decode_step(model, a, traced, trace=trace)
                with torch.inference_mode():
                    lb = pure(b.view(1, 1), cache=plain)[:, -1]  # the pure model's eager layers
                assert (la - lb).abs().max().item() < 1e-4
                a, b = la.argmax(-1), lb.argmax(-1)
            decodes = [e for e in trace.events if e["kind"] == "decode"]
            assert (len(calls), len(decodes), traced.length) == (compiled_calls, 3, 9)
            assert all(e["time_ms"] > 0 for e in decodes)
    finally:
        model.compiled_decode = before


def test_a_bfloat16_compiled_step_multiplies_on_the_tiles_within_bfloat16s_error(folder):
    """bfloat16 on the compile+matvec path (calibrate's other bfloat16 candidate). Where the CPU has AMX-BF16 the
    graph calls the tiles' product as an op, each product of a step (2 layers x 4 + the LM head = 9); inductor
    fuses the norms, RoPE and SwiGLU and keeps float32 between them where eager code rounds to bfloat16, so the
    logits are not eager's to the bit. Oracle: the float32 lesson model. Yardstick: E, the eager bfloat16 lesson
    model's error from it, measured here; the compiled step's error is within 2E (the bound the speed layer's
    bfloat16 logits have against transformers', tests/test_dtypes_vs_hf.py)."""
    from torch.profiler import profile

    from minillm.fast import kernels

    reference = load_model(folder, device="cpu", fast=False)
    eager16 = load_model(folder, device="cpu", dtype="bfloat16", fast=False)
    compiled16 = apply_decode_path(load_model(folder, device="cpu", dtype="bfloat16", fast=False), "compile+matvec")
    ids = _prompt(reference, batch=1)
    caches = [KVCache.for_model(m, max_seq_len=24) for m in (reference, eager16, compiled16)]
    for m, c in zip((reference, eager16, compiled16), caches):
        prefill(m, ids, c)
    token, errors = ids[:, -1], {"eager": 0.0, "compiled": 0.0}

    def steps(n):
        nonlocal token
        for _ in range(n):
            expected = decode_step(reference, token, caches[0])
            for name, m, c in (("eager", eager16, caches[1]), ("compiled", compiled16, caches[2])):
                errors[name] = max(errors[name], (decode_step(m, token, c) - expected).abs().max().item())
            token = expected.argmax(-1)

    steps(2)  # (the first compiles)
    with profile() as prof:
        steps(5)
    calls = sum(e.count for e in prof.key_averages() if e.key == "minillm::bf16_amx_matmul")
    assert calls == (5 * 9 if kernels.available() and kernels.bf16_amx_ready() else 0)
    assert 0 < errors["eager"] and errors["compiled"] <= 2 * errors["eager"], errors


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantised_compiled_step_runs_the_tiles_op_with_the_eager_steps_logits(folder, fmt):
    """int8 and int4 on the compile+matvec path: where the CPU has AMX-INT8 the graph calls the tiles' product as an
    op, each product of a step (9), the same C as the eager step's; so the logits are the eager quantised step's
    up to float32 rounding (the rest of the step in float32 either way)."""
    from torch.profiler import profile

    from minillm.fast import kernels

    eager = load_model(folder, device="cpu", quantize=fmt)
    compiled = apply_decode_path(load_model(folder, device="cpu", quantize=fmt), "compile+matvec")
    ids = _prompt(eager, batch=1)
    caches = [KVCache.for_model(m, max_seq_len=24) for m in (eager, compiled)]
    token = prefill(eager, ids, caches[0]).argmax(-1)
    prefill(compiled, ids, caches[1])
    for i in range(6):
        with profile() as prof:
            expected, got = decode_step(eager, token, caches[0]), decode_step(compiled, token, caches[1])
        assert (got - expected).abs().max().item() < 1e-4
        if i > 0:  # (the first compiles)
            calls = sum(e.count for e in prof.key_averages() if e.key == "minillm::quantized_amx_matmul")
            assert calls == (9 if kernels.available() and kernels.quantized_amx_ready() else 0)
        token = expected.argmax(-1)


def test_a_process_decodes_more_models_than_dynamos_default_limit_of_graphs(folder, tmp_path):
    """One compiled function serves every model a process runs, a graph for each shape and precision: with
    dynamo's limit at 1 (its default is 8, which the test suite's process passed), a second model's graph was
    refused (FailOnRecompileLimitHit under fullgraph=True). The compiled step raises the limit."""
    family, kwargs = CONFIGS["llama_gqa"]
    wider = save_hf(build_hf(family, {**kwargs, "vocab_size": 256}), tmp_path / "wider")
    with torch._dynamo.config.patch(recompile_limit=1):
        step = compile_decode_step("default")
        for source in (folder, wider):
            model = apply_decode_path(load_model(source, device="cpu", fast=False), "long-rows+split")
            pure = load_model(source, device="cpu", fast=False)
            ids = _prompt(model, batch=1, n=5)
            static, plain = (KVCache.for_model(m, max_seq_len=8) for m in (model, pure))
            b, a = prefill(model, ids, static).argmax(-1), prefill(pure, ids, plain).argmax(-1)
            assert (step(model, b, static) - decode_step(pure, a, plain)).abs().max().item() < 1e-4
