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
"""

from .config import ModelConfig
from .errors import CacheFullError, ConfigError, MiniLLMError, ModelNotFoundError, WeightsError
from .generate import GenerationStep, generate
from .kv_cache import KVCache
from .loading import load_model
from .model import Transformer
from .phases import decode_step, prefill
from .sampling import SamplingParams, sample

__all__ = [
    "CacheFullError",
    "ConfigError",
    "GenerationStep",
    "KVCache",
    "MiniLLMError",
    "ModelConfig",
    "ModelNotFoundError",
    "SamplingParams",
    "Transformer",
    "WeightsError",
    "decode_step",
    "generate",
    "load_model",
    "prefill",
    "sample",
]
