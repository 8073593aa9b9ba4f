"""The naive baseline for benchmarks/compare.py: Hugging Face transformers' ``generate()`` behind a minimal
OpenAI-style server (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, streamed or not).

Static batching, as a plain ``generate()`` user would write it: a worker thread takes every request
waiting when it becomes free (at most ``--max-batch-size``), left-pads them into one batch, and runs
``model.generate`` greedily until the longest ``max_tokens`` of the batch; requests that arrive meanwhile
wait for the next batch. A streamer hands each step's tokens to the requests' streams, so TTFT and ITL
are measured as for the other engines. Not part of inferd: a benchmark peer only.

    python benchmarks/hf_server.py --model HF_FOLDER --port 8001 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

_END = object()


class _Job:
    def __init__(self, ids: list[int], max_tokens: int, ignore_eos: bool, loop, out: asyncio.Queue) -> None:
        self.ids, self.max_tokens, self.ignore_eos = ids, max_tokens, ignore_eos
        self.loop, self.out = loop, out
        self.tokens: list[int] = []
        self.text = ""
        self.done = False

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _BatchStreamer(BaseStreamer):
    """Receives ``[batch]`` new token ids per step from ``generate`` and streams each row's new text."""

    def __init__(self, jobs: list[_Job], tokenizer, eos: set[int]) -> None:
        self.jobs, self.tok, self.eos = jobs, tokenizer, eos
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompts
            self.prompt_seen = True
            return
        for job, t in zip(self.jobs, value.reshape(len(self.jobs), -1)[:, -1].tolist()):
            if job.done:
                continue
            if t in self.eos and not job.ignore_eos:
                job.done = True
                job.push(_END)
                continue
            job.tokens.append(t)
            text = self.tok.decode(job.tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                job.push(text[len(job.text):])
                job.text = text
            if len(job.tokens) >= job.max_tokens:
                job.done = True
                job.push(_END)

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                job.done = True
                job.push(_END)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="Hugging Face folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    eos = {model.generation_config.eos_token_id} if isinstance(model.generation_config.eos_token_id, int) else \
        set(model.generation_config.eos_token_id or [])
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    name = args.model.rstrip("/").split("/")[-1]
    pending: queue.Queue[_Job] = queue.Queue()

    def worker() -> None:
        while True:
            jobs = [pending.get()]
            while len(jobs) < args.max_batch_size:
                try:
                    jobs.append(pending.get_nowait())
                except queue.Empty:
                    break
            width = max(len(j.ids) for j in jobs)
            ids = torch.tensor([[pad] * (width - len(j.ids)) + j.ids for j in jobs])
            mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in jobs])
            stop = None if all(j.ignore_eos for j in jobs) else sorted(eos)
            try:
                with torch.inference_mode():
                    model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                   max_new_tokens=max(j.max_tokens for j in jobs), eos_token_id=stop,
                                   pad_token_id=pad, streamer=_BatchStreamer(jobs, tok, eos))
            except Exception as e:  # noqa: BLE001 - a baseline server reports and goes on
                for j in jobs:
                    if not j.done:
                        j.done = True
                        j.push(e)

    threading.Thread(target=worker, daemon=True).start()
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        if chat:
            text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body["prompt"])
        out: asyncio.Queue = asyncio.Queue()
        job = _Job(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")),
                   asyncio.get_running_loop(), out)
        pending.put(job)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None) -> dict:
            choice = ({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text or "", "finish_reason": finish})
            return {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created, "model": name,
                    "choices": [choice]}

        def usage() -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": len(job.tokens),
                    "total_tokens": len(ids) + len(job.tokens)}

        if not body.get("stream"):
            while (item := await out.get()) is not _END:
                if isinstance(item, Exception):
                    return JSONResponse({"error": {"message": str(item)}}, status_code=500)
            c = chunk(job.text, "length")
            if chat:
                c["choices"][0]["message"] = {"role": "assistant", "content": job.text}
                del c["choices"][0]["delta"]
            c["object"], c["usage"] = kind, usage()
            return c

        async def stream():
            while (item := await out.get()) is not _END:
                if isinstance(item, Exception):
                    yield f"data: {json.dumps({'error': {'message': str(item)}})}\n\n"
                    return
                if item:
                    yield f"data: {json.dumps(chunk(item))}\n\n"
            yield f"data: {json.dumps(chunk(None, 'length'))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**chunk(None), 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
