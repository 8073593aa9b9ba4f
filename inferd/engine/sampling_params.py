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

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
