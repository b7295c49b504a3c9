"""Shared CLI plumbing: target arguments, logging set-up, one-line errors for bad input."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from decode.errors import UserError
from decode.runtime.heap import retain_freed_memory


def add_target_args(parser: argparse.ArgumentParser, default: str = "smolvlm-135m") -> None:
    from decode.targets.presets import preset_names

    parser.add_argument("--target", default=default,
                        help=f"preset name ({', '.join(preset_names())}) or a local HF model directory (default: {default})")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--dtype", default="auto", help="float32|bfloat16|float16|auto (auto: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where embedded targets are prepared (default: $XDG_CACHE_HOME/vlm-draft-nas)")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("decode.targets.embedded").setLevel(logging.INFO)  # first-run preparation shows its progress
    import transformers

    if not verbose:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()  # per-tensor "Loading weights" bars


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run main(argv); bad input ends with one line on stderr and exit code 2. Large freed CPU buffers stay in
    the heap for the process's lifetime (decode.runtime.heap: no page faults per training step or data forward)."""
    retain_freed_memory()
    try:
        code = main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
