"""The gateway in front of every route (OpenAI, KServe v2 over HTTP and gRPC, repository control,
metrics): authentication, quotas and rate limits, load shedding and deadlines, circuit breakers, the
audit log, TLS, tracing and the input guard, configured from one YAML file (docs/gateway.md)."""
