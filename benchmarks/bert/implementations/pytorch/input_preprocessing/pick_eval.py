"""eval: the evaluation set, ``num_samples`` evenly spaced samples of the eval examples.

The reference's ``pick_eval_samples.py``: sample i of the pick is global sample
``int(i * (N / num_samples))`` of the N eval examples (all input files in sorted order), the
ratio a float, the product rounded toward zero. It is not ``i * N // num_samples``: the float
product falls just below an integer for some i (N=30, 22 samples: i=11 gives 14.999..., so
sample 14, where integer arithmetic gives 15); about 5.6% of the N from 10,000 to 400,000
pick at least one other sample of the 10,000 that way.

The inputs are checked against their directory's md5 list (inputs.py) before anything is
written, and read through the run's reader; the output directory gets its md5 list with the
eval file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert.config import PREP_READ_TIMEOUT_S
from bert.shards import DataError, Shard, list_shards

from .common import PrepError, shard_geometry, step_output, write_md5_list, write_shard_atomic
from .inputs import open_inputs


def eval_file_name(num_samples: int) -> str:
    return "eval_10k.hdf5" if num_samples == 10000 else f"eval_{num_samples}.hdf5"


def pick_indices(total: int, num_samples: int) -> np.ndarray:
    if not 1 <= num_samples <= total:
        raise PrepError(f"cannot pick {num_samples} samples out of {total}"
                        + (": give more held-out text (docs/pretraining.md says how much), or take all there are "
                           "with --or-fewer" if 1 <= total < num_samples else ""))
    # float64 products of exact integers (i < 2**53), as Python's float makes them; truncated
    return (np.arange(num_samples, dtype=np.float64) * (total / num_samples)).astype(np.int64)


def pick_eval(input_path: str | Path, output_dir: str | Path, num_samples: int = 10000, layout: str = "",
              max_seq_length: int = 512, max_predictions: int = 76, *, or_fewer: bool = False,
              read_timeout_s: float = PREP_READ_TIMEOUT_S) -> dict:
    """Write ``output_dir/eval_10k.hdf5`` (``eval_<n>.hdf5`` for another count); ``layout`` '' keeps the
    input's. ``or_fewer``: with fewer than ``num_samples`` eval examples, take every one."""
    p = Path(input_path)
    try:
        paths = [p] if p.is_file() else list_shards(p)
    except DataError as e:
        raise PrepError(str(e)) from None
    root = p.parent if p.is_file() else p
    # The output's lengths are checked as it is written: no length bound on the reads.
    inputs = open_inputs(root, paths, every_listed=not p.is_file(), max_seq_length=None, timeout_s=read_timeout_s,
                         fingerprint=True)
    data = Shard.concat([inputs.read(x) for x in paths])
    in_layout, s, pp = shard_geometry(paths[0])
    layout = layout or in_layout
    if in_layout == "fixed" and layout == "fixed":
        max_seq_length, max_predictions = s, pp
    wanted = num_samples
    if or_fewer and 1 <= len(data) < num_samples:
        num_samples = len(data)
    idx = pick_indices(len(data), num_samples)
    params = {"num_samples": wanted, "layout": layout, "max_seq_length": max_seq_length,
              "max_predictions": max_predictions, "inputs": inputs.fingerprint}
    with step_output(output_dir, "eval", {**params, "or_fewer": True} if or_fewer else params) as out:
        picked = data.subset(idx)
        target = out / eval_file_name(num_samples)
        try:
            md5 = write_shard_atomic(target, picked, layout, max_seq_length, max_predictions)
        except ValueError as e:
            raise PrepError(f"{target}: {e}") from None
        write_md5_list(out, {target.name: md5})
    summary = {"eval_examples": len(data), "picked": len(picked), "file": str(target),
               "tokens": int(len(picked.tokens)), "inputs_verified_against": inputs.verified_by()}
    if num_samples < wanted:
        summary["fewer_than_asked"] = f"{wanted} asked, {num_samples} there: every eval example taken (--or-fewer)"
    return summary
