"""GLUE fine-tuning: a grid of tasks x learning rates x seeds, each run one fine-tuning of the
model on one task, and the table of the results with the GLUE average.

    python tools/glue.py plan  --grid GRID.yaml                  # the runs; the sbatch line
    python tools/glue.py run   --grid GRID.yaml [--index I]      # all runs here, or run I
    sbatch --array=0-179%16 tools/glue.sub                       # the same on SLURM (GRID=...)
    python tools/glue.py table --grid GRID.yaml                  # table.md, table.json
    python tools/glue.py compare --grid GRID.yaml --task T --margin M  # pretrained vs random init
    python tools/glue.py same-doc --text HELD_OUT_TEXT --output DIR [--pairs N]  # a task from your text

Every command takes ``key=value`` overrides of the grid file after it (YAML values:
``seeds=[1,2]``). The grid file (YAML; keys and defaults are ``Grid``'s below):

    name: bert_large_demo        # results go to <workdir>/<name>/<init>/<task>/lr<lr>_seed<seed>.json
    model: results/hf            # Hugging Face directory (`checkpoint --to hf`), a run's final
                                 # weights (.pt; then bert_config), or a TF checkpoint prefix
    bert_config: ""              # config.json / bert_config.json; default <model dir>/config.json
    vocab: ""                    # the WordPiece vocab; default <model dir>/vocab.txt
    glue_dir: data/glue          # GLUE's layout: <glue_dir>/<TASK>/train.tsv, dev.tsv ...
    hf_cache: ""                 # or a datasets cache (load_dataset("nyu-mll/glue", ...) once)
    tasks: [CoLA, SST-2, MRPC, QQP, STS-B, MNLI, QNLI, RTE, WNLI]
    inits: [pretrained]          # add `random`: the same architecture from random weights
    lrs: [2.0e-5, 3.0e-5, 4.0e-5, 5.0e-5]
    seeds: [1, 2, 3, 4, 5]

Defaults are the anchors' recipe: BERT's (Devlin et al. 2019: batch 32, 3 epochs, the best
of learning rates 2e-5..5e-5 on dev; AdamW, 10% linear warmup then linear decay, weight decay
0.01, dropout 0.1, sequence length 128, gradients clipped at norm 1 as Hugging Face's
run_glue) with several seeds per learning rate, and the median over seeds reported
(MosaicBERT, Cramming, ELECTRA), since small tasks (RTE, MRPC, STS-B, CoLA) swing by points
from seed to seed.

The table (``table``): per task and learning rate, each seed's score (the mean of the task's
metrics, tools/glue_metrics.py) and its median over seeds; the task's learning rate is the one
with the best median; reported are that learning rate's per-metric medians and median score.
The GLUE average is the mean of the task scores over GLUE's nine tasks (and without WNLI, as
BERT's paper reports it); a task with missing runs is marked and the average with it.

``same-doc`` makes the task ``SAME-DOC`` (glue_data.same_doc_task) from text pretraining never
saw, in the format ``create`` reads (a file or a directory of them): does the second sentence
follow the first in the same document? It needs no download: a downstream measure for a
model pretrained on your own text (``tasks: [SAME-DOC]``, ``glue_dir: DIR``, ``inits:
[pretrained, random]``, then ``compare``).

A run writes its result file at its end, atomically, and is skipped when the file exists: a
requeued or repeated array task redoes only what is missing. SIGTERM/SIGUSR1 (a SLURM
requeue or cancel; tools/tune.py's Stop) end a run at its next step without a result (exit
3); the rerun starts it again from the beginning (a run is minutes, not worth a checkpoint).
Bad input (a missing task folder, a malformed row, a label outside the task's set, a grid
key that does not exist) exits 2 with a message that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import glue_data  # noqa: E402  (tools/ holds scripts, not a package; this file's folder is on the path)
import glue_metrics  # noqa: E402
from glue_data import GlueDataError, Task  # noqa: E402
from tune import Stop  # noqa: E402

PKG = Path(__file__).resolve().parent.parent
STOPPED = 3  # exit status of a run ended by a signal (as the trainer's and tools/tune.py's)


class GridError(ValueError):
    """The grid file or an override is wrong; names the key."""


class Stopped(Exception):
    """A signal arrived during a run."""


@dataclass
class Grid:
    name: str = "glue"
    model: str = ""
    bert_config: str = ""
    vocab: str = ""
    glue_dir: str = ""
    hf_cache: str = ""
    tasks: list[str] = field(default_factory=lambda: list(glue_data.GLUE_TASKS))
    inits: list[str] = field(default_factory=lambda: ["pretrained"])
    lrs: list[float] = field(default_factory=lambda: [2e-5, 3e-5, 4e-5, 5e-5])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    epochs: float = 3.0
    batch_size: int = 32
    max_seq_length: int = 128
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # 0 = no clipping
    dropout: float = 0.1  # hidden and attention dropout while fine-tuning
    eval_batch_size: int = 128
    max_train_examples: int = 0  # 0 = every training example; else the first N (smoke runs)
    device: str = "auto"  # auto = cuda when there is one, else cpu
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    threads: int = 0  # torch CPU threads; 0 = torch's default


def _coerce(key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if value is None and kind is str:  # `key=` on the command line: empty
        return ""
    try:
        if isinstance(default, list):
            if not isinstance(value, list):
                raise TypeError("a list")
            item = type(default[0]) if default else str
            return [float(v) if item is float else int(v) if item is int else str(v) for v in value]
        if kind is float:
            return float(value)
        if kind is int and not isinstance(value, bool):
            return int(value)
        return str(value)
    except (TypeError, ValueError) as e:
        raise GridError(f"{key}: {value!r} is not {e if isinstance(e, TypeError) else kind.__name__}") from None


def load_grid(path: str | Path | None, overrides: list[str] = ()) -> Grid:
    tree: dict[str, Any] = {}
    if path:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise GridError(f"{path}: cannot read the grid: {e}") from None
        if not isinstance(tree, dict):
            raise GridError(f"{path}: a grid is a mapping of keys to values")
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise GridError(f"override {item!r}: expected key=value")
        tree[key] = yaml.safe_load(value)
    defaults = Grid()
    known = {f.name for f in dataclasses.fields(Grid)}
    unknown = sorted(set(tree) - known)
    if unknown:
        raise GridError(f"unknown key(s) {unknown}; known: {sorted(known)}")
    g = Grid(**{k: _coerce(k, v, getattr(defaults, k)) for k, v in tree.items()})
    if path:
        base = Path(path).resolve().parent  # paths in a grid file are relative to it
        for k in ("model", "bert_config", "vocab", "glue_dir", "hf_cache"):
            v = getattr(g, k)
            if v and k not in {item.partition("=")[0] for item in overrides} and not Path(v).is_absolute():
                setattr(g, k, str(base / v))
    _validate(g)
    return g


def _validate(g: Grid) -> None:
    if not g.model:
        raise GridError("model: the model to fine-tune is required (an HF directory, a .pt, a TF prefix)")
    if not (g.glue_dir or g.hf_cache):
        raise GridError("glue_dir or hf_cache: where the tasks' data is")
    for name in g.tasks:
        glue_data.task(name)
    bad = sorted(set(g.inits) - {"pretrained", "random"})
    if bad or not g.inits:
        raise GridError(f"inits: {bad or g.inits} (pretrained | random)")
    if not (g.lrs and g.seeds and g.tasks):
        raise GridError("tasks, lrs and seeds must each name at least one")
    if g.precision not in ("fp32", "bf16"):
        raise GridError(f"precision: {g.precision!r} (fp32 | bf16)")
    if g.epochs <= 0 or g.batch_size < 1 or not 0 <= g.warmup_fraction < 1 or g.max_seq_length < 8:
        raise GridError("epochs > 0, batch_size >= 1, 0 <= warmup_fraction < 1, max_seq_length >= 8")


@dataclass(frozen=True)
class Run:
    task: str
    init: str
    lr: float
    seed: int

    def path(self, root: Path) -> Path:
        return root / self.init / self.task / f"lr{self.lr:g}_seed{self.seed}.json"


def runs(g: Grid) -> list[Run]:
    """Every run of the grid in array order: task, then init, then learning rate, then seed."""
    return [Run(t, i, lr, s) for t, i, lr, s in itertools.product(g.tasks, g.inits, g.lrs, g.seeds)]


def results_dir(g: Grid, workdir: Path) -> Path:
    return workdir / g.name


# ---------------------------------------------------------------- one run


def _model_files(g: Grid) -> tuple[Path, Path]:
    model = Path(g.model)
    where = model if model.is_dir() else model.parent
    config = Path(g.bert_config) if g.bert_config else where / "config.json"
    vocab = Path(g.vocab) if g.vocab else where / "vocab.txt"
    for what, p in (("bert_config", config), ("vocab", vocab)):
        if not p.is_file():
            raise GridError(f"{what}: {p} does not exist (name it in the grid)")
    return config, vocab


def model_config(g: Grid, bert_config: Path):
    from bert.weights import config_from_bert_json
    from bert.config import ModelConfig

    # The padded path through SDPA on every device (fine-tuning batches are padded [B, S]);
    # no vocab padding (no vocab-sized GEMM runs here).
    base = ModelConfig(hidden_dropout=g.dropout, attention_dropout=g.dropout, attention_backend="sdpa",
                       unpad=False, vocab_pad_multiple=1)
    cfg = config_from_bert_json(bert_config, base)
    if g.max_seq_length > cfg.max_position_embeddings:
        raise GridError(f"max_seq_length: {g.max_seq_length} > the model's {cfg.max_position_embeddings} positions")
    return cfg


def _batches(ids, types, order, batch_size):
    import torch

    for i in range(0, len(order), batch_size):
        rows = order[i:i + batch_size]
        width = max(len(ids[r]) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        tt = torch.zeros_like(x)
        mask = torch.zeros_like(x)
        for j, r in enumerate(rows):
            n = len(ids[r])
            x[j, :n] = torch.tensor(ids[r])
            tt[j, :n] = torch.tensor(types[r])
            mask[j, :n] = 1
        yield rows, x, tt, mask


def _predict(model, ids, types, batch_size, device, autocast) -> list:
    import torch

    model.eval()
    order = sorted(range(len(ids)), key=lambda r: len(ids[r]))  # similar lengths: less padding
    out: list = [None] * len(ids)
    with torch.no_grad():
        for rows, x, tt, mask in _batches(ids, types, order, batch_size):
            with autocast():
                logits = model(x.to(device), tt.to(device), mask.to(device)).float()
            pred = logits[:, 0] if logits.shape[1] == 1 else logits.argmax(dim=1)
            for r, p in zip(rows, pred.tolist()):
                out[r] = p
    return out


def finetune(g: Grid, run: Run, stop: Stop | None = None) -> dict[str, Any]:
    """Fine-tune ``run.init`` weights on ``run.task`` at ``run.lr`` with ``run.seed``; the
    dev-set metrics and what the run was."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from bert.weights import load_weights
    from bert.classify import BertForSequenceClassification
    from bert.optim import param_groups

    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    t: Task = glue_data.task(run.task)
    config_path, vocab_path = _model_files(g)
    cfg = model_config(g, config_path)
    data = glue_data.load_task(t, g.glue_dir, g.hf_cache)
    enc = glue_data.Encoder(vocab_path, g.max_seq_length)
    if enc.vocab.size != cfg.vocab_size:
        raise GridError(f"vocab: {vocab_path} has {enc.vocab.size} pieces, the model {cfg.vocab_size}")
    train = data.train[:g.max_train_examples] if g.max_train_examples else data.train
    ids, types = enc.encode(train)
    labels = torch.tensor([e.label for e in train], dtype=torch.float32 if t.regression else torch.long)
    devs = {s: (enc.encode(ex), [e.label for e in ex]) for s, ex in data.dev.items()}

    if g.threads:
        torch.set_num_threads(g.threads)
    device = torch.device("cuda" if g.device == "auto" and torch.cuda.is_available() else
                          "cpu" if g.device == "auto" else g.device)
    torch.manual_seed(run.seed)
    model = BertForSequenceClassification(cfg, t.num_labels, device.type)
    if run.init == "pretrained":
        model.load_encoder(load_weights(g.model, cfg))
    model.to(device)

    def autocast():
        if g.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    steps_per_epoch = math.ceil(len(train) / g.batch_size)
    total = max(1, round(g.epochs * steps_per_epoch))
    warmup = round(g.warmup_fraction * total)
    opt = torch.optim.AdamW(param_groups(model, g.weight_decay), lr=run.lr, betas=(0.9, 0.999), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))
    gen = torch.Generator().manual_seed(run.seed)
    step, losses = 0, []
    model.train()
    while step < total:
        order = torch.randperm(len(train), generator=gen).tolist()
        for rows, x, tt, mask in _batches(ids, types, order, g.batch_size):
            if step >= total:
                break
            if stop is not None and stop.signum:
                raise Stopped(f"signal {stop.signum} at step {step} of {total}")
            with autocast():
                logits = model(x.to(device), tt.to(device), mask.to(device)).float()
            y = labels[rows].to(device)
            loss = F.mse_loss(logits[:, 0], y) if t.regression else F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if g.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), g.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            if step % max(1, steps_per_epoch // 4) == 0 or step == total:
                losses.append([step, round(loss.item(), 5)])  # sync point, a few times an epoch

    metrics: dict[str, float] = {}
    for d in t.dev:
        (dev_ids, dev_types), gold = devs[d.suffix]
        pred = _predict(model, dev_ids, dev_types, g.eval_batch_size, device, autocast)
        for m in t.metrics:
            metrics[m + d.suffix] = glue_metrics.METRICS[m](pred, gold)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"task": run.task, "init": run.init, "lr": run.lr, "seed": run.seed, "metrics": metrics,
            "score": glue_metrics.score(metrics), "train_examples": len(train),
            "dev_examples": {d.suffix or "dev": len(data.dev[d.suffix]) for d in t.dev}, "steps": total,
            "epochs": g.epochs, "batch_size": g.batch_size, "loss_curve": losses, "device": device.type,
            "seconds": round(time.monotonic() - t0, 2),
            "cpu_seconds": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2),
            "model": g.model, "data": data.source}


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # the pid: two writers never share one
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def run_grid(g: Grid, workdir: Path, index: int | None = None, stop: Stop | None = None) -> int:
    """Run one run of the grid (``index``) or all of them; runs with a result are skipped."""
    todo = runs(g)
    if index is not None:
        if not 0 <= index < len(todo):
            raise GridError(f"--index {index}: the grid has runs 0..{len(todo) - 1}")
        todo = [todo[index]]
    root = results_dir(g, workdir)
    for r in todo:
        out = r.path(root)
        if out.exists():
            print(f"glue: {r.task} {r.init} lr {r.lr:g} seed {r.seed}: done ({out})", flush=True)
            continue
        res = finetune(g, r, stop)
        _write_json(out, res)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in res["metrics"].items())
        print(f"glue: {r.task} {r.init} lr {r.lr:g} seed {r.seed}: {shown} "
              f"({res['steps']} steps, {res['seconds']:.0f} s)", flush=True)
    return 0


# ---------------------------------------------------------------- the table


def summarize(g: Grid, workdir: Path) -> dict[str, Any]:
    """The table's content: per init, per task, the best learning rate by median score over
    seeds, its per-metric medians, and the GLUE averages."""
    root = results_dir(g, workdir)
    out: dict[str, Any] = {"grid": dataclasses.asdict(g), "inits": {}}
    for init in g.inits:
        tasks: dict[str, Any] = {}
        for name in g.tasks:
            per_lr = {}
            for lr in g.lrs:
                found = [json.loads(p.read_text()) for s in g.seeds
                         if (p := Run(name, init, lr, s).path(root)).exists()]
                if found:
                    per_lr[f"{lr:g}"] = {
                        "seeds": len(found), "median_score": statistics.median(r["score"] for r in found),
                        "metrics": {m: statistics.median(r["metrics"][m] for r in found) for m in found[0]["metrics"]},
                        "per_seed": {str(r["seed"]): r["score"] for r in found}}
            if not per_lr:
                tasks[name] = {"complete": False, "runs": 0}
                continue
            best = max(per_lr, key=lambda lr: (per_lr[lr]["median_score"], -float(lr)))
            runs_found = sum(v["seeds"] for v in per_lr.values())
            tasks[name] = {"best_lr": float(best), "score": per_lr[best]["median_score"],
                           "metrics": per_lr[best]["metrics"], "seeds": per_lr[best]["seeds"],
                           "runs": runs_found, "complete": runs_found == len(g.lrs) * len(g.seeds),
                           "per_lr": per_lr}
        glue_scored = [n for n in glue_data.GLUE_TASKS if "score" in tasks.get(n, {})]
        averages = {}
        for label, names in (("glue_average", glue_data.GLUE_TASKS),
                             ("glue_average_without_wnli", [n for n in glue_data.GLUE_TASKS if n != "WNLI"])):
            have = [n for n in names if n in glue_scored]
            if have:
                averages[label] = {"value": statistics.fmean(tasks[n]["score"] for n in have), "tasks": have,
                                   "complete": len(have) == len(names) and all(tasks[n]["complete"] for n in have)}
        out["inits"][init] = {"tasks": tasks, **averages}
    return out


_METRIC_NAMES = {"accuracy": "acc", "f1": "F1", "matthews": "Matthews", "pearson": "Pearson",
                 "spearman": "Spearman"}


def _metric_label(m: str) -> str:
    base, _, suffix = m.partition("_")
    return _METRIC_NAMES.get(base, base) + (f" ({suffix})" if suffix else "")


def markdown(summary: dict[str, Any]) -> str:
    g = summary["grid"]
    lines = [f"GLUE dev results of `{g['model']}` ({g['name']}): per task, the learning rate with the best median "
             f"score over seeds {g['seeds']} (of {g['lrs']}); scores x100, the median over the seeds.", ""]
    for init, block in summary["inits"].items():
        lines += [f"**{init}**", "", "| task | metrics | best lr | seeds | score |", "|---|---|---|---|---|"]
        for name, r in block["tasks"].items():
            if "score" not in r:
                lines.append(f"| {name} | (no results) | | 0/{len(g['seeds'])} | |")
                continue
            shown = " / ".join(f"{_metric_label(m)} {100 * v:.1f}" for m, v in r["metrics"].items())
            mark = "" if r["complete"] else f" (incomplete: {r['runs']} of {len(g['lrs']) * len(g['seeds'])} runs)"
            lines.append(f"| {name} | {shown} | {r['best_lr']:g} | {r['seeds']}/{len(g['seeds'])} | "
                         f"{100 * r['score']:.1f}{mark} |")
        for key, label in (("glue_average", "GLUE average"), ("glue_average_without_wnli", "GLUE average without WNLI")):
            if key in block:
                a = block[key]
                note = "" if a["complete"] else f" (incomplete: {len(a['tasks'])} task(s) with results)"
                lines.append(f"| **{label}** | | | | **{100 * a['value']:.1f}**{note} |")
        lines.append("")
    return "\n".join(lines)


def write_table(g: Grid, workdir: Path, out: Path | None = None) -> tuple[Path, Path]:
    summary = summarize(g, workdir)
    out = out or results_dir(g, workdir)
    md, js = out / "table.md", out / "table.json"
    _write_json(js, summary)
    tmp = md.with_name(f"{md.name}.{os.getpid()}.tmp")
    tmp.write_text(markdown(summary))
    tmp.replace(md)
    return md, js


def compare(g: Grid, workdir: Path, task_name: str, margin: float) -> dict[str, Any]:
    """Pretrained against its randomly initialised twin on one task: each at its own best
    learning rate (the table's rule), the per-seed scores. It wins when its worst seed beats
    the twin's best seed by ``margin`` or more."""
    inits = summarize(g, workdir)["inits"]
    sides = {}
    for init in ("pretrained", "random"):
        r = inits.get(init, {}).get("tasks", {}).get(task_name, {})
        if "score" not in r:
            raise GridError(f"compare: no {init} results for {task_name} (inits must hold pretrained and random)")
        best = r["per_lr"][f"{r['best_lr']:g}"]
        sides[init] = {"best_lr": r["best_lr"], "median": r["score"], "per_seed": best["per_seed"],
                       "metrics": r["metrics"], "complete": r["complete"]}
    a, b = sides["pretrained"], sides["random"]
    worst_vs_best = min(a["per_seed"].values()) - max(b["per_seed"].values())
    return {"task": task_name, "margin_required": margin, "median_difference": a["median"] - b["median"],
            "worst_minus_best": worst_vs_best, "wins": worst_vs_best >= margin, **sides}


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/glue.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("plan", "list the grid's runs and the sbatch line of its array"),
                           ("run", "fine-tune: every run of the grid not yet done, or one (--index)"),
                           ("table", "the results as table.md and table.json"),
                           ("compare", "pretrained against random init on one task: exit 1 unless it wins")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--grid", default="", help="the grid file (YAML)")
        p.add_argument("--workdir", type=Path, default=PKG / "results" / "glue",
                       help="where results go (<workdir>/<name>/...): a shared filesystem for an array")
        p.add_argument("overrides", nargs="*", help="key=value over the grid file")
        if name == "plan":
            p.add_argument("--count", action="store_true", help="print only the number of runs")
        if name == "run":
            p.add_argument("--index", type=int, default=None, help="only this run (a SLURM array task's id)")
        if name == "compare":
            p.add_argument("--task", required=True)
            p.add_argument("--margin", type=float, required=True, help="by how much the median score must win")
            p.add_argument("--out", type=Path, default=None, help="also write the comparison here (JSON)")
    p = sub.add_parser("same-doc", help="make the downstream task SAME-DOC from your own held-out text")
    p.add_argument("--text", required=True, help="a text file, or a directory of them, one sentence a line, "
                   "a blank line between documents: text pretraining never saw")
    p.add_argument("--output", type=Path, required=True, help="the glue_dir to write SAME-DOC/{train,dev}.tsv into")
    p.add_argument("--pairs", type=int, default=1, help="positive pairs per training document (and as many negative)")
    a = ap.parse_args(argv)
    stop = Stop()
    if a.command == "same-doc":
        try:
            print(json.dumps(glue_data.same_doc_task(a.text, a.output, a.pairs)))
        except GlueDataError as e:
            print(f"glue: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        g = load_grid(a.grid or None, a.overrides)
        workdir = a.workdir.resolve()
        if a.command == "plan" and a.count:
            print(len(runs(g)))
            return 0
        if a.command == "plan":
            for i, r in enumerate(runs(g)):
                print(f"{i:4d}  {r.task:<16} {r.init:<10} lr {r.lr:<8g} seed {r.seed}")
            print(f"{len(runs(g))} runs: GRID={a.grid} sbatch --array=0-{len(runs(g)) - 1} tools/glue.sub")
            return 0
        if a.command == "run":
            stop.install()
            return run_grid(g, workdir, a.index, stop)
        if a.command == "compare":
            c = compare(g, workdir, a.task, a.margin)
            if a.out:
                _write_json(a.out, c)
            for init in ("pretrained", "random"):
                seeds = ", ".join(f"{v:.3f}" for v in c[init]["per_seed"].values())
                print(f"{a.task} {init:<10}: lr {c[init]['best_lr']:g}, median {c[init]['median']:.3f} "
                      f"(seeds: {seeds})")
            print(f"pretrained - random: median {c['median_difference']:+.3f}; worst pretrained seed - best random "
                  f"seed {c['worst_minus_best']:+.3f} (required: >= {a.margin:+.3f}): "
                  f"{'wins' if c['wins'] else 'does NOT win'}")
            return 0 if c["wins"] else 1
        md, js = write_table(g, workdir)
        print(md.read_text())
        print(f"wrote {md} and {js}")
        return 0
    except (GridError, GlueDataError) as e:
        print(f"glue: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"glue: stopped ({e}); no result written, a rerun starts this run again", file=sys.stderr)
        return STOPPED
    except Exception as e:
        from bert.weights import CheckpointError  # the weights' own error type: torch is loaded by now

        if isinstance(e, CheckpointError):
            print(f"glue: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
