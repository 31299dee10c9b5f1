"""The Triton attention kernels' block-size sweep on one GPU: forward and backward ms per
block configuration on a training micro-batch, and how far each configuration's numbers are
from the default's (only rounding may differ: the dropout mask depends on no block size).

``BLOCK_CONFIGS`` is the list the device run sweeps; ``bench/triton_sm90.py`` compiles every
entry for sm_90 on a CPU first, so a configuration that does not build is known before a
device window is spent on it.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

# (forward blocks, backward blocks), each (BLOCK_M, BLOCK_N, num_warps, num_stages); the
# first is the module's default (bert.triton_attention.FWD_BLOCKS / BWD_BLOCKS).
BLOCK_CONFIGS = [((64, 64, 4, 2), (64, 64, 4, 2)),
                 ((128, 64, 4, 3), (64, 128, 8, 2)),
                 ((128, 64, 8, 2), (128, 64, 8, 2))]


def cuda_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` calls after two untimed, CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def sweep(cu_seqlens: torch.Tensor, total: int, heads: int, dim: int, max_seqlen: int, device: torch.device,
          reps: int = 10, dropout_p: float = 0.1) -> dict:
    """Per ``BLOCK_CONFIGS`` entry the forward and backward ms on random bf16 q, k, v of
    ``total`` rows (``cu_seqlens`` on ``device``: a budget rung's real sequences), the max
    difference from the default entry's output and gradients, each entry in its own try
    (one that does not fit, e.g. in shared memory, says so and the sweep goes on); then
    every compiled kernel's registers and spills as the driver reported them."""
    from bert import triton_attention

    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(total, heads, dim, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    seed = torch.tensor([99], dtype=torch.int64, device=device)
    out: dict[str, Any] = {"status": "ok", "tokens": total, "real_tokens": int(cu_seqlens[-1]), "configs": []}
    ref = None
    for fwd_blocks, bwd_blocks in BLOCK_CONFIGS:
        row: dict[str, Any] = {"forward_blocks": fwd_blocks, "backward_blocks": bwd_blocks}
        try:
            def fwd():
                return triton_attention.forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, fwd_blocks)

            o, lse = fwd()

            def bwd():
                return triton_attention.backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, dropout_p, seed,
                                                 bwd_blocks)

            grads = bwd()
            row["forward_ms"], row["backward_ms"] = cuda_ms(fwd, reps), cuda_ms(bwd, reps)
            if ref is None:
                ref = (o, *grads)
            row["max_diff_from_default"] = max(float((a.float() - b.float()).abs().max())
                                               for a, b in zip((o, *grads), ref))
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a config that does not fit: say so, go on
            row["status"] = f"error: {type(e).__name__}: {e}"
        out["configs"].append(row)
    try:
        out["kernels"] = triton_attention.kernel_stats()
    except Exception as e:  # noqa: BLE001 - the timings stand without the driver's counts
        out["kernels_error"] = f"{type(e).__name__}: {e}"
    return out
