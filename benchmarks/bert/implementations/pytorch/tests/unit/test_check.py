"""input_preprocessing check: clean shards pass in both layouts; each planted defect is
counted in its shard (and nowhere else) with a non-zero exit; NVIDIA's convert_fixed2variable
int8-sum wrap, reproduced here with the same Python sum() over the int8 mask, is named and
the rebuild with our `shard` step comes back clean."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from bert.shards import Sample, Shard, read_shard, write_shard
from input_preprocessing.__main__ import main
from input_preprocessing.check import DEFECTS, WRAP_SIGNATURE, Vocabulary, check

VOCAB = Vocabulary(size=200, cls=2, sep=3)
S, P = 512, 76


def _sample(rng: np.random.Generator, length: int) -> Sample:
    """[CLS] A [SEP] B [SEP] of ``length`` tokens with predictions on non-special positions."""
    a = int(rng.integers(1, length - 3)) if length > 4 else 1
    body = rng.integers(5, VOCAB.size, size=length)
    body[0], body[a + 1], body[length - 1] = VOCAB.cls, VOCAB.sep, VOCAB.sep
    seg = (np.arange(length) > a + 1).astype(np.int8)
    cand = np.setdiff1d(np.arange(1, length - 1), [a + 1])
    pos = np.sort(rng.choice(cand, size=min(P, max(1, round(length * 0.15))), replace=False))
    return Sample(body.astype(np.int16), seg, pos.astype(np.int16), body[pos].astype(np.int16), int(rng.integers(0, 2)))


def _clean(seed: int, n: int = 64) -> Shard:
    rng = np.random.default_rng(seed)
    # every length band the int8 wrap treats differently: <128, 128-255, 256-383, 384-511, 512
    lengths = [5, 60, 127, 128, 200, 255, 256, 300, 383, 384, 450, 511, 512]
    lengths += list(rng.integers(5, S + 1, size=n - len(lengths)))
    samples = [_sample(rng, int(x)) for x in lengths]
    # the reference's 10% random replacement can put [PAD], [CLS] or [SEP] at a masked
    # position (create found it in real text): that sample is clean
    s = samples[20]
    tok = np.array(s.input_ids)
    tok[s.masked_positions[:3]] = [0, VOCAB.cls, VOCAB.sep][:len(s.masked_positions[:3])]
    samples[20] = s._replace(input_ids=tok)
    return Shard.from_samples(samples)


def _replace(shard: Shard, i: int, **changes) -> Shard:
    samples = [shard[j] for j in range(len(shard))]
    samples[i] = samples[i]._replace(**changes)
    return Shard.from_samples(samples)


def test_clean_shards_pass_in_both_layouts(tmp_path):
    digests = {}
    for layout in ("fixed", "variable"):
        d = tmp_path / layout
        d.mkdir()
        for k in range(2):
            write_shard(d / f"part_{k}.hdf5", _clean(k), layout, S, P)
        out = check(d, VOCAB, digests=tmp_path / f"{layout}.md5")
        assert out["exit_status"] == 0 and out["defects"] == {} and out["samples"] == 128, out
        assert out["diagnosis"] == []
        digests[layout] = (tmp_path / f"{layout}.md5").read_text()
        assert digests[layout] == "".join(f"{out['per_shard'][f'part_{k}.hdf5']['examples_md5']}  part_{k}.hdf5\n"
                                          for k in range(2))
    assert digests["fixed"] == digests["variable"]  # the examples' digest, not the file's


def _plant(shard: Shard, defect: str) -> Shard:
    """One sample (index 7) given ``defect``; the others stay clean."""
    s = shard[7]
    tok, seg, pos, lab = (np.array(x) for x in (s.input_ids, s.segment_ids, s.masked_positions, s.masked_ids))
    if defect == "empty_sample":
        return _replace(shard, 7, input_ids=tok[:0], segment_ids=seg[:0], masked_positions=pos[:0], masked_ids=lab[:0])
    if defect == "too_long":
        return _replace(shard, 7, input_ids=np.concatenate([tok, tok]), segment_ids=np.concatenate([seg, seg]))
    if defect == "pad_inside":
        free = np.setdiff1d(np.arange(1, len(tok) - 1), np.concatenate([pos, np.nonzero(tok == VOCAB.sep)[0]]))
        tok[free[0]] = 0
        return _replace(shard, 7, input_ids=tok)
    if defect == "mask_outside":
        pos[-1] = len(tok) + 3
        return _replace(shard, 7, masked_positions=pos)
    if defect == "mask_on_special":
        last = len(tok) - 1
        return _replace(shard, 7, masked_positions=np.append(pos, last), masked_ids=np.append(lab, tok[last]))
    if defect == "mask_on_sep":  # sentence A's [SEP] predicted (a label that is not [SEP]: told by the segments)
        a_sep = int(np.argmax(seg != 0)) - 1
        order = np.argsort(np.append(pos, a_sep), kind="stable")
        return _replace(shard, 7, masked_positions=np.append(pos, a_sep)[order], masked_ids=np.append(lab, 7)[order])
    if defect == "mask_duplicate":
        return _replace(shard, 7, masked_positions=np.append(pos, pos[0]), masked_ids=np.append(lab, lab[0]))
    if defect == "no_predictions":
        return _replace(shard, 7, masked_positions=pos[:0], masked_ids=lab[:0])
    if defect == "id_out_of_vocab":
        lab[0] = VOCAB.size + 5
        return _replace(shard, 7, masked_ids=lab)
    if defect == "bad_segments":
        seg[1] = 1  # a 1 inside segment A, then back to 0
        return _replace(shard, 7, segment_ids=seg)
    if defect == "bad_nsp_label":
        return _replace(shard, 7, nsp_label=2)
    raise AssertionError(defect)


PLANTABLE = [d for d in DEFECTS if d not in ("mask_not_prefix", "unreadable")]


@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_each_planted_defect_is_counted_in_its_shard(tmp_path, layout):
    d = tmp_path / layout
    d.mkdir()
    write_shard(d / "clean.hdf5", _clean(0), layout, S, P)
    for defect in PLANTABLE:
        if layout == "fixed" and defect == "too_long":
            continue  # a fixed row cannot hold more than S tokens
        write_shard(d / f"{defect}.hdf5", _plant(_clean(0), defect), layout, 2 * S, P + 1)
    if layout == "fixed":  # a hole in input_mask: only the fixed layout has one
        write_shard(d / "mask_not_prefix.hdf5", _clean(0), layout, S, P)
        with h5py.File(d / "mask_not_prefix.hdf5", "r+") as f:
            m = f["input_mask"][()]
            m[7, 2] = 0
            f["input_mask"][...] = m
    (d / "unreadable.hdf5").write_bytes(b"not hdf5")
    out = check(d, VOCAB)
    assert out["exit_status"] == 1
    # every planted shard is clean.hdf5 with sample 7 changed: its other samples of 32 tokens
    # or more are copies of the first shard's (in name order) that holds them
    long = int((np.delete(_clean(0).lengths, 7) >= 32).sum())
    readable = sorted(n for n in out["per_shard"] if n != "unreadable.hdf5")
    assert {n: c.pop("repeated_samples", 0) for n, c in out["per_shard"].items()} == \
        {n: 0 if n in (readable[0], "unreadable.hdf5") else long for n in out["per_shard"]}
    assert out["copies"]["repeated_samples"] == long * (len(readable) - 1) == out["defects"]["repeated_sample"]
    assert set(out["per_shard"]["clean.hdf5"]) == {"samples", "examples_md5"}
    for defect in DEFECTS:
        name = f"{defect}.hdf5"
        if name not in out["per_shard"]:
            continue
        got = out["per_shard"][name]
        assert got.get(defect) == 1, (defect, got)
        if defect != "unreadable":  # each defect counted names its first sample, in the file's words
            assert set(got["messages"]) == set(got) - {"samples", "examples_md5", "messages"}, got
            assert got["messages"][defect].startswith(f"{d / name}: "), got
            assert "sample 7" in got["messages"][defect], got
    assert out["per_shard"]["unreadable.hdf5"]["error"].startswith(f"{d / 'unreadable.hdf5'}: cannot open as hdf5")
    # side effects that follow from the definitions, no more: a hole in the mask also puts
    # an extra token in the row; a duplicate/extra prediction does not touch the tokens
    for defect in ("mask_duplicate", "bad_nsp_label", "id_out_of_vocab"):
        assert set(out["per_shard"][f"{defect}.hdf5"]) == {"samples", "examples_md5", defect, "messages"}
    # every change to a sample changes its shard's examples_md5
    digests = [c["examples_md5"] for c in out["per_shard"].values() if "examples_md5" in c]
    assert len(set(digests)) == len(digests) == len(out["per_shard"]) - 1
    assert out["diagnosis"] and "vocab" in out["diagnosis"][0]


def _nvidia_fixed2variable(src, dst) -> None:
    """What NVIDIA's convert_fixed2variable.py does to each row, with its Python sum() over the
    int8 mask row: under NumPy >= 2 the sum is int8 and wraps (the bug under test)."""
    with h5py.File(src) as f:
        data = {k: f[k][()] for k in f}
    n = len(data["next_sentence_labels"])
    with np.errstate(over="ignore"):
        lens = [sum(data["input_mask"][i]) for i in range(n)]
        plens = [sum(data["masked_lm_positions"][i] != 0) for i in range(n)]
    with h5py.File(dst, "w") as f:
        for k, dt in (("input_ids", np.int16), ("segment_ids", np.int8)):
            rows = np.empty(n, object)
            rows[:] = [data[k][i][:lens[i]].astype(dt) for i in range(n)]
            f.create_dataset(k, shape=(n,), dtype=h5py.vlen_dtype(dt), data=rows)
        for k in ("masked_lm_positions", "masked_lm_ids"):
            rows = np.empty(n, object)
            rows[:] = [data[k][i][:plens[i]].astype(np.int16) for i in range(n)]
            f.create_dataset(k, shape=(n,), dtype=h5py.vlen_dtype(np.int16), data=rows)
        f.create_dataset("next_sentence_labels", data=data["next_sentence_labels"])


def test_convert_fixed2variable_int8_wrap_is_named_and_our_rebuild_is_clean(tmp_path, capsys):
    fixed, broken, rebuilt = tmp_path / "fixed", tmp_path / "broken", tmp_path / "rebuilt"
    fixed.mkdir(), broken.mkdir()
    shard = _clean(3)
    write_shard(fixed / "part_0.hdf5", shard, "fixed", S, P)
    _nvidia_fixed2variable(fixed / "part_0.hdf5", broken / "part_0.hdf5")
    true = shard.lengths
    with h5py.File(broken / "part_0.hdf5") as f:
        got = np.array([len(r) for r in f["input_ids"][()]])
    # the wrap as documented: +256 for 128-255, -256 for 256-383, 512 -> 0, others intact
    assert np.array_equal(got, np.where((true >= 128) & (true < 256), true + 256,
                                        np.where((true >= 256) & (true < 384), true - 256, true % 512)))
    assert main(["check", "--input", str(broken), "--vocab-size", "200", "--cls-id", "2", "--sep-id", "3"]) == 1
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    band = lambda lo, hi: int(((true >= lo) & (true <= hi)).sum())  # noqa: E731
    assert out["per_shard"]["part_0.hdf5"][WRAP_SIGNATURE] == band(128, 255)
    assert out["defects"]["pad_inside"] == band(128, 255)
    assert out["defects"]["empty_sample"] == band(512, 512) + band(256, 256)  # L-256 = 0 at 256
    assert out["defects"]["bad_segments"] >= band(128, 255) + band(257, 383)  # cut or padded: not [CLS] A [SEP] B [SEP]
    assert "convert_fixed2variable.py" in cap.err and "NumPy >= 2" in cap.err
    assert "python -m input_preprocessing shard --input FIXED_DIR" in cap.err and "--layout variable" in cap.err
    assert main(["shard", "--input", str(fixed), "--output", str(rebuilt), "--num-shards", "1",
                 "--layout", "variable", "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["check", "--input", str(rebuilt), "--vocab-size", "200", "--cls-id", "2", "--sep-id", "3"]) == 0
    assert np.array_equal(read_shard(next(rebuilt.glob("*.hdf5"))).lengths, true)


def test_shards_of_another_vocabulary_are_named_not_counted_as_defects(tmp_path, capsys):
    """Without --vocab the check assumes MLPerf's [CLS]=101/[SEP]=102: on shards made with
    another vocab (here [CLS]=2, [SEP]=3) it says so and asks for --vocab instead of counting
    every sample as bad_segments; with the right ids the same shards are clean, and a real
    defect is still counted under the wrong ids."""
    d = tmp_path / "other"
    d.mkdir()
    write_shard(d / "part_0.hdf5", _clean(5), "variable", S, P)
    assert main(["check", "--input", str(d), "--per-shard"]) == 2
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert "bad_segments" not in out["defects"] and "mask_on_special" not in out["defects"]
    assert "bad_segments" not in out["per_shard"]["part_0.hdf5"]
    assert "another vocabulary" in cap.err and "--vocab" in cap.err and "[CLS] (id 101)" in cap.err
    assert main(["check", "--input", str(d), "--vocab-size", "200", "--cls-id", "2", "--sep-id", "3"]) == 0
    capsys.readouterr()
    # vocab-independent defects are still counted (and reported) when the ids do not fit
    broken = tmp_path / "broken"
    broken.mkdir()
    shard = _clean(5)
    write_shard(broken / "part_0.hdf5", _replace(shard, 7, nsp_label=5), "variable", S, P)
    out = check(broken)
    assert out["defects"] == {"bad_nsp_label": 1} and out["exit_status"] == 2 and "other_vocabulary" in out
    # shards of MLPerf's ids (one sample mangled) are not mistaken for another vocabulary
    assert "other_vocabulary" not in check(broken, VOCAB)


def _run_refusal(train_dir, road: str) -> str:
    """What a run on ``train_dir`` refuses, in its words: the closed road reads the shard whole
    for its first batch; a deal reads every shard for its length index at start-up."""
    from bert import loader
    from bert.config import build_config
    from bert.shards import DataError
    from bert.trainer import train_plan

    cfg = build_config({"data.train_dir": str(train_dir), "data.max_seq_length": S, "model.max_position_embeddings": S,
                        "data.max_predictions_per_seq": P, "run.local_batch_size": 4, "model.vocab_size": VOCAB.size,
                        **({} if road == "closed" else {"run.division": "open", "sampler.deal": "snake",
                                                        "sampler.group_size": 2})})
    with pytest.raises(DataError) as err:
        stream = loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, 2),
                                      seed=1, rank=0, world_size=2, read_timeout_s=10, prefetch=False)
        for _ in range(40):
            next(stream)
    return str(err.value)


RUN_REFUSES = ["mask_not_prefix", "seg_rows", "empty_sample", "too_long", "mask_outside", "mask_on_sep",
               "bad_nsp_label", "id_out_of_vocab"]


@pytest.mark.parametrize("road", ["closed", "deal"])
@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_check_and_the_run_report_the_same_defect_of_the_same_shard_in_the_same_words(tmp_path, layout, road):
    """The one decoder: for each defect a run refuses, a run on the shard raises the message
    that check gives as that shard's first offender of it (the bound's name aside: the run's
    config key, check's vocab); in both layouts, on both of the run's roads (whole shards, and
    every shard read at start-up for a length index)."""
    for defect in RUN_REFUSES:
        if (defect, layout) in (("mask_not_prefix", "variable"), ("seg_rows", "fixed")):
            continue  # a layout that cannot hold it
        d = tmp_path / f"{defect}_{layout}"
        d.mkdir()
        shard = d / "part_0.hdf5"
        if defect == "mask_not_prefix":
            write_shard(shard, _clean(0), layout, S, P)
            with h5py.File(shard, "r+") as f:
                m = f["input_mask"][()]
                m[7, 2] = 0
                f["input_mask"][...] = m
        elif defect == "seg_rows":
            write_shard(shard, _clean(0), layout, S, P)
            with h5py.File(shard, "r+") as f:
                f["segment_ids"][7] = np.zeros(3, np.int8)
        else:
            write_shard(shard, _plant(_clean(0), defect), layout, 2 * S, P + 1)
        counted = "bad_segments" if defect == "seg_rows" else defect
        said = check(d, VOCAB)["per_shard"]["part_0.hdf5"]["messages"][counted]
        assert said.startswith(f"{shard}: sample 7") or said.startswith(f"{shard}: 'input_mask' of sample 7"), said
        assert _run_refusal(d, road) == said.replace(VOCAB.bounds().vocab_key, "model.vocab_size"), defect
