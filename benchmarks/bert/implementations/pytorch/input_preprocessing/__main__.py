"""``python -m input_preprocessing <step> --help``: the data preparation steps, one CLI.

Each step writes into its own output directory through temp-file-then-rename and records
its parameters there, so rerunning an interrupted step with the same arguments resumes it
and an output directory holding a different run is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from .common import PrepError, default_workers

# name -> (one-line help, adds its arguments, runs it and returns a JSON-able summary)
STEPS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], object]]] = {}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="processes working in parallel, one input file each (default: the usable cores); "
                        "the output does not depend on it")


# ---------------------------------------------------------------- create


def _run_create(a: argparse.Namespace) -> object:
    from .create import CreateOptions, create

    opts = CreateOptions(a.max_seq_length, a.max_predictions_per_seq, a.masked_lm_prob, a.short_seq_prob,
                         a.dupe_factor, a.seed, not a.cased, a.layout, a.allow_empty_documents)
    return create(a.input, a.vocab, a.output, opts, a.workers, a.pattern)


def _create_args(p: argparse.ArgumentParser) -> None:
    from .create import CreateOptions

    d = CreateOptions()
    p.add_argument("--input", required=True, help="directory of text parts: one sentence per line, "
                   "a blank line between documents, UTF-8")
    p.add_argument("--pattern", default="*", help="glob of the parts inside --input (default: every non-hidden file)")
    p.add_argument("--vocab", required=True, help="WordPiece vocab.txt (one token per line; the MLPerf uncased vocab)")
    p.add_argument("--output", required=True, help="new directory: one <part>.hdf5 per text part")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--max-predictions-per-seq", type=int, default=d.max_predictions_per_seq)
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob)
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob)
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor, help="passes over each part, each masked anew")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of every part (as the reference runs it)")
    p.add_argument("--cased", action="store_true", help="keep case and accents (for a cased vocab)")
    p.add_argument("--layout", choices=("fixed", "variable"), default=d.layout)
    p.add_argument("--allow-empty-documents", action="store_true",
                   help="drop empty documents as the reference does, instead of stopping with an error")
    _workers(p)


STEPS["create"] = ("text parts + vocab -> pretraining examples (NSP + masked LM), one hdf5 per part",
                   _create_args, _run_create)


# ---------------------------------------------------------------- stratify


def _run_stratify(a: argparse.Namespace) -> object:
    from .stratify import stratify

    m = stratify(a.input, a.output, a.bounds, a.max_seq_length, a.workers)
    return {s["name"]: {"samples": s["samples"], "tokens": s["tokens"]} for s in m["strata"]}


def _stratify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="directory of hdf5 shards (either layout)")
    p.add_argument("--output", required=True, help="new directory: stratum_<k>_<lo>-<hi>/part_<i>.hdf5, manifest.json")
    p.add_argument("--bounds", type=_ints, default=[128, 256, 384, 512],
                   help="increasing inclusive upper bounds of the strata (default 128,256,384,512 = "
                        "1-128, 129-256, 257-384, 385-512)")
    p.add_argument("--max-seq-length", type=int, default=512)
    _workers(p)


STEPS["stratify"] = ("split shards by real length into strata + manifest.json + length_index.npz",
                     _stratify_args, _run_stratify)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m input_preprocessing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True, metavar="<" + "|".join(STEPS) + ">")
    for name, (help_, add_args, _) in STEPS.items():
        add_args(sub.add_parser(name, help=help_, description=help_))
    args = parser.parse_args(argv)
    try:
        summary = STEPS[args.step][2](args)
    except PrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
