"""`minillm serve` against requests generated from its own OpenAPI document (issue 40, item 5).

schemathesis reads /openapi.json (the request bodies are protocol.py's models) and generates
requests that fit it and requests that break it; tests/serving/server/fuzz_requests.py says what every
answer must be: never a 5xx, every 4xx OpenAI's error JSON on one line, a 400 of a JSON object
naming its field. Meanwhile one greedy chat stream runs again and again: each run's tokens must
equal the quiet server's. The cases are derandomized (the same every run) and bounded by count
and time; benchmarks/fuzz_server.py runs minutes of fresh ones.
"""

import pytest

pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[fuzz]')")

from fuzz_requests import QuietStream, fuzz  # noqa: E402
from live_server import app_of, live_server  # noqa: E402

MAX_EXAMPLES = 1500  # about 40 a second here: the time bound ends the run first on a slow machine
FUZZ_SECONDS = 30.0  # CI's share; benchmarks/fuzz_server.py runs for minutes


@pytest.mark.server
def test_fuzzed_requests_get_4xx_naming_their_field_and_leave_a_stream_alone(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=256, max_num_seqs=8) as url:
        stream = QuietStream(url)  # its reference: the quiet server's tokens
        stream.start()
        try:
            statuses, problems = fuzz(url, app_of(url), "minillm-test", FUZZ_SECONDS, MAX_EXAMPLES)
        finally:
            stream.stop()
    print(f"{sum(statuses.values())} requests: " + ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items(), key=str)))
    print(f"the stream ran {stream.runs} times during them")
    found = [f"{problem}\n  {request}" for problem, request in problems.values()]
    assert not found, "\n".join(found)
    assert stream.runs >= 2 and not stream.mismatches, stream.mismatches
    assert statuses[200] > 0 and statuses[400] > 0  # some reached the engine, some were refused
