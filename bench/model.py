"""Model speed: Strata's runner against transformers on the same Hugging Face checkpoint and device.

    .venv/bin/python -m bench.model [--quick] [--prompt 2048] [--decode 64] [--device cpu|cuda] [--dtype ...]
                                    [--threads N]

A random Llama checkpoint the size of the ``small`` preset (dim 512, 12 layers, 8 query / 2 KV heads,
FFN 1408; ``--quick``: dim 128, 2 layers) is saved with ``save_pretrained`` to a temporary directory
and loaded by both. In the same run, best of ``--rounds`` (each round runs the engines in another order,
as the load of a shared machine drifts):

- **prefill**: tokens/s of one ``--prompt``-token prompt from nothing cached: Strata's ``CompletionRunner``
  until its ``Prefilled`` event (admission, paged forward), transformers' forward with a fresh
  ``DynamicCache``;
- **decode**: tokens/s (1 / the median time between tokens) of ``--decode`` greedy tokens after that
  prompt: Strata's stream of token events, transformers' one-token forwards over its ``DynamicCache``.

Strata is measured three ways: the **runner** (``CompletionRunner``: admission, chunked prefill in
``STRATA_PREFILL_CHUNK``-sized turns as the worker runs it, sampling, bookkeeping, its scheduler) and the
**model** alone (``LlamaModel.forward`` over KV pages through a block table, the prompt in one
forward, then one-token forwards), so a gap shows whether it lies in the decoder or around it. A third
Strata row runs the runner with the whole prompt in one chunk and one step (the step's token budget,
512 as deployed, raised to the prompt), as the model alone takes it: the
worker's chunks (``DEFAULT_PREFILL_CHUNK``, 256) let decodes run between them, and each chunk reads
every weight again, so the two rows split the runner's prefill gap into what chunking costs and what
the runner adds around the forwards.

All four run on the worker's threads, as the worker deploys the engine: the runner's scheduler
gives a step of prompt chunks alone every core and a step with a decode every core but one
(``WorkerConfig.step_threads``, ``cachecore.scheduler.threads``); transformers and the model alone get
the same per phase (prefill on every core, decode on every core but one), so each phase compares
like with like. ``--threads N``: all four on N threads throughout. Each runs on a thread of its own
that ends with its run (``cachecore.passing_thread``; the runner's loop thread ends before the next
engine starts), as the worker loads on a passing thread and computes on its loop thread: one OpenMP
pool in the process at a time. A pool left on another thread made the runner's 2-thread prefill
steps wait on sleeping threads (2,050-2,079 tok/s against 2,556 without, same code otherwise).

Both decode the same greedy tokens (checked: ``tokens_match``), so the two did the same work. Goal on
CPU: Strata at least 1.0x transformers in both. transformers is a bench/test-only dependency.
"""

from __future__ import annotations

import argparse
import inspect
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cachecore.device import pick_device
from cachecore.engine import CacheEngine
from cachecore.layout import torch_dtype
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.pages import KVPages
from cachecore.passing_thread import on_passing_thread
from cachecore.runner import DEFAULT_PREFILL_CHUNK, CompletionRunner, Finished, Prefilled, SamplingParams, TokenOut
from cachecore.scheduler import Scheduler
from cachecore.scheduler.settings import SchedulerSettings
from cachecore.scheduler.threads import StepThreads

LOOP_EXIT_S = 0.05  # the runner's loop thread ends this long after its last request
SMALL = {"dim": 512, "layers": 12, "heads": 8, "kv_heads": 2, "ffn": 1408}
QUICK = {"dim": 128, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256}


@dataclass
class Figures:
    prefill_tps: float
    decode_tps: float
    tokens: list[int]


def _per_second(times: list[float]) -> float:
    """Tokens/s from the times tokens came out: 1 / the median interval (a busy neighbour's burst on a
    shared machine moves the mean, not the median)."""
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return 1.0 / gaps[len(gaps) // 2] if gaps else 0.0


def _prompt(vocab: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def strata_run(loaded, engine: CacheEngine, prompt: list[int], decode: int, threads: StepThreads | None,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Figures:
    """One cold prefill then ``decode`` greedy tokens through Strata's ``CompletionRunner`` (EOS ignored), its
    scheduler's steps on ``threads`` (None: the loop thread's default torch threads), the prompt in
    ``prefill_chunk``-token chunks (the scheduler's step token budget raised to hold one when it is larger)."""
    budget = max(SchedulerSettings().token_budget, prefill_chunk)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name=loaded.name, revision="r1",
                           scheduler=Scheduler(engine, threads=threads, idle_exit_s=LOOP_EXIT_S, token_budget=budget),
                           prefill_chunk=prefill_chunk)
    ns = loaded.namespace(secrets.token_bytes(32))  # a fresh namespace: nothing is cached
    params = SamplingParams(max_tokens=decode, temperature=0.0, stop_at_eos=False)
    t0 = time.perf_counter()
    prefill_s, times, tokens = 0.0, [], []
    for ev in gen.stream(ns, prompt, owner="bench", params=params):
        if isinstance(ev, Prefilled):
            prefill_s = time.perf_counter() - t0
        elif isinstance(ev, TokenOut):
            times.append(time.perf_counter())
            tokens.append(ev.token_id)
        elif isinstance(ev, Finished) and ev.finish_reason == "aborted":
            raise RuntimeError("the bench generation was aborted")
    engine.check_integrity()
    decode_tps = _per_second(times)
    time.sleep(4 * LOOP_EXIT_S)  # the loop thread ends, and its thread pool with it, before the next engine runs
    return Figures(len(prompt) / prefill_s, decode_tps, tokens)


def model_run(loaded, prompt: list[int], decode: int, threads: tuple[int, int]) -> Figures:
    """Strata's decoder alone: one paged forward over the prompt, then one-token paged forwards
    (``threads``: torch threads of the prefill and of the decode)."""
    layout, model = loaded.layout, loaded.model
    torch.set_num_threads(threads[0])
    blocks = -(-(len(prompt) + decode) // layout.block_size)
    pages = KVPages(layout, blocks, model.device)
    table = torch.randperm(blocks).to(model.device)  # scattered blocks, as a pool hands them out
    t0 = time.perf_counter()
    token = model.forward(torch.tensor(prompt, device=model.device), 0, table, pages)[-1].argmax()
    tokens, times = [int(token)], [time.perf_counter()]
    prefill_s = times[0] - t0
    torch.set_num_threads(threads[1])
    for i in range(decode - 1):
        token = model.forward(token.view(1), len(prompt) + i, table, pages)[-1].argmax()
        tokens.append(int(token))
        times.append(time.perf_counter())
    decode_tps = _per_second(times)
    return Figures(len(prompt) / prefill_s, decode_tps, tokens)


def hf_run(hf, prompt: list[int], decode: int, device: torch.device, threads: tuple[int, int]) -> Figures:
    """The same with transformers: a forward over the prompt, then one-token forwards over its cache."""
    from transformers import DynamicCache

    torch.set_num_threads(threads[0])
    ids = torch.tensor([prompt], device=device)
    # the cache argument is ``past_key_values`` up to transformers 5.19 (the one vLLM's CPU build
    # allows), ``cache`` in later releases; an unknown keyword is swallowed and the cache unused
    arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = DynamicCache(config=hf.config)
        out = hf(ids, **{arg: cache}, use_cache=True)
        token = out.logits[0, -1].argmax()
        if device.type == "cuda":
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        torch.set_num_threads(threads[1])
        tokens, times = [int(token)], [time.perf_counter()]
        for _ in range(decode - 1):
            out = hf(token.view(1, 1), **{arg: cache}, use_cache=True)
            token = out.logits[0, -1].argmax()
            tokens.append(int(token))  # a host sync per token, as a server streaming tokens has
            times.append(time.perf_counter())
    decode_tps = _per_second(times)
    return Figures(len(prompt) / prefill_s, decode_tps, tokens)


def run(*, quick: bool, prompt_len: int, decode: int, rounds: int, device: str | None, dtype: str | None,
        workdir: Path, threads: tuple[int, int] = (1, 1), step_threads: StepThreads | None = None) -> dict:
    """Build the checkpoint under ``workdir``, measure both, return the figures (best of ``rounds``).
    ``threads``: transformers' and the model's threads prefilling and decoding, each engine's run on a
    thread of its own (``on_passing_thread``); ``step_threads``: the runner's scheduler's."""
    from tests.hf_checkpoints import build_checkpoint  # the same random checkpoints the parity tests prove

    dev = pick_device(device)
    sizes = QUICK if quick else SMALL
    hf, _ = build_checkpoint("llama", workdir, seed=1, max_pos=max(4096, prompt_len + decode), **sizes)
    loaded = load_model("bench-model", "", RevisionSpec(label="r1", checkpoint_path=str(workdir)), device=dev,
                        dtype=dtype)
    hf = hf.to(device=dev, dtype=torch_dtype(loaded.config.dtype)).eval()
    blocks = -(-(prompt_len + decode) // loaded.block_size) + 8
    engine = CacheEngine(loaded.layout, num_blocks=blocks, device=dev)
    prompt = _prompt(loaded.config.vocab_size, prompt_len)
    best: dict[str, Figures] = {}
    matched = True
    runs = {"transformers": lambda: on_passing_thread(hf_run, hf, prompt, decode, dev, threads, threads=threads[0]),
            "strata": lambda: strata_run(loaded, engine, prompt, decode, step_threads),
            "one chunk": lambda: strata_run(loaded, engine, prompt, decode, step_threads, prefill_chunk=prompt_len),
            "model": lambda: on_passing_thread(model_run, loaded, prompt, decode, threads, threads=threads[0])}
    for i in range(rounds):
        # A shared machine's load drifts: each round runs the four in another order, best round kept.
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        figs = {name: runs[name]() for name in order}
        matched &= len({tuple(fig.tokens) for fig in figs.values()}) == 1
        for name, fig in figs.items():
            old = best.get(name)
            best[name] = Figures(max(fig.prefill_tps, old.prefill_tps if old else 0.0),
                                 max(fig.decode_tps, old.decode_tps if old else 0.0), fig.tokens)
    return {"device": str(dev), "dtype": loaded.config.dtype, "sizes": sizes, "prompt": prompt_len,
            "decode": decode, "threads": threads, "tokens_match": matched,
            "transformers": best["transformers"], "strata": best["strata"], "model": best["model"],
            "one chunk": best["one chunk"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="prefill and decode tokens/s: Strata's runner vs transformers")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model, 256-token prompt (under a minute)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 2048; 256 with --quick)")
    ap.add_argument("--decode", type=int, default=None, help="greedy tokens decoded (default 64; 16 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="best of this many rounds (default 5; 2 with --quick)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when present)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of all four runs throughout (default 0: the worker's, per step or phase)")
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error("--threads must be >= 0")
    from workers.config import WorkerConfig

    # This thread only sets up, on one thread; each engine runs on a thread of its own (as the worker loads
    # on a passing thread and computes on its loop thread: one OpenMP pool at a time, passing_thread.py).
    torch.set_num_threads(1)
    cfg = WorkerConfig(torch_threads=args.threads)  # 0: the worker's defaults
    step_threads = cfg.step_threads(str(pick_device(args.device)))
    threads = (step_threads.burst, step_threads.steady)
    prompt = args.prompt or (256 if args.quick else 2048)
    decode = args.decode or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="strata-bench-model-") as tmp:
        r = run(quick=args.quick, prompt_len=prompt, decode=decode, rounds=rounds, device=args.device,
                dtype=args.dtype, workdir=Path(tmp), threads=threads, step_threads=step_threads)
    hf, st, md, oc = r["transformers"], r["strata"], r["model"], r["one chunk"]
    s = r["sizes"]
    print(f"model speed: random Llama checkpoint dim {s['dim']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} "
          f"heads, FFN {s['ffn']}; {r['device']} {r['dtype']}, {r['threads'][0]} threads prefilling and "
          f"{r['threads'][1]} decoding; prompt {r['prompt']} tokens, "
          f"decode {r['decode']} tokens, best of {rounds}")
    print(f"{'engine':<33} {'prefill tok/s':>14} {'decode tok/s':>13}")
    print(f"{'transformers':<33} {hf.prefill_tps:>14.1f} {hf.decode_tps:>13.1f}")
    print(f"{'strata runner':<33} {st.prefill_tps:>14.1f} {st.decode_tps:>13.1f}")
    print(f"{'strata model':<33} {md.prefill_tps:>14.1f} {md.decode_tps:>13.1f}")
    print(f"{'  runner, the prompt in one chunk':<33} {oc.prefill_tps:>14.1f} {oc.decode_tps:>13.1f}")
    prefill_x, decode_x = st.prefill_tps / hf.prefill_tps, st.decode_tps / hf.decode_tps
    model_px, model_dx = md.prefill_tps / hf.prefill_tps, md.decode_tps / hf.decode_tps
    print(f"{'runner / hf':<33} {prefill_x:>13.2f}x {decode_x:>12.2f}x   (goal >= 1.0x both)")
    print(f"{'model / hf':<33} {model_px:>13.2f}x {model_dx:>12.2f}x")
    print(f"runner / model alone: prefill {st.prefill_tps / md.prefill_tps:.2f}x "
          f"in {DEFAULT_PREFILL_CHUNK}-token chunks "
          f"(as the worker prefills, so decodes run between the chunks), {oc.prefill_tps / md.prefill_tps:.2f}x in one "
          f"chunk (as the model alone); decode {st.decode_tps / md.decode_tps:.2f}x")
    print(f"greedy tokens identical: {r['tokens_match']}")
    print(f"RESULT prefill_x={prefill_x:.2f} decode_x={decode_x:.2f} model_prefill_x={model_px:.2f} "
          f"model_decode_x={model_dx:.2f} strata_prefill_tps={st.prefill_tps:.1f} "
          f"hf_prefill_tps={hf.prefill_tps:.1f} strata_decode_tps={st.decode_tps:.1f} "
          f"hf_decode_tps={hf.decode_tps:.1f} tokens_match={int(r['tokens_match'])} device={r['device']} "
          f"dtype={r['dtype']} runner_vs_model_prefill={st.prefill_tps / md.prefill_tps:.2f} "
          f"one_chunk_vs_model_prefill={oc.prefill_tps / md.prefill_tps:.2f} "
          f"runner_vs_model_decode={st.decode_tps / md.decode_tps:.2f} prefill_chunk={DEFAULT_PREFILL_CHUNK}")


if __name__ == "__main__":
    main()
