"""Train-step throughput, ours vs Hugging Face ``BertForPreTraining``, on the CPU.

    python bench/vs_hf.py [--reps 3] [--steps 2] [--batches 8] [--json] [--out FILE] [--setup smoke]
                          [--activation gelu_tanh|gelu_erf]

Both sides train the same model (hidden 256, 4 layers, 4 heads, intermediate 1024, vocab
30522, dropout 0.1, float32) on the same batches of 16 samples whose real lengths are drawn
from the MLPerf Wikipedia length histogram (up to 512 tokens, 15% masked, at most 76):

- hf: ``transformers.BertForPreTraining`` as its users run it: padded [16, 512] batches,
  ``labels`` / ``next_sentence_label`` (MLM logits over every position), default
  ``torch.optim.AdamW``, ``clip_grad_norm_(1.0)``, ``zero_grad()``.
- ours: ``bert.trainer.train_step`` (the loop's own step) on the unpadded model
  (``model.unpad=True``) with AdamW from ``bert.optim`` (the same update rule) and the same
  clipping. HF's initial weights are loaded into ours.

Batches are collated before timing for both (data loading is not measured). The two sides
alternate, A/B then B/A, for ``--reps`` repetitions of ``--steps`` steps after one warm-up
step each; the tokens/s of a side is the median over repetitions of useful (non-padding)
tokens / seconds, and ``ratio`` is the median of the per-repetition ratios.

Also reported: the FLOP ratio of padded to useful work for these batches (``flop_limit_ratio``,
the speed-up unpadding can approach), useful model FLOP/s of each side against the float32
GEMM peak measured in the same run (``mfu``: ours), and each side's peak RSS, each measured
in a fresh subprocess that builds its side and trains ``--mem-steps`` steps
(``*_peak_rss_mb``: VmHWM; ``*_step_rss_mb``: the peak over the RSS just before training).

Numbers from a shared machine move with its load; ``machine.loadavg`` is recorded at the
start and end. Run under ``flock /tmp/bench.lock`` there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from bert import flops  # noqa: E402
from bert import grad_sync  # noqa: E402
from bert.config import GradSyncConfig, ModelConfig, OptimConfig, PrecisionConfig  # noqa: E402
from bert.model import BertForPreTraining  # noqa: E402
from bert.optim import build_optimizer, build_scheduler  # noqa: E402
from bert.precision import build_precision, build_scaler  # noqa: E402
from bert.state import Learner  # noqa: E402
from bert.trainer import train_step  # noqa: E402

LR, WD, CLIP = 1e-4, 0.01, 1.0


@dataclasses.dataclass(frozen=True)
class Setup:
    model: ModelConfig
    batch: int
    seq: int
    max_pred: int


SETUPS = {
    "default": Setup(ModelConfig(vocab_size=30522, hidden_size=256, num_layers=4, num_heads=4,
                                 intermediate_size=1024, max_position_embeddings=512, unpad=True),
                     16, 512, 76),
    # Every code path of the default on a model small enough for a test; measures nothing.
    "smoke": Setup(ModelConfig(vocab_size=1000, hidden_size=32, num_layers=1, num_heads=2,
                               intermediate_size=64, max_position_embeddings=64, unpad=True),
                   4, 64, 10),
}


class Ours:
    """Our training step, through the loop's own ``train_step``."""

    name = "ours"

    def __init__(self, setup: Setup, batches: list[dict], state: dict | None):
        self.model = BertForPreTraining(setup.model, "cpu")
        if state is not None:
            self.model.load_state_dict(state, strict=True)
        self.model.train()
        ocfg = OptimConfig(name="adamw", lr=LR, weight_decay=WD, max_grad_norm=CLIP,
                           warmup_steps=0, total_steps=10**9)
        opt, self.impl = build_optimizer(self.model, ocfg, "cpu")
        self.batches = batches
        self.k = 0
        pcfg = PrecisionConfig(dtype="fp32")  # same dtype as the HF side
        prec = build_precision(pcfg, "cpu")
        self.learner = Learner(model=self.model, train_model=self.model, optimizer=opt,
                               scheduler=build_scheduler(opt, ocfg), scaler=build_scaler(pcfg, prec, "cpu"),
                               precision=prec,
                               grad_sync=grad_sync.build(GradSyncConfig(), None, self.model.parameters(), CLIP),
                               device=torch.device("cpu"))
        self.feed = self._feed()

    def _feed(self):
        while True:
            yield self.batches[self.k % len(self.batches)]

    def step(self) -> None:
        train_step(self.learner, self.feed, 1)
        self.k += 1


class HF:
    """``transformers.BertForPreTraining`` trained the way its documentation shows."""

    name = "hf"

    def __init__(self, setup: Setup, batches: list[dict]):
        import transformers

        torch.manual_seed(0)
        self.model = transformers.BertForPreTraining(common.hf_config(setup.model))
        self.model.train()
        self.impl = f"transformers {transformers.__version__}, attn {self.model.config._attn_implementation}"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD)
        self.batches = batches
        self.k = 0

    def step(self) -> None:
        b = self.batches[self.k % len(self.batches)]
        out = self.model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                         attention_mask=b["attention_mask"], labels=b["mlm_labels"],
                         next_sentence_label=b["nsp_labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad()
        self.k += 1


def data(setup: Setup, num_batches: int, seed: int):
    batches = common.make_batches(num_batches, setup.batch, setup.seq, setup.max_pred,
                                  setup.model.vocab_size, seed)
    unpadded, padded = common.collate_both(batches, setup.seq)
    return batches, unpadded, padded


def timed(side, steps: int, tokens_of) -> tuple[float, float]:
    """(seconds, useful tokens) of ``steps`` steps; CPU ops are synchronous."""
    first = side.k
    t = time.perf_counter()
    for _ in range(steps):
        side.step()
    return time.perf_counter() - t, sum(tokens_of(k) for k in range(first, first + steps))


def setup_of(args) -> Setup:
    """``--setup`` with ``--activation`` (if given) on both sides."""
    setup = SETUPS[args.setup]
    if not args.activation:
        return setup
    return dataclasses.replace(setup, model=dataclasses.replace(setup.model, activation=args.activation))


def memory_child(setup: Setup, which: str, num_batches: int, seed: int, steps: int) -> None:
    """Build one side in this fresh process, train ``steps`` steps, print its RSS as JSON."""
    before_build = common.proc_status_mb("VmRSS")
    _, unpadded, padded = data(setup, num_batches, seed)
    side = Ours(setup, unpadded, None) if which == "ours" else HF(setup, padded)
    before = common.proc_status_mb("VmRSS")
    for _ in range(steps):
        side.step()
    peak = common.proc_status_mb("VmHWM")
    print(json.dumps({"peak_rss_mb": peak, "step_rss_mb": peak - before,
                      "model_rss_mb": before - before_build}))


def measure_memory(which: str, args) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", which, "--batches", str(args.batches),
           "--seed", str(args.seed), "--mem-steps", str(args.mem_steps), "--setup", args.setup]
    cmd += ["--activation", args.activation] if args.activation else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args) -> dict:
    load_start = os.getloadavg()
    setup = setup_of(args)
    batches, unpadded, padded = data(setup, args.batches, args.seed)
    stats = [common.batch_stats(b) for b in batches]
    shape = common.shape_of(setup.model)
    useful = [flops.useful_forward_flops(shape, lens, m) for lens, m in stats]
    padded_f = flops.padded_forward_flops(shape, setup.batch, setup.seq)
    # What our CPU path executes: attention padded to each batch's longest sequence.
    executed = [flops.forward_flops(shape, lens, m, [max(lens)] * len(lens)) for lens, m in stats]
    tokens = [sum(lens) for lens, _ in stats]

    def tokens_of(k):
        return tokens[k % len(tokens)]

    def flops_of(k):
        return useful[k % len(useful)]

    sizes = (1024, 2048) if args.setup == "default" else (256,)
    peak0 = common.gemm_peak(torch.float32, torch.device("cpu"), sizes)
    hf = HF(setup, padded)
    state = {k: v.detach().clone() for k, v in hf.model.state_dict().items()}
    ours = Ours(setup, unpadded, state)
    for side in (hf, ours):  # warm-up: first-touch allocations, optimizer state
        side.step()
    per = {"ours": [], "hf": []}
    ratios, fl = [], {"ours": [], "hf": []}
    for rep in range(args.reps):
        order = (ours, hf) if rep % 2 == 0 else (hf, ours)
        got = {}
        for side in order:
            k0 = side.k
            secs, tok = timed(side, args.steps, tokens_of)
            got[side.name] = tok / secs
            fl[side.name].append(3 * sum(flops_of(k) for k in range(k0, side.k)) / secs)
            per[side.name].append(tok / secs)
        ratios.append(got["ours"] / got["hf"])
    peak1 = common.gemm_peak(torch.float32, torch.device("cpu"), sizes)
    peak = max(peak0, peak1, key=lambda p: p["flops_per_s"])

    mem = {w: measure_memory(w, args) for w in ("ours", "hf")}
    ours_fps, hf_fps = statistics.median(fl["ours"]), statistics.median(fl["hf"])
    return {
        "ours_tokens_per_s": statistics.median(per["ours"]),
        "hf_tokens_per_s": statistics.median(per["hf"]),
        "ratio": statistics.median(ratios),
        "flop_limit_ratio": padded_f * len(useful) / sum(useful),
        "ratio_of_flop_limit": statistics.median(ratios) / (padded_f * len(useful) / sum(useful)),
        "executed_flop_ratio": padded_f * len(executed) / sum(executed),
        "mfu": ours_fps / peak["flops_per_s"],
        "hf_mfu": hf_fps / peak["flops_per_s"],
        "ours_useful_flops_per_s": ours_fps,
        "hf_useful_flops_per_s": hf_fps,
        "gemm_peak_flops_per_s": peak["flops_per_s"],
        "gemm_peak_n": peak["n"],
        "gemm_peak_start_end": [peak0["flops_per_s"], peak1["flops_per_s"]],
        "ours_peak_rss_mb": mem["ours"]["peak_rss_mb"],
        "hf_peak_rss_mb": mem["hf"]["peak_rss_mb"],
        "ours_step_rss_mb": mem["ours"]["step_rss_mb"],
        "hf_step_rss_mb": mem["hf"]["step_rss_mb"],
        "per_rep": {"ours_tokens_per_s": per["ours"], "hf_tokens_per_s": per["hf"], "ratio": ratios},
        "useful_tokens_per_batch": statistics.mean(tokens),
        "padded_tokens_per_batch": setup.batch * setup.seq,
        "masked_per_batch": statistics.mean(m for _, m in stats),
        "impl": {"ours": ours.impl, "hf": hf.impl},
        "dtype": "float32",
        "setup": args.setup, "model": dataclasses.asdict(setup.model),
        "batch": setup.batch, "seq_len": setup.seq, "reps": args.reps, "steps": args.steps,
        "batches": args.batches, "seed": args.seed,
        "machine": {**common.machine(), "loadavg_start": load_start},
    }


def table(r: dict) -> str:
    rows = [
        ("useful tokens/s", f"{r['ours_tokens_per_s']:.0f}", f"{r['hf_tokens_per_s']:.0f}"),
        ("useful GFLOP/s", f"{r['ours_useful_flops_per_s'] / 1e9:.1f}", f"{r['hf_useful_flops_per_s'] / 1e9:.1f}"),
        ("MFU vs fp32 GEMM peak", f"{r['mfu']:.1%}", f"{r['hf_mfu']:.1%}"),
        ("peak RSS (MiB)", f"{r['ours_peak_rss_mb']:.0f}", f"{r['hf_peak_rss_mb']:.0f}"),
        ("step RSS over start (MiB)", f"{r['ours_step_rss_mb']:.0f}", f"{r['hf_step_rss_mb']:.0f}"),
    ]
    w = max(len(a) for a, _, _ in rows)
    out = [f"{'':{w}}  {'ours':>10}  {'hf':>10}"] + [f"{a:{w}}  {b:>10}  {c:>10}" for a, b, c in rows]
    out += [
        f"ratio ours/hf (median of {r['reps']} interleaved reps): {r['ratio']:.2f}x "
        f"(per rep: {', '.join(f'{x:.2f}' for x in r['per_rep']['ratio'])})",
        f"FLOP-limit ratio (padded / useful FLOPs): {r['flop_limit_ratio']:.2f}x; "
        f"ours reaches {r['ratio_of_flop_limit']:.0%} of it",
        f"GEMM peak fp32 (n={r['gemm_peak_n']}): {r['gemm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s; "
        f"threads {r['machine']['threads']}; load {r['machine']['loadavg_start'][0]:.2f} -> "
        f"{r['machine']['loadavg'][0]:.2f}",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median taken)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per side per repetition")
    ap.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-steps", type=int, default=2, help="steps of the peak-memory subprocesses")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--setup", choices=sorted(SETUPS), default="default",
                    help="'smoke': a tiny model through the same code, for tests")
    ap.add_argument("--activation", choices=("gelu_tanh", "gelu_erf"), default="",
                    help="model.activation of both sides (HF's by its own name); default: the setup's")
    ap.add_argument("--memory-child", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(setup_of(args), args.memory_child, args.batches, args.seed, args.mem_steps)
        return 0
    r = run(args)
    text = json.dumps(r, indent=None if args.json else 2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
