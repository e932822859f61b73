"""Text <-> token ids: the model folder's tokenizer, its chat template, and streaming decode.

A thin layer over the `tokenizers` library (the Rust engine behind transformers'
fast tokenizers), reading the files an HF-style folder ships:

    tokenizer.json          vocabulary, merges, pre-tokenizer, decoder, added tokens
    tokenizer_config.json   bos/eos token strings, chat_template   (optional)
    chat_template.jinja     the chat template, as transformers now saves it (optional)
    config.json             eos_token_id, possibly a list          (optional)

Chat templates are rendered in :mod:`minillm.formats.chat_template`.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from pathlib import Path
from typing import Sequence

import tokenizers

from .formats.chat_template import SPECIAL_TOKEN_NAMES, normalize_messages, render_chat_template, select_template
from .errors import ModelNotFoundError
from .stopping import StreamDecoder  # noqa: F401 (the streaming detokenizer, importable here too)

# A normalizer may merge characters before the vocabulary sees them (NFC composes e + U+0301
# into one); four characters to one is beyond what any text does.
NORMALIZER_SLACK = 4
# Tokens_at_least counts a text of up to this many characters per token of its limit by encoding
# it (a few ms); a longer one by pieces first. English runs about 4 characters a token.
PREFIX_CHARS_PER_TOKEN = 8



def load_tokenizer(name_or_path: str | Path, weights_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model: a folder holding tokenizer.json (+ tokenizer_config.json,
    config.json), a .gguf file, or a model name known to :mod:`minillm.formats.weights`
    (downloaded if absent, like :func:`minillm.load_model`).

    Raises ModelNotFoundError when the model or its tokenizer.json is missing.
    """
    from .formats.weights import resolve_model

    model_dir = resolve_model(name_or_path, weights_dir, download=True)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{model_dir.absolute()} has no tokenizer.json; add the model's tokenizer.json "
                                 "to that folder")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ModelNotFoundError(f"cannot read {path} ({e}); download or convert the model again") from None
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():  # transformers reads it in preference to tokenizer_config's
        tokenizer_config["chat_template"] = template_file.read_text(encoding="utf-8")
    return Tokenizer(backend, tokenizer_config, _read_json(model_dir / "config.json"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Encode/decode text, render chat prompts; wraps a ``tokenizers.Tokenizer``.

    Attributes:
        backend: the wrapped ``tokenizers.Tokenizer``.
        bos_token_id, eos_token_id: ids of the BOS / EOS tokens, or None.
        eos_token_ids: every id that ends generation (tokenizer_config's eos_token
            plus config.json's eos_token_id, an int or a list).
        chat_template: the Jinja chat template (or a dict of named ones), or None.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, tokenizer_config: dict | None = None, model_config: dict | None = None
    ):
        self.backend = backend
        self.special_tokens = {name: _token_content((tokenizer_config or {}).get(name)) for name in SPECIAL_TOKEN_NAMES}
        model_config = model_config or {}
        self.bos_token_id = self._special_id("bos_token", model_config.get("bos_token_id"))
        self.eos_token_id = self._special_id("eos_token", model_config.get("eos_token_id"))
        config_eos = model_config.get("eos_token_id")
        config_eos = config_eos if isinstance(config_eos, list) else [config_eos]
        self.eos_token_ids = {i for i in [self.eos_token_id, *config_eos] if i is not None}
        self.chat_template = (tokenizer_config or {}).get("chat_template")
        added = backend.get_added_tokens_decoder()
        self._added_ids = set(added)
        self.special_ids = frozenset(i for i, token in added.items() if token.special)  # dropped by skip_special_tokens
        self.byte_fallback_ids = _byte_fallback_ids(backend)

    def _special_id(self, name: str, fallback: int | list[int] | None) -> int | None:
        token = self.special_tokens[name]
        if token is not None:
            return self.backend.token_to_id(token)
        return fallback[0] if isinstance(fallback, list) else fallback

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.special_tokens['bos_token']!r} ({self.bos_token_id}), "
            f"eos_ids={sorted(self.eos_token_ids)}, chat_template={self.has_chat_template})"
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be less than the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become
        their single ids; ``add_special_tokens`` adds the BOS/EOS the tokenizer is set up for.

        Raises ValueError when ``text`` is not a str, or holds what UTF-8 cannot encode: the
        bytes Python could not decode (a Latin-1 file, a terminal's argv: ``surrogateescape``
        keeps byte 0xe9 as U+DCE9) or a lone surrogate. The tokenizers library's own messages
        name neither ("TextInputSequence must be str")."""
        _check_text(text)
        # encode_batch gives the same ids and releases the GIL while Rust works (encode holds it):
        # a server's other threads keep running while a long prompt is tokenised
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token spells (the longest vocabulary entry, added tokens included).

        A text of n characters is at least ``n / max_token_chars`` tokens (before a normalizer
        merges characters), so a server can refuse a prompt too long for the context without
        tokenising it.
        """
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def tokens_at_least(self, text: str, enough: int) -> int:
        """A lower bound on ``len(self.encode(text, add_special_tokens=False))`` that reaches
        ``enough`` as soon as a prefix of ``text`` shows it, without tokenising the rest: a server
        refuses a prompt too long for its context in a fraction of a second, not the seconds (and
        hundreds of MB) that encoding megabytes takes. A text of at most ``PREFIX_CHARS_PER_TOKEN *
        enough`` characters costs little to encode: the bound is then 0 (it says nothing).

        Each prefix ``P = text[:c]`` (c doubling, moved back to the start of an added token it
        would cut) is split into *pieces* by the tokenizer's own pipeline (added tokens,
        normalizer, pre-tokenizer), with the model swapped for one that spells each piece as one
        token (:attr:`_piece_splitter`: no BPE, which is what costs on a long word). With the
        pieces of P, p_1 .. p_k, and a = where p_k starts:

            text   |-- p_1 --|-- p_2 --| ... |-- p_k -----.------------------|
                                              a           c (the cut)

            tokens(text) >= sum_{i<k} ceil(|p_i| / L) + ceil((c - a) / L)

        where L = max_token_chars (times NORMALIZER_SLACK when there is a normalizer: it may merge
        that many characters into one) and |p| counts characters, or UTF-8 bytes for a byte-level
        vocabulary without a normalizer (:attr:`_spells_bytes`). Why it holds:

        1. p_1 .. p_(k-1) are pieces of the whole text too. Each stage splits by what it reads up
           to the split and one character past it: an added token's match covers its characters
           only (no lstrip, rstrip or single_word; else :attr:`_piece_splitter` is None) and none
           crosses c; the pre-tokenizers' regexes (GPT-2's, Llama 3's, Qwen's; Metaspace,
           digits) are alternatives of runs of one class of characters (letters, digits, other,
           whitespace, with an optional first character or one character of lookahead), so a run
           that goes on past c in the text matches, in P, a run up to c. Only p_k can differ.
        2. The model encodes each piece on its own (``tokenizers``' pipeline), so the text's
           tokens include each p_i's, and a piece of n characters is at least ceil(n / L) tokens:
           no token spells more than L characters, and each character has a token (byte-level and
           byte-fallback vocabularies, minillm's models'), so no piece is 0 tokens.
        3. The characters [a, c) are spelled by the text's later tokens, at most L each.
           (A byte-level token's L characters are L bytes, of which a character takes 1-4.)

        Without a pre-tokenizer (SentencePiece-style tokenizer.json: one piece) this is c / L, the
        length alone. Raises ValueError as :meth:`encode` does.
        """
        _check_text(text)
        chars = PREFIX_CHARS_PER_TOKEN * enough
        if len(text) <= chars or self._piece_splitter is None:
            return 0
        per_token = self.max_token_chars * (NORMALIZER_SLACK if self.backend.normalizer is not None else 1)
        in_bytes = self._spells_bytes
        while True:
            cut = self._cut_before_added_tokens(text, chars) if chars < len(text) else len(text)
            pieces = self._piece_splitter.encode_batch([text[:cut]], add_special_tokens=False)[0].offsets
            spans = [(start, end) for start, end in pieces if end > start]
            if spans and cut < len(text):  # the last piece may go on past the cut: counted up to it
                spans[-1] = (spans[-1][0], cut)
            sizes = (len(text[start:end].encode()) if in_bytes else end - start for start, end in spans)
            bound = sum(-(-size // per_token) for size in sizes)
            if bound >= enough or chars >= len(text):
                return bound
            chars *= 2

    def _cut_before_added_tokens(self, text: str, cut: int) -> int:
        """``cut``, moved back to the start of any added token written in ``text`` across it."""
        moved = True
        while moved:
            moved = False
            for content in self._added_contents:
                start = text.rfind(content, max(0, cut - len(content) + 1), cut + len(content) - 1)
                if start != -1 and start < cut:
                    cut, moved = start, True
        return cut

    @functools.cached_property
    def _spells_bytes(self) -> bool:
        """A byte-level vocabulary with no normalizer: its tokens' characters are the text's UTF-8
        bytes, so L (max_token_chars) bounds the bytes a token spells (a CJK character is 3)."""
        pre_tokenizer = self.backend.pre_tokenizer
        return self.backend.normalizer is None and pre_tokenizer is not None and (
            b'"ByteLevel"' in pre_tokenizer.__getstate__())  # its JSON

    @functools.cached_property
    def _added_contents(self) -> list[str]:
        return [token.content for token in self.backend.get_added_tokens_decoder().values() if token.content]

    @functools.cached_property
    def _piece_splitter(self) -> tokenizers.Tokenizer | None:
        """This tokenizer with its model swapped for a WordLevel model that knows no word: each
        piece of a text (an added token, a pre-tokenizer's split) becomes one unknown token, with
        its character offsets (:meth:`tokens_at_least`). None when an added token's match depends
        on characters beyond its own (lstrip, rstrip, single_word; or normalized, under a
        normalizer): then a prefix's pieces tell nothing."""
        added = self.backend.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized and self.backend.normalizer for t in added):
            return None
        splitter = tokenizers.Tokenizer.from_str(self.backend.to_str())
        splitter.model = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
        splitter.no_truncation()
        splitter.no_padding()
        return splitter

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (an incomplete UTF-8 character at the end shows as U+FFFD).

        ``ids``: ints (or numpy / 0-d torch integers), each a vocabulary id.
        Raises ValueError for an id that is not an integer or not in the vocabulary.
        """
        return self.backend.decode(self.check_ids(ids), skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of Python ints, each one in the vocabulary.

        Raises ValueError naming the first bad id (the `tokenizers` library would turn an
        unknown id into "" and a negative or 33-bit one into an OverflowError).
        """
        try:
            checked = [_as_token_id(i) for i in ids]
        except TypeError:
            raise ValueError(f"token ids must be a sequence of integers, got {ids!r:.80}") from None
        for token_id in checked:
            # the library's ids are 32-bit (a larger one is an OverflowError); also holes in the id range
            if not 0 <= token_id < 2**32 or self.backend.id_to_token(token_id) is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary (ids 0..{self.vocab_size - 1})")
        return checked

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry, as stored (byte-level: 'Ġhello' for ' hello'); None for an
        integer outside the vocabulary. Raises ValueError for a non-integer."""
        try:
            token_id = _as_token_id(token_id)
        except TypeError:
            raise ValueError(f"a token id must be an integer, got {token_id!r:.80}") from None
        return self.backend.id_to_token(token_id) if token_id >= 0 else None

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """One readable piece per id, for display: ``[' hello', ' \\xf0\\x9f', '\\x98\\x80']``.

        Byte-level pieces are shown as the text they encode; bytes of a character
        split across tokens (byte-level or ``<0xNN>`` byte-fallback tokens) are shown as
        ``\\xNN`` escapes instead of U+FFFD; SentencePiece's '▁' shows as the space it is.
        Raises ValueError like :meth:`decode`.
        """
        return [self._token_string(i) for i in self.check_ids(ids)]

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes of text each id stands for, a split character's bytes as they are
        (``[b' hello', b' \\xf0\\x9f', b'\\x98\\x80']``): OpenAI's ``bytes`` of a logprob.
        Raises ValueError like :meth:`decode`."""
        return [self._token_bytes(i) for i in self.check_ids(ids)]

    def _token_string(self, token_id: int) -> str:
        return self._token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _token_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token_id in self._added_ids:
            return token.encode()
        if token_id in self.byte_fallback_ids:  # "<0xE6>" -> b"\\xe6", "<0x0A>" -> b"\n"
            return bytes([int(token[3:5], 16)])
        if "\u2581" in token and self.byte_fallback_ids:  # SentencePiece: "▁wo" is " wo" (a lone
            return token.replace("\u2581", " ").encode()  # decode would strip that space as the text's first)
        byte_level = isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel)
        if not byte_level or not set(token) <= _BYTE_OF_CHAR.keys():
            return self.backend.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF_CHAR[c] for c in token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` into the prompt text the model was tuned on.

        Rendered like transformers' ``apply_chat_template(tokenize=False)``, string for string
        (see :mod:`minillm.formats.chat_template`). "content" may be a string or a list of parts
        (``[{"type": "text", "text": ...}]``). The text already holds its special tokens, so
        encode it with ``add_special_tokens=False``.

        Args:
            tools: JSON schemas of callable functions, for templates that support tool use.
            documents: ``[{"title": ..., "text": ...}]``, for retrieval-augmented templates.
            **kwargs: extra template variables (e.g. ``enable_thinking=False``).

        Raises ValueError (one line) when the model has no chat template, a message is
        malformed, or the template rejects the chat (its ``raise_exception`` message is kept).
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        return render_chat_template(
            select_template(self.chat_template, tools),
            normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            tools=tools,
            documents=documents,
            **kwargs,
        )


def _check_text(text) -> None:
    """ValueError unless ``text`` is a str UTF-8 can encode (:meth:`Tokenizer.encode` says why)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}; decode ids with tok.decode")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ValueError(f"the text is not valid UTF-8: {what} at character {e.start}; give it as UTF-8 "
                         "(e.g. iconv -f latin1 -t utf-8)") from None


def _as_token_id(value) -> int:
    """An int from an int-like value (numpy or 0-d torch integers too); TypeError otherwise.
    bool is refused although Python counts it as an int: True is never meant as id 1."""
    if isinstance(value, bool):
        raise TypeError("bool")
    return operator.index(value)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _byte_fallback_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the ``<0x00>``..``<0xFF>`` tokens of a byte-fallback model (SentencePiece style:
    Llama-2, Mistral, TinyLlama), or nothing for other models."""
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: char -> byte.

    The 188 printable bytes stand for themselves; the other 68 (space, newline,
    control bytes...) get chars from U+0100 on, in byte order: space -> 'Ġ', '\\n' -> 'Ċ'.
    Source: ``bytes_to_unicode`` in openai/gpt-2 encoder.py.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = _gpt2_byte_of_char()
