#!/usr/bin/env python
# Run: python benchmarks/speculative_vs_plain.py THREADS   (the BENCHMARKS.md "Speculative decoding" rows)
"""Plain vs ngram (k=5) greedy on SmolLM2-135M-Instruct, one process, warm; decode tok/s = (n-1)/(t_last - t_first)."""
import sys, time, torch
from minillm import SpeculativeConfig, generate, load_model, load_tokenizer, SamplingParams
from minillm.speculative import SpeculativeStats
torch.set_num_threads(int(sys.argv[1]))
model, tok = load_model("smollm2-135m-instruct", device="cpu"), load_tokenizer("smollm2-135m-instruct")
eos = tok.eos_token_ids | set(model.generation_config.eos_token_ids)
prompts = {
 "grounded": "Repeat exactly: The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
             "and the clocks were striking thirteen.",
 "free": "Write a short story about a robot who learns to paint.",
}
params = SamplingParams(max_new_tokens=96)
list(generate(model, tok.encode("warm up"), SamplingParams(max_new_tokens=4)))
for name, text in prompts.items():
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    res = {}
    for label, spec in (("plain", None), ("ngram k=5", SpeculativeConfig("ngram", 5))):
        steps = list(generate(model, ids, params, eos_token_ids=eos, speculative=spec))
        n, dt = len(steps), steps[-1].time_s - steps[0].time_s
        res[label] = ([s.token_id for s in steps], (n - 1) / dt)
        extra = ""
        if spec:
            st = SpeculativeStats.from_steps(steps)
            extra = (f" | acceptance {100 * st.acceptance_rate:.1f}% ({st.num_accepted_tokens}/{st.num_draft_tokens}),"
                     f" mean acceptance length {st.mean_acceptance_length:.2f}, {1 + sum(s.proposed is not None for s in steps)} passes")
        print(f"{name} {label}: {n} tok, decode {(n - 1) / dt:.1f} tok/s{extra}", flush=True)
    print(f"{name}: identical greedy output {res['plain'][0] == res['ngram k=5'][0]}, "
          f"speedup {res['ngram k=5'][1] / res['plain'][1]:.2f}x", flush=True)
