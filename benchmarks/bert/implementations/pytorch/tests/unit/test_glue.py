"""tools/glue.py, tools/glue_data.py, tools/glue_metrics.py, bert/classify.py: GLUE fine-tuning.

What is checked against something we did not write: the nine tasks' files in GLUE's published
layout (each task's own columns and header rule, MNLI's two dev files, MRPC's byte-order mark)
read as Hugging Face's ``glue`` loader reads them, and the same rows from a ``datasets`` cache
that ``datasets.load_dataset`` itself loads offline; the metrics against scikit-learn and
scipy; the classifier against transformers' ``BertForSequenceClassification``. Then: bad input
exits 2 naming the file and line; fine-tuning learns generated tasks with a rule in them; the
table's rule (best learning rate by median over seeds, the GLUE average). The array on a
one-node SLURM cluster: tests/integration/test_glue.py.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PKG
from glue_helpers import _grid, as_examples, examples, row, tiny_model, write_task  # noqa: F401 - tiny_model: a fixture

sys.path.insert(0, str(PKG / "tools"))
import glue  # noqa: E402  (tools/ holds scripts, not a package)
import glue_data  # noqa: E402
import glue_metrics  # noqa: E402


# ---------------------------------------------------------------- a datasets cache


def write_hf_cache(cache: Path, task: str, train, dev) -> None:
    """The cache ``load_dataset("nyu-mll/glue", config)`` leaves: datasets' parquet builder
    (what the hub dataset is made of) prepared into <cache>/nyu-mll___glue/<config>/0.0.0/<rev>."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    t = glue_data.TASKS[task]
    feats = {c: datasets.Value("string") for c in t.hf_text}
    feats["label"] = datasets.Value("float32") if t.regression else datasets.ClassLabel(names=list(t.hf_label_names))
    feats["idx"] = datasets.Value("int32")
    features = datasets.Features(feats)
    src = cache / "src" / t.hf_config
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in [("train", train)] + [(d.hf_split, dev) for d in t.dev]:
        cols: dict[str, list] = {c: [] for c in feats}
        for i, (a, b, y) in enumerate(rows):
            cols[t.hf_text[0]].append(a)
            if t.pair:
                cols[t.hf_text[1]].append(b)
            # the cache's class index: the TSV's 0/1 as they are, other label strings by name
            cols["label"].append(float(y) if t.regression else int(y) if t.labels == ("0", "1")
                                 else t.hf_label_names.index(y))
            cols["idx"].append(i)
        datasets.Dataset.from_dict(cols, features=features).to_parquet(str(src / f"{split}.parquet"))
        files[split] = [str(src / f"{split}.parquet")]
    # The hub's repo id names the folder (nyu-mll___glue); a builder given local files may not
    # carry it, so it is prepared under "glue" and moved, config folder and all.
    builder = Parquet(cache_dir=str(cache / "build"), dataset_name="glue", config_name=t.hf_config,
                      config_id=t.hf_config, hash="0123456789abcdef0123456789abcdef01234567",
                      data_files=files, features=features)
    builder.download_and_prepare()
    (cache / "nyu-mll___glue").mkdir(exist_ok=True)
    shutil.move(str(cache / "build" / "glue" / t.hf_config), str(cache / "nyu-mll___glue" / t.hf_config))


@pytest.mark.parametrize("task", list(glue_data.TASKS))
def test_task_reads_from_glue_layout_and_from_a_datasets_cache(task, tmp_path):
    rng = random.Random(task)
    train, dev = examples(task, 12, rng), examples(task, 6, rng)
    write_task(tmp_path / "glue", task, train, dev)
    data = glue_data.load_task(glue_data.TASKS[task], glue_dir=tmp_path / "glue")
    assert data.train == as_examples(task, train)
    t = glue_data.TASKS[task]
    assert list(data.dev) == [d.suffix for d in t.dev] and all(v == as_examples(task, dev) for v in data.dev.values())
    if not t.hf_config:
        return
    write_hf_cache(tmp_path / "cache", task, train, dev)
    cached = glue_data.load_task(t, hf_cache=tmp_path / "cache")
    assert cached.train == data.train and cached.dev == data.dev


def test_the_cache_is_what_datasets_loads_offline(tmp_path, monkeypatch):
    """MNLI (two dev splits, the cache's label order not the TSV's): datasets' own
    load_dataset, offline, reads the rows our reader reads."""
    import datasets

    rng = random.Random(0)
    train, dev = examples("MNLI", 10, rng), examples("MNLI", 5, rng)
    write_hf_cache(tmp_path, "MNLI", train, dev)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    theirs = datasets.load_dataset("nyu-mll/glue", "mnli", cache_dir=str(tmp_path))
    ours = glue_data.read_hf_cache(tmp_path, glue_data.TASKS["MNLI"])
    names = theirs["train"].features["label"].names
    for split, mine in (("train", ours.train), ("validation_matched", ours.dev["_matched"]),
                        ("validation_mismatched", ours.dev["_mismatched"])):
        got = [(r["premise"], r["hypothesis"], names[r["label"]]) for r in theirs[split]]
        assert got == [(e.text_a, e.text_b, glue_data.TASKS["MNLI"].labels[e.label]) for e in mine]


# ---------------------------------------------------------------- bad input


BAD = {  # what to break in a valid SST-2 / STS-B / CoLA / MNLI layout -> what the message says
    "missing task folder": ("SST-2", lambda d: shutil.rmtree(d), "SST-2: no such directory"),
    "missing dev file": ("MNLI", lambda d: (d / "dev_mismatched.tsv").unlink(), "dev_mismatched.tsv: no such file"),
    "short row": ("SST-2", lambda d: _edit(d / "train.tsv", 4, "just one field"),
                  "train.tsv:5: 1 tab-separated fields, SST-2's rows have 2 (as its header)"),
    "long row": ("CoLA", lambda d: _edit(d / "dev.tsv", 2, "gj04\t1\t\ta sentence\textra"),
                 "dev.tsv:3: 5 tab-separated fields, CoLA's rows have 4"),
    "label outside the set": ("SST-2", lambda d: _edit(d / "dev.tsv", 3, "the cat sat\t2"),
                              "dev.tsv:4: label '2' is not one of ['0', '1'] (SST-2)"),
    "nli label outside the set": ("MNLI", lambda d: _edit(d / "train.tsv", 2, row("MNLI", 1, "a", "b", "-")),
                                  "train.tsv:3: label '-' is not one of ['contradiction', 'entailment', 'neutral']"),
    "score outside the range": ("STS-B", lambda d: _edit(d / "train.tsv", 1, row("STS-B", 0, "a", "b", "7.5")),
                                "train.tsv:2: label '7.5' is not a number in [0, 5]"),
    "header without a column": ("SST-2", lambda d: _edit(d / "train.tsv", 0, "text\tlabel"),
                                "train.tsv:1: the header lacks column(s) ['sentence']"),
    "not UTF-8": ("SST-2", lambda d: (d / "dev.tsv").write_bytes(b"sentence\tlabel\nok\t1\nbad \xff\t0\n"),
                  "dev.tsv:3: not UTF-8"),
}


def _edit(path: Path, line: int, text: str) -> None:
    lines = path.read_text(encoding="utf-8").split("\n")
    lines[line] = text
    path.write_text("\n".join(lines), encoding="utf-8")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_and_names_it(case, tmp_path, tiny_model, capsys):
    task, breakit, message = BAD[case]
    rng = random.Random(1)
    d = write_task(tmp_path / "glue", task, examples(task, 8, rng), examples(task, 4, rng))
    breakit(d)
    grid = _grid(tmp_path, tiny_model, tmp_path / "glue", tasks=[task])
    assert glue.main(["run", "--grid", str(grid), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not list((tmp_path / "w").rglob("*.json"))  # nothing half-written


def test_bad_grid_exits_2_and_names_the_key(tmp_path, tiny_model, capsys):
    grid = _grid(tmp_path, tiny_model, tmp_path)
    for overrides, message in ((["lr=1e-3"], "unknown key(s) ['lr']"), (["seeds=3"], "seeds: 3 is not a list"),
                               (["tasks=[GLUE]"], "unknown task 'GLUE'"), (["inits=[warm]"], "inits: ['warm']"),
                               (["model="], "model: the model to fine-tune is required")):
        assert glue.main(["plan", "--grid", str(grid), *overrides]) == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------- metrics


def test_metrics_are_scikit_learns_and_scipys():
    from scipy import stats
    from sklearn import metrics as sk

    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(5, 200))
        gold, pred = rng.integers(0, 2, n), rng.integers(0, 2, n)
        assert glue_metrics.accuracy(pred, gold) == pytest.approx(sk.accuracy_score(gold, pred))
        assert glue_metrics.f1(pred, gold) == pytest.approx(sk.f1_score(gold, pred, zero_division=0))
        assert glue_metrics.matthews(pred, gold) == pytest.approx(sk.matthews_corrcoef(gold, pred))
        three_gold, three_pred = rng.integers(0, 3, n), rng.integers(0, 3, n)
        assert glue_metrics.matthews(three_pred, three_gold) == pytest.approx(sk.matthews_corrcoef(three_gold, three_pred))
        x = rng.normal(size=n)
        y = x * rng.normal() + rng.normal(size=n)
        y_ties = np.round(y * 2) / 2  # STS-B's scores are often in steps of 0.2 to 1: ties
        assert glue_metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
        assert glue_metrics.spearman(x, y_ties) == pytest.approx(stats.spearmanr(x, y_ties)[0])
    # undefined cases: 0, as scikit-learn's F1 and Matthews (scipy gives nan for a constant input)
    assert glue_metrics.f1([0, 0], [0, 0]) == sk.f1_score([0, 0], [0, 0], zero_division=0) == 0
    assert glue_metrics.matthews([1, 1, 1], [0, 1, 0]) == sk.matthews_corrcoef([0, 1, 0], [1, 1, 1]) == 0
    assert glue_metrics.pearson([1, 1, 1], [1, 2, 3]) == 0 and glue_metrics.spearman([2, 2], [1, 3]) == 0


# ---------------------------------------------------------------- the classifier


@pytest.mark.parametrize("num_labels", [3, 1])
def test_classifier_is_transformers_bert_for_sequence_classification(num_labels):
    from transformers import BertConfig
    from transformers import BertForSequenceClassification as HF

    from bert.weights import hf_config
    from bert.classify import BertForSequenceClassification
    from bert.config import ModelConfig

    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                      max_position_embeddings=40, attention_backend="sdpa", unpad=False, vocab_pad_multiple=1)
    torch.manual_seed(0)
    theirs = HF(BertConfig(**{**hf_config(cfg), "num_labels": num_labels})).eval()
    ours = BertForSequenceClassification(cfg, num_labels).eval()
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if not k.endswith("position_ids")})
    ids = torch.randint(5, 50, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    types = (torch.arange(11) > 5).long().expand(3, 11)
    with torch.no_grad():
        want = theirs(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        got = ours(ids, types, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pretrained_init_loads_the_encoder_and_only_it(tiny_model):
    from bert.weights import load_weights
    from bert.classify import BertForSequenceClassification, encoder_state

    g = glue.load_grid(None, [f"model={tiny_model}", f"glue_dir={tiny_model}", "max_seq_length=64"])
    cfg = glue.model_config(g, tiny_model / "config.json")
    state = load_weights(tiny_model, cfg)
    torch.manual_seed(5)
    model = BertForSequenceClassification(cfg, 2)
    before = model.classifier.weight.clone()
    model.load_encoder(state)
    mine = model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in encoder_state(state).items())
    assert torch.equal(mine["classifier.weight"], before) and not any(k.startswith("cls.") for k in mine)
    with pytest.raises(KeyError, match="missing"):
        model.load_encoder({k: v for k, v in state.items() if "layer.1." not in k})


# ---------------------------------------------------------------- fine-tuning and the table


def test_finetuning_learns_generated_tasks_and_the_table_picks_by_median(tmp_path, tiny_model, capsys):
    """SST-2 (classification), STS-B (regression), MNLI (3 classes, two dev files), each with a
    rule in its words: at a usable rate the model learns it, at a tiny rate it does not; the
    table takes the better rate by its median over seeds; a second run redoes nothing."""
    rng = random.Random(2)
    tasks = ["SST-2", "STS-B", "MNLI"]
    for task in tasks:
        write_task(tmp_path / "glue", task, examples(task, 320, rng), examples(task, 80, rng))
    grid = _grid(tmp_path, tiny_model, tmp_path / "glue", tasks=tasks, lrs=[1e-7, 3e-3], seeds=[1, 2],
                 epochs=8, batch_size=16, dropout=0.0)
    work = tmp_path / "w"
    assert glue.main(["run", "--grid", str(grid), "--workdir", str(work)]) == 0
    g = glue.load_grid(grid)
    res = {(r.task, r.lr, r.seed): json.loads(r.path(work / "t").read_text()) for r in glue.runs(g)}
    assert len(res) == 12
    for task in tasks:
        for seed in (1, 2):
            learned, stuck = res[(task, 3e-3, seed)], res[(task, 1e-7, seed)]
            assert learned["score"] > stuck["score"] + 0.15, (task, learned["metrics"], stuck["metrics"])
    assert res[("SST-2", 3e-3, 1)]["metrics"]["accuracy"] > 0.9
    assert res[("STS-B", 3e-3, 1)]["metrics"]["pearson"] > 0.8
    assert set(res[("MNLI", 3e-3, 1)]["metrics"]) == {"accuracy_matched", "accuracy_mismatched"}
    capsys.readouterr()
    assert glue.main(["run", "--grid", str(grid), "--workdir", str(work)]) == 0
    assert capsys.readouterr().out.count(": done (") == 12  # every result kept, nothing rerun

    assert glue.main(["table", "--grid", str(grid), "--workdir", str(work)]) == 0
    table = json.loads((work / "t" / "table.json").read_text())["inits"]["pretrained"]
    for task in tasks:
        want = float(np.median([res[(task, 3e-3, s)]["score"] for s in (1, 2)]))
        assert table["tasks"][task]["best_lr"] == 3e-3 and table["tasks"][task]["score"] == pytest.approx(want)
    assert table["glue_average"]["value"] == pytest.approx(np.mean([table["tasks"][t]["score"] for t in tasks]))
    assert not table["glue_average"]["complete"]  # three of the nine tasks
    md = (work / "t" / "table.md").read_text()
    assert "| MNLI | acc (matched) " in md and "**GLUE average**" in md and "(incomplete: 3 task(s)" in md


def _result(root: Path, init: str, task: str, lr: float, seed: int, metrics: dict[str, float]) -> None:
    p = glue.Run(task, init, lr, seed).path(root)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"seed": seed, "metrics": metrics, "score": glue_metrics.score(metrics)}))


def test_table_rule_best_rate_by_median_and_the_glue_average(tmp_path):
    g = glue.load_grid(None, ["model=m", "glue_dir=d", "lrs=[1e-5, 2e-5]", "seeds=[1, 2, 3]"])
    root = tmp_path / g.name
    names = {t: glue_data.TASKS[t].metric_names() for t in glue_data.GLUE_TASKS}
    for k, task in enumerate(glue_data.GLUE_TASKS):
        # medians 0.9 and 0.7 (the first rate wins); means 0.65 and 0.7 (the second would)
        for lr, seed_scores in ((1e-5, [0.95, 0.1, 0.9]), (2e-5, [0.7, 0.7, 0.7])):
            for seed, base in zip((1, 2, 3), seed_scores):
                _result(root, "pretrained", task, lr, seed, {m: base + 0.01 * k + 0.001 * j
                                                             for j, m in enumerate(names[task])})
    s = glue.summarize(g, tmp_path)["inits"]["pretrained"]
    for k, task in enumerate(glue_data.GLUE_TASKS):
        r = s["tasks"][task]
        assert r["best_lr"] == 1e-5 and r["seeds"] == 3 and r["complete"]
        assert r["metrics"] == pytest.approx({m: 0.9 + 0.01 * k + 0.001 * j for j, m in enumerate(names[task])})
    want = np.mean([s["tasks"][t]["score"] for t in glue_data.GLUE_TASKS])
    assert s["glue_average"]["value"] == pytest.approx(want) and s["glue_average"]["complete"]
    assert s["glue_average_without_wnli"]["tasks"] == [t for t in glue_data.GLUE_TASKS if t != "WNLI"]
    # MRPC's score is the mean of its F1 and accuracy; MNLI's of matched and mismatched
    assert s["tasks"]["MNLI"]["score"] == pytest.approx(np.mean(list(s["tasks"]["MNLI"]["metrics"].values())))
    (root / "pretrained" / "RTE" / "lr1e-05_seed3.json").unlink()
    s = glue.summarize(g, tmp_path)["inits"]["pretrained"]
    assert not s["tasks"]["RTE"]["complete"] and not s["glue_average"]["complete"]
    assert "(incomplete: 5 of 6 runs)" in glue.markdown(glue.summarize(g, tmp_path))




def test_compare_wins_only_when_every_pretrained_seed_beats_every_random_one_by_the_margin(tmp_path, capsys):
    g = glue.load_grid(None, ["model=m", "glue_dir=d", "tasks=[SAME-DOC]", "inits=[pretrained, random]",
                              "lrs=[1e-4, 3e-4]", "seeds=[1, 2, 3]"])
    root = tmp_path / g.name
    scores = {("pretrained", 1e-4): [0.70, 0.70, 0.70], ("pretrained", 3e-4): [0.80, 0.75, 0.78],
              ("random", 1e-4): [0.50, 0.55, 0.52], ("random", 3e-4): [0.60, 0.65, 0.70]}
    for (init, lr), values in scores.items():
        for seed, v in zip((1, 2, 3), values):
            _result(root, init, "SAME-DOC", lr, seed, {"accuracy": v})
    c = glue.compare(g, tmp_path, "SAME-DOC", 0.05)
    assert c["pretrained"]["best_lr"] == 3e-4 and c["random"]["best_lr"] == 3e-4  # each at its own best rate
    assert c["worst_minus_best"] == pytest.approx(0.75 - 0.70) and c["median_difference"] == pytest.approx(0.78 - 0.65)
    args = ["compare", "--task", "SAME-DOC", "--workdir", str(tmp_path), "model=m", "glue_dir=d",
            "tasks=[SAME-DOC]", "inits=[pretrained, random]", "lrs=[1e-4, 3e-4]", "seeds=[1, 2, 3]"]
    assert glue.main([*args, "--margin", "0.049"]) == 0
    assert glue.main([*args, "--margin", "0.051"]) == 1
    assert "does NOT win" in capsys.readouterr().out


def test_a_signal_stops_a_run_without_a_result_and_the_rerun_does_it(tmp_path, tiny_model):
    rng = random.Random(4)
    write_task(tmp_path / "glue", "SST-2", examples("SST-2", 32, rng), examples("SST-2", 8, rng))
    g = glue.load_grid(_grid(tmp_path, tiny_model, tmp_path / "glue", tasks=["SST-2"]))
    stop = glue.Stop()
    stop.signum = 15  # as tools/tune.py's handler records SIGTERM
    with pytest.raises(glue.Stopped, match="signal 15 at step 0"):
        glue.run_grid(g, tmp_path / "w", stop=stop)
    assert not list((tmp_path / "w").rglob("*.json*"))  # no result, no temporary
    stop.signum = 0
    assert glue.run_grid(g, tmp_path / "w", stop=stop) == 0
    assert glue.runs(g)[0].path(tmp_path / "w" / g.name).exists()


def test_the_downstream_task_is_made_from_documents_pretraining_never_sees(tmp_path):
    """tools/pretrain_demo.py: the corpus keeps its downstream documents out of the training
    and held-out text; `glue.py same-doc`'s positives are a sentence and the next of one docstring,
    its negatives a sentence and one of another, no docstring in both train and dev."""
    import pretrain_demo

    summary = pretrain_demo.write_corpus(tmp_path / "text", max_docs=400)
    train = [d for part in sorted((tmp_path / "text" / "train").glob("*.txt")) for d in glue_data.read_documents(part)]
    held = glue_data.read_documents(tmp_path / "text" / "eval" / "eval.txt")
    down = glue_data.read_documents(tmp_path / "text" / "downstream.txt")
    assert len(train) + len(held) + len(down) == summary["documents"] == 400 and 30 < len(down) < 100
    keys = [{" ".join(d) for d in part} for part in (train, held, down)]
    assert not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    counts = glue_data.same_doc_task(tmp_path / "text" / "downstream.txt", tmp_path / "glue", pairs=1)
    data = glue_data.read_glue_dir(tmp_path / "glue", glue_data.TASKS["SAME-DOC"])
    assert len(data.train) == counts["train"]["pairs"] and len(data.dev[""]) == counts["dev"]["pairs"]
    nxt = {(d[k], d[k + 1]) for d in down for k in range(len(d) - 1)}
    for rows in (data.train, data.dev[""]):
        assert sum(e.label for e in rows) * 2 == len(rows)  # balanced
        assert all(((e.text_a, e.text_b) in nxt) == (e.label == 1) for e in rows)
    owners: dict[str, set[int]] = {}
    for i, d in enumerate(down):
        for sentence in d:
            owners.setdefault(sentence, set()).add(i)
    docs_of = [{i for e in rows for i in owners[e.text_a]} for rows in (data.train, data.dev[""])]
    unique = [{i for e in rows if len(owners[e.text_a]) == 1 for i in owners[e.text_a]} for rows in (data.train, data.dev[""])]
    assert not (unique[0] & docs_of[1]) and not (unique[1] & docs_of[0])  # no docstring on both sides


def test_same_doc_from_a_directory_of_your_own_text_and_too_little_of_it(tmp_path, capsys):
    """`glue.py same-doc` on text of the user's own (a directory of parts in create's format,
    a tab inside a sentence): GLUE-layout TSVs of four fields a row, each sentence of the
    text; text with fewer than two documents of two sentences in a split stops with exit 2."""
    text = tmp_path / "text"
    text.mkdir()
    docs = [[f"Document {d} says thing {s}\tin a sentence." for s in range(3)] for d in range(40)]
    for part in range(2):
        (text / f"part-{part:02d}.txt").write_text("\n\n".join("\n".join(d) for d in docs[part::2]) + "\n")
    assert glue.main(["same-doc", "--text", str(text), "--output", str(tmp_path / "out"), "--pairs", "2"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["train"]["documents"] + counts["dev"]["documents"] == 40
    sentences = {" ".join(s.split()) for d in docs for s in d}
    for split in ("train", "dev"):
        rows = (tmp_path / "out" / "SAME-DOC" / f"{split}.tsv").read_text().splitlines()[1:]
        assert len(rows) == counts[split]["pairs"] and all(len(r.split("\t")) == 4 for r in rows)
        assert all(r.split("\t")[1] in sentences and r.split("\t")[2] in sentences for r in rows)
    (tmp_path / "few.txt").write_text("One sentence here only.\n\nAnd another lone one.\n")
    assert glue.main(["same-doc", "--text", str(tmp_path / "few.txt"), "--output", str(tmp_path / "o2")]) == 2
    assert "document(s) of two or more sentences out of 2 documents; it needs 2" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
