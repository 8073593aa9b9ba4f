"""A short property-based fuzz run of the OpenAPI schema against the real server (the long one is
`make fuzz`, recorded in docs/fuzzing.md)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_fuzz_run_finds_no_server_error():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz.py"), "--examples", "8",
                          "--phases", "fuzzing", "--workers", "2"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "5xx: 0" in run.stdout and "healthy afterwards: True" in run.stdout
    assert "KV blocks held afterwards: 0" in run.stdout
