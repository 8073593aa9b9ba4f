"""config.pbtxt checking, version policies and SHA256SUMS (inferd/repository), without a server."""

from __future__ import annotations

import os

import pytest

from inferd.repository.config import ModelConfigError, config_to_json, parse_config
from inferd.repository.repository import (IntegrityError, read_model, select_versions, verify_checksums,
                                          write_checksums)

BASE = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_a_triton_config_parses_with_defaults():
    cfg = parse_config(BASE + """
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100
  default_queue_policy { max_queue_size: 3 default_timeout_microseconds: 5000 allow_timeout_override: true } }
instance_group [ { count: 2 kind: KIND_CPU } ]
model_warmup [ { name: "w" batch_size: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 3, 4 ] random_data: true } } } ]
""", "m")
    assert cfg.name == "m" and cfg.backend == "onnxruntime"
    assert cfg.version_policy.latest.num_versions == 1
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.instance_group[0].count == 2
    j = config_to_json(cfg)
    assert j["input"][0] == {"name": "x", "data_type": "TYPE_FP32", "dims": ["-1", "4"]}
    # An empty dynamic_batching block turns the batcher on, as in Triton.
    assert parse_config(BASE + "dynamic_batching { }", "m").HasField("dynamic_batching")
    # No instance_group: one instance.
    assert [(g.count, g.kind) for g in parse_config(BASE, "m").instance_group] == [(1, 0)]


@pytest.mark.parametrize("extra, message", [
    ("sequence_batching { }", "field 'sequence_batching' is not supported by inferd"),
    ("optimization { cuda { graphs: true } }", "field 'optimization.cuda.graphs' is not supported by inferd"),
    ("dynamic_batching { priority_levels: 2 }", "field 'dynamic_batching.priority_levels' is not supported"),
    ("response_cache { enable: true }", "field 'response_cache.enable' is not supported by inferd"),
    ("model_transaction_policy { decoupled: true }", "field 'model_transaction_policy.decoupled' is not supported"),
    ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
     "default_queue_policy.timeout_action DELAY is not supported (use REJECT)"),
    ("dynamic_batching { preferred_batch_size: [ 16 ] }", "preferred_batch_size 16 is outside [1, max_batch_size=8]"),
    ("instance_group [ { kind: KIND_MODEL } ]", "instance_group kind KIND_MODEL is not supported"),
    ('parameters { key: "execution_mode" value: { string_value: "1" } }',
     "parameter 'execution_mode' is not understood by the onnxruntime backend"),
    ('name: "other"', "name 'other' differs from the folder name 'm'"),
    ("version_policy { specific { } }", "version_policy specific needs at least one version"),
    ("bogus_field: 1", 'no field named "bogus_field"'),
    ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "x" value: { dims: [ 4 ] zero_data: true } } } ]',
     "model_warmup 'w': input 'x' needs data_type TYPE_FP32"),
])
def test_unhonoured_or_inconsistent_fields_are_refused(extra, message):
    with pytest.raises(ModelConfigError) as err:
        parse_config(BASE + extra, "m")
    assert str(err.value).startswith("config.pbtxt of 'm': ")
    assert message in str(err.value)


def test_backends_and_llm_rules():
    with pytest.raises(ModelConfigError, match="set backend to one of onnxruntime, pytorch, embedding, llm"):
        parse_config(BASE.replace('platform: "onnxruntime_onnx"', ""), "m")
    with pytest.raises(ModelConfigError, match="platform 'tensorrt_plan' is not supported"):
        parse_config(BASE.replace("onnxruntime_onnx", "tensorrt_plan"), "m")
    with pytest.raises(ModelConfigError, match="the llm backend batches continuously by itself"):
        parse_config('backend: "llm" max_batch_size: 4', "m")
    with pytest.raises(ModelConfigError, match="the llm backend runs one instance"):
        parse_config('backend: "llm" instance_group [ { count: 2 } ]', "m")
    assert parse_config('backend: "llm"', "m").backend == "llm"


def test_version_policies():
    def versions(policy: str, available):
        return select_versions(parse_config(BASE + policy, "m").version_policy, available)

    assert versions("", [1, 2, 3]) == (3,)
    assert versions("version_policy { latest { num_versions: 2 } }", [1, 2, 3]) == (2, 3)
    assert versions("version_policy { all { } }", [1, 2, 3]) == (1, 2, 3)
    assert versions("version_policy { specific { versions: [ 1, 3, 7 ] } }", [1, 2, 3]) == (1, 3)


def test_read_model_finds_versions_and_reports_config_errors(tmp_path):
    for v in ("1", "2", "10", "abc", "0"):
        os.makedirs(tmp_path / "m" / v)
    (tmp_path / "m" / "config.pbtxt").write_text(BASE + "version_policy { all { } }")
    src = read_model(str(tmp_path), "m")
    assert src.versions == (1, 2, 10) and src.error is None
    (tmp_path / "m" / "config.pbtxt").write_text(BASE + "sequence_batching { }")
    assert "sequence_batching" in read_model(str(tmp_path), "m").error
    os.makedirs(tmp_path / "empty")
    assert read_model(str(tmp_path), "empty").error == "empty/config.pbtxt is missing"


def test_sha256sums(tmp_path):
    d = tmp_path / "1"
    os.makedirs(d / "sub")
    (d / "model.onnx").write_bytes(b"weights")
    (d / "sub" / "vocab.txt").write_text("a b c")
    assert verify_checksums(str(d)) is False  # nothing to check
    write_checksums(str(d))
    assert verify_checksums(str(d)) is True
    (d / "model.onnx").write_bytes(b"weightz")
    with pytest.raises(IntegrityError, match=r"^model.onnx does not match SHA256SUMS \(expected sha256 "):
        verify_checksums(str(d))
    (d / "model.onnx").write_bytes(b"weights")
    (d / "extra.bin").write_bytes(b"?")
    with pytest.raises(IntegrityError, match="^extra.bin is not listed in SHA256SUMS$"):
        verify_checksums(str(d))
    os.remove(d / "extra.bin")
    os.remove(d / "sub" / "vocab.txt")
    with pytest.raises(IntegrityError, match="^sub/vocab.txt is listed in SHA256SUMS but missing$"):
        verify_checksums(str(d))
    (d / "SHA256SUMS").write_text("nothex  model.onnx\n")
    with pytest.raises(IntegrityError, match="^SHA256SUMS line 1 is not '<sha256>  <file>'$"):
        verify_checksums(str(d))
