"""The ``onnxruntime`` backend: one ``onnxruntime.InferenceSession`` per instance.

Loads ``<version_dir>/model.onnx`` (or the config's ``default_model_filename``), as Triton's onnxruntime
backend does, and checks at load that every input and output the config declares exists in the model
with the same element type and a compatible shape. ``execute`` runs the session for the config's outputs.

Batch invariance: onnxruntime's CPU kernels (MLAS) compute each image of a batch on its own. For
EfficientNet-Lite0 every row of a batch was bit-identical to the same row run alone (batch sizes 1 to 64,
1 and 2 intra-op threads, every graph optimisation level; the thread count did not change the results
either), so the default ``ORT_ENABLE_ALL`` is kept: it is also 3-4x faster than ``ORT_DISABLE_ALL``.
Changing the optimisation level changes the results in the last bits (it fuses batch norms and
rewrites convolutions to the blocked NCHWc layout), so all instances use the same options. Other models
(MatMul/Gemm-heavy ones, CUDA) are not covered by that measurement.

Source for the API: https://onnxruntime.ai/docs/api/python/api_summary.html.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import Backend, BackendError
from inferd.config import cpu_threads

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILENAME = "model.onnx"

# Triton data type -> onnxruntime's type string (``NodeArg.type``).
ORT_TYPES = {
    mc.TYPE_BOOL: "tensor(bool)",
    mc.TYPE_UINT8: "tensor(uint8)",
    mc.TYPE_UINT16: "tensor(uint16)",
    mc.TYPE_UINT32: "tensor(uint32)",
    mc.TYPE_UINT64: "tensor(uint64)",
    mc.TYPE_INT8: "tensor(int8)",
    mc.TYPE_INT16: "tensor(int16)",
    mc.TYPE_INT32: "tensor(int32)",
    mc.TYPE_INT64: "tensor(int64)",
    mc.TYPE_FP16: "tensor(float16)",
    mc.TYPE_FP32: "tensor(float)",
    mc.TYPE_FP64: "tensor(double)",
    mc.TYPE_STRING: "tensor(string)",
    mc.TYPE_BF16: "tensor(bfloat16)",
}


def _type_name(data_type: int) -> str:
    return mc.DataType.Name(data_type)


def session_options(num_threads: int | None = None):
    """The ``SessionOptions`` every instance uses.

    Args:
        num_threads: intra-op threads; ``None`` lets onnxruntime choose (one per core of the machine,
            whatever the affinity; the backend passes :func:`inferd.config.cpu_threads` instead).

    Graph optimisations stay at onnxruntime's default (``ORT_ENABLE_ALL``, see the module docstring on
    batch invariance); the inter-op pool is not used (sequential execution), and a session never spins
    its threads waiting for work, so idle instances leave the CPUs to the rest of the server.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if num_threads is not None:
        opts.intra_op_num_threads = num_threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def _num_threads_from_config(config) -> int | None:
    param = config.parameters.get("intra_op_thread_count") if config.parameters else None
    if param is None or not param.string_value:
        return None
    try:
        value = int(param.string_value)
    except ValueError:
        raise BackendError(f"parameter intra_op_thread_count must be an integer, "
                           f"got {param.string_value!r}") from None
    if value < 0:
        raise BackendError(f"parameter intra_op_thread_count must be >= 0, got {value}")
    return value or None


class OnnxRuntimeBackend(Backend):
    """An onnxruntime session on the CPU, or on CUDA when asked for and available.

    Args:
        version_dir, config, device: see :class:`~inferd.backends.base.Backend`.
        num_threads: intra-op threads; defaults to the config's ``intra_op_thread_count`` parameter,
            else the CPUs the process may use (:func:`inferd.config.cpu_threads`: ``OMP_NUM_THREADS``, else
            the affinity capped by the cgroup's CPU limit).

    Raises:
        BackendError: the model file is missing or unreadable, or a config tensor is missing from the
            model or has another element type or shape.
    """

    def __init__(self, version_dir: str, config, device: str, num_threads: int | None = None) -> None:
        super().__init__(version_dir, config, device)
        import onnxruntime as ort

        filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
        self.model_path = os.path.join(version_dir, filename)
        if not os.path.isfile(self.model_path):
            raise BackendError(f"{self.model_path}: model file not found")
        if num_threads is None:
            num_threads = _num_threads_from_config(config)
        if not num_threads:  # (None or 0)
            # onnxruntime's own default is one thread per core of the machine, whatever the process's affinity
            # or its container's CPU limit: 2 threads in a process pinned to 1 CPU.
            num_threads = cpu_threads()[0]
        self.num_threads = num_threads

        providers: list = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" in ort.get_available_providers():
                device_id = int(device.split(":", 1)[1]) if ":" in device else 0
                providers = [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
            else:
                logger.warning("%s: device %s asked for, but onnxruntime has no CUDAExecutionProvider; "
                               "running on the CPU", self.model_path, device)
        try:
            self.session = ort.InferenceSession(self.model_path, sess_options=session_options(num_threads),
                                                providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            raise BackendError(f"{self.model_path}: onnxruntime cannot load the model: {e}") from e

        self._check_tensors(self.session.get_inputs(), config.input, "input")
        self._check_tensors(self.session.get_outputs(), config.output, "output")
        self.output_names = [o.name for o in config.output]
        self._string_inputs = {i.name for i in config.input if i.data_type == mc.TYPE_STRING}
        self._string_outputs = {o.name for o in config.output if o.data_type == mc.TYPE_STRING}

    @property
    def providers(self) -> list[str]:
        """The execution providers the session runs on, in priority order."""
        return self.session.get_providers()

    def _check_tensors(self, model_args, config_tensors, kind: str) -> None:
        by_name = {a.name: a for a in model_args}
        batched = self.config.max_batch_size > 0
        for t in config_tensors:
            arg = by_name.get(t.name)
            if arg is None:
                raise BackendError(f"{self.model_path}: the config's {kind} {t.name!r} is not an {kind} of the "
                                   f"model (its {kind}s: {', '.join(sorted(by_name)) or 'none'})")
            want = ORT_TYPES.get(t.data_type)
            if want != arg.type:
                raise BackendError(f"{self.model_path}: {kind} {t.name!r} is {_type_name(t.data_type)} in the "
                                   f"config but {arg.type} in the model")
            self._check_shape(t, arg, kind, batched)

    def _check_shape(self, t, arg, kind: str, batched: bool) -> None:
        shape = arg.shape
        if shape is None:  # rank unknown in the model: onnxruntime checks at run time
            return
        want = ([-1] if batched else []) + list(t.dims)
        shown = "[" + ", ".join(str(d) for d in want) + "]"
        if len(shape) != len(want):
            raise BackendError(f"{self.model_path}: {kind} {t.name!r} has shape {shown} in the config "
                               f"(batch first) but {list(shape)} in the model")
        for i, (have, need) in enumerate(zip(shape, want)):
            if not isinstance(have, int) or have < 0:  # symbolic or unknown dimension
                continue
            if batched and i == 0:
                if have < self.config.max_batch_size:
                    raise BackendError(f"{self.model_path}: {kind} {t.name!r} has a fixed batch dimension "
                                       f"{have} in the model, below max_batch_size "
                                       f"{self.config.max_batch_size}")
            elif need != -1 and need != have:
                raise BackendError(f"{self.model_path}: {kind} {t.name!r} has shape {shown} in the config "
                                   f"(batch first) but {list(shape)} in the model")

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {}
        for name, arr in inputs.items():
            if name in self._string_inputs:
                # tritonclient sends bytes; onnxruntime's string tensors take str.
                arr = np.vectorize(lambda b: b.decode("utf-8") if isinstance(b, bytes) else b,
                                   otypes=[object])(arr)
            feeds[name] = arr
        try:
            results = self.session.run(self.output_names, feeds)
        except Exception as e:
            raise BackendError(f"onnxruntime run failed: {e}") from e
        out = {}
        for name, arr in zip(self.output_names, results):
            if name in self._string_outputs:
                arr = np.vectorize(lambda s: s.encode("utf-8") if isinstance(s, str) else s,
                                   otypes=[object])(arr)
            out[name] = arr
        return out

    def close(self) -> None:
        self.session = None
