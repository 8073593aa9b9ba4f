"""The model repository served over KServe v2 (HTTP and gRPC) and the OpenAI routes, with the official
``tritonclient`` and ``openai`` clients against the real server (issue 4).

One server runs the example repository (``inferd repo examples``) in poll mode; a second, in explicit
mode, checks the repository API. The KServe cases C31 and C33 of ../shared/cases are here.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import openai
import pytest
import skimage.data
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ServerProcess, free_port
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from inferd.model.efficientnet_lite import preprocess
from inferd.repository.examples import build_examples

CAT_CLASSES = range(281, 286)  # ImageNet: tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967

# The same ONNX model with a batcher that waits long enough for 8 concurrent requests, and batches of 16.
BATCHING_CONFIG = """\
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] } ]
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 300000 }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("repo"))
    build_examples(root, ["efficientnet_lite0", "all_minilm_l6_v2", "smollm2"])
    os.makedirs(os.path.join(root, "batching", "1"))
    shutil.copyfile(os.path.join(root, "efficientnet_lite0", "1", "model.onnx"),
                    os.path.join(root, "batching", "1", "model.onnx"))
    with open(os.path.join(root, "batching", "config.pbtxt"), "w") as f:
        f.write(BATCHING_CONFIG)
    return root


@pytest.fixture(scope="module")
def triton(repo):
    grpc_port = free_port()
    s = ServerProcess("--model-repository", repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.5",
                      "--grpc-port", str(grpc_port))
    s.wait_ready()
    s.grpc_url = f"127.0.0.1:{grpc_port}"
    s.http_url = f"127.0.0.1:{s.port}"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def photos():
    return np.stack([preprocess(skimage.data.chelsea()), preprocess(skimage.data.coffee())])


def _http_logits(url: str, x: np.ndarray, model: str = "efficientnet_lite0") -> np.ndarray:
    c = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp]).as_numpy("logits")


def _model_metric(base_url: str, name: str, model: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{model="{model}",'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_efficientnet_classifies_photos_over_http_and_grpc(triton, photos):
    logits = _http_logits(triton.http_url, photos)
    assert logits.shape == (2, 1000) and logits.dtype == np.float32
    assert logits[0].argmax() in CAT_CLASSES
    assert logits[1].argmax() == ESPRESSO
    g = grpcclient.InferenceServerClient(triton.grpc_url)
    inp = grpcclient.InferInput("input", list(photos.shape), "FP32")
    inp.set_data_from_numpy(photos)
    result = g.infer("efficientnet_lite0", [inp])
    np.testing.assert_array_equal(result.as_numpy("logits"), logits)
    assert result.get_response().model_version == "1"
    # JSON tensors (no binary extension) give the same numbers.
    c = httpclient.InferenceServerClient(triton.http_url)
    inp = httpclient.InferInput("input", list(photos[:1].shape), "FP32")
    inp.set_data_from_numpy(photos[:1], binary_data=False)
    out = httpclient.InferRequestedOutput("logits", binary_data=False)
    np.testing.assert_array_equal(c.infer("efficientnet_lite0", [inp], outputs=[out]).as_numpy("logits"),
                                  logits[:1])


def test_server_and_model_metadata(triton):
    c = httpclient.InferenceServerClient(triton.http_url)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("efficientnet_lite0") and c.is_model_ready("efficientnet_lite0", "1")
    assert not c.is_model_ready("efficientnet_lite0", "7")
    md = c.get_model_metadata("efficientnet_lite0")
    assert md == {"name": "efficientnet_lite0", "versions": ["1"], "platform": "onnxruntime_onnx",
                  "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
                  "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}]}
    cfg = c.get_model_config("efficientnet_lite0")
    assert cfg["max_batch_size"] == 8 and cfg["dynamic_batching"]["preferred_batch_size"] == [8]
    g = grpcclient.InferenceServerClient(triton.grpc_url)
    assert g.is_server_ready() and g.is_model_ready("all_minilm_l6_v2")
    gmd = g.get_model_metadata("all_minilm_l6_v2", as_json=True)
    assert [i["name"] for i in gmd["inputs"]] == ["text", "input_ids"]
    assert g.get_model_config("efficientnet_lite0").config.max_batch_size == 8
    assert g.get_server_metadata().name == "inferd"


def test_eight_concurrent_requests_run_as_one_execution(triton, photos):
    rows = [photos[i % 2:i % 2 + 1] for i in range(8)]
    alone = [_http_logits(triton.http_url, r, "batching") for r in rows[:2]]
    before = (_model_metric(triton.base_url, "inferd:model_execution_count_total", "batching"),
              _model_metric(triton.base_url, "inferd:model_batch_size_sum", "batching"))
    barrier = threading.Barrier(8)

    def one(x):
        c = httpclient.InferenceServerClient(triton.http_url)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        barrier.wait()
        return c.infer("batching", [inp]).as_numpy("logits")

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, rows))
    after = (_model_metric(triton.base_url, "inferd:model_execution_count_total", "batching"),
             _model_metric(triton.base_url, "inferd:model_batch_size_sum", "batching"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 8)  # one execution of 8 rows
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, alone[i % 2])  # bit for bit the result alone


def test_c33_rows_of_any_batch_equal_single_rows(triton, photos):
    rng = np.random.default_rng(0)
    pool = np.concatenate([photos, (photos[:1] + rng.normal(0, 0.3, (8, 3, 224, 224))).astype(np.float32)])
    single = [_http_logits(triton.http_url, pool[i:i + 1], "batching")[0] for i in range(len(pool))]
    start = 0
    for size in (10, 2, 10, 1, 7):
        idx = [(start + k) % len(pool) for k in range(size)]
        start += size
        out = _http_logits(triton.http_url, pool[idx], "batching")
        assert out.shape == (size, 1000)
        for row, i in enumerate(idx):
            np.testing.assert_array_equal(out[row], single[i])


C31_BODIES = [
    ({"inputs": [{"name": "input", "shape": [-1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]},
     "input 'input': shape[0] must be a non-negative integer, got -1"),
    ({"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]},
     "input 'input': shape [1, 3] requires 3 elements but 'data' has 2"),
    ({"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": ["a"]}]},
     "input 'input': 'data' element 0 must be a number for FP32, got \"a\""),
    ({"inputs": [{"name": "pixels", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
     "unexpected input 'pixels' for model 'efficientnet_lite0'; its inputs are 'input'"),
    ({"inputs": []}, "missing required input 'input' for model 'efficientnet_lite0'"),
    ({"inputs": [{"name": "input", "shape": [1e12], "datatype": "FP32", "data": [1.0]}]},
     "input 'input': shape[0] must be a non-negative integer, got 1000000000000.0"),
    ({"inputs": [{"name": "input", "shape": [1000000000000], "datatype": "FP32", "data": [1.0]}]},
     "input 'input': shape [1000000000000] requires 1000000000000 elements but 'data' has 1"),
    ({"inputs": {}}, "'inputs' must be a JSON array, got an object"),
    ({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP64", "data": [0.0] * 150528}]},
     "input 'input': datatype FP64 does not match model 'efficientnet_lite0', which expects FP32"),
    ({"inputs": [{"name": "input", "shape": [9, 3, 224, 224], "datatype": "FP32", "data": [0.0] * 9 * 150528}]},
     "input 'input': batch size 9 exceeds max_batch_size 8 of model 'efficientnet_lite0'"),
]


def test_c31_malformed_tensors_are_400_and_harm_nothing(triton, photos):
    url = triton.base_url + "/v2/models/efficientnet_lite0/infer"
    reference = _http_logits(triton.http_url, photos[:1])
    for body, message in C31_BODIES:
        r = httpx.post(url, json=body, timeout=60)
        assert (r.status_code, r.json()) == (400, {"error": message}), body
    r = httpx.post(url, content="{\"inputs\": [".encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, content="你好".encode("gbk"))  # C11 (f): not UTF-8
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]
    valid = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                    "data": [0.0] * 150528}]})
    r = httpx.post(url, content=valid, headers={"content-type": "text/plain"})  # C11 (b): a type that is not JSON
    assert (r.status_code, r.json()) == (400, {"error": "the request body must be JSON (Content-Type: "
                                                        "application/json) or the binary tensor extension's "
                                                        "(application/octet-stream), not 'text/plain'"})
    r = httpx.post(url, content=valid, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 1000]
    r = httpx.post(url, content=valid)  # C11 (a): no Content-Type (as tritonclient sends) reads as JSON
    assert "content-type" not in r.request.headers
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 1000]
    r = httpx.post(url, content=b"", headers={"content-type": "application/json"})  # C11 (d): an empty body
    assert (r.status_code, r.json()) == (400, {"error": "request body is not valid JSON: Expecting value at line 1 "
                                                        "column 1"})
    r = httpx.post(url, content=b"[]", headers={"content-type": "application/json"})  # C11 (e): a JSON array
    assert r.status_code == 400 and r.json()["error"].startswith("request body must be a JSON object, got ")
    r = httpx.post(triton.base_url + "/v2/models/no_such_model/infer", json={"inputs": []})
    assert (r.status_code, r.json()) == (404, {"error": "model 'no_such_model' is not found"})
    # Over gRPC: the shape disagrees with the raw bytes -> INVALID_ARGUMENT naming the input.
    with grpc.insecure_channel(triton.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        req = service_pb2.ModelInferRequest(model_name="efficientnet_lite0")
        req.inputs.add(name="input", datatype="FP32", shape=[1, 3, 224, 224])
        req.raw_input_contents.append(b"\0" * 12)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'input'" in err.value.details()
    assert httpx.get(triton.base_url + "/v2/health/ready").status_code == 200
    np.testing.assert_array_equal(_http_logits(triton.http_url, photos[:1]), reference)


def test_embeddings_match_sentence_transformers(triton, repo):
    from sentence_transformers import SentenceTransformer

    texts = ["A cat sits on the mat.", "Où est la gare ?", "深度学习模型", "🦙🦙 llamas", "",
             "The quick brown fox jumps over the lazy dog. " * 8]
    ref = SentenceTransformer(os.path.join(repo, "all_minilm_l6_v2", "1"), device="cpu").encode(texts)
    client = openai.OpenAI(base_url=triton.base_url + "/v1", api_key="none")
    resp = client.embeddings.create(model="all_minilm_l6_v2", input=texts)
    assert [d.index for d in resp.data] == list(range(len(texts)))
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    # The official client asks for base64 by default when given no encoding_format: one string.
    one = client.embeddings.create(model="all_minilm_l6_v2", input=texts[0])
    np.testing.assert_allclose(one.data[0].embedding, ref[0], atol=1e-5, rtol=0)
    # Token ids give the same vector as the text they encode.
    ids = httpx.post(triton.base_url + "/v1/embeddings", json={"model": "all_minilm_l6_v2", "input": [
        [101, 1037, 4937, 7719, 2006, 1996, 13523, 1012, 102]]}).json()
    np.testing.assert_allclose(ids["data"][0]["embedding"], ref[0], atol=1e-5, rtol=0)
    assert ids["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    # C07 (shared/cases): an empty string alone is a text like any other ([CLS] [SEP]), as sentence-transformers
    # embeds it.
    empty = httpx.post(triton.base_url + "/v1/embeddings", json={"model": "all_minilm_l6_v2", "input": ""})
    assert empty.status_code == 200 and empty.json()["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    np.testing.assert_allclose(empty.json()["data"][0]["embedding"], ref[4], atol=1e-5, rtol=0)
    # KServe: a batch of texts as BYTES.
    g = grpcclient.InferenceServerClient(triton.grpc_url)
    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    np.testing.assert_allclose(g.infer("all_minilm_l6_v2", [inp]).as_numpy("embedding"), ref, atol=1e-5, rtol=0)


def test_embedding_errors(triton):
    url = triton.base_url + "/v1/embeddings"
    r = httpx.post(url, json={"model": "all_minilm_l6_v2", "input": "word " * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "256" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "all_minilm_l6_v2", "input": [[999999]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(url, json={"model": "all_minilm_l6_v2", "input": "x", "dimensions": 12})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    r = httpx.post(url, json={"model": "smollm2", "input": "x"})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "the model 'smollm2' is a llm model, not an embedding model")
    r = httpx.post(url, json={"model": "all_minilm_l6_v2", "input": []})
    assert r.status_code == 400


def test_llm_answers_openai_and_kserve_by_name(triton):
    client = openai.OpenAI(base_url=triton.base_url + "/v1", api_key="none")
    assert sorted(m.id for m in client.models.list().data) == ["all_minilm_l6_v2", "smollm2"]
    text = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                     temperature=0).choices[0].text
    c = httpclient.InferenceServerClient(triton.http_url)
    inp = httpclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
    params = httpclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([b'{"max_tokens": 8, "temperature": 0}'], dtype=object))
    out = c.infer("smollm2", [inp, params]).as_numpy("text_output")
    assert out.tolist() == [text.encode()]
    assert "Paris" in text
    r = httpx.post(triton.base_url + "/v1/completions", json={"model": "efficientnet_lite0", "prompt": "x"})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "the model 'efficientnet_lite0' is a onnxruntime model: it does not generate text")


def _index(base_url: str) -> list[dict]:
    return httpx.post(base_url + "/v2/repository/index").json()


def _wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError


def test_poll_mode_serves_a_new_version_without_failing_requests(triton, repo, photos):
    model_dir = os.path.join(repo, "efficientnet_lite0")
    reference = _http_logits(triton.http_url, photos[:1])
    stop = threading.Event()
    versions, failures = [], []

    def load():
        c = grpcclient.InferenceServerClient(triton.grpc_url)
        inp = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(photos[:1])
        while not stop.is_set():
            try:
                r = c.infer("efficientnet_lite0", [inp])
                versions.append(r.get_response().model_version)
                if not np.array_equal(r.as_numpy("logits"), reference):
                    failures.append("wrong logits")
            except InferenceServerException as e:
                failures.append(str(e))

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(load) for _ in range(4)]
        _wait_for(lambda: len(versions) > 20)
        # Atomic drop-in: copy beside, then rename into place.
        shutil.copytree(os.path.join(model_dir, "1"), os.path.join(repo, ".staging-2"))
        os.rename(os.path.join(repo, ".staging-2"), os.path.join(model_dir, "2"))
        _wait_for(lambda: versions and versions[-1] == "2")
        n = len(versions)
        _wait_for(lambda: len(versions) > n + 20)
        stop.set()
        for f in futures:
            f.result()
    assert failures == []
    assert set(versions) == {"1", "2"}
    assert versions.index("2") > 0 and "1" not in versions[versions.index("2") + 8:]
    assert httpclient.InferenceServerClient(triton.http_url).get_model_metadata("efficientnet_lite0")["versions"] \
        == ["2"]

    # A tampered version 3: refused, naming the file; version 2 keeps answering.
    shutil.copytree(os.path.join(model_dir, "2"), os.path.join(repo, ".staging-3"))
    with open(os.path.join(repo, ".staging-3", "model.onnx"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\x01" * 8)
    os.rename(os.path.join(repo, ".staging-3"), os.path.join(model_dir, "3"))
    entry = _wait_for(lambda: next((e for e in _index(triton.base_url)
                                    if e["name"] == "efficientnet_lite0" and e.get("version") == "3"
                                    and e["state"] == "UNAVAILABLE"), None))
    assert entry["reason"].startswith("model.onnx does not match SHA256SUMS")
    c = grpcclient.InferenceServerClient(triton.grpc_url)
    inp = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
    inp.set_data_from_numpy(photos[:1])
    r = c.infer("efficientnet_lite0", [inp])
    assert r.get_response().model_version == "2"
    np.testing.assert_array_equal(r.as_numpy("logits"), reference)
    shutil.rmtree(os.path.join(model_dir, "3"))
    _wait_for(lambda: not any(e.get("version") == "3" for e in _index(triton.base_url)))


def test_batcher_metrics_are_exported(triton):
    text = httpx.get(triton.base_url + "/metrics").text
    assert 'inferd:model_request_failure_total{model="batching",reason="backend",version="1"} 0.0' in text
    for name in ("inferd:model_request_success_total", "inferd:model_execution_count_total", "inferd:model_inference_count_total",
                 "inferd:model_batch_size_count", "inferd:model_queue_duration_seconds_sum",
                 "inferd:model_compute_duration_seconds_sum"):
        assert f'{name}{{model="batching",version="1"' in text, name


# Batches of 8 rows or after 1.5 s; at most 2 requests wait; a request waits at most 1 s unless it asks for less.
QUEUE_POLICY = BATCHING_CONFIG.replace("max_queue_delay_microseconds: 300000", """max_queue_delay_microseconds: 1500000
  default_queue_policy { max_queue_size: 2 default_timeout_microseconds: 1000000 allow_timeout_override: true }""")
# Warmup with a sample the model cannot take (a 2x2 image): the version never becomes ready.
BAD_WARMUP = """model_warmup [ { name: "tiny" batch_size: 1
  inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 2, 2 ] zero_data: true } } } ]
"""


@pytest.fixture(scope="module")
def explicit(tmp_path_factory, repo):
    root = str(tmp_path_factory.mktemp("explicit"))
    shutil.copytree(os.path.join(repo, "batching"), os.path.join(root, "classifier"))
    os.makedirs(os.path.join(root, "cached", "1"))
    with open(os.path.join(root, "cached", "config.pbtxt"), "w") as f:
        f.write(BATCHING_CONFIG + "response_cache { enable: true }\n")
    for name, config in (("queued", QUEUE_POLICY), ("badwarmup", BATCHING_CONFIG + BAD_WARMUP)):
        shutil.copytree(os.path.join(repo, "batching"), os.path.join(root, name))
        with open(os.path.join(root, name, "config.pbtxt"), "w") as f:
            f.write(config)
    grpc_port = free_port()
    s = ServerProcess("--model-repository", root, "--model-control-mode", "explicit", "--grpc-port", str(grpc_port),
                      "--load-model", "queued", "--max-request-body-bytes", "4000000")
    s.wait_ready()
    s.grpc_url = f"127.0.0.1:{grpc_port}"
    yield s
    s.stop()


def test_explicit_mode_loads_and_unloads_through_the_repository_api(explicit, photos):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{explicit.port}")
    assert [e["name"] for e in c.get_model_repository_index()] == ["badwarmup", "cached", "classifier", "queued"]
    assert c.is_model_ready("queued")
    assert not c.is_model_ready("classifier")
    c.load_model("classifier")
    assert c.is_model_ready("classifier")
    inp = httpclient.InferInput("input", [1, 3, 224, 224], "FP32")
    inp.set_data_from_numpy(photos[1:])
    assert c.infer("classifier", [inp]).as_numpy("logits")[0].argmax() == ESPRESSO
    with pytest.raises(InferenceServerException) as err:
        c.load_model("cached")
    assert str(err.value) == ("[400] failed to load 'cached': config.pbtxt of 'cached': field 'response_cache.enable' "
                              "is not supported by inferd (remove it; supported fields are listed in "
                              "docs/model_repository.md)")
    assert c.is_server_ready()  # a failed load call is the caller's error: the server stays ready
    g = grpcclient.InferenceServerClient(explicit.grpc_url)
    for name in (os.path.join(os.path.dirname(explicit.log_path), "x"), "classifier/../queued", "", ".."):
        with pytest.raises(InferenceServerException) as err:
            g.load_model(name)
        assert err.value.status() == "StatusCode.NOT_FOUND", name
    assert c.is_server_ready()
    g.unload_model("classifier")
    assert not c.is_model_ready("classifier")
    r = httpx.post(explicit.base_url + "/v2/models/classifier/infer", json={"inputs": []})
    assert r.status_code == 404
    g.load_model("classifier")
    assert g.is_model_ready("classifier")
    states = {(e["name"], e.get("state")) for e in c.get_model_repository_index()}
    assert ("classifier", "READY") in states and ("cached", "UNAVAILABLE") in states


def test_repository_api_refuses_control_outside_explicit_mode(triton):
    r = httpx.post(triton.base_url + "/v2/repository/models/efficientnet_lite0/unload")
    assert r.status_code == 400
    assert r.json() == {"error": "explicit model load / unload is not allowed in model control mode 'poll' "
                                 "(start with --model-control-mode explicit)"}


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"parameters": {"x": ' + b"1" * 5000 + b"}}",
                                  '{"parameters": {}'.encode("utf-16-le")],
                         ids=["nested-too-deeply", "number-too-long", "utf16-not-json"])
def test_repository_control_with_a_body_json_cannot_read_is_a_400(explicit, body):
    """A load or unload whose body Python's json gives up on (nesting too deep, an integer past int()'s digits) is a
    400 like any body that is not JSON; both were a 500."""
    for action in ("load", "unload"):
        r = httpx.post(explicit.base_url + f"/v2/repository/models/classifier/{action}", content=body)
        assert (r.status_code, r.json()) == (400, {"error": "the request body is not valid JSON"}), action
    assert httpx.get(explicit.base_url + "/v2/health/ready").status_code == 200


def test_warmup_runs_before_a_model_is_ready(explicit):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{explicit.port}")
    with pytest.raises(InferenceServerException) as err:
        c.load_model("badwarmup")
    assert "failed to load 'badwarmup': warmup 'tiny' failed" in str(err.value)
    assert not c.is_model_ready("badwarmup")


def test_queue_policy_sheds_and_times_out(explicit, photos):
    url = explicit.base_url + "/v2/models/queued/infer"

    def infer(extra: dict | None = None):
        body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                            "data": photos[:1].ravel().tolist()}], **(extra or {})}
        return httpx.post(url, json=body, timeout=30)

    # Two requests wait for the batch to fill (1.5 s); a third finds the queue full.
    with ThreadPoolExecutor(2) as ex:
        waiting = [ex.submit(infer, {"parameters": {"timeout": 5_000_000}}) for _ in range(2)]
        _wait_for(lambda: _model_metric(explicit.base_url, "inferd:model_pending_request_count", "queued") == 2)
        r = infer()
        assert (r.status_code, r.json()) == (503, {"error": "the model's queue is full (2 requests waiting)"})
        assert [f.result().status_code for f in waiting] == [200, 200]
    # Alone, a request waits for the batch past its default timeout (1 s) and is rejected.
    r = infer()
    assert r.status_code == 503 and r.json()["error"].startswith("the request waited in the queue past its timeout")
    # It may ask for a longer one (allow_timeout_override): then the batch runs after 1.5 s.
    assert infer({"parameters": {"timeout": 3_000_000}}).status_code == 200
    text = httpx.get(explicit.base_url + "/metrics").text
    assert 'inferd:model_request_failure_total{model="queued",reason="rejected",version="1"} 1.0' in text
    assert 'inferd:model_request_failure_total{model="queued",reason="timeout",version="1"} 1.0' in text


def test_grpc_stream_infer_answers_each_request(triton, photos):
    import queue

    results: queue.Queue = queue.Queue()
    g = grpcclient.InferenceServerClient(triton.grpc_url)
    g.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(2):
            inp = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
            inp.set_data_from_numpy(photos[i:i + 1])
            g.async_stream_infer("efficientnet_lite0", [inp], request_id=str(i))
        g.async_stream_infer("all_minilm_l6_v2", [], request_id="empty")  # an error; the stream goes on
        bad = grpcclient.InferInput("input", [1, 3, 2, 2], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 2, 2), np.float32))
        g.async_stream_infer("efficientnet_lite0", [bad], request_id="bad")
        got = [results.get(timeout=60) for _ in range(4)]
    finally:
        g.stop_stream()
    ok = {r.get_response().id: r.as_numpy("logits")[0].argmax() for r, e in got if e is None}
    assert ok["0"] in CAT_CLASSES and ok["1"] == ESPRESSO
    errors = [str(e) for r, e in got if e is not None]
    assert errors == ["the request has no inputs; model 'all_minilm_l6_v2' takes one of 'text', 'input_ids'",
                      "input 'input': shape [1, 3, 2, 2] does not match model 'efficientnet_lite0', which expects "
                      "[batch, 3, 224, 224]"]


def test_bad_kserve_inputs_to_embedding_and_llm_models_are_400(triton):
    def post(model: str, body: dict, path: str = "/infer"):
        return httpx.post(f"{triton.base_url}/v2/models/{model}{path}", json=body, timeout=60)

    r = post("all_minilm_l6_v2", {"inputs": []})
    assert (r.status_code, r.json()) == (400, {
        "error": "the request has no inputs; model 'all_minilm_l6_v2' takes one of 'text', 'input_ids'"})

    def llm(params: str):
        return post("smollm2", {"inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": [params]}]})

    for params, message in (
            ('{"seed": 1.5}', "sampling_parameters.seed: Input should be a valid integer"),
            ('{"seed": 1180591620717411303424}', "sampling_parameters.seed: Input should be less than "
                                                "9223372036854775808"),
            ('{"max_tokens": "ten"}', "sampling_parameters.max_tokens: Input should be a valid integer"),
            ('{"max_tokens": true}', "sampling_parameters.max_tokens: Input should be a valid integer"),
            ('{"stop": 5}', "sampling_parameters.stop: Input should be a valid string or array"),
            ('{"top_p": null}', "sampling_parameters.top_p: Input should be a valid number"),
            ('{"beam_width": 2}', "sampling_parameters.beam_width: Extra inputs are not permitted")):
        r = llm(params)
        assert (r.status_code, r.json()) == (400, {"error": message}), params
    assert llm('{"max_tokens": 2, "temperature": 0}').status_code == 200
    r = post("efficientnet_lite0", {"inputs": []}, "/versions/\u00b9/infer")
    assert (r.status_code, r.json()) == (400, {"error": "model version '\u00b9' is not a positive integer"})
    r = httpx.get(triton.base_url + "/v2/models/efficientnet_lite0/infer")
    assert (r.status_code, r.json()) == (405, {"error": "Method Not Allowed"})
    r = httpx.post(triton.base_url + "/v1/embeddings", json={"model": "all_minilm_l6_v2",
                                                             "input": [1180591620717411303424]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "input: Value error, must be a string, a list of 1-2048 strings")
    assert httpx.get(triton.base_url + "/v2/health/ready").status_code == 200


def test_embedding_rows_do_not_depend_on_their_batch(triton):
    texts = [f"sentence number {i} about cats and coffee" for i in range(0, 25, 5)]
    c = grpcclient.InferenceServerClient(triton.grpc_url)

    def embed(batch):
        inp = grpcclient.InferInput("text", [len(batch), 1], "BYTES")
        inp.set_data_from_numpy(np.array([[t.encode()] for t in batch], dtype=object))
        return c.infer("all_minilm_l6_v2", [inp]).as_numpy("embedding")

    together = embed(texts)
    for i, t in enumerate(texts):
        np.testing.assert_array_equal(embed([t])[0], together[i])


def test_a_client_that_leaves_a_kserve_llm_request_frees_the_engine(triton):
    body = {"inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Tell me a long story."]},
        {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
         "data": ['{"max_tokens": 2000, "ignore_eos": true}']}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(triton.base_url + "/v2/models/smollm2/infer", json=body, timeout=1.0)

    def running() -> float:
        for line in httpx.get(triton.base_url + "/metrics").text.splitlines():
            if line.startswith('inferd:num_requests_running{model_name="smollm2"}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no running gauge")

    _wait_for(lambda: running() == 0, timeout=10)


def test_request_bodies_over_the_limit_get_413(explicit):
    big = b"x" * 4_000_001
    message = "the request body is larger than the server's limit of 4000000 bytes"
    r = httpx.post(explicit.base_url + "/v2/models/queued/infer", content=big)
    assert (r.status_code, r.json()) == (413, {"error": message})
    r = httpx.post(explicit.base_url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["code"]) == (413, message, 413)

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"x" * 1_000_000

    r = httpx.post(explicit.base_url + "/v2/models/queued/infer", content=chunks())
    assert (r.status_code, r.json()) == (413, {"error": message})
    r = httpx.post(explicit.base_url + "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["message"]) == (413, message)
    # A compressed infer body must keep the limit once decompressed too (a few KB of gzip would expand to 4 MB).
    doc = b'{"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": ["' + b"a" * 4_000_000 + b'"]}]}'
    for encoding, data in (("gzip", gzip.compress(doc)), ("deflate", zlib.compress(doc))):
        assert len(data) < 20_000
        r = httpx.post(explicit.base_url + "/v2/models/queued/infer", content=data,
                       headers={"content-type": "application/json", "content-encoding": encoding})
        assert (r.status_code, r.json()) == (413, {"error": f"the request body, decompressed ({encoding}), is larger "
                                                            "than the server's limit of 4000000 bytes"})
    assert httpx.get(explicit.base_url + "/v2/health/live").status_code == 200
