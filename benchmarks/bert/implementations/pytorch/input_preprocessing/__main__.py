"""``python -m input_preprocessing <step> --help``: the data preparation steps, one CLI.

Each step writes into its own output directory through temp-file-then-rename and records
its parameters there, so rerunning an interrupted step with the same arguments resumes it
and an output directory holding a different run is refused.

Every step that reads shards checks them against the md5 list their directory carries
(``md5sums.txt``) before it writes anything, and reads them through the run's reader (the
watchdog's bound, ``--read-timeout-s``); every step that writes shards writes their md5 list
with them.

Exit statuses: 0 done; 1 ``check`` found a defect or a copy; 2 bad input (one line naming it);
130 interrupted (Ctrl-C: one line, what is complete stays, the same command resumes); 141 the
reader of the JSON on stdout went away (a closed pipe, as ``| head`` closes it): quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import typing
from pathlib import Path
from typing import Callable

# Every import that takes time (numpy, h5py, torch) happens inside main(), where Ctrl-C is
# answered with one line: an interrupt during the start-up imports would print a traceback.

SHOWN = 20  # check's shard entries printed without --per-shard

# name -> (one-line help, adds its arguments, runs it and returns a JSON-able summary)
STEPS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], object]]] = {}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _workers(p: argparse.ArgumentParser) -> None:
    from .common import default_workers

    p.add_argument("--workers", type=int, default=default_workers(),
                   help="processes working in parallel, one input file each (default: the usable cores); "
                        "the output does not depend on it")


def _reads(p: argparse.ArgumentParser) -> None:
    from bert.config import PREP_READ_TIMEOUT_S

    p.add_argument("--read-timeout-s", type=float, default=PREP_READ_TIMEOUT_S,
                   help=f"seconds one shard may take to read (default {PREP_READ_TIMEOUT_S:g}): past it the step "
                        "stops (exit 2) naming the file, a damaged one on which HDF5 spins or a hung filesystem")


# ---------------------------------------------------------------- create


def _run_create(a: argparse.Namespace) -> object:
    from .create import CreateOptions, create

    opts = CreateOptions(a.max_seq_length, a.max_predictions_per_seq, a.masked_lm_prob, a.short_seq_prob,
                         a.dupe_factor, a.seed, not a.cased, a.layout, a.strict_documents)
    return create(a.input, a.vocab, a.output, opts, a.workers, a.pattern, max_unk_rate=a.max_unk_rate,
                  allow_same_text=a.allow_same_text)


def _create_args(p: argparse.ArgumentParser) -> None:
    from .create import MAX_UNK_RATE, MIN_UNK_TOKENS, CreateOptions
    from .wordpiece import UNICODE_VERSION

    p.description = (
        "The reference's create_pretraining_data.py and tokenization.py (Google BERT's, as MLPerf runs them on "
        "each part): for a text part, a vocab and the same flags, the examples it writes, in its order, one hdf5 "
        "per part. Its algorithms, restated: a line ends at \"\\n\" only; the character classes (whitespace, "
        "control, punctuation, accents stripped, CJK) and the lowercasing are Python's unicodedata and str.lower(), "
        f"here Unicode {UNICODE_VERSION} (Python {platform.python_version()}); its random draws, from "
        "random.Random(seed) per part.")
    d = CreateOptions()
    p.add_argument("--input", required=True, help="directory of text parts: one sentence per line, "
                   "a blank line between documents, UTF-8")
    p.add_argument("--pattern", default="*", help="glob of the parts inside --input (default: every non-hidden file)")
    p.add_argument("--vocab", required=True, help="WordPiece vocab.txt (one token per line, each once, id = line "
                   "number; the MLPerf uncased vocab)")
    p.add_argument("--output", required=True, help="new directory: one <part>.hdf5 per text part")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--max-predictions-per-seq", type=int, default=d.max_predictions_per_seq)
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob)
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob)
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor, help="passes over each part, each masked anew")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of every part (as the reference runs it)")
    p.add_argument("--cased", action="store_true", help="keep case and accents (for a cased vocab)")
    p.add_argument("--layout", choices=("fixed", "variable"), default=d.layout)
    p.add_argument("--strict-documents", action="store_true",
                   help="stop at the first empty document (two blank lines in a row, or lines without "
                        "tokens) instead of dropping and counting it as the reference does")
    p.add_argument("--max-unk-rate", type=float, default=MAX_UNK_RATE,
                   help=f"refuse text whose tokens are more than this share [UNK] (default {MAX_UNK_RATE:g}; judged on "
                        f"{MIN_UNK_TOKENS} tokens or more): the sign of a vocab that does not fit the text, usually "
                        "an uncased vocab with --cased")
    p.add_argument("--allow-same-text", action="store_true",
                   help="make parts with the same text anyway (refused by default: every part is seeded alike, so "
                        "two copies of a text give the same examples twice)")
    _workers(p)


STEPS["create"] = ("text parts + vocab -> pretraining examples (NSP + masked LM), one hdf5 per part",
                   _create_args, _run_create)


# ---------------------------------------------------------------- stratify


def _run_stratify(a: argparse.Namespace) -> object:
    from .stratify import stratify

    from bert.integrity import Manifest

    m = stratify(a.input, a.output, a.bounds, a.max_seq_length, a.workers, read_timeout_s=a.read_timeout_s)
    listed = Manifest.find(a.input)  # the list stratify checked its inputs against
    return {**{s["name"]: {"samples": s["samples"], "tokens": s["tokens"]} for s in m["strata"]},
            "inputs_verified_against": str(listed.path) if listed else None}


def _stratify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="directory of hdf5 shards (either layout)")
    p.add_argument("--output", required=True, help="new directory: stratum_<k>_<lo>-<hi>/part_<i>.hdf5, manifest.json")
    p.add_argument("--bounds", type=_ints, default=[128, 256, 384, 512],
                   help="increasing inclusive upper bounds of the strata (default 128,256,384,512 = "
                        "1-128, 129-256, 257-384, 385-512)")
    p.add_argument("--max-seq-length", type=int, default=512)
    _workers(p)
    _reads(p)


STEPS["stratify"] = ("split shards by real length into strata + manifest.json + length_index.npz",
                     _stratify_args, _run_stratify)


# ---------------------------------------------------------------- shard, eval, checksum, verify, stats


def _shard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="directory of hdf5 parts (e.g. the output of create)")
    p.add_argument("--output", required=True, help="new directory: part_<j>_of_<N>.hdf5")
    p.add_argument("--num-shards", type=int, required=True, help="N (MLPerf uses 2048 or 4320)")
    p.add_argument("--layout", choices=("fixed", "variable"), default="variable")
    p.add_argument("--max-seq-length", type=int, default=512, help="padded length of a fixed-layout output")
    p.add_argument("--max-predictions", type=int, default=76, help="prediction slots of a fixed-layout output")
    _workers(p)
    _reads(p)


def _run_shard(a: argparse.Namespace) -> object:
    from .shard import shard

    return shard(a.input, a.output, a.num_shards, a.layout, a.max_seq_length, a.max_predictions, a.workers,
                 read_timeout_s=a.read_timeout_s)


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.description = ("The reference's pick_eval_samples.py: of the N eval examples (the input files in sorted "
                     "order), sample int(i * (N / n)) for i < n, the ratio a float, as it computes it.")
    p.add_argument("--input", required=True, help="hdf5 file or directory of the eval examples (create's output)")
    p.add_argument("--output", required=True, help="new directory for eval_10k.hdf5")
    p.add_argument("--num-samples", type=int, default=10000)
    p.add_argument("--or-fewer", action="store_true",
                   help="with fewer eval examples than --num-samples, take them all (the summary says how many) "
                        "instead of refusing: for a held-out text of your own that is too small")
    p.add_argument("--layout", choices=("", "fixed", "variable"), default="", help="default: the input's")
    p.add_argument("--max-seq-length", type=int, default=512, help="for a fixed output from variable input")
    p.add_argument("--max-predictions", type=int, default=76, help="for a fixed output from variable input")
    _reads(p)


def _run_eval(a: argparse.Namespace) -> object:
    from .pick_eval import pick_eval

    return pick_eval(a.input, a.output, a.num_samples, a.layout, a.max_seq_length, a.max_predictions,
                     or_fewer=a.or_fewer, read_timeout_s=a.read_timeout_s)


def _sum_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="directory of shards (searched recursively)")
    p.add_argument("--manifest", default="", help="md5 manifest path (default: INPUT/md5sums.txt)")
    _workers(p)


def _run_checksum(a: argparse.Namespace) -> object:
    from .checksum import checksum

    return {"files": len(checksum(a.input, a.manifest, a.workers))}


def _run_verify(a: argparse.Namespace) -> object:
    from .checksum import verify

    return verify(a.input, a.manifest, a.workers)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="directory of shards (searched recursively)")
    p.add_argument("--output", required=True, help="directory for stats.json and length_histogram.png")
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument("--vocab", default="", help="vocab.txt the shards were made with, for its [UNK] id (default: "
                   "--unk-id)")
    p.add_argument("--unk-id", type=int, default=100, help="id of [UNK] (default: the MLPerf uncased vocab's, 100)")
    _reads(p)


def _run_stats(a: argparse.Namespace) -> object:
    from .create import load_vocab
    from .stats import stats

    vocab = load_vocab(a.vocab) if a.vocab else None
    return stats(a.input, a.output, a.max_seq_length, vocab.unk if vocab else a.unk_id,
                 vocab_size=vocab.size if vocab else None, read_timeout_s=a.read_timeout_s)


def _ckpt_args(p: argparse.ArgumentParser) -> None:
    from bert.config import ModelConfig

    p.add_argument("--input", required=True, help="TF checkpoint prefix (model.ckpt-28252), "
                   "Hugging Face directory/file, or a state dict saved by this project")
    p.add_argument("--output", required=True, help="a .pt file (our state dict) or, with --to hf, a directory")
    p.add_argument("--to", choices=("pt", "hf"), default="pt")
    p.add_argument("--bert-config", default="", help="the model's architecture: the run's resolved config "
                   "(<log>_config.json beside its MLPerf log), Google's bert_config.json or Hugging Face's "
                   "config.json (default: BERT-Large, said in the output)")
    activations = typing.get_args(typing.get_type_hints(ModelConfig)["activation"])
    p.add_argument("--activation", default="", choices=activations,
                   help="the GELU the weights were trained with (model.activation), written into a --to hf export's "
                        "config.json so that it computes what was trained (default: the --bert-config's hidden_act "
                        "in the meaning of whoever wrote it -- Google's 'gelu' is gelu_tanh, Hugging Face's 'gelu' "
                        "gelu_erf -- else gelu_tanh, the reference's)")


def _run_ckpt(a: argparse.Namespace) -> object:
    import dataclasses

    import torch

    from bert.weights import CheckpointError, config_from_bert_json, export_hf, load_weights
    from bert.config import ModelConfig

    from .common import PrepError, atomic_write

    try:
        cfg = config_from_bert_json(a.bert_config) if a.bert_config else ModelConfig()
        if a.activation:
            cfg = dataclasses.replace(cfg, activation=a.activation)
        state = load_weights(a.input, cfg)
    except CheckpointError as e:
        hint = "" if a.bert_config else (" (no --bert-config: BERT-Large was assumed; for a model of your own give "
                                          "--bert-config <the run's log>_config.json)")
        raise PrepError(f"{e}{hint}") from None
    if a.to == "hf":
        export_hf(state, cfg, a.output)
    else:
        atomic_write(Path(a.output), lambda t: torch.save(state, t))
    return {"tensors": len(state), "parameters": sum(v.numel() for k, v in state.items()
                                                     if not k.startswith("cls.predictions.decoder")),
            "activation": cfg.activation,
            "architecture": a.bert_config or "BERT-Large (the default: no --bert-config)",
            "output": a.output}


def _check_args(p: argparse.ArgumentParser) -> None:
    from .check import EVAL_TOLERANCE

    p.add_argument("--input", required=True, help="directory of shards, fixed or variable layout (searched recursively)")
    p.add_argument("--vocab", default="", help="vocab.txt the shards were made with (default: the MLPerf uncased "
                   "vocab's facts, or the options below)")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--cls-id", type=int, default=101)
    p.add_argument("--sep-id", type=int, default=102)
    p.add_argument("--unk-id", type=int, default=100)
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument("--eval", default="", metavar="EVAL_DIR",
                   help="the eval set (eval's output directory or file): count its samples whose text (masked "
                        "positions restored) a training shard holds, name those shards, exit 1 on any")
    p.add_argument("--eval-tolerance", type=float, default=EVAL_TOLERANCE, metavar="FRACTION",
                   help="eval samples found in training that only make a note, as a share of the eval set (default "
                        f"{EVAL_TOLERANCE:g}: passages a corpus holds twice; a leak is most of the set)")
    p.add_argument("--per-shard", action="store_true",
                   help="print every shard's entry (samples, examples_md5, counts); by default only the shards "
                        f"with a finding, at most {SHOWN}")
    p.add_argument("--digests", default="", help="also write each shard's examples_md5 (the md5 of its examples, "
                   "the same in either layout) to this file, '<md5>  <shard>' a line: compare it with the same "
                   "file made from shards made elsewhere, part by part")
    p.add_argument("--workers", type=int, default=1,
                   help="shards checked at once, in as many processes (default 1: each holds a shard in memory)")
    _reads(p)


def _run_check(a: argparse.Namespace) -> object:
    from .check import Vocabulary, check

    vocab = Vocabulary.from_file(a.vocab) if a.vocab else Vocabulary(a.vocab_size, a.cls_id, a.sep_id, a.unk_id)
    out = check(a.input, vocab, a.max_seq_length, a.digests, a.eval, a.workers, a.eval_tolerance,
                read_timeout_s=a.read_timeout_s)
    if "other_vocabulary" in out:
        print(f"error: {a.input}: {out['other_vocabulary']}", file=sys.stderr)
    for line in out.pop("errors"):
        print(f"error: {a.input}: {line}", file=sys.stderr)
    for line in out.pop("notes"):
        print(f"note: {a.input}: {line}", file=sys.stderr)
    for line in out.pop("diagnosis"):
        print(f"diagnosis: {line}", file=sys.stderr)
    if not a.per_shard:
        flagged = {n: c for n, c in out["per_shard"].items() if set(c) - {"samples", "examples_md5"}}
        out["per_shard"] = dict(list(flagged.items())[:SHOWN])
        out["shards_with_findings"] = len(flagged)
        if len(flagged) > SHOWN:
            out["per_shard_not_shown"] = len(flagged) - SHOWN  # --per-shard prints them all
    return out


def _vocab_args(p: argparse.ArgumentParser) -> None:
    from .wordpiece import TIE_BREAK

    p.epilog = ("The same corpus and options give the same vocab.txt, byte for byte, on every run and machine "
                "(Hugging Face tokenizers' WordPiece trainer, its starting pieces numbered first). " + TIE_BREAK)
    p.add_argument("--input", required=True, help="directory of text parts (the format create reads)")
    p.add_argument("--pattern", default="*", help="glob of the parts inside --input (default: every non-hidden file)")
    p.add_argument("--output", required=True, help="the vocab.txt to write, one token per line")
    p.add_argument("--size", type=int, default=30522, help="tokens, special ones included (default: BERT's 30,522)")
    p.add_argument("--cased", action="store_true", help="keep case and accents (then create with --cased too)")


def _run_vocab(a: argparse.Namespace) -> object:
    from .common import PrepError
    from .wordpiece import train_vocab

    files = sorted(f for f in Path(a.input).glob(a.pattern) if f.is_file() and not f.name.startswith("."))
    if not files:
        raise PrepError(f"{a.input}: no text parts match {a.pattern!r}")
    path = train_vocab(files, a.output, a.size, lowercase=not a.cased)
    return {"tokens": len(path.read_text(encoding="utf-8").splitlines()), "parts": len(files), "output": a.output}


STEPS["shard"] = ("re-chop hdf5 parts into N shards, fixed or variable layout", _shard_args, _run_shard)
STEPS["eval"] = ("pick the evenly spaced eval set (10,000 samples) from the eval examples", _eval_args, _run_eval)
STEPS["vocab"] = ("train a WordPiece vocab.txt on your own corpus (BERT's special tokens first; the same bytes "
                  "every run)",
                  _vocab_args, _run_vocab)
STEPS["checksum"] = ("write an md5 manifest of every shard", _sum_args, _run_checksum)
STEPS["verify"] = ("check shards against their md5 manifest (exit 2 on any difference)", _sum_args, _run_verify)
STEPS["checkpoint"] = ("convert model weights: TF phase-1 checkpoint / HF / ours -> ours (.pt) or HF",
                       _ckpt_args, _run_ckpt)
STEPS["check"] = ("scan every sample of every shard for defects and copies (and, with --eval, the eval set inside "
                   "the training set); exit 1 on any, 2 when it cannot check",
                  _check_args, _run_check)
STEPS["stats"] = ("length histogram, tokens, padding fraction: stats.json + length_histogram.png",
                  _stats_args, _run_stats)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = argparse.ArgumentParser(prog="python -m input_preprocessing", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        sub = parser.add_subparsers(dest="step", required=True, metavar="<" + "|".join(STEPS) + ">")
        for name, (help_, add_args, _) in STEPS.items():
            add_args(sub.add_parser(name, help=help_, description=help_))
        args = parser.parse_args(argv)
        from .common import PrepError

        try:
            summary = STEPS[args.step][2](args)
        except PrepError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rc = summary.pop("exit_status", 0) if isinstance(summary, dict) else 0
        print(json.dumps(summary, indent=1), flush=True)
        return rc
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): the files written so far are complete; the same command resumes",
              file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): nothing more to say to it. Point stdout at
        # /dev/null so the interpreter's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _stuck_read() -> bool:
    """A read still in h5py past its bound (bert/watchdog.py's daemon thread): the interpreter's
    teardown would wait on h5py's lock for good."""
    import threading

    return any(t.name == "bounded-read" and t.is_alive() for t in threading.enumerate())


if __name__ == "__main__":
    status = main()
    if _stuck_read():  # what was printed is flushed; the process ends without its teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
