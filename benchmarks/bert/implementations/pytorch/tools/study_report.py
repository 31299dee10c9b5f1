"""tools/study.py's statistics, tables and plots, from the runs it collected (plain dicts:
this module runs nothing and knows no plan file).

``collected`` (what tools/study.py passes):

    {"study": name, "margin": 0.10, "balance": {...}, "target": 0.75,
     "ablation": [{"recipe", "about", "settings", "seeds": {seed: {"result": dict | None, "config": Path}}}],
     "scaling": {optimizer: [{"batch", "grid": {factor: result | None}, "factor": winner | None,
                              "local_batch", "results": [results of the winner's seeds, first seed first]}]}}

where a result is tools/study.py's ``read_run`` of one run and ``config`` the resolved config
bert.train wrote beside its log.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

import balance  # tools/balance.py (tools/study.py puts tools/ on the path)
from bert import loader
from bert.lengths import length_distribution
from bert.config import build_config
from bert.trainer import train_plan

BOOTSTRAP = 10000  # resamples of a ratio of means
FIT_BOOTSTRAP = 2000  # resamples of a critical-batch fit (each a least-squares solve)


# -- statistics ----------------------------------------------------------------------------

def summary(values: list[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"n": len(v), "mean": float(v.mean()) if len(v) else None,
            "std": float(v.std(ddof=1)) if len(v) > 1 else None, "each": [float(x) for x in v]}


def bootstrap_ratio(a: list[float], b: list[float], paired: bool, seed: int = 0) -> list[float] | None:
    """95% percentile interval of mean(a) / mean(b) over resampled seeds; ``paired``: a[i]
    and b[i] share seed i and are resampled together. None with fewer than 2 of either."""
    a_, b_ = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a_) < 2 or len(b_) < 2:
        return None
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a_), size=(BOOTSTRAP, len(a_)))
    ib = ia if paired else rng.integers(0, len(b_), size=(BOOTSTRAP, len(b_)))
    lo, hi = np.percentile(a_[ia].mean(1) / b_[ib].mean(1), [2.5, 97.5])
    return [float(lo), float(hi)]


def non_inferior(ci: list[float] | None, margin: float) -> str:
    """The verdict on "does not slow convergence" from a ratio's interval: supported when
    the whole interval stays below 1 + margin (a non-inferiority margin)."""
    if ci is None:
        return "not decidable (fewer than 2 runs reached the target)"
    if ci[1] <= 1 + margin:
        return f"supported (any slowdown is below {margin:.0%})"
    if ci[0] > 1:
        return "not supported (significantly slower)"
    return f"not decidable at this scale (the interval reaches past +{margin:.0%})"


def critical_batch(batches: list[int], steps: list[float]) -> dict:
    """S(B) = S_min (1 + B_crit / B) (McCandlish et al. 2018): weighted least squares of S on
    1/B, weights 1/S (relative residuals). B_crit = inf when the fit finds no S_min > 0: the
    steps still fall as 1/B (or faster) at the largest batch."""
    x, y = 1.0 / np.asarray(batches, np.float64), np.asarray(steps, np.float64)
    w = 1.0 / y
    (s_min, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1) * w[:, None], y * w, rcond=None)
    return {"s_min": float(s_min), "b_crit": float(slope / s_min) if s_min > 0 else math.inf}


def _fit_resamples(points: list[dict], seed: int) -> np.ndarray:
    """B_crit refitted on the points' seeds resampled (each point's own, with replacement)."""
    rng = np.random.default_rng(seed)
    batches = [p["batch"] for p in points]
    each = [np.asarray(p["steps"]["each"]) for p in points]
    return np.array([critical_batch(batches, [float(rng.choice(e, size=len(e)).mean()) for e in each])["b_crit"]
                     for _ in range(FIT_BOOTSTRAP)])


def _rank_interval(values: np.ndarray) -> list[float]:
    """2.5th and 97.5th percentiles by rank: an infinite B_crit is a value, not an error."""
    v = np.sort(values)
    return [float(v[int(0.025 * (len(v) - 1))]), float(v[int(math.ceil(0.975 * (len(v) - 1)))])]


def compare_critical(first: list[dict], second: list[dict]) -> dict:
    """Is the second optimizer's critical batch larger than the first's? The share of
    bootstrap resamples in which it is (and in which it is smaller)."""
    a, b = _fit_resamples(first, 1), _fit_resamples(second, 2)
    larger, smaller = float(np.mean(b > a)), float(np.mean(b < a))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = b / a
    finite = ratio[np.isfinite(ratio)]
    if larger >= 0.975:
        verdict = "supported"
    elif smaller >= 0.975:
        verdict = "not supported (the reverse holds)"
    elif np.all(np.isinf(a) & np.isinf(b)):
        verdict = "not decidable at this scale (neither stops scaling within the batches measured)"
    else:
        verdict = "not decidable at this scale"
    return {"p_larger": larger, "p_smaller": smaller,
            "ratio_median": float(np.median(finite)) if len(finite) else None, "verdict": verdict}


# -- load balance --------------------------------------------------------------------------

def real_tokens(batch: dict) -> int:
    """Real tokens of a collated batch: unpadded layouts count them in cu_seqlens (a token
    budget's padding lies past its end), the padded one in its attention mask."""
    if "cu_seqlens" in batch:
        return int(batch["cu_seqlens"][-1])
    return int(batch["attention_mask"].sum())


def token_imbalance(config: Path, steps: int) -> dict:
    """The busiest rank's real tokens / the mean, per optimizer step (micro-batches summed),
    over a run's first ``steps``: its own loaders (bert.loader.train_batches from its
    resolved ``config``, one per rank, as the trainer builds them) replayed in this process."""
    doc = json.loads(Path(config).read_text())
    cfg = build_config(config_file=str(config))
    world = int(doc["resolved"]["world_size"])
    loaders = [loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                    seed=cfg.run.seed, rank=r, world_size=world) for r in range(world)]
    ratios = []
    try:
        for _ in range(steps):
            tok = np.array([sum(real_tokens(next(ld)) for _ in range(cfg.run.grad_accum_steps)) for ld in loaders])
            ratios.append(tok.max() / tok.mean())
    finally:
        for ld in loaders:
            ld.close()
    s = cfg.sampler
    return {"mode": s.mode if s.deal == "none" else f"{s.mode}+{s.deal}", "steps": steps, "ranks": world,
            "local_batch": cfg.run.local_batch_size, "group": min(s.group_size or world, world),
            "strata_width": s.strata_width, "max_seq_length": cfg.data.max_seq_length,
            "hidden": cfg.model.hidden_size, "mean": float(np.mean(ratios)), "worst": float(np.max(ratios))}


def cached_imbalance(config: Path, steps: int) -> dict:
    """token_imbalance, kept beside the run (a report rerun does not replay it again)."""
    f = Path(config).with_name("imbalance.json")
    if f.exists():
        m = json.loads(f.read_text())
        if m["steps"] == steps:
            return m
    m = token_imbalance(config, steps)
    f.write_text(json.dumps(m, indent=1) + "\n")
    return m


def simulated(measured: dict, paper: dict) -> dict:
    """tools/balance.py for the same mode: at the run's own geometry (ranks, local batch,
    the demo's lengths: the Wikipedia histogram scaled to its sequence length) and at the
    paper's (``paper``: ranks, local batch, group; Wikipedia at 512)."""
    lengths, probs = length_distribution(measured["max_seq_length"])
    own = balance.simulate(measured["mode"], measured["ranks"], measured["local_batch"], measured["group"], 200, 0,
                           lengths, probs, max_len=measured["max_seq_length"], hidden=measured["hidden"],
                           strata_width=measured["strata_width"])
    wl, wc = balance.load_histogram(balance.DEFAULT_HISTOGRAM)
    big = balance.simulate(measured["mode"], int(paper["ranks"]), int(paper["local_batch"]), int(paper["group"]),
                           int(paper.get("steps", 50)), 0, wl, wc)
    return {"own_geometry": own["tokens_max_over_mean"], "paper_geometry": big["tokens_max_over_mean"]}


# -- the analysis --------------------------------------------------------------------------

def _reached(seeds: dict) -> dict[int, float]:
    return {s: r["result"]["samples"] for s, r in seeds.items() if r["result"] and r["result"]["status"] == "success"}


def ablation(rows: list[dict], margin: float, paper: dict) -> list[dict]:
    out = []
    base = _reached(rows[0]["seeds"]) if rows else {}
    for i, row in enumerate(rows):
        ok = _reached(row["seeds"])
        done = {s: r for s, r in row["seeds"].items() if r["result"]}
        r: dict[str, Any] = {"recipe": row["recipe"], "about": row["about"], "settings": row["settings"],
                             "runs": len(done), "samples_to_target": summary(list(ok.values())),
                             "seeds_reached": sorted(ok),
                             "missed": sorted(s for s, x in done.items() if x["result"]["status"] != "success"),
                             "curves": {s: x["result"]["curve"] for s, x in done.items()}}
        intervals = [x["result"]["eval_interval"] for x in done.values()]
        mean = r["samples_to_target"]["mean"]
        r["eval_interval"] = max(intervals, default=None)
        r["resolution"] = r["eval_interval"] / mean if mean and r["eval_interval"] else None
        if i > 0 and ok and base:
            r["ratio_to_baseline"] = mean / float(np.mean(list(base.values())))
            r["ratio_to_baseline_ci"] = bootstrap_ratio(list(ok.values()), list(base.values()), paired=False)
            r["verdict_vs_baseline"] = non_inferior(r["ratio_to_baseline_ci"], margin)
        if i > 0:
            prev = _reached(rows[i - 1]["seeds"])
            both = sorted(set(ok) & set(prev))
            if both:
                a, b = [ok[s] for s in both], [prev[s] for s in both]
                ci = bootstrap_ratio(a, b, paired=True)
                r["vs_previous"] = {"recipe": rows[i - 1]["recipe"], "seeds": both,
                                    "ratio": float(np.mean(a) / np.mean(b)), "ci": ci,
                                    "verdict": non_inferior(ci, margin)}
        if done:
            imb = [cached_imbalance(x["config"], x["result"]["steps"]) for x in done.values()]
            r["imbalance"] = {"measured_mean": float(np.mean([m["mean"] for m in imb])),
                              "measured_worst": float(np.max([m["worst"] for m in imb])),
                              "steps": int(sum(m["steps"] for m in imb)), "mode": imb[0]["mode"],
                              "simulated": simulated(imb[0], paper),
                              "buckets": next(iter(done.values()))["result"]["buckets"]}
        out.append(r)
    return out


def scaling(points: list[dict]) -> dict:
    rows = []
    for p in points:
        row: dict[str, Any] = {"batch": p["batch"], "grid": {
            str(f): (g and {"status": g["status"], "samples": g["samples"], "lr": g["lr"]}) for f, g in p["grid"].items()}}
        if p["factor"] is not None:
            got = [g for g in p["results"] if g]
            ok = [g for g in got if g["status"] == "success"]
            first = p["grid"][p["factor"]]
            row.update(factor=p["factor"], lr=first["lr"], beta1=first["beta1"], beta2=first["beta2"],
                       local_batch=p["local_batch"], accumulation=first["accumulation"],
                       eval_interval=first["eval_interval"], max_samples=first["max_samples"], runs=len(got),
                       missed=len(got) - len(ok), steps=summary([g["steps"] for g in ok]),
                       samples=summary([g["samples"] for g in ok]),
                       edge=len(p["grid"]) > 1 and p["factor"] in (min(p["grid"]), max(p["grid"])))
        rows.append(row)
    full = [r for r in rows if r.get("steps", {}).get("n")]
    for a, b in zip(full, full[1:]):
        # 1 = perfect scaling (the steps fall as fast as the batch grows), 0 = no gain.
        b["efficiency"] = (a["steps"]["mean"] / b["steps"]["mean"]) / (b["batch"] / a["batch"])
    fit = None
    if len(full) >= 2:
        fit = critical_batch([r["batch"] for r in full], [r["steps"]["mean"] for r in full])
        fit["ci"] = _rank_interval(_fit_resamples(full, 0))
    return {"points": rows, "fit": fit}


def analyse(collected: dict) -> dict:
    out = {k: collected[k] for k in ("study", "margin", "target")}
    out["ablation"] = ablation(collected["ablation"], collected["margin"], collected["balance"])
    out["scaling"] = {opt: scaling(points) for opt, points in collected["scaling"].items()}
    opts = list(out["scaling"])
    if len(opts) == 2 and all(out["scaling"][o]["fit"] for o in opts):
        first, second = ([r for r in out["scaling"][o]["points"] if r.get("steps", {}).get("n")] for o in opts)
        out["comparison"] = {"larger": opts[1], "than": opts[0], **compare_critical(first, second)}
    return out


# -- tables and plots ----------------------------------------------------------------------

def _fmt(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:,.{digits}f}"


def _ci(ci: Any) -> str:
    return "-" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def markdown(a: dict) -> str:
    lines = [f"### Ablation (study {a['study']}, target {a['target']})", "",
             "| recipe | adds | reached | samples to target: mean ± std | each seed | ratio to baseline [95% CI] "
             "| vs the step before, paired [95% CI] | token imbalance, measured (worst step) "
             "| simulated, same geometry | simulated, paper's geometry |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in a["ablation"]:
        s, vp = r["samples_to_target"], r.get("vs_previous")
        imb = r.get("imbalance", {})
        sim = imb.get("simulated", {})
        lines.append(
            f"| {r['recipe']} | {r['about']} | {s['n']} of {r['runs']}"
            + (f" (missed: seeds {r['missed']})" if r["missed"] else "")
            + f" | {_fmt(s['mean'])} ± {_fmt(s['std'])} | {', '.join(_fmt(v) for v in s['each'])} | "
            + (f"{r['ratio_to_baseline']:.3f} {_ci(r['ratio_to_baseline_ci'])}" if "ratio_to_baseline" in r else "1")
            + " | " + (f"{vp['ratio']:.3f} {_ci(vp['ci'])}: {vp['verdict']}" if vp else "-")
            + f" | {_fmt(imb.get('measured_mean'), 3)} ({_fmt(imb.get('measured_worst'), 3)})"
            + f" | {_fmt(sim.get('own_geometry'), 3)} | {_fmt(sim.get('paper_geometry'), 3)} |")
    for opt, s in a["scaling"].items():
        lines += ["", f"### Steps to target against global batch: {opt}", "",
                  "| global batch | local x accumulation | lr grid: factor -> samples (first seed) | lr (factor) "
                  "| beta1 / beta2 | reached | steps to target: mean (each) | samples to target | scaling efficiency |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in s["points"]:
            grid = ", ".join(f"x{f}: " + (_fmt(g["samples"]) if g and g["status"] == "success" else "miss" if g else "-")
                             for f, g in r["grid"].items())
            if "steps" not in r:
                lines.append(f"| {r['batch']} | - | {grid} | - | - | - | - | - | - |")
                continue
            st = r["steps"]
            lines.append(f"| {r['batch']} | {r['local_batch']} x {r['accumulation']} | {grid} | {r['lr']:.4g} "
                         f"(x{r['factor']}{', grid edge' if r['edge'] else ''}) | {r['beta1']:.4g} / {r['beta2']:.4g} | "
                         f"{st['n']} of {r['runs']} | {_fmt(st['mean'])} ({', '.join(_fmt(v) for v in st['each'])}) | "
                         f"{_fmt(r['samples']['mean'])} | {_fmt(r.get('efficiency'), 2)} |")
        if s["fit"]:
            f = s["fit"]
            lines += ["", f"Fit S(B) = S_min (1 + B_crit / B): S_min = {_fmt(f['s_min'], 1)} steps, B_crit = "
                      f"{_fmt(f['b_crit'], 1)} (95% CI {_fmt(f['ci'][0], 1)} to {_fmt(f['ci'][1], 1)}; inf: the "
                      "steps still fall as 1/B at the largest batch)."]
    c = a.get("comparison")
    if c:
        lines += ["", f"Critical batch of {c['larger']} larger than {c['than']}'s in {c['p_larger']:.1%} of the "
                  f"bootstrap resamples, smaller in {c['p_smaller']:.1%} (median ratio {_fmt(c['ratio_median'], 2)}): "
                  f"{c['verdict']}."]
    cost = a.get("cost")
    if cost:
        lines += ["", f"{cost['runs']} runs made here: {cost['cpu_s']:,} CPU seconds (on 2 idle cores about "
                  f"{cost['cpu_s'] / 120:.0f} minutes), {cost['wall_s'] / 60:,.0f} minutes of wall time."]
    return "\n".join(lines) + "\n"


def plots(a: dict, out: Path) -> list[Path]:
    """ablation.png (samples to target per recipe, eval curves) and scaling.png (steps and
    samples to target against the global batch, the fits and their critical batches)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = []
    rows = a["ablation"]
    fig, (ax, cx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(rows):
        s = r["samples_to_target"]
        ax.scatter([i] * s["n"], s["each"], color=f"C{i}", s=14, zorder=3)
        if s["mean"] is not None:
            ax.hlines(s["mean"], i - 0.3, i + 0.3, color="black")
        for j, curve in enumerate(r["curves"].values()):
            cx.plot([c[0] for c in curve], [c[1] for c in curve], color=f"C{i}", alpha=0.6, linewidth=0.8,
                    marker=".", markersize=3, label=r["recipe"] if j == 0 else None)
    ax.set_xticks(range(len(rows)), [r["recipe"] for r in rows], rotation=15)
    ax.set_ylabel("samples to target (dots: seeds; bar: mean)")
    ax.grid(alpha=0.3)
    if a["target"]:
        cx.axhline(a["target"], color="gray", linestyle=":", linewidth=1)
    cx.set_xlabel("training samples")
    cx.set_ylabel("eval masked-LM accuracy")
    cx.legend(fontsize=7)
    cx.grid(alpha=0.3)
    fig.suptitle(f"study {a['study']}: ablation, one technique at a time")
    paths.append(_save(fig, out / "ablation.png"))

    if not a["scaling"]:
        return paths
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (opt, s) in enumerate(a["scaling"].items()):
        full = [r for r in s["points"] if r.get("steps", {}).get("n")]
        if not full:
            continue
        bs = np.array([r["batch"] for r in full], np.float64)
        st = [r["steps"] for r in full]
        ax.errorbar(bs, [x["mean"] for x in st], yerr=[[x["mean"] - min(x["each"]) for x in st],
                                                       [max(x["each"]) - x["mean"] for x in st]],
                    marker="o", color=f"C{i}", capsize=3, label=f"{opt} (bars: range over seeds)")
        ax.plot(bs, st[0]["mean"] * bs[0] / bs, color=f"C{i}", linestyle=":", linewidth=1,
                label=f"{opt}: perfect scaling from B={int(bs[0])}")
        bx.plot(bs, [r["samples"]["mean"] for r in full], marker="o", color=f"C{i}", label=opt)
        f = s["fit"]
        if f and math.isfinite(f["b_crit"]) and f["b_crit"] > 0:
            fine = np.geomspace(bs[0], bs[-1], 50)
            ax.plot(fine, f["s_min"] * (1 + f["b_crit"] / fine), color=f"C{i}", linestyle="--", linewidth=1,
                    label=f"{opt}: fit, B_crit = {f['b_crit']:.0f}")
            for axis in (ax, bx):
                axis.axvline(f["b_crit"], color=f"C{i}", linestyle="-.", linewidth=0.8)
    for axis in (ax, bx):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("global batch")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    ax.set_ylabel("steps to target")
    bx.set_ylabel("samples to target")
    fig.suptitle(f"study {a['study']}: where perfect scaling ends (dash-dot: critical batch)")
    paths.append(_save(fig, out / "scaling.png"))
    return paths


def _save(fig, path: Path) -> Path:
    """The figure as a PNG of a size that can be committed (~50-100 KB at 90 dpi), closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
