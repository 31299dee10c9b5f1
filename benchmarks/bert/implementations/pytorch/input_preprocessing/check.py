"""check: scan every sample of every shard for what breaks training or silently spoils it.

A run stops at the first malformed sample it cannot use; this scan goes on, counts every
defect of every sample per shard, and names a known cause when the counts carry its
signature. The shards are decoded once, by the decoder a run reads them with
(``bert.shards.scan_shard``, through the run's reader: the md5 list, the watchdog's bound, the
vocab's bounds), which counts each defect (``bert.shards.DEFECTS`` says what each is; a sample
may have several) and keeps its first offender in the words a run raises for it: the two
report the same defect of the same shard alike. ``check`` applies the rules a run does not
refuse too: the reference's example structure, by the vocab's [CLS]/[SEP]/[PAD] ids.

Another vocabulary: the [CLS]/[SEP] ids (MLPerf's 101/102 unless ``--vocab`` or the id options
say otherwise) must begin and end every sample. When no sample begins with [CLS] and none
ends with [SEP], the shards were made with another vocabulary, not broken sample by sample:
the id-dependent counts (``bad_segments``, ``mask_on_special``) are then not reported, and
the check says to pass ``--vocab`` (exit 2: the scan's premise, not the data, is wrong).

Each readable shard also gets ``examples_md5``: the md5 of its examples, the same in either
layout (``bert.shards.example_records`` says what it hashes), so that shards made elsewhere (NVIDIA's
scripts, the reference's output converted to hdf5) can be compared with ours part by part;
``--digests FILE`` writes them as ``<md5>  <shard>`` lines.

Copies (``copies.py`` says what counts as one and what it costs in memory), counted beside the
defects and making the check fail like them:

identical_shard     a shard whose examples are exactly an earlier shard's (the same
                    ``examples_md5``): counted once per copy
repeated_sample     a sample of at least 32 tokens whose example (tokens, masks, labels,
                    segments, next-sentence label) occurs earlier, in its shard or another;
                    counted per pair of shards with a few rows
eval_in_training    with ``--eval DIR``: an eval sample of at least 32 tokens whose text
                    (masked positions restored from their labels) a training sample holds,
                    when they are more than ``--eval-tolerance`` (1%) of the eval set or a
                    training shard holds a whole eval shard; fewer are a note (a corpus that
                    holds a passage twice, in a held-out and a training document)

The [UNK] rate (the share of [UNK] among the samples' tokens, masked positions counted as
their labels) is reported, not judged: above 1% the diagnosis names the likely cause.

Exit status: 0 clean; 1 a defect or a copy; 2 the check's premise is wrong (an input that is
not a directory of shards, a shard that differs from its directory's md5 list or is missing
from it, a read past ``--read-timeout-s``, an eval set that cannot be read, or shards of
another vocabulary).

Known causes recognised:

- NVIDIA's ``convert_fixed2variable.py`` computes each length as Python ``sum()`` over the
  int8 ``input_mask`` row; under NumPy >= 2 the sum stays int8 and wraps modulo 256, so
  samples of real length 128-255 gain 256 padding tokens, 256-383 are cut to L-256 and 512
  are emptied. Its signature here: variable rows that end in exactly 256 padding ids after a
  [SEP] at a real length of 128-255.
- Whole shards that repeat: a shuffle or re-chop script that wrote the same samples into
  several shards (NVIDIA's ``shuffle_samples.py`` never advanced its sample index, and every
  shard came out the same; runs on such data stalled at 0.62-0.63 masked-LM accuracy, and
  ``diagnose`` names the public reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.config import PREP_READ_TIMEOUT_S
from bert.reader import ShardReader
from bert.shards import (DEFECTS, SHARD_SUFFIXES, Bounds, DataError, Specials, example_records, examples_md5,
                         records_md5, shard_size)

from . import copies
from .common import PrepError, input_directory, parallel_iter, write_text
from .inputs import open_inputs, read_whole

WRAP_SIGNATURE = "wrap256_padded"  # counted beside the defects: samples carrying the int8-wrap signature
SPECIALS_IN_PLACE = "cls_or_sep_in_place"  # counted beside them: samples starting [CLS] or ending [SEP]
VOCAB_DEPENDENT = ("bad_segments", "mask_on_special")  # meaningless when the [CLS]/[SEP] ids are not the shards'
PAD_ID = 0
UNK_NOTE = 0.01  # an [UNK] rate above this gets a diagnosis (create's own default refusal)
LISTED = 5  # shards or pairs named in one line, the rest counted
SHOWN_PAIRS = 20  # pairs of shards with their rows in the JSON, the rest counted
# Eval samples whose text a training shard holds, as a share of the eval set, that a corpus
# holding some passages twice gives without any leak (the standard library's docstrings have a
# few: asyncio's protocol classes share their methods' docs); a copied eval shard gives ~all.
EVAL_TOLERANCE = 0.01


@dataclass(frozen=True)
class Vocabulary:
    """What the scan needs of the vocab: its size and the [CLS]/[SEP]/[UNK] ids."""

    size: int = 30522  # the MLPerf uncased WordPiece vocab
    cls: int = 101
    sep: int = 102
    unk: int = 100

    @staticmethod
    def from_file(path: str | Path) -> Vocabulary:
        from .create import load_vocab

        v = load_vocab(path)
        return Vocabulary(v.size, v.cls, v.sep, v.unk)

    def bounds(self) -> Bounds:
        """The ids a sample may hold: the vocab's, and BERT's two segment types."""
        return Bounds(self.size, 2, vocab_key="vocab_size", type_vocab_key="type_vocab_size")

    def specials(self) -> Specials:
        return Specials(self.cls, self.sep, PAD_ID)


def _wrap_signature(t: np.ndarray, offsets: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """Rows of 384-511 tokens whose last 256 are padding after a [SEP]: a real length of
    128-255 that gained 256 padding tokens (the int8 wrap of sum() over input_mask)."""
    lengths = np.diff(offsets)
    cand = np.nonzero((lengths >= 384) & (lengths <= 511))[0]
    hit = np.zeros(len(lengths), bool)
    if not len(cand):
        return hit
    tail = offsets[cand + 1][:, None] - 256 + np.arange(256)[None, :]
    real_end = offsets[cand + 1] - 257
    hit[cand] = (t[tail] == PAD_ID).all(axis=1) & (t[real_end] == vocab.sep)
    return hit


def _specials_in_place(t: np.ndarray, offsets: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """Samples that begin with [CLS] or end with [SEP]: none at all means another vocabulary."""
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    if not len(t):
        return np.zeros(len(lengths), bool)
    first, last = np.where(nonempty, offsets[:-1], 0), np.where(nonempty, offsets[1:] - 1, 0)
    return nonempty & ((t[first] == vocab.cls) | (t[last] == vocab.sep))


def shard_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.suffix in SHARD_SUFFIXES and p.is_file())


@dataclass(frozen=True)
class _Job:
    path: Path
    reader: ShardReader
    vocab: Vocabulary
    eval_keys: np.ndarray | None  # sorted text keys of the eval set, or None without --eval


def _scan_one(job: _Job) -> dict:
    """One shard: its defect counts and first offenders, examples_md5, example keys, [UNK]
    count and the rows whose text is an eval sample's; or why it is unreadable; or (``fatal``)
    why it cannot be checked at all (its md5 differs from the list, its read overran)."""
    reader, path, vocab = job.reader, job.path, job.vocab
    try:
        found = reader.wait(path, lambda read: reader.scan(read, path, vocab.specials()))
    except DataError as e:
        return {"fatal": str(e)}
    if found.shard is None:
        return {"error": found.first["unreadable"]}
    s = found.shard
    records, starts = example_records(s.tokens, s.segments, s.offsets, s.mlm_positions, s.mlm_ids, s.mlm_offsets,
                                      s.nsp)
    text = copies.restored_tokens(s.tokens, s.offsets, s.mlm_positions, s.mlm_ids, s.mlm_offsets)
    counts = {k: found.counts.get(k, 0) for k in DEFECTS}
    counts[WRAP_SIGNATURE] = int(_wrap_signature(s.tokens, s.offsets, vocab).sum())
    counts[SPECIALS_IN_PLACE] = int(_specials_in_place(s.tokens, s.offsets, vocab).sum())
    counts["nonempty"] = int((s.lengths > 0).sum())
    out = {"samples": len(s), "examples_md5": records_md5(records), "counts": counts, "first": found.first,
           "keys": copies.example_keys(records, starts, s.lengths), "unk": int((text == vocab.unk).sum()),
           "tokens": len(text)}
    if job.eval_keys is not None:  # with each row's text, for the key's match to be confirmed
        keys = copies.text_keys(text, s.offsets)
        rows = np.flatnonzero(np.isin(keys, job.eval_keys))
        out["eval_rows"], out["eval_keys"] = rows, keys[rows]
        out["eval_texts"] = [text[s.offsets[r]:s.offsets[r + 1]] for r in rows.tolist()]
    return out


@dataclass
class _EvalSet:
    files: list[str]
    samples: int
    where: dict[int, list[tuple[int, int]]]  # text key -> (file, row) of every eval sample with that text
    md5: dict[str, str]  # examples_md5 -> file
    texts: list[tuple[np.ndarray, np.ndarray]]  # each file's samples' text (restored tokens, offsets)

    def holds(self, at: tuple[int, int], text: np.ndarray) -> bool:
        """Whether eval sample ``at`` (file, row) has exactly ``text``."""
        tokens, offsets = self.texts[at[0]]
        return np.array_equal(tokens[offsets[at[1]]:offsets[at[1] + 1]], text)


def _read_eval(path: Path, vocab: Vocabulary, max_seq_length: int, timeout_s: float) -> _EvalSet:
    """The eval set, read as a run reads it (strictly, through its md5 list and the bound)."""
    p = Path(path)
    if not p.exists():
        raise PrepError(f"{p}: no such eval set (--eval takes the directory or file that eval wrote)")
    paths = [p] if p.is_file() else shard_paths(p)
    if not paths:
        raise PrepError(f"{p}: holds no eval shard ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    root = p.parent if p.is_file() else p
    where: dict[int, list[tuple[int, int]]] = {}
    md5: dict[str, str] = {}
    texts: list[tuple[np.ndarray, np.ndarray]] = []
    samples = 0
    inputs = open_inputs(root, paths, every_listed=p.is_dir(), max_seq_length=max_seq_length, bounds=vocab.bounds(),
                         timeout_s=timeout_s, fingerprint=False)
    for i, f in enumerate(paths):
        try:
            s = read_whole(inputs.reader, f)
        except PrepError as e:
            raise PrepError(f"cannot use the eval set {p}: {e}") from None
        texts.append((copies.restored_tokens(s.tokens, s.offsets, s.mlm_positions, s.mlm_ids, s.mlm_offsets),
                      s.offsets))
        keys = copies.text_keys(texts[-1][0], s.offsets)
        for row, k in enumerate(keys.tolist()):
            where.setdefault(k, []).append((i, row))
        samples += len(keys)
        md5.setdefault(examples_md5(s), str(f.relative_to(root)))
    return _EvalSet([str(f.relative_to(root)) for f in paths], samples, where, md5, texts)


def _records(reader: ShardReader, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``path``'s example records, read again (as stored, as its scan read them) to confirm a
    repeat its keys suggest."""
    try:
        s = reader.wait(path, lambda read: reader.stored(read, path))
    except DataError as e:
        raise PrepError(str(e)) from None
    return example_records(s.tokens, s.segments, s.offsets, s.mlm_positions, s.mlm_ids, s.mlm_offsets, s.nsp)


def _size(p: Path) -> int:
    try:
        return shard_size(p)
    except DataError:
        return 0  # unreadable: its scan says why


def _listed(items: list[str]) -> str:
    more = len(items) - LISTED
    return ", ".join(items[:LISTED]) + (f" and {more} more" if more > 0 else "")


def _shard_copies(per_shard: dict[str, dict], names: list[str], table: copies.KeyTable, records_of: copies.Records,
                  found: dict[str, int], errors: list[str]) -> dict:
    """Whole shards with the same examples, then samples repeated across shards or within one
    (each confirmed by its record, ``records_of``): marks the shards, counts the defects, adds
    a line each; returns the JSON's ``copies``."""
    groups = copies.same_digest_groups({n: c["examples_md5"] for n, c in per_shard.items() if c.get("samples")})
    for g in groups:
        for other in g[1:]:
            per_shard[other]["copy_of"] = g[0]
        md5 = per_shard[g[0]]["examples_md5"]
        errors.append(f"{g[1]} holds the same examples as {g[0]} (examples_md5 {md5})" if len(g) == 2 else
                      f"{len(g) - 1} shards hold the same examples as {g[0]} (examples_md5 {md5}): {_listed(g[1:])}")
    rep = table.repeats(records_of)
    for i in np.flatnonzero(rep.per_shard):
        per_shard[names[i]]["repeated_samples"] = int(rep.per_shard[i])
    pairs = sorted(rep.pairs.items(), key=lambda kv: (-kv[1].samples, kv[0]))
    group_of = {n: k for k, g in enumerate(groups) for n in g}
    partial = [(ab, pc) for ab, pc in pairs  # pairs that are not two whole copies of one shard
               if group_of.get(names[ab[0]], -1) != group_of.get(names[ab[1]], -2)]
    if partial:
        def pair(a: int, b: int, pc: copies.PairCount) -> str:
            where = f"within {names[a]}" if a == b else f"{names[b]} repeats {names[a]}"
            return f"{where}: {pc.samples} (e.g. its sample {pc.rows[0][1]} = sample {pc.rows[0][0]})"
        n = sum(pc.samples for _, pc in partial)
        errors.append(f"{n} samples repeat an earlier sample beyond whole-shard copies ({len(partial)} pair(s) of "
                      "shards): " + "; ".join(pair(a, b, pc) for (a, b), pc in partial[:LISTED])
                      + (f"; and {len(partial) - LISTED} more pairs" if len(partial) > LISTED else ""))
    if groups:
        found["identical_shard"] = sum(len(g) - 1 for g in groups)
    if rep.copies:
        found["repeated_sample"] = rep.copies
    return {"identical_shards": groups, "repeated_samples": rep.copies, "short_repeats": rep.short,
            "key_collisions": rep.collisions,
            "pairs": [{"shards": [names[a], names[b]], "samples": pc.samples, "rows": [list(x) for x in pc.rows]}
                      for (a, b), pc in pairs[:SHOWN_PAIRS]],
            "pairs_total": len(pairs)}


def _eval_findings(ev: _EvalSet, eval_dir: str, found_eval: dict[tuple[int, int], bool],
                   per_training_shard: dict[str, int], examples: list[str], per_shard: dict[str, dict],
                   tolerance: float, found: dict[str, int], errors: list[str], notes: list[str]) -> dict:
    """The eval samples found in the training shards: a defect and a line above ``tolerance``
    of the eval set or when a training shard is an eval shard, else a note; returns the JSON's
    ``eval``."""
    long_found = sum(found_eval.values())
    held_by = dict(sorted(per_training_shard.items(), key=lambda kv: -kv[1]))
    for name, k in held_by.items():
        per_shard[name]["eval_samples"] = k
    whole = [name for name, c in per_shard.items() if c.get("examples_md5") in ev.md5 and c.get("samples")]
    for name in whole:
        errors.append(f"{name} holds the same examples as the eval set's {ev.md5[per_shard[name]['examples_md5']]}: "
                      "a copy of the eval set among the training shards")
    short = len(found_eval) - long_found
    if long_found:
        line = (f"{long_found} of the {ev.samples} eval samples in {eval_dir} are in the training shards "
                "(their text, masked positions restored"
                + (f"; {short} shorter ones match too, which chance can do" if short else "")
                + f"): held by {_listed([f'{n} ({k})' for n, k in held_by.items()])}; e.g. {examples[0]}")
        if whole or long_found > tolerance * ev.samples:
            found["eval_in_training"] = long_found
            errors.append(line)
        else:
            notes.append(f"{line}. That is {long_found / ev.samples:.2%} of the eval set, within --eval-tolerance "
                         f"{tolerance:g}: text the corpus holds twice (a boilerplate passage in two documents), "
                         "not a leak")
    return {"eval_dir": eval_dir, "eval_samples": ev.samples, "in_training": long_found, "short_matches": short,
            "training_shards": held_by, "examples": examples}


def check(input_dir: str | Path, vocab: Vocabulary = Vocabulary(), max_seq_length: int = 512,
          digests: str | Path = "", eval_dir: str | Path = "", workers: int = 1,
          eval_tolerance: float = EVAL_TOLERANCE, *, read_timeout_s: float = PREP_READ_TIMEOUT_S) -> dict:
    """Scan every shard under ``input_dir`` (recursively); return per-shard counts and
    ``examples_md5``, the totals, the copies (and, with ``eval_dir``, the eval samples found in
    the training shards: a defect above ``eval_tolerance`` of the eval set or when a whole eval
    shard is there), the [UNK] rate, the diagnosis, one line per finding that fails the check
    (``errors``) or does not (``notes``), and ``exit_status`` (0 clean, 1 a defect or a copy, 2
    shards of another vocabulary). ``digests``: also write the examples' md5 of each shard there.
    Each shard is read through the run's reader (its directory's md5 list, ``read_timeout_s``
    a file); one that differs from the list, or a read that overruns, is a ``PrepError``."""
    d = input_directory(input_dir, "shards")
    paths = shard_paths(d)
    if not paths:
        raise PrepError(f"{d}: holds no shard files ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    inputs = open_inputs(d, paths, every_listed=True, max_seq_length=max_seq_length, bounds=vocab.bounds(),
                         timeout_s=read_timeout_s, fingerprint=False)
    ev = _read_eval(Path(eval_dir), vocab, max_seq_length, read_timeout_s) if eval_dir else None
    eval_keys = np.array(sorted(ev.where), np.uint64) if ev else None
    names = [str(p.relative_to(d)) for p in paths]
    table = copies.KeyTable([_size(p) for p in paths])
    counters = (*DEFECTS, WRAP_SIGNATURE, SPECIALS_IN_PLACE, "nonempty")
    totals = dict.fromkeys(counters, 0)
    per_shard: dict[str, dict] = {}  # a shard's counts, filtered below once the totals are known
    samples = unk = tokens = 0
    found_eval: dict[tuple[int, int], bool] = {}  # eval sample -> long enough to count
    eval_per_shard: dict[str, int] = {}
    eval_examples: list[str] = []
    eval_collisions = 0  # training samples whose text key an eval sample has, not its text
    firsts: dict[str, dict[str, str]] = {}  # a shard's first offender of each defect
    jobs = [_Job(p, inputs.reader.only([p]), vocab, eval_keys) for p in paths]
    # One shard's result held at a time: its keys go into the table, nothing else keeps them.
    for i, (name, res) in enumerate(zip(names, parallel_iter(_scan_one, jobs, workers, "check"))):
        if "fatal" in res:
            raise PrepError(res["fatal"])
        if inputs.reader.manifest is not None:  # checked against the list as the scan read it
            inputs.reader.manifest.verified.add(str(paths[i]))
        if "error" in res:
            counts = {**dict.fromkeys(counters, 0), "unreadable": 1}
            per_shard[name] = {"unreadable": 1, "error": res["error"]}
        else:
            counts = res["counts"]
            samples, unk, tokens = samples + res["samples"], unk + res["unk"], tokens + res["tokens"]
            table.put(i, res["keys"])
            per_shard[name] = {"samples": res["samples"], "examples_md5": res["examples_md5"], **counts}
            firsts[name] = res["first"]
            for row, key, text in zip(res.get("eval_rows", ()), res.get("eval_keys", ()), res.get("eval_texts", ())):
                same_key = ev.where[int(key)]
                hits = [h for h in same_key if ev.holds(h, text)]  # the key's match confirmed by the text
                eval_collisions += len(same_key) - len(hits)
                if not hits:
                    continue
                for h in hits:
                    found_eval[h] = bool(key & 1)
                if key & 1:
                    eval_per_shard[name] = eval_per_shard.get(name, 0) + 1
                    if len(eval_examples) < LISTED:
                        f, r = hits[0]
                        eval_examples.append(f"{ev.files[f]} sample {r} = {name} sample {int(row)}")
        for k, v in counts.items():
            totals[k] += v
    # No sample where [CLS]/[SEP] must stand holds them: another vocabulary, not broken data.
    other_vocab = totals["nonempty"] > 0 and totals[SPECIALS_IN_PLACE] == 0
    hidden = (*VOCAB_DEPENDENT, SPECIALS_IN_PLACE, "nonempty") if other_vocab else (SPECIALS_IN_PLACE, "nonempty")
    per_shard = {name: {k: v for k, v in c.items() if (v or k == "samples") and k not in hidden}
                 for name, c in per_shard.items()}
    for name, first in firsts.items():  # the first offender of each defect counted, as a run words it
        if shown := {k: m for k, m in first.items() if k in per_shard[name]}:
            per_shard[name]["messages"] = shown
    if digests:
        write_text(Path(digests), "".join(f"{c['examples_md5']}  {name}\n" for name, c in per_shard.items()
                                          if "examples_md5" in c))
    found = {k: v for k, v in totals.items() if v and k != WRAP_SIGNATURE and k not in hidden}
    errors: list[str] = []  # one line per finding that fails the check
    notes: list[str] = []  # one line per finding that does not
    out = {"shards": len(paths), "samples": samples, "inputs_verified_against": inputs.verified_by(), "defects": found,
           "unk_rate": round(unk / tokens, 6) if tokens and not other_vocab else None,
           "copies": _shard_copies(per_shard, names, table, lambda i: _records(inputs.reader, paths[i]), found,
                                   errors)}
    if ev:
        out["eval"] = _eval_findings(ev, str(eval_dir), found_eval, eval_per_shard, eval_examples, per_shard,
                                     eval_tolerance, found, errors, notes)
        out["eval"]["key_collisions"] = eval_collisions
    for k in DEFECTS:
        if k in found:
            bad = [n for n, c in per_shard.items() if c.get(k)]
            first = per_shard[bad[0]]["error"] if k == "unreadable" else per_shard[bad[0]]["messages"][k]
            errors.append((f"{found[k]} samples with {k} in {len(bad)} shards: {_listed(bad)}" if k != "unreadable"
                           else f"{found[k]} unreadable shards: {_listed(bad)}") + f"; first: {first}")
    out["per_shard"] = per_shard
    out["diagnosis"] = diagnose(totals, out)
    out["errors"], out["notes"] = errors, notes
    out["exit_status"] = 1 if found else 0
    if other_vocab:
        out["other_vocabulary"] = (
            f"no sample begins with [CLS] (id {vocab.cls}) or ends with [SEP] (id {vocab.sep}): the shards seem to "
            "be made with another vocabulary; pass it with --vocab vocab.txt (or --cls-id/--sep-id/--vocab-size) "
            f"to check segments and special tokens ({', '.join(VOCAB_DEPENDENT)} not counted)")
        out["exit_status"] = 2
    return out


def diagnose(totals: dict[str, int], out: dict | None = None) -> list[str]:
    """Known causes the counts point to, each with what to do."""
    out = out or {}
    lines = []
    if totals.get(WRAP_SIGNATURE, 0):
        lines.append(
            f"{totals[WRAP_SIGNATURE]} samples end in exactly 256 padding tokens after their last [SEP]: the "
            "signature of NVIDIA's convert_fixed2variable.py run under NumPy >= 2. It sums the int8 input_mask "
            "with Python's sum(), which wraps modulo 256: samples of real length 128-255 gain 256 padding "
            "tokens, 256-383 are cut to L-256 (empty_sample/bad_segments/mask_outside), 512 are emptied. "
            "Rebuild the variable layout with this project's tools from the fixed-layout shards (or create's "
            "output): python -m input_preprocessing shard --input FIXED_DIR --output NEW_DIR "
            "--num-shards N --layout variable, then check NEW_DIR again.")
    if totals.get("id_out_of_vocab", 0):
        lines.append("ids outside the vocab: the shards were made with another vocab (pass it with --vocab) "
                     "or ids above 32767 overflowed int16")
    cp = out.get("copies", {})
    if cp.get("identical_shards"):
        every = len(cp["identical_shards"]) == 1 and len(cp["identical_shards"][0]) == out.get("shards")
        lines.append(
            ("every shard holds the same examples" if every else "whole shards repeat") + ": the signature of a "
            "shuffle or re-chop script that wrote the same samples into several shards. NVIDIA's "
            "shuffle_samples.py (mlcommons/training_results_v2.1, pytorch-22.09) never advanced its sample index, "
            "so every shard came out the same; runs on such data stalled at 0.62-0.63 masked-LM accuracy instead "
            "of reaching 0.720, with nothing saying why (mlcommons/training_results_v2.1 issue 10, "
            "mlcommons/training issue 659). Re-chop create's output with this project's tools: python -m "
            "input_preprocessing shard --input PARTS_DIR --output NEW_DIR --num-shards N, then check NEW_DIR "
            "again (and remove the copies from any directory a run reads).")
    elif cp.get("repeated_samples"):
        lines.append(
            "samples repeat across shards (or within one): copies made after create, by a shuffle or re-chop "
            "that wrote some samples twice, or a shard copied in part; create itself repeats an example of 32 "
            "tokens or more only by chance, far less than once in a dataset. Rebuild the shards from create's "
            "output (python -m input_preprocessing shard) and check them again.")
    if out.get("defects", {}).get("eval_in_training"):  # not for the few a note reports
        lines.append(
            "eval samples inside the training set: the logged accuracy is then not a held-out measure. Known "
            "causes: the eval shard copied among the training shards, or the held-out text also given to create "
            "as a training part. Make the eval set from text no training part holds (whole documents apart), "
            "and keep it out of the training directory.")
    rate = out.get("unk_rate")
    if rate is not None and rate > UNK_NOTE:
        lines.append(
            f"{rate:.2%} of the tokens are [UNK]: the vocab does not fit the text the shards were made from; the "
            "usual cause is a cased/uncased mismatch (an uncased vocab with create --cased), or --vocab names "
            "another vocab than the shards'")
    return lines
