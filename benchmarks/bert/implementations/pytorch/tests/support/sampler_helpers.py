"""Helpers of test_sampler.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bert.config import build_config
from bert import loader
from bert.trainer import train_plan
from bert.shards import Sample, Shard, read_shard, write_shard


PKG = Path(__file__).resolve().parents[2]


S, P = 32, 5


BOUNDS = [(1, 12), (13, 20), (21, 32)]


def make_sample(uid: int, length: int, rng: np.random.Generator) -> Sample:
    """A valid sample whose token 1 is 5 + uid, so it can be traced after reading."""
    ids = rng.integers(5, 30000, size=length)
    ids[0], ids[-1], ids[1] = 2, 3, 5 + uid
    a = max(2, length // 2)  # sentence A's [SEP]
    seg = (np.arange(length) > a).astype(np.int8)
    m = int(min(P, length - 2))
    pos = np.sort(rng.choice(np.arange(2, length), size=m, replace=False))
    labels = rng.integers(5, 100, size=m)
    keep = (pos != a) & (pos != length - 1)  # never on a [SEP] (nor [CLS], token 1: the uid)
    return Sample(ids.astype(np.int16), seg, pos[keep].astype(np.int16), labels[keep].astype(np.int16),
                  int(rng.integers(0, 2)))


def write_stratified(root: Path, per_stratum: list[int], seed: int = 0, layout: str = "variable",
                     shards_per_stratum: int = 2) -> list[int]:
    """A strata dir; returns the length of every sample in global-id order."""
    rng = np.random.default_rng(seed)
    strata, index, all_lengths, uid = [], {}, [], 0
    for k, ((lo, hi), n) in enumerate(zip(BOUNDS, per_stratum)):
        name = f"stratum_{k}_{lo}-{hi}"
        (root / name).mkdir(parents=True)
        lengths = rng.integers(max(lo, 5), hi + 1, size=n)
        shards = []
        for j, part in enumerate(np.array_split(np.arange(n), shards_per_stratum)):
            rel = f"{name}/part_{j:05d}.hdf5"
            samples = [make_sample(uid + int(i), int(lengths[i]), rng) for i in part]
            write_shard(root / rel, Shard.from_samples(samples), layout, S, P)
            index[rel] = lengths[part].astype(np.uint16)
            shards.append(rel)
        uid += n
        all_lengths += lengths.tolist()
        strata.append({"name": name, "min_len": lo, "max_len": hi, "samples": n,
                       "tokens": int(lengths.sum()), "shards": shards})
    np.savez(root / "length_index.npz", **index)
    (root / "manifest.json").write_text(json.dumps({
        "format": "mlperf-bert-strata/1", "max_seq_length": S, "strata": strata,
        "total_samples": sum(per_stratum), "total_tokens": int(sum(all_lengths)),
        "length_index": "length_index.npz"}))
    return all_lengths


def uid_of(sample: Sample) -> int:
    return int(sample.input_ids[1]) - 5


@pytest.fixture(scope="module")
def strata_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("strata")
    lengths = write_stratified(root, [48, 24, 24])
    return root, lengths


def _cfg(root, **sampler):
    return build_config({"data.train_dir": str(root), "data.max_seq_length": S, "model.max_position_embeddings": S,
                         "data.max_predictions_per_seq": P, "run.local_batch_size": 4, "run.division": "open",
                         "run.seed": 1, **{f"sampler.{k}": v for k, v in sampler.items()}})


def _loader(cfg, rank, world):
    return loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                seed=cfg.run.seed, rank=rank, world_size=world)


def read_ids(index, root, ids, bounds=None):
    """The samples of global ids ``ids`` of ``index``, as the loader reads a draw of them."""
    from bert.loader import TrainLoader
    from bert.reader import ShardReader
    from bert.sampler import Draw, IdOrder

    reader = ShardReader(root, max_seq_length=S, bounds=bounds, verify_md5=True, timeout_s=60)
    stream = TrainLoader(policy=IdOrder(None, index), reader=reader, paths=index.paths, collate=list, batch_size=1,
                         world_size=1, data=dict)
    shard, row = index.locate(np.asarray(ids))
    return stream.samples(Draw(shard, row, (0, 0), (1, 0), index.lengths[np.asarray(ids)]))


MODES = {  # the sampling modes (config overrides) by the directory each reads: road_dirs'
    "closed": ("plain", {}),
    "snake": ("plain", {"run.division": "open", "sampler.deal": "snake", "sampler.group_size": 2}),
    "strata": ("strata", {"run.division": "open", "sampler.mode": "stratified", "sampler.deal": "snake",
                          "sampler.group_size": 2}),
    "strata_closed": ("strata", {}),
    "packed": ("plain", {"run.division": "open", "model.pack": "true", "model.unpad": "false"}),
}


def road_dirs(tmp_path, change=None):
    """The same samples as a plain directory of shards and as a strata directory."""
    plain, strata = tmp_path / "plain", tmp_path / "strata"
    write_stratified(strata, [16, 8, 8], shards_per_stratum=2)
    plain.mkdir()
    for i, f in enumerate(sorted(strata.glob("stratum_*/*.hdf5"))):
        shard = read_shard(f)
        write_shard(plain / f"part_{i}.hdf5", shard, "variable")
    for d in (plain, strata):
        if change is not None:
            for f in sorted(d.rglob("*.hdf5")):
                shard = read_shard(f)
                change(shard)
                write_shard(f, shard, "variable")
    return {"plain": plain, "strata": strata}
