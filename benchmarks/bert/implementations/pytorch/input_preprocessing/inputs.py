"""The shards a data-preparation step reads, on the run's road: checked against the md5 list
their directory carries, and read through the run's reader.

Before a step writes anything, the directory's ``md5sums.txt`` (where it has one; a strata
directory's lists its stratum files) must describe what is there: every file it lists present,
every shard present listed, and, for a step that fingerprints its inputs for its run record
(``shard``, ``stratify``, ``eval``), each with its listed md5. That fingerprint is the md5
pass: each input is read once to hash it, and the reader then knows it as verified and reads
it once more only to decode it. A step without a run record (``check``, ``stats``) has each
shard hashed as it reads it, as a run does. A changed, missing or unlisted shard stops the step
(exit 2) naming it and the list, in a run's words, with nothing written.

Every read then goes through ``bert.reader.ShardReader``: under the watchdog's bound
(``--read-timeout-s``: a damaged file on which HDF5 spins is named, not waited on forever),
decoded by the run's decoder (its structure and values) with the model's bounds the step knows
(the sequence length; the vocab where it is given). A directory without a list is read
unverified, as a run reads it, and the step's summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert.reader import ShardReader
from bert.shards import Bounds, DataError, Findings, Shard, Specials

from .common import PrepError, file_fingerprint

TIMEOUT_KEY = "--read-timeout-s"  # the option that sets the reads' bound, named when one overruns it
NAMED = 3  # problems named in one message, the rest counted


@dataclass
class Inputs:
    """A step's input shards, verified as far as ``open_inputs`` says, and their reader."""

    root: Path  # the directory whose md5 list describes them
    paths: list[Path]
    reader: ShardReader
    fingerprint: list[list[Any]]  # [relative name, size, md5] of each, for the run record ([] without one)

    def read(self, path: Path) -> Shard:
        """Every sample of ``path``, checked as a run checks it; bad data is a ``PrepError``."""
        return read_whole(self.reader, path)

    def verified_by(self) -> str | None:
        """The md5 list the inputs are checked against, or None (the directory has none)."""
        return str(self.reader.manifest.path) if self.reader.manifest is not None else None


def read_whole(reader: ShardReader, path: Path) -> Shard:
    """Every sample of ``path`` through ``reader`` (its bound, its md5 list, the decoder's checks);
    bad data is a ``PrepError`` naming it."""
    try:
        return reader.wait(path, lambda read: reader.whole(read, path))
    except DataError as e:
        raise PrepError(str(e)) from None


def scan(reader: ShardReader, path: Path, specials: Specials | None) -> Findings:
    """Every defect of ``path`` (the run's decoder, collecting); a file that differs from its md5
    list, or a read that overruns, is a ``PrepError``: the shard cannot be checked."""
    try:
        return reader.wait(path, lambda read: reader.scan(read, path, specials))
    except DataError as e:
        raise PrepError(str(e)) from None


def open_inputs(root: Path, paths: list[Path], *, every_listed: bool, max_seq_length: int | None,
                bounds: Bounds | None = None, timeout_s: float, fingerprint: bool, workers: int = 1) -> Inputs:
    """``paths`` (shards in or under the directory ``root``) checked against ``root``'s md5 list:
    a ``PrepError`` naming every file that is unlisted, (``every_listed``: the step reads the
    whole directory) listed but missing, or (``fingerprint``: hashed here, in the one pass that
    also fingerprints them for the run record) changed, and the list; nothing is written."""
    try:
        reader = ShardReader(root, max_seq_length=max_seq_length, bounds=bounds, verify_md5=True, timeout_s=timeout_s,
                             timeout_key=TIMEOUT_KEY)
    except DataError as e:  # a list that cannot be read or parsed
        raise PrepError(str(e)) from None
    manifest = reader.manifest
    problems: list[str] = []
    if manifest is not None:
        problems += manifest.missing() if every_listed else []
        problems += [why for p in paths if (why := manifest.unlisted(p))]
    prints = file_fingerprint(paths, root, workers) if fingerprint and not problems else []
    if manifest is not None:
        for p, (_, _, md5) in zip(paths, prints):
            try:
                manifest.check(p, md5=md5)  # known as verified from here: the reader does not hash it again
            except DataError as e:
                problems.append(str(e))
    if problems:
        more = len(problems) - NAMED
        raise PrepError("; ".join(problems[:NAMED]) + (f"; and {more} more" if more > 0 else "") + "; nothing written")
    return Inputs(root, paths, reader, prints)
