"""create: schema, the masking and NSP rules checked against the source text, determinism
across worker counts, resumption, and the errors on bad input."""

from __future__ import annotations

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
