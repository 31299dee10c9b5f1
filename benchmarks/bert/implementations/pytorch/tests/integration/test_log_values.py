"""Every value of the MLPerf log a reviewer reads, checked against what the run did.

Two 2-rank runs through run_and_time.sh: the session's ``trained`` run (config_CPU_1x2.sh to
the target: a successful result) and one short run from its weights (module fixture) whose
settings make the arithmetic visible: gradient accumulation 2, an eval interval that is no
multiple of the global batch, a warmup that starts partway and ends inside the run, a target
it never reaches (so it evaluates at every interval and at the sample limit), a train-state
checkpoint and a progress line every step.

The oracles do not come from the code that logs: the launcher's variables (config_*.sh, as
a reviewer reads them), the step count the loop printed, the eval set counted with h5py,
the accuracy recomputed from the saved weights on the padded path, the MLCommons learning
rate schedule transcribed here, and the optimizer's own settings in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from bert.config import build_config
from bert.model import BertForPreTraining
from conftest import PKG, demo_run_env, mllog_events

MARGIN = 1e-4  # top-two logits closer than this may rank either way on another code path


# ---------------------------------------------------------------- oracles


def launcher(env: dict[str, str]) -> dict[str, int]:
    """Ranks and global batch as the config_*.sh variables state them."""
    ranks = int(env["DGXNNODES"]) * int(env["DGXNGPU"])
    return {"ranks": ranks, "gbs": ranks * int(env["BATCHSIZE"]) * int(env.get("GRADIENT_STEPS") or 1)}


def steps_run(stdout: str) -> int:
    """Optimizer steps, as the loop counted them (its last line), not from sample arithmetic."""
    (steps,) = re.findall(r"^run_stop \w+ after (\d+) steps", stdout, re.M)
    return int(steps)


def progress_lines(stdout: str) -> list[tuple[int, int, float]]:
    """(step, samples, lr) of every progress line."""
    return [(int(a), int(b), float(c)) for a, b, c in
            re.findall(r"^step +(\d+) \| samples +(\d+) \| loss +\S+ \| lr (\S+) \|", stdout, re.M)]


def mlcommons_lr(step: int, hp: dict) -> float:
    """The MLCommons reference schedule (linear warmup from start_warmup_step, then linear
    decay to the end rate at opt_learning_rate_training_steps, progress = step / total), from
    the logged hyperparameters: the rate of the update after ``step`` updates."""
    base, end = hp["opt_base_learning_rate"], hp["opt_learning_rate_end"]
    warmup, start = hp["opt_learning_rate_warmup_steps"], hp["start_warmup_step"]
    total = hp["opt_learning_rate_training_steps"]
    if warmup and step - start < warmup:
        return base * max(step - start, 0) / warmup
    return (base - end) * (1 - min(step, total) / total) + end


def eval_set_on_disk(eval_dir: Path, limit: int) -> list[tuple[np.ndarray, ...]]:
    """The first ``limit`` eval samples (shards in name order), read with h5py: (tokens,
    segments, masked positions, masked ids); prediction slots at position 0 are padding."""
    out = []
    for path in sorted(p for p in eval_dir.iterdir() if p.suffix in (".hdf5", ".h5", ".hdf")):
        with h5py.File(path, "r") as f:
            cols = {k: f[k][:] for k in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids")}
            mask = f["input_mask"][:] if "input_mask" in f else None
        for i in range(len(cols["input_ids"])):
            n = int(mask[i].astype(np.int64).sum()) if mask is not None else len(cols["input_ids"][i])
            pos, ids = np.asarray(cols["masked_lm_positions"][i], np.int64), np.asarray(cols["masked_lm_ids"][i], np.int64)
            out.append((np.asarray(cols["input_ids"][i][:n], np.int64), np.asarray(cols["segment_ids"][i][:n], np.int64),
                        pos[pos != 0], ids[pos != 0]))
            if len(out) == limit:
                return out
    return out


def correct_bounds(weights: Path, run_config: Path, samples: list) -> tuple[int, int, int]:
    """(fewest, most, labelled): masked-LM predictions of ``weights`` on ``samples`` that are
    right, on the padded path (the run used the unpadded one); a prediction whose two best
    logits lie within MARGIN counts as wrong for the fewest and right for the most."""
    cfg = dataclasses.replace(build_config(config_file=str(run_config)).model, unpad=False, pack=False,
                              compile_layers=False)
    model = BertForPreTraining(cfg)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    lo = hi = labelled = 0
    for a in range(0, len(samples), 100):
        chunk = samples[a:a + 100]
        seq = max(len(s[0]) for s in chunk)
        ids, types, mask = (torch.zeros(len(chunk), seq, dtype=torch.long) for _ in range(3))
        for b, (tok, seg, _, _) in enumerate(chunk):
            ids[b, :len(tok)], types[b, :len(tok)], mask[b, :len(tok)] = torch.from_numpy(tok), torch.from_numpy(seg), 1
        with torch.no_grad():
            logits, _ = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
        for b, (_, _, pos, want) in enumerate(chunk):
            top = logits[b, torch.from_numpy(pos)].topk(2, dim=-1)
            right = top.indices[:, 0] == torch.from_numpy(want)
            sure = top.values[:, 0] - top.values[:, 1] > MARGIN
            lo += int((right & sure).sum())
            hi += int((right | ~sure).sum())
            labelled += len(pos)
    return lo, hi, labelled


# ---------------------------------------------------------------- checks shared by both runs


def keyed(events: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for e in events:
        out.setdefault(e["key"], e)
    return out


def of(events: list[dict], key: str) -> list[dict]:
    return [e for e in events if e["key"] == key]


def check_hyperparameters(k: dict[str, dict], env: dict[str, str], run_config: dict) -> None:
    """The logged hyperparameters are the launcher's variables (and bert/config.py's defaults
    for the ones it leaves unset, read from the config the run dumped)."""
    hp = {key: e["value"] for key, e in k.items()}
    o = run_config["optim"]
    assert hp["opt_base_learning_rate"] == float(env["LR"])
    assert hp["opt_learning_rate_training_steps"] == int(env["MAX_STEPS"])
    assert hp["opt_learning_rate_warmup_steps"] == hp["num_warmup_steps"] == int(env["WARMUP_STEPS"])
    assert hp["start_warmup_step"] == int(env["START_WARMUP_STEP"])
    assert hp["opt_lamb_beta_1"] == float(env["OPT_LAMB_BETA_1"])
    assert hp["opt_lamb_beta_2"] == float(env["OPT_LAMB_BETA_2"])
    assert hp["opt_lamb_weight_decay_rate"] == float(env["WEIGHT_DECAY_RATE"])
    assert hp["opt_lamb_epsilon"] == o["eps"] and hp["opt_learning_rate_end"] == float(env.get("END_LR") or o["end_lr"])
    assert hp["gradient_accumulation_steps"] == int(env["GRADIENT_STEPS"])
    assert hp["global_batch_size"] == launcher(env)["gbs"]
    assert hp["world_size"] == launcher(env)["ranks"]
    assert hp["seed"] == int(env["SEED"])
    assert hp["opt_name"] == env["OPTIMIZER"] and hp["submission_division"] == env["DIVISION"]
    assert hp["max_sequence_length"] == int(env["DEMO_SEQ_LEN"])
    assert hp["opt_gradient_clip_norm"] == o["max_grad_norm"]
    assert hp["submission_benchmark"] == "bert"
    lg = run_config["log"]
    assert lg["system"] == env["DGXSYSTEM"]
    assert hp["submission_platform"] == (lg["platform"] or lg["system"])
    assert hp["submission_org"] == lg["submitter"] and hp["submission_status"] == lg["status"]
    assert hp["cache_clear"] is run_config["run"]["cache_cleared"]


def check_evals_and_blocks(events: list[dict], interval: int) -> list[int]:
    """One block per eval: block_start at the samples the previous eval left (0 first),
    epoch_count the interval; block_stop, eval_start, eval_stop and eval_accuracy at the
    samples of that eval; in that order. Returns the evals' epoch_num."""
    evals = [e["metadata"]["epoch_num"] for e in of(events, "eval_accuracy")]
    starts, stops = of(events, "block_start"), of(events, "block_stop")
    assert len(starts) == len(stops) == len(evals) > 0
    assert [e["metadata"]["epoch_num"] for e in of(events, "eval_start")] == evals
    assert [e["metadata"]["epoch_num"] for e in of(events, "eval_stop")] == evals
    assert [e["metadata"]["samples_count"] for e in of(events, "skipped_steps")] == evals
    assert [e["metadata"]["first_epoch_num"] for e in starts] == [0, *evals[:-1]]
    assert [e["metadata"]["samples_count"] for e in starts] == [0, *evals[:-1]]
    assert all(e["metadata"]["epoch_count"] == interval for e in starts)
    assert [e["metadata"]["samples_count"] for e in stops] == evals
    assert [e["metadata"]["first_epoch_num"] for e in stops] == [e["metadata"]["first_epoch_num"] for e in starts]
    order = [e["key"] for e in events if e["key"] in ("block_start", "block_stop", "eval_start", "eval_stop",
                                                       "eval_accuracy")]
    assert order == ["block_start", "block_stop", "eval_start", "eval_stop", "eval_accuracy"] * len(evals)
    return evals


def check_run_events(events: list[dict], stdout: str, status: str) -> None:
    """init < run_start < run_stop, each once, and the timed span no longer than the
    launcher's own wall clock (its RESULT line, whole seconds)."""
    k = keyed(events)
    for key in ("init_start", "init_stop", "run_start", "run_stop", "train_samples", "eval_samples"):
        assert len(of(events, key)) == 1, key
    t = {key: k[key]["time_ms"] for key in ("init_start", "init_stop", "run_start", "run_stop")}
    assert t["init_start"] <= t["init_stop"] <= t["run_start"] < t["run_stop"]
    assert all(t["run_start"] <= e["time_ms"] <= t["run_stop"] for e in of(events, "eval_accuracy"))
    (seconds,) = re.findall(r"^RESULT,bert,[^,]*,(\d+),", stdout, re.M)
    assert (t["run_stop"] - t["run_start"]) / 1000 <= int(seconds) + 1
    assert k["run_stop"]["metadata"]["status"] == status
    assert k["run_stop"]["metadata"]["samples_count"] == k["train_samples"]["value"]
    assert k["nonfinite_loss_steps"]["value"] == 0 and all(e["value"] == 0 for e in of(events, "skipped_steps"))


def check_accuracy(events: list[dict], weights: Path, run_config: Path, eval_dir: Path, eval_limit: int) -> None:
    """eval_samples is the eval set the run was given; the last eval_accuracy is what the
    saved (final) weights score on it: correct over labelled positions, exactly a count of
    correct predictions over the labelled positions counted here."""
    samples = eval_set_on_disk(eval_dir, eval_limit)
    k = keyed(events)
    assert k["eval_samples"]["value"] == len(samples)
    lo, hi, labelled = correct_bounds(weights, run_config, samples)
    correct = of(events, "eval_accuracy")[-1]["value"] * labelled
    assert abs(correct - round(correct)) < 1e-6, f"accuracy x {labelled} labelled = {correct}: another denominator"
    assert lo <= round(correct) <= hi, (lo, round(correct), hi)
    assert hi - lo <= 10  # the margin leaves only a few predictions undecided


# ---------------------------------------------------------------- the successful run


def test_trained_run_log_values_are_what_it_did(trained, demo_data):
    assert trained.returncode == 0, trained.stdout[-3000:]
    events, out = mllog_events(trained.log), trained.stdout
    env = dict(demo_data.env, SEED="7")  # the fixture's seed
    dumped = build_config(config_file=str(trained.log.parent / "result_0_config.json"))
    run_config = dataclasses.asdict(dumped)
    k = keyed(events)
    check_hyperparameters(k, env, run_config)
    check_run_events(events, out, "success")
    gbs = launcher(env)["gbs"]
    steps = steps_run(out)
    assert k["train_samples"]["value"] == steps * gbs
    interval = int(env["EVAL_ITER_SAMPLES"])
    assert interval % gbs == 0  # here every eval falls exactly on a multiple of the interval
    evals = check_evals_and_blocks(events, interval)
    assert evals == list(range(interval, steps * gbs + 1, interval))
    accs = [e["value"] for e in of(events, "eval_accuracy")]
    target = dumped.eval.target_accuracy
    assert accs[-1] >= target and all(a < target for a in accs[:-1])  # it stopped at the first success
    progress = progress_lines(out)
    assert progress and all(samples == step * gbs for step, samples, _ in progress)
    # The printed rate is the scheduler's for the next update: the logged schedule's.
    assert all(lr == pytest.approx(mlcommons_lr(step, {key: e["value"] for key, e in k.items()}), rel=1e-3)
               for step, _, lr in progress)
    check_accuracy(events, trained.checkpoint, trained.log.parent / "result_0_config.json", demo_data.eval,
                   dumped.data.eval_samples)


# ---------------------------------------------------------------- a short run that shows the arithmetic


@dataclasses.dataclass
class ShortRun:
    dir: Path
    env: dict[str, str]
    stdout: str
    returncode: int


@pytest.fixture(scope="module")
def short_run(trained, demo_data, tmp_path_factory) -> ShortRun:
    assert trained.returncode == 0, trained.stdout[-3000:]
    out = tmp_path_factory.mktemp("short_run")
    # Global batch 2 ranks x 16 x 2 = 64; evals at the first step at or past each multiple of
    # 96 and at the 448-sample limit; warmup from step -2 over 4 steps, decay to 1e-5 at 20.
    env = demo_run_env(trained, demo_data, out, SEED="23", BATCHSIZE="16", GRADIENT_STEPS="2",
                       EVAL_ITER_SAMPLES="96", MAX_SAMPLES_TERMINATION="448", TARGET_MLM_ACCURACY="0.99",
                       WARMUP_STEPS="4", START_WARMUP_STEP="-2", MAX_STEPS="20", END_LR="1e-5",
                       SAVE_CHECKPOINT=str(out / "final.pt"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=1 ckpt.interval_steps=3"
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    return ShortRun(out, env, r.stdout + r.stderr, r.returncode)


def test_short_run_log_values_are_what_it_did(short_run, demo_data):
    run, env = short_run, short_run.env
    assert run.returncode == 1, run.stdout[-3000:]  # the sample limit came first: aborted
    events = mllog_events(run.dir / "result_0.txt")
    config_path = run.dir / "result_0_config.json"
    dumped = build_config(config_file=str(config_path))
    k = keyed(events)
    hp = {key: e["value"] for key, e in k.items()}
    check_hyperparameters(k, env, dataclasses.asdict(dumped))
    check_run_events(events, run.stdout, "aborted")
    gbs, limit, interval = launcher(env)["gbs"], int(env["MAX_SAMPLES_TERMINATION"]), int(env["EVAL_ITER_SAMPLES"])
    assert gbs == 64 and hp["gradient_accumulation_steps"] == 2

    # Samples: the loop's steps times the launcher's global batch, up to the limit.
    steps = steps_run(run.stdout)
    progress = progress_lines(run.stdout)
    assert [p[0] for p in progress] == list(range(1, steps + 1))
    assert [p[1] for p in progress] == [s * gbs for s in range(1, steps + 1)]
    assert hp["train_samples"] == steps * gbs == limit

    # Evals at the first step at or past each multiple of the interval, and at the limit.
    crossing = [s * gbs for s in range(1, steps + 1) if (s * gbs) // interval > ((s - 1) * gbs) // interval]
    want = sorted(set(crossing) | {limit})
    assert want == [128, 192, 320, 384, 448]  # the oracle's own arithmetic, spelled out
    # Off the interval grid (96 is no multiple of 64): block_stop still repeats its block_start.
    assert check_evals_and_blocks(events, interval) == want
    assert of(events, "eval_accuracy")[-1]["metadata"]["epoch_num"] == hp["train_samples"]

    # The schedule the optimizer ran is the logged one, step by step.
    assert all(lr == pytest.approx(mlcommons_lr(step, hp), rel=1e-3) for step, _, lr in progress)
    assert len({round(lr, 12) for *_, lr in progress}) == steps  # warmup, then decay: every rate differs

    # The optimizer's own settings, from the train-state checkpoint it wrote after step 6.
    ckpt = torch.load(run.dir / "checkpoints" / "step_000000006" / "train.pt", weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    assert all(tuple(g["betas"]) == (hp["opt_lamb_beta_1"], hp["opt_lamb_beta_2"]) for g in groups)
    assert all(g["eps"] == hp["opt_lamb_epsilon"] for g in groups)
    assert sorted(g["weight_decay"] for g in groups) == [0.0, hp["opt_lamb_weight_decay_rate"]]
    assert all(g["initial_lr"] == hp["opt_base_learning_rate"] for g in groups)
    assert all(g["lr"] == pytest.approx(mlcommons_lr(6, hp), rel=1e-12) for g in groups)
    assert ckpt["train_state"]["step"] == 6 and ckpt["train_state"]["samples"] == 6 * gbs

    check_accuracy(events, run.dir / "final.pt", config_path, demo_data.eval, dumped.data.eval_samples)
