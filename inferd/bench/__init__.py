"""Benchmarks: workloads, ``inferd bench serve`` (online, any OpenAI-compatible server) and ``inferd bench throughput`` (offline)."""
