"""The ``minillm`` command line: argument parsing and rendering only; the work is in the library.

    minillm generate "What is the capital of France?"     stream an answer
    minillm download NAME                                  fetch a model into the weights dir
    minillm convert FILE.gguf OUT_DIR                      GGUF -> Hugging Face folder
    minillm info [MODEL]                                   config, parameters, bytes
    minillm generate "..." --trace [steps|layers]          every phase of the request, in numbers
    minillm sweep --out DIR                                TTFT vs prompt length, TPOT vs context
    minillm calibrate [--device cpu] [--quick]             measure peak FLOP/s and GB/s
    minillm whatif --config llama-3-8b --hardware h100     roofline TTFT / TPOT prediction
    minillm generate --prefix-cache --system "..." Q1 Q2   requests in turn, reusing cached prefixes
    minillm prefix-demo [--requests N] [--plot FILE.png]   TTFT with and without the prefix cache
    minillm bench [--quick] [--json F] [--plot F.png]      minillm vs transformers, no cache, the floors
    minillm check [ex03 ...] [--student-dir DIR ...]       grade the classroom exercises (lessons/exercises)

Exit codes: 0 ok, 1 runtime error (one line), 2 usage error (one line), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import weights
from .errors import MiniLLMError, OutputPathError, check_output_dir


class UsageError(Exception):
    """Bad command-line usage: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage block; one line is kinder
        raise UsageError(f"{message} (see '{self.prog} --help')")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minillm`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.run(args) or 0
    except UsageError as e:
        print(f"minillm: error: {e}", file=sys.stderr)
        return 2
    except (MiniLLMError, ValueError, OSError) as e:
        if debug:
            raise
        print(f"minillm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        fresh_line = "\n" if sys.stderr.isatty() else ""  # a terminal echoed ^C, maybe mid-line of output
        print(f"{fresh_line}minillm: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minillm", description="An educational LLM inference engine in pure PyTorch.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_download(sub)
    _add_convert(sub)
    _add_info(sub)
    _add_sweep(sub)
    _add_calibrate(sub)
    _add_whatif(sub)
    _add_prefix_demo(sub)
    _add_bench(sub)
    _add_check(sub)
    return parser


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=weights.DEFAULT_MODEL,
                   help=f"model name, hub repo id, folder or .gguf file (default: {weights.DEFAULT_MODEL})")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, ~/.cache/minillm)")
    p.add_argument("--device", help="cpu, cuda or mps (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32 (bfloat16 on cuda)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


# -- generate ----------------------------------------------------------------------------


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed token by token")
    p.add_argument("prompt", nargs="*", help="the prompt; '-' or omitted reads stdin; several prompts "
                                              "run one after another (sharing a --prefix-cache)")
    _model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    p.add_argument("--system", help="system message (chat mode)")
    p.add_argument("--trace", nargs="?", const="steps", choices=["steps", "layers"],
                   help="show every phase: prompt tokens, prefill, each step, summary, roofline verdicts "
                        "(layers: also per-layer shapes and times)")
    p.add_argument("--trace-out", metavar="FILE.jsonl", help="write the trace, one JSON event a line (schema: pydoc minillm.trace)")
    p.add_argument("--plots", metavar="DIR", help="with a trace: write timeline, roofline and KV cache PNGs")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="with a trace: skip the warm-up pass (then the first pass pays one-time setup costs)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the K/V of prompt prefixes seen before in this run (automatic prefix caching)")
    p.add_argument("--block-size", type=int, default=16, help="prefix cache block size in tokens (default 16)")
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    from .loading import load_model
    from .prefix_cache import PrefixCache
    from .tokenizer import load_tokenizer

    params = _sampling_params(args)
    prompts = [_read_prompt(p) for p in args.prompt] or [_read_prompt(None)]
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.trace_out:
        _check_out_file("--trace-out", args.trace_out)
    folder = _ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(folder)
    prefix_cache = PrefixCache(model, block_size=args.block_size) if args.prefix_cache else None
    for prompt in prompts:  # one request after another; with --prefix-cache they share cached prefixes
        if args.trace or args.trace_out or args.plots:
            run_generate_traced(args, model, tokenizer, prompt, params, prefix_cache)
        else:
            _generate_one(args, model, tokenizer, prompt, params, prefix_cache)
    return 0


def _generate_one(args, model, tokenizer, prompt: str, params, prefix_cache) -> None:
    """One request: the answer streamed to stdout, the summary line to stderr."""
    from .generate import generate
    from .tokenizer import StreamDecoder

    start = time.perf_counter()
    prompt_ids = _encode_prompt(tokenizer, prompt, args.chat, args.system)
    eos = tokenizer.eos_token_ids | set(model.config.eos_token_ids)
    stream = StreamDecoder(tokenizer)
    steps = []
    for step in generate(model, prompt_ids, params, eos_token_ids=eos, prefix_cache=prefix_cache):
        steps.append(step)
        print(stream.push(step.token_id), end="", flush=True)
    print(stream.flush())
    print(_summary(len(prompt_ids), steps, start), file=sys.stderr)


def _sampling_params(args):
    from .sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as e:  # "top_p must be ..." -> "--top-p must be ...": name the flag the user typed
        name, rest = str(e).split(" ", 1)
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None


def _read_prompt(prompt: str | None) -> str:
    if prompt in (None, "-"):
        if prompt is None and sys.stdin.isatty():
            raise UsageError("give a prompt, or pipe one in on stdin (see 'minillm generate --help')")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _ensure_model(name_or_path: str, weights_dir: str | None):
    """The model folder; a missing known model is downloaded first, with a notice."""
    if weights.is_model_name(name_or_path) and not weights.is_downloaded(name_or_path, weights_dir):
        print(f"minillm: {name_or_path} is not downloaded yet; fetching it into "
              f"{weights.weights_dir(weights_dir)} (once)", file=sys.stderr)
    return weights.resolve_model(name_or_path, weights_dir, download=True)


def _encode_prompt(tokenizer, prompt: str, chat: bool | None, system: str | None) -> list[int]:
    if chat is None:
        chat = tokenizer.has_chat_template
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _summary(n_prompt: int, steps, start: float) -> str:
    ttft_ms = (steps[0].time_s - start) * 1e3
    e2e_s = steps[-1].time_s - start
    tpot = f"{(steps[-1].time_s - steps[0].time_s) * 1e3 / (len(steps) - 1):.1f} ms" if len(steps) > 1 else "n/a"
    cached = f" ({steps[0].cached_tokens} cached)" if steps[0].cached_tokens else ""
    return (f"[prompt {n_prompt} tok{cached} | generated {len(steps)} tok | TTFT {ttft_ms:.1f} ms | TPOT {tpot} | "
            f"{len(steps) / e2e_s:.1f} tok/s | stop: {steps[-1].finish_reason}]")


def run_generate_traced(args, model, tokenizer, prompt: str, params, prefix_cache=None) -> int:
    """generate() with a Trace: the prompt's tokens, the streamed answer, then the trace rendered."""
    from rich.console import Console

    from .generate import generate
    from .hardware import get_hardware
    from .render import print_trace, prompt_panel
    from .sweep import warm_up
    from .tokenizer import StreamDecoder
    from .trace import Trace

    param = next(model.parameters())
    hw = get_hardware(param.device, param.dtype)  # measured once per machine, then cached
    console = Console()
    warmup_ms = warm_up(model, len(_encode_prompt(tokenizer, prompt, args.chat, args.system))) if args.warmup else None
    trace = Trace(args.trace or "steps", tokenizer=tokenizer, hardware=hw)
    if warmup_ms is not None:
        trace.record("warmup", time_ms=warmup_ms)
    with trace.span("tokenize", text=prompt) as event:
        prompt_ids = _encode_prompt(tokenizer, prompt, args.chat, args.system)
    event.update(n_tokens=len(prompt_ids), token_ids=prompt_ids, token_strings=tokenizer.token_strings(prompt_ids))
    if args.trace and prefix_cache is None:  # with a prefix cache: shown after, with the cached tokens marked
        console.print(prompt_panel(trace, plain=console.color_system is None))
    eos = tokenizer.eos_token_ids | set(model.config.eos_token_ids)
    stream, steps, pieces, detok_s = StreamDecoder(tokenizer), [], [], 0.0
    for step in generate(model, prompt_ids, params, eos_token_ids=eos, trace=trace, prefix_cache=prefix_cache):
        steps.append(step)
        t = time.perf_counter()
        pieces.append(stream.push(step.token_id) + (stream.flush() if step.finish_reason else ""))
        detok_s += time.perf_counter() - t
        print(pieces[-1], end="", flush=True)
        if step.finish_reason:
            trace.record("detokenize", time_ms=detok_s * 1e3, n_tokens=len(steps), text="".join(pieces))
    print()
    if args.trace_out:
        trace.to_jsonl(args.trace_out)
    if args.plots:
        from .plots import save_trace_plots

        save_trace_plots(trace, args.plots)
    if args.trace:
        if prefix_cache is not None:
            console.print(_cached_prompt_panel(trace, prefix_cache))
        print_trace(trace, console, prompt=False)
    else:
        print(_summary(len(prompt_ids), steps, trace.start_s), file=sys.stderr)
    return 0


# -- sweep ---------------------------------------------------------------------------------------


def _add_sweep(sub) -> None:
    from .sweep import DEFAULT_CONTEXT_LENGTHS, DEFAULT_PROMPT_LENGTHS

    p = sub.add_parser("sweep", help="measure TTFT vs prompt length and TPOT vs context length; write PNGs")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs, sweep.json and sweep.csv")
    _model_options(p)
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENGTHS), metavar="N")
    p.add_argument("--context-lengths", type=int, nargs="+", default=list(DEFAULT_CONTEXT_LENGTHS), metavar="N")
    p.add_argument("--repeats", type=int, default=3, help="prefills per prompt length (median)")
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps per context length (median)")
    p.set_defaults(run=run_sweep)


def run_sweep(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .hardware import get_hardware
    from .loading import load_model
    from .plots import save_sweep_plots
    from .sweep import sweep

    if min(args.repeats, args.decode_steps) < 1:
        raise UsageError("--repeats and --decode-steps must be >= 1")
    _check_out_dir("--out", args.out)
    model = load_model(_ensure_model(args.model, args.weights_dir), device=args.device, dtype=args.dtype)
    param = next(model.parameters())
    hw = get_hardware(param.device, param.dtype)
    result = sweep(model, args.prompt_lengths, args.context_lengths, args.repeats, args.decode_steps, hw,
                   name=str(args.model))
    paths = save_sweep_plots(result, args.out)
    table = Table("measurement", "tokens", "ms", "roofline floor ms", title=f"sweep of {args.model} on {hw.name}")
    for name, lengths, ms, floors in (("TTFT", result.prompt_lengths, result.ttft_ms, result.ttft_floor_ms),
                                      ("TPOT", result.context_lengths, result.tpot_ms, result.tpot_floor_ms)):
        for n, t, f in zip(lengths, ms, floors):
            table.add_row(name, str(n), f"{t:.1f}", f"{f:.1f}")
    console = Console()
    console.print(table)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _check_out_dir(flag: str, path: str) -> None:
    """A usage error now when the output folder ``path`` could not be written at the end."""
    try:
        check_output_dir(path)
    except OutputPathError as e:
        raise UsageError(f"{flag}: {e}") from None


# -- download, convert, info ----------------------------------------------------------------


def _add_download(sub) -> None:
    p = sub.add_parser("download", help="fetch a model into the weights directory")
    p.add_argument("name", nargs="?", default=weights.DEFAULT_MODEL,
                   help=f"{weights.DEFAULT_MODEL} or a Hugging Face repo id such as gpt2")
    p.add_argument("--weights-dir")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=lambda args: print(weights.download(args.name, args.weights_dir)))


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model folder")
    p.add_argument("gguf_file")
    p.add_argument("out_dir")
    p.add_argument("--debug", action="store_true")

    def run(args):
        _check_out_dir("OUT_DIR", args.out_dir)  # before the gguf import and the dequantizing
        from .gguf_convert import convert_gguf

        print(convert_gguf(args.gguf_file, args.out_dir))

    p.set_defaults(run=run)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="show a model's config, parameter count and memory")
    p.add_argument("model", nargs="?", default=weights.DEFAULT_MODEL)
    p.add_argument("--weights-dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run_info)


def run_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .loading import load_model

    model = load_model(_ensure_model(args.model, args.weights_dir), device="cpu", dtype=args.dtype)
    c = model.config
    dtype_bytes = next(model.parameters()).element_size()
    table = Table(title=f"{args.model} ({args.dtype})", show_header=False)
    rows = [
        ("model_type", c.model_type), ("layers", c.n_layers), ("d_model", c.d_model),
        ("heads / KV heads", f"{c.n_heads} / {c.n_kv_heads} (GQA x{c.n_rep})" if c.n_rep > 1 else c.n_heads),
        ("head_dim", c.head_dim), ("d_mlp", c.d_mlp), ("vocab", c.vocab_size), ("context", c.max_seq_len),
        ("positions", f"RoPE theta={c.rope_theta:g}" if c.uses_rope else "learned"),
        ("tied embeddings", c.tie_word_embeddings),
        ("parameters", f"{model.num_parameters():,}"),
        ("weights bytes", f"{model.weights_bytes():,} ({model.weights_bytes() / 2**20:.1f} MiB)"),
        ("KV bytes per token", f"{c.kv_bytes_per_token(dtype_bytes):,} (2 x {c.n_layers} x {c.n_kv_heads} x "
                               f"{c.head_dim} x {dtype_bytes})"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)
    return 0


# -- calibrate, whatif ---------------------------------------------------------------------


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's peak matmul FLOP/s and memory bandwidth")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--quick", action="store_true", help="smaller, faster measurement (less accurate)")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args) -> int:
    from rich.console import Console

    from .hardware import calibrate, calibration_path

    hw = calibrate(args.device, args.dtype, quick=args.quick)
    Console().print(_hardware_table(hw, f"calibrated {args.device} {args.dtype} (saved to {calibration_path()})"))
    return 0


def _hardware_table(hw, title: str):
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_row("device", hw.name)
    table.add_row("peak matmul", f"{hw.peak_flops / 1e9:,.1f} GFLOP/s")
    table.add_row("memory bandwidth", f"{hw.mem_bandwidth / 1e9:,.1f} GB/s")
    table.add_row("ridge point", f"{hw.ridge_point:,.1f} FLOP/byte")
    table.add_row("how", hw.description)
    return table


def _add_whatif(sub) -> None:
    p = sub.add_parser("whatif", help="predict TTFT and TPOT of a model on some hardware (roofline floors)")
    p.add_argument("--config", required=True, help="config.json path or folder, a downloaded model, or llama-3-8b")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, l4, rtx4090, m2-max, laptop-cpu, "
                                                     "or 'this' (the calibrated local machine)")
    p.add_argument("--device", default="cpu", help="with --hardware this: which device's calibration")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16; with --hardware this, the dtype the model runs in on --device "
                        "(float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run_whatif)


def run_whatif(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .whatif import load_config, predict

    if min(args.prompt_tokens, args.output_tokens, args.batch_size) < 1:
        raise UsageError("--prompt-tokens, --output-tokens and --batch-size must be >= 1")
    args.dtype = args.dtype or _whatif_dtype(args.hardware, args.device)
    hw = _whatif_hardware(args.hardware, args.device, args.dtype)
    config = load_config(args.config)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    w = predict(config, hw, args.prompt_tokens, args.output_tokens, dtype_bytes, args.batch_size)
    table = Table(title=f"{args.config} on {hw.name}, {args.dtype}, batch {w.batch_size} (roofline floors)",
                  show_header=False)
    fits = {True: "fits", False: "does NOT fit", None: "capacity unknown"}[w.fits_in_memory]
    na = "n/a (one output token)"
    rows = [
        ("hardware", str(hw)),
        ("request", f"{w.prompt_tokens} prompt + {w.output_tokens} output tokens"),
        ("weights bytes", f"{w.weights_bytes:,} ({w.weights_bytes / 1e9:.2f} GB)"),
        ("KV bytes per token", f"{w.kv_bytes_per_token:,}"),
        ("KV bytes per request", f"{w.kv_bytes_per_request:,} ({w.kv_bytes_per_request / 1e9:.3f} GB)"),
        ("memory needed", f"{w.memory_bytes_needed / 1e9:.2f} GB ({fits})"),
        ("prefill", f"{w.prefill.flops / 1e12:.3g} TFLOP, {w.prefill.bytes / 1e9:.3g} GB, "
                    f"{w.prefill.arithmetic_intensity:.3g} FLOP/byte: {w.prefill_bound}"),
        ("TTFT", f"{w.ttft_ms:.2f} ms"),
        ("decode", f"{w.decode_first.arithmetic_intensity:.3g} FLOP/byte: {w.decode_bound}"
                   if w.decode_first else na),
        ("TPOT", f"{w.tpot_ms:.3f} ms ({w.output_throughput_tok_s:,.0f} tok/s)" if w.tpot_ms else na),
        ("e2e", f"{w.e2e_ms:.1f} ms"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    return 0


def _whatif_dtype(hardware: str, device: str) -> str:
    """The default --dtype: what load_model picks on this machine's device, bfloat16 on a datasheet GPU."""
    if hardware != "this":
        return "bfloat16"
    from .loading import resolve_device, resolve_dtype

    return str(resolve_dtype(None, resolve_device(device))).removeprefix("torch.")


def _whatif_hardware(name: str, device: str, dtype: str):
    from .hardware import PROFILES, get_hardware, load_calibration

    if name == "this":
        if load_calibration(device, dtype) is None:
            print(f"minillm: no calibration for {device}/{dtype} yet; measuring it now (once)", file=sys.stderr)
        return get_hardware(device, dtype)
    if name not in PROFILES:
        raise UsageError(f"unknown --hardware {name!r}; known: {', '.join(PROFILES)}, this")
    return PROFILES[name]


# -- prefix cache ----------------------------------------------------------------------------


def _cached_prompt_panel(trace, prefix_cache):
    """The prompt with the prefix cache's hit marked, and what the cache did for this request.

    Cached tokens are on green (blocks alternate shades, "|" between blocks); "▶" is where
    the prefill starts. Below: the lookup, hit, insert and evict events, hashes shortened.
    """
    from rich.panel import Panel
    from rich.text import Text

    from .render import visible

    B = prefix_cache.block_size
    pieces = trace.first("tokenize")["token_strings"]
    lookup = trace.first("prefix_lookup") or {}
    cached = lookup.get("cached_tokens", 0)
    text = Text()
    for i, piece in enumerate(pieces):
        if i == cached:
            text.append(" ▶ " if i else "▶ ", style="bold")
        elif i and i % B == 0 and i < cached:
            text.append("|", style="bold green")
        text.append(visible(piece), style=("on dark_green", "on green4")[i // B % 2] if i < cached else None)
    text.append("\n")
    for e in trace.events:
        if e["kind"].startswith("prefix_"):
            fields = ", ".join(f"{k}={_brief(v)}" for k, v in e.items() if k not in ("kind", "t_ms"))
            text.append(f"\n{e['kind']:<14}", style="bold")
            text.append(fields)
    title = (f"Prompt: {len(pieces)} tokens, {cached} from the prefix cache ({cached // B} blocks of {B}), "
             f"{len(pieces) - cached} prefilled")
    st = prefix_cache.stats
    subtitle = (f"prefix cache: {st.blocks} blocks, {st.bytes / 2**20:.1f} MiB, hit rate {100 * st.hit_rate:.1f}% "
                f"over {st.requests} requests, {st.evictions} evictions")
    return Panel(text, title=title, title_align="left", subtitle=subtitle)


def _brief(value) -> str:
    """A list of many block hashes as 'first .. last (n)'."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{value[0]} {value[1]} .. {value[-1]}] ({len(value)})"
    return str(value)


def _add_prefix_demo(sub) -> None:
    p = sub.add_parser("prefix-demo", help="N requests sharing a long system prompt, with and without the prefix cache")
    _model_options(p)
    p.add_argument("--requests", type=int, default=4, help="number of requests (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="prefix cache block size in tokens (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--plot", metavar="FILE.png", help="draw TTFT per request, without and with the cache")
    p.set_defaults(run=run_prefix_demo_cmd)


def run_prefix_demo_cmd(args) -> int:
    if args.plot:
        _check_out_file("--plot", args.plot, ".png")
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .kv_cache import _fmt_bytes
    from .loading import load_model
    from .prefix_demo import plot_prefix_demo, run_prefix_demo
    from .tokenizer import load_tokenizer

    if min(args.requests, args.block_size, args.max_new_tokens) < 1:
        raise UsageError("--requests, --block-size and --max-new-tokens must be >= 1")
    folder = _ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype)
    result = run_prefix_demo(model, load_tokenizer(folder), args.requests, args.block_size, args.max_new_tokens)
    table = Table("req", "prompt", "cached", "prefill", "TTFT ms\nno cache", "TTFT ms\ncache", "speedup",
                  "KV saved", "hit rate", "same\noutput", box=box.SIMPLE_HEAD, padding=0, show_edge=False,
                  title=f"Prefix cache: {result.shared_prefix_tokens} shared prompt tokens, block_size "
                        f"{result.block_size}")
    for r in result.rows:
        table.add_row(str(r.request), str(r.prompt_tokens), str(r.cached_tokens), str(r.prefill_tokens),
                      f"{r.ttft_no_cache_ms:.0f}", f"{r.ttft_cache_ms:.0f}", f"x{r.speedup:.1f}",
                      _fmt_bytes(r.kv_bytes_saved), f"{100 * r.hit_rate:.1f}%", "yes" if r.same_output else "NO")
    console = Console()
    console.print(table)
    s = result.stats
    console.print(f"warm requests: TTFT x{result.warm_speedup:.1f} faster | cache: {s.blocks} blocks, "
                  f"{_fmt_bytes(s.bytes)}, hit rate {100 * s.hit_rate:.1f}% ({s.hit_tokens}/{s.query_tokens} "
                  f"tokens), {s.evictions} evictions")
    if args.plot:
        console.print(f"wrote {plot_prefix_demo(result, args.plot)}")
    return 0



# -- bench ------------------------------------------------------------------------------------


def _add_bench(sub) -> None:
    from .bench import ENGINES

    p = sub.add_parser("bench", help="prefill and decode speed: minillm vs transformers, no cache, the floors")
    _model_options(p)
    p.add_argument("--prompt-lengths", type=int, nargs="+", metavar="N",
                   help="prefill cases, batch 1 (default 128 512 2048)")
    p.add_argument("--context-lengths", type=int, nargs="+", metavar="N",
                   help="decode cases: tokens in the cache (default 128 1024)")
    p.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="decode (default 1 8)")
    p.add_argument("--repeats", type=int, help="runs per case and engine, medians reported (default 3)")
    p.add_argument("--decode-tokens", type=int, help="tokens per decode run (default 16)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES) + ["minillm-compile"],
                   metavar="ENGINE", help=f"which engines to run, each once (default: {' '.join(ENGINES)}; "
                                          "also minillm-compile)")
    p.add_argument("--compile", nargs="?", const="auto", metavar="MODE",
                   help="add minillm-compile: torch.compile of decode_step (mode default on cpu, "
                        "reduce-overhead = CUDA graphs on cuda)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--memory-tokens", type=int,
                   help="peak RSS of generating this many tokens, in a fresh process (0: skip; default 1024)")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="tok/s against length per engine, floors drawn")
    p.add_argument("--markdown", metavar="FILE.md", help="write the tables as markdown")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: prompts 32 128, context 64, batch 1, 1 repeat, 8 tokens, memory 64 tokens "
                        "(options given explicitly still apply)")
    p.set_defaults(run=run_bench_cmd)


BENCH_DEFAULTS = dict(prompt_lengths=[128, 512, 2048], context_lengths=[128, 1024], batch_sizes=[1, 8],
                      repeats=3, decode_tokens=16, memory_tokens=1024)
BENCH_QUICK = dict(prompt_lengths=[32, 128], context_lengths=[64], batch_sizes=[1],
                   repeats=1, decode_tokens=8, memory_tokens=64)


def run_bench_cmd(args) -> int:
    import torch
    from rich.console import Console

    from .bench import rich_table, run_bench, targets_rich_table, to_markdown, validate_bench
    from .loading import load_model

    for name, value in (BENCH_QUICK if args.quick else BENCH_DEFAULTS).items():
        if getattr(args, name) is None:  # an option given explicitly wins over the preset
            setattr(args, name, value)
    _check_bench_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(_ensure_model(args.model, args.weights_dir), device=args.device, dtype=args.dtype)
    try:  # lengths against the model's context: before any work
        validate_bench(model, args.prompt_lengths, args.context_lengths, args.batch_sizes, args.repeats,
                       args.decode_tokens, args.memory_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None
    compile_mode = None
    if args.compile:
        on_cuda = next(model.parameters()).device.type == "cuda"
        compile_mode = ("reduce-overhead" if on_cuda else "default") if args.compile == "auto" else args.compile
    console = Console(stderr=True)
    result = run_bench(model, args.prompt_lengths, args.context_lengths, args.batch_sizes, args.repeats,
                       args.decode_tokens, args.engines, compile_mode, memory_tokens=args.memory_tokens,
                       model_name=str(args.model), progress=lambda line: console.print(f"[dim]bench: {line}[/dim]"))
    out = Console() if sys.stdout.isatty() else Console(width=180)  # piped: don't wrap the 11 columns
    out.print(rich_table(result))
    if targets := targets_rich_table(result):
        out.print(targets)
    for note in result.notes + ([_memory_note(result.memory)] if result.memory else []):
        out.print(f"- {note}")
    for flag, write in (("json", result.to_json), ("markdown", lambda path: _write(path, to_markdown(result)))):
        if getattr(args, flag):
            out.print(f"wrote {write(getattr(args, flag))}")
    if args.plot:
        from .bench import plot

        out.print(f"wrote {plot(result, args.plot)}")
    return 0


COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_bench_args(args) -> None:
    """One-line usage errors for the bench's options, before the model loads."""
    for flag, value, least in (("--repeats", args.repeats, 1), ("--batch-sizes", min(args.batch_sizes), 1),
                               ("--decode-tokens", args.decode_tokens, 2), ("--memory-tokens", args.memory_tokens, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.compile and args.compile not in COMPILE_MODES:
        raise UsageError(f"--compile: unknown mode {args.compile!r}; use one of {', '.join(COMPILE_MODES[1:])}")
    twice = sorted({e for e in args.engines if args.engines.count(e) > 1})
    if twice:
        raise UsageError(f"--engines lists {', '.join(twice)} more than once; name each engine once")
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            _check_out_file(f"--{flag}", getattr(args, flag), ".png" if flag == "plot" else None)


def _check_out_file(flag: str, path: str, suffix: str | None = None) -> None:
    """A usage error now for an output file that could not be written after the work."""
    target = Path(path).expanduser().absolute()
    if suffix and target.suffix.lower() != suffix:
        raise UsageError(f"{flag}: {path} must end in {suffix}")
    if target.is_dir():
        raise UsageError(f"{flag}: {target} is a folder; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"{flag}: folder {target.parent} does not exist; create it or pick another path")


def _memory_note(memory) -> str:
    from .bench import memory_line

    return memory_line(memory)


def _write(path, text: str):
    from pathlib import Path

    Path(path).write_text(text)
    return path


# -- check: the classroom exercises ------------------------------------------------------------


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="grade the classroom exercises (lessons/exercises) with their checks")
    p.add_argument("exercises", nargs="*", metavar="EXERCISE", help="ex01, ex02, ... or 1, 2, ... (default: all)")
    p.add_argument("--student-dir", nargs="+", metavar="DIR",
                   help="a student's copy of lessons/exercises/ (default: the checkout's); several: a class table")
    p.add_argument("-v", "--verbose", action="store_true", help="also show pytest's own output (tracebacks)")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run_check)


def run_check(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from .classroom import exercise_ids, find_checkout, normalize_exercise, run_checks

    root = find_checkout()
    known = exercise_ids(root)
    try:
        wanted = [normalize_exercise(e, known) for e in args.exercises] or known
    except ValueError as e:
        raise UsageError(str(e)) from None
    dirs = [Path(d) for d in args.student_dir] if args.student_dir else [None]
    for d in dirs:
        if d is not None and not d.is_dir():
            raise UsageError(f"--student-dir {d} is not a folder")
    results = {d: run_checks(wanted, d, root, args.verbose) for d in dirs}
    console = Console()
    if len(dirs) == 1:
        where = dirs[0] or root / "lessons" / "exercises"
        _print_exercise_results(console, results[dirs[0]], str(where))
    else:
        console.print(_class_table(results))
    failed = any(r.status == "failed" for rs in results.values() for r in rs)
    return 1 if failed else 0


_STATUS_STYLE = {"passed": "green", "failed": "red", "not attempted": "dim"}


def _print_exercise_results(console, results, where: str) -> None:
    from rich.table import Table

    table = Table(title=f"exercises in {where}")
    for column in ("exercise", "topic", "result", "checks"):
        table.add_column(column)
    for r in results:
        style = _STATUS_STYLE[r.status]
        todo = f" ({r.count('not attempted')} not attempted)" if r.status == "failed" and r.count("not attempted") else ""
        table.add_row(r.id, r.title, f"[{style}]{r.status}[/{style}]", f"{r.count('passed')}/{len(r.checks)} passed{todo}")
    console.print(table)
    for r in results:
        failures: dict[str, list[str]] = {}  # one message, the checks that gave it (a load error fails them all)
        for check in r.checks:
            if check.outcome == "failed":
                failures.setdefault(check.message, []).append(check.name)
        for message, names in failures.items():
            console.print(f"\n[red]FAILED[/red] {r.id} {r.file}: {', '.join(names)}")
            console.print(message, markup=False, highlight=False, soft_wrap=True)
    totals = {s: sum(r.status == s for r in results) for s in _STATUS_STYLE}
    todo = "" if totals["passed"] == len(results) else (
        f" Write them in {where}/exNN_*.py; 'minillm check exNN -v' shows tracebacks.")
    console.print("\n" + ", ".join(f"{n} {s}" for s, n in totals.items()) + f" (of {len(results)} exercises)."
                  + todo, markup=False, soft_wrap=True)


def _class_table(results: dict):
    from rich.table import Table

    ids = [r.id for r in next(iter(results.values()))]
    table = Table(title="class results", caption="+ passed   x failed   . not attempted")
    table.add_column("student")
    for ex_id in ids:
        table.add_column(ex_id, justify="center")
    table.add_column("passed", justify="right")
    marks = {"passed": "[green]+[/green]", "failed": "[red]x[/red]", "not attempted": "[dim].[/dim]"}
    for folder, rs in results.items():
        passed = sum(r.status == "passed" for r in rs)
        table.add_row(folder.name, *(marks[r.status] for r in rs), f"{passed}/{len(rs)}")
    return table


if __name__ == "__main__":
    sys.exit(main())
