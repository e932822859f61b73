#!/usr/bin/env python
# Run: python benchmarks/speculative_vs_plain.py [THREADS] [--transformers] [--repeats N]
#      (the BENCHMARKS.md "Speculative decoding" rows; THREADS default 1)
"""Plain vs prompt-lookup (ngram) greedy decoding on SmolLM2-135M-Instruct, one process, warm.

For each prompt: minillm plain, ngram k=5 with a constant k and 1-token matches (as first built),
and the defaults (heuristic schedule, matches of 2..3 tokens) up to k=5 and up to k=10; with --transformers, the same weights through transformers' generate()
plain and with prompt_lookup_num_tokens=5 and 10 (its max_matching_ngram_size default, 2).
Decode tok/s = (tokens - 1) / (last token time - first token time) for both engines
(transformers' times from a streamer), best of --repeats runs; the speedup is speculative / plain
of the same engine. "CPU x" is the same ratio from this process's CPU time over the whole request
(prefill included, time.process_time): on a machine shared with other jobs it leaves out the waits
for a core, so it stays readable when the wall-clock ratio does not (1 thread only).
"""
import argparse
import os
import time

import torch

from minillm import SamplingParams, SpeculativeConfig, generate, load_model, load_tokenizer
from minillm.speculative import SpeculativeStats

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''
PROMPTS = {
    "repeat": "Repeat exactly: The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
              "and the clocks were striking thirteen.",
    "edit code": "Rename the variable `total` to `acc` in this code and give the whole code back:\n\n" + CODE,
    "free": "Write a short story about a robot who learns to paint.",
}
MAX_NEW_TOKENS = 128
SPECULATIVE = {  # the first: before the schedule and the 2-token minimum match (BENCHMARKS.md's earlier rows)
    "ngram k=5 constant, lookup 1..3": SpeculativeConfig("ngram", 5, num_speculative_tokens_schedule="constant",
                                                         prompt_lookup_min=1),
    "ngram k<=5 heuristic, lookup 2..3 (default)": SpeculativeConfig("ngram", 5),
    "ngram k<=10 heuristic, lookup 2..3": SpeculativeConfig("ngram", 10)}
HF_LOOKUP = (5, 10)


def decode_tok_s(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def run_minillm(model, ids, eos, spec, repeats):
    """(token ids, best decode tok/s, least CPU s, the stats line) of greedy generate with ``spec``."""
    best, cpu_s, steps = 0.0, float("inf"), []
    for _ in range(repeats):
        start = time.process_time()
        steps = list(generate(model, ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), eos_token_ids=eos,
                              speculative=spec))
        cpu_s = min(cpu_s, time.process_time() - start)
        best = max(best, decode_tok_s([s.time_s for s in steps]))
    note = ""
    if spec is not None:
        st, passes = SpeculativeStats.from_steps(steps), 1 + sum(s.proposed is not None for s in steps)
        note = (f"acceptance {100 * st.acceptance_rate:.1f}% ({st.num_accepted_tokens}/{st.num_draft_tokens}), "
                f"mean acceptance length {st.mean_acceptance_length:.2f}, {passes} passes")
    return [s.token_id for s in steps], best, cpu_s, note


class _Times:
    """A transformers streamer that stamps each arrival of new tokens (the first put() is the prompt)."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        now = time.perf_counter()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times += [now] * value.numel()

    def end(self):
        pass


def run_transformers(hf, ids, lookup, repeats):
    """(token ids, best decode tok/s, least CPU s) of transformers' greedy generate, plain or prompt lookup."""
    best, cpu_s, out = 0.0, float("inf"), None
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    for _ in range(repeats):
        streamer, start = _Times(), time.process_time()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                              pad_token_id=hf.config.eos_token_id, streamer=streamer, **kwargs)
        cpu_s = min(cpu_s, time.process_time() - start)
        best = max(best, decode_tok_s(streamer.times))
    return out[0, len(ids):].tolist(), best, cpu_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("threads", nargs="?", type=int, default=1)
    parser.add_argument("--transformers", action="store_true", help="also transformers' prompt lookup, side by side")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration; the best is kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m-instruct", device="cpu"), load_tokenizer("smollm2-135m-instruct")
    eos = tok.eos_token_ids | set(model.generation_config.eos_token_ids)
    hf = None
    if args.transformers:
        from transformers import AutoModelForCausalLM

        folder = os.path.join(os.environ.get("MINILLM_WEIGHTS", os.path.expanduser("~/.cache/minillm")),
                              "smollm2-135m-instruct")
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    list(generate(model, tok.encode("warm up"), SamplingParams(max_new_tokens=4)))
    print(f"threads {args.threads}, max_new_tokens {MAX_NEW_TOKENS}, best of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for name, text in PROMPTS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        plain_ids, plain, plain_cpu, _ = run_minillm(model, ids, eos, None, args.repeats)
        print(f"{name}: minillm plain: {len(plain_ids)} tok, decode {plain:.1f} tok/s, {plain_cpu:.1f} s CPU",
              flush=True)
        for label, spec in SPECULATIVE.items():
            spec_ids, rate, cpu_s, note = run_minillm(model, ids, eos, spec, args.repeats)
            print(f"{name}: minillm {label}: decode {rate:.1f} tok/s, speedup x{rate / plain:.2f}, "
                  f"CPU x{plain_cpu / cpu_s:.2f}, same greedy output {spec_ids == plain_ids} | {note}", flush=True)
        if hf is not None:
            hf_plain_ids, hf_plain, hf_plain_cpu = run_transformers(hf, ids, None, args.repeats)
            print(f"{name}: transformers plain: {len(hf_plain_ids)} tok, decode {hf_plain:.1f} tok/s, "
                  f"{hf_plain_cpu:.1f} s CPU (same tokens as minillm plain {hf_plain_ids == plain_ids})", flush=True)
            for lookup in HF_LOOKUP:
                hf_ids, hf_rate, hf_cpu = run_transformers(hf, ids, lookup, args.repeats)
                print(f"{name}: transformers prompt_lookup_num_tokens={lookup}: decode {hf_rate:.1f} tok/s, speedup "
                      f"x{hf_rate / hf_plain:.2f}, CPU x{hf_plain_cpu / hf_cpu:.2f}, same greedy output "
                      f"{hf_ids == hf_plain_ids}", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
