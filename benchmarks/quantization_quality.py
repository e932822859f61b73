"""What int8 and int4 weights cost in quality, against float32, on a fixed public-domain text (issue 16).

    python benchmarks/quantization_quality.py [--model NAME] [--chunk 256] [--threads N]

The text is tests/data/coriolanus_act1.txt (Shakespeare, public domain; source in tests/data/README.md).
Each model (float32, bfloat16, int8 and int4 quantised from float32) reads it in chunks through its
KV cache, so every position sees the whole text before it. Per format, printed:

- perplexity: exp(mean negative log-likelihood of each next token), lower is better;
- top-1 agreement: share of positions whose argmax equals float32's;
- KL(float32 || format): mean over positions of Σ p32 · (log p32 - log p), in nats;
- the greedy answer (chat template, 24 tokens) to the README's question.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm import KVCache, SamplingParams, generate, load_model, load_tokenizer
from minillm.formats.weights import DEFAULT_MODEL

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "coriolanus_act1.txt"
QUESTION = "What is the capital of France?"
FORMATS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None),
           "int8": ("float32", "int8"), "int4": ("float32", "int4")}


def log_probs_by_chunk(model, ids: torch.Tensor, chunk: int):
    """Yield log-softmax [n, vocab] float32 of each chunk's positions, reading ids [1, T] in order."""
    cache = KVCache.for_model(model, max_seq_len=ids.shape[1])
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], cache)[0]
        yield F.log_softmax(logits.float(), dim=-1)


def greedy_answer(model, tokenizer) -> str:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    steps = generate(model, ids, SamplingParams(temperature=0.0, max_tokens=24))
    return tokenizer.decode([s.token_id for s in steps]).strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    ids = torch.tensor([tokenizer.encode(TEXT.read_text())])
    targets = ids[0, 1:]
    models = {name: load_model(args.model, device="cpu", dtype=dtype, quantize=q) for name, (dtype, q) in FORMATS.items()}
    streams = {name: log_probs_by_chunk(m, ids, args.chunk) for name, m in models.items()}
    nll = {name: 0.0 for name in models}
    agree = {name: 0 for name in models}
    kl = {name: 0.0 for name in models}
    done = 0
    for chunks in zip(*streams.values()):
        lp = dict(zip(streams, chunks))
        n = min(len(lp["float32"]), len(targets) - done)  # the last position has no next token
        ref = lp["float32"][:n]
        for name, logp in lp.items():
            logp = logp[:n]
            nll[name] -= logp.gather(1, targets[done:done + n, None]).sum().item()
            agree[name] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            kl[name] += (ref.exp() * (ref - logp)).sum().item()
        done += n
    print(f"{args.model} on {TEXT.name}: {ids.shape[1]} tokens, {done} next-token predictions, chunks of {args.chunk}")
    print(f"{'weights':9} {'MB read':>8} {'perplexity':>11} {'top-1 = fp32':>13} {'KL vs fp32':>11}  greedy answer")
    for name, model in models.items():
        answer = greedy_answer(model, tokenizer).replace("\n", " ")
        print(f"{name:9} {model.weights_bytes() / 1e6:8.1f} {torch.tensor(nll[name] / done).exp().item():11.3f} "
              f"{100 * agree[name] / done:12.1f}% {kl[name] / done:11.5f}  {answer!r}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
