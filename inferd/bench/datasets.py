"""Benchmark workloads: prompts of known token lengths, reproducible from a seed.

Prompt text is built from whole-word tokens of the model's own vocabulary (entries of the form
" word", lower-case letters only), so a prompt of ``n`` sampled words tokenizes to exactly ``n``
tokens: a byte-level BPE pre-tokenizer splits on the leading space and each word is one vocabulary
entry. The same seed gives the same prompts and lengths on every machine and for every engine.

Workloads (``WORKLOADS``):

* ``fixed``: completions, 128 prompt tokens, 128 output tokens.
* ``chat``: chat completions, one user message; prompt lengths uniform in [32, 512] tokens and output
  lengths uniform in [32, 256] tokens (means 272 and 144).
* ``shared_prefix``: chat completions with one 1,024-token system prompt common to every request, a
  32-token user question that differs, 64 output tokens (what prefix caching is for).
* ``long_prompt``: completions, 2,000 prompt tokens, 64 output tokens.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

_WORD = re.compile(r"^[a-z]{3,12}$")


@dataclass
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt: completion prompt text (None for chat requests).
        messages: chat messages (None for completion requests).
        prompt_len: prompt tokens as the tokenizer counts the text (before any chat template).
        output_len: tokens to generate (``max_tokens``; EOS is ignored).
    """

    prompt: str | None
    messages: list[dict] | None
    prompt_len: int
    output_len: int

    def to_json(self) -> str:
        return json.dumps({"prompt": self.prompt, "messages": self.messages, "prompt_len": self.prompt_len,
                           "output_len": self.output_len})


@dataclass
class Workload:
    name: str
    description: str
    chat: bool
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    shared_prefix_len: int = 0
    extra: dict = field(default_factory=dict)


WORKLOADS: dict[str, Workload] = {
    "fixed": Workload("fixed", "completions, 128 tokens in, 128 out", False, (128, 128), (128, 128)),
    "chat": Workload("chat", "chat, prompt uniform in [32, 512] tokens, output uniform in [32, 256]", True,
                     (32, 512), (32, 256)),
    "shared_prefix": Workload("shared_prefix", "chat, a common 1,024-token system prompt + a 32-token "
                              "question, 64 out", True, (32, 32), (64, 64), shared_prefix_len=1024),
    "long_prompt": Workload("long_prompt", "completions, 2,000 tokens in, 64 out", False, (2000, 2000), (64, 64)),
}


class WordSampler:
    """Samples text of an exact token count from the tokenizer's whole-word vocabulary entries."""

    def __init__(self, tokenizer) -> None:
        words = []
        for tok in tokenizer.get_vocab():
            text = tokenizer.convert_tokens_to_string([tok])
            if text.startswith(" ") and _WORD.match(text[1:]):
                words.append(text)
        words.sort()
        # Keep only words that really encode to one token on their own (a guard against odd vocabularies).
        self.words = [w for w in words if len(tokenizer.encode(w, add_special_tokens=False)) == 1]
        if len(self.words) < 100:
            raise ValueError("the tokenizer has too few whole-word tokens to build benchmark prompts")

    def text(self, rng: random.Random, n_tokens: int) -> str:
        """``n_tokens`` random words, each one token; the text starts with a space, which is part of the
        first word's token."""
        return "".join(rng.choice(self.words) for _ in range(n_tokens))


def make_requests(workload: str | Workload, tokenizer, num_prompts: int, seed: int = 0,
                  input_len: int | None = None, output_len: int | None = None) -> list[BenchRequest]:
    """The workload's requests, identical for a given seed.

    Args:
        workload: a name in :data:`WORKLOADS` or a :class:`Workload`.
        tokenizer: the model's Hugging Face tokenizer (only its vocabulary is used).
        num_prompts: how many requests.
        seed: random seed for lengths and words.
        input_len, output_len: override the workload's lengths with fixed ones (tokens).

    Raises:
        KeyError: an unknown workload name.
    """
    wl = WORKLOADS[workload] if isinstance(workload, str) else workload
    rng = random.Random(seed)
    sampler = WordSampler(tokenizer)
    system = None
    if wl.shared_prefix_len:
        system = "You are a helpful assistant. Here is the document:" + sampler.text(rng, wl.shared_prefix_len)
    out = []
    for _ in range(num_prompts):
        n_in = input_len if input_len is not None else rng.randint(*wl.input_len)
        n_out = output_len if output_len is not None else rng.randint(*wl.output_len)
        if wl.chat:
            words = sampler.text(rng, max(n_in - 1, 0))
            content = "Continue this text:" + words if n_in > 1 else "Hi"
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
            n = len(tokenizer.encode(content, add_special_tokens=False))
            if system:
                n += len(tokenizer.encode(system, add_special_tokens=False))
            out.append(BenchRequest(None, msgs, n, n_out))
        else:
            text = sampler.text(rng, n_in)
            out.append(BenchRequest(text, None, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return out


def load_dataset(path: str) -> list[BenchRequest]:
    """Requests from a JSON-lines file: per line ``{"prompt": str}`` or ``{"messages": [...]}``, with
    ``"output_len"`` (tokens) and optionally ``"prompt_len"``.

    Raises:
        ValueError: a line without a prompt or messages, or without output_len.
    """
    reqs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not (d.get("prompt") or d.get("messages")) or not isinstance(d.get("output_len"), int):
                raise ValueError(f"{path}:{i}: need 'prompt' or 'messages', and an integer 'output_len'")
            reqs.append(BenchRequest(d.get("prompt"), d.get("messages"), int(d.get("prompt_len") or 0),
                                     d["output_len"]))
    return reqs
