"""KServe v2 (Open Inference Protocol) tensors: wire requests -> validated numpy, numpy -> wire responses.

This module is pure numpy plus the protobuf classes shipped with ``tritonclient``; it knows nothing
about HTTP routing, gRPC servicers, batching or model repositories. It covers:

* KServe v2 REST, "Inference Request JSON Object" (``$inference_request``, ``$request_input``,
  ``$request_output``) and "Inference Response JSON Object" (``$inference_response``,
  ``$response_output``), with "Tensor Data" given as a nested or flat row-major JSON array.
* Triton's "Binary Tensor Data Extension" (docs/protocol/extension_binary_data.md): the JSON object
  is followed by raw little-endian tensor bytes; the ``Inference-Header-Content-Length`` HTTP header
  gives the JSON length; ``parameters.binary_data_size`` on an input gives its byte count (inputs
  consume the binary section in the order they are listed); an output is returned as binary when
  its ``parameters.binary_data`` is true, or, when it does not say, when the request-level
  ``parameters.binary_data_output`` is true. BOOL is one byte (0 or 1) per element; BYTES elements
  are a 4-byte little-endian unsigned length followed by that many bytes.
* KServe v2 gRPC, ``ModelInfer`` (``ModelInferRequest`` / ``ModelInferResponse``): tensor data in
  ``raw_input_contents`` / ``raw_output_contents`` (same byte layout as the binary extension; one
  entry per input, in input order, and then no input may also carry ``contents``) or in the typed
  ``InferTensorContents`` fields (``bool_contents``, ``int_contents`` for INT8/16/32,
  ``int64_contents``, ``uint_contents`` for UINT8/16/32, ``uint64_contents``, ``fp32_contents``,
  ``fp64_contents``, ``bytes_contents``; FP16 and BF16 have no typed field and need raw contents).
* Checking a decoded request against a Triton ``ModelConfig`` (inputs, datatypes, dims, batching).

Datatypes ("Tensor Data Types" in the spec) and their numpy dtypes::

    BOOL bool | UINT8 uint8 | UINT16 uint16 | UINT32 uint32 | UINT64 uint64
    INT8 int8 | INT16 int16 | INT32 int32 | INT64 int64
    FP16 float16 | FP32 float32 | FP64 float64
    BYTES object (each element a Python ``bytes``)
    BF16 ml_dtypes.bfloat16 (binary / raw contents only; only if ml_dtypes is importable)

Decoded input arrays are C-contiguous, native byte order, writable and own their memory (they do not
keep the request body alive). Every problem with a request raises :class:`TensorError`, whose message
is meant to be sent to the client verbatim as ``{"error": message}`` with HTTP 400 (gRPC
INVALID_ARGUMENT). Problems with what the *model* produced (a missing output, a numpy dtype with no
KServe datatype) raise plain ``ValueError`` (a server fault: HTTP 500 / gRPC INTERNAL).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2

from inferd.server.limits import codec_name, decode_message, json_codec

try:  # BF16 has no numpy dtype of its own; tritonclient itself uses ml_dtypes.bfloat16.
    import ml_dtypes as _ml_dtypes

    _BF16_DTYPE: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes ships with tritonclient
    _BF16_DTYPE = None

__all__ = [
    "HEADER_CONTENT_LENGTH",
    "DATATYPES",
    "TensorError",
    "InferInput",
    "RequestedOutput",
    "InferRequest",
    "parse_header_length",
    "decode_http_request",
    "decode_grpc_request",
    "validate_inputs",
    "encode_http_response",
    "encode_grpc_response",
    "datatype_to_numpy",
    "numpy_to_datatype",
    "config_datatype",
]

#: HTTP header giving the length in bytes of the JSON object when binary tensor data follows it.
HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"

#: The KServe v2 tensor datatypes this module accepts (BF16 only when ml_dtypes is importable).
DATATYPES: tuple[str, ...] = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
) + (("BF16",) if _BF16_DTYPE is not None else ())

# Wire (little-endian) dtype of each fixed-size datatype; BYTES has none.
_WIRE_DTYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype("|b1"),
    "UINT8": np.dtype("|u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("|i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
if _BF16_DTYPE is not None:
    _WIRE_DTYPE["BF16"] = _BF16_DTYPE  # ml_dtypes types are native-order; every supported host is little-endian

_INT_RANGE: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(_WIRE_DTYPE[name]).min), int(np.iinfo(_WIRE_DTYPE[name]).max))
    for name in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
}

# model_config.proto DataType <-> KServe datatype (TYPE_STRING is BYTES on the wire).
_CONFIG_TO_DATATYPE: dict[int, str] = {
    model_config_pb2.TYPE_BOOL: "BOOL",
    model_config_pb2.TYPE_UINT8: "UINT8",
    model_config_pb2.TYPE_UINT16: "UINT16",
    model_config_pb2.TYPE_UINT32: "UINT32",
    model_config_pb2.TYPE_UINT64: "UINT64",
    model_config_pb2.TYPE_INT8: "INT8",
    model_config_pb2.TYPE_INT16: "INT16",
    model_config_pb2.TYPE_INT32: "INT32",
    model_config_pb2.TYPE_INT64: "INT64",
    model_config_pb2.TYPE_FP16: "FP16",
    model_config_pb2.TYPE_FP32: "FP32",
    model_config_pb2.TYPE_FP64: "FP64",
    model_config_pb2.TYPE_STRING: "BYTES",
    model_config_pb2.TYPE_BF16: "BF16",
}

# InferTensorContents field that carries each datatype (gRPC "Tensor Data").
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_MAX_NDIM = 64  # numpy's limit
_MAX_DIM = 2**63 - 1  # dims are int64 in the protocol
_UNSUPPORTED_INPUT_PARAMS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


# --------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------


class TensorError(ValueError):
    """A request that is malformed or does not fit the model; a client error (HTTP 400).

    Attributes:
        message: the text to return to the client as ``{"error": message}``.
        input_name: the tensor (input, or requested output) the problem is about, or None when it
            is about the request as a whole.
    """

    def __init__(self, message: str, input_name: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.input_name = input_name


@dataclass
class InferInput:
    """One decoded input tensor (``$request_input`` / ``ModelInferRequest.InferInputTensor``).

    ``data`` has ``data.shape == tuple(shape)`` and the numpy dtype of ``datatype`` (see the module
    docstring; BYTES is an object array of ``bytes``). ``parameters`` holds the input's other
    parameters (``binary_data_size`` removed).
    """

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestedOutput:
    """One requested output (``$request_output`` / ``InferRequestedOutputTensor``).

    ``binary`` is the output's ``parameters.binary_data`` (True/False), or None when the request did
    not say (then the request-level ``binary_data_output`` decides). Always None for gRPC.
    """

    name: str
    binary: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A decoded inference request (``$inference_request`` / ``ModelInferRequest``).

    ``id`` is "" when the client sent none. ``parameters`` are the request-level parameters as plain
    Python values. ``outputs`` is empty when the client did not name outputs (then every output is
    returned).
    """

    id: str
    parameters: dict[str, Any]
    inputs: list[InferInput]
    outputs: list[RequestedOutput]

    @property
    def binary_data_output(self) -> bool:
        """The request-level ``parameters.binary_data_output`` (binary extension); False if absent."""
        return self.parameters.get("binary_data_output") is True


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A short JSON-style rendering of a client value for error messages."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def datatype_to_numpy(datatype: str) -> np.dtype:
    """The numpy dtype (native byte order) that decoded tensors of a KServe ``datatype`` have.

    Raises:
        ValueError: ``datatype`` is not a supported KServe datatype.
    """
    if datatype == "BYTES":
        return np.dtype(object)
    wire = _WIRE_DTYPE.get(datatype)
    if wire is None:
        raise ValueError(f"unsupported datatype {datatype!r}")
    return wire if wire.byteorder in "|=" or datatype == "BF16" else wire.newbyteorder("=")


def numpy_to_datatype(dtype: np.dtype | type) -> str | None:
    """The KServe datatype of a numpy dtype, or None if it has none.

    bool -> BOOL, intN/uintN -> INTN/UINTN, float16/32/64 -> FP16/32/64, ml_dtypes.bfloat16 -> BF16,
    object / bytes_ (``S``) / str_ (``U``) -> BYTES.
    """
    dtype = np.dtype(dtype)
    if _BF16_DTYPE is not None and dtype == _BF16_DTYPE:
        return "BF16"
    kind, size = dtype.kind, dtype.itemsize
    if kind == "b":
        return "BOOL"
    if kind == "i" and size in (1, 2, 4, 8):
        return f"INT{size * 8}"
    if kind == "u" and size in (1, 2, 4, 8):
        return f"UINT{size * 8}"
    if kind == "f" and size in (2, 4, 8):
        return f"FP{size * 8}"
    if kind in "OSU":
        return "BYTES"
    return None


def config_datatype(data_type: int) -> str:
    """The KServe datatype for a ``model_config_pb2.DataType`` (e.g. TYPE_FP32 -> "FP32",
    TYPE_STRING -> "BYTES"). Raises ValueError for TYPE_INVALID or an unknown value."""
    try:
        return _CONFIG_TO_DATATYPE[data_type]
    except KeyError:
        raise ValueError(f"model config data_type {data_type} has no KServe datatype") from None


def parse_header_length(value: str | None) -> int | None:
    """Parse the ``Inference-Header-Content-Length`` header value (binary data extension).

    Returns None when the header is absent; raises TensorError unless it is a non-negative integer.
    """
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise TensorError(f"{HEADER_CONTENT_LENGTH} header must be a non-negative integer, got {value!r}")
    return int(text)


def _check_datatype(name: str, datatype: Any) -> str:
    if not isinstance(datatype, str):
        raise TensorError(f"input '{name}': 'datatype' must be a string, got {_show(datatype)}", name)
    if datatype not in DATATYPES:
        if datatype == "BF16":
            raise TensorError(
                f"input '{name}': datatype BF16 is not supported by this server (ml_dtypes is not installed)", name
            )
        raise TensorError(
            f"input '{name}': unsupported datatype {_show(datatype)}; expected one of {', '.join(DATATYPES)}", name
        )
    return datatype


def _check_shape(name: str, shape: Any) -> tuple[list[int], int]:
    """Validate a shape (list of non-negative ints); return it and its element count."""
    if not isinstance(shape, (list, tuple)):
        raise TensorError(
            f"input '{name}': 'shape' must be an array of non-negative integers, got {_show(shape)}", name
        )
    if len(shape) > _MAX_NDIM:
        raise TensorError(f"input '{name}': shape has {len(shape)} dimensions; at most {_MAX_NDIM} are supported", name)
    for i, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise TensorError(f"input '{name}': shape[{i}] must be a non-negative integer, got {_show(dim)}", name)
        if dim > _MAX_DIM:
            raise TensorError(f"input '{name}': shape[{i}] is {dim}, larger than the maximum {_MAX_DIM}", name)
    shape = [int(d) for d in shape]
    return shape, math.prod(shape)


def _reshape(name: str, flat: np.ndarray, shape: list[int]) -> np.ndarray:
    try:
        return flat.reshape(shape)
    except ValueError:  # only reachable for zero-element shapes whose other dims overflow numpy
        raise TensorError(f"input '{name}': shape {shape} is too large", name) from None


def _flatten(data: list) -> list:
    """Row-major flatten of nested JSON arrays, without recursion."""
    if not any(type(item) is list for item in data):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if type(item) is list:
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _fits_float64(value: int) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _first_index(values: list, bad) -> int:
    return next(i for i, v in enumerate(values) if bad(v))


# --------------------------------------------------------------------------------------------
# Tensor data: JSON values, typed gRPC contents, raw bytes
# --------------------------------------------------------------------------------------------


def _json_values_to_array(name: str, datatype: str, values: list) -> np.ndarray:
    """Convert a flat list of JSON values to a 1-D array of ``datatype`` (type- and range-checked)."""
    where = f"input '{name}': 'data' element"
    if datatype == "BOOL":
        if not all(type(v) is bool for v in values):
            i = _first_index(values, lambda v: type(v) is not bool)
            raise TensorError(f"{where} {i} must be true or false for BOOL, got {_show(values[i])}", name)
        return np.array(values, dtype=np.bool_).reshape(-1)
    if datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[datatype]
        if not all(type(v) is int for v in values):
            i = _first_index(values, lambda v: type(v) is not int)
            raise TensorError(f"{where} {i} must be an integer for {datatype}, got {_show(values[i])}", name)
        if values and (min(values) < lo or max(values) > hi):
            i = _first_index(values, lambda v: v < lo or v > hi)
            raise TensorError(
                f"{where} {i} is {_show(values[i])}, out of range for {datatype} [{lo}, {hi}]", name
            )
        return np.array(values, dtype=datatype_to_numpy(datatype)).reshape(-1)
    if datatype in ("FP16", "FP32", "FP64"):
        if not all(type(v) is float or type(v) is int for v in values):
            i = _first_index(values, lambda v: type(v) is not float and type(v) is not int)
            raise TensorError(f"{where} {i} must be a number for {datatype}, got {_show(values[i])}", name)
        try:
            wide = np.array(values, dtype=np.float64).reshape(-1)
        except OverflowError:  # a JSON integer beyond float64
            i = _first_index(values, lambda v: type(v) is int and not _fits_float64(v))
            raise TensorError(f"{where} {i} is {_show(values[i])}, out of range for {datatype}", name) from None
        if datatype == "FP64":
            return wide
        with np.errstate(over="ignore"):
            narrow = wide.astype(datatype_to_numpy(datatype))
        overflow = np.isinf(narrow) & np.isfinite(wide)
        if overflow.any():
            i = int(np.argmax(overflow))
            raise TensorError(f"{where} {i} is {_show(values[i])}, out of range for {datatype}", name)
        return narrow
    if datatype == "BYTES":
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            if type(v) is not str:
                raise TensorError(f"{where} {i} must be a string for BYTES, got {_show(v)}", name)
            try:
                out[i] = v.encode("utf-8")
            except UnicodeEncodeError:
                raise TensorError(f"{where} {i} is not a valid Unicode string (lone surrogate)", name) from None
        return out
    if datatype == "BF16":
        raise TensorError(
            f"input '{name}': BF16 data must be sent as binary data (parameters.binary_data_size); "
            "JSON 'data' is not supported for BF16",
            name,
        )
    raise AssertionError(datatype)  # pragma: no cover - datatype was validated


def _bytes_elements(name: str, buf: memoryview, count: int, shape: list[int], where: str) -> np.ndarray:
    """Parse ``count`` BYTES elements (4-byte LE length + bytes each) that must fill ``buf`` exactly."""
    size = len(buf)
    if count * 4 > size:
        raise TensorError(
            f"input '{name}': shape {shape} requires {count} BYTES elements (at least {count * 4} bytes) "
            f"but {where} has {size} bytes",
            name,
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for k in range(count):
        left = size - offset
        if left < 4:
            if left == 0:
                raise TensorError(
                    f"input '{name}': {where} holds only {k} BYTES elements but shape {shape} requires {count}", name
                )
            raise TensorError(f"input '{name}': {where} ends inside the length prefix of BYTES element {k}", name)
        (length,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        if length > size - offset:
            raise TensorError(
                f"input '{name}': BYTES element {k} declares length {length} but only {size - offset} bytes "
                f"remain in {where}",
                name,
            )
        out[k] = bytes(buf[offset : offset + length])
        offset += length
    if offset != size:
        raise TensorError(
            f"input '{name}': {where} has {size - offset} bytes left over after the {count} BYTES elements "
            f"that shape {shape} requires",
            name,
        )
    return out


def _fixed_size_mismatch(name: str, datatype: str, shape: list[int], count: int, got: str) -> TensorError:
    itemsize = _WIRE_DTYPE[datatype].itemsize
    return TensorError(
        f"input '{name}': shape {shape} of {datatype} requires {count * itemsize} bytes "
        f"({count} elements x {itemsize} bytes) but {got}",
        name,
    )


def _raw_to_array(name: str, datatype: str, shape: list[int], count: int, buf: memoryview, where: str) -> np.ndarray:
    """Decode raw little-endian tensor bytes (binary extension / raw_input_contents). For fixed-size
    datatypes the caller has already checked ``len(buf) == count * itemsize``."""
    if datatype == "BYTES":
        return _reshape(name, _bytes_elements(name, buf, count, shape, where), shape)
    wire = _WIRE_DTYPE[datatype]
    if datatype == "BOOL":
        as_bytes = np.frombuffer(buf, dtype=np.uint8, count=count)
        if count and as_bytes.max() > 1:
            i = int(np.argmax(as_bytes > 1))
            raise TensorError(
                f"input '{name}': BOOL element {i} is byte {int(as_bytes[i])}; BOOL binary data must be 0 or 1", name
            )
    flat = np.frombuffer(buf, dtype=wire, count=count).astype(datatype_to_numpy(datatype), copy=True)
    return _reshape(name, flat, shape)


# --------------------------------------------------------------------------------------------
# HTTP/REST request
# --------------------------------------------------------------------------------------------


def _json_object(value: Any, what: str, input_name: str | None = None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TensorError(f"{what} must be a JSON object, got {_show(value)}", input_name)
    return value


def _decode_requested_outputs_http(outputs: Any) -> list[RequestedOutput]:
    if outputs is None:
        return []
    if not isinstance(outputs, list):
        raise TensorError(f"'outputs' must be a JSON array, got {_show(outputs)}")
    result: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise TensorError(f"outputs[{i}] must be a JSON object, got {_show(out)}")
        name = out.get("name")
        if not isinstance(name, str) or not name:
            raise TensorError(f"outputs[{i}]: 'name' must be a non-empty string, got {_show(name)}")
        if name in seen:
            raise TensorError(f"output '{name}' is requested more than once", name)
        seen.add(name)
        params = dict(_json_object(out.get("parameters"), f"output '{name}': 'parameters'", name))
        binary = params.get("binary_data")
        if binary is not None and type(binary) is not bool:
            raise TensorError(
                f"output '{name}': parameters.binary_data must be true or false, got {_show(binary)}", name
            )
        _reject_output_extensions(name, params)
        result.append(RequestedOutput(name=name, binary=binary, parameters=params))
    return result


def _reject_output_extensions(name: str, params: dict) -> None:
    if "classification" in params:
        raise TensorError(f"output '{name}': the classification extension is not supported by this server", name)
    if "shared_memory_region" in params:
        raise TensorError(f"output '{name}': shared memory outputs are not supported by this server", name)


def decode_http_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode a KServe v2 REST inference request body (``POST /v2/models/{m}[/versions/{v}]/infer``).

    Args:
        body: the whole HTTP body: the ``$inference_request`` JSON object, followed, when
            ``header_length`` is given, by binary tensor data (Triton binary data extension).
        header_length: the ``Inference-Header-Content-Length`` header as an int (see
            :func:`parse_header_length`), or None when absent (the body is all JSON).

    Each ``$request_input`` needs ``name``, ``datatype`` (a KServe datatype), ``shape`` (non-negative
    ints) and either ``data`` (nested or flat row-major JSON array: true/false for BOOL, integers
    for INT*/UINT* within range, numbers for FP* (NaN/Infinity accepted), strings for BYTES, which
    become UTF-8 ``bytes``; BF16 is rejected in JSON) or ``parameters.binary_data_size`` (bytes
    taken, in input order, from the binary section). The nesting of ``data`` is not checked
    against ``shape``; only the element count is. The element count implied by ``shape`` is
    compared with the data actually present before any array is allocated, so a huge shape with
    little data is rejected cheaply. Unclaimed binary bytes, duplicate input names and shared-memory
    parameters are errors.

    Returns:
        the request with one :class:`InferInput` per input, in request order.

    Raises:
        TensorError: anything malformed; the message names the input at fault.
    """
    view = memoryview(body).cast("B")
    if header_length is None:
        json_bytes, binary = view, view[len(view) :]
    else:
        if isinstance(header_length, bool) or not isinstance(header_length, int) or header_length < 0:
            raise TensorError(f"{HEADER_CONTENT_LENGTH} must be a non-negative integer, got {header_length!r}")
        if header_length > len(view):
            raise TensorError(
                f"{HEADER_CONTENT_LENGTH} is {header_length} but the request body has only {len(view)} bytes"
            )
        json_bytes, binary = view[:header_length], view[header_length:]

    raw = bytes(json_bytes)
    # UTF-8 (its byte order mark ignored), or the UTF-16 or UTF-32 that the first bytes announce, as the OpenAI
    # routes' json.loads reads them.
    codec, bom = json_codec(raw)
    read_as = "" if codec == "utf-8" else f" (the body was read as {codec_name(codec)}, as its first bytes announce)"
    try:
        text = raw[bom:].decode(codec)
    except UnicodeDecodeError as e:
        raise TensorError(decode_message(e, bom, codec)) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TensorError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}{read_as}") \
            from None
    except RecursionError:
        raise TensorError("request body is not valid JSON: arrays or objects nested too deeply") from None
    except ValueError:  # an integer of more digits than int() takes (sys.get_int_max_str_digits())
        raise TensorError(f"request body is not valid JSON: a number with more than {sys.get_int_max_str_digits()} "
                          "digits") from None
    if not isinstance(doc, dict):
        raise TensorError(f"request body must be a JSON object, got {_show(doc)}")

    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise TensorError(f"'id' must be a string, got {_show(request_id)}")
    parameters = dict(_json_object(doc.get("parameters"), "'parameters'"))
    bdo = parameters.get("binary_data_output")
    if bdo is not None and type(bdo) is not bool:
        raise TensorError(f"parameters.binary_data_output must be true or false, got {_show(bdo)}")

    if "inputs" not in doc:
        raise TensorError("request body has no 'inputs' array")
    raw_inputs = doc["inputs"]
    if not isinstance(raw_inputs, list):
        raise TensorError(f"'inputs' must be a JSON array, got {_show(raw_inputs)}")

    inputs: list[InferInput] = []
    seen: set[str] = set()
    offset = 0
    for idx, spec in enumerate(raw_inputs):
        if not isinstance(spec, dict):
            raise TensorError(f"inputs[{idx}] must be a JSON object, got {_show(spec)}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise TensorError(f"inputs[{idx}]: 'name' must be a non-empty string, got {_show(name)}")
        if name in seen:
            raise TensorError(f"duplicate input '{name}'", name)
        seen.add(name)
        if "datatype" not in spec:
            raise TensorError(f"input '{name}': 'datatype' is required", name)
        datatype = _check_datatype(name, spec["datatype"])
        if "shape" not in spec:
            raise TensorError(f"input '{name}': 'shape' is required", name)
        shape, count = _check_shape(name, spec["shape"])
        params = dict(_json_object(spec.get("parameters"), f"input '{name}': 'parameters'", name))
        for key in _UNSUPPORTED_INPUT_PARAMS:
            if key in params:
                raise TensorError(
                    f"input '{name}': shared memory (parameters.{key}) is not supported by this server", name
                )

        if "binary_data_size" in params:
            size = params.pop("binary_data_size")
            if "data" in spec:
                raise TensorError(
                    f"input '{name}': has both 'data' and parameters.binary_data_size; send only one", name
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise TensorError(
                    f"input '{name}': parameters.binary_data_size must be a non-negative integer, got {_show(size)}",
                    name,
                )
            if datatype != "BYTES" and size != count * _WIRE_DTYPE[datatype].itemsize:
                raise _fixed_size_mismatch(name, datatype, shape, count, f"parameters.binary_data_size is {size}")
            left = len(binary) - offset
            if size > left:
                hint = f" (no {HEADER_CONTENT_LENGTH} header was given)" if header_length is None else ""
                raise TensorError(
                    f"input '{name}': parameters.binary_data_size is {size} but only {left} bytes of binary data "
                    f"remain in the request body{hint}",
                    name,
                )
            chunk = binary[offset : offset + size]
            offset += size
            array = _raw_to_array(name, datatype, shape, count, chunk, "its binary data")
        else:
            if "data" not in spec:
                raise TensorError(f"input '{name}': has neither 'data' nor parameters.binary_data_size", name)
            data = spec["data"]
            if datatype == "BF16":
                _json_values_to_array(name, datatype, [])  # raises the BF16-needs-binary error
            if not isinstance(data, list):
                raise TensorError(f"input '{name}': 'data' must be a JSON array, got {_show(data)}", name)
            values = _flatten(data)
            if len(values) != count:
                raise TensorError(
                    f"input '{name}': shape {shape} requires {count} elements but 'data' has {len(values)}", name
                )
            array = _reshape(name, _json_values_to_array(name, datatype, values), shape)
        inputs.append(InferInput(name=name, datatype=datatype, shape=shape, data=array, parameters=params))

    if offset != len(binary):
        raise TensorError(
            f"request body has {len(binary) - offset} bytes of binary data that no input claims "
            f"(binary section is {len(binary)} bytes, inputs' binary_data_size total {offset})"
        )
    outputs = _decode_requested_outputs_http(doc.get("outputs"))
    return InferRequest(id=request_id, parameters=parameters, inputs=inputs, outputs=outputs)


# --------------------------------------------------------------------------------------------
# gRPC request
# --------------------------------------------------------------------------------------------


def _grpc_parameters(params) -> dict[str, Any]:
    """``map<string, InferParameter>`` -> plain Python values (bool/int/str/float)."""
    out: dict[str, Any] = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which is not None else None
    return out


def _typed_contents_to_array(
    name: str, datatype: str, shape: list[int], count: int, contents: service_pb2.InferTensorContents
) -> np.ndarray:
    present = [fd.name for fd, _ in contents.ListFields()]
    wanted = _CONTENTS_FIELD.get(datatype)
    if wanted is None:  # FP16, BF16
        raise TensorError(
            f"input '{name}': {datatype} data must be sent in raw_input_contents; "
            f"InferTensorContents has no field for {datatype}",
            name,
        )
    stray = [f for f in present if f != wanted]
    if stray:
        raise TensorError(
            f"input '{name}': {datatype} data must be in contents.{wanted}, found contents.{stray[0]}", name
        )
    values = getattr(contents, wanted)
    if len(values) != count:
        raise TensorError(
            f"input '{name}': shape {shape} requires {count} elements but contents.{wanted} has {len(values)}", name
        )
    if datatype == "BYTES":
        flat = np.empty(count, dtype=object)
        for i, v in enumerate(values):
            flat[i] = bytes(v)
        return _reshape(name, flat, shape)
    if datatype == "BOOL":
        return _reshape(name, np.array(list(values), dtype=np.bool_).reshape(-1), shape)
    target = datatype_to_numpy(datatype)
    if datatype in ("INT8", "INT16", "UINT8", "UINT16"):
        wide = np.array(list(values), dtype=np.int64).reshape(-1)
        lo, hi = _INT_RANGE[datatype]
        bad = (wide < lo) | (wide > hi)
        if bad.any():
            i = int(np.argmax(bad))
            raise TensorError(
                f"input '{name}': contents.{wanted} element {i} is {int(wide[i])}, out of range for "
                f"{datatype} [{lo}, {hi}]",
                name,
            )
        return _reshape(name, wide.astype(target), shape)
    return _reshape(name, np.array(list(values), dtype=target).reshape(-1), shape)


def decode_grpc_request(req: service_pb2.ModelInferRequest) -> InferRequest:
    """Decode a KServe v2 gRPC ``ModelInfer`` request (``inference.ModelInferRequest``).

    Tensor data comes either from ``raw_input_contents`` (what tritonclient.grpc sends: one entry
    per input, in input order, same byte layout as the binary data extension; when it is used no
    input may also set ``contents``) or from each input's typed ``contents`` field for its datatype
    (see the module docstring; INT8/INT16 and UINT8/UINT16 values are range-checked). Shapes,
    element counts, datatypes and duplicate names are validated exactly as for
    :func:`decode_http_request`, and data sizes are checked before arrays are allocated.

    Returns:
        the request; ``parameters`` are converted from ``InferParameter`` to Python values, and
        every :class:`RequestedOutput` has ``binary=None``.

    Raises:
        TensorError: anything malformed; the message names the input at fault.
    """
    parameters = _grpc_parameters(req.parameters)
    raw = req.raw_input_contents
    if len(raw) and len(raw) != len(req.inputs):
        raise TensorError(
            f"raw_input_contents has {len(raw)} entries but the request has {len(req.inputs)} inputs; "
            "when raw_input_contents is used it must hold one entry per input"
        )
    inputs: list[InferInput] = []
    seen: set[str] = set()
    for idx, tensor in enumerate(req.inputs):
        name = tensor.name
        if not name:
            raise TensorError(f"inputs[{idx}]: 'name' must be a non-empty string")
        if name in seen:
            raise TensorError(f"duplicate input '{name}'", name)
        seen.add(name)
        datatype = _check_datatype(name, tensor.datatype)
        shape, count = _check_shape(name, list(tensor.shape))
        params = _grpc_parameters(tensor.parameters)
        for key in _UNSUPPORTED_INPUT_PARAMS:
            if key in params:
                raise TensorError(
                    f"input '{name}': shared memory (parameters.{key}) is not supported by this server", name
                )
        if len(raw):
            if tensor.contents.ListFields():
                raise TensorError(
                    f"input '{name}': has both contents and raw_input_contents[{idx}]; when raw_input_contents "
                    "is used no input may set contents",
                    name,
                )
            buf = memoryview(raw[idx])
            if datatype != "BYTES" and len(buf) != count * _WIRE_DTYPE[datatype].itemsize:
                raise _fixed_size_mismatch(
                    name, datatype, shape, count, f"raw_input_contents[{idx}] has {len(buf)} bytes"
                )
            array = _raw_to_array(name, datatype, shape, count, buf, f"raw_input_contents[{idx}]")
        else:
            array = _typed_contents_to_array(name, datatype, shape, count, tensor.contents)
        inputs.append(InferInput(name=name, datatype=datatype, shape=shape, data=array, parameters=params))

    outputs: list[RequestedOutput] = []
    seen_out: set[str] = set()
    for idx, out in enumerate(req.outputs):
        if not out.name:
            raise TensorError(f"outputs[{idx}]: 'name' must be a non-empty string")
        if out.name in seen_out:
            raise TensorError(f"output '{out.name}' is requested more than once", out.name)
        seen_out.add(out.name)
        out_params = _grpc_parameters(out.parameters)
        _reject_output_extensions(out.name, out_params)
        outputs.append(RequestedOutput(name=out.name, binary=None, parameters=out_params))
    return InferRequest(id=req.id, parameters=parameters, inputs=inputs, outputs=outputs)


# --------------------------------------------------------------------------------------------
# Validation against the model configuration
# --------------------------------------------------------------------------------------------


def _format_expected(dims: list[int], batched: bool) -> str:
    parts = (["batch"] if batched else []) + [str(d) for d in dims]
    return "[" + ", ".join(parts) + "]"


def validate_inputs(request: InferRequest, config: model_config_pb2.ModelConfig) -> dict[str, np.ndarray]:
    """Check a decoded request against the model's Triton ``ModelConfig``; return its input arrays.

    * every request input must be a declared ``config.input``; every declared input must be present
      unless it is ``optional``;
    * the datatype must equal the config's (``TYPE_FP32`` <-> ``FP32``, ``TYPE_STRING`` <-> ``BYTES``,
      ... see :func:`config_datatype`);
    * the shape must match ``dims`` (``-1`` matches any size). When ``config.max_batch_size > 0`` the
      shape has one extra leading batch dimension, ``1 <= batch <= max_batch_size``, equal across all
      inputs. The config's ``reshape`` is ignored (not supported): shapes are checked against ``dims``;
    * every requested output must be a declared ``config.output``.

    Returns:
        ``{input name: array}`` for the inputs present, in the config's input order.

    Raises:
        TensorError: the request does not fit the model; ``input_name`` names the tensor.
        ValueError: the config itself declares a datatype with no KServe equivalent (server fault).
    """
    model = config.name or "model"
    declared = {cfg.name: cfg for cfg in config.input}
    provided = {inp.name: inp for inp in request.inputs}
    for inp in request.inputs:
        if inp.name not in declared:
            expected = ", ".join(f"'{n}'" for n in declared) or "none"
            raise TensorError(f"unexpected input '{inp.name}' for model '{model}'; its inputs are {expected}", inp.name)
    missing = [n for n, cfg in declared.items() if n not in provided and not cfg.optional]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        names = ", ".join(f"'{n}'" for n in missing)
        raise TensorError(f"missing required input{plural} {names} for model '{model}'", missing[0])

    max_batch = int(config.max_batch_size)
    batched = max_batch > 0
    batch_size: int | None = None
    batch_from = ""
    result: dict[str, np.ndarray] = {}
    for name, cfg in declared.items():
        inp = provided.get(name)
        if inp is None:
            continue
        expected_type = config_datatype(cfg.data_type)
        if inp.datatype != expected_type:
            raise TensorError(
                f"input '{name}': datatype {inp.datatype} does not match model '{model}', which expects "
                f"{expected_type}",
                name,
            )
        dims = [int(d) for d in cfg.dims]
        shape = list(inp.shape)
        expected = _format_expected(dims, batched)
        wildcard = " (-1 means any size)" if -1 in dims else ""
        if len(shape) != len(dims) + (1 if batched else 0):
            raise TensorError(
                f"input '{name}': shape {shape} does not match model '{model}', which expects {expected}{wildcard}",
                name,
            )
        if batched:
            batch, shape = shape[0], shape[1:]
            if batch > max_batch:
                raise TensorError(
                    f"input '{name}': batch size {batch} exceeds max_batch_size {max_batch} of model '{model}'", name
                )
            if batch < 1:
                raise TensorError(
                    f"input '{name}': batch size 0 is invalid; model '{model}' accepts batch sizes 1 to {max_batch}",
                    name,
                )
            if batch_size is None:
                batch_size, batch_from = batch, name
            elif batch != batch_size:
                raise TensorError(
                    f"input '{name}': batch size {batch} differs from batch size {batch_size} of input '{batch_from}'",
                    name,
                )
        if any(d != -1 and d != s for d, s in zip(dims, shape)):
            raise TensorError(
                f"input '{name}': shape {list(inp.shape)} does not match model '{model}', which expects "
                f"{expected}{wildcard}",
                name,
            )
        result[name] = inp.data

    declared_outputs = [out.name for out in config.output]
    for out in request.outputs:
        if out.name not in declared_outputs:
            expected = ", ".join(f"'{n}'" for n in declared_outputs) or "none"
            raise TensorError(
                f"unexpected output '{out.name}' for model '{model}'; its outputs are {expected}", out.name
            )
    return result


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def _selected_outputs(
    outputs: dict[str, np.ndarray], requested: Iterable[RequestedOutput] | None
) -> list[tuple[str, np.ndarray, str, RequestedOutput | None]]:
    """(name, array, datatype, request) for each output to return: the requested ones in request
    order, or every output in dict order when none were requested."""
    requested = list(requested or [])
    pairs: list[tuple[str, RequestedOutput | None]] = (
        [(r.name, r) for r in requested] if requested else [(n, None) for n in outputs]
    )
    selected = []
    for name, req in pairs:
        if name not in outputs:
            raise ValueError(f"the model produced no output '{name}'")
        array = np.asarray(outputs[name])
        datatype = numpy_to_datatype(array.dtype)
        if datatype is None:
            raise ValueError(f"output '{name}': numpy dtype {array.dtype} has no KServe datatype")
        selected.append((name, array, datatype, req))
    return selected


def _element_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):  # includes np.bytes_
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return str(value).encode("utf-8")  # as tritonclient.utils.serialize_byte_tensor does


def _raw_output(array: np.ndarray, datatype: str) -> bytes:
    """Row-major little-endian bytes (binary extension / raw_output_contents layout)."""
    if datatype == "BYTES":
        parts = []
        for value in array.ravel(order="C").tolist():
            data = _element_bytes(value)
            if len(data) > 0xFFFFFFFF:
                raise ValueError("a BYTES output element is larger than 4 GiB")
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=_WIRE_DTYPE[datatype]).tobytes(order="C")


def _json_output_data(array: np.ndarray, datatype: str) -> list | None:
    """Flat row-major JSON values, or None for BYTES that are not all UTF-8 (send those as binary)."""
    flat = array.ravel(order="C")
    if datatype != "BYTES":
        return flat.tolist()
    values = []
    for value in flat.tolist():
        if isinstance(value, str):
            values.append(value)
            continue
        try:
            values.append(_element_bytes(value).decode("utf-8"))
        except UnicodeDecodeError:
            return None
    return values


def encode_http_response(
    model_name: str,
    model_version: str | int | None,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    requested: list[RequestedOutput] | None,
    binary_default: bool,
) -> tuple[bytes, int | None]:
    """Encode a KServe v2 REST inference response (``$inference_response``).

    Args:
        model_name, model_version: echoed as ``model_name`` / ``model_version`` (the version as a
            string; omitted when None or "").
        request_id: echoed as ``id`` when non-empty.
        outputs: the model's outputs by name; any shape; numpy dtype mapped by
            :func:`numpy_to_datatype` (object / ``S`` / ``U`` arrays are BYTES).
        requested: the request's outputs; when non-empty only these are returned, in this order,
            otherwise every entry of ``outputs`` in dict order.
        binary_default: the request's ``parameters.binary_data_output`` (binary data extension);
            used for outputs whose ``binary`` is None.

    Each ``$response_output`` has ``name``, ``datatype``, ``shape`` and either ``data`` (flat
    row-major JSON array; BYTES as strings) or ``parameters.binary_data_size`` with the bytes
    appended after the JSON in output order. BF16 outputs are always binary; a BYTES output that
    is not valid UTF-8 is sent as binary even if JSON was asked for. Non-finite floats in JSON are
    written as NaN / Infinity / -Infinity (as Python's and rapidjson's parsers accept).

    Returns:
        ``(body, header_length)``: ``header_length`` is the JSON length in bytes, to be sent as the
        ``Inference-Header-Content-Length`` header, or None when no output is binary.

    Raises:
        ValueError: a requested output is missing from ``outputs`` or has an unsupported dtype.
    """
    entries = []
    chunks: list[bytes] = []
    for name, array, datatype, req in _selected_outputs(outputs, requested):
        binary = req.binary if req is not None and req.binary is not None else bool(binary_default)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [int(d) for d in array.shape]}
        if datatype == "BF16":
            binary = True
        if not binary:
            data = _json_output_data(array, datatype)
            if data is None:
                binary = True
            else:
                entry["data"] = data
        if binary:
            raw = _raw_output(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        entries.append(entry)

    response: dict[str, Any] = {"model_name": model_name}
    if model_version is not None and str(model_version) != "":
        response["model_version"] = str(model_version)
    if request_id:
        response["id"] = request_id
    response["outputs"] = entries
    header = json.dumps(response, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def encode_grpc_response(
    model_name: str,
    model_version: str | int | None,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    requested: list[RequestedOutput] | None,
) -> service_pb2.ModelInferResponse:
    """Encode a KServe v2 gRPC ``ModelInferResponse``.

    Outputs are selected as in :func:`encode_http_response`. Each output's data goes to
    ``raw_output_contents`` (one entry per output, same order as ``outputs``; row-major
    little-endian, BOOL one byte, BYTES 4-byte length-prefixed), which is what
    ``tritonclient.grpc.InferResult.as_numpy`` reads.

    Raises:
        ValueError: a requested output is missing from ``outputs`` or has an unsupported dtype.
    """
    response = service_pb2.ModelInferResponse()
    response.model_name = model_name
    if model_version is not None:
        response.model_version = str(model_version)
    if request_id:
        response.id = request_id
    for name, array, datatype, _ in _selected_outputs(outputs, requested):
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(int(d) for d in array.shape)
        response.raw_output_contents.append(_raw_output(array, datatype))
    return response
