"""The ``pytorch`` backend: a ``torch.export`` program (``model.pt2``), never a pickle.

``torch.export.load`` is not safe on untrusted files by itself (its docstring says so): the archive
format (``torch/export/pt2_archive/_package.py``) can hold weights and constants stored with pickle
(``"use_pickle": true`` in ``data/weights/<model>_weights_config.json`` or
``data/constants/<model>_constants_config.json``, loaded with ``torch.load(weights_only=False)``),
TorchScript objects (``custom_obj_*``, ``torch._C._pickle_load_obj``), opaque objects (``opaque_obj_*``,
``pickle.loads``), legacy pickled weight files (``data/weights/<model>.pt``), AOTInductor shared
libraries (``data/aotinductor/``), and sample inputs that ``torch._export.serde.serialize`` loads with
``weights_only=False`` when ``weights_only=True`` fails. The graph (``models/<model>.json``) names the
function each node calls, and the deserializer accepts any callable reachable as an attribute path under
``torch``, ``math`` or ``operator``. :func:`check_pt2_archive` inspects the zip before
``torch.export.load`` sees it and refuses all of these: only raw tensor bytes, JSON, sample inputs that
load with ``weights_only=True``, and graphs that call only PyTorch operators are accepted.

TorchScript files (``model.pt``, Triton's ``pytorch_libtorch`` format) are pickles too and are refused
with a hint to export with ``torch.export`` instead.

Inputs are taken in the config's order (or by name when the config's input names are the program's
argument names); the program's outputs are positional and mapped to the config's outputs in order.
"""

from __future__ import annotations

import io
import json
import logging
import math
import operator
import os
import re
import zipfile

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import Backend, BackendError
from inferd.config import cpu_threads

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILENAME = "model.pt2"

# Triton data type -> torch dtype name (STRING and BF16 have no numpy/torch round trip here).
_TORCH_DTYPES = {
    mc.TYPE_BOOL: "bool",
    mc.TYPE_UINT8: "uint8",
    mc.TYPE_UINT16: "uint16",
    mc.TYPE_UINT32: "uint32",
    mc.TYPE_UINT64: "uint64",
    mc.TYPE_INT8: "int8",
    mc.TYPE_INT16: "int16",
    mc.TYPE_INT32: "int32",
    mc.TYPE_INT64: "int64",
    mc.TYPE_FP16: "float16",
    mc.TYPE_FP32: "float32",
    mc.TYPE_FP64: "float64",
}

# Names inside the archive, relative to its root folder (torch/export/pt2_archive/constants.py).
_MODEL_JSON = re.compile(r"models/([^/]+)\.json")
_WEIGHTS_CONFIG = re.compile(r"data/weights/([^/]+)_weights_config\.json")
_CONSTANTS_CONFIG = re.compile(r"data/constants/([^/]+)_constants_config\.json")
_WEIGHT_FILE = re.compile(r"data/weights/weight_\d+")
_TENSOR_CONSTANT_FILE = re.compile(r"data/constants/tensor_\d+")
_SAMPLE_INPUTS = re.compile(r"data/sample_inputs/([^/]+)\.pt")
_FIXED_ENTRIES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}


def _sym_ops() -> set:
    """Python-level functions an exported graph may call on symbolic sizes."""
    try:
        from torch._export.serde.serialize import _SYM_OPS

        return set(_SYM_OPS)
    except ImportError:  # pragma: no cover - private name moved
        import torch

        return {operator.eq, operator.ne, operator.le, operator.ge, operator.lt, operator.gt, operator.neg,
                operator.pos, operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod,
                operator.pow, operator.truediv, operator.and_, operator.or_, math.trunc, torch.sym_not,
                torch.sym_int, torch.sym_float, torch.sym_ite, torch.sym_max, torch.sym_min, torch.sym_sqrt}


def _resolve_target(target: str):
    """What ``torch._export.serde.serialize.GraphModuleDeserializer.deserialize_operator`` resolves
    ``target`` to (None where it would stay a string, or use an extension operator)."""
    import torch

    roots = {"_operator": operator, "torch": torch, "math": math}
    head, _, rest = target.partition(".")
    if head not in roots or not rest:
        return None
    obj = roots[head]
    for name in rest.split("."):
        if not hasattr(obj, name):
            return None
        obj = getattr(obj, name)
    return obj


def _graph_targets(obj, found: set[str]) -> None:
    """Collect the ``target`` of every graph node (nested graphs included) in a model JSON."""
    if isinstance(obj, dict):
        target = obj.get("target")
        if isinstance(target, str) and "inputs" in obj and "outputs" in obj:
            found.add(target)
        for value in obj.values():
            _graph_targets(value, found)
    elif isinstance(obj, list):
        for value in obj:
            _graph_targets(value, found)


def check_pt2_archive(path: str) -> None:
    """Refuse a ``.pt2`` archive that ``torch.export.load`` would unpickle or that could run code.

    Accepted: one root folder holding ``archive_format`` (``pt2``), ``archive_version``, ``byteorder``,
    ``.data/*`` bookkeeping, ``models/<m>.json`` whose nodes call only PyTorch operators (``OpOverload``
    or higher-order operators) and symbolic-size arithmetic, ``data/weights/<m>_weights_config.json``
    and ``data/constants/<m>_constants_config.json`` whose every entry has ``"use_pickle": false`` and
    names a raw ``weight_N`` / ``tensor_N`` file of the archive, those raw files, sample inputs that
    load with ``torch.load(weights_only=True)``, and ``extra/`` text files.

    Raises:
        BackendError: naming ``path`` and the offending entry.
    """
    import torch
    from torch._ops import HigherOrderOperator, OpOverload

    def refuse(why: str) -> BackendError:
        return BackendError(f"{path}: {why}; refusing to load it (export with torch.export.export and "
                            "save with torch.export.save, keeping weights as plain tensors)")

    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise BackendError(f"{path}: not a torch.export archive (.pt2 zip): {e}") from e
    with zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1 or any("/" not in n for n in names):
            raise refuse("entries outside a single root folder (the pickled pre-2.8 torch.export format, "
                         f"or not a torch.export archive): {sorted(n for n in names if '/' not in n)[:5]}")
        root = roots.pop() + "/"
        files = {n[len(root):]: n for n in names}

        def read(rel: str) -> bytes:
            return zf.read(files[rel])

        if files.get("archive_format") is None or read("archive_format").decode(errors="replace") != "pt2":
            raise refuse("no archive_format 'pt2' entry (not a torch.export.save archive)")

        models = set()
        for rel in files:
            if (rel in _FIXED_ENTRIES or rel.startswith("extra/") or _WEIGHT_FILE.fullmatch(rel)
                    or _TENSOR_CONSTANT_FILE.fullmatch(rel) or _WEIGHTS_CONFIG.fullmatch(rel)
                    or _CONSTANTS_CONFIG.fullmatch(rel) or _SAMPLE_INPUTS.fullmatch(rel)):
                continue
            if m := _MODEL_JSON.fullmatch(rel):
                models.add(m.group(1))
                continue
            base = rel.rsplit("/", 1)[-1]
            if rel.startswith("data/aotinductor/"):
                raise refuse(f"it holds AOTInductor compiled code ({rel})")
            if base.startswith("custom_obj_"):
                raise refuse(f"it holds a pickled TorchScript custom object ({rel})")
            if base.startswith("opaque_obj_"):
                raise refuse(f"it holds a pickled opaque object ({rel})")
            if rel.startswith(("data/weights/", "data/constants/")) and rel.endswith(".pt"):
                raise refuse(f"it holds weights or constants stored pickled in the legacy format ({rel})")
            raise refuse(f"unexpected entry {rel!r} (only raw tensors, JSON configs and graphs are accepted)")
        if not models:
            raise refuse("no models/<name>.json graph")

        allowed_python = _sym_ops()
        for model in sorted(models):
            for kind, fmt, prefix in (("weights", "data/weights/{}_weights_config.json", "weight_"),
                                      ("constants", "data/constants/{}_constants_config.json", "tensor_")):
                rel = fmt.format(model)
                if rel not in files:
                    raise refuse(f"no {rel} (a {kind} config is required)")
                try:
                    config = json.loads(read(rel)).get("config", {})
                except (ValueError, AttributeError) as e:
                    raise refuse(f"{rel} is not a valid JSON payload config ({e})") from None
                if not isinstance(config, dict):
                    raise refuse(f"{rel} is not a valid JSON payload config")
                for fqn, meta in config.items():
                    if not isinstance(meta, dict):
                        raise refuse(f"{rel}: entry {fqn!r} is not an object")
                    if meta.get("use_pickle") is not False:
                        raise refuse(f"{kind} {fqn!r} stored pickled (use_pickle in {rel})")
                    path_name = str(meta.get("path_name", ""))
                    if path_name.startswith("custom_obj_"):
                        raise refuse(f"constant {fqn!r} is a pickled TorchScript custom object ({rel})")
                    if not path_name.startswith(prefix) or f"data/{kind}/{path_name}" not in files:
                        raise refuse(f"{rel}: {kind} {fqn!r} points at {path_name!r}, "
                                     f"not a raw {prefix}N file of the archive")

            rel = f"data/sample_inputs/{model}.pt"
            if rel in files:
                try:
                    torch.load(io.BytesIO(read(rel)), map_location="cpu", weights_only=True)
                except Exception as e:  # noqa: BLE001 - any failure means torch would retry with pickle
                    raise refuse(f"sample inputs {rel} cannot be loaded with weights_only=True ({e})") from None

            rel = f"models/{model}.json"
            try:
                graph = json.loads(read(rel))
            except ValueError as e:
                raise refuse(f"{rel} is not valid JSON ({e})") from None
            targets: set[str] = set()
            _graph_targets(graph, targets)
            for target in sorted(targets):
                obj = _resolve_target(target)
                if isinstance(obj, (OpOverload, HigherOrderOperator)):
                    continue
                try:
                    if obj is not None and obj in allowed_python:
                        continue
                except TypeError:  # unhashable
                    pass
                raise refuse(f"graph {rel} calls {target!r}, which is not a PyTorch operator")


def _param_str(config, key: str) -> str | None:
    param = config.parameters.get(key) if config.parameters else None
    return param.string_value if param is not None and param.string_value else None


class PyTorchBackend(Backend):
    """A ``torch.export`` program run eagerly (``ExportedProgram.module()``) on the CPU or a CUDA device.

    Args:
        version_dir, config, device: see :class:`~inferd.backends.base.Backend`.
        num_threads: PyTorch's intra-op threads (process-wide: ``torch.set_num_threads``); defaults to
            the config's ``num_threads`` parameter, else :func:`inferd.config.cpu_threads` (PyTorch's own
            default follows the affinity but not a container's CPU quota).
        batch_invariant: run a batch one row at a time, so that a row's outputs are bit-identical
            whatever batch the dynamic batcher put it in. PyTorch's CPU kernels (oneDNN 1x1
            convolutions, MKL matrix products) choose their blocking from the batch size and the thread
            count, so a row batched with others can differ from the same row alone by an ulp. Defaults
            to the config's ``batch_invariant`` parameter (``true``/``false``), else ``True`` on the CPU
            and ``False`` on CUDA.

    Raises:
        BackendError: the file is missing, a TorchScript file, unsafe (see :func:`check_pt2_archive`),
            or its inputs and outputs do not match the config.
    """

    def __init__(self, version_dir: str, config, device: str, num_threads: int | None = None,
                 batch_invariant: bool | None = None) -> None:
        super().__init__(version_dir, config, device)
        import torch

        filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
        self.model_path = os.path.join(version_dir, filename)
        torchscript = os.path.join(version_dir, "model.pt")
        if filename.endswith((".pt", ".pth", ".ts")) or (
                not config.default_model_filename and not os.path.exists(self.model_path)
                and os.path.exists(torchscript)):
            shown = self.model_path if filename.endswith((".pt", ".pth", ".ts")) else torchscript
            raise BackendError(f"{shown}: TorchScript / pickled model files are not loaded (unpickling can run "
                               "code); export the model with torch.export.export, save it with "
                               f"torch.export.save as {DEFAULT_MODEL_FILENAME}, and use that file")
        if not os.path.isfile(self.model_path):
            raise BackendError(f"{self.model_path}: model file not found")

        if num_threads is None and (value := _param_str(config, "num_threads")) is not None:
            try:
                num_threads = int(value)
            except ValueError:
                raise BackendError(f"parameter num_threads must be an integer, got {value!r}") from None
        self.num_threads = num_threads if num_threads and num_threads > 0 else cpu_threads()[0]
        if batch_invariant is None and (value := _param_str(config, "batch_invariant")) is not None:
            if value.lower() not in ("true", "false", "1", "0"):
                raise BackendError(f"parameter batch_invariant must be true or false, got {value!r}")
            batch_invariant = value.lower() in ("true", "1")
        if batch_invariant is None:
            batch_invariant = not device.startswith("cuda")
        self.batch_invariant = bool(batch_invariant) and config.max_batch_size > 0

        check_pt2_archive(self.model_path)
        try:
            program = torch.export.load(self.model_path)
        except Exception as e:  # noqa: BLE001 - deserialisation raises many types
            raise BackendError(f"{self.model_path}: torch.export.load failed: {e}") from e
        self._check_signature(program)
        try:
            module = program.module()
            self.torch_device = torch.device(device)
            if self.torch_device.type != "cpu":
                module = module.to(self.torch_device)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"{self.model_path}: cannot prepare the program on {device}: {e}") from e
        self.module = module
        self.output_names = [o.name for o in config.output]

    def _check_signature(self, program) -> None:
        import torch

        sig = program.graph_signature
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        user_inputs = [placeholders[name] for name in sig.user_inputs if name in placeholders]
        output_node = next(n for n in program.graph.nodes if n.op == "output")
        returned = list(output_node.args[0])
        n_non_user = len(sig.output_specs) - len(sig.user_outputs)  # buffer mutations come first
        user_outputs = returned[n_non_user:]

        for t in list(self.config.input) + list(self.config.output):
            if t.data_type not in _TORCH_DTYPES:
                raise BackendError(f"{self.model_path}: {t.name!r} is {mc.DataType.Name(t.data_type)}, which the "
                                   "pytorch backend does not support")
        if len(user_inputs) != len(self.config.input):
            raise BackendError(f"{self.model_path}: the program takes {len(user_inputs)} tensor input(s), the "
                               f"config declares {len(self.config.input)}")
        if len(user_outputs) != len(self.config.output):
            raise BackendError(f"{self.model_path}: the program returns {len(user_outputs)} output(s), the "
                               f"config declares {len(self.config.output)}")
        arg_names = [n.name for n in user_inputs]
        config_names = [t.name for t in self.config.input]
        if sorted(arg_names) == sorted(config_names):
            self.input_order = arg_names  # by name
            by_name = dict(zip(arg_names, user_inputs))
            pairs = [(t, by_name[t.name]) for t in self.config.input]
        else:
            self.input_order = config_names  # positional, config order
            pairs = list(zip(self.config.input, user_inputs))
        batched = self.config.max_batch_size > 0
        for kind, items in (("input", pairs), ("output", list(zip(self.config.output, user_outputs)))):
            for t, node in items:
                val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
                if not isinstance(val, torch.Tensor):
                    raise BackendError(f"{self.model_path}: {kind} {t.name!r} is not a tensor in the program")
                want = getattr(torch, _TORCH_DTYPES[t.data_type])
                if val.dtype != want:
                    raise BackendError(f"{self.model_path}: {kind} {t.name!r} is {mc.DataType.Name(t.data_type)} "
                                       f"in the config but {val.dtype} in the program")
                dims = ([-1] if batched else []) + list(t.dims)
                shape = list(val.shape)
                static = [d if isinstance(d, int) else -1 for d in shape]
                if len(shape) != len(dims) or any(
                        s != -1 and d != -1 and s != d for i, (s, d) in enumerate(zip(static, dims))
                        if not (batched and i == 0)):
                    raise BackendError(f"{self.model_path}: {kind} {t.name!r} has shape {dims} in the config "
                                       f"(batch first) but {static} in the program (-1: dynamic)")
                if batched and isinstance(shape[0], int) and self.config.max_batch_size > 1 \
                        and not (self.batch_invariant and shape[0] == 1):
                    raise BackendError(f"{self.model_path}: {kind} {t.name!r} has a fixed batch dimension "
                                       f"{shape[0]} in the program; export it with a dynamic batch "
                                       "(torch.export.Dim) to serve max_batch_size "
                                       f"{self.config.max_batch_size}")

    def _run(self, tensors: list) -> list:
        result = self.module(*tensors)
        if not isinstance(result, (tuple, list)):
            result = [result]
        return list(result)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        tensors = []
        for name in self.input_order:
            arr = inputs[name]
            if not arr.flags.writeable or not arr.flags.c_contiguous:
                arr = np.array(arr, copy=True, order="C")
            tensors.append(torch.from_numpy(arr).to(self.torch_device))
        try:
            with torch.inference_mode():
                if self.batch_invariant and tensors and tensors[0].shape[0] > 1:
                    rows = [self._run([t[i:i + 1] for t in tensors]) for i in range(tensors[0].shape[0])]
                    outputs = [torch.cat(parts) for parts in zip(*rows)]
                else:
                    outputs = self._run(tensors)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"pytorch run failed: {e}") from e
        if len(outputs) != len(self.output_names):
            raise BackendError(f"the program returned {len(outputs)} outputs, the config declares "
                               f"{len(self.output_names)}")
        return {name: out.detach().cpu().numpy() for name, out in zip(self.output_names, outputs)}

    def close(self) -> None:
        self.module = None
