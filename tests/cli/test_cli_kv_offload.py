"""The KV tier flags of serve and bench-serving (--kv-offload-memory, --kv-offload-dir, --kv-offload-disk-size),
run in this process (conftest's run_main): their usage errors come before the model loads, one line, exit 2;
a bound the engine refuses is the engine's one line, exit 1."""

import shutil

import pytest

COMMANDS = ["serve", "bench-serving"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("args, message", [
    (["--kv-offload-disk-size", "1GiB"], "--kv-offload-disk-size bounds the disk tier: give --kv-offload-dir DIR too"),
    (["--kv-offload-dir", "{tmp}", "--kv-offload-disk-size", "lots"],
     "--kv-offload-disk-size: the disk tier's size must be a size like 512MiB"),
    (["--kv-offload-dir", "{tmp}", "--kv-offload-disk-size", "0GiB"], "--kv-offload-disk-size: the disk tier's size must be > 0"),
    (["--kv-offload-dir", "{tmp}", "--kv-offload-disk-size", "1.5"], "--kv-offload-disk-size: a fraction of free disk space "
                                                                     "must be in (0, 1]"),
])
def test_bad_disk_sizes_are_one_line_usage_errors(run_main, tmp_path, command, args, message):
    r = run_main(command, *(a.format(tmp=tmp_path) for a in args))
    assert r.returncode == 2 and r.stderr == f"minillm: error: {r.stderr.removeprefix('minillm: error: ')}"
    assert message in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("command", COMMANDS)
def test_the_help_says_what_the_bound_does(run_main, command):
    help_text = " ".join(run_main(command, "--help").stdout.split())
    assert "--kv-offload-disk-size SIZE" in help_text
    assert ("least recently used block files are removed (LRU), pinned cache points kept until their lifetime ends"
            in help_text and "default: unbounded" in help_text)


def test_serve_refuses_the_bound_with_tensor_parallelism(run_main, tmp_path):
    r = run_main("serve", "--tensor-parallel-size", "2", "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-size",
                 "1GiB")
    assert r.returncode == 2 and "does not go with tensor parallelism yet" in r.stderr and r.stderr.count("\n") == 1


def test_bench_serving_passes_the_bound_to_the_engine(run_main, tiny_chat, smollm2_dir, tmp_path):
    """A bound smaller than one block's file passes the size check; the engine refuses it, in one line (exit 1):
    the flag reached LLMEngine(kv_offload_disk_size=)."""
    folder = shutil.copytree(tiny_chat[0].source, tmp_path / "model")  # the tiny model with SmolLM2's tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    r = run_main("bench-serving", "--model", str(folder), "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
                 "--long-prompt-len", "0", "--threads", "1", "--policies", "continuous", "--quiet",
                 "--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-disk-size", "100B")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("minillm: error: kv_offload_disk_size '100B' holds no block (one block's file is ")


@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_kv_offload_dir_is_a_usage_error(run_main, command):
    r = run_main(command, "--kv-offload-dir=")
    assert r.returncode == 2 and r.stderr == "minillm: error: --kv-offload-dir is empty; give a folder path\n"
