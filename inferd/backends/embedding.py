"""The embedding backend: a BERT-family sentence encoder (Sentence-BERT) turning texts into vectors.

A version folder holds a model laid out as `sentence-transformers <https://www.sbert.net>`_ saves it::

    <repository>/<model>/<version>/
        modules.json                 # the pipeline: Transformer, Pooling, optionally Normalize
        config.json                  # the Hugging Face transformer's config
        model.safetensors            # its weights (pickled pytorch_model.bin is refused)
        tokenizer.json               # a Hugging Face `tokenizers` tokenizer
        sentence_bert_config.json    # max_seq_length, do_lower_case
        1_Pooling/config.json        # the pooling mode(s)

The transformer runs a text's tokens (special tokens included); pooling turns its last hidden states
``[n_tokens, hidden]`` into one vector, weighting by the attention mask so padding never counts:
``mean`` (the average), ``cls`` (the first token), ``max`` (element-wise maximum) or
``mean_sqrt_len_tokens`` (the sum divided by ``sqrt(n_tokens)``); several modes are concatenated in that
order (cls, max, mean, mean_sqrt_len_tokens), as sentence-transformers does. ``Normalize`` scales each
vector to unit L2 norm, so a dot product is the cosine similarity.

Tensors (Triton model configuration; with ``max_batch_size > 0`` each carries a leading batch dim ``B``):

* input ``text``: TYPE_STRING (BYTES), dims ``[1]`` -> ``[B, 1]`` numpy object array of UTF-8 ``bytes``;
* input ``input_ids``: TYPE_INT64, dims ``[-1]`` -> ``[B, L]`` int64: whole token sequences as
  :meth:`SentenceEncoder.tokenize` returns them (special tokens included, no padding: every row is ``L``
  tokens, since the dynamic batcher only batches requests of the same shape);
* output ``embedding``: TYPE_FP32, dims ``[dim]`` -> ``[B, dim]`` float32.

Both inputs are optional in the config; a request carries exactly one of them.

Texts are never truncated: a sequence longer than ``max_seq_length`` tokens is an
:class:`~inferd.backends.base.InvalidInputError` (sentence-transformers would silently cut it).

Batch invariance (on CPU): a row's embedding is bit-identical whether it runs alone or in any batch. A
plain padded batch is not: MKL's sgemm takes another kernel below 16 rows (a short text alone), and
padding a sequence of more than 16 tokens to 33 or more changes the attention's arithmetic; the rows
differ by up to ~2.2e-7 (all-MiniLM-L6-v2, float32; sentence-transformers alone vs batched too).
Grouping rows of equal length into one unpadded pass is not enough either: a group of 32 rows takes
other GEMM kernels than a group of 8 when torch runs on 2 threads. So, in batch-invariant mode,
:meth:`SentenceEncoder.embed_ids` runs each row alone, padded to :data:`MIN_PADDED_LENGTH` tokens when it
is shorter (padding to 16 rows keeps MKL on one kernel and was measured not to change the result): a
row's arithmetic then depends only on its own tokens. GPU kernels pick shape-dependent algorithms anyway
and pay a launch per forward pass, so on ``cuda`` the default is one padded forward pass per batch, as
sentence-transformers runs it (``batch_invariant`` chooses either way). The dynamic batcher still saves
the queueing and dispatch; the model's arithmetic is per row.

Sources:
    Nils Reimers and Iryna Gurevych, "Sentence-BERT: Sentence Embeddings using Siamese BERT-Networks",
    EMNLP 2019, arXiv:1908.10084 (mean/cls/max pooling over BERT token embeddings);
    sentence-transformers ``models.Transformer``, ``models.Pooling`` and ``models.Normalize``
    (UKPLab/sentence-transformers), whose saved folder layout and pooling arithmetic this follows.
"""

from __future__ import annotations

import json
import os

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import Backend, BackendError, InvalidInputError
from inferd.config import cpu_threads

TEXT_INPUT = "text"
IDS_INPUT = "input_ids"
OUTPUT = "embedding"

# Sequences shorter than this are padded up to it (batch_invariant mode): below 16 rows MKL's sgemm
# takes another kernel, so a short sequence alone would not match itself inside a batch. (Padding up to
# 16 was measured bit-neutral for every length 1..16, alone or with other rows.)
MIN_PADDED_LENGTH = 16

# Pooling modes in sentence-transformers' concatenation order, with their legacy config keys.
POOLING_MODES = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
}
_OTHER_POOLING_KEYS = {"pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"

# Architectures whose position ids start after the padding index (RoBERTa's "padding_idx + 1" offset).
_PADDING_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "longformer",
                             "data2vec-text"}


def _read_json(path: str) -> dict | list:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BackendError(f"cannot read {path}: {e}") from None


def _module_type(entry: dict) -> str:
    # sentence-transformers >= 3 may write the new module paths (sentence_transformers.base.modules...).
    t = entry.get("type", "")
    for short in ("Transformer", "Pooling", "Normalize"):
        if t.rsplit(".", 1)[-1] == short and t.startswith("sentence_transformers."):
            return f"sentence_transformers.models.{short}"
    return t


def _pooling_modes(cfg: dict, path: str) -> tuple[str, ...]:
    """The pooling modes of a ``1_Pooling/config.json``, legacy booleans or the newer ``pooling_mode``."""
    if "pooling_mode" in cfg:
        raw = cfg["pooling_mode"]
        modes = (raw,) if isinstance(raw, str) else tuple(raw)
    else:
        for key, mode in _OTHER_POOLING_KEYS.items():
            if cfg.get(key):
                modes = (mode,)
                break
        else:
            modes = tuple(m for m, key in POOLING_MODES.items() if cfg.get(key)) or ("mean",)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise BackendError(f"{path}: pooling mode {bad[0]!r} is not supported "
                           f"(supported: {', '.join(POOLING_MODES)})")
    return modes


class SentenceEncoder:
    """A sentence-transformers model (Transformer -> Pooling -> optional Normalize) in float32, eval mode.

    Args:
        folder: a folder laid out as sentence-transformers saves a model (see the module docstring).
        device: ``"cpu"`` or ``"cuda:N"``.
        batch_invariant: run each distinct token count as its own unpadded forward pass (short sequences
            padded to :data:`MIN_PADDED_LENGTH`), so that a row's embedding does not depend on the other
            rows of its batch. ``False``: one forward pass per batch, padded to its longest row, as
            sentence-transformers does (bits vary by ~2e-7 with the batch). Default: ``True`` on CPU,
            ``False`` on CUDA.

    Attributes:
        dim: the embedding width (``hidden_size`` times the number of pooling modes).
        max_seq_length: the most tokens a sequence may have, special tokens included.
        pooling_modes: the pooling modes, in concatenation order.
        normalize: whether embeddings are scaled to unit L2 norm.
        vocab_size: token ids must be in ``[0, vocab_size)``.

    Raises:
        BackendError: a file is missing or unreadable, the weights are pickled only, or the pipeline has a
            module this class does not run (Dense, LayerNorm, ...).
    """

    def __init__(self, folder: str, device: str = "cpu", batch_invariant: bool | None = None) -> None:
        import torch
        from tokenizers import Tokenizer
        from tokenizers.normalizers import Lowercase
        from tokenizers.normalizers import Sequence as NormalizerSequence
        from transformers import AutoConfig, AutoModel

        self.folder = folder
        self.device = device
        self.batch_invariant = device == "cpu" if batch_invariant is None else batch_invariant
        if not os.path.isdir(folder):
            raise BackendError(f"{folder} is not a folder")

        # The pipeline (modules.json); without one, sentence-transformers uses Transformer + mean pooling.
        modules_path = os.path.join(folder, "modules.json")
        if os.path.isfile(modules_path):
            modules = _read_json(modules_path)
            if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
                raise BackendError(f"{modules_path}: expected a list of modules")
            modules = sorted(modules, key=lambda m: m.get("idx", 0))
        else:
            modules = [{"type": _TRANSFORMER, "path": ""}]
        types = [_module_type(m) for m in modules]
        if types not in ([_TRANSFORMER], [_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE],
                         [_TRANSFORMER, _NORMALIZE]):
            raise BackendError(f"{modules_path}: the embedding backend runs a Transformer, then optionally Pooling "
                               f"and Normalize, nothing else (found {', '.join(m.get('type', '?') for m in modules)})")
        self.normalize = _NORMALIZE in types
        tdir = os.path.join(folder, modules[0].get("path", "") or "")

        # Weights: safetensors only; refuse pickles (torch.load can run arbitrary code).
        files = set(os.listdir(tdir)) if os.path.isdir(tdir) else set()
        if not os.path.isfile(os.path.join(tdir, "config.json")):
            raise BackendError(f"{tdir}: config.json (the transformer's configuration) is missing")
        if not ({"model.safetensors", "model.safetensors.index.json"} & files):
            if {"pytorch_model.bin", "pytorch_model.bin.index.json"} & files:
                raise BackendError(f"{tdir}: only pickled weights (pytorch_model.bin) found; inferd loads "
                                   "safetensors only: convert them to model.safetensors")
            raise BackendError(f"{tdir}: model.safetensors is missing")

        # Sequence length and lower-casing (sentence_bert_config.json), capped by the position embeddings.
        sbert_path = os.path.join(tdir, "sentence_bert_config.json")
        sbert = _read_json(sbert_path) if os.path.isfile(sbert_path) else {}
        try:
            hf_config = AutoConfig.from_pretrained(tdir, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any parse failure is a load failure
            raise BackendError(f"{tdir}/config.json: {e}") from None

        tok_path = os.path.join(tdir, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise BackendError(f"{tdir}: tokenizer.json is missing (a Hugging Face fast tokenizer is needed)")
        try:
            tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"{tok_path}: {e}") from None
        tokenizer_pad = tokenizer.padding["pad_id"] if tokenizer.padding else None
        # tokenizer.json may carry truncation and fixed padding (all-MiniLM-L6-v2's pads to 128): drop both.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if sbert.get("do_lower_case"):
            # As sentence-transformers does: lowercase first unless the normalizer already has Lowercase.
            norm = tokenizer.normalizer
            has_lower = isinstance(norm, Lowercase) or (
                isinstance(norm, NormalizerSequence) and any(isinstance(n, Lowercase) for n in norm))
            if not has_lower:
                tokenizer.normalizer = NormalizerSequence([Lowercase()] + (
                    list(norm) if isinstance(norm, NormalizerSequence) else [norm] if norm is not None else []))
        self._tokenizer = tokenizer

        positions = getattr(hf_config, "max_position_embeddings", None)
        if positions is not None and positions > 0 and hf_config.model_type in _PADDING_OFFSET_POSITIONS:
            positions -= (getattr(hf_config, "pad_token_id", None) or 0) + 1
        limit = sbert.get("max_seq_length")
        if limit is None:
            tcfg_path = os.path.join(tdir, "tokenizer_config.json")
            tcfg = _read_json(tcfg_path) if os.path.isfile(tcfg_path) else {}
            limit = tcfg.get("model_max_length")
            if not isinstance(limit, int) or limit > 1_000_000:
                limit = None
        if limit is None and (positions is None or positions <= 0):
            raise BackendError(f"{tdir}: no max_seq_length in sentence_bert_config.json and no "
                               "max_position_embeddings in config.json: the sequence limit is unknown")
        self.max_seq_length = int(min(x for x in (limit, positions) if x is not None and x > 0))

        # Pooling.
        hidden = int(hf_config.hidden_size)
        if _POOLING in types:
            pdir = os.path.join(folder, modules[types.index(_POOLING)].get("path", ""))
            ppath = os.path.join(pdir, "config.json")
            pcfg = _read_json(ppath)
            self.pooling_modes = _pooling_modes(pcfg, ppath)
            width = pcfg.get("embedding_dimension", pcfg.get("word_embedding_dimension", hidden))
            if width != hidden:
                raise BackendError(f"{ppath}: pooling expects {width}-wide token embeddings but the "
                                   f"transformer's hidden_size is {hidden}")
        else:
            self.pooling_modes = ("mean",)
        self.dim = hidden * len(self.pooling_modes)

        # The transformer, float32, eval mode, never pickled and never remote code.
        try:
            model = AutoModel.from_pretrained(tdir, use_safetensors=True, local_files_only=True,
                                              dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"{tdir}: cannot load the transformer: {e}") from None
        self._model = model.to(device).eval()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)

        # Padding is masked out; its id matters only to RoBERTa-style position ids (pad_token_id based).
        pad = getattr(hf_config, "pad_token_id", None)
        if pad is None:
            pad = tokenizer_pad
        self.pad_token_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self._torch = torch

    # -- tokens ----------------------------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens included (``[CLS] ... [SEP]`` for BERT), untruncated.

        An empty text gives just the special tokens.
        """
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def check_ids(self, ids: list[list[int]], noun: str = "token sequence") -> None:
        """Raise :class:`InvalidInputError` for an empty sequence, one over :attr:`max_seq_length`, or an id
        outside the vocabulary. ``noun`` names the rows in the message (``"text"`` for texts)."""
        for i, row in enumerate(ids):
            n = len(row)
            if n == 0:
                raise InvalidInputError(f"row {i}: the token sequence is empty; a sequence needs at least "
                                        "the special tokens (an empty text gives them)")
            if n > self.max_seq_length:
                raise InvalidInputError(f"row {i}: the {noun} is {n} tokens long (special tokens included) but "
                                        f"this model takes at most {self.max_seq_length} tokens "
                                        "(max_seq_length); inferd does not truncate, shorten it")
            for j, t in enumerate(row):
                if not 0 <= t < self.vocab_size:
                    raise InvalidInputError(f"row {i}: token id {t} at position {j} is outside this model's "
                                            f"vocabulary [0, {self.vocab_size})")

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_ids(self, ids: list[list[int]], _noun: str = "token sequence") -> np.ndarray:
        """Embed whole token sequences (as :meth:`tokenize` returns them).

        Args:
            ids: ``n`` sequences of token ids, each 1..``max_seq_length`` long, ids in ``[0, vocab_size)``.

        Returns:
            float32 array ``[n, dim]`` (unit rows when the model normalizes).

        Raises:
            InvalidInputError: an empty or over-long sequence, or an id outside the vocabulary.
        """
        ids = [[int(t) for t in row] for row in ids]
        self.check_ids(ids, _noun)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        if not ids:
            return out
        if self.batch_invariant:  # each row alone: MKL picks its GEMM kernels by the row count
            for i, row in enumerate(ids):
                out[i] = self._forward([row], max(len(row), MIN_PADDED_LENGTH))[0]
        else:
            out[:] = self._forward(ids, max(len(r) for r in ids))
        return out

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """Embed texts: :meth:`tokenize`, then :meth:`embed_ids`. Returns float32 ``[n, dim]``.

        Raises:
            InvalidInputError: a text longer than ``max_seq_length`` tokens.
        """
        return self.embed_ids(self.tokenize(texts), "text")

    def _forward(self, ids: list[list[int]], length: int) -> np.ndarray:
        """Run sequences right-padded to ``length``; pool and normalize. Returns float32 ``[n, dim]``."""
        torch = self._torch
        n = len(ids)
        input_ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        try:
            with torch.inference_mode():
                hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                vec = self._pool(hidden, mask)
                if self.normalize:
                    vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"the transformer failed: {e}") from None
        return vec.float().cpu().numpy()

    def _pool(self, hidden, mask):
        """sentence-transformers' ``Pooling._forward_padded`` for right-padded float32 batches:
        ``hidden`` ``[n, L, H]`` and ``mask`` ``[n, L]`` -> ``[n, H * len(pooling_modes)]``."""
        torch = self._torch
        vectors = []
        fmask = mask.unsqueeze(-1).to(hidden.dtype)
        for mode in self.pooling_modes:
            if mode == "cls":
                vectors.append(hidden[:, 0])
            elif mode == "max":
                vectors.append(hidden.masked_fill(fmask == 0, float("-inf")).max(dim=1).values)
            else:
                total = (hidden * fmask).sum(dim=1)
                count = torch.clamp(fmask.sum(dim=1), min=1e-9)
                vectors.append(total / (count if mode == "mean" else torch.sqrt(count)))
        return torch.cat(vectors, dim=-1)

    def close(self) -> None:
        self._model = None


def _decode(value, row: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInputError(f"row {row}: the text is not valid UTF-8 ({e.reason} at byte {e.start})",
                                    TEXT_INPUT) from None
    raise InvalidInputError(f"row {row}: expected UTF-8 bytes, got {type(value).__name__}", TEXT_INPUT)


class EmbeddingBackend(Backend):
    """Serves a :class:`SentenceEncoder` from a version folder under the config's ``embedding`` backend.

    Inputs (give exactly one per request; both optional in the config, at least one declared):
    ``text`` TYPE_STRING dims ``[1]`` (batch ``[B, 1]`` of UTF-8 bytes) or ``input_ids`` TYPE_INT64 dims
    ``[-1]`` (batch ``[B, L]``, every row a whole sequence of ``L`` ids, special tokens included).
    Output: ``embedding`` TYPE_FP32 dims ``[dim]`` (batch ``[B, dim]``). With ``max_batch_size: 0`` the
    shapes lose their leading ``B``.

    Parameters (config ``parameters``): ``num_threads`` sets ``torch.set_num_threads`` (process-wide; default
    :func:`inferd.config.cpu_threads`: ``OMP_NUM_THREADS``, else the affinity capped by the cgroup's CPU limit);
    ``batch_invariant`` (``"true"``/``"false"``; default true on CPU, false on CUDA) is passed to
    :class:`SentenceEncoder`.

    Raises:
        BackendError: the folder cannot be loaded (see :class:`SentenceEncoder`), or the config's tensors do
            not match the model (unknown input, wrong dtype or dims, ``embedding`` not ``[dim]`` FP32).
    """

    def __init__(self, version_dir: str, config, device: str = "cpu") -> None:
        super().__init__(version_dir, config, device)
        params = {k: v.string_value for k, v in config.parameters.items()}
        threads = cpu_threads()[0]
        if "num_threads" in params:
            try:
                threads = int(params["num_threads"])
                if threads < 1:
                    raise ValueError
            except ValueError:
                raise BackendError(f"parameter num_threads must be a positive integer, "
                                   f"not {params['num_threads']!r}") from None
        import torch
        torch.set_num_threads(threads)
        invariant = None
        if "batch_invariant" in params:
            value = params["batch_invariant"].strip().lower()
            if value not in ("true", "false"):
                raise BackendError(f"parameter batch_invariant must be true or false, not {value!r}")
            invariant = value == "true"
        self.encoder = SentenceEncoder(version_dir, device, batch_invariant=invariant)
        self._check_config(config)
        self.batched = config.max_batch_size > 0

    def _check_config(self, config) -> None:
        dim = self.encoder.dim
        want = {TEXT_INPUT: (mc.TYPE_STRING, [1]), IDS_INPUT: (mc.TYPE_INT64, [-1])}
        names = set()
        for t in config.input:
            if t.name not in want:
                raise BackendError(f"the embedding backend has no input {t.name!r} (inputs: text, input_ids)")
            dtype, dims = want[t.name]
            if t.data_type != dtype or list(t.dims) != dims:
                raise BackendError(f"input {t.name!r} must be {mc.DataType.Name(dtype)} with dims {dims}")
            names.add(t.name)
        if not names:
            raise BackendError("declare input text (TYPE_STRING [1]) or input_ids (TYPE_INT64 [-1]), or both")
        outs = list(config.output)
        if [o.name for o in outs] != [OUTPUT]:
            raise BackendError(f"the embedding backend has one output, {OUTPUT!r} (TYPE_FP32 [{dim}])")
        if outs[0].data_type != mc.TYPE_FP32 or list(outs[0].dims) not in ([dim], [-1]):
            raise BackendError(f"output {OUTPUT!r} must be TYPE_FP32 with dims [{dim}] for this model")
        self.input_names = names

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Embed a batch of texts (``text`` ``[B, 1]`` bytes) or token sequences (``input_ids`` ``[B, L]``).

        Returns:
            ``{"embedding": float32 [B, dim]}`` (``[dim]`` when the model does not batch).

        Raises:
            InvalidInputError: both or neither input given; a text not UTF-8; a sequence empty, longer
                than ``max_seq_length`` or with an id outside the vocabulary.
        """
        given = [n for n in (TEXT_INPUT, IDS_INPUT) if n in inputs]
        if len(given) != 1:
            raise InvalidInputError(f"give exactly one of the inputs {TEXT_INPUT!r} and {IDS_INPUT!r} "
                                    f"(got {', '.join(map(repr, given)) or 'neither'})", given[0] if given else None)
        name = given[0]
        arr = np.asarray(inputs[name])
        if not self.batched:
            arr = arr[None]
        try:
            if name == TEXT_INPUT:
                texts = [_decode(v, i) for i, v in enumerate(arr.reshape(arr.shape[0], -1)[:, 0])] \
                    if arr.size else []
                emb = self.encoder.embed_texts(texts)
            else:
                if arr.ndim != 2:
                    raise InvalidInputError(f"input_ids must be [batch, tokens], got shape {list(arr.shape)}",
                                            IDS_INPUT)
                emb = self.encoder.embed_ids(arr.astype(np.int64, copy=False).tolist())
        except InvalidInputError as e:
            if e.input_name is None:
                e.input_name = name
            raise
        return {OUTPUT: emb if self.batched else emb[0]}

    def close(self) -> None:
        self.encoder.close()


def default_config(name: str, max_batch_size: int, *, dim: int = 384) -> str:
    """The ``config.pbtxt`` text for an embedding model (``dim`` 384: all-MiniLM-L6-v2).

    Both inputs are optional (a request sends one); with ``max_batch_size > 0`` the dynamic batcher is on.
    """
    lines = [
        f'name: "{name}"',
        'backend: "embedding"',
        f"max_batch_size: {max_batch_size}",
        "input [",
        '  { name: "text" data_type: TYPE_STRING dims: [ 1 ] optional: true },',
        '  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] optional: true }',
        "]",
        "output [",
        f'  {{ name: "embedding" data_type: TYPE_FP32 dims: [ {dim} ] }}',
        "]",
    ]
    if max_batch_size > 0:
        lines.append("dynamic_batching { }")
    return "\n".join(lines) + "\n"
