"""benchmarks/make_gguf.py against a stand-in llama.cpp tree: the converter's command line and PYTHONPATH, one
file a shape and type named as decode_growth.py's --gguf expects, a file already there kept, and a missing or
failing converter said in one line."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # (make_gguf imports model_shapes as the scripts do)
spec = importlib.util.spec_from_file_location("make_gguf", BENCHMARKS / "make_gguf.py")
make_gguf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_gguf)

# writes its arguments and the first PYTHONPATH entry into --outfile, or fails as the real one does on a bad type
CONVERTER = """import os, sys
args = sys.argv[1:]
if args[args.index("--outtype") + 1] == "q8_0" and "fail" in args[0]:
    sys.exit("ValueError: cannot quantize this model")
out = args[args.index("--outfile") + 1]
open(out, "w").write(" ".join(args) + "\\n" + os.environ["PYTHONPATH"].split(os.pathsep)[0])
"""


@pytest.fixture
def llama_cpp(tmp_path, monkeypatch):
    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text(CONVERTER)
    monkeypatch.setattr(make_gguf, "model_folder", lambda shape: tmp_path / f"model-{shape}")
    return tree


@pytest.mark.cli
def test_each_shape_and_type_is_converted_once(llama_cpp, tmp_path, capsys):
    out = tmp_path / "gguf"
    make_gguf.main(["--llama-cpp", str(llama_cpp), "--out", str(out), "--shapes", "135m", "1.7b",
                    "--types", "f32", "q8_0"])
    written = (out / "1.7b-q8_0.gguf").read_text().splitlines()
    assert written == [f"{tmp_path / 'model-1.7b'} --outtype q8_0 --outfile {out / '1.7b-q8_0.gguf'}",
                       str(llama_cpp / "gguf-py")]
    assert sorted(p.name for p in out.iterdir()) == ["1.7b-f32.gguf", "1.7b-q8_0.gguf", "135m-f32.gguf",
                                                      "135m-q8_0.gguf"]
    assert capsys.readouterr().out.splitlines()[-1] == (f"decode_growth.py --gguf 135m:float32={out / '135m-f32.gguf'} "
                                                        f"1.7b:float32={out / '1.7b-f32.gguf'}")
    (out / "135m-f32.gguf").write_text("kept")
    make_gguf.main(["--llama-cpp", str(llama_cpp), "--out", str(out), "--types", "f32"])
    assert (out / "135m-f32.gguf").read_text() == "kept"


def test_a_tree_without_the_converter_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_gguf.main(["--llama-cpp", str(tmp_path), "--out", str(tmp_path / "gguf")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: no convert_hf_to_gguf.py in {tmp_path}; give llama.cpp's source tree "
                        "(vendor/llama.cpp in llama-cpp-python's sdist)")


@pytest.mark.cli
def test_a_failing_conversion_names_the_model_the_type_and_the_converters_last_line(llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setattr(make_gguf, "model_folder", lambda shape: tmp_path / "fail")
    with pytest.raises(SystemExit, match=r"^convert_hf_to_gguf.py fail --outtype q8_0 failed: ValueError: cannot "
                                         r"quantize this model$"):
        make_gguf.main(["--llama-cpp", str(llama_cpp), "--out", str(tmp_path / "gguf"), "--types", "q8_0"])
