"""What every preprocessing step shares: its error type, atomic writes, and the run record
that makes a step resumable and refuses to mix two different runs in one directory.

Every output file is written under a temporary name in its final directory and renamed
into place (atomic on POSIX), so an interrupted step leaves complete files and stray
``*.tmp`` files only; a rerun with the same arguments skips the complete files and
overwrites the temporaries. Each shard written is hashed before its rename, and the step
writes the md5 list of its output directory (``md5sums.txt``) with its shards: the directory
verifies from the moment it is complete, and a run on it checks every shard it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from bert.integrity import MANIFEST, format_manifest, md5_file
from bert.shards import DataError, Shard, write_shard

RUN_RECORD = ".run.json"  # in every output directory: which step, with which parameters


class PrepError(ValueError):
    """Bad input or output for a preprocessing step; the message names the file and the problem."""


def input_directory(path: str | Path, holding: str) -> Path:
    """``path`` as the input directory of a step (``holding``: what it should hold); a
    ``PrepError`` that says whether it is missing or a file."""
    d = Path(path)
    if d.is_dir():
        return d
    if d.exists():
        raise PrepError(f"{d}: is a file, not a directory; --input takes the directory of the {holding}")
    raise PrepError(f"{d}: no such input directory")


def reference_lines(path: Path, raw: bytes, what: str = "") -> list[str]:
    """The lines of a UTF-8 file as the reference reads them, each stripped (Python's
    ``str.strip``): a line ends at "\\n" only, as TensorFlow's GFile reads it, not at the other
    breaks ``str.splitlines()`` knows (U+2028/2029/0085, form feed, vertical tab, U+001C-1E, a
    lone "\\r"), which stay inside their line. Bytes that are not UTF-8 stop it with their line
    (``what`` names the file's role in the message)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise PrepError(f"{path}: line {line}: {what}not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the last "\n" ends a line; it starts none
        lines.pop()
    return [ln.strip() for ln in lines]


def tmp_path(path: Path) -> Path:
    # The pid keeps two concurrent writers (a stale run and a new one) off each other's file.
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def atomic_write(path: Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` then rename ``tmp`` to ``path``; the temporary is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_shard_atomic(path: Path, shard: Shard, layout: str, max_seq_length: int, max_predictions: int) -> str:
    """Write ``shard`` to ``path`` atomically; returns the md5 of the file written, taken before
    its rename (one pass over its bytes, from the page cache it was just written to)."""
    md5 = ""

    def write(tmp: Path) -> None:
        nonlocal md5
        write_shard(tmp, shard, layout, max_seq_length, max_predictions)
        md5 = md5_file(tmp)

    atomic_write(path, write)
    return md5


def write_md5_list(directory: Path, sums: dict[str, str]) -> Path:
    """``directory/md5sums.txt`` of the shards a step wrote there ({path relative to it: md5}),
    in ``checksum``'s format and order."""
    return write_text(directory / MANIFEST, format_manifest(sums))


def prepare_output(directory: str | Path, step: str, params: dict[str, Any]) -> Path:
    """Create ``directory`` for ``step`` or reopen it to resume the same run.

    ``params`` must describe everything that determines the output (arguments, input
    files and their contents, vocab digest). A directory holding another step's or another
    parameter set's run, or files but no run record, is refused with a ``PrepError``.
    """
    d = Path(directory)
    record = {"step": step, "params": params}
    rec_path = d / RUN_RECORD
    if d.exists() and not d.is_dir():
        raise PrepError(f"{d}: output path exists and is not a directory")
    if rec_path.is_file():
        try:
            old = json.loads(rec_path.read_text())
        except (OSError, ValueError) as e:
            raise PrepError(f"{rec_path}: unreadable run record ({e}); remove the directory to start over") from None
        if old != json.loads(json.dumps(record)):
            diff = sorted(k for k in set(old.get("params", {})) | set(params)
                          if old.get("params", {}).get(k) != json.loads(json.dumps(params)).get(k))
            what = f"step {old.get('step')!r}" if old.get("step") != step else f"different {', '.join(diff)}"
            raise PrepError(f"{d}: already holds a different run ({what}); use another output "
                            "directory or remove this one")
        return d
    if d.is_dir() and any(d.iterdir()):
        raise PrepError(f"{d}: is not empty and has no {RUN_RECORD}; not an output of this tool, refusing to write into it")
    d.mkdir(parents=True, exist_ok=True)
    write_json(rec_path, record)
    return d


@contextmanager
def step_output(directory: str | Path, step: str, params: dict[str, Any]) -> Iterator[Path]:
    """``prepare_output``'s directory, for a step that reads shards: where the step stops on bad
    input (a ``PrepError`` or ``DataError`` while it writes), a directory this call began is
    removed again (or emptied, when it was there empty before), so that bad input leaves no
    partial output behind; a resumed run's directory is left as it was."""
    d = Path(directory)
    existed, resumed = d.exists(), (d / RUN_RECORD).is_file()
    out = prepare_output(d, step, params)
    try:
        yield out
    except (PrepError, DataError):
        if not resumed:
            if existed:
                for child in out.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            else:
                shutil.rmtree(out, ignore_errors=True)
        raise


def file_fingerprint(paths: list[Path], root: Path, workers: int = 1) -> list[list[Any]]:
    """[relative name, size, md5] of each input: what the output was made from, by content. A
    shard remade with other samples often keeps its size (a fixed-layout shard's size is a
    function of its sample count), so a rerun over changed inputs must see the bytes, or it
    would reopen the old run and keep its stale output. Costs one md5 pass over the inputs
    (about 1.4 ms a MB a worker), which the step then reads anyway; the same pass checks the
    inputs against their md5 list (inputs.py)."""
    digests = parallel_map(md5_file, list(paths), workers, "md5")
    return [[str(p.relative_to(root)), p.stat().st_size, h] for p, h in zip(paths, digests)]


def shard_geometry(path: Path) -> tuple[str, int, int]:
    """(layout, S, P) of a shard from metadata: ``fixed`` with its padded sizes, or
    ``variable`` with 0, 0 (a vlen file does not record them)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if "input_ids" not in f or "masked_lm_positions" not in f:
                raise PrepError(f"{path}: not a pretraining shard (needs 'input_ids' and 'masked_lm_positions')")
            ids = f["input_ids"]
            if ids.ndim == 2:
                return "fixed", int(ids.shape[1]), int(f["masked_lm_positions"].shape[1])
            return "variable", 0, 0
    except OSError as e:
        raise PrepError(f"{path}: cannot open as hdf5: {e}") from None


def _worker_start() -> None:
    # Ctrl-C reaches every process of the terminal's process group: the workers leave it to
    # the main process, which stops the pool and says so once (no traceback per worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def parallel_map(fn: Callable[[Any], Any], items: list[Any], workers: int, desc: str) -> list[Any]:
    """``[fn(x) for x in items]`` over ``workers`` processes, in order, with a progress bar.

    Results come back in input order whatever the number of workers, so output built from
    them does not depend on it. ``workers <= 1`` runs in this process (no pickling).
    """
    return list(parallel_iter(fn, items, workers, desc))


def parallel_iter(fn: Callable[[Any], Any], items: list[Any], workers: int, desc: str) -> Iterator[Any]:
    """``parallel_map``'s results one at a time, as they come (in input order): a caller that
    keeps only what it needs of each holds one result, not all of them."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc=desc, unit="file", disable=None, leave=False)
    try:
        if workers <= 1 or len(items) <= 1:
            for x in items:
                yield fn(x)
                bar.update()
            return
        import multiprocessing as mp

        # SIGINT blocked while the workers start, so none is born with Python's handler; one
        # that comes meanwhile reaches this process when it is unblocked.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pool = mp.get_context("fork").Pool(min(workers, len(items)), initializer=_worker_start)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        with pool:
            for r in pool.imap(fn, items):
                yield r
                bar.update()
    finally:
        bar.close()


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def save_npz(path: Path, arrays: dict[str, Any]) -> Path:
    """``np.savez`` atomically (keys may hold '/', e.g. shard paths)."""
    import numpy as np

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            np.savez(f, **arrays)

    return atomic_write(path, write)
