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
