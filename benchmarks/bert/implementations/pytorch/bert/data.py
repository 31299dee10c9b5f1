"""Training and eval data: shards (bert/shards.py) -> collated batches of torch tensors.

``collate`` decides the batch layout of a list of samples:

* padded (``unpad=False``): [B, max_seq_length] tensors plus ``attention_mask``, labels
  [B, S] with -100 everywhere but the masked positions (Hugging Face's convention);
* unpadded (``unpad=True``): the batch's real tokens packed into [T] with ``cu_seqlens``,
  ``position_ids`` and ``masked_index`` (where each prediction sits in the packed tokens).

Sampling is kept apart from reading: ``RandomShardOrder`` says which shards a rank reads in
an epoch and in which order it takes their samples; ``SampleStream`` reads what the policy
names; ``TrainLoader`` only cuts the stream into batches. A different policy (stratified
sampling, ``bert/sampler.py``) replaces the first piece and reuses the other two.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from .model import IGNORE_INDEX
from .shards import SHARD_SUFFIXES, DataError, Sample, Shard, list_shards, read_shard, row_offsets, shard_size

LABEL_KEYS = ("mlm_labels", "nsp_labels")  # what collate adds to the model's keyword arguments


# ---------------------------------------------------------------- batches


def collate(samples: Sequence[Sample], unpad: bool, max_seq_length: int) -> dict[str, Any]:
    """Stack samples into the model's keyword arguments plus ``mlm_labels``/``nsp_labels``.

    Padded: ``input_ids``, ``token_type_ids``, ``attention_mask``, ``mlm_labels`` [B, S]
    (S = ``max_seq_length``), ``nsp_labels`` [B]. Unpadded: ``input_ids``,
    ``token_type_ids``, ``position_ids`` [T]; ``cu_seqlens`` int32 [B+1]; ``max_seqlen``
    (int, this batch's longest sample); ``masked_index`` [M] into the T packed tokens;
    ``mlm_labels`` [M]; ``nsp_labels`` [B]. All integer tensors are int64 except
    ``cu_seqlens``. CPU tensors; moving (and pinning) is the caller's choice.
    """
    b = len(samples)
    if b == 0:
        raise ValueError("collate: empty batch")
    lengths = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=b)
    if lengths.max() > max_seq_length:
        i = int(np.argmax(lengths))
        raise ValueError(f"collate: sample {i} of the batch has {int(lengths[i])} tokens > "
                         f"max_seq_length {max_seq_length}")
    n_pred = np.fromiter((len(s.masked_positions) for s in samples), dtype=np.int64, count=b)
    tokens = np.concatenate([s.input_ids for s in samples]).astype(np.int64)
    segments = np.concatenate([s.segment_ids for s in samples]).astype(np.int64)
    positions = np.concatenate([s.masked_positions for s in samples]).astype(np.int64)
    labels = np.concatenate([s.masked_ids for s in samples]).astype(np.int64)
    nsp = torch.tensor([s.nsp_label for s in samples], dtype=torch.int64)
    row_of_pred = np.repeat(np.arange(b), n_pred)

    if unpad:
        cu = row_offsets(lengths)
        starts = cu[:-1]
        return {
            "input_ids": torch.from_numpy(tokens),
            "token_type_ids": torch.from_numpy(segments),
            "position_ids": torch.from_numpy(np.arange(cu[-1]) - np.repeat(starts, lengths)),
            "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
            "max_seqlen": int(lengths.max()),
            "masked_index": torch.from_numpy(positions + starts[row_of_pred]),
            "mlm_labels": torch.from_numpy(labels),
            "nsp_labels": nsp,
        }
    mask = np.arange(max_seq_length)[None, :] < lengths[:, None]
    input_ids = np.zeros((b, max_seq_length), dtype=np.int64)
    input_ids[mask] = tokens  # row-major boolean assignment fills each row's prefix in order
    token_type_ids = np.zeros((b, max_seq_length), dtype=np.int64)
    token_type_ids[mask] = segments
    mlm_labels = np.full((b, max_seq_length), IGNORE_INDEX, dtype=np.int64)
    mlm_labels[row_of_pred, positions] = labels
    return {
        "input_ids": torch.from_numpy(input_ids),
        "token_type_ids": torch.from_numpy(token_type_ids),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        "mlm_labels": torch.from_numpy(mlm_labels),
        "nsp_labels": nsp,
    }


def to_device(batch: dict, device: torch.device) -> dict:
    # non_blocking: overlaps the host-to-device copy with compute on GPU (from pinned
    # memory); free on CPU.
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def split_labels(batch: dict) -> tuple[dict, dict]:
    """(the model's keyword arguments, the labels)."""
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS}, {k: batch[k] for k in LABEL_KEYS}


# ---------------------------------------------------------------- sampling policy


class ShardPolicy(Protocol):
    """Which shards a rank reads in an epoch, and which of their samples, in what order."""

    def shards(self, epoch: int) -> list[int]: ...

    def select(self, epoch: int, shard: int, num_samples: int) -> np.ndarray: ...


class RandomShardOrder:
    """Closed-division random order, deterministic from ``seed``.

    Epoch e shuffles the shard list with ``seed + e``. With at least as many shards as
    ranks, the shuffled list is dealt round-robin (rank r reads shards r, r+W, ...), so each
    sample is read by exactly one rank per epoch; with fewer shards every rank reads every
    shard and keeps samples r, r+W, ... of its permutation. Inside a shard the samples are
    permuted with (seed, epoch, shard index in the sorted list).
    """

    def __init__(self, num_shards: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_shards, self.rank, self.world_size, self.seed = num_shards, rank, world_size, seed
        self.dealt = num_shards >= world_size

    def shards(self, epoch: int) -> list[int]:
        order = np.random.default_rng(self.seed + epoch).permutation(self.num_shards)
        return order[self.rank::self.world_size].tolist() if self.dealt else order.tolist()

    def select(self, epoch: int, shard: int, num_samples: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch, shard]).permutation(num_samples)
        return perm if self.dealt else perm[self.rank::self.world_size]


# ---------------------------------------------------------------- reading what the policy names


class SampleStream:
    """Endless samples of one rank: epoch after epoch of what ``policy`` names.

    Yields ``(epoch, offset, sample)``, ``offset`` counting this rank's samples within the
    epoch, so a position can be saved and resumed. With ``prefetch`` one background thread
    reads the next shard while the current one is consumed, so file I/O overlaps the training
    step (torch kernels release the GIL); costs one extra shard in memory.
    """

    def __init__(self, paths: Sequence[Path], policy: ShardPolicy, max_seq_length: int | None = None,
                 prefetch: bool = True):
        self.paths, self.policy = list(paths), policy
        self.max_seq_length, self.prefetch = max_seq_length, prefetch

    def _count(self, epoch: int, shard: int) -> int:
        return len(self.policy.select(epoch, shard, shard_size(self.paths[shard])))

    def _plan(self, epoch: int, offset: int) -> Iterator[tuple[int, int, int]]:
        """Endless (epoch, shard, samples of it to skip), starting at ``offset`` of ``epoch``.

        Resuming skips whole shards from metadata alone (one file open each, no data read);
        only the shard that holds the offset is read and partly skipped.
        """
        skip = offset
        while True:
            for shard in self.policy.shards(epoch):
                if skip:
                    n = self._count(epoch, shard)
                    if skip >= n:
                        skip -= n
                        continue
                yield epoch, shard, skip
                skip = 0
            epoch, skip = epoch + 1, 0

    def _load(self, epoch: int, shard: int) -> tuple[Shard, np.ndarray]:
        data = read_shard(self.paths[shard], self.max_seq_length)
        return data, self.policy.select(epoch, shard, len(data))

    def __call__(self, epoch: int = 0, offset: int = 0) -> Iterator[tuple[int, int, Sample]]:
        """Samples from ``offset`` (this rank's count within ``epoch``) on."""
        plan = self._plan(epoch, offset)
        pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
                if self.prefetch else None)
        try:
            ep, shard, skip = next(plan)
            pos = offset if ep == epoch else 0
            pending = pool.submit(self._load, ep, shard) if pool else None
            idle = 0  # consecutive shards that gave this rank nothing
            while True:
                data, order = pending.result() if pending else self._load(ep, shard)
                nxt = next(plan)
                if pool:
                    pending = pool.submit(self._load, nxt[0], nxt[1])
                for i in order[skip:]:
                    yield ep, pos, data[int(i)]
                    pos += 1
                idle = idle + 1 if len(order) <= skip else 0
                if idle > 2 * len(self.paths):  # else a rank with nothing to read spins forever
                    raise DataError(f"{self.paths[0].parent}: this rank got no samples from {idle} "
                                    "shards in a row; too few samples for the world size")
                if nxt[0] != ep:
                    pos = 0
                ep, shard, skip = nxt
        finally:
            if pool:
                pool.shutdown(wait=False, cancel_futures=True)


class TrainLoader:
    """Endless local training batches of one rank (every rank yields forever, so ranks never
    disagree on the number of steps; an epoch ends at different steps on different ranks).

    ``state_dict()`` is the stream position of the next sample not yet handed out, so a
    resumed run continues with the same batches.
    """

    def __init__(self, train_dir: str | Path, rank: int, world_size: int, local_batch_size: int,
                 seed: int, unpad: bool, max_seq_length: int, *, prefetch: bool = True,
                 policy: ShardPolicy | None = None, collate_fn: Any = None):
        if local_batch_size <= 0:
            raise ValueError(f"local_batch_size must be positive, got {local_batch_size}")
        self.paths = list_shards(train_dir)
        self.policy = policy or RandomShardOrder(len(self.paths), rank, world_size, seed)
        self.stream = SampleStream(self.paths, self.policy, max_seq_length, prefetch)
        self.rank, self.world_size = rank, world_size
        self.local_batch_size, self.unpad, self.max_seq_length = local_batch_size, unpad, max_seq_length
        # samples -> batch; None = ``collate`` in the ``unpad`` layout (bert.budget's pads it).
        self.collate_fn = collate_fn
        self._epoch, self._offset = 0, 0
        self._it: Iterator[tuple[int, int, Sample]] | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be handed out."""
        return self._epoch

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self.stream(self._epoch, self._offset)
        batch = []
        for _ in range(self.local_batch_size):
            ep, off, sample = next(self._it)
            batch.append(sample)
        self._epoch, self._offset = ep, off + 1
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        return collate(batch, self.unpad, self.max_seq_length)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "offset": self._offset, "rank": self.rank,
                "world_size": self.world_size, "num_shards": len(self.paths)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("world_size", self.world_size), ("num_shards", len(self.paths))):
            if key in state and state[key] != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]}, this run has {mine}")
        self.close()
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])

    def close(self) -> None:
        """Stop the prefetch thread (also happens when the loader is garbage-collected)."""
        if self._it is not None:
            self._it.close()  # type: ignore[attr-defined]
            self._it = None


# ---------------------------------------------------------------- evaluation


def check_eval_dir(train_dir: str | Path, eval_dir: str | Path) -> None:
    """Refuse an eval set that is the training directory, lies inside it, or shares a file
    with it (the same inode: a hard link or symlink counts): the run would "evaluate" on
    training samples. Lists and stats every training shard (4,320 stats on the full set,
    well under a second on a local disk); a touch of the data, so only after run_start."""
    t, e = Path(train_dir).resolve(), Path(eval_dir).resolve()
    fix = "point data.eval_dir (EVALDIR) at the separate eval set (10,000 samples for the benchmark)"
    if e == t or t in e.parents:
        raise DataError(f"data.eval_dir={eval_dir} is, or lies inside, data.train_dir={train_dir}: {fix}")
    if not e.exists():
        return  # EvalSet says so, naming the path
    train_files = {(st.st_dev, st.st_ino) for st in
                   (q.stat() for q in t.rglob("*") if q.suffix in SHARD_SUFFIXES and q.is_file())}
    for q in [e] if e.is_file() else list_shards(e):
        st = q.stat()
        if (st.st_dev, st.st_ino) in train_files:
            raise DataError(f"data.eval_dir={eval_dir}: {q.name} is also a file of data.train_dir={train_dir}: {fix}")


class EvalSet:
    """The first ``limit`` samples (0 = all) of a file or a directory of files (sorted),
    of which rank r keeps samples r, r+W, ...; held in memory (10,000 samples ~ 10 MB).

    Ranks may hold one sample more than others and so yield different batch counts; the
    caller sums correct/total counts across ranks once per evaluation.
    """

    def __init__(self, eval_dir_or_file: str | Path, rank: int, world_size: int, limit: int = 0,
                 max_seq_length: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if limit < 0:
            raise ValueError(f"limit must be >= 0 (0 = all), got {limit}")
        p = Path(eval_dir_or_file)
        if not p.exists():
            raise DataError(f"{p}: no such eval file or directory")
        paths = [p] if p.is_file() else list_shards(p)
        parts, total = [], 0
        for path in paths:
            shard = read_shard(path, max_seq_length)
            if limit and total + len(shard) > limit:
                shard = shard.subset(np.arange(limit - total))
            parts.append(shard)
            total += len(shard)
            if limit and total >= limit:
                break
        if limit and total < limit:
            raise DataError(f"data.eval_samples={limit} but {p} holds {total} samples: set data.eval_samples="
                            f"{total} (or 0 = all), or point data.eval_dir (EVALDIR) at the full eval set")
        self.total_samples = total  # across all ranks
        self.shard = Shard.concat(parts, str(p)).subset(np.arange(rank, total, world_size))

    def __len__(self) -> int:
        return len(self.shard)
