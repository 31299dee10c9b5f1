"""The data-preparation steps on the run's road: every step that reads shards checks them
against the md5 list their directory carries (a changed or missing shard: exit 2 naming it and
the list, nothing written) and reads under the watchdog's bound; every step that writes shards
writes their md5 list with them, so its output verifies as written and a run on it checks it."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from bert import demo_data
from bert.integrity import MANIFEST
from bert.shards import list_shards, read_shard, write_shard
from input_preprocessing.__main__ import main
from input_preprocessing.checksum import checksum, verify
from input_preprocessing.common import PrepError
from input_preprocessing.stratify import stratify

S, P, V = 64, 10, 200  # the demo data's geometry here
IDS = ["--vocab-size", str(V), "--cls-id", str(demo_data.CLS), "--sep-id", str(demo_data.SEP)]


@pytest.fixture(scope="module", params=["fixed", "variable"])
def made(request, tmp_path_factory):
    """Directories as the steps write them, in one layout: ``plain`` (``shard``'s output),
    ``strata`` (``stratify``'s, of ``plain``) and ``eval`` (``eval``'s), each with the md5 list
    its step wrote."""
    layout = request.param
    root = tmp_path_factory.mktemp(f"made_{layout}")
    demo_data.generate(root / "demo", train_samples=240, eval_samples=60, seed=4, seq_len=S, max_pred=P, vocab=V,
                       layout=layout, shards=3)
    for step in (["shard", "--input", str(root / "demo" / "train"), "--output", str(root / "plain"),
                  "--num-shards", "4", "--layout", layout, "--max-seq-length", str(S), "--max-predictions", str(P)],
                 ["stratify", "--input", str(root / "plain"), "--output", str(root / "strata"), "--bounds", "24,40,64",
                  "--max-seq-length", str(S)],
                 ["eval", "--input", str(root / "demo" / "eval"), "--output", str(root / "eval"), "--num-samples", "30",
                  "--max-seq-length", str(S), "--max-predictions", str(P)]):
        assert main([*step, "--workers", "1"] if step[0] != "eval" else step) == 0
    return layout, root


def _change(path: Path) -> None:
    """One token of the first sample changed in place, as a damaged copy or disk would."""
    with h5py.File(path, "r+") as f:
        ids = f["input_ids"]
        if ids.ndim == 2:
            ids[0, 1] = ids[0, 1] + 1
        else:
            row = ids[0]
            row[1] += 1
            ids[0] = row


def _damaged(made, tmp_path, which: str, fault: str) -> tuple[Path, Path]:
    """A copy of ``made``'s ``which`` directory with one shard changed or removed: (the copy,
    the shard)."""
    _, root = made
    d = tmp_path / which
    shutil.copytree(root / which, d)
    victim = sorted(p for p in d.rglob("*.hdf5"))[1]
    if fault == "changed":
        _change(victim)
    else:
        victim.unlink()
    return d, victim


STEPS = {  # step: (the directory it reads, its arguments but --input, whether it writes an output directory)
    "stratify": ("plain", ["--bounds", "24,40,64", "--max-seq-length", str(S), "--workers", "1"], True),
    "shard": ("plain", ["--num-shards", "2", "--max-seq-length", str(S), "--max-predictions", str(P),
                        "--workers", "1"], True),
    "eval": ("plain", ["--num-samples", "20", "--max-seq-length", str(S), "--max-predictions", str(P)], True),
    "stats": ("plain", ["--max-seq-length", str(S)], True),
    "stats on strata": ("strata", ["--max-seq-length", str(S)], True),
    "check": ("plain", [*IDS, "--max-seq-length", str(S)], False),
    "check on strata": ("strata", [*IDS, "--max-seq-length", str(S)], False),
}


@pytest.mark.parametrize("fault", ["changed", "missing"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_each_step_refuses_a_changed_or_missing_input_shard_naming_it_and_its_list_and_writes_nothing(
        made, tmp_path, capsys, step, fault):
    which, args, writes = STEPS[step]
    d, victim = _damaged(made, tmp_path, which, fault)
    out = tmp_path / "out"
    assert main([step.split()[0], "--input", str(d), *(["--output", str(out)] if writes else []), *args]) == 2
    err = capsys.readouterr().err
    said = (f"{victim}: md5 " if fault == "changed" else f"{victim}: listed in {d / MANIFEST} but not there")
    assert said in err, err
    assert f"{d / MANIFEST}" in err, err
    # the steps with a run record check every input before they begin; check and stats as they read
    assert ("nothing written" in err) is (step in ("stratify", "shard", "eval") or fault == "missing"), err
    assert not out.exists()


@pytest.mark.parametrize("fault", ["changed", "missing"])
def test_check_refuses_an_eval_set_that_differs_from_its_list(made, tmp_path, capsys, fault):
    _, root = made
    ev = tmp_path / "eval"
    shutil.copytree(root / "eval", ev)
    victim = next(ev.glob("*.hdf5"))
    if fault == "changed":
        _change(victim)
    else:  # the list names a second file, gone
        (ev / MANIFEST).write_text((ev / MANIFEST).read_text() + f"{'0' * 32}  eval_gone.hdf5\n")
    assert main(["check", "--input", str(root / "plain"), *IDS, "--max-seq-length", str(S), "--eval", str(ev)]) == 2
    err = capsys.readouterr().err
    gone = ev / "eval_gone.hdf5"
    assert (f"{victim}: md5 " if fault == "changed" else f"{gone}: listed in {ev / MANIFEST} but not there") in err


def test_the_eval_step_given_one_file_checks_that_file_against_its_list(made, tmp_path, capsys):
    d, victim = _damaged(made, tmp_path, "plain", "changed")
    out = tmp_path / "out"
    assert main(["eval", "--input", str(victim), "--output", str(out), "--num-samples", "5"]) == 2
    assert f"{victim}: md5 " in capsys.readouterr().err and not out.exists()
    other = sorted(d.glob("*.hdf5"))[0]  # the same directory's other files are not its input
    assert main(["eval", "--input", str(other), "--output", str(out), "--num-samples", "5"]) == 0


def test_an_unlisted_shard_is_refused_as_a_run_refuses_it(made, tmp_path, capsys):
    _, root = made
    d = tmp_path / "plain"
    shutil.copytree(root / "plain", d)
    extra = d / "part_extra.hdf5"
    shutil.copy(sorted(d.glob("*.hdf5"))[0], extra)
    assert main(["stratify", "--input", str(d), "--output", str(tmp_path / "out"), "--max-seq-length", str(S)]) == 2
    assert f"{extra}: not listed in {d / MANIFEST}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["plain", "strata", "eval"])
def test_what_a_step_writes_verifies_as_written_and_lists_what_checksum_would(made, tmp_path, which):
    """shard, stratify and eval write their output's md5 list with it: the directory verifies
    the moment it exists, and its list is byte for byte the one ``checksum`` makes of it."""
    _, root = made
    d = root / which
    listed = (d / MANIFEST).read_text()
    assert verify(d)["verified"] == len(list(d.rglob("*.hdf5"))) == len(listed.splitlines())
    checksum(d, tmp_path / "again.txt")
    assert (tmp_path / "again.txt").read_text() == listed


def test_a_run_on_a_strata_directory_checks_it_as_written(made, tmp_path):
    """The list stratify wrote is the run's: a stratum file changed after stratify is refused
    by a run on the strata, naming it (the stratified road and the closed one)."""
    from bert import loader
    from bert.config import build_config
    from bert.shards import DataError
    from bert.trainer import train_plan

    d, victim = _damaged(made, tmp_path, "strata", "changed")
    for sampler in ({"run.division": "open", "sampler.mode": "stratified", "sampler.deal": "snake",
                     "sampler.group_size": 2}, {}):
        cfg = build_config({"data.train_dir": str(d), "data.max_seq_length": S, "model.max_position_embeddings": S,
                            "data.max_predictions_per_seq": P, "run.local_batch_size": 4, "model.vocab_size": V,
                            **sampler})
        with pytest.raises(DataError, match=rf"^{victim}: md5 [0-9a-f]{{32}}, but {d / MANIFEST} says"):
            stream = loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model,
                                          plan=train_plan(cfg, 2), seed=1, rank=0, world_size=2, read_timeout_s=10,
                                          prefetch=False)
            for _ in range(60):
                next(stream)


def test_a_read_that_hangs_is_named_after_the_steps_bound_and_nothing_is_written(made, tmp_path, monkeypatch):
    """A damaged file on which HDF5 spins: the step stops at --read-timeout-s naming the file
    (the setting named as the step's option), its output directory not left behind."""
    from bert import shards

    _, root = made
    release = threading.Event()
    decode = shards._structure_and_rows

    def spins(path, f, rows):
        if Path(path).name == sorted(p.name for p in (root / "plain").glob("*.hdf5"))[1]:
            release.wait(10)
        return decode(path, f, rows)

    monkeypatch.setattr(shards, "_structure_and_rows", spins)
    try:
        with pytest.raises(PrepError, match=r"part_00001_of_00004\.hdf5: reading took longer than "
                                            r"--read-timeout-s=0\.3 s"):
            stratify(root / "plain", tmp_path / "out", [24, 40, 64], max_seq_length=S, read_timeout_s=0.3)
    finally:
        release.set()
    assert not (tmp_path / "out").exists()


def test_bad_data_found_while_a_step_writes_leaves_no_partial_output(made, tmp_path):
    """A shard that verifies (no list) but breaks a rule further on: the step stops naming it,
    and the output it had begun is removed, not left half-made for a rerun to trip on."""
    layout, root = made
    d = tmp_path / "plain"
    shutil.copytree(root / "plain", d)
    (d / MANIFEST).unlink()
    victim = list_shards(d)[2]
    shard = read_shard(victim)
    shard.tokens[shard.offsets[3] + 1] = -5
    write_shard(victim, shard, layout, S, P)
    with pytest.raises(PrepError, match=rf"^{victim}: sample 3: "):
        stratify(d, tmp_path / "out", [24, 40, 64], max_seq_length=S, workers=1)
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()  # a directory that was there, empty: emptied again, kept
    with pytest.raises(PrepError, match=rf"^{victim}: sample 3: "):
        stratify(d, tmp_path / "empty", [24, 40, 64], max_seq_length=S, workers=1)
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_stats_checks_the_vocab_it_is_given(made, tmp_path, capsys):
    _, root = made
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"[unused{i}]\n" for i in range(50)).replace("[unused0]", "[PAD]")
                     .replace("[unused1]", "[UNK]").replace("[unused2]", "[CLS]").replace("[unused3]", "[SEP]")
                     .replace("[unused4]", "[MASK]"))
    assert main(["stats", "--input", str(root / "plain"), "--output", str(tmp_path / "st"), "--vocab", str(vocab),
                 "--max-seq-length", str(S)]) == 2
    assert "token id" in capsys.readouterr().err and not (tmp_path / "st").exists()
