"""Models shared by the serving tests: loaded once per session, never per test.

``tiny_model(name)``: a random-weight model of one tests/tiny_models.py config (float32, CPU).
``smollm2``: the real default model and its tokenizer (on disk already; see tests/conftest.py).
"""

import pytest
from tiny_models import CONFIGS, build_hf, save_hf

import minillm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    models = {}

    def get(name: str):
        if name not in models:
            family, kwargs = CONFIGS[name]
            folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(name))
            models[name] = minillm.load_model(folder, device="cpu")
        return models[name]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of smollm2-135m-instruct, float32 on the CPU."""
    return minillm.load_model("smollm2-135m-instruct", device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    """(model, tokenizer): a random 2-layer Llama with SmolLM2's vocabulary (49,152 ids) and
    SmolLM2's tokenizer and chat template: text in and out in milliseconds (the server tests)."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_chat"))
    return minillm.load_model(folder, device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")
