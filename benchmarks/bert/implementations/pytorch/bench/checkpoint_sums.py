"""What proving a checkpoint's bytes costs: hash throughput, and writing and restoring a
checkpoint-sized file with and without its CRC-32 (bert/storage.py, bert/checkpoint.py).

    python bench/checkpoint_sums.py [--mib 1024] [--dir DIR] [--repeats 3] [--out FILE.json]

Hashes: CRC-32 (zlib), sha256, sha1, blake2b and md5 over one in-memory buffer of --mib MiB,
CPU time. Files: a state dict of float32 tensors totalling --mib MiB (a BERT-Large train.pt
is ~4 GiB: weights and LAMB's two moments), written as a checkpoint file is
(``storage.save_torch``: temp file, fsync, rename; the CRC summed as the bytes go out) or
through the same file object with the sum left out; restored as bert/checkpoint.py restores (the file
summed, then ``torch.load``) or loaded alone. The restore reads a file just written, from the
page cache: the sum's cost, not the disk's. Medians of --repeats, the cases interleaved;
process CPU seconds beside wall seconds (the machine may be shared).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent
if str(PKG) not in sys.path:  # scripts run as `python bench/x.py`: import this checkout's bert
    sys.path.insert(0, str(PKG))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from bert import storage  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn, repeats: int) -> dict[str, float]:
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = cpu_s(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_s() - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


HASHES = {
    "crc32": lambda b: zlib.crc32(b),
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "blake2b": lambda b: hashlib.blake2b(b).digest(),
    "md5": lambda b: hashlib.md5(b).digest(),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="size of the buffer and of the checkpoint file")
    ap.add_argument("--dir", default="", help="where the files go (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="JSON file for the numbers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.mib << 20
    out: dict = {"mib": args.mib, "repeats": args.repeats, "machine": machine(), "hash_gib_per_cpu_s": {}}

    buf = os.urandom(n)
    for name, fn in HASHES.items():
        t = timed(lambda fn=fn: fn(buf), args.repeats)
        out["hash_gib_per_cpu_s"][name] = args.mib / 1024 / t["cpu_s"]
    del buf

    # Tensors of a transformer's sizes: 16 MiB each (a 2048 x 2048 float32 matrix).
    state = {f"t{i}": torch.randn(2048, 2048) for i in range(max(1, args.mib // 16))}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as d:
        path = Path(d) / "train.pt"

        class Passing:  # the same file object as storage's, without the CRC: the sum's cost alone
            def __init__(self, f):
                self.f = f

            def write(self, data):
                return self.f.write(data)

            def flush(self):
                self.f.flush()

        def write_plain() -> None:
            tmp = path.with_name(path.name + ".part")
            with open(tmp, "wb") as f:
                torch.save(state, Passing(f))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

        def restore_summed() -> None:
            storage.sum_file(path)
            torch.load(path, map_location="cpu", weights_only=True)

        cases = {"write_plain": write_plain, "write_summed": lambda: storage.save_torch(state, path),
                 "restore_plain": lambda: torch.load(path, map_location="cpu", weights_only=True),
                 "restore_summed": restore_summed}
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
        write_plain()  # the file exists and its blocks are allocated before anything is timed
        for i in range(args.repeats):  # interleaved, the order rotating: drift hits every case alike
            for key in (list(cases) if i % 2 == 0 else list(cases)[::-1]):
                runs[key].append(timed(cases[key], 1))
        for key, rs in runs.items():
            out[key] = {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "cpu_s")}
        out["file_bytes"] = path.stat().st_size
    out["load_average"] = os.getloadavg()

    print(f"{args.mib} MiB, medians of {args.repeats}; load average {out['load_average'][0]:.1f}")
    print("hash      GiB per CPU-s")
    for name, v in out["hash_gib_per_cpu_s"].items():
        print(f"  {name:8s} {v:6.2f}")
    print("checkpoint file        wall s   CPU s")
    for key in ("write_plain", "write_summed", "restore_plain", "restore_summed"):
        print(f"  {key:18s} {out[key]['wall_s']:8.3f} {out[key]['cpu_s']:7.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
