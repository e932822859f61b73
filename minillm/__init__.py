"""minillm: an educational LLM inference engine in pure PyTorch.

The package layout is the course outline:

    config.py     ModelConfig from a Hugging Face config.json
    model.py      the transformer (embedding, attention, MLP, norms) for GPT-2 and Llama
    rope.py       rotary position embedding
    loading.py    load_model: safetensors checkpoint -> Transformer
    kv_cache.py   KVCache, the visible cache of keys and values
    phases.py     prefill and decode_step, the two phases of inference
    sampling.py   SamplingParams: greedy, temperature, top-k, top-p
    generate.py   generate: prefill, then decode in a loop
    tokenizer.py  load_tokenizer: text <-> ids, chat template, streaming detokenizer
    weights.py    model names, the weights directory, downloads
    gguf_convert.py  GGUF file -> Hugging Face folder (dequantised)
"""

from .config import ModelConfig
from .errors import CacheFullError, ConfigError, MiniLLMError, ModelNotFoundError, WeightsError
from .generate import GenerationStep, generate
from .kv_cache import KVCache
from .loading import load_model
from .model import Transformer
from .phases import decode_step, prefill
from .sampling import SamplingParams, sample
from .tokenizer import StreamDecoder, Tokenizer, load_tokenizer

__all__ = [
    "CacheFullError",
    "ConfigError",
    "GenerationStep",
    "KVCache",
    "MiniLLMError",
    "ModelConfig",
    "ModelNotFoundError",
    "SamplingParams",
    "StreamDecoder",
    "Tokenizer",
    "Transformer",
    "WeightsError",
    "decode_step",
    "generate",
    "load_model",
    "load_tokenizer",
    "prefill",
    "sample",
]
