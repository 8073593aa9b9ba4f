"""POST /v1/embeddings (OpenAI's embeddings API) over an embedding model of the repository.

Every input item becomes one request to the model's dynamic batcher, so items of this request and of
others are batched together; results come back in input order. ``usage.prompt_tokens`` counts the
tokens the model saw (special tokens included).

Source: https://platform.openai.com/docs/api-reference/embeddings/create
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from inferd.backends.base import BackendError, InvalidInputError
from inferd.batching.dynamic_batcher import BatcherClosedError, QueueFullError, QueueTimeoutError
from inferd.gateway import context as gateway_context
from inferd.repository.manager import LoadedVersion
from inferd.server.protocol import EmbeddingRequest
from inferd.server.serving import error_response


async def create_embeddings(lv: LoadedVersion, body: EmbeddingRequest) -> JSONResponse | dict:
    """Embed ``body.input`` with the model version ``lv``.

    Returns:
        OpenAI's ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage"}``, or the error response: 400 for an input the model cannot take (too long, a token id
        outside the vocabulary, a ``dimensions`` other than the model's), 503 when its queue is full.
    """
    items = body.input
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]
    dim = next((list(o.dims)[-1] for o in lv.config.output if o.name == "embedding"), None)
    if body.dimensions is not None and body.dimensions != dim:
        return error_response(400, f"dimensions: this model returns {dim}-dimensional embeddings and cannot "
                                   f"shorten them", "dimensions")
    texts = [x for x in items if isinstance(x, str)]
    try:
        lengths = iter([len(ids) for ids in await run_in_threadpool(lv.tokenizer.tokenize, texts)] if texts else [])
        rows = []
        for x in items:
            if isinstance(x, str):
                rows.append(({"text": np.array([[x.encode("utf-8")]], dtype=object)}, next(lengths)))
            else:
                rows.append(({"input_ids": np.array([x], dtype=np.int64)}, len(x)))
        futures = [lv.batcher.submit(inputs) for inputs, _ in rows]
    except (QueueFullError, BatcherClosedError) as e:
        if isinstance(e, QueueFullError):
            gateway_context.record_shed()
        return error_response(503, str(e), None, "service_unavailable", {"retry-after": "1"})
    try:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except InvalidInputError as e:
        return error_response(400, f"input: {e}", "input")
    except QueueTimeoutError as e:
        return error_response(503, str(e), None, "service_unavailable")
    except BackendError as e:
        gateway_context.record_outcome(False)
        return error_response(500, str(e), None, "internal_server_error")
    except asyncio.CancelledError:
        for f in futures:
            f.cancel()
        raise
    data = []
    for i, out in enumerate(results):
        vec = out["embedding"][0].astype(np.float32)
        emb = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
               if body.encoding_format == "base64" else vec.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(n for _, n in rows)
    gateway_context.record_outcome(True)
    gateway_context.record_usage(tokens, 0)
    return {"object": "list", "data": data, "model": lv.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
