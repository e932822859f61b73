"""The engine on a CUDA GPU: logits against transformers in float32 and bfloat16, the
CUDA-graph decode step, and a quick bench. Skipped without a GPU (benchmarks/gpu_check.sh runs it)."""

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module", params=["llama_gqa", "gpt2"])
def pair(request, tmp_path_factory):
    family, kwargs = CONFIGS[request.param]
    hf = build_hf(family, kwargs)
    return hf, save_hf(hf, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_transformers_on_cuda(pair, dtype):
    hf, folder = pair
    hf = hf.to("cuda", dtype)
    model = load_model(folder, device="cuda", dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device="cuda")
    with torch.no_grad():
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= TOL[dtype]


@pytest.mark.compile
def test_cuda_graph_decode_matches_decode_step(pair):
    from minillm.fast.compile import compile_decode_step

    _, folder = pair
    model = load_model(folder, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    plain, static = (KVCache.for_model(model, max_seq_len=40) for _ in range(2))
    a = prefill(model, ids, plain).argmax(-1)
    b = prefill(model, ids, static).argmax(-1)
    step = compile_decode_step("reduce-overhead")
    same = 0
    for _ in range(12):
        la, lb = decode_step(model, a, plain), step(model, b, static)
        same += int(torch.equal(la.argmax(-1), lb.argmax(-1)))
        a = b = la.argmax(-1)  # follow one sequence, so both caches hold the same tokens
    assert same >= 11  # bfloat16: a near-tie may flip one argmax


def test_quick_bench_on_cuda(pair):
    from minillm.bench import run_bench
    from minillm.hardware import HardwareProfile

    _, folder = pair
    model = load_model(folder, device="cuda", dtype=torch.bfloat16)
    result = run_bench(model, prompt_lengths=(16,), context_lengths=(16,), batch_sizes=(1, 2), repeats=1,
                       decode_tokens=4, hardware=HardwareProfile("gpu", 1e14, 1e12), memory_tokens=8,
                       compile_mode="reduce-overhead")
    assert "minillm-compile" in result.engines()
    assert result.memory.device_peak_bytes > 0
