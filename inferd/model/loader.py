"""Checkpoint loading: GGUF and Hugging Face safetensors folders, never pickle.

Both paths produce a :class:`~inferd.config.ModelConfig` and a state dict whose keys follow the Hugging
Face Llama naming (``model.layers.{i}.self_attn.q_proj.weight`` ...), so the model code reads one layout.

GGUF (llama.cpp's file format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is read and
dequantized with the ``gguf`` package. llama.cpp's converter permutes the rows of the Q and K projections
of Llama checkpoints (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) so that RoPE can rotate adjacent
pairs; :func:`unpermute_qk` undoes that so the weights match the Hugging Face "rotate half" layout.

Reading a GGUF file takes seconds: ``gguf``'s reader parses every metadata field (the tokenizer's
~100,000 vocabulary and merge strings one by one) and the tensors are dequantized with numpy. The
result, the FP32 state dict and the config, is therefore saved once as safetensors in
:mod:`inferd.cache` (``checkpoints``, keyed by the file's bytes and :data:`GGUF_CACHE_VERSION`) and later loads
read that instead (the same tensors, bit for bit).

Safetensors files (a Hugging Face folder's, the cache's) are read lazily, one tensor at a time as the model
converts it to the serving dtype (:class:`SafetensorsStateDict`), so the whole checkpoint never sits in
memory as tensors at once: 257 MiB less at the load peak for SmolLM2-135M's Hugging Face folder
(docs/performance.md; a mapped file's pages still count while it is open).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import logging
import mmap
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from inferd.cache import cache_dir, cache_key, prune, source_stats, touch, unchanged
from inferd.config import ModelConfig

logger = logging.getLogger("inferd.model")

try:  # the C library, for madvise and malloc_trim where it has them
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def madvise(start: int, length: int, advice: int | None) -> bool:
    """madvise(2) over ``length`` bytes from address ``start`` (page-aligned), without holding the GIL (ctypes
    releases it; ``mmap.madvise`` does not). Returns whether the C library has it and it succeeded."""
    if advice is None or length <= 0 or not hasattr(_libc, "madvise"):
        return False
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) != 0:
        logger.debug("madvise(%d) over %d bytes failed: %s", advice, length, os.strerror(ctypes.get_errno()))
        return False
    return True

# Bump when _load_gguf's output changes, so that old cache entries are not used.
GGUF_CACHE_VERSION = "1"
# Checkpoints kept in the cache (about 4 bytes per parameter each), least recently used dropped first.
CHECKPOINT_CACHE_ENTRIES = 3

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        config: the architecture.
        state_dict: parameter name -> CPU tensor in the checkpoint's own dtype (FP32 from GGUF; converted
            to the serving dtype by the model); a :class:`SafetensorsStateDict` reads it on access.
        tokenizer_source: (folder, gguf file name or None) for ``AutoTokenizer.from_pretrained``.
    """

    config: ModelConfig
    state_dict: Mapping[str, torch.Tensor]
    tokenizer_source: tuple[str, str | None]


class SafetensorsStateDict(Mapping):
    """The tensors of one or more safetensors files, each read from the file (memory-mapped) when it is
    looked up, as a new CPU tensor in the file's dtype; nothing is held but the open files.

    Raises:
        safetensors.SafetensorError: a file is not valid safetensors (from the constructor).
    """

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._files = [safe_open(fn, framework="pt") for fn in files]
        self._where = {k: f for f in self._files for k in f.keys()}

    def metadata(self) -> dict[str, str]:
        """The first file's metadata header."""
        return self._files[0].metadata() or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the file's pages under ``tensor`` (a view this object returned, already copied) from the
        process: ``madvise(MADV_DONTNEED)`` over the whole pages inside it (madvise(2)). The mapping is
        private and never written, so a later read faults the same bytes back in from the file; meanwhile
        they no longer count in the resident size, which would otherwise reach the whole file by the end
        of loading (538 MB for the default model's FP32 entry, docs/performance.md). A no-op where the C
        library has no ``madvise``.
        """
        page = mmap.PAGESIZE
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        madvise(start, end - start, MADV_DONTNEED)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Args:
        w: ``[n_head * head_dim, in_features]`` (or ``[n_head * head_dim]`` for a bias) as stored in GGUF.
        n_head: number of query heads for Q, key/value heads for K.

    Returns:
        The rows in Hugging Face order: per head, first all even then all odd rotary components.
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def load_checkpoint(path: str) -> Checkpoint:
    """Load a GGUF file or a Hugging Face folder (config.json, ``*.safetensors``, tokenizer files).

    Raises:
        FileNotFoundError: the path does not exist or lacks weights.
        ValueError: an unsupported architecture or file type (``.bin``/``.pt`` pickles are refused).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _load_gguf_cached(path)
        raise ValueError(f"{path!r}: inferd loads GGUF files and Hugging Face safetensors folders")
    return _load_hf_folder(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _load_gguf_cached(path: str) -> Checkpoint:
    """:func:`_load_gguf` through the checkpoint cache (an unreadable entry is rebuilt)."""
    from safetensors.torch import save_file

    stats = source_stats(path)
    entry = os.path.join(cache_dir("checkpoints"), cache_key(path, GGUF_CACHE_VERSION) + ".safetensors")
    folder, fname = os.path.split(os.path.abspath(path))
    if os.path.isfile(entry):
        try:
            state = SafetensorsStateDict([entry])
            meta = json.loads(state.metadata()["config"])
            meta["eos_token_ids"] = tuple(meta["eos_token_ids"])
            touch(entry)
            return Checkpoint(ModelConfig(**meta), state, (folder, fname))
        except Exception as e:  # noqa: BLE001 - a damaged entry: read the GGUF file again
            logger.warning("checkpoint cache entry %s unreadable (%s); reading %s", entry, e, path)
    ckpt = _load_gguf(path)
    if not unchanged(path, stats):  # replaced while it was read: these weights are not the key's
        logger.warning("%s changed while it was read; its checkpoint cache entry is not written", path)
        return ckpt
    tmp = None
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".safetensors", dir=os.path.dirname(entry))
        os.close(fd)
        save_file({k: v.contiguous() for k, v in ckpt.state_dict.items()}, tmp,
                  metadata={"config": json.dumps(dataclasses.asdict(ckpt.config)), "source": os.path.abspath(path)})
        os.replace(tmp, entry)  # atomic: a concurrent loader sees all of it or nothing
    except OSError as e:
        logger.info("checkpoint cache not written (%s)", e)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    prune("checkpoints", CHECKPOINT_CACHE_ENTRIES)
    return ckpt


def _load_gguf(path: str) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    p = f"{arch}."
    n_head = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    hidden = int(_field(reader, p + "embedding_length"))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_head))
    rope_scaling = None
    scaling_type = _field(reader, p + "rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, p + "rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {scaling_type!r} is not supported")

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = t.name
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"{path}: unexpected tensor {name}")
            if arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
                arr = unpermute_qk(arr, n_head if rest.startswith("attn_q.") else n_kv)
            key = f"model.layers.{int(layer)}.{_GGUF_LAYER_NAMES[rest]}"
        elif name in _GGUF_GLOBAL_NAMES:
            key = _GGUF_GLOBAL_NAMES[name]
        else:
            raise ValueError(f"{path}: unexpected tensor {name}")
        state[key] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    vocab = state["model.embed_tokens.weight"].shape[0]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot) if x is not None}))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in state,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in state,
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )
    folder, fname = os.path.split(os.path.abspath(path))
    return Checkpoint(cfg, state, (folder, fname))


def _load_hf_folder(path: str) -> Checkpoint:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        hf = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (pickle checkpoints are refused)")
    state = SafetensorsStateDict(files)
    arch = hf.get("model_type")
    n_head = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = hf.get("eos_token_id")
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos_ids = tuple(sorted(set(eos if isinstance(eos, list) else [] if eos is None else [eos])))
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=n_head,
        num_key_value_heads=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False) or "lm_head.weight" not in state,
        attention_bias=hf.get("attention_bias", arch == "qwen2"),
        rope_scaling=rope_scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    return Checkpoint(cfg, state, (path, None))


def release_freed_memory() -> None:
    """Return the heap memory freed after loading (the checkpoint's tensors) to the OS.

    glibc keeps freed small and medium allocations in its arenas, so the process's resident size stays at
    the load peak; ``malloc_trim(0)`` (glibc 2.8+) releases them: about 90 MB for SmolLM2-135M
    (docs/performance.md). A no-op where the C library has no ``malloc_trim``.
    """
    if hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
STEP_MMAP_THRESHOLD = 64 * 2**20  # bytes: allocations up to this size come from the heap
STEP_TRIM_THRESHOLD = 512 * 2**20  # bytes: free memory a heap keeps at its top instead of returning it


def keep_freed_heap() -> bool:
    """Let the C library keep the memory a model step frees for the next step (glibc ``mallopt``, malloc(3)).

    A step's activations are tensors of up to several MB (a 2,048-row prefill's FP32 residual stream is 4.7 MB;
    its MLP runs in passes of 3 MiB of gate_up output, llama.MLP_PASS_BYTES, so that the holes these leave are
    reused). With glibc's defaults the largest are mapped and unmapped per allocation, and freed heap memory above
    128 KiB-32 MiB is returned to the OS, so each step faults its activations back in page by page: 8,000-80,000
    page faults per 2,048-row prefill step on the machine of docs/performance.md, ~0 with an mmap threshold of
    64 MiB and a trim threshold of 512 MiB (prefill 1.04x; stop 27). The resident size stays at its high-water
    mark, which the largest step sets either way. Call once the model is loaded (its load's garbage is returned
    first by :func:`release_freed_memory`). Returns whether the C library took both settings (False where it is
    not glibc).
    """
    if not hasattr(_libc, "mallopt"):
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)) and bool(
        _libc.mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))
