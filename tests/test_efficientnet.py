"""EfficientNet-Lite0 with its real weights through the onnxruntime and pytorch backends, and the pytorch
backend's refusal of pickled archives and TorchScript files."""

from __future__ import annotations

import io
import json
import os
import shutil
import zipfile

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import BackendError
from inferd.backends.onnxruntime import OnnxRuntimeBackend
from inferd.backends.pytorch import PyTorchBackend
from inferd.model import efficientnet_lite as effnet

skimage_data = pytest.importorskip("skimage.data")

CONFIG = """
name: "efficientnet_lite0"
max_batch_size: 8
input { name: "input" data_type: TYPE_FP32 dims: [3, 224, 224] }
output { name: "logits" data_type: TYPE_FP32 dims: [1000] }
"""
CAT_CLASSES = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967


def make_config(text: str = CONFIG) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A version folder with model.onnx and model.pt2 exported from the real weights."""
    torch.set_num_threads(1)
    version_dir = tmp_path_factory.mktemp("efficientnet_lite0") / "1"
    version_dir.mkdir()
    model = effnet.load_efficientnet_lite0()
    effnet.export_onnx(model, version_dir / "model.onnx")
    effnet.export_pt2(model, version_dir / "model.pt2")
    return version_dir


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    """chelsea (a tabby cat) and coffee (a cup of espresso), preprocessed: float32 [2, 3, 224, 224]."""
    return np.stack([effnet.preprocess(skimage_data.chelsea()), effnet.preprocess(skimage_data.coffee())])


def assert_classifies(logits: np.ndarray) -> None:
    assert logits.shape == (2, 1000) and logits.dtype == np.float32
    top = logits.argmax(axis=1)
    assert top[0] in CAT_CLASSES, top
    assert top[1] == ESPRESSO, top


def test_preprocess_shape_and_range(photos):
    assert photos.shape == (2, 3, 224, 224) and photos.dtype == np.float32
    assert photos.min() >= -127 / 128 and photos.max() <= 128 / 128
    with pytest.raises(ValueError):
        effnet.preprocess(np.zeros((8, 8), np.uint8))


def test_onnxruntime_backend_classifies(exported, photos):
    backend = OnnxRuntimeBackend(str(exported), make_config(), "cpu", num_threads=1)
    try:
        assert backend.providers == ["CPUExecutionProvider"]
        out = backend.execute({"input": photos})
        assert list(out) == ["logits"]
        assert_classifies(out["logits"])
        # Each row is bit-identical whatever batch it is in (onnxruntime's CPU kernels are batch-invariant).
        alone = backend.execute({"input": photos[1:]})["logits"]
        assert np.array_equal(alone[0], out["logits"][1])
    finally:
        backend.close()


def test_pytorch_backend_classifies(exported, photos):
    backend = PyTorchBackend(str(exported), make_config(), "cpu", num_threads=1)
    try:
        assert backend.batch_invariant  # default on the CPU
        out = backend.execute({"input": photos})
        assert list(out) == ["logits"]
        assert_classifies(out["logits"])
        alone = backend.execute({"input": photos[1:]})["logits"]
        assert np.array_equal(alone[0], out["logits"][1])
        # The eager model gives the same classes (the program is the same graph).
        with torch.inference_mode():
            eager = effnet.load_efficientnet_lite0()(torch.from_numpy(photos)).numpy()
        np.testing.assert_allclose(out["logits"], eager, rtol=0, atol=1e-4)
    finally:
        backend.close()


def test_onnxruntime_backend_checks_config(exported):
    wrong_type = CONFIG.replace('name: "input" data_type: TYPE_FP32', 'name: "input" data_type: TYPE_FP16')
    with pytest.raises(BackendError, match="'input'.*TYPE_FP16"):
        OnnxRuntimeBackend(str(exported), make_config(wrong_type), "cpu", num_threads=1)
    missing = CONFIG.replace('name: "logits"', 'name: "probabilities"')
    with pytest.raises(BackendError, match="'probabilities'"):
        OnnxRuntimeBackend(str(exported), make_config(missing), "cpu", num_threads=1)
    wrong_dims = CONFIG.replace("dims: [3, 224, 224]", "dims: [3, 256, 256]")
    with pytest.raises(BackendError, match="'input'.*shape"):
        OnnxRuntimeBackend(str(exported), make_config(wrong_dims), "cpu", num_threads=1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a second CPU to leave out")
def test_backends_threads_follow_the_process_cpus(exported, photos):
    """Without a configured thread count, the onnxruntime session's pool and PyTorch's threads are the CPUs the
    process may use (inferd.config.cpu_threads): in a process pinned to one CPU, one thread. onnxruntime's own
    default is a thread per core of the machine whatever the affinity, so its session added a worker thread here
    before (in a container limited to one CPU, two threads taking turns on it)."""
    import subprocess
    import sys

    np.save(exported.parent / "photos.npy", photos)
    code = f"""
import os, numpy as np, onnxruntime, torch  # (importing onnxruntime starts a thread of its own)
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from inferd.backends.onnxruntime import OnnxRuntimeBackend
from inferd.backends.pytorch import PyTorchBackend
config = text_format.Parse({CONFIG!r}, mc.ModelConfig())
photos = np.load({str(exported.parent / "photos.npy")!r})
before = len(os.listdir("/proc/self/task"))
ort_backend = OnnxRuntimeBackend({str(exported)!r}, config, "cpu")
ort_backend.execute({{"input": photos}})
print("onnxruntime", ort_backend.num_threads, len(os.listdir("/proc/self/task")) - before)
torch.set_num_threads(2)  # as if another part of the process had set it
pt_backend = PyTorchBackend({str(exported)!r}, config, "cpu")
pt_backend.execute({{"input": photos}})
print("pytorch", pt_backend.num_threads, torch.get_num_threads())
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-2:] == ["onnxruntime 1 0", "pytorch 1 1"]


def rewrite_pt2(src: os.PathLike, dst: os.PathLike, edit) -> None:
    """Copy a .pt2 zip, passing each (name, bytes) through ``edit`` (which returns the new bytes)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, edit(info.filename, zin.read(info.filename)))


class _Payload:
    """Unpickling this touches a marker file: stands in for code an attacker would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pytorch_backend_refuses_pickled_weights(exported, tmp_path):
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    bad = version_dir / "model.pt2"
    marker = tmp_path / "unpickled"
    with zipfile.ZipFile(exported / "model.pt2") as z:
        config_name = next(n for n in z.namelist() if n.endswith("data/weights/model_weights_config.json"))
        weights_config = json.loads(z.read(config_name))
    path_name = weights_config["config"]["_fc.bias"]["path_name"]
    weights_config["config"]["_fc.bias"]["use_pickle"] = True  # what torch.export.save writes for subclasses

    def edit(name: str, data: bytes) -> bytes:
        if name == config_name:
            return json.dumps(weights_config).encode()
        if name.endswith(f"data/weights/{path_name}"):
            buf = io.BytesIO()
            torch.save(_Payload(str(marker)), buf)
            return buf.getvalue()
        return data

    rewrite_pt2(exported / "model.pt2", bad, edit)
    with pytest.raises(BackendError) as err:
        PyTorchBackend(str(version_dir), make_config(), "cpu", num_threads=1)
    message = str(err.value)
    assert str(bad) in message and "_fc.bias" in message and "pickled" in message
    assert not marker.exists()


def test_pytorch_backend_refuses_sample_inputs_needing_pickle(exported, tmp_path):
    # torch retries sample inputs with torch.load(weights_only=False) when weights_only=True fails.
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    marker = tmp_path / "unpickled"

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("data/sample_inputs/model.pt"):
            buf = io.BytesIO()
            torch.save(_Payload(str(marker)), buf)
            return buf.getvalue()
        return data

    rewrite_pt2(exported / "model.pt2", version_dir / "model.pt2", edit)
    with pytest.raises(BackendError, match=r"model\.pt2.*sample inputs.*weights_only=True"):
        PyTorchBackend(str(version_dir), make_config(), "cpu", num_threads=1)
    assert not marker.exists()


def test_pytorch_backend_refuses_graph_calling_python(exported, tmp_path):
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    bad = version_dir / "model.pt2"

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("models/model.json"):
            return data.replace(b'"torch.ops.aten.relu6.default"', b'"torch.os.system"', 1)
        return data

    rewrite_pt2(exported / "model.pt2", bad, edit)
    with pytest.raises(BackendError, match=r"model\.pt2.*torch\.os\.system"):
        PyTorchBackend(str(version_dir), make_config(), "cpu", num_threads=1)


def test_pytorch_backend_refuses_torchscript(tmp_path):
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    (version_dir / "model.pt").write_bytes(b"PK\x03\x04 never opened")
    with pytest.raises(BackendError, match=r"model\.pt\b.*torch\.export"):
        PyTorchBackend(str(version_dir), make_config(), "cpu")
    named = make_config(CONFIG + 'default_model_filename: "model.pt"\n')
    with pytest.raises(BackendError, match=r"model\.pt\b.*torch\.export"):
        PyTorchBackend(str(version_dir), named, "cpu")


def test_pytorch_backend_checks_config(exported, tmp_path):
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    shutil.copy(exported / "model.pt2", version_dir / "model.pt2")
    wrong_type = CONFIG.replace('name: "logits" data_type: TYPE_FP32', 'name: "logits" data_type: TYPE_FP64')
    with pytest.raises(BackendError, match="'logits'.*TYPE_FP64"):
        PyTorchBackend(str(version_dir), make_config(wrong_type), "cpu", num_threads=1)
