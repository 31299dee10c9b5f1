"""Step time of gradient clipping + allreduce variants on 2 gloo ranks, BERT-base gradient.

    flock /tmp/bench.lock python bench/grad_sync.py --json [--link-gbps X] [--reps N] [--variants ...]

A benchmark, not a test: it prints numbers (and one JSON object with --json). One step =
forward + backward + the variant's clipping and gradient reduction (no optimizer: the same
for every variant). Each rank runs one intra-op thread. Variants:

  compute_only          forward, backward, local global-norm clip; no communication
  no_clip               DDP, buckets reduced during backward, no clipping          (i)
  clip_then_allreduce   backward, then global-norm clip, then allreduce each bucket
                        (nothing overlaps backward: what global clipping before the
                        allreduce forces)                                           (ii)
  bucketwise            DDP + bert.grad_sync bucket-wise clip hook                  (iii)
  clip_after_allreduce  DDP, then global-norm clip of the reduced gradient (closed)  (iv)
  bucketwise_bf16       (iii) with bf16 on the wire
  bucketwise_powersgd   (iii) with PowerSGD (rank --powersgd-rank) on the wire, compressing
                        from the first timed step; on gloo each compressed bucket finishes
                        inside its hook (bert/grad_sync.py), so it overlaps nothing

Each step is split at the moment its last gradient is accumulated (a post-accumulate hook
on every parameter, which runs before DDP's reducer sees the gradient): to_last_grad(v) is
forward + backward up to it, tail(v) = step end - last gradient is the communication,
clipping and copying still running after backward has computed everything: the exposed
communication, as a profiler's timeline shows it.

  exposed(v)          = tail(v) - tail(compute_only)         (compute_only's tail: its clip)
  hidden_fraction     = 1 - exposed(iii) / exposed(ii)       (for bucketwise)
  exposed_step(v)     = t(v) - t(compute_only)
  hidden_fraction_step = 1 - exposed_step(iii) / exposed_step(ii)

hidden_fraction is the share of what (ii) exposes that (iii) moves behind backward. The
tails hold little compute: their medians repeat within a few hundredths of a second from
run to run, while whole steps spread by a second or more here, which swamps the difference
at fast links. hidden_fraction_step also charges the cost of
overlapping itself: on this machine the "network" is the same two CPU cores, so gloo's
loopback traffic, DDP's bucket copies and the bucket clip slow backward down (to_last_grad
grows), which a NIC-driven transfer on a GPU cluster would not.

--link-gbps X simulates a network link: after each bucket's real (shared-memory) allreduce
the bucket also waits 2(n-1)/n * bytes * 8 / X ns on one serial "link" thread (a ring
allreduce's traffic per rank; one bucket on the wire at a time). The sleep costs no CPU, so
it shows overlap that 2 shared CPU cores cannot show with real traffic. PowerSGD's bytes
are its factors (r(n+m) per compressed n x m matrix) plus the tensors it sends as they are.

Times are medians over --rounds x --reps steps (each round builds every variant afresh and
times --reps steps after --warmup; DDP rebuilds its buckets after the first step), each
step taken as the slower of the two ranks. The machine is shared: rerun and compare
medians; never read one step.
"""

import argparse
import gc
import json
import os
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bert import distributed, grad_sync  # noqa: E402
from bert.config import GradSyncConfig, ModelConfig  # noqa: E402
from bert.model import BertForPreTraining, pretraining_loss  # noqa: E402

BERT_BASE = ModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                        hidden_dropout=0.0, attention_dropout=0.0, unpad=False, attention_backend="sdpa")
MAX_NORM = 1.0
VARIANTS = ("compute_only", "no_clip", "clip_then_allreduce", "bucketwise", "clip_after_allreduce", "bucketwise_bf16",
            "bucketwise_powersgd")
TINY = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, unpad=False,
                   attention_backend="sdpa")


class SimLink:
    """One serial link: each reduced bucket is released bytes*8/gbps after the previous one."""

    def __init__(self, gbps: float, world: int) -> None:
        self.seconds_per_byte = 2 * (world - 1) / world * 8 / (gbps * 1e9)
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            fut, out, nbytes = self.jobs.get()
            value = fut.wait()
            time.sleep(nbytes * self.seconds_per_byte)
            out.set_result(value)

    def __call__(self, fut: torch.futures.Future, nbytes: int) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        self.jobs.put((fut, out, nbytes))
        return out


def linked(comm, link, wire_bytes):
    """``comm`` followed by the simulated link's delay for ``wire_bytes(bucket)`` bytes."""
    if link is None:
        return comm
    return lambda bucket: link(comm(bucket), wire_bytes(bucket))


def powersgd_bytes(rank):
    """Bytes PowerSGD sends for a bucket: rank-r factors of each matrix it compresses (torch:
    when that at least halves it), everything else as fp32."""
    def wire_bytes(bucket):
        total = 0
        for p in bucket.parameters():
            n = p.shape[0]
            m = p.numel() // n
            compress = p.dim() > 1 and (n + m) * rank * 2 < n * m
            total += (n + m) * rank if compress else p.numel()
        return 4 * total
    return wire_bytes


def batch(args, rank):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, args.model.vocab_size, (args.batch, args.seq), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 1::7] = ids[:, 1::7]
    inputs = dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
    return inputs, labels, torch.randint(0, 2, (args.batch,), generator=g)


def flat_buckets(params, cap_bytes):
    """DDP-like buckets (reverse parameter order, ~cap bytes each) for the non-DDP variant."""
    out, cur, size = [], [], 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def run_variant(name, args, rank, link):
    torch.manual_seed(0)
    model = BertForPreTraining(args.model)
    params = list(model.parameters())
    compression = {"bucketwise_bf16": "bf16", "bucketwise_powersgd": "powersgd"}.get(name, "none")
    # PowerSGD compresses from the first timed step on (torch's hook needs >= 2 plain ones).
    cfg = GradSyncConfig(bucket_cap_mb=args.bucket_cap_mb, compression=compression,
                         powersgd_rank=args.powersgd_rank, powersgd_start_step=max(2, args.warmup))
    wire = {"none": lambda b: b.buffer().numel() * 4, "bf16": lambda b: b.buffer().numel() * 2,
            "powersgd": powersgd_bytes(args.powersgd_rank)}[compression]
    net, post, clip = model, (lambda: None), None
    if name in ("no_clip", "bucketwise", "clip_after_allreduce") or name.startswith("bucketwise_"):
        net = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        if name.startswith("bucketwise"):
            clip = grad_sync.BucketClip(MAX_NORM, "count")
        grad_sync.attach(net, linked(grad_sync.make_comm(cfg), link, wire), clip)
    if name == "clip_after_allreduce" or name == "compute_only":
        post = lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)  # noqa: E731
    if name == "clip_then_allreduce":
        buckets = flat_buckets(params, args.bucket_cap_mb * 2**20)

        def post():
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            flats, futs = [], []
            for ps in buckets:  # flatten (allocates, as DDP's bucket copy does), reduce async
                flat = torch.cat([p.grad.flatten() for p in ps]).div_(dist.get_world_size())
                fut = dist.all_reduce(flat, async_op=True).get_future()
                futs.append(link(fut, flat.numel() * 4) if link else fut)
                flats.append(flat)
            for ps, flat, fut in zip(buckets, flats, futs):
                fut.wait()
                for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                    p.grad.copy_(v.view_as(p))

    # When backward produced its last gradient: a post-accumulate hook on every parameter.
    # It runs inside the accumulation, before DDP's reducer hook, so the last bucket's clip and
    # launch count as time after it (in the tail), as they are communication work.
    last_grad = [0.0]
    handles = [p.register_post_accumulate_grad_hook(lambda _p: last_grad.__setitem__(0, time.perf_counter()))
               for p in params]
    inputs, labels, nsp = batch(args, rank)
    steps, tails = [], []
    for step in range(args.warmup + args.reps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        mlm, nsp_logits = net(**inputs)
        pretraining_loss(mlm, nsp_logits, labels, nsp).backward()
        post()
        t = torch.tensor([time.perf_counter() - t0, last_grad[0] - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slower rank; so is its last gradient
        if step >= args.warmup:
            steps.append(t[0].item())
            tails.append(t[0].item() - t[1].item())
    n_buckets = len(clip.layout) if clip is not None else None
    for h in handles:
        h.remove()
    del net, model, params
    gc.collect()
    return steps, tails, n_buckets


def worker(rank, port, args, out_path):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    link = SimLink(args.link_gbps, 2) if args.link_gbps > 0 else None
    result = {name: [] for name in args.variants} | {f"{name}/tail": [] for name in args.variants}
    for _ in range(args.rounds):  # variants interleaved: a slow drift of the machine hits all
        for name in args.variants:
            steps, tails, n_buckets = run_variant(name, args, rank, link)
            result[name] += steps
            result[f"{name}/tail"] += tails
            if n_buckets is not None:
                result["n_buckets"] = n_buckets
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()  # neither rank tears its sockets down while the other still works
    dist.destroy_process_group()
    distributed.exit_process(0)  # not a return: see exit_process (a torch 2.13 gloo race at exit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--link-gbps", type=float, default=0.0, help="simulated link speed (0 = none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="passes over all variants (reps each), interleaved")
    ap.add_argument("--batch", type=int, default=1, help="samples per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a tiny BERT instead of BERT-base (smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}; the first five are required")
    args = ap.parse_args()
    asked = set(args.variants.split(","))
    if asked - set(VARIANTS) or not set(VARIANTS[:5]) <= asked:
        ap.error(f"--variants: names from {VARIANTS}, including the first five")
    args.variants = tuple(v for v in VARIANTS if v in asked)  # in VARIANTS' order
    args.model = TINY if args.tiny else BERT_BASE
    if args.warmup < 2:
        ap.error("--warmup must be >= 2 (DDP rebuilds its buckets after the first step)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(port, args, out), nprocs=2, join=True)
        raw = json.loads(Path(out).read_text())
    names = args.variants
    med = {k: statistics.median(raw[k]) for k in names}
    tail = {k: statistics.median(raw[f"{k}/tail"]) for k in names}
    tc, tail_c = med["compute_only"], tail["compute_only"]
    exposed = {k: tail[k] - tail_c for k in names if k != "compute_only"}
    exposed_step = {k: med[k] - tc for k in names if k != "compute_only"}
    grad_numel = sum(p.numel() for p in BertForPreTraining(args.model).parameters())

    def hidden(e):
        return (1 - e["bucketwise"] / e["clip_then_allreduce"]) if e["clip_then_allreduce"] > 0 else None

    report = {
        **med,  # step time per variant
        "hidden_fraction": hidden(exposed),
        "hidden_fraction_step": hidden(exposed_step),
        "bucketwise_vs_no_clip": med["bucketwise"] / med["no_clip"],
        "exposed": exposed,  # tail over compute_only's (its local clip)
        "exposed_step": exposed_step,  # step time over compute_only's
        "tail": tail,  # step end - last gradient
        "to_last_grad": {k: statistics.median(s - t for s, t in zip(raw[k], raw[f"{k}/tail"])) for k in names},
        "powersgd_rank": args.powersgd_rank,
        "link_gbps": args.link_gbps or None,
        "n_buckets": raw.get("n_buckets"),
        "grad_numel": grad_numel,
        "model": "tiny" if args.tiny else "bert-base", "reps": args.reps, "rounds": args.rounds,
        "batch": args.batch, "seq": args.seq, "bucket_cap_mb": args.bucket_cap_mb,
        "samples": {k: raw[k] for k in names}, "tail_samples": {k: raw[f"{k}/tail"] for k in names},
        "note": "seconds per step, median over rounds x reps, slower rank; shared 2-core CPU machine",
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'variant':22s} {'step':>8s} {'tail':>8s}")
        for k in names:
            print(f"{k:22s} {med[k]:8.4f} {tail[k]:8.4f} s")
        print(f"hidden_fraction        {report['hidden_fraction']}  (tails after the last gradient)")
        print(f"hidden_fraction_step   {report['hidden_fraction_step']}  (step times)")
        print(f"bucketwise / no_clip   {report['bucketwise_vs_no_clip']:.3f}")

if __name__ == "__main__":
    main()
