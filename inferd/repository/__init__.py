"""The model repository: Triton's folder layout and config.pbtxt, version policies, checksums, and the
manager that loads, reloads and unloads model versions (model control modes none, poll, explicit)."""
