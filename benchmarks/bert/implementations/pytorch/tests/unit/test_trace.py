"""bert/trace.py: the sample trace a run writes (one line per optimizer step per rank, every
micro-batch's samples; the lines an earlier run left past the step a run starts at dropped,
its own file and those of ranks the run no longer has) and what it reads back."""

from __future__ import annotations

import json

import pytest

from bert.trace import SampleTrace, read_trace, trace_file


class Named:
    """A stream of numbered batches whose samples are named as the loader names them."""

    def __init__(self, batch: int):
        self.batch, self.n, self.closed = batch, 0, False

    def __next__(self) -> dict:
        self.n += 1
        return {"n": self.n}

    @property
    def last(self) -> list[list]:
        return [[f"part_{self.n}.hdf5", r] for r in range(self.batch)]

    def close(self) -> None:
        self.closed = True


def test_each_step_is_one_line_of_its_micro_batches(tmp_path):
    stream = Named(2)
    trace = SampleTrace(stream, tmp_path, rank=1, world_size=2, accum=3, step=0)
    got = [next(trace)["n"] for _ in range(7)]
    trace.close()
    assert got == list(range(1, 8)) and stream.closed
    lines = [json.loads(x) for x in trace_file(tmp_path, 1).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and {x["rank"] for x in lines} == {1}  # the 7th micro-batch: no step yet
    assert lines[1]["samples"] == [[f"part_{n}.hdf5", r] for n in (4, 5, 6) for r in range(2)]
    assert read_trace(tmp_path) == {1: {1: lines[0]["samples"]}, 2: {1: lines[1]["samples"]}}


@pytest.mark.parametrize("rank, kept", [(0, {"rank_0": [1, 2, 3], "rank_1": [1, 2, 3, 4, 5], "rank_2": [1, 2, 3],
                                              "rank_3": [1, 2, 3, 4, 5]}),
                                        (1, {"rank_0": [1, 2, 3, 4, 5], "rank_1": [1, 2, 3], "rank_2": [1, 2, 3, 4, 5],
                                             "rank_3": [1, 2, 3]})])
def test_a_run_starting_at_step_3_drops_the_lines_past_it(tmp_path, rank, kept):
    """A 4-rank run wrote steps 1-5 (its last line torn) and checkpointed at 3; resumed on 2
    ranks, rank r rewrites its file and those of old ranks r + 2k: steps 1-3 kept, the rest
    (and the torn line) gone; the other rank's files are its own to rewrite."""
    for r in range(4):
        lines = [json.dumps({"step": k, "rank": r, "samples": [["a.hdf5", k]]}) for k in range(1, 6)]
        trace_file(tmp_path, r).write_text("\n".join(lines) + "\n" + '{"step": 6, "ra')
    trace = SampleTrace(Named(1), tmp_path, rank=rank, world_size=2, accum=1, step=3)
    trace.close()
    for name, steps in kept.items():
        text = (tmp_path / f"{name}.jsonl").read_text()
        if steps == [1, 2, 3, 4, 5]:
            assert text.endswith('{"step": 6, "ra')  # another rank's: untouched
            continue
        assert [json.loads(x)["step"] for x in text.splitlines()] == steps


def test_a_write_that_fails_is_kept_for_the_next_agreement(tmp_path):
    """A full disk: the step goes on, the error waits where the MLPerf log's waits (the
    checkpoint poll ends the run on every rank, exit 5), and no later line is written."""
    trace = SampleTrace(Named(1), tmp_path, rank=0, world_size=1, accum=1, step=0)

    class Full:
        def write(self, _text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    trace.file.close()
    trace.file = Full()
    next(trace)
    next(trace)
    assert isinstance(trace.write_error, OSError) and trace.write_error.errno == 28
    assert trace.step == 2
