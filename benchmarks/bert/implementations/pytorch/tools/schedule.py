#!/usr/bin/env python3
"""The learning rate at every step that a config_*.sh gives: see the schedule before a
cluster runs it.

    python tools/schedule.py CONFIG_SH [--steps N] [--json] [--plot FILE] [--set VAR=VALUE ...]

The config file is read as every launcher reads it (``bert.config_script.load``): sourced
by bash, then what you set over it, your environment and ``--set`` (``--set PRECISION=fp16``);
the variables become training overrides through the trainer's own table
(``bert.config.LAUNCHER_VARIABLES``, CONFIG_PARAMS, EXTRA_PARAMS), resolved and validated by
``bert.config``. The rates come from the trainer's own scheduler (``bert.optim.build_scheduler``)
stepped once per optimizer step, so what is printed is what a run applies: step k (0-based)
is the rate of the update that follows k updates.

Output: ``step rate`` per line; ``--json``: one object ``{"lr": [rate at step 0, 1, ...]}``;
``--plot FILE``: a PNG of rate against step. ``--steps`` defaults to the run's step limit
(``run.max_steps``, else ``optim.total_steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

import torch  # noqa: E402

from bert import config_script  # noqa: E402
from bert.config import Config, ConfigError  # noqa: E402
from bert.optim import build_scheduler  # noqa: E402


def rates(cfg: Config, steps: int) -> list[float]:
    """The rate of each of the first ``steps`` updates, read from the trainer's scheduler."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.optim.lr)
    sched = build_scheduler(opt, cfg.optim)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()  # no gradient: nothing moves; keeps torch's step-order check quiet
        sched.step()
    return out


def plot(lr: list[float], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(len(lr)), lr, lw=1.5)
    ax.set_xlabel("optimizer step (0-based)")
    ax.set_ylabel("learning rate")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path, help="a config_*.sh file")
    ap.add_argument("--steps", type=int, help="steps to print (default: the run's step limit)")
    ap.add_argument("--json", action="store_true", help='print {"lr": [...]} instead of "step rate" lines')
    ap.add_argument("--plot", type=Path, help="write a PNG of the rate against the step")
    ap.add_argument("--set", action="append", default=[], metavar="VAR=VALUE",
                    help="a variable over your environment's, as the config reads it (e.g. PRECISION=fp16)")
    args = ap.parse_args(argv)
    try:
        extra = dict(item.split("=", 1) for item in args.set)
    except ValueError:
        ap.error("--set takes VAR=VALUE")
    try:
        cfg, _, _ = config_script.load(args.config, {**os.environ, **extra})
    except ConfigError as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    steps = args.steps if args.steps is not None else (cfg.run.max_steps or cfg.optim.total_steps)
    if steps < 0:
        ap.error("--steps must be >= 0")
    lr = rates(cfg, steps)
    if args.json:
        print(json.dumps({"lr": lr}))
    else:
        for k, rate in enumerate(lr):
            print(f"{k} {rate!r}")
    if args.plot:
        o = cfg.optim
        plot(lr, f"{args.config.name}: {o.schedule} schedule, warmup {o.warmup_steps} from {o.start_warmup_step}",
             args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
