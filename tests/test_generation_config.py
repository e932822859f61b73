"""generation_config.json: eos ids and sampling defaults as transformers reads them.
Oracle: transformers' generate on the same folder; hand-written files for the rules."""

import json

import pytest
import torch

from minillm import SamplingParams, generate, load_model, load_tokenizer
from minillm.errors import ConfigError
from minillm.generation_config import GenerationConfig


def test_its_eos_replaces_config_json_and_without_do_sample_it_is_greedy():
    config = GenerationConfig.from_dict({"eos_token_id": [2, 4649], "temperature": 0.6, "top_p": 0.9}, (2,))
    assert config.eos_token_ids == (2, 4649) and config.sources["eos_token_ids"] == "generation_config.json"
    assert config.sampling_params() == SamplingParams()  # transformers: do_sample absent = greedy
    assert GenerationConfig.from_dict({"bos_token_id": 1}, (7,)).eos_token_ids == (7,)  # none in the file
    assert GenerationConfig.from_model_config((7,)).sources == {"eos_token_ids": "config.json"}


def test_do_sample_brings_the_sampling_defaults_and_transformers_top_k():
    config = GenerationConfig.from_dict({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
                                         "max_new_tokens": 64, "num_beams": 1, "max_length": 100})
    params = config.sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_new_tokens) == (
        0.6, 0.9, 50, 1.1, 64)
    assert config.sources["top_k"] == "transformers default with do_sample"
    assert config.ignored == ("max_length", "num_beams")
    rows = {name: (value, source) for name, value, source in config.describe()}
    assert rows["temperature"] == (0.6, "generation_config.json") and rows["min_p"] == (0.0, "minillm default")


def test_user_set_knobs_win_and_unset_ones_take_the_defaults():
    config = GenerationConfig.from_dict({"do_sample": True, "temperature": 0.6, "top_k": 20})
    params = config.sampling_params(temperature=0.0, top_k=None, seed=3)
    assert (params.temperature, params.top_k, params.seed) == (0.0, 20, 3)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of them, got '2'"),
        ({"do_sample": "yes"}, "do_sample must be true or false"),
        ({"do_sample": True, "top_p": 1.5}, r"generation_config.json: top_p must be in \(0, 1\]"),
        ({"repetition_penalty": -1}, "repetition_penalty must be a finite number > 0"),
    ],
)
def test_bad_values_name_the_file_and_field(data, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig.from_dict(data)


def test_unreadable_file_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json is not valid JSON"):
        GenerationConfig.from_folder(tmp_path)


def test_real_model_stops_at_an_extra_eos_as_transformers_does(smollm2_dir, tmp_path):
    """SmolLM2 with eos [2, 4649] (4649 is " France"): the answer ends at "The capital of France"."""
    transformers = pytest.importorskip("transformers")
    for f in smollm2_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4649]}))
    tok = load_tokenizer(tmp_path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                        add_special_tokens=False)
    steps = list(generate(load_model(tmp_path, device="cpu"), prompt, tokenizer=tok))

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40)[0, len(prompt):].tolist()
    assert [s.token_id for s in steps] == expected and expected[-1] == 4649
    assert steps[-1].finish_reason == "eos" and "".join(s.text for s in steps) == "The capital of France"
