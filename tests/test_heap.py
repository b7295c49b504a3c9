"""decode.runtime.heap: freed large CPU buffers are reused from the heap, not mapped afresh (counted in page faults)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# a training step's pattern: two 16384 x 576 fp32 buffers (37.7 MB, above glibc's largest dynamic mmap threshold of
# 32 MiB) filled and freed, 20 times; the minor page faults after the first round say whether their memory came
# back from the heap (a few: memalign's slack sometimes needs fresh pages) or from fresh mmaps (~18k per round)
PROBE = """
import resource, sys, torch
from decode.runtime.heap import retain_freed_memory
print(retain_freed_memory())
x = torch.zeros(16384, 576); y = torch.ones(16384, 576); del x, y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    x = torch.zeros(16384, 576); y = torch.ones(16384, 576); del x, y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(env_value: str | None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "VLM_DRAFT_NAS_HEAP"}
    if env_value is not None:
        env["VLM_DRAFT_NAS_HEAP"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap thresholds are glibc's")
def test_freed_large_buffers_are_reused_without_page_faults():
    took, faults = _probe(None)
    kept, default_faults = _probe("system")  # glibc's defaults: every buffer is unmapped and faulted in again
    assert took and not kept
    assert default_faults > 20 * 9000, default_faults
    assert faults < 0.25 * default_faults, f"{faults} page faults against {default_faults}: buffers mapped afresh"


def test_every_cli_retains_freed_memory(monkeypatch):
    from decode import cli

    calls = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append(1))
    with pytest.raises(SystemExit) as exit_:
        cli.run_cli(lambda argv: 0, [])
    assert exit_.value.code == 0 and calls == [1]
