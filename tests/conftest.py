"""Shared fixtures: the real server on a loopback port, the reference model from Hugging Face
transformers, and offline engines. All use the default model, SmolLM2-135M-Instruct (GGUF)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from inferd.config import default_model_path

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List two planets of the solar system.",
    "What do bees make?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a puppy.",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Say hello in French.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``inferd serve`` in a subprocess on 127.0.0.1.

    Args:
        health_headers: headers for the readiness probe (credentials, when the server asks for them).
        verify: an ``ssl.SSLContext`` for a TLS server (the base URL is then https).
    """

    def __init__(self, *args: str, health_headers: dict | None = None, verify=None, preexec_fn=None) -> None:
        self.port = free_port()
        self.base_url = f"{'https' if verify is not None else 'http'}://127.0.0.1:{self.port}"
        self.health_headers = health_headers or {}
        self.verify = verify if verify is not None else True
        self.log_path = f"/tmp/inferd-test-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log_path).read()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", headers=self.health_headers, verify=self.verify,
                             timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()  # the fixture will not reach its teardown
        raise TimeoutError(f"server not ready: {open(self.log_path).read()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def server():
    s = ServerProcess()
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def model_name() -> str:
    return "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def hf_model():
    """The reference: transformers loading the same GGUF file, dequantized to FP32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    model.eval()
    return model, tok


def hf_greedy_tokens(model, tok, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, one full forward per token (the reference in tests)."""
    expected = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        out = []
        with torch.no_grad():
            for _ in range(max_tokens):
                out.append(int(model(input_ids=ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        expected.append(out)
    return expected


@pytest.fixture(scope="session")
def llm_fp32():
    from inferd import LLM

    return LLM(dtype="float32")


def kv_blocks_used(base_url: str) -> float:
    """The ``inferd:kv_cache_blocks_used`` gauge from /metrics."""
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("inferd:kv_cache_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("inferd:kv_cache_blocks_used missing from /metrics")


def metric(base_url: str, name: str, headers: dict | None = None, labels: str = "") -> float:
    """A sample of ``name`` from /metrics (the first, or the one whose labels contain ``labels``)."""
    for line in httpx.get(base_url + "/metrics", headers=headers).text.splitlines():
        if (line.startswith(name + "{") and labels in line) or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def collapse_supported() -> bool:
    """Whether this kernel has transparent huge pages and MADV_COLLAPSE (Linux 6.1), for the weights' move."""
    import platform

    return os.path.isdir("/sys/kernel/mm/transparent_hugepage") and \
        tuple(int(x) for x in platform.release().split(".")[:2]) >= (6, 1)
