import glob
import os

import pytest

import tf_gradsync as gs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_preset_loads(path):
    cfg = gs.parse_config(path)
    ops = cfg.build()
    assert isinstance(ops, gs.CompressedAllReduce)
    assert ops.bucket_bytes == cfg.bucket_bytes and ops.algorithm == cfg.algorithm


def test_mapping_and_compression_options():
    ops = gs.load_config({"compression": "topk", "compression_options": {"ratio": 0.05},
                          "bucket_bytes": 1024, "algorithm": "ring"})
    assert ops.compressor.inner.ratio == 0.05 and ops.bucket_bytes == 1024


def test_shipped_presets_load_by_name_from_anywhere(tmp_path, monkeypatch):
    """An installed copy has no configs/ folder beside the user's code: presets load by
    name, or by the path a checkout has (README's "configs/fp16.yaml"), from any
    directory; setup.py installs configs/ with the package for that."""
    names = sorted(os.path.basename(p)[:-len(".yaml")]
                   for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert gs.presets() == names
    monkeypatch.chdir(tmp_path)
    assert type(gs.load_config("fp16").compressor).__name__ == "Float16"
    assert gs.load_config("configs/topk-1pct.yaml").compressor.inner.ratio == 0.01
    with pytest.raises(FileNotFoundError, match="no preset file 'zip'; the shipped presets, "
                                                "by name: adaptive, bf16, "):
        gs.load_config("zip")
    with pytest.raises(FileNotFoundError, match="elsewhere/fp16.yaml"):
        gs.load_config("elsewhere/fp16.yaml")       # a path of the user's own, missing
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        assert 'package_dir={"tf_gradsync.configs": "configs"}' in f.read()


def test_every_constructor_setting_has_a_key():
    ops = gs.load_config({"compression": "topk", "jit_compile": False, "measure_error": False})
    assert "jit_compile=False" in repr(ops) and not ops._pipeline.measure_error
    with pytest.raises(ValueError, match="jit_compile must be True or False, got 'no'"):
        gs.load_config({"compression": "fp16", "jit_compile": "no"})
    ops = gs.load_config({"compression": "fp16", "sparse_as_dense": True})
    assert ops.sparse_as_dense and "sparse_as_dense=True" in repr(ops)
    with pytest.raises(ValueError, match="sparse_as_dense must be True or False, got 1"):
        gs.CompressedAllReduce("fp16", sparse_as_dense=1)


@pytest.mark.parametrize("data,match", [
    ({"compresion": "fp16"}, r"unknown config keys \['compresion'\]; valid keys: compression, "),
    ({"compression": "zip"}, "unknown compression 'zip'; valid names: adaptive, bf16, "),
    ({"bucket_bytes": "32MB"}, "bucket_bytes must be a positive integer, got '32MB'"),
    ({"algorithm": "star"}, "unknown algorithm 'star'"),
    ({"error_feedback": "yes"}, "true, false or null in YAML"),
    ({"compression": "topk", "compression_options": {"k": 5}}, "unknown arguments \\['k'\\]"),
    ({"timeout_seconds": 0}, "timeout_seconds must be a positive, finite number"),
])
def test_bad_config(data, match):
    with pytest.raises(ValueError, match=match):
        gs.load_config(data)


def test_yaml_is_loaded_safely(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compression: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(Exception, match="could not determine a constructor"):
        gs.load_config(bad)
