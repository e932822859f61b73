"""GGUF -> HF folder conversion, checked against transformers loading the same GGUF file."""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from minillm.formats import gguf_convert
from minillm.errors import ConfigError, ModelNotFoundError, OutputPathError
from minillm.formats.gguf_convert import convert_gguf, unpermute_qk
from minillm.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted_dir(smollm2_gguf, tmp_path_factory):
    """A fresh conversion (the shared smollm2_dir may have been converted by an older version)."""
    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2"), progress=False)


@pytest.mark.large
def test_every_tensor_equals_transformers(converted_dir, hf_smollm2):
    ours = load_file(converted_dir / "model.safetensors")
    theirs = hf_smollm2.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), f"{name} first differs from transformers"


@pytest.mark.large
def test_config_matches_transformers(converted_dir, hf_smollm2):
    ours = transformers.AutoConfig.from_pretrained(converted_dir)
    theirs = hf_smollm2.config
    fields = [
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "hidden_act",
    ]  # fmt: skip
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.rope_parameters == theirs.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (ours.num_hidden_layers, ours.num_key_value_heads, ours.tie_word_embeddings) == (30, 3, True)


@pytest.mark.large
def test_folder_loads_in_transformers_with_same_logits(converted_dir, hf_smollm2):
    """End to end: config.json + model.safetensors are a complete HF Llama checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf_smollm2(ids).logits)


@pytest.mark.large
def test_folder_is_complete(converted_dir):
    names = sorted(p.name for p in converted_dir.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim (numpy -> torch)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_qk_hand_case():
    stored = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]).reshape(16, 1)
    assert unpermute_qk(stored, n_heads=2).flatten().tolist() == list(range(16))


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_qk_inverts_llama_cpp(n_heads):
    w = torch.randn(n_heads * 64, 576)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(w, n_heads), n_heads), w)


def _default_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab"])
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)


def _tiny_llama_gguf(path, hf: dict[str, torch.Tensor], write_tokenizer=_default_tokenizer):
    """A 1-layer Llama GGUF written the way llama.cpp's converter writes ``hf``:
    Q/K rows permuted, F16 matrices, F32 norms, an untied output.weight, BOS added;
    ``write_tokenizer(writer)`` writes the tokenizer.ggml.* keys."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    write_tokenizer(writer)
    for name, tensor in _gguf_tensors(hf).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "model.layers.0."
    names = {
        "token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
        "blk.0.attn_norm": prefix + "input_layernorm", "blk.0.ffn_norm": prefix + "post_attention_layernorm",
        "blk.0.attn_q": prefix + "self_attn.q_proj", "blk.0.attn_k": prefix + "self_attn.k_proj",
        "blk.0.attn_v": prefix + "self_attn.v_proj", "blk.0.attn_output": prefix + "self_attn.o_proj",
        "blk.0.ffn_gate": prefix + "mlp.gate_proj", "blk.0.ffn_up": prefix + "mlp.up_proj",
        "blk.0.ffn_down": prefix + "mlp.down_proj",
    }  # fmt: skip
    out = {}
    for gguf_name, hf_name in names.items():
        w = hf[hf_name + ".weight"]
        if gguf_name.endswith(("attn_q", "attn_k")):
            w = _llama_cpp_permute(w, 2 if gguf_name.endswith("q") else 1)
        out[gguf_name + ".weight"] = w.half() if w.ndim == 2 else w
    return out


def _tiny_hf_weights(n_vocab: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens": (n_vocab, 8), "lm_head": (n_vocab, 8), "model.norm": (8,),
        "model.layers.0.input_layernorm": (8,), "model.layers.0.post_attention_layernorm": (8,),
        "model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.self_attn.k_proj": (4, 8),
        "model.layers.0.self_attn.v_proj": (4, 8), "model.layers.0.self_attn.o_proj": (8, 8),
        "model.layers.0.mlp.gate_proj": (16, 8), "model.layers.0.mlp.up_proj": (16, 8),
        "model.layers.0.mlp.down_proj": (8, 16),
    }  # fmt: skip
    # rounded through float16 so the F16 copies in the GGUF are exact
    return {f"{name}.weight": torch.randn(shape, generator=g).half().float() for name, shape in shapes.items()}


def test_tiny_llama_round_trips(tmp_path):
    """Hand-made oracle: F16 + F32 tensors, untied lm_head, GQA un-permutation, BOS, linear RoPE scaling."""
    hf = _tiny_hf_weights()
    out = convert_gguf(_tiny_llama_gguf(tmp_path / "tiny.gguf", hf), tmp_path / "out", progress=False)
    ours = load_file(out / "model.safetensors")
    assert ours.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(ours[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 4)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("abb<s>").ids == [0, 4, 3, 0]  # BOS added, "a b" merged, <s> matched whole


def _tiny_gguf(path, arch: str, pre: str = "smollm"):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "pre", "named"),
    [("bert", "smollm", "'bert'"), ("llama", "mystery-pre", "'mystery-pre'"), ("llama", "gpt2", "'gpt2'")],
)
def test_unsupported_gguf_raises_config_error(tmp_path, arch, pre, named):
    path = _tiny_gguf(tmp_path / "tiny.gguf", arch, pre)
    with pytest.raises(ConfigError) as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    message = str(info.value)
    assert named in message and "supported" in message and "\n" not in message
    if arch == "llama":  # the names minillm knows are listed
        assert "llama-bpe" in message and "smollm" in message and "gpt-2" in message
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_file_raises_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out", progress=False)


def test_unreadable_file_raises_model_not_found(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="cannot read") as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value)


def test_converted_files_get_the_umask_mode(tmp_path):
    """Like any file the user creates: 0o666 less the umask (safetensors alone leaves 0o600)."""
    old = os.umask(0o002)
    try:
        out = convert_gguf(_tiny_llama_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights()), tmp_path / "out",
                           progress=False)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes == dict.fromkeys(
        ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"], oct(0o666 & ~0o002)
    )


@pytest.mark.parametrize("out", ["taken", "taken/out"])
def test_output_path_through_a_file_fails_before_dequantizing(tmp_path, monkeypatch, out):
    """A file where the folder would go: one-line error, before the long work, and the file is kept."""
    gguf_file = _tiny_llama_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights())
    (tmp_path / "taken").write_text("keep me")

    def dequantize_all(*args):
        raise AssertionError("dequantized before checking the output folder")

    monkeypatch.setattr(gguf_convert, "_hf_tensors", dequantize_all)
    with pytest.raises(OutputPathError, match="is not a folder") as info:
        convert_gguf(gguf_file, tmp_path / out, progress=False)
    assert "\n" not in str(info.value) and str(tmp_path / "taken") in str(info.value)
    assert (tmp_path / "taken").read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_folder_without_write_permission_fails_before_dequantizing(tmp_path, monkeypatch):
    gguf_file = _tiny_llama_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights())
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setattr(gguf_convert, "_hf_tensors", lambda *args: pytest.fail("dequantized first"))
    with pytest.raises(OutputPathError, match="permission denied"):
        convert_gguf(gguf_file, locked / "out", progress=False)


# ---------------------------------------------------------------- tokenizer, by llama.cpp's rules

WORDS = ["<|begin_of_text|>", "<|end_of_text|>", "Ġ", "h", "e", "l", "o", "Ġh", "el", "Ġhello",
         "1", "2", "3", "4", "5", "12", "123", "45", "12345", ",", "x"]  # fmt: skip
WORD_MERGES = ["Ġ h", "e l", "1 2", "12 3", "4 5", "123 45"]  # nothing builds "Ġhello"


def _words_tokenizer(pre: str, **keys):
    """A writer of tokenizer.ggml.* keys for WORDS, with ``pre`` and optional add_bos/add_eos keys."""

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(WORDS)
        writer.add_token_types([3, 3] + [1] * (len(WORDS) - 2))
        writer.add_token_merges(WORD_MERGES)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        if "add_bos" in keys:
            writer.add_add_bos_token(keys["add_bos"])
        if "add_eos" in keys:
            writer.add_add_eos_token(keys["add_eos"])

    return write


def _converted_tokenizer(tmp_path, write_tokenizer, n_vocab: int = len(WORDS)) -> tuple[Tokenizer, dict]:
    path = _tiny_llama_gguf(tmp_path / "tok.gguf", _tiny_hf_weights(n_vocab), write_tokenizer)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    return Tokenizer.from_file(str(out / "tokenizer.json")), json.loads((out / "tokenizer_config.json").read_text())


def _ids(*tokens: str) -> list[int]:
    return [WORDS.index(t) for t in tokens]


# Expected ids worked out by hand with llama.cpp's rules (src/llama-vocab.cpp): for llama-bpe a
# piece that is a whole vocabulary entry is one token (ignore_merges) and BOS is added by
# default; "\p{N}{1,3}" (llama-bpe), "\p{N}+" then "[0-9]{3}" (default), "\p{N}" (smollm)
# split "12345" before BPE; gpt-2 keeps it whole and BPE merges it to one token.
LLAMA_CPP_CASES = {
    "llama-bpe whole word, BOS": ("llama-bpe", {}, " hello", _ids("<|begin_of_text|>", "Ġhello")),
    "llama-bpe digits by 3": ("llama-bpe", {}, "12345", _ids("<|begin_of_text|>", "123", "45")),
    "llama-bpe add_bos_token=false": ("llama-bpe", {"add_bos": False}, " hello", _ids("Ġhello")),
    "llama-bpe add_eos_token=true": ("llama-bpe", {"add_eos": True}, "x", _ids("<|begin_of_text|>", "x", "<|end_of_text|>")),
    "gpt-2 merges only": ("gpt-2", {}, " hello", _ids("Ġh", "el", "l", "o")),
    "gpt-2 digits whole": ("gpt-2", {}, "12345", _ids("12345")),
    "gpt-2 add_bos_token=true": ("gpt-2", {"add_bos": True}, "x,", _ids("<|begin_of_text|>", "x", ",")),
    "default digits by 3": ("default", {}, "12345", _ids("123", "45")),
    "smollm single digits": ("smollm", {}, "12345", _ids("1", "2", "3", "4", "5")),
}  # fmt: skip


@pytest.mark.parametrize("case", LLAMA_CPP_CASES)
def test_tokenizer_follows_llama_cpp_rules(tmp_path, case):
    pre, keys, text, expected = LLAMA_CPP_CASES[case]
    tok, config = _converted_tokenizer(tmp_path, _words_tokenizer(pre, **keys))
    assert tok.encode(text).ids == expected
    assert config["add_bos_token"] is (expected[0] == 0)
    assert tok.decode(expected, skip_special_tokens=True) == text


def test_missing_special_tokens_are_left_out_of_tokenizer_config(tmp_path):
    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(["a", "b", "ab", "c", "d"])
        writer.add_token_merges(["a b"])

    tok, config = _converted_tokenizer(tmp_path, write, n_vocab=5)
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                      "add_eos_token": False, "model_max_length": 32}  # fmt: skip
    assert tok.encode("abc").ids == [2, 3]


@pytest.mark.parametrize(
    ("keys", "says"),
    [({"bos_token_id": 99}, "bos_token_id is 99, outside the 21-token vocabulary"),
     ({"no_bos": True}, "adds a BOS token but has no tokenizer.ggml.bos_token_id")],
)  # fmt: skip
def test_bad_special_token_ids_raise_config_error(tmp_path, keys, says):
    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")  # adds BOS by default
        writer.add_token_list(WORDS)
        writer.add_token_merges(WORD_MERGES)
        if not keys.get("no_bos"):
            writer.add_bos_token_id(keys.get("bos_token_id", 0))

    path = _tiny_llama_gguf(tmp_path / "tok.gguf", _tiny_hf_weights(len(WORDS)), write)
    with pytest.raises(ConfigError, match=says) as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


SMOLLM2_TEXTS = ["Hello, world!", "Pi is 3.14159; 1,000,000 items", "def add(a, b):\n    return a + b\n",
                 "😀 🎉👍🏽 日本語のテキスト", "a  b   c    d\n\n\tx", "It's, I'm, we'll", "<|im_start|>user\nhi<|im_end|>"]  # fmt: skip


@pytest.mark.large
def test_smollm2_tokenizer_matches_transformers(converted_dir, hf_smollm2_tokenizer):
    """The real "smollm" pre-tokenizer, freshly converted, against transformers' reading of the GGUF."""
    ours = Tokenizer.from_file(str(converted_dir / "tokenizer.json"))
    theirs = hf_smollm2_tokenizer
    for text in SMOLLM2_TEXTS:
        assert ours.encode(text).ids == theirs(text).input_ids, text


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]], ids=["default", "tool_use"])
def test_named_chat_templates_survive_conversion(tmp_path, tools):
    """llama.cpp's converter writes a model's extra templates as tokenizer.chat_template.<name>."""

    def write(writer: gguf.GGUFWriter) -> None:
        _words_tokenizer("gpt-2")(writer)
        writer.add_chat_template([{"name": "default", "template": "plain {{ messages[0].content }}"},
                                  {"name": "tool_use", "template": "tools {{ tools[0].function.name }}"}])  # fmt: skip

    path = _tiny_llama_gguf(tmp_path / "tok.gguf", _tiny_hf_weights(len(WORDS)), write)
    tok = load_tokenizer(convert_gguf(path, tmp_path / "out", progress=False))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools) == (
        "plain hi" if tools is None else "tools f"
    )


# -- Qwen2 and Qwen3 GGUF files ---------------------------------------------------------

# HF -> llama.cpp tensor names (llama.cpp gguf-py tensor_mapping.py), per layer and global.
_LLAMA_CPP_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_LLAMA_CPP_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _llama_cpp_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in _LLAMA_CPP_GLOBAL:
        return f"{_LLAMA_CPP_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LLAMA_CPP_LAYER[rest]}.{kind}"


QWEN_WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "1", "2", "12"]


def _qwen_gguf(path, hf_model, words=QWEN_WORDS, merges=("a b", "1 2")) -> None:
    """``hf_model`` written as llama.cpp's converter writes a Qwen2/Qwen3 model: the {arch}.* keys,
    Q/K rows as they are (NEOX RoPE, no permutation), F16 matrices, F32 norms and biases, output.weight
    only when untied, and a byte-level BPE vocabulary (``words`` padded to the model's vocabulary,
    the first three special) with the qwen2 pre-tokenizer."""
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), c.model_type)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(words + [f"<unused{i}>" for i in range(len(words), c.vocab_size)])
    writer.add_token_types([3, 3, 3] + [1] * (c.vocab_size - 3))
    writer.add_token_merges(list(merges))
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        writer.add_tensor(_llama_cpp_name(name), tensor.half().numpy() if tensor.ndim == 2 else tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rounded_to_f16(hf_model):
    """The matrices rounded through float16, so the GGUF's F16 copies hold exactly these weights."""
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return hf_model


@pytest.mark.large
@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "qwen3"])
def test_qwen_gguf_converts_with_transformers_logits(name, tmp_path):
    """A tiny Qwen2 (q, k, v biases) or Qwen3 (QK-norm; head_dim 128, the only one transformers'
    GGUF reader knows: it ignores qwen3.attention.key_length) GGUF: minillm's conversion gives the
    logits transformers computes from the same file, and those of the model it was written from."""
    from tiny_models import CONFIGS, build_hf

    from minillm import load_model

    family, kwargs = CONFIGS[name]
    hf = _rounded_to_f16(build_hf(family, dict(kwargs, head_dim=128) if family == "qwen3" else kwargs))
    _qwen_gguf(tmp_path / "tiny.gguf", hf)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    model = load_model(out, device="cpu", dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.randint(0, kwargs["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = model(ids), theirs.eval()(ids).logits
        assert (got - expected).abs().max().item() <= 1e-4
        assert (got - hf(ids).logits).abs().max().item() <= 1e-4
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"]) == (family, kwargs.get("tie_word_embeddings", False))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("<|im_start|>ab12").ids == [1, 5, 6, 7]  # added token whole, no BOS, digits one by one


@pytest.mark.large
def test_qwen2_pre_tokenizer_splits_like_transformers(tmp_path):
    """The qwen2 pre-tokenizer's regex (digits one by one, letters with one leading non-letter,
    newlines apart) against transformers' own tokenizer from the same GGUF, on a byte-level
    vocabulary whose merges would join what a wrong split leaves together."""
    from tiny_models import LLAMA_BASE, build_hf
    from tokenizers import pre_tokenizers

    merged = {"Ġ t": "Ġt", "h e": "he", "Ġt he": "Ġthe", "1 2": "12", "' s": "'s", "Ċ Ċ": "ĊĊ", "! !": "!!"}
    words = QWEN_WORDS[:3] + sorted(pre_tokenizers.ByteLevel.alphabet()) + list(merged.values())
    hf = build_hf("qwen2", dict(LLAMA_BASE, vocab_size=len(words)))
    _qwen_gguf(tmp_path / "tok.gguf", hf, words, merged)
    ours = load_tokenizer(convert_gguf(tmp_path / "tok.gguf", tmp_path / "out", progress=False))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in ["the 12345 cat's\n\n  dogs!!\tthe\r\nthe", "<|im_start|>he'S 2024, THE the!!!"]:
        assert ours.encode(text) == theirs.encode(text), text
