"""Offline batch inference: ``LLM(model).generate(prompts, SamplingParams)``."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class GenerateOutput:
    """One prompt's result, in the order of the prompts given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """Offline engine: all prompts are batched continuously until every one is done.

    Args:
        model: GGUF file or Hugging Face folder; None = the default model (SmolLM2-135M-Instruct).
        **kwargs: any :class:`~inferd.config.EngineConfig` field (``dtype``, ``max_model_len``...).

    Construction loads the model and moves its packed weights into huge pages (:meth:`LLMEngine.collapse_weights`,
    0.1-1.1 s more; the server does that in the background once it has answered its first request).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.engine.collapse_weights()
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerateOutput]:
        """Generate for each prompt (text, or token ids).

        Raises:
            InvalidRequestError: a prompt or a parameter the engine cannot serve.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerateOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            rid = f"offline-{self._counter}"
            self._counter += 1
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, ids, p)
            results[rid] = GenerateOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                          [CompletionOutput("", [], None)])
            order.append(rid)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                c = results[out.request_id].outputs[0]
                c.text += out.delta_text
                c.token_ids.extend(out.delta_token_ids)
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return [results[r] for r in order]
