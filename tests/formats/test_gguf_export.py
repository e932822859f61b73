"""Writing a model as an F32 GGUF (minillm/formats/gguf_export.py), read back with the gguf package and with
minillm's own GGUF converter (itself checked against transformers' GGUF loader in test_gguf_convert.py)."""

import gguf
import pytest
import torch
from tiny_models import CONFIGS, LLAMA_BASE, build_hf, save_hf

from minillm import KVCache, load_model, prefill
from minillm.formats.gguf_convert import convert_gguf, unpermute_qk
from minillm.formats.gguf_export import permute_qk, write_f32_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary size, so SmolLM2's GGUF tokenizer fits it."""
    hf = build_hf("llama", dict(LLAMA_BASE, vocab_size=49152, rope_theta=100000.0))
    return load_model(save_hf(hf, tmp_path_factory.mktemp("export")), device="cpu")


@pytest.fixture(scope="module")
def written(model, smollm2_gguf, tmp_path_factory):
    return write_f32_gguf(model, smollm2_gguf, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


@pytest.mark.large
def test_every_tensor_is_f32_under_llama_cpps_names(model, written, smollm2_gguf):
    reader = gguf.GGUFReader(written)
    tensors = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert len(tensors) == 2 * 9 + 3  # 9 per layer, embedding, final norm, untied output
    assert tensors["blk.1.ffn_gate.weight"].shape.tolist() == [64, 128]  # GGUF lists shapes innermost first
    down = model.blocks[0].mlp.down_proj.weight
    assert torch.equal(torch.from_numpy(tensors["blk.0.ffn_down.weight"].data.copy()), down)
    assert reader.fields["general.file_type"].contents() == 0  # ALL_F32
    assert reader.fields["llama.rope.freq_base"].contents() == 100000.0
    source = gguf.GGUFReader(smollm2_gguf)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == source.fields["tokenizer.ggml.tokens"].contents()


@pytest.mark.large
def test_converting_it_back_gives_the_same_logits(model, written, tmp_path):
    back = load_model(convert_gguf(written, tmp_path / "back", progress=False), device="cpu")
    ids = torch.randint(0, 49152, (1, 7), generator=torch.Generator().manual_seed(1))
    logits = [prefill(m, ids, KVCache.for_model(m, max_seq_len=8)) for m in (model, back)]
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5


def test_permute_is_llama_cpps_interleaving_and_unpermute_undoes_it():
    w = torch.arange(16.0).reshape(16, 1)  # 2 heads of head_dim 8, one input column
    assert permute_qk(w, 2).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(unpermute_qk(permute_qk(w, 2), 2), w)


@pytest.mark.large
def test_refuses_what_it_cannot_write(model, smollm2_gguf, tmp_path):
    family, kwargs = CONFIGS["llama_gqa"]  # vocabulary 128: not SmolLM2's tokenizer
    small = load_model(save_hf(build_hf(family, kwargs), tmp_path / "small"), device="cpu")
    with pytest.raises(ValueError, match="tokenizer of 49152 tokens but the model's vocabulary is 128"):
        write_f32_gguf(small, smollm2_gguf, tmp_path / "x.gguf")
    family, kwargs = CONFIGS["gpt2"]
    gpt2 = load_model(save_hf(build_hf(family, kwargs), tmp_path / "gpt2"), device="cpu")
    with pytest.raises(ValueError, match="only Llama-family models"):
        write_f32_gguf(gpt2, smollm2_gguf, tmp_path / "y.gguf")


@pytest.mark.large
def test_llama_cpp_decodes_it_to_minillms_greedy_tokens(model, written):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
    from minillm.bench import make_engines
    from minillm.bench.llama_cpp import LlamaCppEngine

    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(2))
    theirs = LlamaCppEngine(written, n_ctx=32)
    mine = make_engines(model, ["minillm-sdpa"])[0][0]
    assert theirs.ttft(ids).tokens == mine.ttft(ids).tokens
    assert (theirs.decode(ids, theirs.prepare_decode(ids, 6), 6).tokens
            == mine.decode(ids, mine.prepare_decode(ids, 6), 6).tokens)
