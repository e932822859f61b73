"""Small random-weight Hugging Face models saved to disk: the oracle for logits tests.

Each config exercises one feature (GQA, MQA, tied/untied embeddings, RoPE scaling,
an explicit head_dim, Qwen2's q/k/v biases, Qwen3's QK-norm). Weights get extra noise so that norm weights and biases are
not their trivial init values (a loader that skipped them would then pass).
"""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-5,
)

CONFIGS = {
    "gpt2": ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128)),
    "llama_gqa": ("llama", dict(LLAMA_BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_mqa_tied": ("llama", dict(LLAMA_BASE, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_scaling": ("llama", dict(LLAMA_BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_linear_scaling": ("llama", dict(LLAMA_BASE, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama_head_dim": ("llama", dict(LLAMA_BASE, head_dim=24)),
    "mistral": ("mistral", dict(LLAMA_BASE, sliding_window=None)),
    "qwen2": ("qwen2", dict(LLAMA_BASE)),  # biases on q, k, v
    "qwen2_tied": ("qwen2", dict(LLAMA_BASE, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(LLAMA_BASE, head_dim=24)),  # QK-norm, head_dim != hidden / heads
    "qwen3_bias": ("qwen3", dict(LLAMA_BASE, head_dim=16, attention_bias=True)),
}

# GPT-2 small's real shape (124M parameters), random weights.
GPT2_124M = ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))


def build_hf(family: str, kwargs: dict, seed: int = 0):
    """A random-weight transformers model in float32 eval mode, eager attention."""
    import transformers as tf

    classes = {
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs, attn_implementation="eager"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.float().eval()


def save_hf(model, folder: Path, **save_kwargs) -> Path:
    model.save_pretrained(folder, **save_kwargs)
    return folder
