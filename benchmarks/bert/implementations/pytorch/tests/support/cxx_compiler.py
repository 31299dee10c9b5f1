"""Whether torch's inductor can build its CPU kernels here: they are C++, compiled by the
compiler inductor itself picks (``$CXX``, else g++), which the README and the Makefile call
optional. The tests that run inductor on the CPU skip with this reason where it cannot."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile


@functools.lru_cache(maxsize=1)
def cxx_unavailable() -> str | None:
    """Why inductor cannot build C++ kernels here (no compiler, or one that cannot build a
    program), with the package that provides one; None: it can. Cached: a compile, ~0.5 s."""
    from torch._inductor import cpp_builder, exc

    try:
        cxx = cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as e:
        why = str(e) or "no C++ compiler found"
    else:
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([cxx, "-x", "c++", "-", "-o", os.path.join(d, "a.out")],
                               input="int main() { return 0; }\n", capture_output=True, text=True)
        if r.returncode == 0:
            return None
        why = f"{cxx} cannot build a C++ program: {r.stderr.strip()[:300]}"
    return f"inductor needs a working C++ compiler (Debian: apt-get install g++): {why}"
