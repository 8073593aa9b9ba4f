"""A model's tokenizer, without importing transformers' tokenizer classes on the serving path (once the model's
tokenizer is in the cache, and where its ``tokenizers`` backend alone reproduces transformers).

Encoding and decoding run on Hugging Face ``tokenizers`` (the Rust library inside transformers' fast
tokenizers); chat templates are rendered by transformers' Jinja renderer
(``transformers.utils.chat_template_utils.render_jinja_template``, what ``apply_chat_template`` calls) with
the template and special tokens saved from transformers' tokenizer. Importing transformers and building its
tokenizer takes about 2 s of the GIL on this machine, the renderer's module alone about 1 s, ``tokenizers``
0.02 s (docs/performance.md, stop 18); the renderer is imported in the background once the model is loaded
(:meth:`Tokenizer.preload`).

The backend is the exact one transformers builds: the first load of a model goes through
``AutoTokenizer.from_pretrained`` (converting a GGUF vocabulary when needed) and saves the result with
``save_pretrained`` in :mod:`inferd.cache` (``tokenizers``, keyed by the bytes of the GGUF file or of a folder's
files but its weights, and the transformers and tokenizers versions), with ``inferd.json``: the special
token ids and strings, the chat template, and whether the backend alone reproduces transformers' ``encode``/
``decode`` (checked on probe texts then; where it does not, e.g. a WordPiece tokenizer whose decode cleans up
spaces in Python, every call goes through transformers).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import threading

from inferd.cache import cache_dir, cache_key, prune, source_stats, touch, unchanged

logger = logging.getLogger("inferd.engine")

TOKENIZER_CACHE_ENTRIES = 16
# Bumped when an entry's layout or its backend check changes (2: inferd.json; 3: special tokens in the probes;
# 4: the chat template and special token strings in inferd.json).
TOKENIZER_CACHE_VERSION = "4"
# The files of a Hugging Face folder that transformers builds the tokenizer from.
# Weights (and other large files) a Hugging Face folder's tokenizer is never read from: not hashed for its key.
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".pt2", ".gguf", ".onnx", ".h5", ".msgpack", ".ckpt")
_PROBES = ["Hello 世界 🦙🦙 😶‍🌫️", "Don't stop , they said . It 's fine !", "  leading\tand\n\ntrailing  ",
           "歪聪 Привет ١٢٣ x²", ""]


class Tokenizer:
    """Encode/decode on the ``tokenizers`` backend, chat templates with transformers' renderer.

    Args:
        backend: the ``tokenizers.Tokenizer`` transformers built, or None to use transformers for all.
        eos_token_id, bos_token_id: the special token ids (None where the model has none).
        load_hf: returns the transformers tokenizer (called once, on first use).
        chat_template: transformers' ``chat_template``: a Jinja template, a dict of named ones, or None.
        special_tokens: transformers' ``special_tokens_map`` ({"eos_token": "<|im_end|>", ...}), which
            ``apply_chat_template`` passes to the template.

    Thread-safe as far as ``tokenizers`` and Jinja are; the transformers tokenizer is not (callers lock
    around it).
    """

    def __init__(self, backend, eos_token_id: int | None, bos_token_id: int | None, load_hf,
                 chat_template: str | dict | None = None, special_tokens: dict | None = None) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._load_hf = load_hf
        self._hf = None
        self._hf_lock = threading.Lock()

    @property
    def hf(self):
        """The transformers tokenizer (``PreTrainedTokenizerBase``), loaded on first use.

        Raises:
            OSError, ValueError: transformers cannot load it.
        """
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    self._hf = self._load_hf()
        return self._hf

    def preload(self) -> threading.Thread | None:
        """Import transformers' chat template renderer on a background thread now (a chat request waits for
        the import, an encode or decode does not); errors surface on first use instead. Nothing for a model
        without a chat template (its chats are refused without rendering). The server calls it as the engine's
        idle task (:class:`inferd.engine.async_engine.AsyncLLMEngine`), once the first request is answered.
        Returns the importing thread (None where there is nothing to import)."""
        if self.chat_template is None:
            return None

        def run() -> None:
            try:
                _renderer()
            except Exception as e:  # noqa: BLE001 - raised again to the request that needs it
                logger.warning("cannot import transformers' chat template renderer: %s", e)

        # Not a daemon thread: an import cut off at interpreter exit can crash it; exit waits for it instead.
        thread = threading.Thread(target=run, name="inferd-chat-template")
        thread.start()
        return thread

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """An upper bound on the characters of text one token stands for: the longest string in the vocabulary,
        added tokens included (a byte-level token's string has one character per byte, so it bounds the characters
        too), 4x that where the backend normalises text first (NFC composing characters, a normaliser dropping
        some, can shorten it). So text of more than ``max_token_chars * n`` characters has more than ``n`` tokens,
        and a prompt that long is refused before it is tokenized. None without the ``tokenizers`` backend."""
        if self.backend is None:
            return None
        longest = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return longest * (4 if self.backend.normalizer is not None else 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the model's special tokens (BOS...) when ``add_special_tokens``."""
        if self.backend is None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (an incomplete UTF-8 sequence decodes to U+FFFD)."""
        if self.backend is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str | list[int]:
        """``messages`` rendered with the model's chat template, as transformers' ``apply_chat_template``
        renders them (its template selection, its renderer, the special tokens as template variables; keys
        whose value is None dropped); token ids (no special tokens added) when ``tokenize``.

        Raises:
            jinja2.TemplateError, ValueError, TypeError: the template rejects the messages, the model has
                no template, or the conversation is empty.
            ImportError: transformers cannot be imported.
        """
        template = self.chat_template
        if isinstance(template, dict):  # named templates: transformers takes "default" when no tools are given
            if "default" not in template:
                raise ValueError(f"this model has several chat templates and no default: {sorted(template)}")
            template = template["default"]
        if template is None:
            raise ValueError("this model has no chat template")
        if not messages:
            raise ValueError("the conversation is empty: give at least one message")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, _ = _renderer()([chat], chat_template=template, add_generation_prompt=add_generation_prompt,
                                  **self.special_tokens)
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]


def _renderer():
    """transformers' ``render_jinja_template`` (imports transformers' package, about 1 s)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template


def _versions() -> str:
    return "\0".join([TOKENIZER_CACHE_VERSION, importlib.metadata.version("transformers"),
                      importlib.metadata.version("tokenizers")])


def _backend_matches(hf, backend) -> bool:
    """Whether ``backend`` (transformers' ``tokenizers`` backend as saved: settings transformers keeps on the live
    object, such as ``split_special_tokens``, are not in the file) gives transformers' encode and decode on the
    probes."""
    special = list(getattr(hf, "all_special_tokens", []))[:32]
    # With the special tokens in a text too: transformers may split them (split_special_tokens) or not.
    for text in [*_PROBES, " ".join(f"{t}x" for t in special), "".join(special)]:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            if backend.encode(text, add_special_tokens=special).ids != ids:
                return False
            for skip in (True, False):
                if backend.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                    return False
    return True


def _build_entry(hf, backend_matches: bool, cached: str) -> None:
    """Save transformers' tokenizer and ``inferd.json`` as the cache entry ``cached`` (atomically)."""
    staging = None
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".tok-", dir=os.path.dirname(cached))
        hf.save_pretrained(staging)
        meta = {"eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id, "backend": backend_matches,
                "chat_template": hf.chat_template, "special_tokens": hf.special_tokens_map}
        with open(os.path.join(staging, "inferd.json"), "w") as f:
            json.dump(meta, f)
        if os.path.isdir(cached):  # an entry that could not be read: replaced
            shutil.rmtree(cached, ignore_errors=True)
        elif os.path.lexists(cached):
            os.remove(cached)
        os.replace(staging, cached)  # a concurrent loader sees all of it or nothing
    except OSError as e:
        logger.info("tokenizer cache not written (%s)", e)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    prune("tokenizers", TOKENIZER_CACHE_ENTRIES)


def _folder_files(folder: str) -> list[str]:
    """The files of a Hugging Face folder that its tokenizer may be read from (every file but the weights, so a
    vocabulary under any name counts, and config.json, by whose model type transformers may pick the class), and
    those in its ``additional_chat_templates/``, in a fixed order."""
    out = []
    for sub in (folder, os.path.join(folder, "additional_chat_templates")):
        if os.path.isdir(sub):
            out += [os.path.join(sub, n) for n in sorted(os.listdir(sub))
                    if not n.endswith(_NOT_TOKENIZER) and os.path.isfile(os.path.join(sub, n))]
    return out


def load_tokenizer(source: tuple[str, str | None]) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, or of a GGUF file in it (``(folder, gguf file name)``).

    The first load of a source goes through transformers and writes the cache entry; later loads read
    the entry with ``tokenizers`` only.

    Raises:
        OSError, ValueError: transformers cannot load a tokenizer from ``source``.
    """
    folder, gguf_file = source
    # Every file transformers may read the tokenizer from: an edit of any of them is a new entry.
    files = os.path.join(folder, gguf_file) if gguf_file else _folder_files(folder)
    stats = source_stats(files)
    key = cache_key(files, _versions(), root=folder)
    cached = os.path.join(cache_dir("tokenizers"), key)

    def load_hf():
        from transformers import AutoTokenizer

        # From the entry for a GGUF file (converting its vocabulary again takes seconds), else the folder.
        return AutoTokenizer.from_pretrained(cached if gguf_file else folder)

    tok = _read_entry(cached, load_hf)
    if tok is not None:
        touch(cached)
        return tok
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else \
        AutoTokenizer.from_pretrained(folder)
    # The backend as it is saved, and a copy: transformers changes its truncation and padding settings as it encodes.
    live = getattr(hf, "backend_tokenizer", None)  # None: a slow (Python) tokenizer
    backend = type(live).from_str(live.to_str()) if live is not None else None
    matches = backend is not None and _backend_matches(hf, backend)
    if unchanged(files, stats):  # else the files were replaced while transformers read them: no entry
        _build_entry(hf, matches, cached)
    backend = backend if matches else None
    tok = Tokenizer(backend, hf.eos_token_id, hf.bos_token_id, load_hf, hf.chat_template, hf.special_tokens_map)
    tok._hf = hf
    return tok


def _read_entry(cached: str, load_hf) -> Tokenizer | None:
    """The tokenizer of cache entry ``cached``, or None where there is none or it cannot be read (missing or
    damaged files: the caller rebuilds it)."""
    try:
        with open(os.path.join(cached, "inferd.json")) as f:
            meta = json.load(f)
        backend = None
        if meta["backend"]:
            from tokenizers import Tokenizer as Backend

            backend = Backend.from_file(os.path.join(cached, "tokenizer.json"))
        template, special = meta["chat_template"], meta["special_tokens"]
        if not (template is None or isinstance(template, str) or isinstance(template, dict) and template
                and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items())):
            raise ValueError(f"chat_template is {type(template).__name__}")
        # transformers' special_tokens_map: named tokens ("bos_token", ...) as strings.
        if not (isinstance(special, dict) and all(isinstance(k, str) and k.endswith("_token") and isinstance(v, str)
                                                  for k, v in special.items())):
            raise ValueError("special_tokens is not a map of token names to strings")
        tok = Tokenizer(backend, meta["eos_token_id"], meta["bos_token_id"], load_hf, template, special)
        if backend is None:
            tok.hf  # every call needs it
        return tok
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any damage (bad JSON, missing keys, a broken tokenizer.json): rebuilt
        logger.warning("tokenizer cache entry %s unreadable (%s): rebuilding it", cached, e)
        return None
