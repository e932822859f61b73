"""The "families side by side" table of lesson 03: what each model family adds to the transformer,
and what its real config costs per token, from minillm's own cost model (minillm/costs.py).

    python benchmarks/families_table.py

No model runs: every number is a formula over the shipped config.json (minillm/configs/).
KV bytes and weights in bfloat16 (2 bytes); FLOPs per token = 2 · matmul parameters +
4 · layers · heads · head_dim · context (costs.flops_per_token).
"""

from minillm.costs import flops_per_token, kv_bytes_per_token, matmul_params
from minillm.whatif import load_config

# (shipped config, family, what the family adds to the one before it)
FAMILIES = [
    ("gpt2-124m", "GPT-2", "learned positions, LayerNorm, GELU MLP, biases everywhere"),
    ("llama-3-8b", "Llama", "RoPE, RMSNorm, SwiGLU MLP, GQA, no biases"),
    ("mistral-7b", "Mistral", "Llama's layer; a 4,096-token sliding window in its config"),
    ("qwen2.5-0.5b", "Qwen2", "Llama's layer + biases on q, k, v; tied embeddings"),
    ("qwen3-0.6b", "Qwen3", "Llama's layer + QK-norm; head_dim 128 > hidden/heads"),
]
CONTEXTS = (1, 1024, 4096)


def _flops(config, context: int) -> str:
    """GFLOP of one token attending to ``context`` keys, and the share attention takes of it."""
    if context > config.max_seq_len:
        return f"n/a (context {config.max_seq_len:,})"
    flops = flops_per_token(config, context)
    return f"{flops / 1e9:.2f} ({1 - 2 * matmul_params(config) / flops:.0%} attention)"


def main() -> None:
    columns = " | ".join(f"GFLOP/token at context {n:,}" for n in CONTEXTS)
    print(f"| family (config) | adds | KV heads × head_dim | KV bytes/token (bf16) | matmul params | {columns} |")
    print("|---" * (5 + len(CONTEXTS)) + "|")
    for name, family, adds in FAMILIES:
        c = load_config(name)
        flops = " | ".join(_flops(c, n) for n in CONTEXTS)
        print(f"| {family} (`{name}`) | {adds} | {c.n_kv_heads} × {c.head_dim} "
              f"| {kv_bytes_per_token(c, 2) / 1024:,.0f} KiB | {matmul_params(c) / 1e6:,.0f} M | {flops} |")


if __name__ == "__main__":
    main()
