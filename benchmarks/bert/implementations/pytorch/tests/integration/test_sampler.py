"""bert.sampler: the integration tier's (processes started, or long);
tests/unit/test_sampler.py has the rest and says what the file covers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import end_worker, free_port
from sampler_helpers import PKG, _cfg, _loader, strata_dir, uid_of  # noqa: F401 - fixtures: strata_dir


def test_balance_tool_json_interface():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "tools/balance.py", "--ranks", "64", "--local-batch", "16", "--group", "8",
                          "--mode", "stratified+snake", "--steps", "3", "--json"],
                         cwd=PKG, capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert {"tokens_max_over_mean", "attention_max_over_mean", "padding_fraction"} <= r.keys()
    assert r["counts_per_unit"] == [6, 3, 2, 5]
    assert 1.0 <= r["tokens_max_over_mean"] < 1.2


def _drawn(stream, step):
    """The samples ``stream``'s policy draws at ``step`` (each rank in the same order: the
    gather deal's draw is a collective)."""
    return stream.samples(next(stream.policy.draws((step, 0), stream)))


def _gloo_worker(rank, port, root, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for deal in ("snake", "greedy"):
        base = dict(mode="stratified", group_size=2, counts=[2, 1, 1])
        plain = _loader(_cfg(root, **base), rank, 2)
        local = _loader(_cfg(root, **base, deal=deal), rank, 2)
        gathered = _loader(_cfg(root, **base, deal=deal, lengths="gather"), rank, 2)
        for step in range(6):
            res[(deal, step)] = {name: [uid_of(s) for s in _drawn(loader, step)]
                                 for name, loader in (("plain", plain), ("local", local), ("gather", gathered))}
            batch = next(gathered)  # the collated batch holds the dealt samples, in order
            res[(deal, step)]["batch"] = (batch["input_ids"][batch["cu_seqlens"][:-1].long() + 1] - 5).tolist()
        for loader in (plain, local, gathered):
            loader.close()
    torch.save(res, f"{out}/rank{rank}.pt")
    end_worker()


def test_two_gloo_ranks_presort_only_reorders(strata_dir, tmp_path):
    import torch.multiprocessing as mp

    root, lengths = strata_dir
    mp.spawn(_gloo_worker, args=(free_port(), str(root), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for key in r0:
        a, b = r0[key], r1[key]
        assert sorted(a["plain"] + b["plain"]) == sorted(a["local"] + b["local"])  # same multiset
        assert a["local"] == a["gather"] and b["local"] == b["gather"]  # same deal either way
        assert len(a["local"]) == len(b["local"]) == 4
        assert abs(sum(lengths[i] for i in a["local"]) - sum(lengths[i] for i in b["local"])) <= \
            abs(sum(lengths[i] for i in a["plain"]) - sum(lengths[i] for i in b["plain"]))
        assert a["batch"] == a["gather"] and b["batch"] == b["gather"]


@pytest.mark.parametrize("extra", [["sampler.deal=greedy", "model.unpad=false", "model.pack=true"],
                                   ["sampler.deal=snake", "sampler.lengths=gather"]])
def test_open_division_run_with_presorting(trained, demo_data, tmp_path, extra):
    """The id-based loader (random + a deal; packed rows for train and eval) in the real loop,
    from the trained demo weights: reaches the target and the log passes the checker."""
    from bert import train
    from conftest import run_checker
    from train_helpers import _small_overrides

    assert trained.returncode == 0, trained.stdout[-3000:]
    rc = train.main(_small_overrides(demo_data, tmp_path, "run.division=open", "optim.name=adam",
                                     f"run.init_checkpoint={trained.checkpoint}", "optim.lr=1e-4",
                                     "eval.interval_samples=64", "run.max_samples=128", *extra))
    assert rc == 0
    ok, out = run_checker(tmp_path / "result_0.txt")
    assert ok, out
