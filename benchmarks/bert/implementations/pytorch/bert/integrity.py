"""Shards that prove their bytes: the md5 manifest a data directory carries (``md5sums.txt``,
written by ``python -m input_preprocessing checksum``), checked as each shard is read.

HDF5 keeps no checksum of its data: a flipped bit in a shard reads back as a changed token
without a word, and a lost sector can make it spin (bert/watchdog.py bounds that). Where the
directory has a manifest, every file the run reads is hashed the first time this process
reads it (the bytes then come from the page cache for h5py) and must match: a file that
changed, or one the manifest does not list, is an error naming it. Costs one md5 pass over
each file read, once per run (BENCHMARKS.md), in the reading thread: training shards in the
prefetch thread, beside the steps. A file read again (the next epoch, other rows of it) is
not hashed again: the check is of the data as the run first found it.

The format is ``md5sum``'s (``<md5>  <path relative to the directory>``, sorted), so
``cd DIR && md5sum -c md5sums.txt`` checks it too. Every data-preparation step that writes
shards writes their manifest with them, and every one that reads shards checks its inputs
against theirs (input_preprocessing/inputs.py). Torch-free.
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

from .shards import DataError

MANIFEST = "md5sums.txt"


def md5_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):  # hashlib releases the GIL on large blocks
            h.update(block)
    return h.hexdigest()


def format_manifest(sums: dict[str, str]) -> str:
    """A manifest's text: ``<md5>  <relative path>`` lines in path order (the order ``checksum``
    lists a directory in: the same directory gives the same bytes, whoever wrote them)."""
    return "".join(f"{h}  {rel}\n" for rel, h in sorted(sums.items(), key=lambda kv: PurePosixPath(kv[0])))


def parse_manifest(text: str, path: Path) -> dict[str, str]:
    """{relative path: md5} from a manifest's text; ``ValueError`` naming the bad line."""
    sums = {}
    for n, line in enumerate(text.splitlines(), 1):
        h, sep, rel = line.partition("  ")
        if not sep or len(h) != 32 or not rel:
            raise ValueError(f"{path}: line {n}: expected '<md5>  <path>', got {line!r}")
        sums[rel] = h
    return sums


class Manifest:
    """The manifest of one data directory (train or eval), or nothing to check (``find``)."""

    def __init__(self, root: Path, sums: dict[str, str]):
        self.root, self.sums = root, sums
        self.path = root / MANIFEST
        # Paths hashed and matched in this process, as they were given: a row read's file, the
        # thousandth time, is one lookup (no resolve per read).
        self.verified: set[str] = set()

    @staticmethod
    def find(root: str | Path) -> Manifest | None:
        """``root/md5sums.txt`` when there is one (a file's own directory for a single file)."""
        root = Path(root)
        root = root.parent if root.is_file() else root
        path = root / MANIFEST
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror}") from None
        try:
            return Manifest(root, parse_manifest(text, path))
        except ValueError as e:
            raise DataError(str(e)) from None

    def only(self, paths: list[Path]) -> Manifest:
        """This manifest for ``paths`` alone, what is known of them kept: what a worker process
        that reads them is handed (a small pickle, whatever the directory's size)."""
        rels = {Path(p).resolve().relative_to(self.root.resolve()).as_posix() for p in paths}
        part = Manifest(self.root, {rel: h for rel, h in self.sums.items() if rel in rels})
        part.verified = self.verified & {str(p) for p in paths}
        return part

    def missing(self) -> list[str]:
        """Why each file the manifest lists but the directory lacks is missing (one stat each)."""
        return [f"{self.root / rel}: listed in {self.path} but not there: removed or moved since the manifest was "
                "made; restore it from its source" for rel in self.sums if not (self.root / rel).is_file()]

    def unlisted(self, path: Path) -> str | None:
        """Why ``path`` is not one of the manifest's files, or None (it lists it)."""
        if Path(path).resolve().relative_to(self.root.resolve()).as_posix() in self.sums:
            return None
        return (f"{path}: not listed in {self.path}: the manifest does not describe this directory "
                f"(remake it: python -m input_preprocessing checksum --input {self.root})")

    def check(self, path: Path, md5: str | None = None) -> None:
        """Hash ``path`` (the first time only; ``md5``: its md5, taken by the caller in a pass
        of its own, not taken again); ``DataError`` unless the manifest lists it with that md5."""
        if str(path) in self.verified:
            return
        if why := self.unlisted(path):
            raise DataError(why)
        want = self.sums[Path(path).resolve().relative_to(self.root.resolve()).as_posix()]
        try:
            got = md5 if md5 is not None else md5_file(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such file (removed or moved since the directory was listed?)") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror}") from None
        if got != want:
            raise DataError(f"{path}: md5 {got}, but {self.path} says {want}: the file changed after the manifest "
                            f"was made (a damaged copy or disk); copy it again from the source")
        self.verified.add(str(path))
