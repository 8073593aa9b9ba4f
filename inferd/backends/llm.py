"""The llm backend: a model version served by the inferd engine (continuous batching, paged KV cache).

It has no dynamic batcher: the engine batches every running request at each step. Its KServe tensors
follow Triton's vLLM backend: ``text_input`` (BYTES [1]), optional ``sampling_parameters`` (BYTES [1],
a JSON object of OpenAI-style parameters: max_tokens, temperature, top_p, top_k, seed, stop, ...) and
optional ``exclude_input_in_output`` (BOOL [1], default true); output ``text_output`` (BYTES [1]).
The OpenAI routes reach the same engine by the model's name.

Source: triton-inference-server/vllm_backend, README "Using the vLLM backend".
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import uuid
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import BackendError, InvalidInputError
from inferd.config import EngineConfig
from inferd.engine.async_engine import AsyncLLMEngine
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.metrics import EngineMetrics
from inferd.engine.sampling_params import SamplingParams
from inferd.errors import InvalidRequestError, first_field_error
from inferd.gateway import context as gateway_context
from inferd.gateway.context import EngineTimes

_INT_PARAMS = ("max_model_len", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
               "max_prefill_tokens_with_decodes")
_BOOL_PARAMS = ("enable_prefix_caching", "batch_invariant")


class KServeSamplingParameters(BaseModel):
    """``sampling_parameters`` of a KServe request: OpenAI's ranges and types, strictly (a string is not a
    number), unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0


def declare_tensors(config: mc.ModelConfig) -> None:
    """Add the llm backend's inputs and outputs to its config (for metadata and input validation)."""
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    config.input.add(name="sampling_parameters", data_type=mc.TYPE_STRING, dims=[1], optional=True)
    config.input.add(name="exclude_input_in_output", data_type=mc.TYPE_BOOL, dims=[1], optional=True)
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[1])


def engine_config(config: mc.ModelConfig, version_dir: str, device: str) -> EngineConfig:
    """The engine settings of a repository model: weights from the version folder (``model.gguf``, the
    ``model_file`` parameter, or a Hugging Face folder with config.json), tuning from ``parameters``.

    Raises:
        BackendError: no weights found, or a parameter with a bad value.
    """
    params = {k: v.string_value for k, v in config.parameters.items()}
    name = params.pop("model_file", None)
    if name:
        path = os.path.join(version_dir, name)
    elif os.path.isfile(os.path.join(version_dir, "config.json")):
        path = version_dir
    else:
        ggufs = sorted(f for f in os.listdir(version_dir) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise BackendError(f"{version_dir}: put one .gguf file or a Hugging Face folder (config.json and "
                               f"safetensors) in the version folder, or name the file in parameter model_file")
        path = os.path.join(version_dir, ggufs[0])
    if not os.path.exists(path):
        raise BackendError(f"{path} does not exist")
    kwargs = {"model": path, "served_model_name": params.pop("served_model_name", None) or config.name,
              "device": device}
    try:
        for k in _INT_PARAMS:
            if k in params:
                kwargs[k] = int(params.pop(k))
        for k in _BOOL_PARAMS:
            if k in params:
                v = params.pop(k).lower()
                if v not in ("true", "false"):
                    raise ValueError(f"{k} must be true or false")
                kwargs[k] = v == "true"
        if "dtype" in params:
            kwargs["dtype"] = params.pop("dtype")
        return EngineConfig(**kwargs)
    except ValueError as e:
        raise BackendError(f"parameters of {config.name!r}: {e}") from None


def load_engine(engine_cfg: EngineConfig, registry) -> AsyncLLMEngine:
    """Load the weights and start the engine thread.

    Raises:
        BackendError: the model cannot be loaded.
    """
    try:
        engine = LLMEngine(engine_cfg, EngineMetrics(engine_cfg.model_name(), registry))
    except (OSError, ValueError) as e:
        raise BackendError(f"cannot load {engine_cfg.resolved_model()}: {e}") from e
    return AsyncLLMEngine(engine, idle_task=lambda: after_first_answer(engine))


def after_first_answer(engine: LLMEngine) -> None:
    """The engine's idle task (run once its first request is answered): import transformers' chat template renderer
    (a chat request that comes first imports it itself) and move the weights into huge pages, each on a thread of
    its own. Both take seconds of a core, which on two cores the first request's steps would otherwise lose
    (docs/performance.md, stop 21).

    Once the import is done, a third thread moves every object alive out of the cyclic garbage collector's reach
    (:func:`freeze_objects`)."""
    importing = engine.tokenizer.preload()
    threading.Thread(target=engine.collapse_weights, name="inferd-huge-pages", daemon=True).start()
    threading.Thread(target=freeze_objects, args=(importing,), name="inferd-gc-freeze", daemon=True).start()


def freeze_objects(after: threading.Thread | None = None) -> None:
    """Once ``after`` has finished: ``gc.collect()``, then ``gc.freeze()`` (as vLLM does once it has started). The
    ~170,000 objects of the imports and the load live as long as the process, and each full collection walked them
    all holding the GIL: 89-120 ms in which no step of any stream ran (docs/performance.md, stop 24). Afterwards a
    full collection walks only the objects made since; this one collection is the last such pause."""
    if after is not None:
        after.join()
    gc.collect()
    gc.freeze()


async def infer(engine: AsyncLLMEngine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Generate for one KServe request (``text_input`` of shape [1]).

    Raises:
        InvalidInputError: bad sampling parameters, an empty or over-long prompt, or the input guard
            refused it.
        EngineOverloadedError: too many requests are waiting (load shedding).
        BackendError: the model step failed.
    """
    text = _utf8(inputs["text_input"].reshape(-1)[0], "text_input")
    raw = "{}"
    if "sampling_parameters" in inputs:
        raw = _utf8(inputs["sampling_parameters"].reshape(-1)[0], "sampling_parameters")
    try:
        params = KServeSamplingParameters.model_validate_json(raw if raw.strip() else "{}").model_dump()
    except ValidationError as e:
        loc, message, _ = first_field_error(e.errors())
        raise InvalidInputError(f"sampling_parameters{''.join('.' + x for x in loc)}: {message}",
                                "sampling_parameters") from None
    params["stop"] = params["stop"] or []
    params["stop_token_ids"] = params["stop_token_ids"] or []
    exclude = bool(inputs["exclude_input_in_output"].reshape(-1)[0]) if "exclude_input_in_output" in inputs else True
    e = engine.engine
    try:
        sp = SamplingParams(**params)
        ids = await asyncio.to_thread(e.encode, text)
        parts: list[str] = []
        generated = 0
        started = False
        try:
            async for out in engine.generate(f"kserve-{uuid.uuid4().hex}", ids, sp, gateway_context.priority()):
                started = True
                parts.append(out.delta_text)
                generated += len(out.delta_token_ids)
                if out.finished:
                    if out.finish_reason == "error":
                        raise BackendError("the model failed on this request; see the server log")
                    if out.times is not None:
                        gateway_context.record_engine_times(EngineTimes(*out.times))
        finally:  # also when cut by a deadline or a client that left: what ran is charged
            if started:
                gateway_context.record_usage(len(ids), generated, [text], ["".join(parts)])
        out_text = "".join(parts)
    except (InvalidRequestError, TypeError) as err:
        raise InvalidInputError(str(err), getattr(err, "param", None)) from None
    result = out_text if exclude else text + out_text
    return {"text_output": np.array([result.encode("utf-8")], dtype=object)}


def _utf8(value, name: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidInputError(f"{name}: not valid UTF-8", name) from None
