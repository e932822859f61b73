"""lm-eval itself against minillm serve: its ``local-completions`` model scores a multiple-choice
task kept in tests/data/lm_eval (a YAML task and its JSON lines) through /v1/completions
(``echo: true, logprobs: 1, max_tokens: 1``, prompt token ids) and its remote tokenizer (vLLM's
/tokenizer_info and /tokenize). Every loglikelihood lm-eval receives must equal the one computed
here from transformers' log_softmax on the same random weights. No network: the dataset is a
local JSON file, the tokenizer the server's.
"""

from pathlib import Path

import pytest
import torch
from live_server import app_of, live_server
from tiny_models import CONFIGS, build_hf, save_hf

import minillm

pytestmark = [pytest.mark.eval, pytest.mark.server]

TASK_YAML = Path(__file__).parents[2] / "data" / "lm_eval" / "minillm_mc.yaml"
MODEL = "minillm-test"


def task_config(yaml_path: Path, cache_dir: Path) -> dict:
    """The task's YAML as lm-eval's config dict, its data file made absolute (the YAML names it
    from the repository root) and the datasets cache kept in a temporary folder."""
    import yaml  # lm-eval's dependency

    config = yaml.safe_load(yaml_path.read_text())
    repo = yaml_path.parents[3]  # tests/data/lm_eval/X.yaml
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"] = dict(config["dataset_kwargs"], cache_dir=str(cache_dir),
                                    data_files={split: str(repo / path) for split, path in files.items()})
    return config


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into token ids (TemplateLM._encode_pair): the
    context's trailing spaces move to the continuation; the whole text is encoded, then cut."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)

    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    hf = build_hf(family, kwargs, seed=11)
    model = minillm.load_model(save_hf(hf, tmp_path / "model"), device="cpu")
    tokenizer = minillm.load_tokenizer("smollm2-135m-instruct")

    with live_server(model, tokenizer, model_name=MODEL, num_blocks=256, block_size=4,
                     max_num_batched_tokens=16) as url:  # small chunks; a shared question prefix hits the cache
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{url}/v1/completions", "model": MODEL, "tokenizer_backend": "auto",
                        "num_concurrent": 1, "max_retries": 1, "max_length": 512},
            tasks=[task_config(TASK_YAML, tmp_path / "datasets")], log_samples=True, write_out=False)
        engine = app_of(url).state.async_engine.engine
    # "auto" found /tokenizer_info and /tokenize (else it would look for a Hugging Face tokenizer named
    # "minillm-test", offline: an error); each choice was one request with the prompt's logprobs
    scored = [r for r in engine.requests.values() if r.num_prompt_logprobs == 1]
    assert len(scored) == 12 and all(len(r.output_ids) == 1 for r in scored)

    samples = results["samples"]["minillm_mc"]
    assert len(samples) == 4 and results["results"]["minillm_mc"]["acc,none"] is not None
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglikelihood, is_greedy = resp[0]
            context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
            ids = context_ids + continuation_ids
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            rows = logprobs[len(context_ids) - 1 : len(ids) - 1]
            expected = rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum().item()
            assert loglikelihood == pytest.approx(expected, abs=1e-4), (context, continuation)
            assert is_greedy == (rows.argmax(-1).tolist() == continuation_ids)
            checked += 1
    assert checked == sum(len(s["arguments"]) for s in samples) == 12
