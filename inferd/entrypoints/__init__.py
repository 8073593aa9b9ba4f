"""User-facing entry points: the offline ``LLM`` class."""
