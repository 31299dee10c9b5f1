
import subprocess
import sys

from conftest import PKG


def test_exit_process_flushes_and_keeps_the_status():
    # Block-buffered stdout (a pipe) would lose the text if exit_process skipped the flush.
    code = "import sys; from bert import distributed; print('done', end=''); sys.stderr.write('err'); distributed.exit_process(3)"
    r = subprocess.run([sys.executable, "-c", code], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (3, "done", "err")
