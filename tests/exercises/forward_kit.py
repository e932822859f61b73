"""What the differential checks of prefill (ex06) and decode_step (ex07) share (issue 30).

The tiny models in every dtype and attention layout the docstrings allow (GQA, MQA with tied
embeddings, GPT-2's learned positions, an explicit head_dim, Qwen3's QK-norm, sliding windows
with and without rolling buffers), and the pass's whole observable result: the logits, the
cache length and every K/V the pass wrote, so that a pass that returns the right logits but
leaves the cache wrong is caught too; the oracle (the whole sequence, no cache), the cases the
random checks draw, and the comparison of a student's pass with minillm's.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import lru_cache

import torch
from hypothesis import strategies as st

from exercises.differential import agree
from exercises.models import prompt, tiny_config, tiny_model
from minillm import KVCache, Transformer

# name -> (config of tests/tiny_models.py, sliding window or None)
MODELS = {
    "llama_gqa": ("llama_gqa", None),
    "gpt2": ("gpt2", None),
    "llama_mqa_tied": ("llama_mqa_tied", None),
    "llama_head_dim": ("llama_head_dim", None),
    "qwen3": ("qwen3", None),
    "mistral_window_5": ("mistral", 5),  # every layer sees the last 5 positions only
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCAB = 128


@lru_cache(maxsize=None)
def model_for(name: str, dtype: torch.dtype = torch.float32) -> Transformer:
    """A tiny seeded model of MODELS in ``dtype``; shared between checks, never modified."""
    base, window = MODELS[name]
    if window is None:
        model = tiny_model(base)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Transformer(replace(tiny_config(base), sliding_window=window), attn_impl="eager")
        model = model.eval().requires_grad_(False)
    if dtype != torch.float32:
        model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
    return model


def tolerance(dtype: torch.dtype) -> tuple[float, float] | None:
    """Logits are float32 either way, but a half-precision model rounds every op on the way."""
    return None if dtype == torch.float32 else (6e-2, 6e-2)


def cache_state(cache: KVCache) -> tuple:
    """Everything a pass leaves in the cache: its length and the K/V of the filled positions."""
    n = cache.length
    return (n, cache.k[..., :n, :].clone(), cache.v[..., :n, :].clone(), cache.k_roll.clone(), cache.v_roll.clone())


def full_forward_last(model, ids: torch.Tensor) -> torch.Tensor:
    """The oracle: the model over the whole sequence from position 0, no cache; last position's logits."""
    with torch.no_grad():
        return model(ids)[:, -1].float()


def with_cache(fn):
    """``fn(model, ids, cache)`` -> (its answer, the cache afterwards): both are graded."""
    def run(model, ids, cache):
        with torch.no_grad():
            out = fn(model, ids, cache)
        return out, cache_state(cache)
    run.__name__ = getattr(fn, "__name__", "run")
    return run


MODEL_NAMES = sorted(MODELS)
BAD_IDS = {"a negative id": -1, "an id >= vocab": VOCAB}


def table(kinds: list[str]) -> list[dict]:
    """Every kind of case in every dtype, models, batches and positions rotating: a deterministic sweep that
    hypothesis' random draws cannot miss (they cluster), run before the random search."""
    rows = []
    for i, (kind, dtype) in enumerate((k, d) for k in kinds for d in DTYPES):
        name = MODEL_NAMES[i % len(MODEL_NAMES)]
        far = i % 3 == 0 and name != "gpt2"
        rows.append(dict(name=name, dtype=dtype, rolling=MODELS[name][1] is not None and i % 2 == 0,
                         batch=1 + i % 2, kind=kind, prefix_len=100 + i % 20 if far else i % 7, n=1 + (3 * i) % 8,
                         extra=1 + i % 3, seed=i % 4, bad_at=i))
    return rows


def draw_model(data) -> tuple[str, torch.dtype, bool]:
    name = data.draw(st.sampled_from(sorted(MODELS)), label="model")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    rolling = MODELS[name][1] is not None and data.draw(st.booleans(), label="rolling buffer")
    return name, dtype, rolling


def ids_of(batch: int, n: int, seed: int, kind: str, bad_at: int) -> list[list[int]]:
    """Seeded token ids [batch, n]; for a bad-id kind, one id of the last row outside the vocabulary."""
    ids = prompt(n, batch, seed=seed).tolist()
    if kind in BAD_IDS:
        ids[-1][bad_at % n] = BAD_IDS[kind]
    return ids


def filled_cache(model: Transformer, batch: int, max_seq_len: int, prefix_len: int, rolling: bool) -> KVCache:
    """A cache holding ``prefix_len`` seeded tokens per sequence (prefilled by minillm), or empty: a copy each
    call (the one prefilled is kept for the next example, which saves most of a check's time)."""
    return copy.deepcopy(_filled(model, batch, max_seq_len, prefix_len, rolling))


@lru_cache(maxsize=256)
def _filled(model, batch, max_seq_len, prefix_len, rolling) -> KVCache:
    from minillm.phases import prefill

    cache = KVCache.for_model(model, batch_size=batch, max_seq_len=max_seq_len, rolling=rolling)
    if prefix_len:
        prefill(model, prompt(prefix_len, batch, seed=9), cache)
    return cache


def agree_on_the_cache(student, reference, inputs, name: str, dtype: torch.dtype, rolling: bool, case: str,
                       **report) -> None:
    """agree() on (logits, the cache afterwards) of one prefill or decode step, the student's against minillm's;
    ``case`` names the kind of case and the cache, ``report`` is agree's exercise, lesson and hint."""
    agree(with_cache(student), with_cache(reference), inputs, tol=tolerance(dtype),
          what=f"{reference.__name__} (tiny {name}, {str(dtype)[6:]}{', rolling cache' if rolling else ''}, {case}) "
               "-> (logits, cache afterwards)", **report)


def draw_case(data, kinds: list[str], far_prefix: tuple[int, int], n, extra: tuple[int, int],
              bad_at: tuple[int, int]) -> dict:
    """A check's compare() arguments drawn by hypothesis: a model, a kind of case, a batch, a cache near position 0
    or ``far_prefix`` tokens from it; ``n`` tokens, or the range they are drawn from."""
    name, dtype, rolling = draw_model(data)
    kind = data.draw(st.sampled_from(kinds), label="case")
    far = name != "gpt2" and data.draw(st.booleans(), label="far from position 0")
    return dict(name=name, dtype=dtype, rolling=rolling, batch=data.draw(st.integers(1, 2), label="batch"), kind=kind,
                prefix_len=data.draw(st.integers(*far_prefix) if far else st.integers(0, 12), label="tokens cached"),
                n=n if isinstance(n, int) else data.draw(st.integers(*n), label="T"),
                extra=data.draw(st.integers(*extra), label="room +-"),
                seed=data.draw(st.integers(0, 3), label="ids seed"),
                bad_at=data.draw(st.integers(*bad_at), label="bad at"))
