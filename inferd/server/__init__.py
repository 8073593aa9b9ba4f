"""Server layer: the OpenAI-compatible HTTP API."""
