"""KServe v2 tensor codec (inferd/server/kserve_tensors.py) against the official Triton clients.

Requests are built with tritonclient's own code (``InferenceServerClient.generate_request_body`` for
HTTP, ``tritonclient.grpc._utils._get_inference_request`` for gRPC), so the bytes and protos are
exactly what the official clients put on the wire; responses are read back with tritonclient's
``InferResult`` classes. Malformed requests assert the exact error text the client will see.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import model_config_pb2 as mc  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402
from tritonclient.grpc._utils import _get_inference_request as _grpc_request  # noqa: E402
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor  # noqa: E402


def _load_module():
    # The module is pure numpy. Importing it as inferd.server.kserve_tensors would run
    # inferd/__init__.py, which imports the engine and torch; load it by path instead.
    if "inferd.server.kserve_tensors" in sys.modules:
        return sys.modules["inferd.server.kserve_tensors"]
    path = Path(__file__).resolve().parents[1] / "inferd" / "server" / "kserve_tensors.py"
    spec = importlib.util.spec_from_file_location("_inferd_kserve_tensors", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


kt = _load_module()
TensorError = kt.TensorError


# ------------------------------------------------------------------------------------------ helpers


def http_input(name, array, datatype, binary=True):
    tensor = tritonhttp.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def http_body(inputs, outputs=None, **kwargs):
    return tritonhttp.InferenceServerClient.generate_request_body(inputs, outputs=outputs, **kwargs)


def grpc_input(name, array, datatype):
    tensor = tritongrpc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def grpc_request(inputs, outputs=None, request_id=""):
    request = _grpc_request(
        model_name="m", inputs=inputs, model_version="", request_id=request_id, outputs=outputs,
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None,
    )
    # Through the wire format, as a gRPC server would receive it.
    return service_pb2.ModelInferRequest.FromString(request.SerializeToString())


def json_body(inputs, **extra):
    return json.dumps({"inputs": inputs, **extra}).encode()


def error_of(fn, *args) -> TensorError:
    with pytest.raises(TensorError) as info:
        fn(*args)
    return info.value


def config(inputs, outputs=(("y", mc.TYPE_FP32, [-1]),), max_batch_size=0, optional=()):
    return mc.ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        input=[mc.ModelInput(name=n, data_type=t, dims=d, optional=n in optional) for n, t, d in inputs],
        output=[mc.ModelOutput(name=n, data_type=t, dims=d) for n, t, d in outputs],
    )


def request_with(*inputs, outputs=()):
    return kt.InferRequest(
        id="",
        parameters={},
        inputs=[kt.InferInput(name=n, datatype=dt, shape=list(a.shape), data=a) for n, dt, a in inputs],
        outputs=[kt.RequestedOutput(name=o) for o in outputs],
    )


RNG = np.random.default_rng(0)
TENSORS = {
    "f32": (RNG.standard_normal((2, 3)).astype(np.float32), "FP32"),
    "i64": (np.array([[-(2**63), 2**63 - 1], [0, 7]], dtype=np.int64), "INT64"),
    "b": (np.array([True, False, True]), "BOOL"),
    "f16": (RNG.standard_normal((2, 2)).astype(np.float16), "FP16"),
    "s": (np.array([[b"hello", "h\u00e9llo".encode()], [b"", b"x" * 300]], dtype=object), "BYTES"),
}


def assert_same(got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert got.flags.c_contiguous and got.flags.writeable
    if want.dtype == object:
        assert got.tolist() == want.tolist()
    else:
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------- HTTP round trips


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_round_trip_all_types(binary):
    inputs = [http_input(n, a, dt, binary=binary) for n, (a, dt) in TENSORS.items()]
    body, header_length = http_body(inputs, request_id="req-1")
    assert (header_length is not None) == binary
    request = kt.decode_http_request(body, header_length)
    assert request.id == "req-1"
    assert [i.name for i in request.inputs] == list(TENSORS)
    for inp, (name, (array, datatype)) in zip(request.inputs, TENSORS.items()):
        assert inp.datatype == datatype and inp.shape == list(array.shape)
        assert_same(inp.data, array)
    # No outputs named: the client asks for binary_data_output, so every output comes back binary.
    assert request.outputs == [] and request.binary_data_output is True

    outputs = {inp.name: inp.data for inp in request.inputs}
    body, header_length = kt.encode_http_response("m", "1", request.id, outputs, request.outputs,
                                                  request.binary_data_output)
    assert header_length is not None
    result = tritonhttp.InferResult.from_response_body(body, header_length=header_length)
    response = result.get_response()
    assert response["model_name"] == "m" and response["model_version"] == "1" and response["id"] == "req-1"
    for name, (array, datatype) in TENSORS.items():
        assert result.get_output(name)["datatype"] == datatype
        got = result.as_numpy(name)
        if datatype == "BYTES":
            assert got.tolist() == array.tolist()
        else:
            np.testing.assert_array_equal(got, array)
            assert got.dtype == array.dtype


def test_http_requested_outputs_mixed_json_and_binary():
    arrays = {n: a for n, (a, _) in TENSORS.items()}
    requested_client = [
        tritonhttp.InferRequestedOutput("s", binary_data=False),
        tritonhttp.InferRequestedOutput("f32", binary_data=True),
        tritonhttp.InferRequestedOutput("b", binary_data=False),
        tritonhttp.InferRequestedOutput("i64", binary_data=False),
        tritonhttp.InferRequestedOutput("f16", binary_data=False),
    ]
    body, header_length = http_body([http_input("f32", arrays["f32"], "FP32")], outputs=requested_client)
    request = kt.decode_http_request(body, header_length)
    assert [(o.name, o.binary) for o in request.outputs] == [
        ("s", False), ("f32", True), ("b", False), ("i64", False), ("f16", False)]
    assert request.binary_data_output is False

    body, header_length = kt.encode_http_response("m", 3, "", arrays, request.outputs, False)
    header = json.loads(body[:header_length])
    assert "id" not in header and header["model_version"] == "3"
    assert [o["name"] for o in header["outputs"]] == ["s", "f32", "b", "i64", "f16"]
    by_name = {o["name"]: o for o in header["outputs"]}
    assert by_name["s"]["data"] == ["hello", "h\u00e9llo", "", "x" * 300]
    assert by_name["b"]["data"] == [True, False, True]
    assert by_name["f32"]["parameters"] == {"binary_data_size": 24}
    result = tritonhttp.InferResult.from_response_body(body, header_length=header_length)
    for name in by_name:
        got = result.as_numpy(name)
        if name == "s":
            assert got.tolist() == [[s.decode() for s in row] for row in arrays["s"].tolist()]
        else:
            np.testing.assert_array_equal(got, arrays[name])


def test_http_all_json_response_has_no_header_length():
    body, header_length = kt.encode_http_response(
        "m", "", "abc", {"y": np.arange(6, dtype=np.int32).reshape(2, 3)}, [], binary_default=False)
    assert header_length is None
    assert json.loads(body) == {"model_name": "m", "id": "abc", "outputs": [
        {"name": "y", "datatype": "INT32", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}]}
    np.testing.assert_array_equal(
        tritonhttp.InferResult.from_response_body(body).as_numpy("y"), np.arange(6).reshape(2, 3))


def test_http_non_utf8_bytes_output_falls_back_to_binary():
    array = np.array([b"\xff\xfe", b"ok"], dtype=object)
    body, header_length = kt.encode_http_response(
        "m", "1", "", {"s": array}, [kt.RequestedOutput("s", binary=False)], False)
    assert header_length is not None
    result = tritonhttp.InferResult.from_response_body(body, header_length=header_length)
    assert result.as_numpy("s").tolist() == [b"\xff\xfe", b"ok"]


def test_http_nested_and_flat_json_data_and_scalars():
    body = json_body([
        {"name": "a", "datatype": "INT8", "shape": [2, 2], "data": [[1, -128], [127, 0]]},
        {"name": "b", "datatype": "UINT64", "shape": [2], "data": [0, 2**64 - 1]},
        {"name": "c", "datatype": "FP64", "shape": [], "data": [1.5]},
        {"name": "d", "datatype": "FP32", "shape": [0, 3], "data": []},
    ], id="q", parameters={"custom": 1})
    request = kt.decode_http_request(body, None)
    a, b, c, d = (i.data for i in request.inputs)
    assert_same(a, np.array([[1, -128], [127, 0]], dtype=np.int8))
    assert_same(b, np.array([0, 2**64 - 1], dtype=np.uint64))
    assert_same(c, np.array(1.5))
    assert d.shape == (0, 3) and d.dtype == np.float32
    assert request.parameters == {"custom": 1}


def test_http_bf16_binary_round_trip():
    array = np.array([[1.0, -2.5], [0.125, 3.0]], dtype=ml_dtypes.bfloat16)
    body, header_length = http_body([http_input("x", array, "BF16")])
    request = kt.decode_http_request(body, header_length)
    assert_same(request.inputs[0].data, array)
    # BF16 outputs are always binary, even when JSON is asked for.
    body, header_length = kt.encode_http_response("m", "1", "", {"x": array}, [], False)
    assert header_length is not None
    np.testing.assert_array_equal(
        tritonhttp.InferResult.from_response_body(body, header_length=header_length).as_numpy("x"), array)


# ------------------------------------------------------------------------------- gRPC round trips


def test_grpc_round_trip_all_types():
    inputs = [grpc_input(n, a, dt) for n, (a, dt) in TENSORS.items()]
    outputs = [tritongrpc.InferRequestedOutput(n) for n in ("f16", "s", "f32")]
    request = kt.decode_grpc_request(grpc_request(inputs, outputs, request_id="g-7"))
    assert request.id == "g-7"
    for inp, (name, (array, datatype)) in zip(request.inputs, TENSORS.items()):
        assert (inp.name, inp.datatype, inp.shape) == (name, datatype, list(array.shape))
        assert_same(inp.data, array)
    assert [(o.name, o.binary) for o in request.outputs] == [("f16", None), ("s", None), ("f32", None)]

    response = kt.encode_grpc_response("m", "2", request.id, {i.name: i.data for i in request.inputs},
                                       request.outputs)
    response = service_pb2.ModelInferResponse.FromString(response.SerializeToString())
    assert (response.model_name, response.model_version, response.id) == ("m", "2", "g-7")
    result = tritongrpc.InferResult(response)
    assert [o.name for o in response.outputs] == ["f16", "s", "f32"]
    for name in ("f16", "s", "f32"):
        array, datatype = TENSORS[name]
        assert result.get_output(name).datatype == datatype
        got = result.as_numpy(name)
        if datatype == "BYTES":
            assert got.tolist() == array.tolist()
        else:
            np.testing.assert_array_equal(got, array)
    # every output when none were requested, in dict order
    response = kt.encode_grpc_response("m", "2", "", {"b": TENSORS["b"][0], "i64": TENSORS["i64"][0]}, [])
    result = tritongrpc.InferResult(response)
    np.testing.assert_array_equal(result.as_numpy("b"), TENSORS["b"][0])
    np.testing.assert_array_equal(result.as_numpy("i64"), TENSORS["i64"][0])


def test_grpc_typed_contents():
    req = service_pb2.ModelInferRequest(model_name="m")
    specs = [
        ("f", "FP32", [2], "fp32_contents", [1.5, -2.0]),
        ("i8", "INT8", [3], "int_contents", [-128, 0, 127]),
        ("u16", "UINT16", [1], "uint_contents", [65535]),
        ("i64", "INT64", [1, 2], "int64_contents", [-5, 2**62]),
        ("b", "BOOL", [2], "bool_contents", [True, False]),
        ("s", "BYTES", [2], "bytes_contents", [b"a", b"\x00\xff"]),
    ]
    for name, datatype, shape, field, values in specs:
        tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(tensor.contents, field).extend(values)
    request = kt.decode_grpc_request(req)
    got = {i.name: i.data for i in request.inputs}
    assert_same(got["f"], np.array([1.5, -2.0], dtype=np.float32))
    assert_same(got["i8"], np.array([-128, 0, 127], dtype=np.int8))
    assert_same(got["u16"], np.array([65535], dtype=np.uint16))
    assert_same(got["i64"], np.array([[-5, 2**62]], dtype=np.int64))
    assert_same(got["b"], np.array([True, False]))
    assert_same(got["s"], np.array([b"a", b"\x00\xff"], dtype=object))


def test_bytes_serialization_matches_tritonclient():
    array = TENSORS["s"][0]
    ours, _ = kt.encode_http_response("m", "1", "", {"s": array}, [kt.RequestedOutput("s", binary=True)], False)
    assert ours.endswith(serialize_byte_tensor(array).item())
    assert deserialize_bytes_tensor(serialize_byte_tensor(array).item()).tolist() == array.ravel().tolist()


# ------------------------------------------------------------------------- malformed HTTP requests


def test_negative_dimension():
    body = json_body([{"name": "x", "datatype": "FP32", "shape": [-1, 4], "data": [1, 2, 3, 4]}])
    err = error_of(kt.decode_http_request, body, None)
    assert err.message == "input 'x': shape[0] must be a non-negative integer, got -1"
    assert err.input_name == "x" and str(err) == err.message


def test_shape_product_differs_from_data_length():
    body = json_body([{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5]}])
    assert error_of(kt.decode_http_request, body, None).message == (
        "input 'x': shape [2, 3] requires 6 elements but 'data' has 5")


def test_fp32_with_string_data():
    body = json_body([{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, "abc"]}])
    assert error_of(kt.decode_http_request, body, None).message == (
        "input 'x': 'data' element 1 must be a number for FP32, got \"abc\"")


def test_float_dimension_1e12():
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1e12], "data": [1, 2, 3, 4]}]}'
    assert error_of(kt.decode_http_request, body, None).message == (
        "input 'x': shape[0] must be a non-negative integer, got 1000000000000.0")


def test_huge_integer_dimension_with_tiny_data():
    body = json_body([{"name": "x", "datatype": "FP32", "shape": [1000000000000], "data": [1, 2, 3, 4]}])
    assert error_of(kt.decode_http_request, body, None).message == (
        "input 'x': shape [1000000000000] requires 1000000000000 elements but 'data' has 4")
    # binary form: rejected from binary_data_size alone, before any allocation
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1000000000000],
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    err = error_of(kt.decode_http_request, header + bytes(16), len(header))
    assert err.message == ("input 'x': shape [1000000000000] of FP32 requires 4000000000000 bytes "
                           "(1000000000000 elements x 4 bytes) but parameters.binary_data_size is 16")
    # BYTES binary: needs at least 4 bytes per element
    header = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1000000000000],
                                     "parameters": {"binary_data_size": 5}}]}).encode()
    err = error_of(kt.decode_http_request, header + b"\x01\x00\x00\x00a", len(header))
    assert err.message == ("input 'x': shape [1000000000000] requires 1000000000000 BYTES elements "
                           "(at least 4000000000000 bytes) but its binary data has 5 bytes")


def test_inputs_not_a_list():
    assert error_of(kt.decode_http_request, b'{"inputs": {}}', None).message == (
        "'inputs' must be a JSON array, got an object")


def test_body_not_utf8():
    err = error_of(kt.decode_http_request, b'\xff{"inputs": []}', None)
    assert err.message == "the request body is not valid UTF-8 at byte offset 0 (0xff: invalid start byte)"
    assert err.input_name is None
    # A UTF-8 byte order mark is ignored (RFC 8259 section 8.1), as the OpenAI routes' json.loads ignores it.
    assert kt.decode_http_request(b'\xef\xbb\xbf{"inputs": []}', None).inputs == []
    err = error_of(kt.decode_http_request, b'\xef\xbb\xbf{"id": "\xff"}', None)
    assert err.message == "the request body is not valid UTF-8 at byte offset 11 (0xff: invalid start byte)"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_body_in_utf16_or_utf32_reads_as_in_utf8(encoding):
    """JSON in UTF-16 or UTF-32 (with or without a byte order mark) decodes to the same request as in UTF-8, as the
    OpenAI routes' json.loads reads it; bytes that are not valid in the encoding the body's first bytes announce get
    a 400 that names it."""
    doc = {"id": "caf\u00e9 \U0001f999", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]},
                                             {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["\u00fc"]}]}
    text = json.dumps(doc, ensure_ascii=False)
    ref, got = kt.decode_http_request(text.encode(), None), kt.decode_http_request(text.encode(encoding), None)
    assert got.id == ref.id == "caf\u00e9 \U0001f999"
    assert [(i.name, i.datatype, i.shape) for i in got.inputs] == [(i.name, i.datatype, i.shape) for i in ref.inputs]
    assert got.inputs[0].data.tolist() == [1.5, -2.0] and got.inputs[1].data.tolist() == ["\u00fc".encode()]


def test_body_not_valid_utf16_or_utf32():
    """Bytes that are not valid in the encoding the first bytes announce get a 400 naming it, the offset and the bad
    code unit's bytes; JSON that does not parse in it says which encoding it was read in."""
    unpaired = '{"id": "'.encode("utf-16-le") + b"\x00\xd8" + '"}'.encode("utf-16-le")  # a lone high surrogate
    assert error_of(kt.decode_http_request, unpaired, None).message == (
        "the request body is not valid UTF-16LE at byte offset 16 (bytes 00 d8: illegal UTF-16 surrogate)")
    odd = '{"inputs": []}'.encode("utf-16-be") + b"\x00"
    assert error_of(kt.decode_http_request, odd, None).message == (
        "the request body is not valid UTF-16BE at byte offset 28 (bytes 00: truncated data)")
    beyond = '{"id": "'.encode("utf-32-le") + (0x110000).to_bytes(4, "little") + '"}'.encode("utf-32-le")
    assert error_of(kt.decode_http_request, beyond, None).message == (
        "the request body is not valid UTF-32LE at byte offset 32 (bytes 00 00 11 00: code point not in "
        "range(0x110000))")
    assert error_of(kt.decode_http_request, b'\x00{"inputs": []}x', None).message == (  # a NUL first: UTF-16BE
        "request body is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2 (the "
        "body was read as UTF-16BE, as its first bytes announce)")


def test_body_not_json_or_not_object():
    assert error_of(kt.decode_http_request, b'{"inputs": [', None).message == (
        "request body is not valid JSON: Expecting value at line 1 column 13")
    # an integer longer than int() reads (a ValueError from json.loads, not a JSONDecodeError: it was a 500)
    assert error_of(kt.decode_http_request, b'{"inputs": [], "parameters": {"x": ' + b"1" * 5000 + b"}}",
                    None).message == (
        f"request body is not valid JSON: a number with more than {sys.get_int_max_str_digits()} digits")
    assert error_of(kt.decode_http_request, b"[1, 2]", None).message == (
        "request body must be a JSON object, got an array")
    assert error_of(kt.decode_http_request, b"{}", None).message == "request body has no 'inputs' array"


def test_binary_size_does_not_match_shape():
    body, header_length = http_body([http_input("x", np.ones((2, 2), np.float32), "FP32")])
    header = json.loads(body[:header_length])
    header["inputs"][0]["parameters"]["binary_data_size"] = 12
    new_header = json.dumps(header).encode()
    err = error_of(kt.decode_http_request, new_header + body[header_length:header_length + 12], len(new_header))
    assert err.message == ("input 'x': shape [2, 2] of FP32 requires 16 bytes (4 elements x 4 bytes) "
                           "but parameters.binary_data_size is 12")


def test_binary_body_truncated_or_too_long():
    body, header_length = http_body([http_input("x", np.ones((2, 2), np.float32), "FP32")])
    assert error_of(kt.decode_http_request, body[:-4], header_length).message == (
        "input 'x': parameters.binary_data_size is 16 but only 12 bytes of binary data remain in the request body")
    assert error_of(kt.decode_http_request, body + b"junk", header_length).message == (
        "request body has 4 bytes of binary data that no input claims "
        "(binary section is 20 bytes, inputs' binary_data_size total 16)")
    assert error_of(kt.decode_http_request, body[:header_length], None).message == (
        "input 'x': parameters.binary_data_size is 16 but only 0 bytes of binary data remain in the request body "
        "(no Inference-Header-Content-Length header was given)")
    assert error_of(kt.decode_http_request, body, len(body) + 1).message == (
        f"Inference-Header-Content-Length is {len(body) + 1} but the request body has only {len(body)} bytes")


def test_binary_bytes_element_overruns():
    data = b"\x02\x00\x00\x00ab\x09\x00\x00\x00abc"
    header = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    assert error_of(kt.decode_http_request, header + data, len(header)).message == (
        "input 's': BYTES element 1 declares length 9 but only 3 bytes remain in its binary data")


def test_binary_bool_must_be_zero_or_one():
    header = json.dumps({"inputs": [{"name": "b", "datatype": "BOOL", "shape": [3],
                                     "parameters": {"binary_data_size": 3}}]}).encode()
    assert error_of(kt.decode_http_request, header + b"\x00\x01\x02", len(header)).message == (
        "input 'b': BOOL element 2 is byte 2; BOOL binary data must be 0 or 1")


@pytest.mark.parametrize("datatype,values,message", [
    ("INT8", [1, 128], "input 'x': 'data' element 1 is 128, out of range for INT8 [-128, 127]"),
    ("UINT32", [-1, 0], "input 'x': 'data' element 0 is -1, out of range for UINT32 [0, 4294967295]"),
    ("INT32", [1, 2.5], "input 'x': 'data' element 1 must be an integer for INT32, got 2.5"),
    ("INT64", [1.0, 2], "input 'x': 'data' element 0 must be an integer for INT64, got 1.0"),
    ("INT64", [True, 2], "input 'x': 'data' element 0 must be an integer for INT64, got true"),
    ("BOOL", [True, 1], "input 'x': 'data' element 1 must be true or false for BOOL, got 1"),
    ("BYTES", ["a", 5], "input 'x': 'data' element 1 must be a string for BYTES, got 5"),
    ("FP16", [1.0, 1e5], "input 'x': 'data' element 1 is 100000.0, out of range for FP16"),
    ("FP32", [None, 1.0], "input 'x': 'data' element 0 must be a number for FP32, got null"),
    ("FLOAT32", [1.0, 2.0], "input 'x': unsupported datatype \"FLOAT32\"; expected one of BOOL, UINT8, UINT16, "
                            "UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES, BF16"),
    ("BF16", [1.0, 2.0], "input 'x': BF16 data must be sent as binary data (parameters.binary_data_size); "
                         "JSON 'data' is not supported for BF16"),
])
def test_json_values_must_match_datatype(datatype, values, message):
    body = json_body([{"name": "x", "datatype": datatype, "shape": [2], "data": values}])
    err = error_of(kt.decode_http_request, body, None)
    assert err.message == message and err.input_name == "x"


def test_other_input_errors():
    cases = [
        ([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},
          {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "duplicate input 'x'"),
        ([{"name": "x", "datatype": "FP32", "shape": [True], "data": [1]}],
         "input 'x': shape[0] must be a non-negative integer, got true"),
        ([{"name": "x", "datatype": "FP32", "shape": [1]}],
         "input 'x': has neither 'data' nor parameters.binary_data_size"),
        ([{"name": "x", "datatype": "FP32", "shape": [1], "data": 1}],
         "input 'x': 'data' must be a JSON array, got 1"),
        ([{"datatype": "FP32", "shape": [1], "data": [1]}], "inputs[0]: 'name' must be a non-empty string, got null"),
        ([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1],
           "parameters": {"shared_memory_region": "r"}}],
         "input 'x': shared memory (parameters.shared_memory_region) is not supported by this server"),
    ]
    for inputs, message in cases:
        assert error_of(kt.decode_http_request, json_body(inputs), None).message == message


def test_output_request_errors():
    x = [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]
    assert error_of(kt.decode_http_request, json_body(x, outputs=[{"name": "y"}, {"name": "y"}]), None).message == (
        "output 'y' is requested more than once")
    body = json_body(x, outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}])
    assert error_of(kt.decode_http_request, body, None).message == (
        "output 'y': parameters.binary_data must be true or false, got \"yes\"")
    body = json_body(x, outputs=[{"name": "y", "parameters": {"classification": 3}}])
    assert error_of(kt.decode_http_request, body, None).message == (
        "output 'y': the classification extension is not supported by this server")


def test_parse_header_length():
    assert kt.parse_header_length(None) is None
    assert kt.parse_header_length(" 42 ") == 42
    assert error_of(kt.parse_header_length, "-3").message == (
        "Inference-Header-Content-Length header must be a non-negative integer, got '-3'")


# ------------------------------------------------------------------------- malformed gRPC requests


def test_grpc_raw_contents_count_and_size():
    req = grpc_request([grpc_input("a", np.ones(2, np.float32), "FP32"),
                        grpc_input("b", np.ones(2, np.int32), "INT32")])
    del req.raw_input_contents[1]
    assert error_of(kt.decode_grpc_request, req).message == (
        "raw_input_contents has 1 entries but the request has 2 inputs; "
        "when raw_input_contents is used it must hold one entry per input")
    req = grpc_request([grpc_input("a", np.ones(2, np.float32), "FP32")])
    req.raw_input_contents[0] = b"\x00" * 7
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'a': shape [2] of FP32 requires 8 bytes (2 elements x 4 bytes) but raw_input_contents[0] has 7 bytes")
    req = grpc_request([grpc_input("a", np.ones(4, np.float32), "FP32")])
    req.inputs[0].shape[:] = [1000000000000]
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'a': shape [1000000000000] of FP32 requires 4000000000000 bytes "
        "(1000000000000 elements x 4 bytes) but raw_input_contents[0] has 16 bytes")
    req = grpc_request([grpc_input("a", np.ones(4, np.float32), "FP32")])
    req.inputs[0].shape[:] = [-1, 4]
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'a': shape[0] must be a non-negative integer, got -1")


def test_grpc_typed_contents_errors():
    req = service_pb2.ModelInferRequest()
    req.inputs.add(name="x", datatype="FP32", shape=[2]).contents.int_contents.extend([1, 2])
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'x': FP32 data must be in contents.fp32_contents, found contents.int_contents")
    req = service_pb2.ModelInferRequest()
    req.inputs.add(name="x", datatype="FP32", shape=[2, 3]).contents.fp32_contents.extend([1, 2])
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'x': shape [2, 3] requires 6 elements but contents.fp32_contents has 2")
    req = service_pb2.ModelInferRequest()
    req.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.extend([300])
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'x': contents.int_contents element 0 is 300, out of range for INT8 [-128, 127]")
    req = service_pb2.ModelInferRequest()
    req.inputs.add(name="x", datatype="FP16", shape=[1])
    assert error_of(kt.decode_grpc_request, req).message == (
        "input 'x': FP16 data must be sent in raw_input_contents; InferTensorContents has no field for FP16")


# ---------------------------------------------------------------------------- validation vs config


FP32_X = config([("x", mc.TYPE_FP32, [4])])


def test_valid_against_config_with_wildcards_and_batching():
    cfg = config([("x", mc.TYPE_FP32, [-1, 4]), ("s", mc.TYPE_STRING, []), ("o", mc.TYPE_INT64, [1])],
                 max_batch_size=8, optional=("o",))
    x = np.zeros((3, 5, 4), np.float32)
    s = np.array([b"a", b"b", b"c"], dtype=object)
    arrays = kt.validate_inputs(request_with(("s", "BYTES", s), ("x", "FP32", x), outputs=["y"]), cfg)
    assert list(arrays) == ["x", "s"] and arrays["x"] is x and arrays["s"] is s


def test_unknown_input_vs_config():
    req = request_with(("x", "FP32", np.zeros(4, np.float32)), ("z", "FP32", np.zeros(4, np.float32)))
    err = error_of(kt.validate_inputs, req, FP32_X)
    assert err.message == "unexpected input 'z' for model 'm'; its inputs are 'x'" and err.input_name == "z"


def test_missing_required_input_vs_config():
    cfg = config([("x", mc.TYPE_FP32, [4]), ("b", mc.TYPE_INT32, [1])])
    err = error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros(4, np.float32))), cfg)
    assert err.message == "missing required input 'b' for model 'm'" and err.input_name == "b"


def test_wrong_datatype_vs_config():
    err = error_of(kt.validate_inputs, request_with(("x", "FP64", np.zeros(4))), FP32_X)
    assert err.message == "input 'x': datatype FP64 does not match model 'm', which expects FP32"
    cfg = config([("s", mc.TYPE_STRING, [1])])
    assert error_of(kt.validate_inputs, request_with(("s", "INT8", np.zeros(1, np.int8))), cfg).message == (
        "input 's': datatype INT8 does not match model 'm', which expects BYTES")


def test_batch_larger_than_max_batch_size():
    cfg = config([("x", mc.TYPE_FP32, [4])], max_batch_size=8)
    err = error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((9, 4), np.float32))), cfg)
    assert err.message == "input 'x': batch size 9 exceeds max_batch_size 8 of model 'm'" and err.input_name == "x"


def test_shape_and_batch_mismatches_vs_config():
    cfg = config([("x", mc.TYPE_FP32, [-1, 4]), ("w", mc.TYPE_FP32, [2])], max_batch_size=8)
    w2 = ("w", "FP32", np.zeros((2, 2), np.float32))
    assert error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((2, 4), np.float32)), w2), cfg).message == (
        "input 'x': shape [2, 4] does not match model 'm', which expects [batch, -1, 4] (-1 means any size)")
    assert error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((2, 3, 5), np.float32)), w2),
                    cfg).message == (
        "input 'x': shape [2, 3, 5] does not match model 'm', which expects [batch, -1, 4] (-1 means any size)")
    assert error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((3, 1, 4), np.float32)), w2),
                    cfg).message == "input 'w': batch size 2 differs from batch size 3 of input 'x'"
    assert error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((0, 1, 4), np.float32)), w2),
                    cfg).message == "input 'x': batch size 0 is invalid; model 'm' accepts batch sizes 1 to 8"
    assert error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros((1, 4), np.float32))),
                    FP32_X).message == "input 'x': shape [1, 4] does not match model 'm', which expects [4]"


def test_unknown_requested_output_vs_config():
    err = error_of(kt.validate_inputs, request_with(("x", "FP32", np.zeros(4, np.float32)), outputs=["nope"]), FP32_X)
    assert err.message == "unexpected output 'nope' for model 'm'; its outputs are 'y'" and err.input_name == "nope"


def test_config_with_the_client_json_request():
    # End to end: the official client's JSON request, checked against a batching config.
    array = np.arange(8, dtype=np.float32).reshape(2, 4)
    body, header_length = http_body([http_input("x", array, "FP32", binary=False)])
    arrays = kt.validate_inputs(kt.decode_http_request(body, header_length),
                                config([("x", mc.TYPE_FP32, [4])], max_batch_size=8))
    assert_same(arrays["x"], array)


# ------------------------------------------------------------------------------------- encoding


def test_missing_or_unsupported_output_is_a_server_error():
    with pytest.raises(ValueError, match="the model produced no output 'y'") as info:
        kt.encode_http_response("m", "1", "", {}, [kt.RequestedOutput("y")], True)
    assert not isinstance(info.value, TensorError)
    with pytest.raises(ValueError, match="has no KServe datatype"):
        kt.encode_grpc_response("m", "1", "", {"c": np.zeros(2, np.complex64)}, [])


def test_dtype_mappings():
    for datatype in kt.DATATYPES:
        assert kt.numpy_to_datatype(kt.datatype_to_numpy(datatype)) == datatype
    assert kt.numpy_to_datatype(np.dtype("S3")) == "BYTES" and kt.numpy_to_datatype(np.dtype("U3")) == "BYTES"
    assert kt.config_datatype(mc.TYPE_STRING) == "BYTES" and kt.config_datatype(mc.TYPE_BF16) == "BF16"
