"""minillm generate: the answer streamed to stdout; with --trace, every phase of the request."""

from __future__ import annotations

import sys
import time

from ..units import fmt_bytes
from .common import UsageError, check_out_file, ensure_model, model_options


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed token by token")
    p.add_argument("prompt", nargs="*", help="the prompt; '-' or omitted reads stdin; several prompts "
                                              "run one after another (sharing a --prefix-cache)")
    model_options(p)
    _sampling_options(p)
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


def _sampling_options(p) -> None:
    """The SamplingParams knobs (vLLM's names). Unset ones take the checkpoint's
    generation_config.json default, else minillm's (see 'minillm info')."""
    g = p.add_argument_group("sampling and stopping (default: the model's generation_config.json, else the value shown)")
    g.add_argument("--max-new-tokens", type=int, help="most tokens to generate (256)")
    g.add_argument("--temperature", type=float, help="0 = greedy (0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="keep the smallest set reaching this probability mass (1 = off)")
    g.add_argument("--min-p", type=float, help="keep tokens with at least this fraction of the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float,
                   help="> 1 discourages tokens of the prompt and output: logit / p if positive, * p if not (1 = off)")
    g.add_argument("--presence-penalty", type=float, help="subtracted from the logit of each output token so far (0)")
    g.add_argument("--frequency-penalty", type=float, help="subtracted once per occurrence in the output so far (0)")
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the answer before this text (never printed); repeat for several")


_SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop")
_SAMPLE_ONLY_FLAGS = ("top_k", "top_p", "min_p", "seed")  # no effect on greedy decoding


def run_generate(args) -> int:
    from ..loading import load_model
    from ..prefix_cache import PrefixCache
    from ..tokenizer import load_tokenizer

    _sampling_params(args)  # bad values are usage errors before the model loads
    prompts = [_read_prompt(p) for p in args.prompt] or [_read_prompt(None)]
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.trace_out:
        check_out_file("--trace-out", args.trace_out)
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(folder)
    params = _sampling_params(args, model.generation_config)
    prefix_cache = PrefixCache(model, block_size=args.block_size) if args.prefix_cache else None
    for prompt in prompts:  # one request after another; with --prefix-cache they share cached prefixes
        if args.trace or args.trace_out or args.plots:
            run_generate_traced(args, model, tokenizer, prompt, params, prefix_cache)
        else:
            _generate_one(args, model, tokenizer, prompt, params, prefix_cache)
    return 0


def _generate_one(args, model, tokenizer, prompt: str, params, prefix_cache) -> None:
    """One request: the answer streamed to stdout, the summary line to stderr."""
    from ..generate import generate

    start = time.perf_counter()
    prompt_ids = _encode_prompt(tokenizer, prompt, args.chat, args.system)
    steps = []
    for step in generate(model, prompt_ids, params, eos_token_ids=_eos_ids(model, tokenizer),
                         prefix_cache=prefix_cache, tokenizer=tokenizer):
        steps.append(step)
        print(step.text, end="", flush=True)  # stop strings held back and never printed
    print()
    print(_summary(len(prompt_ids), steps, start), file=sys.stderr)


def _sampling_params(args, generation_config=None):
    """The flags the user set over the checkpoint's defaults; warns (stderr, one line) about
    sampling flags that greedy decoding ignores, as transformers does."""
    from ..generation_config import GenerationConfig

    user_set = {name: getattr(args, name, None) for name in _SAMPLING_FLAGS}  # a command may have only some flags
    user_set = {name: value for name, value in user_set.items() if value is not None}
    try:
        params = (generation_config or GenerationConfig()).sampling_params(**user_set)
    except ValueError as e:  # "top_p must be ..." -> "--top-p must be ...": name the flag the user typed
        name, rest = str(e).split(" ", 1)
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None
    ignored = [f"--{name.replace('_', '-')}" for name in _SAMPLE_ONLY_FLAGS if name in user_set]
    if generation_config is not None and params.greedy and ignored:
        print(f"minillm: warning: {', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect: "
              f"temperature {params.temperature:g} is greedy decoding; set --temperature > 0 to sample",
              file=sys.stderr)
    return params


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS and the checkpoint's (generation_config.json's, else config.json's)."""
    return tokenizer.eos_token_ids | set(model.generation_config.eos_token_ids)


def _read_prompt(prompt: str | None) -> str:
    if prompt in (None, "-"):
        if prompt is None and sys.stdin.isatty():
            raise UsageError("give a prompt, or pipe one in on stdin (see 'minillm generate --help')")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


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

    from ..generate import generate
    from ..hardware import get_hardware
    from ..render import print_trace, prompt_panel
    from ..sweep import warm_up
    from ..trace import Trace

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
    steps = []
    for step in generate(model, prompt_ids, params, eos_token_ids=_eos_ids(model, tokenizer), trace=trace,
                         prefix_cache=prefix_cache, tokenizer=tokenizer):  # records "detokenize" at the end
        steps.append(step)
        print(step.text, end="", flush=True)
    print()
    if args.trace_out:
        trace.to_jsonl(args.trace_out)
    if args.plots:
        from ..plots import save_trace_plots

        save_trace_plots(trace, args.plots)
    if args.trace:
        if prefix_cache is not None:
            console.print(_cached_prompt_panel(trace, prefix_cache))
        print_trace(trace, console, prompt=False)
    else:
        print(_summary(len(prompt_ids), steps, trace.start_s), file=sys.stderr)
    return 0


def _cached_prompt_panel(trace, prefix_cache):
    """The prompt with the prefix cache's hit marked, and what the cache did for this request.

    Cached tokens are on green (blocks alternate shades, "|" between blocks); "▶" is where
    the prefill starts. Below: the lookup, hit, insert and evict events, hashes shortened.
    """
    from rich.panel import Panel
    from rich.text import Text

    from ..render import visible

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
    subtitle = (f"prefix cache: {st.blocks} blocks, {fmt_bytes(st.bytes)}, hit rate {100 * st.hit_rate:.1f}% "
                f"over {st.requests} requests, {st.evictions} evictions")
    return Panel(text, title=title, title_align="left", subtitle=subtitle)


def _brief(value) -> str:
    """A list of many block hashes as 'first .. last (n)'."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{value[0]} {value[1]} .. {value[-1]}] ({len(value)})"
    return str(value)
