"""minillm download, convert, info: getting a model and looking inside it."""

from __future__ import annotations

from ..fast import C_KERNELS_FIT, SWAPS
from ..formats import weights
from ..units import fmt_bytes
from .common import (check_out_dir, chosen_model, dtype_option, ensure_model, fast_option, model_argument,
                     quantize_option)


def add_download(sub) -> None:
    p = sub.add_parser("download", help="fetch a model into the weights directory")
    model_argument(p, f"{weights.DEFAULT_MODEL} or a Hugging Face repo id such as gpt2")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, "
                                         "~/.cache/minillm)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    p.set_defaults(run=lambda args: print(weights.download(chosen_model(args), args.weights_dir)))


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model folder")
    p.add_argument("gguf_file")
    p.add_argument("out_dir")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")

    def run(args):
        check_out_dir("OUT_DIR", args.out_dir)  # before the gguf import and the dequantizing
        from ..formats.gguf_convert import convert_gguf

        print(convert_gguf(args.gguf_file, args.out_dir))

    p.set_defaults(run=run)


def add_info(sub) -> None:
    p = sub.add_parser("info", help="show a model's config, parameter count and memory")
    model_argument(p, "model name, hub repo id, folder or .gguf file")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, "
                                         "~/.cache/minillm)")
    dtype_option(p, default="float32", help="the dtype the bytes are counted in")
    quantize_option(p)
    fast_option(p)
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    p.set_defaults(run=run_info)


def run_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..loading import load_model

    args.model = chosen_model(args)
    model = load_model(ensure_model(args.model, args.weights_dir), device="cpu", dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    c = model.config
    dtype_bytes = next(model.parameters()).element_size()
    weights = f", {args.quantize} weights" if args.quantize else ""
    table = Table(title=f"{args.model} ({args.dtype}{weights})", show_header=False)
    rows = [
        ("model_type", c.model_type), ("layers", c.n_layers), ("d_model", c.d_model),
        ("heads / KV heads", f"{c.n_heads} / {c.n_kv_heads} (GQA x{c.n_rep})" if c.n_rep > 1 else c.n_heads),
        ("head_dim", c.head_dim), ("d_mlp", c.d_mlp), ("vocab", c.vocab_size), ("context", c.max_seq_len),
        *family_rows(c),
        ("tied embeddings", c.tie_word_embeddings),
        ("parameters", f"{model.num_parameters():,}"),
        ("weights bytes", f"{model.weights_bytes():,} ({fmt_bytes(model.weights_bytes())})"),
        *_quantization_rows(model),
        ("KV bytes per token", f"{c.kv_bytes_per_token(dtype_bytes):,} (2 x {c.n_layers} x {c.n_kv_heads} x "
                               f"{c.head_dim} x {dtype_bytes})"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)
    folder = ensure_model(args.model, args.weights_dir)
    if gguf_table := _gguf_source_table(args.model, args.weights_dir, folder, c.tie_word_embeddings):
        Console().print(gguf_table)
    Console().print(_generation_table(model.generation_config))
    Console().print(swap_table(getattr(model, "decode_path", None)))
    return 0


def swap_table(decode_path: str | None):
    """The speed layer's swap table (minillm.fast.SWAPS): each course piece, the fast piece put in its place,
    and when; the title names the model's decode path (None: --no-fast, the course's pieces only), the caption
    (with a decode path) whether this CPU's matrix units run bfloat16 and quantised products."""
    from rich.table import Table

    from ..fast import kernels

    got = f"this model: decode path {decode_path}" if decode_path else "this model: none, --no-fast"
    yes = {True: "yes", False: "no"}
    here = (f" AMX matrix units on this CPU for bfloat16 products: {yes[kernels.bf16_amx_ready()]}, for int8 and int4: "
            f"{yes[kernels.quantized_amx_ready()]}." if decode_path else "")
    table = Table("course piece", "fast piece", "when", title=f"the speed layer's swaps ({got})",
                  caption=f"C kernels fit: {C_KERNELS_FIT}.{here} The table: minillm/fast/__init__.py")
    for swap in SWAPS:  # "model.Block" -> "Block"; PyTorch's own keeps "nn."
        course = swap.course.removeprefix("torch.") if swap.course.startswith("torch.") else swap.course.rpartition(".")[2]
        table.add_row(course, swap.fast.rpartition(".")[2], swap.when)
    return table


def family_rows(c) -> list[tuple[str, str]]:
    """What the family adds to the plain transformer layer: positions (RoPE variant), biases,
    QK-norm and the attention window, as (name, value) rows."""
    rope = ("learned" if not c.uses_rope else f"RoPE theta={c.rope_theta:g}" + (
        f", {c.rope_scaling.rope_type} scaling x{c.rope_scaling.factor:g}" if c.rope_scaling else ""))
    biased = [name for name, on in (("q, k, v", c.qkv_bias), ("o", c.o_bias), ("MLP", c.mlp_bias)) if on]
    return [
        ("positions", rope),
        ("biases", ", ".join(biased) if biased else "none"),
        ("QK-norm", "RMSNorm on each q and k head, before RoPE" if c.qk_norm else "no"),
        ("attention window", _window_text(c)),
    ]


def _window_text(c) -> str:
    """Which layers see only the last W positions (sliding window), or "full"."""
    layers = [layer for layer in range(c.n_layers) if c.window(layer) is not None]
    if not layers:
        return "full: each query sees every earlier position"
    which = "every layer" if len(layers) == c.n_layers else f"layers {', '.join(map(str, layers))}"
    return f"sliding window of {c.sliding_window}: each query sees the last {c.sliding_window} positions ({which})"


def _quantization_rows(model) -> list[tuple[str, str]]:
    """What --quantize changed: the format, and the float embedding a tied head keeps beside its copy."""
    if not getattr(model, "quantization", None):
        return []
    rows = [("quantization", f"{model.quantization} matrices, float embedding")]
    if model.config.tie_word_embeddings:  # the head reads its quantised copy; the lookup, one row of the table
        embed = model.embed.weight
        rows.append(("+ float embedding", f"{fmt_bytes(embed.numel() * embed.element_size())} (lookup only)"))
    return rows


def _generation_table(generation_config):
    """The stop ids and sampling defaults 'minillm generate' starts from, and where each came from."""
    from rich.table import Table

    table = Table("setting", "value", "from", title="generation defaults (flags override them)")
    for name, value, source in generation_config.describe():
        table.add_row(name, str(value), source)
    if generation_config.ignored:
        table.add_row("not used by minillm", ", ".join(generation_config.ignored), "generation_config.json")
    return table


def _gguf_source_table(model_name: str, weights_dir, folder, tied: bool):
    """How the GGUF the model was converted from stores its tensors, and what the float32 copy
    is worth; None for a model that did not come from a GGUF on disk."""
    from rich.table import Table

    gguf_path = weights.source_gguf(model_name, weights_dir)
    if gguf_path is None:
        return None
    float32_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    table = Table("GGUF type", "tensors", "parameters", "which", title=(
        f"converted from {gguf_path.name} ({fmt_bytes(gguf_path.stat().st_size)}), "
        f"dequantised to float32 ({fmt_bytes(float32_bytes)})"), caption=(
        "The float32 file is bigger but holds only the quantised model's information: its logits equal "
        "transformers loading this GGUF, not the original bf16 checkpoint's."))
    for t in weights.gguf_tensor_types(gguf_path):
        which = ", ".join(t.kinds) + (" (also the output head: tied)" if tied and "token_embd" in t.kinds else "")
        table.add_row(t.type, str(t.n_tensors), f"{t.n_params:,}", which)
    return table
