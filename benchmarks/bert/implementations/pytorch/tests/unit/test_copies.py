"""Copies in the data (input_preprocessing/copies.py, check's copies and --eval): the keys and the
repeat counting on hand-made arrays, then each copy planted in the demo data or real text and
named by check, and the clean demo data and real text passing without a false alarm."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from bert.shards import Shard, list_shards, read_shard, write_shard
from copies_helpers import DEMO_IDS, make_demo, real_text
from input_preprocessing import copies
from input_preprocessing.__main__ import main
from input_preprocessing.check import Vocabulary, check
from input_preprocessing.create import CreateOptions, create
from input_preprocessing.pick_eval import pick_eval

DEMO_VOCAB = Vocabulary(128, 2, 3, 1)


# ---------------------------------------------------------------- the pure functions


def test_restored_tokens_put_each_label_back_at_its_position():
    tokens = np.array([2, 4, 9, 3, 4, 3, 2, 8, 3, 4, 3])  # two samples, [MASK]=4 at three positions
    offsets = np.array([0, 6, 11])
    positions, labels, poffsets = np.array([1, 4, 3]), np.array([7, 5, 6]), np.array([0, 2, 3])
    got = copies.restored_tokens(tokens, offsets, positions, labels, poffsets)
    assert got.tolist() == [2, 7, 9, 3, 5, 3, 2, 8, 3, 6, 3]
    assert tokens[1] == 4  # the input is left as it was
    # a position outside its sample (a defect check counts) is left out, not written elsewhere
    got = copies.restored_tokens(tokens, offsets, np.array([1, 9, 3]), labels, poffsets)
    assert got.tolist() == [2, 7, 9, 3, 4, 3, 2, 8, 3, 6, 3]


def _shard(samples: list[tuple[list[int], list[int]]], nsp: int = 0) -> Shard:
    """Samples given as (restored tokens, masked positions); masked positions hold [MASK] (4)."""
    from bert.shards import Sample

    out = []
    for toks, pos in samples:
        t = np.array(toks, np.int16)
        labels = t[pos].copy()
        t[pos] = 4
        sep = len(toks) // 2
        out.append(Sample(t, (np.arange(len(toks)) > sep).astype(np.int8), np.array(pos, np.int16), labels, nsp))
    return Shard.from_samples(out)


def _keys(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    records, starts = copies.example_records(shard.tokens, shard.segments, shard.offsets, shard.mlm_positions,
                                             shard.mlm_ids, shard.mlm_offsets, shard.nsp)
    text = copies.restored_tokens(shard.tokens, shard.offsets, shard.mlm_positions, shard.mlm_ids, shard.mlm_offsets)
    return copies.example_keys(records, starts, shard.lengths), copies.text_keys(text, shard.offsets)


def test_the_same_text_masked_otherwise_is_one_text_and_two_examples():
    """The dupe factor's case: the same sentences with other masks are not a copy, but they
    are the same text (an eval sample made from training text is found either way)."""
    text = [2] + list(range(10, 50)) + [3]
    shard = _shard([(text, [3, 9]), (text, [4, 20]), (text, [3, 9]), (text[:20], [5])])
    ex, tx = _keys(shard)
    assert ex[0] != ex[1] and ex[0] == ex[2]
    assert tx[0] == tx[1] == tx[2] != tx[3]
    assert copies.is_long(ex).tolist() == [True, True, True, False]  # 42 tokens, and 20 < 32
    assert copies.is_long(tx).tolist() == [True, True, True, False]
    # another next-sentence label makes another example, not another text
    other = _shard([(text, [3, 9])], nsp=1)
    assert _keys(other)[0][0] != ex[0] and _keys(other)[1][0] == tx[0]


def _records_as_keys(keys: list[np.ndarray]):
    """Records standing for samples whose record is their key (two int32 each): a repeat of a
    key is a repeat of the record."""
    return lambda i: (keys[i].view("<i4"), np.arange(0, 2 * len(keys[i]) + 1, 2))


def test_a_shared_key_is_a_repeat_only_where_the_records_are_the_same():
    """Two different samples forced onto one key (a collision of the 64-bit key): not a repeat,
    counted apart; a real repeat among such samples is still found, of the right sample."""
    sizes = [3, 3]
    keys = [np.array([10, 21, 31], np.uint64) << np.uint64(1) | np.uint64(1) for _ in sizes]
    keys[1][:] = [keys[0][0], keys[0][0], keys[0][2]]  # shard 1: rows 0 and 1 share shard 0 row 0's key
    records = [np.arange(6, dtype="<i4"), np.array([7, 7, 7, 7, 4, 5], "<i4")]  # two int32 a sample
    # shard 1 rows 0 and 1 hold the same record (7, 7), not shard 0 row 0's (0, 1); row 2 repeats shard 0 row 2
    table = copies.KeyTable(sizes)
    for i in range(2):
        table.put(i, keys[i])
    rep = table.repeats(lambda i: (records[i], np.arange(0, 7, 2)))
    assert rep.collisions == 2 and rep.copies == 2 and rep.short == 0
    assert {k: (v.samples, v.rows) for k, v in rep.pairs.items()} == {(0, 1): (1, [(2, 2)]), (1, 1): (1, [(0, 1)])}
    assert rep.per_shard.tolist() == [0, 2]


def test_repeats_are_counted_per_pair_of_shards_with_rows_and_short_ones_apart():
    rng = np.random.default_rng(0)
    sizes = [6, 5, 4, 3]
    keys = [rng.integers(0, 2**63, size=n, dtype=np.uint64) << np.uint64(1) | np.uint64(1) for n in sizes]
    keys[1][2] = keys[0][4]  # shard 1 row 2 repeats shard 0 row 4
    keys[2][0] = keys[0][4]  # and shard 2 row 0 too: both count against the first occurrence
    keys[1][4] = keys[1][0]  # within shard 1
    short = keys[0][1] & ~np.uint64(1)
    keys[0][1] = keys[2][3] = short  # a short sample twice: counted apart
    keys[3][:] = keys[0][:3]  # shard 3 is unreadable: its keys never go in
    table = copies.KeyTable(sizes)
    for i in range(3):
        table.put(i, keys[i])
    table.put(3, keys[3][:2])  # a count that differs from the listed size is refused too
    rep = table.repeats(_records_as_keys(keys))
    assert rep.copies == 3 and rep.short == 1 and rep.collisions == 0
    assert {k: (v.samples, v.rows) for k, v in rep.pairs.items()} == {
        (0, 1): (1, [(4, 2)]), (0, 2): (1, [(4, 0)]), (1, 1): (1, [(0, 4)])}
    assert rep.per_shard.tolist() == [0, 2, 1, 0]


def test_repeats_over_every_partition_of_the_key_range():
    """Keys spread over the whole 64-bit range, so every partition holds some repeats: each is
    found once, whichever partition sorts it."""
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64 - 1, size=8000, dtype=np.uint64, endpoint=True) | np.uint64(1)
    dup = rng.choice(4000, size=1500, replace=False)
    keys[4000 + dup] = keys[dup]  # the second shard repeats 1,500 samples of the first
    table = copies.KeyTable([4000, 4000])
    table.put(0, keys[:4000])
    table.put(1, keys[4000:])
    rep = table.repeats(_records_as_keys([keys[:4000], keys[4000:]]))
    bits = np.uint64(64 - int(np.log2(copies.PARTITIONS)))
    assert {int(k >> bits) for k in keys[dup]} == set(range(copies.PARTITIONS))
    assert rep.copies == 1500 and rep.pairs[(0, 1)].samples == 1500 and rep.short == 0
    assert all(r[0] == r[1] for r in rep.pairs[(0, 1)].rows)  # shard 1 row i repeats shard 0 row i


def test_same_digest_groups_keep_the_order_of_the_names():
    assert copies.same_digest_groups({"a": "1", "b": "2", "c": "1", "d": "3", "e": "1", "f": "2"}) == \
        [["a", "c", "e"], ["b", "f"]]
    assert copies.same_digest_groups({"a": "1"}) == []


# ---------------------------------------------------------------- check on planted copies


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo"))


def test_the_clean_demo_data_has_no_copy_and_no_eval_sample_in_training(demo):
    out = check(demo.train, DEMO_VOCAB, eval_dir=demo.eval)
    assert out["exit_status"] == 0 and out["errors"] == [] and out["diagnosis"] == [], out["errors"]
    assert out["copies"]["identical_shards"] == [] and out["copies"]["repeated_samples"] == 0
    assert out["eval"]["in_training"] == 0 and out["eval"]["eval_samples"] == 2000
    # the demo's chains of 123 tokens meet by chance in short samples: counted, not judged
    assert out["copies"]["short_repeats"] > 0 and out["eval"]["short_matches"] > 0
    assert out["unk_rate"] == 0.0


def test_a_shard_replaced_by_a_copy_of_another_is_named_with_the_known_cause(demo, tmp_path):
    d = demo.copy(tmp_path / "d")
    shutil.copy(d.train / "part_00000_of_00008.hdf5", d.train / "part_00001_of_00008.hdf5")
    out = check(d.train, DEMO_VOCAB)
    assert out["exit_status"] == 1
    md5 = out["per_shard"]["part_00000_of_00008.hdf5"]["examples_md5"]
    assert out["errors"] == [f"part_00001_of_00008.hdf5 holds the same examples as part_00000_of_00008.hdf5 "
                             f"(examples_md5 {md5})"]
    assert out["copies"]["identical_shards"] == [["part_00000_of_00008.hdf5", "part_00001_of_00008.hdf5"]]
    assert out["per_shard"]["part_00001_of_00008.hdf5"]["copy_of"] == "part_00000_of_00008.hdf5"
    long = int((read_shard(d.train / "part_00000_of_00008.hdf5").lengths >= copies.MIN_COPY_TOKENS).sum())
    assert out["defects"] == {"identical_shard": 1, "repeated_sample": long}
    (why,) = out["diagnosis"]
    assert why.startswith("whole shards repeat") and "shuffle_samples.py" in why and "0.62-0.63" in why
    assert "mlcommons/training_results_v2.1 issue 10" in why and "mlcommons/training issue 659" in why


def test_every_shard_the_same_is_said_so(demo, tmp_path):
    d = demo.copy(tmp_path / "d")
    for p in list_shards(d.train)[1:]:
        shutil.copy(d.train / "part_00000_of_00008.hdf5", p)
    out = check(d.train, DEMO_VOCAB)
    assert out["exit_status"] == 1 and out["defects"]["identical_shard"] == 7
    assert out["errors"][0].startswith("7 shards hold the same examples as part_00000_of_00008.hdf5")
    assert "part_00005_of_00008.hdf5 and 2 more" in out["errors"][0]
    assert out["diagnosis"][0].startswith("every shard holds the same examples")


def test_samples_copied_into_another_shard_are_counted_for_that_pair_with_rows(demo, tmp_path):
    """A re-chop that wrote 300 samples of one shard into another (and 5 twice into itself)."""
    d = demo.copy(tmp_path / "d")
    a, b = (d.train / f"part_0000{i}_of_00008.hdf5" for i in (2, 5))
    src, dst = read_shard(a), read_shard(b)
    long = np.flatnonzero(src.lengths >= copies.MIN_COPY_TOKENS)[:300]
    rows = np.arange(len(dst))
    rows[1000:1300] = -1
    mixed = Shard.concat([dst.subset(rows[:1000]), src.subset(long), dst.subset(rows[1300:])])
    own = np.flatnonzero(mixed.lengths >= copies.MIN_COPY_TOKENS)[:5]
    mixed = Shard.concat([mixed, mixed.subset(own)])
    write_shard(b, mixed, "variable", 128, 20)
    out = check(d.train, DEMO_VOCAB)
    assert out["exit_status"] == 1 and out["defects"] == {"repeated_sample": 305}
    pairs = {tuple(p["shards"]): p for p in out["copies"]["pairs"]}
    assert pairs[("part_00002_of_00008.hdf5", "part_00005_of_00008.hdf5")]["samples"] == 300
    assert pairs[("part_00002_of_00008.hdf5", "part_00005_of_00008.hdf5")]["rows"][0] in \
        [[int(r), 1000 + i] for i, r in enumerate(long)]
    assert pairs[("part_00005_of_00008.hdf5", "part_00005_of_00008.hdf5")]["samples"] == 5
    (line,) = out["errors"]
    head = ("305 samples repeat an earlier sample beyond whole-shard copies (2 pair(s) of shards): "
            "part_00005_of_00008.hdf5 repeats part_00002_of_00008.hdf5: 300 (e.g. its sample ")
    assert line.startswith(head)
    b_row, a_row = re.match(r"(\d+) = sample (\d+)\)", line[len(head):]).groups()
    assert [int(a_row), int(b_row)] in [[int(r), 1000 + i] for i, r in enumerate(long)]
    assert "; within part_00005_of_00008.hdf5: 5 (e.g. its sample 25" in line
    assert out["diagnosis"][0].startswith("samples repeat across shards")


def test_the_eval_shard_copied_among_the_training_shards_is_found(demo, tmp_path):
    d = demo.copy(tmp_path / "d")
    shutil.copy(d.eval / "eval_00000.hdf5", d.train / "part_00008_of_00008.hdf5")
    out = check(d.train, DEMO_VOCAB, eval_dir=d.eval)
    long = int((read_shard(d.eval / "eval_00000.hdf5").lengths >= copies.MIN_COPY_TOKENS).sum())
    assert out["exit_status"] == 1 and out["defects"] == {"eval_in_training": long}
    assert out["eval"]["training_shards"] == {"part_00008_of_00008.hdf5": long}
    assert out["errors"][0] == ("part_00008_of_00008.hdf5 holds the same examples as the eval set's eval_00000.hdf5: "
                                "a copy of the eval set among the training shards")
    assert out["errors"][1].startswith(f"{long} of the 2000 eval samples in {d.eval} are in the training shards")
    assert "held by part_00008_of_00008.hdf5 (" in out["errors"][1]
    assert "eval samples inside the training set" in out["diagnosis"][0]
    # without --eval the ninth shard is no copy of a training shard: nothing to say
    assert check(d.train, DEMO_VOCAB)["exit_status"] == 0


def test_two_different_samples_forced_onto_one_key_are_not_called_repeats(demo, tmp_path, monkeypatch):
    """The 64-bit keys made to collide: a training sample given another's example key, an eval
    sample's text given a training sample's text key, and a copy of the first sample planted
    elsewhere. check confirms every match by the records: the two different samples are no
    repeat and the eval sample is not in training (each counted as a key collision), and the
    planted copy is still found, as a repeat of the sample it copies."""
    d = demo.copy(tmp_path / "d")
    a, b, c = (d.train / f"part_0000{i}_of_00008.hdf5" for i in (0, 3, 5))
    x, y = read_shard(a), read_shard(b)
    i, j = (int(np.flatnonzero(s.lengths >= copies.MIN_COPY_TOKENS)[0]) for s in (x, y))
    dst = read_shard(c)
    write_shard(c, Shard.concat([dst, y.subset([j])]), "variable", 128, 20)  # a real copy of y's sample j
    kx, ky = (_keys(s.subset([r]))[0][0] for s, r in ((x, i), (y, j)))
    ev = read_shard(d.eval / "eval_00000.hdf5")
    ke, kt = _keys(ev.subset([0]))[1][0], _keys(x.subset([i]))[1][0]
    assert len({kx, ky}) == 2 and len({ke, kt}) == 2
    forced = {int(ky): kx, int(ke): kt}
    real = copies._keys

    def colliding(data, bounds, long):
        keys = real(data, bounds, long)
        for k, to in forced.items():
            keys[keys == np.uint64(k)] = to
        return keys

    monkeypatch.setattr(copies, "_keys", colliding)
    out = check(d.train, DEMO_VOCAB, eval_dir=d.eval)
    assert out["copies"]["key_collisions"] == 2  # y's sample and its copy share x's key, not its record
    assert out["copies"]["repeated_samples"] == 1 and out["defects"] == {"repeated_sample": 1}
    assert [(p["shards"], p["rows"]) for p in out["copies"]["pairs"]] == \
        [(["part_00003_of_00008.hdf5", "part_00005_of_00008.hdf5"], [[j, len(dst)]])]
    assert out["eval"]["in_training"] == 0 and out["eval"]["key_collisions"] == 1
    monkeypatch.setattr(copies, "_keys", real)
    assert check(d.train, DEMO_VOCAB, eval_dir=d.eval)["copies"]["key_collisions"] == 0


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return real_text(tmp_path_factory.mktemp("text"))


SMALL = CreateOptions(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=5)


def test_real_text_made_into_shards_and_an_eval_set_raises_no_false_alarm(text, tmp_path):
    create(text.text, text.vocab, tmp_path / "train", SMALL)
    create(text.held_out, text.vocab, tmp_path / "held", SMALL)
    pick_eval(tmp_path / "held", tmp_path / "eval", 300)
    vocab = Vocabulary.from_file(text.vocab)
    out = check(tmp_path / "train", vocab, eval_dir=tmp_path / "eval")
    assert out["exit_status"] == 0 and out["errors"] == [] and out["diagnosis"] == [], out["errors"]
    assert out["copies"]["repeated_samples"] == 0 and out["unk_rate"] == 0.0 and out["samples"] > 3000
    # docstrings that share a passage put its text on both sides: a note, at most 1% of the set
    assert out["eval"]["in_training"] <= 3 and len(out["notes"]) == (out["eval"]["in_training"] > 0)


def test_held_out_text_also_given_as_a_training_part_is_found_under_other_masks(text, tmp_path):
    """The eval set made from a training part's text with another seed: other examples (other
    masks and pairs), the same text in many samples, all in that part's shard.

    A passage two docstrings share is a leak too, and check names it: asyncio's
    StreamReader.read and readexactly end with the same two sentences, one in each of two
    parts, and an eval sample made of those two is, token for token, a training sample of the
    other part as well (whether create cuts such a sample depends on the token counts, so on
    the vocab). The model trains on that text whichever part it came from. This test is about
    one part given twice, so the other parts keep none of its sentences."""
    parts = sorted(text.text.iterdir())
    part = parts[1]
    given = set(part.read_text().splitlines()) - {""}
    train = tmp_path / "text"
    train.mkdir()
    for p in parts:
        lines = p.read_text().splitlines()
        (train / p.name).write_text("\n".join(ln for ln in lines if p == part or ln not in given) + "\n")
    create(train, text.vocab, tmp_path / "train", SMALL)
    create(train, text.vocab, tmp_path / "held", CreateOptions(**{**SMALL.__dict__, "seed": 7}), pattern=part.name)
    pick_eval(tmp_path / "held", tmp_path / "eval", 400)
    out = check(tmp_path / "train", Vocabulary.from_file(text.vocab), eval_dir=tmp_path / "eval")
    assert out["exit_status"] == 1 and out["copies"]["repeated_samples"] == 0  # no example is a copy
    assert 0 < out["eval"]["in_training"] < 400
    assert list(out["eval"]["training_shards"]) == [part.stem + ".hdf5"]
    assert "eval samples in" in out["errors"][0] and f"held by {part.stem}.hdf5" in out["errors"][0]


def test_the_cli_prints_a_summary_and_every_shard_on_request(demo, tmp_path, capsys):
    d = demo.copy(tmp_path / "d")
    shutil.copy(d.train / "part_00003_of_00008.hdf5", d.train / "part_00006_of_00008.hdf5")
    assert main(["check", "--input", str(d.train), *DEMO_IDS]) == 1
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert list(out["per_shard"]) == ["part_00006_of_00008.hdf5"] and out["shards_with_findings"] == 1
    assert "errors" not in out and "diagnosis" not in out
    assert cap.err.startswith(f"error: {d.train}: part_00006_of_00008.hdf5 holds the same examples as "
                              "part_00003_of_00008.hdf5 (examples_md5 ")
    assert "\ndiagnosis: whole shards repeat" in cap.err
    assert main(["check", "--input", str(d.train), *DEMO_IDS, "--per-shard"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert len(out["per_shard"]) == 8 and all("examples_md5" in c for c in out["per_shard"].values())


def test_check_and_stats_report_the_unk_rate(demo, tmp_path, capsys):
    """[UNK] planted as the original token of every masked position of one shard: the rate
    counts the text (labels), not the masks."""
    d = demo.copy(tmp_path / "d")
    p = d.train / "part_00004_of_00008.hdf5"
    s = read_shard(p)
    s.mlm_ids[:] = 1
    write_shard(p, s, "variable", 128, 20)
    total = sum(len(read_shard(q).tokens) for q in list_shards(d.train))
    out = check(d.train, DEMO_VOCAB)
    assert out["unk_rate"] == round(len(s.mlm_ids) / total, 6) > 0.01
    assert any("of the tokens are [UNK]" in line and "cased/uncased" in line for line in out["diagnosis"])
    assert out["exit_status"] == 0  # reported, not judged
    assert main(["stats", "--input", str(d.train), "--output", str(tmp_path / "s"), "--unk-id", "1",
                 "--max-seq-length", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["unk_rate"] == out["unk_rate"]


def test_a_few_eval_samples_in_training_are_a_note_and_more_than_the_tolerance_an_error(demo, tmp_path):
    """A corpus that holds a passage twice puts a few eval samples' text in training without
    any leak: a note under --eval-tolerance (1% of the eval set), an error above it."""
    d = demo.copy(tmp_path / "d")
    ev = read_shard(d.eval / "eval_00000.hdf5")
    long = np.flatnonzero(ev.lengths >= copies.MIN_COPY_TOKENS)
    target = d.train / "part_00003_of_00008.hdf5"
    own = read_shard(target)
    write_shard(target, Shard.concat([own, ev.subset(long[:15])]), "variable", 128, 20)
    out = check(d.train, DEMO_VOCAB, eval_dir=d.eval)
    assert out["exit_status"] == 0 and out["errors"] == [] and out["eval"]["in_training"] == 15
    assert out["diagnosis"] == []  # no known cause to name for a note
    (note,) = out["notes"]
    assert note.startswith(f"15 of the 2000 eval samples in {d.eval} are in the training shards")
    assert "0.75% of the eval set, within --eval-tolerance 0.01" in note and "not a leak" in note
    assert check(d.train, DEMO_VOCAB, eval_dir=d.eval, eval_tolerance=0.005)["exit_status"] == 1
    write_shard(target, Shard.concat([own, ev.subset(long[:25])]), "variable", 128, 20)
    out = check(d.train, DEMO_VOCAB, eval_dir=d.eval)
    assert out["exit_status"] == 1 and out["defects"] == {"eval_in_training": 25} and out["notes"] == []
    assert out["errors"][0].startswith("25 of the 2000 eval samples")
