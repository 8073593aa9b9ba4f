"""Per-request generation parameters, with OpenAI's (and vLLM's) meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing logits by ~1e-12 overflows FP32.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most tokens to generate; None = up to the context limit.
        temperature: 0 (or below ``SAMPLING_EPS``) = greedy.
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, arXiv:1904.09751).
        top_k: keep the k most likely tokens; 0 or -1 = all.
        min_p: drop tokens below ``min_p * p_max`` (Nguyen et al. 2024, arXiv:2407.01082).
        seed: per-request seed; the same seed gives the same tokens whatever else runs.
        stop: strings that end generation; the matched text is not returned.
        stop_token_ids: token ids that end generation (besides the model's EOS tokens).
        ignore_eos: keep generating past EOS tokens.
        skip_special_tokens: leave special tokens out of the text.
        min_tokens: EOS and stop token ids are masked until this many tokens are generated.
        presence_penalty, frequency_penalty: OpenAI's penalties in [-2, 2], subtracted from the logits
            of tokens already generated: ``presence * (count > 0) + frequency * count``.
        repetition_penalty: Hugging Face's (Keskar et al. 2019, arXiv:1909.05858), > 0: logits of tokens
            in the prompt or the output are divided by it when positive, multiplied when negative.
        logit_bias: token id -> bias in [-100, 100] added to its logit.
        logprobs: return the log-probability of each generated token and of the ``logprobs`` most likely
            tokens (0..20), from the model's distribution before any sampling transform.
        prompt_logprobs: the same for each prompt token (the first has none).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raises:
            InvalidRequestError: a value out of range, naming the parameter.
        """
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens] = [0, {self.max_tokens}], got "
                                      f"{self.min_tokens}", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                      "repetition_penalty")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise InvalidRequestError(f"{name} must be in [0, 20], got {v}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))
