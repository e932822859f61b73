"""The engines a benchmark runs side by side, each behind the same three calls.

    engine           prefill (TTFT)                    decode (TPOT)
    minillm-sdpa     prefill() of the prompt           decode_step() over the KV cache
    minillm-eager    the same, attention written out
    minillm-compile  (--compile) the same, decode_step compiled (minillm.fast.compile)
    transformers     generate(max_new_tokens=1)        generate() continuing its KV cache
    no-cache         one forward pass (the same)       a forward pass over the whole sequence
                                                       for every token (minillm.baseline)
    llama.cpp        (optional) llama-cpp-python on the same weights as an F32 GGUF (bench/llama_cpp.py)
"""

from __future__ import annotations

import torch

from ..baseline import generate_no_cache
from ..kv_cache import KVCache
from ..model import Transformer
from ..phases import decode_step, prefill
from .clock import Clock

ENGINES = ("minillm-sdpa", "minillm-eager", "transformers", "no-cache")
OPTIONAL_ENGINES = ("minillm-compile", "llama.cpp")  # named explicitly (--engines, --compile)

# Each engine offers the same three calls; ids are [B, L] int64 on the model's device.
#   ttft(ids)                       -> Clock: prompt -> first token, from an empty cache
#   prepare_decode(ids, n)          -> state: the first L-1 tokens' K/V in a cache (untimed;
#                                      the rows of ids are equal: one is prefilled, then copied)
#   decode(ids, state, n)           -> Clock: the last prompt token, then n tokens in all


class MiniLLMEngine:
    """minillm's prefill + decode_step with greedy argmax (what ``generate`` does at temperature 0).

    ``step`` replaces decode_step (the compiled one, for minillm-compile).
    """

    def __init__(self, model: Transformer, attn_impl: str = "sdpa", name: str | None = None, step=None):
        self.model, self.attn_impl = model, attn_impl
        self.name = name or f"minillm-{attn_impl}"
        self.step = step or decode_step
        self.compiled = step is not None  # compiles once per cache shape: warm each case up untimed

    def ttft(self, ids: torch.Tensor) -> Clock:
        self.model.attn_impl = self.attn_impl
        clock = Clock()
        cache = KVCache.for_model(self.model, batch_size=ids.shape[0], max_seq_len=ids.shape[1] + 1)
        clock(prefill(self.model, ids, cache).argmax(dim=-1))
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int) -> KVCache:
        self.model.attn_impl = self.attn_impl
        batch, length = ids.shape
        row = KVCache.for_model(self.model, batch_size=1, max_seq_len=length + n_new)
        prefill(self.model, ids[:1, :-1], row)
        if batch == 1:
            return row
        cache = KVCache.for_model(self.model, batch_size=batch, max_seq_len=length + n_new)
        cache.k.copy_(row.k.expand_as(cache.k))  # [n_layers, 1, ...] -> every row of the batch
        cache.v.copy_(row.v.expand_as(cache.v))
        cache.advance(row.length)
        return cache

    def decode(self, ids: torch.Tensor, cache: KVCache, n_new: int) -> Clock:
        self.model.attn_impl = self.attn_impl
        cache.truncate(ids.shape[1] - 1)
        clock = Clock()
        token = prefill(self.model, ids[:, -1:], cache).argmax(dim=-1)
        clock(token)
        for _ in range(n_new - 1):
            token = self.step(self.model, token, cache).argmax(dim=-1)
            clock(token)
        return clock


class NoCacheEngine:
    """The nanoGPT-style sampler of :mod:`minillm.baseline`: no KV cache at all."""

    name = "no-cache"

    def __init__(self, model: Transformer):
        self.model = model

    def ttft(self, ids: torch.Tensor) -> Clock:
        self.model.attn_impl = "sdpa"
        clock = Clock()
        generate_no_cache(self.model, ids, 1, on_token=clock)
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int) -> None:
        return None  # nothing to keep: every token starts from scratch

    def decode(self, ids: torch.Tensor, state, n_new: int) -> Clock:
        self.model.attn_impl = "sdpa"
        clock = Clock()
        generate_no_cache(self.model, ids, n_new, on_token=clock)
        return clock


class TransformersEngine:
    """Hugging Face ``generate`` (greedy, its DynamicCache on) on the same checkpoint."""

    name = "transformers"

    def __init__(self, hf_model):
        self.hf = hf_model

    def ttft(self, ids: torch.Tensor) -> Clock:
        clock = Clock()
        self._generate(ids, 1, clock)
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int):
        from transformers import DynamicCache

        cache = DynamicCache()
        self._generate(ids[:1, :-1], 1, None, cache)  # fills the cache with the first L-1 tokens of one row
        if ids.shape[0] > 1:
            cache.batch_repeat_interleave(ids.shape[0])  # ... and copies them to every row
        return cache

    def decode(self, ids: torch.Tensor, cache, n_new: int) -> Clock:
        extra = cache.get_seq_length() - (ids.shape[1] - 1)
        if extra > 0:
            cache.crop(-extra)  # negative: "drop this many" in transformers 4.x and 5.x alike
        clock = Clock()
        self._generate(ids, n_new, clock, cache)
        return clock

    def _generate(self, ids, n_new: int, clock: Clock | None, cache=None):
        import warnings

        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        kwargs = {} if cache is None else {"past_key_values": cache}
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # past_key_values is being renamed; both work
            # An explicit mask: without one, transformers masks every prompt token equal to pad_token_id.
            return self.hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    streamer=_Streamer(clock) if clock else None, **kwargs)


class _Streamer:
    """transformers' streamer interface: put(prompt) once, then put(tokens [B]) per step."""

    def __init__(self, clock: Clock):
        self.clock, self.seen_prompt = clock, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.clock(value)
        self.seen_prompt = True

    def end(self) -> None:
        pass


def load_transformers(model: Transformer):
    """The same checkpoint in transformers (sdpa attention, same dtype and device).

    Raises ImportError without transformers, ValueError when the model has no source folder.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    source = getattr(model, "source", None)
    if source is None:
        raise ValueError("the model has no source folder (model.source) for transformers to load")
    param = next(model.parameters())
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would interleave with the bench's lines
    try:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=param.dtype, attn_implementation="sdpa")
    finally:
        hf_logging.enable_progress_bar()
    return hf.to(param.device).eval().requires_grad_(False)


def make_engines(model: Transformer, names=ENGINES, hf_model=None, compile_mode: str | None = None,
                 n_ctx: int | None = None):
    """Build the named engines; returns (engines, notes) where notes say what was skipped and why.

    ``hf_model``: a transformers model to use as the "transformers" engine (default:
    :func:`load_transformers`). ``compile_mode``: also build "minillm-compile"
    (``torch.compile`` mode, e.g. "default" or "reduce-overhead"). "llama.cpp" needs
    llama-cpp-python (skipped with a note without it) and gets a context of ``n_ctx`` positions
    (default the model's).
    """
    names = list(names)
    if compile_mode is not None and "minillm-compile" not in names:
        names.insert(names.index("minillm-sdpa") + 1 if "minillm-sdpa" in names else 0, "minillm-compile")
    engines, notes = [], []
    for name in names:
        if name in ("minillm-sdpa", "minillm-eager"):
            engines.append(MiniLLMEngine(model, name.removeprefix("minillm-")))
        elif name == "minillm-compile":
            from ..fast.compile import compile_decode_step

            step = compile_decode_step(mode=compile_mode or "default")
            engines.append(MiniLLMEngine(model, "sdpa", name="minillm-compile", step=step))
        elif name == "no-cache":
            engines.append(NoCacheEngine(model))
        elif name == "transformers":
            try:
                engines.append(TransformersEngine(hf_model if hf_model is not None else load_transformers(model)))
            except ImportError:
                notes.append("transformers is not installed: its engine was skipped (pip install transformers)")
        elif name == "llama.cpp":
            from .llama_cpp import make_llama_cpp_engine

            engine, why_not = make_llama_cpp_engine(model, n_ctx or model.config.max_seq_len)
            engines += [engine] if engine else []
            notes += [why_not] if why_not else []
        else:
            raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES + OPTIONAL_ENGINES)}")
    return engines, notes
