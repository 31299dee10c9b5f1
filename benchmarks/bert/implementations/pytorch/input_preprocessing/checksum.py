"""checksum / verify: an md5 manifest of every shard under a directory, and its check.

The manifest is ``md5sum`` format (``<md5>  <path relative to the directory>``, sorted),
so ``cd DIR && md5sum -c md5sums.txt`` checks it too. Shards are found recursively, which
covers the per-stratum subdirectories.
"""

from __future__ import annotations

from pathlib import Path

from bert.integrity import MANIFEST, md5_file, parse_manifest
from bert.shards import SHARD_SUFFIXES

from .common import PrepError, input_directory, parallel_map, write_text


def find_shards(directory: Path) -> list[Path]:
    input_directory(directory, "shards")
    found = sorted(p for p in directory.rglob("*") if p.suffix in SHARD_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not found:
        raise PrepError(f"{directory}: holds no shard files")
    return found


def _digest(path: Path) -> str:
    return md5_file(path)


def checksum(directory: str | Path, manifest: str | Path = "", workers: int = 1) -> dict:
    """Write the manifest (default ``DIR/md5sums.txt``); returns {relative path: md5}."""
    d = Path(directory)
    paths = find_shards(d)
    digests = parallel_map(_digest, paths, workers, "md5")
    sums = {p.relative_to(d).as_posix(): h for p, h in zip(paths, digests)}
    write_text(Path(manifest) if manifest else d / MANIFEST, "".join(f"{h}  {rel}\n" for rel, h in sums.items()))
    return sums


def read_manifest(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PrepError(f"{path}: no checksum manifest (run the 'checksum' step first)") from None
    try:
        return parse_manifest(text, path)
    except ValueError as e:
        raise PrepError(str(e)) from None


def verify(directory: str | Path, manifest: str | Path = "", workers: int = 1) -> dict:
    """Recompute every listed shard's md5; ``PrepError`` lists mismatched, missing and unlisted files."""
    d = Path(directory)
    m = Path(manifest) if manifest else d / MANIFEST
    want = read_manifest(m)
    present = {p.relative_to(d).as_posix() for p in find_shards(d)} if d.is_dir() else set()
    missing = sorted(set(want) - present)
    unlisted = sorted(present - set(want))
    listed = sorted(set(want) & present)
    got = dict(zip(listed, parallel_map(_digest, [d / r for r in listed], workers, "verify")))
    bad = [r for r in listed if got[r] != want[r]]
    if bad or missing or unlisted:
        parts = [f"{len(bad)} changed (e.g. {bad[:3]})"] if bad else []
        parts += [f"{len(missing)} missing (e.g. {missing[:3]})"] if missing else []
        parts += [f"{len(unlisted)} not in the manifest (e.g. {unlisted[:3]})"] if unlisted else []
        raise PrepError(f"{d}: verification against {m} failed: " + "; ".join(parts))
    return {"verified": len(listed), "manifest": str(m)}
