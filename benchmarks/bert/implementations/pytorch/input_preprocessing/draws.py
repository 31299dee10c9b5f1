"""The reference's random draws, made faster: what ``random.Random(seed)``'s ``random()``,
``randint()`` and ``shuffle()`` return, computed from the generator's own stream of 32-bit
words.

CPython's ``Random`` makes every draw the reference uses from the Mersenne Twister's 32-bit
outputs: ``random()`` takes two (``(a >> 5) * 2**26 + (b >> 6)``, over ``2**53``);
``randint(a, b)`` is ``a + below(b - a + 1)``; ``shuffle`` walks ``i`` down from ``len - 1``
to 1 and swaps ``x[i]`` with ``x[below(i + 1)]``; ``below(n)`` takes one word per try, keeps its
top ``n.bit_length()`` bits and tries again while they are ``>= n``. ``getrandbits(32 * k)``
hands out the next ``k`` words at once (least significant first), so the words are drawn in
bulk and the draws are restated on them, with two made for the masking, ~95% of a part's
draws: ``shuffle_head`` (the first n items of a shuffle, the same words used) and
``mask_kinds`` (the 80/10/10 draws of n masked positions), and one for the trimming of a pair,
``halves`` (n coin flips ``random() < 0.5``), each a loop over the words with no call per draw.

``reference_random(seed)`` returns ``Stream(seed)`` when it reproduces ``random.Random(seed)``
draw for draw on the running interpreter (checked on a sample of each kind of draw), and
``Exact(seed)`` otherwise, which makes every draw through ``random.Random`` itself: either way
the draws are the reference's.
"""

from __future__ import annotations

import array
import fractions
import math
import random
import sys

_CHUNK = 1 << 16  # words drawn at a time (256 kB); a part of 1 MB uses ~4 million
_WORD = "I"  # unsigned 32 bits wherever CPython builds (elsewhere _agrees fails and Exact is used)
_TWO_POW_53 = 1.0 / 9007199254740992.0
MASK, KEEP = -1, -2  # mask_kinds: [MASK], the original token; otherwise a random vocabulary id


def _split_threshold(x: float) -> tuple[int, int]:
    """``random() < x`` as a test on the two words' kept bits: (high, low) of ceil(x * 2**53)."""
    return divmod(math.ceil(fractions.Fraction(x) * (1 << 53)), 1 << 26)


_P80, _P50 = _split_threshold(0.8), _split_threshold(0.5)  # the masking's two draws


class Exact(random.Random):
    """The reference's draws made by ``random.Random`` itself (the fallback)."""

    def shuffle_head(self, x: list, n: int) -> list:
        self.shuffle(x)
        return x[:n]

    def halves(self, n: int) -> list[bool]:
        return [self.random() < 0.5 for _ in range(n)]

    def mask_kinds(self, n: int, vocab_size: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.random() < 0.8:
                out.append(MASK)
            elif self.random() < 0.5:
                out.append(KEEP)
            else:
                out.append(self.randint(0, vocab_size - 1))
        return out


class Stream:
    """``random()``, ``randint()``, ``shuffle()`` of ``random.Random(seed)``, from its words,
    and ``shuffle_head``/``mask_kinds`` as ``Exact`` makes them."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._w = array.array(_WORD)  # not a list: no int object per word until it is read
        self._p = 0

    def _ensure(self, need: int) -> None:
        """At least ``need`` words not yet used in the buffer."""
        left = len(self._w) - self._p
        if left < need:
            k = max(_CHUNK, need - left)
            new = array.array(_WORD, self._rng.getrandbits(32 * k).to_bytes(4 * k, "little"))
            if sys.byteorder == "big":
                new.byteswap()
            self._w = self._w[self._p:] + new
            self._p = 0

    def random(self) -> float:
        if len(self._w) - self._p < 2:
            self._ensure(2)
        p, w = self._p, self._w
        self._p = p + 2
        return ((w[p] >> 5) * 67108864.0 + (w[p + 1] >> 6)) * _TWO_POW_53

    def _below(self, n: int) -> int:
        k = n.bit_length()
        if k > 32:  # more than one word a try; no draw of the reference is this wide
            raise ValueError(f"below({n}): wider than 32 bits")
        shift = 32 - k
        while True:
            if self._p >= len(self._w):
                self._ensure(1)
            r = self._w[self._p] >> shift
            self._p += 1
            if r < n:
                return r

    def randint(self, a: int, b: int) -> int:
        if b < a:
            raise ValueError(f"empty range for randint({a}, {b})")
        return a + self._below(b - a + 1)

    def _fisher_yates(self, x: list, head: int) -> None:
        """``shuffle``'s swaps, for the positions below ``head``: the steps above it only move
        ``x[i]`` down (position i is final then, and outside the head)."""
        m = len(x)
        if m.bit_length() > 32:
            raise ValueError(f"shuffle of {m} items: wider than 32 bits")
        # Each try takes one word; ~1.4 a draw on average, and 2m + 64 are nearly always enough.
        # When they are not, the IndexError starts the shuffle over on a longer buffer.
        self._ensure(2 * m + 64)
        orig = x[:]
        while True:
            w, p, top = self._w, self._p, m - 1
            try:
                while top >= 1:  # one run of i with the same bit length of i + 1 at a time
                    k = (top + 1).bit_length()
                    s, low = 32 - k, max(1, (1 << (k - 1)) - 1)
                    for i in range(top, max(low, head) - 1, -1):
                        r = w[p] >> s
                        p += 1
                        while r > i:
                            r = w[p] >> s
                            p += 1
                        x[r] = x[i]
                    for i in range(min(top, head - 1), low - 1, -1):
                        r = w[p] >> s
                        p += 1
                        while r > i:
                            r = w[p] >> s
                            p += 1
                        x[i], x[r] = x[r], x[i]
                    top = low - 1
            except IndexError:
                x[:] = orig
                self._ensure(len(self._w) - self._p + 4 * m)
                continue
            self._p = p
            return

    def shuffle(self, x: list) -> None:
        self._fisher_yates(x, len(x))

    def shuffle_head(self, x: list, n: int) -> list:
        """``shuffle(x); return x[:n]``, with the same words; ``x`` is left in no useful order."""
        self._fisher_yates(x, n)
        return x[:n]

    def halves(self, n: int) -> list[bool]:
        """``[random() < 0.5 for _ in range(n)]``: the first of each draw's two words decides."""
        self._ensure(2 * n)
        p = self._p
        self._p = p + 2 * n
        return [w < 0x80000000 for w in self._w[p:p + 2 * n:2]]

    def mask_kinds(self, n: int, vocab_size: int) -> list[int]:
        """For each of ``n`` positions in turn: ``MASK`` if ``random() < 0.8``, else ``KEEP`` if
        ``random() < 0.5``, else ``randint(0, vocab_size - 1)``."""
        k = vocab_size.bit_length()
        if k > 32:
            raise ValueError(f"a vocab of {vocab_size}: wider than 32 bits")
        # random() < x  <=>  (a >> 5) * 2**26 + (b >> 6) < ceil(x * 2**53), for words a, b: an
        # integer test that the first word nearly always decides alone (both are used anyway)
        m_hi, m_lo = _P80
        k_hi, k_lo = _P50
        s, out, need = 32 - k, [], 5 * n + 64  # 2 + 2 + 1 words a position, and retries
        self._ensure(need)
        w, p = self._w, self._p
        for _ in range(n):
            a = w[p] >> 5
            p += 2
            if a < m_hi or a == m_hi and w[p - 1] >> 6 < m_lo:
                out.append(MASK)
                continue
            a = w[p] >> 5
            p += 2
            if a < k_hi or a == k_hi and w[p - 1] >> 6 < k_lo:
                out.append(KEEP)
                continue
            r = w[p] >> s
            p += 1
            while r >= vocab_size:  # a retry: the only draw beyond the budget above
                if len(w) - p < need:
                    self._p = p
                    self._ensure(need)
                    w, p = self._w, self._p
                r = w[p] >> s
                p += 1
            out.append(r)
        self._p = p
        return out


def _agrees(seed: int) -> bool:
    """``Stream`` and ``Exact`` make the same draws of every kind, here and now."""
    ours, theirs = Stream(seed), Exact(seed)
    for n in (1, 2, 3, 7, 64, 255, 256, 1000, 1025):  # ~3 ms
        a, b = list(range(n)), list(range(n))
        ours.shuffle(a)
        theirs.shuffle(b)
        if a != b or ours.shuffle_head(a, n // 3 + 1) != theirs.shuffle_head(b, n // 3 + 1) \
                or ours.mask_kinds(n, 30522) != theirs.mask_kinds(n, 30522) or ours.halves(n) != theirs.halves(n) \
                or ours.random() != theirs.random() \
                or ours.randint(0, n) != theirs.randint(0, n) or ours.randint(2, n + 2) != theirs.randint(2, n + 2):
            return False
    return ours.random() == theirs.random()


def reference_random(seed: int) -> Stream | Exact:
    """The draws of ``random.Random(seed)``: from the word stream when it is checked to agree."""
    return Stream(seed) if _agrees(seed) else Exact(seed)
