"""minillm: an educational LLM inference engine in pure PyTorch.

The top level is the course, in the order the lessons meet it. Its core (the model, the cache, the
phases, sampling, generate, the trace, the costs) imports none of the packages around it; loading.py,
tokenizer.py and whatif.py are the doors to fast/ and formats/ (pyproject.toml's import contracts):

    tokenizer.py  load_tokenizer: text <-> ids, chat template                      (lesson 01)
    config.py     ModelConfig from a Hugging Face config.json
    model.py      the transformer (embedding, attention, MLP, norms) for GPT-2 and Llama, plain PyTorch
    rope.py       rotary position embedding and its scalings
    loading.py    load_model: checkpoint -> Transformer; then quantise, then the speed layer (the one door)
    phases.py     prefill and decode_step, the two phases of inference; verify, speculative decoding's pass (02)
    kv_cache.py   KVCache, the visible cache of keys and values                     (03)
    baseline.py   generate_no_cache: the nanoGPT-style sampler that re-runs the whole sequence (04)
    costs.py      FLOPs and bytes of prefill and decode, from the config (the cost model)   (05)
    hardware.py   peak FLOP/s and bandwidth (datasheets or calibrated), the roofline verdict
    metrics.py    TTFT, TPOT, ITL, e2e, MBU per request; percentiles and SLO attainment   (06)
    trace.py      Trace: structured events of every phase of a request (trace=), JSONL export
    sweep.py      TTFT vs prompt length, TPOT vs context length, measured
    sampling.py   SamplingParams: penalties, greedy, temperature, min-p, top-k, top-p (vLLM's names) (07)
    stopping.py   when a request ends and why (eos, stop, length), stop strings held back and cut out,
                  the text stream (StreamDecoder: ids to text, never splitting a character)
    generate.py   generate: prefill, then decode in a loop
    generation_config.py  generation_config.json: the checkpoint's eos ids and sampling defaults
    chat.py       ChatSession: a conversation that keeps its KV cache between turns
    block_hash.py chained sha256 block hashes, seeded by the model's identity, dtype, device (08)
    prefix_cache.py  PrefixCache: K/V of cached prompt prefixes, so their prefill is skipped
    prefix_demo.py   shared-system-prompt requests with and without the prefix cache, measured
    speculative.py  speculative decoding: a draft proposes k tokens, one pass verifies them (09)
    quantize.py   weight-only int8 / int4 matrices: the formats, the reference arithmetic
    whatif.py     predicted TTFT / TPOT of any config on any hardware (roofline floors)  (10)
    classroom/    the exercises' grader (minillm check) and the student's pieces assembled into
                  one engine (minillm generate --student-dir)
    device.py, errors.py, paths.py, units.py   leaves: device and dtype, the errors, the weights
                  folder, number and byte formats
    cpu_policy.py the minillm command's CPU threads on a shared machine (fewer while others are busy);
                  the busy-machine note
    malloc_policy.py  the serving commands' allocator: glibc's malloc keeps freed memory for the next step
                  (both policies are started by cli/, in the command's process; `import minillm` sets none)

Packages around it:

    fast/         the speed layer, "skip on a first reading": stacked and C products, decode attention
                  in C, the compiled decode step, and which of them a machine gets (choose.py); it
                  swaps in subclasses of the course's modules, same parameters (load_model(fast=False):
                  without it)
    serving/      many users at once (lesson 11): paged KV cache, block allocator, scheduler, LLMEngine;
                  serving/server/: minillm serve, the engine behind an OpenAI-compatible HTTP API;
                  serving/kv_tiers/: blocks beyond the pool (host memory, disk), load or recompute
    distributed/  one model over several processes (lesson 12): tensor parallelism (Megatron's split,
                  the all-reduces, minillm generate --tp N); prefill and decode workers (lesson 10)
    formats/      files: model names and downloads (weights.py), GGUF in (gguf_convert.py) and out for
                  llama.cpp (gguf_export.py), chat templates (chat_template.py), Chrome's Trace Event
                  Format (trace_events.py)
    structured/   structured output: a JSON schema, regex, choice or grammar as an allowed-token mask
                  (llguidance), bounded and tried at admission (grammar.py); the API's fields to one
                  grammar (request_fields.py)
    views/        a run shown to a person: the terminal (terminal.py), notebooks (html.py:
                  show(trace)), Perfetto (chrome_trace.py), plots (plots.py); the serving engine's
                  steps and runs (serving_terminal.py, serving_plots.py)
    bench/        minillm vs transformers vs llama.cpp vs no cache vs the roofline floors, interleaved;
                  the serving benchmark (serving.py, workload.py, http_client.py, metrics_scrape.py)
    cli/          the minillm command: argument parsing and printing; the work is in the library
                  (__main__.py: python -m minillm runs it)

`import minillm` loads nothing heavy: the public names (``minillm.load_model``, ``from minillm import
generate``) load torch and their modules at the first use of one, so that the command can start its CPU
policy before torch loads (cli/__init__.py).
"""

import sys as _sys
import types as _types
from importlib import metadata as _metadata

__all__ = [
    "CacheFullError",
    "ConfigError",
    "GenerationStep",
    "KVCache",
    "LLMEngine",
    "MiniLLMError",
    "ModelConfig",
    "ModelNotFoundError",
    "PrefixCache",
    "SamplingParams",
    "SpeculativeConfig",
    "StreamDecoder",
    "Tokenizer",
    "Trace",
    "Transformer",
    "WeightsError",
    "decode_step",
    "generate",
    "load_model",
    "load_tokenizer",
    "prefill",
    "sample",
]

try:  # the installed distribution's version (pyproject.toml's), as `pip show minillm` prints it
    __version__ = _metadata.version("minillm")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """``minillm.load_model``, ``from minillm import generate``, ...: the public names, all loaded at the
    first use of one (PEP 562). Importing minillm alone loads neither torch nor any module."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_public_names()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _load_public_names() -> None:
    from .config import ModelConfig
    from .errors import CacheFullError, ConfigError, MiniLLMError, ModelNotFoundError, WeightsError
    from .generate import GenerationStep, generate
    from .kv_cache import KVCache
    from .loading import load_model
    from .model import Transformer
    from .phases import decode_step, prefill
    from .prefix_cache import PrefixCache
    from .sampling import SamplingParams, sample
    from .serving import LLMEngine
    from .speculative import SpeculativeConfig
    from .stopping import StreamDecoder
    from .tokenizer import Tokenizer, load_tokenizer
    from .trace import Trace

    imported = locals()
    globals().update({name: imported[name] for name in __all__})  # the package's own names from now on


class _Package(_types.ModuleType):
    """minillm's module object. The import system sets a package's attribute to each submodule it loads:
    loading the submodule ``minillm.generate`` (the generate loop's module) before the public names would
    make ``minillm.generate`` that module instead of the function ``generate``. A public name keeps its place."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__ and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
