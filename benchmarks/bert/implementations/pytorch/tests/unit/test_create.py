"""create: schema, the masking and NSP rules checked against the source text, determinism
across worker counts, resumption, and the errors on bad input."""

from __future__ import annotations

import hashlib
import re
import shutil

import h5py
import numpy as np
import pytest
import torch

from bert.config import ModelConfig
from bert.config import build_config
from bert.loader import EvalSet, train_batches
from bert.trainer import train_plan
from bert.model import BertForPreTraining, pretraining_loss
from bert.shards import list_shards, read_shard
from input_preprocessing.checksum import verify
from input_preprocessing.common import PrepError
from input_preprocessing.create import CreateOptions, create, load_vocab
from create_helpers import OPTS, _digests, corpus, created  # noqa: F401 - fixtures: corpus, created


def test_schema_and_dtypes_in_both_layouts(corpus, created, tmp_path):
    root, parts, vocab = corpus
    out, summary = created
    assert summary["parts"] == 3 and summary["samples_written_now"] > 500
    assert [p.name for p in list_shards(out)] == [p.stem + ".hdf5" for p in parts]
    var = tmp_path / "var"
    create(root / "text", vocab, var, CreateOptions(**{**OPTS.__dict__, "layout": "variable"}), workers=1)
    for p in list_shards(out):
        with h5py.File(p) as f:
            n = f["next_sentence_labels"].shape[0]
            want = {"input_ids": ("int16", (n, 128)), "input_mask": ("int8", (n, 128)),
                    "segment_ids": ("int8", (n, 128)), "masked_lm_positions": ("int16", (n, 20)),
                    "masked_lm_ids": ("int16", (n, 20)), "next_sentence_labels": ("int8", (n,))}
            assert {k: (str(f[k].dtype), f[k].shape) for k in f} == want
        with h5py.File(var / p.name) as f:
            assert set(f) == {"input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                              "next_sentence_labels"}
            for k in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
                assert f[k].ndim == 1 and h5py.check_vlen_dtype(f[k].dtype) is not None
        a, b = read_shard(p, 128), read_shard(var / p.name, 128)  # the same samples either way
        for name in ("tokens", "segments", "offsets", "mlm_positions", "mlm_ids", "mlm_offsets", "nsp"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_the_spine_reader_trains_on_the_output(created):
    out, _ = created
    cfg = ModelConfig(vocab_size=1500, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                      max_position_embeddings=128, unpad=True)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = build_config({"data.train_dir": str(out), "data.max_seq_length": 128, "model.vocab_size": 1500,
                        "model.max_position_embeddings": 128, "run.local_batch_size": 16, "run.seed": 1})
    loader = train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, 1), seed=1,
                           rank=0, world_size=1, prefetch=False)
    batch = next(loader)
    losses = []
    for _ in range(3):  # the same batch: the loss must fall
        mlm, nsp = model(**{k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")})
        loss = pretraining_loss(mlm, nsp, batch["mlm_labels"], batch["nsp_labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    loader.close()
    assert len(EvalSet(out, 0, 1, limit=100)) == 100


def _doc_token_strings(parts, vocab) -> list[str]:
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(str(vocab), lowercase=True)
    docs = []
    for p in parts:
        for doc in p.read_text().split("\n\n"):
            ids = [i for line in doc.splitlines() if line.strip() for i in tok.encode(line, add_special_tokens=False).ids]
            docs.append(" " + " ".join(map(str, ids)) + " ")
    return docs


def test_masking_and_nsp_follow_the_reference_rules(corpus, created):
    _, parts, vocab_path = corpus
    out, _ = created
    v = load_vocab(vocab_path)
    docs = _doc_token_strings(parts, vocab_path)
    kinds = {"mask": 0, "same": 0, "random": 0}
    checked = {0: 0, 1: 0}
    nsp_labels = []
    for p in list_shards(out):
        shard = read_shard(p, 128)
        for i in range(len(shard)):
            s = shard[i]
            ids, pos, labels, L = s.input_ids.astype(int), s.masked_positions.astype(int), s.masked_ids.astype(int), len(s.input_ids)
            assert len(pos) == min(20, max(1, int(round(L * 0.15))))
            assert (np.diff(pos) > 0).all() and pos.min() >= 1 and pos.max() < L  # sorted, unique, inside
            orig = ids.copy()
            orig[pos] = labels
            sep = np.nonzero(orig == v.sep)[0]  # (a random replacement may itself be [SEP])
            assert orig[0] == v.cls and orig[-1] == v.sep and len(sep) == 2, "[CLS] A [SEP] B [SEP]"
            assert not np.isin(pos, sep).any()  # specials are never predicted
            assert not (np.delete(ids, pos) == v.mask).any()  # [MASK] only at predicted positions
            for j, lab in zip(pos, labels):
                kinds["mask" if ids[j] == v.mask else "same" if ids[j] == lab else "random"] += 1
            # segments: 0 up to and including the first [SEP], 1 after
            np.testing.assert_array_equal(s.segment_ids, (np.arange(L) > sep[0]).astype(np.int8))
            a, b = orig[1:sep[0]], orig[sep[0] + 1:L - 1]
            nsp_labels.append(s.nsp_label)
            if len(a) < 6 or len(b) < 6:
                continue  # short pieces may occur anywhere; the long ones pin their document
            sa, sb = " " + " ".join(map(str, a)) + " ", " " + " ".join(map(str, b)) + " "
            doc_a = [d for d, text in enumerate(docs) if sa in text]
            doc_b = [d for d, text in enumerate(docs) if sb in text]
            assert len(doc_a) == 1 and len(doc_b) == 1, "labels restore the original text"
            if s.nsp_label == 0:  # B follows A in A's document
                assert doc_a == doc_b and docs[doc_a[0]].find(sb) > docs[doc_a[0]].find(sa)
            else:
                assert doc_a != doc_b
            checked[s.nsp_label] += 1
    assert min(checked.values()) > 50
    total = sum(kinds.values())
    assert abs(kinds["mask"] / total - 0.8) < 0.03
    # "random" may draw the original token itself (1/1500 of the time): counted as "same"
    assert abs(kinds["same"] / total - 0.1) < 0.02 and abs(kinds["random"] / total - 0.1) < 0.02
    assert 0.4 < np.mean(nsp_labels) < 0.7  # single-sentence chunks always take a random B


def test_bad_input_is_named(corpus, tmp_path):
    root, parts, vocab = corpus
    text = tmp_path / "text"
    text.mkdir()
    good = parts[0].read_text()
    with pytest.raises(PrepError, match=r"nope.txt: vocab file does not exist"):
        create(root / "text", tmp_path / "nope.txt", tmp_path / "o1", OPTS)
    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\n[CLS]\nhello\n")
    with pytest.raises(PrepError, match=r"v.txt: vocab lacks the special token\(s\) \['\[SEP\]', '\[MASK\]'\]"):
        create(root / "text", tmp_path / "v.txt", tmp_path / "o2", OPTS)
    cases = {
        "bad_utf8.txt": (good.encode()[:50] + b"\nabc \xff\xfe def\n", r"bad_utf8.txt: line 2: not UTF-8"),
        "empty.txt": (b"\n  \n", r"empty.txt: empty part"),
        "double_blank.txt": (b"One two.\nThree.\n\n\nFour five.\n", r"double_blank.txt: line 4: empty document"),
        "no_tokens.txt": ("Ok then.\n\n\u200b\x00\n\nMore.\n".encode(), r"no_tokens.txt: line 3: empty document"),
    }
    strict = CreateOptions(**{**OPTS.__dict__, "strict_documents": True})
    for name, (data, msg) in cases.items():
        d = tmp_path / name.replace(".txt", "")
        d.mkdir()
        (d / name).write_bytes(data)
        with pytest.raises(PrepError, match=msg + (r".*without --strict-documents" if "document" in msg else "")):
            create(d, vocab, tmp_path / ("out_" + name), strict, workers=1)
        assert not list((tmp_path / ("out_" + name)).glob("*.hdf5"))  # nothing half-written
    with pytest.raises(PrepError, match="no such input directory"):
        create(tmp_path / "missing", vocab, tmp_path / "o3", OPTS)


def test_empty_documents_dropped_and_counted_as_the_reference_does(corpus, tmp_path):
    """Empty documents (a run of blank lines, or lines without tokens) are dropped by default:
    the shards are byte-identical to those of the same text without them, and the summary
    counts them per part; --strict-documents keeps the error, which names the option."""
    from input_preprocessing.__main__ import main

    _, parts, vocab = corpus
    docs = parts[0].read_text().strip().split("\n\n")
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    clean.mkdir(), dirty.mkdir()
    (clean / "p.txt").write_text("\n\n".join(docs) + "\n")
    # two extra blank lines after doc 0, a tokenless document after doc 1: three dropped
    noisy = [docs[0] + "\n\n", docs[1], "\u200b\x00", *docs[2:]]
    (dirty / "p.txt").write_text("\n\n".join(noisy) + "\n")
    a = create(clean, vocab, tmp_path / "a", OPTS, workers=1)
    b = create(dirty, vocab, tmp_path / "b", OPTS, workers=1)
    assert a["empty_documents_dropped_now"] == 0
    assert b["empty_documents_dropped_now"] == 3 and b["empty_documents_by_part"] == {"p.txt": 3}
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    args = ["create", "--input", str(dirty), "--vocab", str(vocab), "--max-seq-length", "128",
            "--max-predictions-per-seq", "20", "--dupe-factor", "1", "--workers", "1"]
    assert main([*args, "--output", str(tmp_path / "c"), "--strict-documents"]) == 2
    assert main([*args, "--output", str(tmp_path / "d")]) == 0


def test_two_parts_with_the_same_text_are_refused_naming_both(corpus, tmp_path):
    """The same text under two names: every part is seeded alike, so both would give the same
    examples. Refused in one line naming both, before the second part's shard is written;
    --allow-same-text makes both (identical examples); two empty parts are still empty parts."""
    _, parts, vocab = corpus
    text = tmp_path / "text"
    text.mkdir()
    for p in parts[:2]:
        shutil.copy(p, text / p.name)
    shutil.copy(parts[0], text / "again.txt")
    with pytest.raises(PrepError) as e:
        create(text, vocab, tmp_path / "out", OPTS, workers=1)
    md5 = hashlib.md5(parts[0].read_bytes()).hexdigest()
    assert str(e.value) == (f"{text / 'again.txt'} and {text / parts[0].name} hold the same text (md5 {md5}): a part "
                            "given twice makes the same examples twice (every part is seeded alike); remove one, or "
                            "pass --allow-same-text if you mean it")
    assert [p.name for p in list_shards(tmp_path / "out")] == ["again.hdf5"]  # the first; not the second
    s = create(text, vocab, tmp_path / "both", OPTS, workers=1, allow_same_text=True)
    assert s["parts_written_now"] == 3
    assert _examples(tmp_path / "both" / "again.hdf5") == _examples(tmp_path / "both" / parts[0].with_suffix(".hdf5").name)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("\n")
    (empty / "b.txt").write_text("\n")
    with pytest.raises(PrepError, match=r"a.txt: empty part \(no text\)"):
        create(empty, vocab, tmp_path / "o_empty", OPTS, workers=1)


def _examples(p) -> str:
    from bert.shards import examples_md5, read_shard

    return examples_md5(read_shard(p))


def test_a_part_edited_in_place_to_the_same_size_is_made_again(corpus, tmp_path):
    _, parts, vocab = corpus
    text = tmp_path / "text"
    shutil.copytree(parts[0].parent, text)
    out = tmp_path / "out"
    assert create(text, vocab, out, OPTS, workers=1)["parts_written_now"] == 3
    victim = text / parts[1].name
    before = victim.read_bytes()
    i = before.index(b" ") + 1
    after = before[:i] + (b"x" if before[i:i + 1] != b"x" else b"y") + before[i + 1:]  # one letter, same size
    victim.write_bytes(after)
    again = create(text, vocab, out, OPTS, workers=1)
    assert again["parts_written_now"] == 1 and again["samples_written_now"] > 0
    fresh = tmp_path / "fresh"
    create(text, vocab, fresh, OPTS, workers=1)
    assert _digests(out) == _digests(fresh)  # the shard of the edited text, not the old one
    # the output's md5 list, written with it, lists the shard made again, not the old one
    assert verify(out)["verified"] == 3 and (out / "md5sums.txt").read_text() == (fresh / "md5sums.txt").read_text()
    assert create(text, vocab, out, OPTS, workers=1)["parts_written_now"] == 0
    assert verify(out)["verified"] == 3  # a resume lists the shards it kept, from their records
    # a shard whose source record is lost (killed between the two writes) is made again
    (out / ".sources" / f"{victim.stem}.hdf5.md5").unlink()
    assert create(text, vocab, out, OPTS, workers=1)["parts_written_now"] == 1


def test_text_full_of_unk_is_refused_naming_the_likely_cause(corpus, tmp_path):
    """An uncased vocab with --cased: capitalised words are [UNK]. Refused from the first 64 KiB
    before the output directory exists; a part that only later turns foreign is refused before
    its shard is written; --max-unk-rate raises the bar."""
    root, parts, vocab = corpus
    cased = CreateOptions(**{**OPTS.__dict__, "lowercase": False})
    with pytest.raises(PrepError) as e:
        create(root / "text", vocab, tmp_path / "o", cased, workers=1)
    assert re.fullmatch(rf"{root / 'text'}: the first 6\d{{4}} bytes of text \({parts[0].name}\): "
                        r"\d+\.\d% of its \d+ tokens are \[UNK\] \(more than --max-unk-rate 0.01\): the vocab is uncased "
                        r"\(no token holds a capital letter\) and --cased keeps the text's capitals: drop --cased; or "
                        r"raise --max-unk-rate if this text is meant to hold them", str(e.value)), str(e.value)
    assert not (tmp_path / "o").exists()
    text = tmp_path / "text"
    text.mkdir()
    shutil.copy(parts[0], text / "a.txt")
    (text / "b.txt").write_text("Ωμέγα ψυχή ξένος λόγος.\n" * 3000, encoding="utf-8")  # no Greek in the vocab
    with pytest.raises(PrepError, match=r"b.txt: 80.0% of its 15000 tokens are \[UNK\].*not made for this text"):
        create(text, vocab, tmp_path / "o2", OPTS, workers=1)
    assert [p.name for p in list_shards(tmp_path / "o2")] == ["a.hdf5"]
    s = create(text, vocab, tmp_path / "o3", OPTS, workers=1, max_unk_rate=1.0)
    assert s["parts_written_now"] == 2 and 0.3 < s["unk_rate_now"] < 0.9


def test_the_likely_cause_of_unk_from_the_vocab_s_case():
    from input_preprocessing.create import unk_cause

    uncased = ("[PAD]", "[UNK]", "[CLS]", "the", "##s", "[unused0]")
    cased = ("[PAD]", "[UNK]", "The", "the", "Paris")
    assert "drop --cased" in unk_cause(uncased, lowercase=False)
    assert "cased (2 tokens hold capital letters)" in unk_cause(cased, lowercase=True) and "add --cased" in \
        unk_cause(cased, lowercase=True)
    assert "not made for this text" in unk_cause(uncased, lowercase=True)
    assert "not made for this text" in unk_cause(cased, lowercase=False)


def test_input_given_a_file_says_so(corpus, tmp_path):
    _, parts, vocab = corpus
    with pytest.raises(PrepError) as e:
        create(parts[0], vocab, tmp_path / "o", OPTS)
    assert str(e.value) == (f"{parts[0]}: is a file, not a directory; --input takes the directory of the text parts "
                            f"(this part alone: --input {parts[0].parent} --pattern {parts[0].name})")
    from input_preprocessing.check import check

    with pytest.raises(PrepError, match=r"x.hdf5: is a file, not a directory; --input takes the directory of the shards"):
        (tmp_path / "x.hdf5").write_bytes(b"")
        check(tmp_path / "x.hdf5")
