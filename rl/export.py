"""The policy of a checkpoint as a Hugging Face folder (what rl/run/export.py writes, and how).

    python -m rl.export CHECKPOINT OUT [--dtype auto|float32|bfloat16|float16] [--overwrite] [--adapter]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl.config import ConfigError
from rl.run.export import export_checkpoint


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder: <output_dir>/checkpoints/rollout_<N>")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it holds an earlier export")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint's adapter alone, as PEFT loads it (default: the merged model)")
    args = parser.parse_args(argv)
    try:
        written = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype, args.overwrite, args.adapter)
    except ConfigError as e:
        raise SystemExit(f"rl.export: {e}") from None
    print(f"rl.export: wrote {written}")


if __name__ == "__main__":
    main(sys.argv[1:])
