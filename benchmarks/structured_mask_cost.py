"""Per-token cost of a grammar library's allowed-token mask, on SmolLM2's 49,152-token vocabulary.

Constrained decoding asks the grammar, before every token, which of the vocabulary's ids may
come next. This script measures that question for the three maintained libraries (xgrammar,
llguidance, outlines-core) on the same small JSON schema and the same token sequence (the
tokens of one valid answer, fed one by one): compile time, then per step the time to fill a
mask over the whole vocabulary (the unpacking into a bool tensor is timed apart). Libraries not
installed are skipped; minillm's dev extra has llguidance only, so for the comparison first
``pip install xgrammar outlines-core`` (xgrammar pulls in triton, about 1 GB).
Run: python benchmarks/structured_mask_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import minillm

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "colour": "green"}'


def token_bytes_vocab(tok, vocab_size):
    """Each id's bytes; special tokens as b"" (no grammar may spell them)."""
    raw = tok.token_bytes(range(tok.vocab_size))
    return [b"" if i in tok.special_ids else b for i, b in enumerate(raw)] + [b""] * (vocab_size - tok.vocab_size)


def bench_xgrammar(tok, vocab_size, eos, ids):
    import xgrammar as xgr
    from importlib.metadata import version
    info = xgr.TokenizerInfo(token_bytes_vocab(tok, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def run():
        matcher, times, allowed = xgr.GrammarMatcher(compiled), [], []
        for token in ids + [eos]:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t)
            mask = _unpack(bitmask[0], vocab_size)
            allowed.append(int(mask.sum()))
            assert mask[token], token
            assert matcher.accept_token(token)
        return times, allowed
    return f"xgrammar {version('xgrammar')}", compile_s, run


def bench_llguidance(tok, vocab_size, eos, ids):
    import llguidance
    import llguidance.torch as llt
    from importlib.metadata import version
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher0 = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def run():
        matcher, times, allowed = llguidance.LLMatcher(lltok, grammar), [], []
        for token in ids + [eos]:
            t = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - t)
            mask = _unpack(bitmask[0], vocab_size)
            allowed.append(int(mask.sum()))
            assert mask[token], token
            assert matcher.consume_token(token), matcher.get_error()
        return times, allowed
    del matcher0
    return f"llguidance {version('llguidance')}", compile_s, run


def bench_outlines_core(tok, vocab_size, eos, ids):
    import outlines_core
    from importlib.metadata import version
    vocab: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes_vocab(tok, vocab_size)):
        if b and i != eos:
            vocab.setdefault(b, []).append(i)
    t0 = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - t0
    words = (vocab_size + 31) // 32
    packed = torch.zeros(words, dtype=torch.int32)

    def run():
        guide, times, allowed = outlines_core.Guide(index), [], []
        for token in ids + [eos]:
            t = time.perf_counter()
            packed.zero_()
            guide.write_mask_into(packed.data_ptr(), packed.numel(), packed.element_size())
            times.append(time.perf_counter() - t)
            mask = _unpack(packed, vocab_size)
            allowed.append(int(mask.sum()))
            assert mask[token], token
            if token != eos:
                guide.advance(token)
        return times, allowed
    return f"outlines-core {version('outlines_core')}", compile_s, run


BITS = 2 ** torch.arange(32, dtype=torch.int64)


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask (bit j of word w is token 32w + j) as a bool [vocab_size]."""
    return ((words.to(torch.int64)[:, None] & BITS) != 0).reshape(-1)[:vocab_size]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = minillm.load_tokenizer("smollm2-135m-instruct")
    vocab_size, eos = 49152, tok.eos_token_id
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {vocab_size} tokens; schema {json.dumps(SCHEMA)}")
    print(f"answer {ANSWER!r}: {len(ids)} tokens + EOS; {args.repeats} repeats; 1 torch thread; "
          "mask = the library filling its packed bitmask over the vocabulary (unpacking it to a bool tensor: below)")
    print(f"{'library':<22} {'compile ms':>10} {'mask us p50':>12} {'mask us p90':>12} {'mask us max':>12}  allowed per step")
    for bench in (bench_xgrammar, bench_llguidance, bench_outlines_core):
        try:
            name, compile_s, run = bench(tok, vocab_size, eos, ids)
        except ImportError as e:
            print(f"{bench.__name__[6:]:<22} not installed ({e})")
            continue
        run()  # warm-up
        per_step, allowed = [[] for _ in ids + [eos]], None
        for _ in range(args.repeats):
            times, allowed = run()
            for step, t in enumerate(times):
                per_step[step].append(t)
        medians = sorted(statistics.median(ts) * 1e6 for ts in per_step)
        p90 = medians[int(0.9 * (len(medians) - 1))]
        print(f"{name:<22} {compile_s * 1e3:>10.1f} {statistics.median(medians):>12.0f} {p90:>12.0f} "
              f"{medians[-1]:>12.0f}  {allowed}")
    print(f"unpacking a packed mask into a bool [{vocab_size}] tensor (minillm's side): {_time_unpack(vocab_size):.0f} us")
    _time_minillm_hook(tok, vocab_size, eos, ids)


def _time_minillm_hook(tok, vocab_size, eos, ids):
    """minillm's whole path per token (minillm.structured.Grammar on llguidance): matcher.allowed()
    (fill + unpack), sample() with the mask, matcher.accept(); against sample() alone. Greedy."""
    from minillm import SamplingParams
    from minillm.sampling import sample
    from minillm.structured import Grammar

    grammar = Grammar.json_schema(SCHEMA, tok, vocab_size=vocab_size, eos_token_ids=[eos])
    logits = torch.randn(1, vocab_size)
    plain, constrained = SamplingParams(), SamplingParams(allowed_tokens=grammar)
    hook, alone = [], []
    for _ in range(10):
        matcher = grammar.matcher()
        for token in ids + [eos]:
            t = time.perf_counter()
            sample(logits, plain)
            alone.append(time.perf_counter() - t)
            t = time.perf_counter()
            sample(logits, constrained, allowed=matcher.allowed())
            matcher.accept(token)
            hook.append(time.perf_counter() - t)
    print(f"minillm per token, greedy: sample() alone {statistics.median(alone) * 1e6:.0f} us; with the grammar "
          f"(allowed() + masked sample() + accept()) {statistics.median(hook) * 1e6:.0f} us")


def _time_unpack(vocab_size):
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        _unpack(words, vocab_size)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    main()
