"""A synthetic corpus in the MLPerf text format (``wordpiece.train_vocab`` makes its vocab).

For tests and the throughput benchmark, where the 20 GB Wikipedia text is not at hand.
Words are built from syllables and drawn from a Zipf law, so WordPiece learns real
subword splits and sentence/document lengths vary as in prose; the text is deterministic
in its seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "qua", "bri", "dol", "fen", "gar", "hul",
              "jis", "kor", "lam", "mor", "nus", "pel", "ras", "sul", "tor", "ul", "vin", "wex", "yor", "zan", "é")


def make_corpus(directory: str | Path, parts: int, docs_per_part: int, seed: int = 0, words: int = 5000) -> list[Path]:
    """Write ``parts`` text parts (one sentence a line, a blank line between documents)."""
    rng = np.random.default_rng(seed)
    lex = []
    while len(lex) < words:
        w = "".join(rng.choice(_SYLLABLES, size=rng.integers(1, 5)))
        lex.append(w)
    zipf = 1.0 / np.arange(1, words + 1)
    zipf /= zipf.sum()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for p in range(parts):
        docs = []
        for _ in range(docs_per_part):
            sents = []
            for _ in range(int(rng.integers(1, 30))):
                ws = [lex[i] for i in rng.choice(words, size=int(rng.integers(4, 40)), p=zipf)]
                ws[0] = ws[0].capitalize()
                if rng.random() < 0.3:
                    ws.insert(int(rng.integers(1, len(ws))), ",")
                sents.append(" ".join(ws) + rng.choice([".", ".", ".", "?", "!"]))
            docs.append("\n".join(sents))
        path = d / f"part-{p:05d}-of-{parts:05d}.txt"
        path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        out.append(path)
    return out

