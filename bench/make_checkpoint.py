"""Make a small random checkpoint to try Strata with: ``.venv/bin/python -m bench.make_checkpoint DIR``.

Writes a Hugging Face checkpoint directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
its chat template, ``generation_config.json``) of a 2-layer Llama-style model with random weights
(``bench._checkpoints``, the one the tests use): about 1 MiB, served by both engines (its head
size, 64, is one vLLM's CPU build accepts), made in well under a minute on a CPU. Its output is
noise; everything around it (tokenizer, chat template, caching, streaming) is real. Prints the
directory and how to serve it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._checkpoints import KINDS, VLLM_CPU_SHAPE, VLLM_ONLY_KINDS, build_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.make_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="directory to write (created; must be empty if it exists)")
    parser.add_argument("--kind", default="llama", choices=KINDS + VLLM_ONLY_KINDS,
                        help="architecture (default llama; the vLLM-only kinds need --engine vllm)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    path = args.path.expanduser().resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        parser.error(f"{path} exists and is not an empty directory")
    build_checkpoint(args.kind, path, seed=args.seed, layers=args.layers, max_pos=2048, **VLLM_CPU_SHAPE)
    print(f"checkpoint ({args.kind}, {args.layers} layers, random weights, seed {args.seed}) written to {path}")
    print(f"serve it:  STRATA_DEMO=1 STRATA_DEMO_MODEL={path} make run      (model demo-hf)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
