"""The engine: tokenizer, scheduler and model runner; ``step()`` is the loop body
(schedule, execute, update)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from inferd.config import EngineConfig, cpu_threads, resolve_dtype
from inferd.engine.block_manager import BlockManager
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.metrics import EngineMetrics
from inferd.engine.model_runner import ModelRunner
from inferd.engine.sampling_params import SamplingParams
from inferd.engine.scheduler import Scheduler
from inferd.engine.sequence import Sequence
from inferd.engine.tokenizer import load_tokenizer
from inferd.errors import InvalidRequestError
from inferd.model import LlamaForCausalLM, kernels, load_checkpoint
from inferd.model.loader import keep_freed_heap, release_freed_memory
from inferd.model.llama import PADDED_TILE, PREFILL_TILES_MIN_BUDGET

logger = logging.getLogger("inferd.engine")


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        delta_text: new text since the last output (stop-string hold-back applied).
        delta_token_ids: new token ids since the last output.
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` (the model step failed) when
            finished, else None.
        stop_reason: the stop string or stop token id that ended it, if any.
        delta_logprobs: logprobs of ``delta_token_ids`` when the request asked for them.
        prompt_logprobs: on a request's first output, when asked for: one entry per prompt token
            (None for the first).
        times: on the last output, ``(arrival, first scheduled, first token, finished)`` in
            ``time.monotonic()`` seconds (the middle two None if it never got that far).
    """

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    delta_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    times: tuple | None = None


class LLMEngine:
    """Loads the model and serves requests step by step. Not thread-safe: one thread calls
    ``add_sequence``, ``abort`` and ``step`` (``AsyncLLMEngine`` runs that thread);
    ``make_sequence`` may be called from any thread.

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded.
    """

    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None) -> None:
        self.config = config
        path = config.resolved_model()
        self.device = config.resolved_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(path)
        self.model_config = mc = ckpt.config
        self.model_name = config.model_name()
        # The tokenizer loads on a thread while the weights are cast and packed, which releases the GIL (on
        # a model's first load it imports transformers and converts the vocabulary: seconds).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferd-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, ckpt.tokenizer_source)
            bs = config.block_size
            num_blocks = config.kv_cache_memory_bytes // (mc.kv_bytes_per_token(self.dtype) * bs)
            self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                     mc.max_position_embeddings)
            if num_blocks * bs < self.max_model_len:
                raise ValueError(
                    f"the KV cache budget ({config.kv_cache_memory_bytes} bytes = {num_blocks * bs} tokens) "
                    f"cannot hold one request of max_model_len={self.max_model_len} tokens: raise "
                    f"--kv-cache-memory-bytes or lower --max-model-len")
            tile = PADDED_TILE if config.batch_invariant else 0
            if self.device.type == "cpu":
                threads, source = cpu_threads()
                torch.set_num_threads(threads)
                logger.info("CPU kernels on %d threads (%s)", threads, source)
            model = LlamaForCausalLM(mc, ckpt.state_dict, self.dtype, self.device, self.max_model_len, tile,
                                     prefill_tiles=config.max_num_batched_tokens >= PREFILL_TILES_MIN_BUDGET)
            del ckpt
            release_freed_memory()
            if self.device.type == "cpu":
                keep_freed_heap()
            self.runner = ModelRunner(model, num_blocks, bs)
            self.tokenizer = tokenizer.result()
        self.tokenizer_lock = threading.Lock()
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        amx, pairs = cpu_bf16 and kernels.amx_tiles(), cpu_bf16 and kernels.bf16_pair_panels()
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.resolved_max_prefill_tokens_with_decodes(self.device, amx, pairs),
                                   config.long_prefill_token_threshold)
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = mc.vocab_size
        self.seqs: dict[str, Sequence] = {}
        self.rng = torch.Generator().manual_seed(config.seed)
        self.rng_lock = threading.Lock()
        self.metrics = metrics or EngineMetrics(self.model_name)
        self.series = self.metrics.of(self.model_name)
        self._register_gauges()
        self.load_seconds = time.perf_counter() - t0
        logger.info("loaded %s (%s, %s) in %.1f s: %d KV blocks of %d tokens, max_model_len %d",
                    self.model_name, self.dtype, self.device, self.load_seconds, num_blocks, bs,
                    self.max_model_len)

    def collapse_weights(self) -> bool:
        """Move the model's packed GEMM weights into transparent huge pages (a single-stream decode step 7.7%
        shorter on this project's AVX2 machine; :meth:`inferd.model.llama.LlamaForCausalLM.collapse_weights`).
        Blocks for 0.1-1.1 s while steps may go on (4 s was seen with 8 streams decoding); returns whether it did,
        and logs the outcome where there are packed weights to move."""
        t0 = time.perf_counter()
        done = self.runner.model.collapse_weights()
        if done:
            logger.info("packed weights moved into huge pages in %.2f s", time.perf_counter() - t0)
        elif self.runner.model.panel_buffer is not None:
            logger.info("packed weights left in 4 KiB pages: the kernel cannot collapse them (MADV_COLLAPSE needs "
                        "Linux 6.1 and free huge pages)")
        return done

    # ---- requests -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (any thread; the tokenizer is shared under ``tokenizer_lock``).

        Raises:
            InvalidRequestError: the text is longer than a prompt within ``max_model_len`` tokens can be
                (``Tokenizer.max_token_chars`` characters a token): refused before it is tokenized, where
                tokenizing it would hold the tokenizer (and, in ``tokenizers``, the GIL) for seconds, stalling
                every stream (10 MB: 9 s; a 20 MB prompt also took 2 GB).
        """
        per_token = self.tokenizer.max_token_chars
        if per_token is not None and len(text) > per_token * self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters: more than this model's maximum context length of "
                f"{self.max_model_len} tokens can hold (a token is at most {per_token} characters, so at most "
                f"{per_token * self.max_model_len} characters are tokenized)", "prompt")
        with self.tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` ([{"role": ..., "content": ...}]) rendered with the model's chat template (any thread).

        Raises:
            ImportError: transformers' renderer cannot be imported.
            jinja2.TemplateError, ValueError, TypeError: the template refuses the messages, or there is none.
        """
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def make_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate a request and build its state (any thread).

        Raises:
            InvalidRequestError: empty prompt, a token id outside the vocabulary (in the prompt,
                logit_bias or stop_token_ids), or a prompt (plus max_tokens, or min_tokens) longer than the
                context.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: it must contain at least one token", "prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt contains token id {bad[0]} outside the vocabulary [0, {self.vocab_size})", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{n} tokens (at least one token must be left for the output)", "prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})", name)
        if params.min_tokens > self.max_model_len - n:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {_tokens(n)}, "
                f"which leaves room for {self.max_model_len - n}, fewer than min_tokens ({params.min_tokens})",
                "min_tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {_tokens(n)} "
                f"and max_tokens is {max_tokens}, {n + max_tokens} in all: lower max_tokens to at "
                f"most {self.max_model_len - n}", "max_tokens")
        gen = torch.Generator(device=self.device)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            with self.rng_lock:
                gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.rng)))
        detok = IncrementalDetokenizer(_LockedTokenizer(self), prompt_token_ids, params.skip_special_tokens,
                                       params.stop)
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                       max_tokens=max_tokens, detokenizer=detok, generator=gen)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already running")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.series.prompt_tokens.inc(seq.num_prompt_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(request_id, prompt_token_ids, params)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it is not running."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.series.requests["abort"].inc()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop body ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns one output per request that produced text or finished."""
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.series.preemptions.inc(len(sched.preempted))
        if not sched.scheduled:
            return []
        try:
            sampled = self.runner.execute(sched, self.eos_token_ids)
        except Exception:
            logger.exception("model step failed; aborting the %d requests in it", len(sched.scheduled))
            return [self._finish(item.seq, "error") for item in sched.scheduled]
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        outputs = [self._append_token(seq, token, logprobs, now) for seq, token, logprobs in sampled]
        if outputs:
            self.series.generation_tokens.inc(len(outputs))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> RequestOutput:
        m = self.series
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
            m.ttft.observe(now - seq.arrival_time)
            if seq.num_cached_tokens:
                m.prefix_cache_hits.inc(seq.num_cached_tokens)
        else:
            m.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        seq.output_token_ids.append(token)
        p = seq.params
        reason = None
        if token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        else:
            matched = seq.detokenizer.add_token(token)
            if matched is not None:
                reason, seq.stop_reason = "stop", matched
            elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is None:
            out = RequestOutput(seq.request_id, seq.detokenizer.take_delta(False), [token], False, None, None,
                                seq.num_prompt_tokens, len(seq.output_token_ids), seq.num_cached_tokens)
        else:
            if not isinstance(seq.stop_reason, str):
                seq.detokenizer.flush_undecoded()
            out = self._finish(seq, reason, [token])
        if logprobs is not None:
            out.delta_logprobs = [logprobs]
        if first and seq.params.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _finish(self, seq: Sequence, reason: str, delta_ids: list[int] | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.series.requests[reason].inc()
        now = time.monotonic()
        self.series.e2e.observe(now - seq.arrival_time)
        return RequestOutput(seq.request_id, seq.detokenizer.take_delta(True), delta_ids or [], True, reason,
                             seq.stop_reason, seq.num_prompt_tokens, len(seq.output_token_ids),
                             seq.num_cached_tokens,
                             times=(seq.arrival_time, seq.scheduled_time, seq.first_token_time, now))

    def _register_gauges(self) -> None:
        """The state gauges (running, waiting, KV blocks) read the engine when /metrics is scraped, so they are
        current during a seconds-long step too, through a weak reference (an unloaded engine is not kept alive
        by its gauges; they read 0 then)."""
        ref = weakref.ref(self)

        def gauge(metric, read) -> None:
            metric.labels(self.model_name).set_function(lambda: 0 if (e := ref()) is None else read(e))

        m = self.metrics
        gauge(m.running, lambda e: len(e.scheduler.running))
        gauge(m.waiting, lambda e: len(e.scheduler.waiting))
        gauge(m.kv_blocks_used, lambda e: e.block_manager.num_used_blocks)
        gauge(m.kv_blocks_total, lambda e: e.block_manager.num_blocks)
        gauge(m.kv_usage, lambda e: e.block_manager.num_used_blocks / e.block_manager.num_blocks)


class _LockedTokenizer:
    """The engine's tokenizer behind its lock (the Rust tokenizer is shared with request threads)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._engine.tokenizer_lock:
            return self._engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _tokens(n: int) -> str:
    """``n`` tokens in words: "1 token", "7 tokens"."""
    return f"{n} token" if n == 1 else f"{n} tokens"
