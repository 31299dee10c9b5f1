"""Bad input ends the run with exit status 2 and one message naming the file or key, no
traceback, and nothing half-written (no weights file, no checkpoint, no temp file)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from bert import train
from bert.mlperf_log import read_events
from bert.shards import read_shard, write_shard
from input_preprocessing.checksum import checksum
from checkpoint_helpers import TINY, checkpoints, no_partial_files, tiny_data  # noqa: F401 - fixture
from bad_input_helpers import _copy_data


def run(data_args: list[str], out: Path, *extra: str) -> int:
    return train.main([*TINY, *data_args, f"log.output_dir={out}", f"run.save_checkpoint={out / 'final.pt'}",
                       "run.max_samples=32", *extra])


def _fixed_copy(tiny_data: Path, target: Path) -> Path:
    """One of the demo shards, rewritten in the fixed-length layout, alone in ``target``."""
    target.mkdir()
    src = sorted((tiny_data / "train").iterdir())[0]
    path = target / "part_0.hdf5"
    write_shard(path, read_shard(src), "fixed", max_seq_length=64, max_predictions=10)
    return path


def _replace(path: Path, name: str, data) -> None:
    with h5py.File(path, "a") as f:
        del f[name]
        if data is not None:
            f.create_dataset(name, data=data)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _scribble(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\x00garbage" * 64)


@pytest.mark.parametrize("damage, message", [
    ("missing_dir", r"no such directory"),
    ("empty_dir", r"holds no shard files"),
    ("truncated", r"part_0.hdf5: cannot (open as hdf5|read)"),
    ("corrupt", r"part_0.hdf5: cannot open as hdf5"),
    ("no_masked_lm_ids", r"part_0.hdf5: missing dataset\(s\) \['masked_lm_ids'\]"),
    ("float_input_ids", r"part_0.hdf5: dataset 'input_ids' has dtype float32"),
    ("short_segment_ids", r"part_0.hdf5: dataset 'segment_ids' has shape \(40, 63\)"),
])
def test_bad_training_data(tiny_data, tmp_path, capsys, damage, message):  # noqa: F811
    train_dir = tmp_path / "train"
    if damage == "empty_dir":
        train_dir.mkdir()
    elif damage != "missing_dir":
        shard = _fixed_copy(tiny_data, train_dir)
        with h5py.File(shard, "r") as f:
            ids, seg = f["input_ids"][()], f["segment_ids"][()]
        {"truncated": lambda: _truncate(shard), "corrupt": lambda: _scribble(shard),
         "no_masked_lm_ids": lambda: _replace(shard, "masked_lm_ids", None),
         "float_input_ids": lambda: _replace(shard, "input_ids", ids.astype(np.float32)),
         "short_segment_ids": lambda: _replace(shard, "segment_ids", seg[:, :-1])}[damage]()
    out = tmp_path / "out"
    assert run([f"data.train_dir={train_dir}", f"data.eval_dir={tiny_data / 'eval'}"], out) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert any(line.startswith("error: rank 0: ") for line in err.splitlines())
    assert re.search(message, err), err
    if damage not in ("missing_dir", "empty_dir"):
        assert str(train_dir) in err
    assert not (out / "final.pt").exists() and not checkpoints(out) and not no_partial_files(tmp_path)


@pytest.mark.parametrize("override, key", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("run.local_batch_size=abc", "run.local_batch_size: expected an integer"),
    ("eval.interval_samples=0", "eval.interval_samples: 0 is not a number of samples"),
    ("ckpt.keep=0", "ckpt.keep: must be positive"),
])
def test_bad_config(tiny_data, tmp_path, capsys, override, key):  # noqa: F811
    out = tmp_path / "out"
    assert run([f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}"], out, override) == 2
    assert key in capsys.readouterr().err
    assert not out.exists()  # rejected before anything is opened


def test_checkpoint_of_another_model_shape(tiny_data, tmp_path, capsys):  # noqa: F811
    data = [f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}"]
    out = tmp_path / "out"
    # A preempted-looking run: checkpoints at every step, no finished marker.
    assert run(data, out, "ckpt.interval_steps=1") == 1
    (out / "checkpoints" / "finished.json").unlink()
    (out / "final.pt").unlink()
    (ckpt,) = checkpoints(out)[-1:]
    before = sorted(p.name for p in ckpt.iterdir())
    capsys.readouterr()
    assert run(data, out, "model.hidden_size=64", "model.intermediate_size=128") == 2
    err = capsys.readouterr().err  # the checkpoint's settings name the keys first
    assert "model.hidden_size=64 (the checkpointed run's: 32)" in err, err
    assert sorted(p.name for p in ckpt.iterdir()) == before  # the checkpoint is left intact
    # A checkpoint that holds no settings (as written before checkpoints held them): the
    # tensors' shapes refuse it.
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]["config.json"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "config.json").unlink()
    assert run(data, out, "model.hidden_size=64", "model.intermediate_size=128") == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'train.pt'}: written for a different model" in err
    assert "bert.embeddings.word_embeddings.weight has shape (128, 32) there, (128, 64) here" in err
    assert not (out / "final.pt").exists() and not no_partial_files(out)

    # The same model as an init checkpoint (plain weights) is refused alike.
    weights = tmp_path / "w.pt"
    torch.save(torch.load(ckpt / "train.pt", weights_only=True)["model"], weights)
    fresh = tmp_path / "fresh"
    assert run(data, fresh, f"run.init_checkpoint={weights}", "model.hidden_size=64",
               "model.intermediate_size=128") == 2
    err = capsys.readouterr().err
    assert f"{weights}: tensor 'bert.embeddings.word_embeddings.weight' has shape (128, 32); " \
           "the model config wants (128, 64)" in err


def test_torn_checkpoint_file_is_named(tiny_data, tmp_path, capsys):  # noqa: F811
    data = [f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}"]
    out = tmp_path / "out"
    assert run(data, out, "ckpt.interval_steps=1") == 1
    (out / "checkpoints" / "finished.json").unlink()
    ckpt = checkpoints(out)[-1]
    _truncate(ckpt / "train.pt")  # damage after the fact (the atomic write never leaves this)
    capsys.readouterr()
    assert run(data, out, "ckpt.resume=require") == 2  # its size and CRC-32 in meta.json refuse it
    err = capsys.readouterr().err
    assert f"{ckpt / 'train.pt'}: crc32 " in err and "damaged since it was written" in err, err
    assert run(data, out) == 1  # auto: the newest checkpoint that verifies instead, saying so
    assert f"warning: checkpoint {ckpt.name} does not verify: {ckpt / 'train.pt'}: crc32 " in capsys.readouterr().out


def test_stratum_counts_not_summing_to_the_batch(tmp_path, capsys, tiny_data):  # noqa: F811
    from sampler_helpers import P, S, write_stratified

    write_stratified(tmp_path / "strata", [16, 8, 8])  # three strata
    out = tmp_path / "out"
    args = [*TINY, f"data.train_dir={tmp_path / 'strata'}", f"data.eval_dir={tiny_data / 'eval'}",
            f"data.max_seq_length={S}", f"data.max_predictions_per_seq={P}", f"model.max_position_embeddings={S}",
            f"log.output_dir={out}", "run.division=open", "sampler.mode=stratified", "sampler.counts=4,2,1"]  # 7 != 8
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert "sampler.counts=[4, 2, 1]: need 3 non-negative counts summing to 8" in err and "Traceback" not in err
    assert not checkpoints(out) and not no_partial_files(tmp_path)


def _set_token(shard, sample: int, value: int) -> None:
    shard.tokens[shard.offsets[sample] + 1] = value


def _set_label(shard, sample: int, value: int) -> None:
    shard.mlm_ids[shard.mlm_offsets[sample]] = value


@pytest.mark.parametrize("where, change, message", [
    ("train", lambda s: _set_token(s, 3, 200), r"part_\w+\.hdf5: sample 3: token id 200 >= model\.vocab_size=128"),
    ("train", lambda s: _set_label(s, 3, 128), r"part_\w+\.hdf5: sample 3: masked_lm_id \(label\) 128 >= "
                                               r"model\.vocab_size=128"),
    ("eval", lambda s: _set_label(s, 3, 130), r"eval/eval_00000\.hdf5: sample 3: masked_lm_id \(label\) 130 >= "
                                              r"model\.vocab_size=128"),
    ("eval", lambda s: _set_token(s, 7, 128), r"eval/eval_00000\.hdf5: sample 7: token id 128 >= model\.vocab_size=128"),
])
def test_ids_and_labels_past_the_vocabulary_are_named(tiny_data, tmp_path, capsys, where, change, message):  # noqa: F811
    """An id or label the model has no row for: one line naming the file and the sample, exit 2,
    as the shard is read (the eval set: before any training), instead of an IndexError
    traceback or, for eval labels, a wrong accuracy. Every shard is changed alike: whichever
    the run reads first says it."""
    train_dir, eval_dir = _copy_data(tiny_data, tmp_path / "data", (where, change))
    out = tmp_path / "out"
    assert run([f"data.train_dir={train_dir}", f"data.eval_dir={eval_dir}"], out) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"^error: rank 0: .*" + message, err, re.M), err
    if where == "eval":
        assert "eval_start" not in {e["key"] for e in read_events(out / "result_0.txt")}
    assert read_events(out / "result_0.txt")[-1]["metadata"]["status"] == "aborted"  # the log ends with the run
    assert not (out / "final.pt").exists() and not checkpoints(out) and not no_partial_files(tmp_path)


@pytest.mark.parametrize("case", ["changed", "unlisted"])
def test_shards_are_checked_against_their_md5_manifest(tiny_data, tmp_path, capsys, case):  # noqa: F811
    """Where a data directory has md5sums.txt (input_preprocessing's checksum step), a file
    that changed since (one flipped byte, which HDF5 would read as another token) or one it
    does not list ends the run as the file is read: exit 2, naming file and manifest."""
    train_dir, eval_dir = _copy_data(tiny_data, tmp_path / "data")
    checksum(train_dir)
    manifest = train_dir / "md5sums.txt"
    if case == "changed":
        for shard in train_dir.glob("*.hdf5"):  # whichever the run reads first
            data = bytearray(shard.read_bytes())
            data[-100] ^= 0x01
            shard.write_bytes(bytes(data))
        message = rf"\w+\.hdf5: md5 [0-9a-f]{{32}}, but {re.escape(str(manifest))} says [0-9a-f]{{32}}: the file changed"
    else:
        manifest.write_text("0" * 32 + "  other.hdf5\n")
        message = rf"\w+\.hdf5: not listed in {re.escape(str(manifest))}: the manifest does not describe"
    out = tmp_path / "out"
    assert run([f"data.train_dir={train_dir}", f"data.eval_dir={eval_dir}"], out) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err
    if case == "unlisted":  # data.verify_md5=false: the manifest is not read
        assert run([f"data.train_dir={train_dir}", f"data.eval_dir={eval_dir}"], tmp_path / "off",
                   "data.verify_md5=false") == 1
