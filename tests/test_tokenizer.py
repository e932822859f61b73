"""Tokenizer built from the SmolLM2 GGUF, checked against transformers' tokenizer for the same file."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.errors import ModelNotFoundError
from minillm.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345678",
    "Pi is 3.14159, e is 2.71828; 1,000,000 items",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "😀 🎉👍🏽 🇫🇷",
    "日本語のテキストです。",
    "中文分词测试，你好！",
    "한국어 문장",
    "a  b   c    d",
    "line1\n\nline2\n\n\n",
    "\tindented\t\ttabs",
    "café naïve résumé Ünïcödé",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>",
    "It's, I'm, we'll, they've, she'd",
    "   leading and trailing spaces   ",
    "https://example.com/path?q=1&r=2#frag",
    "Mixed: العربية Ελληνικά русский",
]

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about caches 🗄️"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_smollm2_tokenizer, text):
    assert tok.encode(text, add_special_tokens=True) == hf_smollm2_tokenizer(text, add_special_tokens=True).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, hf_smollm2_tokenizer, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_match_transformers(tok, hf_smollm2_tokenizer):
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_smollm2_tokenizer.bos_token_id, hf_smollm2_tokenizer.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == {2}
    assert tok.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS


def test_eos_token_ids_include_config_list(tok):
    other = Tokenizer(tok.backend, {"eos_token": "<|im_end|>"}, {"eos_token_id": [0, 2]})
    assert other.eos_token_ids == {0, 2}


def test_bytes_missing_from_vocab_are_dropped_like_transformers(tok, hf_smollm2_tokenizer):
    """SmolLM2's vocabulary has no token for bytes such as 0x04 or 0xF1 (lead byte of
    U+40000..U+7FFFF), and byte-level BPE has no unknown token: those bytes vanish."""
    text = "a\x04b\U00040000c"
    ids = tok.encode(text)
    assert ids == hf_smollm2_tokenizer(text).input_ids
    assert tok.decode(ids) == "ab\ufffd\ufffd\ufffdc"


def test_token_strings_show_split_characters_as_bytes(tok):
    ids = tok.encode("hi 😀")
    pieces = tok.token_strings(ids)
    assert pieces[0] == "hi"
    assert "".join(pieces[1:]) == " \\xf0\\x9f\\x98\\x80"  # the emoji spans two tokens
    assert tok.token_strings([1]) == ["<|im_start|>"]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tok, hf_smollm2_tokenizer, messages):
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_chat_template_without_generation_prompt(tok, hf_smollm2_tokenizer):
    expected = hf_smollm2_tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == expected


@pytest.mark.parametrize(
    "messages", [[], [{"role": "user"}], ["hello"], [{"role": "user", "content": 3}], "hello"], ids=repr
)
def test_malformed_messages_raise_value_error(tok, messages):
    with pytest.raises(ValueError) as info:
        tok.apply_chat_template(messages)
    assert "\n" not in str(info.value)


def test_no_chat_template_raises_value_error(tok):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend, {}).apply_chat_template(CHATS[1])


def test_template_raise_exception_becomes_value_error(tok):
    strict = Tokenizer(tok.backend, {"chat_template": "{{ raise_exception('roles must alternate') }}"})
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template(CHATS[1])


def test_load_tokenizer_missing_raises(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        load_tokenizer(tmp_path / "absent")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    for name in ("folder", "./folder"):  # "folder" went to the hub: "cannot reach the Hugging Face hub"
        with pytest.raises(ModelNotFoundError) as info:
            load_tokenizer(name)
        assert str(info.value) == (f"{tmp_path / 'folder'} is not a model: it has no config.json, *.safetensors or "
                                   "tokenizer.json; pass a folder with config.json, *.safetensors and "
                                   "tokenizer.json, or a .gguf file")
    (tmp_path / "folder" / "config.json").write_text("{}")  # a model folder, but without its tokenizer
    for name in ("folder", tmp_path / "folder"):
        with pytest.raises(ModelNotFoundError) as info:
            load_tokenizer(name)
        assert str(info.value) == (f"{tmp_path / 'folder'} has no tokenizer.json; add the model's tokenizer.json "
                                   "to that folder")


def _stream(tok, ids, skip_special_tokens=True):
    decoder = StreamDecoder(tok, skip_special_tokens)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("text", ["😀 🎉👍🏽 🇫🇷 done", "日本語のテキストです。", "café 中文 한국어 😀x"])
def test_stream_decoder_equals_one_shot_decode(tok, text):
    ids = tok.encode(text)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert rest == ""
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # at least one character really did span several tokens


@pytest.mark.parametrize("skip", [True, False])
def test_stream_decoder_special_tokens(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nhi 😀<|im_end|>")
    pieces, rest = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_stream_decoder_flush_returns_incomplete_character(tok):
    first_piece_of_emoji = tok.encode(" 😀")[0]
    pieces, rest = _stream(tok, [first_piece_of_emoji])
    assert pieces == [""] and rest == tok.decode([first_piece_of_emoji]) == " \ufffd"


_MULTIBYTE = st.sampled_from(list("éñü中文日本語한국😀🎉👍🏽🇫🇷🗄️\u200d") + [" ", "\n", "  "])
# SmolLM2's vocabulary lacks 21 of the 256 byte tokens (see the test above): leave out
# the characters that need them (control chars, U+40000 and up) so round trips are exact.
_ANY_CHAR = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffd", max_codepoint=0x3FFFF)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.one_of(_MULTIBYTE, _ANY_CHAR), max_size=30).map("".join))
def test_stream_decoder_property(tok, text):
    ids = tok.encode(text)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def _byte_fallback_tokenizer() -> Tokenizer:
    """A tiny Llama-2 / Mistral / TinyLlama-style tokenizer: SentencePiece BPE whose pieces
    start with '▁' (a space), the 256 ``<0xNN>`` byte tokens for characters outside the
    vocabulary, and the decoder of those models' tokenizer.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "w"), ("▁w", "o"), ("▁", "h"), ("▁h", "i"), ("é", "t"), ("▁", "é")]
    for token in ["▁", "w", "o", "h", "i", "é", "t", "▁w", "▁wo", "▁h", "▁hi", "ét", "▁é"]:
        vocab[token] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def byte_fallback_tok():
    return _byte_fallback_tokenizer()


def test_byte_fallback_stream_with_a_stray_byte_equals_one_shot_decode(byte_fallback_tok):
    """Issue #12 kind 6: "日" (3 byte tokens), a stray <0xF0>, then "▁wo" streamed as '日��� wo'.
    The ByteFallback decoder (tokenizers, as transformers decodes) turns a byte run holding an
    invalid byte into one U+FFFD per byte, so the one-shot text is '���� wo'."""
    tok = byte_fallback_tok
    stray_byte, wo = tok.backend.token_to_id("<0xF0>"), tok.backend.token_to_id("▁wo")
    ids = tok.encode("日", add_special_tokens=False)[1:] + [stray_byte, wo]  # [1:]: no "▁" before 日
    assert tok.token_strings(ids) == ["\\xe6", "\\x97", "\\xa5", "\\xf0", " wo"]
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend).decode(ids)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == oracle == "\ufffd" * 4 + " wo"
    assert pieces == ["", "", "", "", "\ufffd" * 4 + " wo"]  # the byte run is held until "▁wo" ends it


def test_byte_fallback_stream_emits_a_completed_character_after_the_run(byte_fallback_tok):
    tok = byte_fallback_tok
    ids = tok.encode("hi 日 wo", add_special_tokens=False)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == "hi 日 wo"
    assert not any("\ufffd" in piece for piece in pieces)


def _random_ids(vocab_size: int):
    return st.lists(st.integers(0, vocab_size - 1), max_size=24)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_for_random_byte_fallback_ids(byte_fallback_tok, data, skip):
    """Any id sequence, valid UTF-8 or not, special tokens anywhere: stream == one-shot decode."""
    ids = data.draw(_random_ids(byte_fallback_tok.vocab_size))
    pieces, rest = _stream(byte_fallback_tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) + rest == byte_fallback_tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_for_random_byte_level_ids(tok, data, skip):
    """Byte-level BPE (SmolLM2): random ids, biased towards the byte tokens that split characters."""
    byte_ids = st.sampled_from(tok.encode("é中😀🇫🇷\u200d") + [1, 2])  # pieces of characters, <|im_start|>, <|im_end|>
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.vocab_size - 1), byte_ids), max_size=24))
    pieces, rest = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text, what", [("caf\udce9", "byte 0xe9 at character 3"),  # b"caf\xe9" read as argv
                                        ("a\ud800b", "lone surrogate U+D800 at character 1")])
def test_encode_refuses_what_utf8_cannot_encode(tok, text, what):
    """Was: "TypeError: TextInputSequence must be str" from the tokenizers library."""
    with pytest.raises(ValueError, match=re.escape(f"the text is not valid UTF-8: {what}; give it as UTF-8")):
        tok.encode(text)


@pytest.mark.parametrize("text", [None, 5, ["a"], b"bytes"])
def test_encode_refuses_what_is_not_text(tok, text):
    with pytest.raises(ValueError, match=f"text must be a str, got {type(text).__name__}; decode ids with tok.decode"):
        tok.encode(text)


BAD_IDS = {"past the end": 10**6, "vocab_size": 49152, "negative": -1, "float": 2.0, "string": "5", "bool": True,
           "past 32 bits": 2**40, "past 64 bits": 10**30}  # the last two: OverflowError in tokenizers


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_bad_ids_raise_value_error(tok, bad):
    """tokenizers turns an unknown id into '' and a negative one into OverflowError: both refused."""
    for call in (lambda: tok.decode([5, bad]), lambda: tok.token_strings([bad])):
        with pytest.raises(ValueError) as info:
            call()
        assert "\n" not in str(info.value) and ("49151" in str(info.value) or "integers" in str(info.value))
    stream = StreamDecoder(tok)
    assert stream.push(tok.encode("hi")[0]) == "hi"
    with pytest.raises(ValueError):
        stream.push(bad)
    assert stream.push(tok.encode(" there")[0]) == " there"  # the bad id left no trace
    assert len(stream.ids) == 2


def test_integer_like_ids_are_accepted(tok):
    import numpy as np
    import torch

    ids = tok.encode("hello world")
    assert tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids)) == "hello world"
    assert StreamDecoder(tok).push(torch.tensor(ids[0])) == "hello"


def test_id_to_token_outside_the_vocabulary(tok):
    assert tok.id_to_token(10**6) is None and tok.id_to_token(-1) is None
    with pytest.raises(ValueError):
        tok.id_to_token(1.5)


# Texts that make pieces of every kind: words, runs of spaces and newlines, digits (one piece
# each), punctuation, contractions, a combining accent, CJK, an added token, a long word.
PIECES = ["a", "b", " ", "  ", "\n", "\t", "7", "'s", ",", ".", "e\u0301", "\u6f22", "<|im_start|>", "x" * 200]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), min_size=1, max_size=120), enough=st.integers(1, 60))
def test_tokens_at_least_is_a_lower_bound(tok, byte_fallback_tok, parts, enough):
    """The bound never exceeds the real count, cut anywhere (``enough`` small: prefixes of a few
    characters), for byte-level BPE (SmolLM2) and a SentencePiece-style tokenizer (a normalizer,
    no pre-tokenizer: one piece)."""
    text = "".join(parts)
    for tokenizer in (tok, byte_fallback_tok):
        assert tokenizer.tokens_at_least(text, enough) <= len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("text", ["The sea, the sea. " * 200_000, "abcdefghij" * 250_000, "\u6f22\u5b57" * 420_000],
                         ids=["words", "one long word", "CJK"])
def test_tokens_at_least_refuses_megabytes_from_a_prefix(tok, text):
    """A 2.4-3.6 MB text over a context of 8,192 tokens: the bound reaches it from a prefix, never
    encoding the whole text (the pieces of a few hundred KB at most)."""
    encoded = []
    splitter = tok._piece_splitter
    tok.__dict__["_piece_splitter"] = _Recording(splitter, encoded)
    try:
        assert tok.tokens_at_least(text, 8192) >= 8192
    finally:
        tok.__dict__["_piece_splitter"] = splitter
    assert max(encoded) < len(text) and max(encoded) <= 2**20, encoded


class _Recording:
    """A tokenizers.Tokenizer that records the length of each text it encodes."""

    def __init__(self, backend, lengths: list):
        self.backend, self.lengths = backend, lengths

    def encode_batch(self, texts, **kwargs):
        self.lengths += [len(t) for t in texts]
        return self.backend.encode_batch(texts, **kwargs)


def test_tokens_at_least_says_nothing_about_a_short_text(tok):
    """Up to 8 characters per token of ``enough`` it is cheaper to encode: the bound is 0."""
    assert tok.tokens_at_least("word " * 1000, 1000) == 0
