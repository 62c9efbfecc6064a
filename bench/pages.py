"""How close do page store/retrieve come to a plain memory copy?

    .venv/bin/python -m bench.pages [--quick] [--tokens 4096] [--reps N]

Moves the KV of a 4K-token prefix of the ``small`` layout (256 blocks of 16 tokens) between a
staging tensor and the page tensor, with the block ids shuffled over a page tensor four times larger
(as after churn):

- store: ``KVPages.write_blocks(ids, kv)`` (validation + scatter);
- retrieve: ``KVPages.read_blocks(ids, out=staging)`` (gather into a reused buffer, as tiers do);
- retrieve, fresh tensor: ``read_blocks(ids)`` (pays a new allocation and its page faults);
- store, unchecked: the bare ``index_copy_`` (shows the cost of validation);
- copy: ``dst.copy_(src)`` of the same number of bytes between preallocated tensors (the baseline).

GB/s counts the payload once (not read + write). Median of ``reps``; ratios are against the copy
measured in the same run. Runs on ``pick_device()`` (CUDA when present).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from cachecore.device import pick_device
from cachecore.model.config import preset
from cachecore.pages import KVPages


def _median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: caches, allocator, lazy kernel init
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="page store/retrieve bandwidth vs a plain copy")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    reps = args.reps or (15 if args.quick else 60)

    device = pick_device()
    layout = preset("small").kv_layout()
    n = -(-args.tokens // layout.block_size)
    pages = KVPages(layout, 4 * n, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(pages.num_blocks, generator=gen)[:n].to(device)
    src = torch.randn((n, *layout.page_shape), generator=gen).to(device=device, dtype=layout.torch_dtype)
    staging = torch.empty_like(src)
    dst = torch.empty_like(src)
    nbytes = n * layout.bytes_per_block

    pages.write_blocks(ids, src)
    assert torch.equal(pages.read_blocks(ids), src)  # the bench moves the right bytes

    cases: list[tuple[str, Callable[[], object]]] = [
        ("copy (baseline)", lambda: dst.copy_(src)),
        ("store", lambda: pages.write_blocks(ids, src)),
        ("retrieve", lambda: pages.read_blocks(ids, out=staging)),
        ("retrieve, fresh tensor", lambda: pages.read_blocks(ids)),
        ("store, unchecked", lambda: pages.kv.index_copy_(0, ids, src)),
    ]
    gbps = {name: nbytes / _median_seconds(fn, reps, device) / 1e9 for name, fn in cases}
    copy = gbps["copy (baseline)"]

    print(
        f"device={device} layout={layout.canonical()} tokens={n * layout.block_size} blocks={n} "
        f"block_bytes={layout.bytes_per_block} payload={nbytes / 2**20:.1f} MiB reps={reps} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'operation':<24}{'median ms':>11}{'GB/s':>9}{'vs copy':>9}")
    for name, rate in gbps.items():
        print(f"{name:<24}{nbytes / rate / 1e6:>11.3f}{rate:>9.2f}{rate / copy:>9.2f}")
    print(
        f"RESULT store_gbps={gbps['store']:.2f} retrieve_gbps={gbps['retrieve']:.2f} copy_gbps={copy:.2f} "
        f"store_ratio={gbps['store'] / copy:.2f} retrieve_ratio={gbps['retrieve'] / copy:.2f}"
    )


if __name__ == "__main__":
    main()
