"""minillm chat: a multi-turn conversation whose KV cache survives between turns.

Each answer streams to stdout; after it, stderr says what the turn cost, e.g.
``[412 tokens reused, 23 prefilled | generated 31 tok | TTFT 96.1 ms | ...]``: only the
new turn is prefilled (see :mod:`minillm.chat`). Lines come from a rich prompt on a
terminal, or one message per line from a pipe (``printf 'Hi\\n/reset\\n' | minillm chat``).

``--kv-offload-dir DIR`` keeps the conversation across runs: DIR/conversation.json after every line,
the cache's blocks in the serving engine's disk tier under DIR; the next run in DIR resumes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .common import (UsageError, busy_note_now, chat_template_kwargs, check_out_dir, ensure_model, model_options,
                     sampling_options, sampling_params, thinking_option, thread_governor,
                     warn_if_template_ignores_thinking)

CONVERSATION_FILE = "conversation.json"  # in --kv-offload-dir, beside the disk tier's folder of blocks
COMMANDS = {
    "/reset": "forget the conversation and empty the KV cache (the system message stays); saved so in "
              "--kv-offload-dir too",
    "/system TEXT": "set the system message (/system alone shows it)",
    "/trace": "show the trace of each answer (prefill, decode steps, roofline); again to stop",
    "/history": "show the conversation and the KV cache",
    "/exit": "leave (so does Ctrl-D)",
}


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat in turns; the KV cache is kept, so each turn prefills only its new tokens")
    model_options(p)
    p.add_argument("--system", help="system message (default: none)")
    thinking_option(p)
    p.add_argument("--max-context", type=int, help="KV cache positions for the whole conversation "
                                                   "(default: min(model context, 2048)); full: old turns are dropped")
    p.add_argument("--kv-offload-dir", metavar="DIR",
                   help="keep the conversation in the folder DIR (created if missing): the messages in "
                        f"DIR/{CONVERSATION_FILE} after every line, the KV cache's full blocks in a disk tier "
                        "there (serve's --kv-offload-dir); started again with the same DIR, the chat resumes and "
                        "its first turn prefills only the new message (/reset starts over; default: off)")
    sampling_options(p)
    p.set_defaults(run=run_chat)


def run_chat(args) -> int:
    from rich.console import Console

    from ..chat import ChatSession
    from ..loading import load_model
    from ..tokenizer import load_tokenizer

    sampling_params(args)  # bad values are usage errors before the model loads
    if args.max_context is not None and args.max_context < 1:
        raise UsageError(f"--max-context must be >= 1, got {args.max_context}")
    if args.kv_offload_dir is not None:
        check_out_dir("--kv-offload-dir", args.kv_offload_dir)
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    if args.max_context is not None and args.max_context > model.config.max_seq_len:
        raise UsageError(f"--max-context must be at most {model.config.max_seq_len} (the model's context), "
                         f"got {args.max_context}")
    params = sampling_params(args, model.generation_config)  # unset flags: the checkpoint's defaults
    tokenizer = load_tokenizer(folder)
    warn_if_template_ignores_thinking(args, tokenizer)
    store = _disk_tier(args.kv_offload_dir, model) if args.kv_offload_dir is not None else None
    session = ChatSession(model, tokenizer, args.system, params, args.max_context,
                          chat_template_kwargs(args), kv_store=store)
    governor = thread_governor(model)
    if args.max_context is not None:
        _check_room(session)
    interactive = sys.stdin.isatty()
    status = Console(stderr=True, highlight=False, soft_wrap=True)  # a stats line stays one line in a log
    saved = Path(args.kv_offload_dir) / CONVERSATION_FILE if args.kv_offload_dir is not None else None
    if saved is not None and saved.exists():
        _resume(session, saved, args.system, status)
    if interactive:
        _enable_line_history()
        status.print(f"chatting with {args.model}, a context of {session.max_context} tokens; "
                     "/help lists the commands, Ctrl-D leaves", style="dim")
    state = {"trace": False}
    while (line := _read_line(interactive, status)) is not None:
        line = line.strip()
        if line.startswith("/"):
            if _command(line, session, state, status) == "exit":
                break
        elif line:
            _turn(session, line, state["trace"], status, governor)
        if saved is not None:
            session.save(saved)
    return 0


def _disk_tier(folder: str, model):
    """The serving engine's disk tier in ``folder``, as the chat's block store (its blocks' size: the chat's)."""
    from ..chat import BLOCK_SIZE
    from ..serving.kv_tiers import DiskTier

    return DiskTier.for_model(folder, model, block_size=BLOCK_SIZE)  # creates the folder


def _resume(session, saved: Path, system: str | None, status) -> None:
    """Continue the conversation saved in ``saved`` (a --system given now replaces its system message)."""
    loaded = session.resume(saved)
    if system is not None:
        session.set_system(system)
    if not any(m["role"] != "system" for m in session.messages):  # saved after /reset: nothing to resume
        return
    status.print(f"resumed the conversation in {saved.parent}: {len(session.messages)} messages, {loaded} tokens "
                 "of KV cache loaded from disk (/reset starts over)", style="dim", markup=False)


def _check_room(session) -> None:
    """A usage error now when --max-context cannot hold even the shortest turn: every message would be refused."""
    shortest = len(session.prompt_ids(session.messages + [{"role": "user", "content": "Hi"}]))
    if shortest >= session.max_context:
        raise UsageError(f"--max-context {session.max_context} is too small: the message 'Hi' alone makes a "
                         f"{shortest}-token prompt (the chat template and any system message included); give more than "
                         f"{shortest}")


def _read_line(interactive: bool, status) -> str | None:
    """The next line the user typed (None at end of input: Ctrl-D or the pipe's end)."""
    if not interactive:
        line = sys.stdin.readline()
        return line if line else None
    from rich.prompt import Prompt

    try:
        return Prompt.ask("[bold green]you[/bold green]", console=status)
    except EOFError:
        status.print()  # leave the terminal on a fresh line
        return None


def _enable_line_history() -> None:
    """Up/down arrows recall earlier lines: input() uses GNU readline once it is imported."""
    try:
        import readline  # noqa: F401
    except ImportError:  # Windows
        pass


def _command(line: str, session, state: dict, status) -> str | None:
    """Run one /command; returns "exit" for /exit."""
    name, _, rest = line.partition(" ")
    if name in ("/exit", "/quit"):
        return "exit"
    if name == "/reset":
        session.reset()
        status.print(f"conversation forgotten, KV cache emptied ({session.cache.length} tokens)", style="dim")
    elif name == "/system":
        if rest.strip():
            session.set_system(rest.strip())
        system = session.messages[0]["content"] if session.messages and session.messages[0]["role"] == "system" else None
        status.print(f"system message: {system!r}", style="dim", markup=False)
    elif name == "/trace":
        state["trace"] = not state["trace"]
        status.print(f"trace {'on' if state['trace'] else 'off'}", style="dim")
    elif name == "/history":
        for message in session.messages:
            status.print(f"[bold]{message['role']}[/bold]: ", end="")
            status.print(message["content"], markup=False)
        status.print(repr(session.cache), style="dim", markup=False)
    elif name == "/help":
        for usage, what in COMMANDS.items():
            status.print(f"  {usage:<14} {what}", markup=False)
    else:
        status.print(f"unknown command {name}; /help lists them", markup=False)
    return None


def _turn(session, text: str, traced: bool, status, governor=None) -> None:
    """One turn: the answer streamed to stdout, then what it cost on stderr. Ctrl-C stops the answer."""
    from ..errors import CacheFullError

    trace = _new_trace(session) if traced else None
    if governor is not None:  # fewer threads while other processes keep cores busy (minillm/cpu_policy.py)
        governor.adjust(force=True)
    steps = session.send(text, trace=trace)
    try:
        for step in steps:
            print(step.text, end="", flush=True)
            if governor is not None:
                governor.adjust()
    except KeyboardInterrupt:
        steps.close()  # the conversation stays as before this message
        print()
        status.print("[answer interrupted; the conversation is unchanged]", style="dim", markup=False)
        return
    except CacheFullError as error:
        status.print(f"minillm: error: {error}", markup=False)
        return
    print()
    turn = session.last_turn
    if turn.dropped_messages:
        status.print(f"[context full ({session.max_context} tokens): dropped the {turn.dropped_messages} "
                     "oldest messages; /reset starts over]", style="dim", markup=False)
    status.print(_summary(turn, busy_note_now()), style="dim", markup=False)
    if turn.finish_reason == "cache_full":
        status.print("[the answer filled the context and was cut; /reset or a larger --max-context]",
                     style="dim", markup=False)
    if trace is not None:
        from rich.console import Console

        from ..views.terminal import print_trace

        print_trace(trace, Console(), prompt=False)


def _summary(turn, busy: str | None = None) -> str:
    n = len(turn.token_ids)
    tpot = f"{(turn.end_s - turn.start_s - turn.ttft_ms / 1e3) * 1e3 / (n - 1):.1f} ms" if n > 1 else "n/a"
    return (f"[{turn.reused_tokens} tokens reused, {turn.prefill_tokens} prefilled | generated {n} tok | "
            f"TTFT {turn.ttft_ms:.1f} ms | TPOT {tpot} | stop: {turn.finish_reason}" + (f" | {busy}]" if busy else "]"))


def _new_trace(session):
    from ..hardware import get_hardware
    from ..trace import Trace

    param = next(session.model.parameters())
    return Trace("steps", tokenizer=session.tokenizer, hardware=get_hardware(param.device, param.dtype))
