"""AsyncEngine built in its own thread (what ``minillm serve`` does): the function that loads the model
and makes the engine runs on the engine thread, the thread that then steps it (so torch's CPU work has
one OpenMP team, see AsyncEngine._run); the constructor returns the built engine, or raises what
building raised."""

import asyncio
import signal
import threading

import pytest

from minillm.sampling import SamplingParams
from minillm.serving.engine import LLMEngine
from minillm.serving.server.async_engine import AsyncEngine

PROMPT = [5, 9, 14, 2, 7]


async def _tokens(async_engine: AsyncEngine, params: SamplingParams) -> list[int]:
    last = None
    async for last in async_engine.generate(PROMPT, params):
        pass
    return list(last.token_ids)


def test_the_engine_is_built_and_stepped_on_the_engine_thread(tiny_model):
    model = tiny_model("llama_gqa")
    threads = {"build": set(), "step": set()}

    def build() -> LLMEngine:
        threads["build"].add(threading.get_ident())
        return LLMEngine(model, num_blocks=16)

    async_engine = AsyncEngine(build, before_step=lambda: threads["step"].add(threading.get_ident()))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    try:
        assert isinstance(async_engine.engine, LLMEngine)
        got = asyncio.run(_tokens(async_engine, params))
    finally:
        async_engine.close()
    assert threads["build"] == threads["step"] and threading.get_ident() not in threads["build"]
    # the oracle: the same engine code run here, in this thread, alone
    [want] = LLMEngine(model, num_blocks=16).generate([PROMPT], params)
    assert got == list(want.token_ids)


def test_an_error_while_building_is_raised_by_the_constructor():
    def build() -> LLMEngine:
        raise ValueError("model.safetensors is truncated: download it again")

    with pytest.raises(ValueError, match="^model.safetensors is truncated: download it again$"):
        AsyncEngine(build)


def test_ctrl_c_while_building_waits_for_the_build_then_raises(tiny_model):
    """Ctrl-C during the build: the constructor lets the build finish and the engine thread end before it
    raises KeyboardInterrupt (a program ending while that thread is inside torch aborts)."""
    import _thread
    import time

    model, finished = tiny_model("llama_gqa"), []
    threads = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        time.sleep(0.1)  # the constructor is now waiting for the build
        _thread.interrupt_main()  # as Ctrl-C: KeyboardInterrupt in the main thread, while this one still works
        time.sleep(0.2)
        finished.append(True)
        return LLMEngine(model, num_blocks=16)

    # Python's Ctrl-C handler, as a terminal's suite has it: started in the background, the suite inherits
    # SIGINT ignored, Python installs no handler, and interrupt_main() does nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncEngine(build)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert finished == [True] and not threads[0].is_alive()
