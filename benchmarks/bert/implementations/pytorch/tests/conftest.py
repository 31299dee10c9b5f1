"""Shared fixtures: the demo data, a model trained to the demo target, the MLPerf checker.

The expensive fixture (``trained``: 2 CPU ranks through run_and_time.sh with
config_CPU_1x2.sh, to 0.720) runs once per session, in the background from the end of
collection, while the files that do not need it run; tests that need a converged model
start from its weights and reach the target at their first evaluation.

``make test`` runs the suite in parallel (pytest-xdist, one worker per core, a test file per
worker at a time: its module fixtures, e.g. a SLURM cluster, are made once). The session
fixtures are made once for all workers: the first worker to need one makes it under a file
lock in the session's shared temp dir (``_made_once``), the others wait for it and read it.
The image (tests/integration/test_image.py) is built by the session's main process, which outlives the
workers, so one engine serves whichever worker runs those tests.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from filelock import FileLock

# The harnesses and the helpers several test files share (tests/support/), importable by name
# from every test file and from each other.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import triton_interpret  # noqa: E402
from docker_engine import ImageBuild, docker_unavailable  # noqa: E402

# OpenMP threads that wait sleep instead of spinning, in this process and every process a
# test starts (read by libgomp when torch loads it: before the first `import torch` below).
# The suite runs more threads than cores (two workers, each with torch's thread per core,
# beside the runs they launch); a spinning thread burns a core another process needs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Before any test module imports triton through torch (test_triton_attention.py runs our
# Triton kernels in Triton's CPU interpreter; tests/support/triton_interpret.py says why here).
triton_interpret.setup()

from bench import common  # noqa: E402  (imports torch: after the interpreter's setup above)
from bert import config_script  # noqa: E402
from bert.mlperf_log import read_events  # noqa: E402

PKG = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)
# Debian's procps: absent from minimal images, so the launchers must not need it.
PROCPS = ("kill", "ps", "sysctl", "free", "pgrep", "pidwait", "pmap", "pwdx", "skill", "slabtop", "tload", "top",
          "uptime", "vmstat", "w", "watch", "pkill", "snice")


def path_without(directory: Path, names: tuple[str, ...] = PROCPS, venv: bool = True) -> str:
    """The venv's bin (``venv``), then ``directory``: a symlink to each program of the current
    PATH (the first of each name) except ``names``, as on a machine without them. (The venv's
    python must be called where it is: through a symlink it would not find its pyvenv.cfg.)"""
    directory.mkdir(parents=True, exist_ok=True)
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d) or d == VENV_BIN:
            continue
        for entry in os.scandir(d):
            link = directory / entry.name
            if entry.name not in names and not link.exists() and os.access(entry.path, os.X_OK) and entry.is_file():
                link.symlink_to(entry.path)
    return f"{VENV_BIN}{os.pathsep}{directory}" if venv else str(directory)


def children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid``, from /proc (no pgrep: see PROCPS)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)"
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def source_config(name: str) -> dict[str, str]:
    """The variables a config_*.sh exports (the trainer's own reading: bert.config_script)."""
    env = config_script.source(PKG / name, {"PATH": os.environ["PATH"]})
    return {k: v for k, v in env.items() if k != "PATH"}


def run_checker(log: Path, ruleset: str = "5.0.0") -> tuple[bool, str]:
    """The MLCommons compliance checker on one log: (passed, its output)."""
    r = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                        "--ruleset", ruleset, str(log)], capture_output=True, text=True, cwd=log.parent)
    out = r.stdout + r.stderr
    return r.returncode == 0 and "SUCCESS" in out, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_worker() -> None:
    """The last call of a spawned 2-rank test worker: both ranks done, the group destroyed,
    the process ended with status 0 without interpreter teardown (bert.distributed.exit_process
    says why: a torch 2.13 gloo race aborted ~1 worker in 10 at exit)."""
    import torch.distributed as dist

    from bert import distributed

    dist.barrier()  # neither rank tears its sockets down while the other still works
    dist.destroy_process_group()
    distributed.exit_process(0)


def hold_env(out: Path, *holds: str) -> dict[str, str]:
    """The environment that holds a run at ``holds`` (WHERE:RANK:STEP:UNTIL, see
    tests/support/inject/sitecustomize.py) until the test's fault has reached it, markers in out/held;
    ``{}`` for none. Passed through every launcher (torchrun, srun) to the training processes."""
    if not holds:
        return {}
    path = os.pathsep.join([str(PKG / "tests" / "support" / "inject"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "BERT_TEST_HOLD": ";".join(holds), "BERT_TEST_HELD_DIR": str(out / "held")}


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` now (SigCgt in /proc/PID/status):
    what a fault test waits for instead of a step that may already be past."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # ended
        return False
    mask = next((line.split()[1] for line in text.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def sigint_default() -> None:
    """SIGINT at its default action in a child, as a terminal starts a command: under a suite
    started in the background without job control (``make test &``, nohup) it is inherited
    ignored, and a script cannot trap a signal ignored at its entry, so a test's Ctrl-C would
    be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_and_time_signalled(env: dict[str, str], at_step: int | None = None, sig: int = signal.SIGUSR1,
                           act=None) -> tuple[int, str]:
    """./run_and_time.sh with ``env``, in a session of its own (as a terminal starts a
    command); ``sig`` to the script (or ``act(proc)``, when given, instead) when it says
    STARTING TIMING RUN, before any training process exists: the script keeps it for them
    (they act on it at their first poll, whenever they start), so no run can end before its
    signal lands. ``at_step``: when its progress line for that step appears instead (for a
    run with no natural end before it). Returns (exit status, output)."""
    proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=sigint_default)
    lines = []
    pattern = rf"step +{at_step} \|" if at_step is not None else r"STARTING TIMING RUN AT "
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(pattern, line):
                act(proc) if act else proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, "".join(lines)


def mllog_events(log: Path) -> list[dict]:
    return read_events(log, strict=True)


@dataclass
class DemoData:
    root: Path
    train: Path
    eval: Path
    env: dict[str, str]  # config_CPU_1x2.sh's variables
    path: str  # PATH for the launchers: no procps (no_procps_path)


def _shared_dir(config: pytest.Config) -> Path:
    """The temp dir all workers of this session share: the base temp dir, whose children are
    each xdist worker's own (``popen-gw0``, ...); without xdist, the session's own."""
    base = config._tmp_path_factory.getbasetemp()  # what the tmp_path_factory fixture uses
    return base.parent if hasattr(config, "workerinput") else base


@contextmanager
def _made_once(config: pytest.Config, name: str) -> Iterator[tuple[Path, bool]]:
    """``(directory, ready)``, with this session's lock for ``name`` held: ``ready`` False means
    the caller makes it now (the directory is new and empty); it counts as made when the block
    ends without an exception, so a worker that failed halfway leaves it to be made again."""
    path = _shared_dir(config) / name
    done = path / ".made"
    with FileLock(f"{path}.lock"):
        if done.exists():
            yield path, True
            return
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        yield path, False
        done.touch()


def _demo_data(config: pytest.Config) -> DemoData:
    from bert import demo_data as gen

    env = source_config("config_CPU_1x2.sh")
    with _made_once(config, "demo_data") as (root, ready):
        if not ready:
            gen.generate(root, train_samples=16000, eval_samples=1000, seed=1, seq_len=int(env["DEMO_SEQ_LEN"]),
                         max_pred=int(env["DEMO_MAX_PRED"]), vocab=int(env["DEMO_VOCAB"]), layout="variable",
                         shards=4)
    return DemoData(root, root / "train", root / "eval", env, _no_procps(config))


def _no_procps(config: pytest.Config) -> str:
    with _made_once(config, "no_procps") as (directory, _):
        return path_without(directory)  # links only what is missing: the same PATH when made


@pytest.fixture(scope="session")
def no_procps_path(request) -> str:
    """The PATH the launcher tests run with: every program but procps's (path_without)."""
    return _no_procps(request.config)


@pytest.fixture(scope="session")
def demo_data(request) -> DemoData:
    """The demo dataset of config_CPU_1x2.sh's geometry, smaller (the model sees it ~2x)."""
    return _demo_data(request.config)


@dataclass
class TrainedRun:
    checkpoint: Path
    log: Path
    stdout: str
    returncode: int


def demo_run_env(trained: TrainedRun, demo_data, logdir: Path, **extra: str) -> dict[str, str]:
    """config_CPU_1x2.sh's variables for run_and_time.sh / run.sub, from the trained demo
    model: the first eval (64 samples) reaches the target; a short eval set keeps it quick."""
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=demo_data.path, DATADIR=str(demo_data.train), EVALDIR=str(demo_data.eval),
               LOGDIR=str(logdir), INIT_CHECKPOINT=str(trained.checkpoint), LR="1e-4",
               EVAL_ITER_SAMPLES="64", MAX_SAMPLES_TERMINATION="640",
               EXTRA_PARAMS="data.eval_samples=500")
    env.update(extra)
    return env


TRAINED_TIMEOUT_S = 900
_TRAINED_RUN = pytest.StashKey[subprocess.Popen]()


def _start_trained(config: pytest.Config) -> None:
    """config_CPU_1x2.sh through run_and_time.sh to the target, in the background: started
    once per session, by the first process (worker) whose tests need it, when it has collected
    them, so that its two minutes of training overlap the tests that run first instead of
    keeping a worker idle. Its exit status is written last (``returncode``): the sign it ended."""
    demo = _demo_data(config)
    with _made_once(config, "trained") as (out, ready):
        if ready:
            return
        env = dict(os.environ, **demo.env)
        env.update(PATH=demo.path, DATADIR=str(demo.train), EVALDIR=str(demo.eval), LOGDIR=str(out),
                   LOGFILE="result_0.txt", SEED="7", SAVE_CHECKPOINT=str(out / "model.pt"),
                   EXTRA_PARAMS="data.eval_samples=1000")
        script = './run_and_time.sh >"$1/output.txt" 2>&1; echo $? >"$1/returncode.tmp"; mv "$1/returncode.tmp" "$1/returncode"'
        config.stash[_TRAINED_RUN] = subprocess.Popen(["bash", "-c", script, "trained", str(out)], cwd=PKG, env=env,
                                                      start_new_session=True, stdin=subprocess.DEVNULL)


def _uses_trained(item: pytest.Item) -> bool:
    return "trained" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session")
def trained(request) -> TrainedRun:
    """config_CPU_1x2.sh through run_and_time.sh (torchrun, 2 gloo ranks) to the target,
    started at collection (_start_trained); here, its outcome, waited for."""
    _start_trained(request.config)  # a no-op once started (by this process or another)
    out = _shared_dir(request.config) / "trained"
    deadline = (out / ".made").stat().st_mtime + TRAINED_TIMEOUT_S
    while not (out / "returncode").exists():
        if time.time() > deadline:
            pytest.fail(f"the trained demo run did not end within {TRAINED_TIMEOUT_S} s; its output so far:\n"
                        + (out / "output.txt").read_text()[-3000:], pytrace=False)
        time.sleep(0.5)
    return TrainedRun(out / "model.pt", out / "result_0.txt", (out / "output.txt").read_text(),
                      int((out / "returncode").read_text()))


# -- a one-node SLURM cluster (tests/integration/test_launchers.py, tests/{unit,integration}/test_tune.py) --------------------

@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A private one-node cluster per test module (free ports, its own temp dir)."""
    from slurm_cluster import SlurmCluster, slurm_unavailable

    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


# -- the image (tests/integration/test_image.py): built in the background from the start ---------------

_IMAGE_BUILD = pytest.StashKey[ImageBuild]()
IMAGE_TESTS = "tests/integration/test_image.py::"  # the tests that use docker_image, and only they


def _uses_image(item: pytest.Item) -> bool:
    return "docker_image" in getattr(item, "fixturenames", ())


def _xdist_main(config: pytest.Config) -> bool:
    """This process hands the tests to pytest-xdist workers (``-n N``, N > 0)."""
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def _image_build(root: Path | None = None) -> ImageBuild:
    """The engine this process owns, or (``root``) the one the session's main process owns."""
    return ImageBuild(dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}"), root)


# The files that take a worker longest (seconds, `--durations=0` under two workers on two AMD
# EPYC cores, summed per file: launchers 425, tune 257, pretrain 223, precision 211, resume 194,
# sampler 182, bench 153, budget 125, two_nodes 115, study 112, configs 97; data_road 566 alone
# on the two cores), in that order: a long file taken last would run alone at the end. A stale
# list costs minutes, not a result.
LONGEST_FIRST = tuple(f"integration/{name}" for name in (
    "test_data_road.py", "test_launchers.py", "test_tune.py", "test_pretrain.py", "test_precision.py", "test_checkpoint.py",
    "test_elastic.py", "test_sampler.py", "test_bench.py", "test_budget.py", "test_two_nodes.py", "test_study.py", "test_configs.py"))
TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration")  # tests/<tier>/: a marker of that name on each of its tests


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order files run in (with `--no-loadscope-reorder`, the order xdist hands them out):
    the files that need no `trained` run first, while it trains in the background
    (_start_trained); then those that need it; the image's tests last, as they wait for the
    image, which is made meanwhile; in each group the longest first (LONGEST_FIRST), the others
    in their place. Which tests use the image is known by file (the main process of an xdist
    session sees only test ids)."""
    for item in items:
        assert _uses_image(item) == item.nodeid.startswith(IMAGE_TESTS), \
            f"{item.nodeid}: the tests using docker_image are those of {IMAGE_TESTS[:-2]}, and only they"
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS and hasattr(item, "add_marker"):
            item.add_marker(getattr(pytest.mark, tier))
    needs = {item.path for item in items if _uses_trained(item)}

    def key(item: pytest.Item) -> tuple:
        name = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else item.path.name
        rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return _uses_image(item), item.path in needs, rank

    items.sort(key=key)  # stable: a file's tests stay together and in their order


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist the main process owns the engine (it outlives every worker); its directory
    is made now, so that each worker can be told where it will be (pytest_configure_node)."""
    if _xdist_main(config) and not config.option.collectonly and docker_unavailable() is None:
        config.stash[_IMAGE_BUILD] = _image_build()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    build = node.config.stash.get(_IMAGE_BUILD, None)
    if build is not None:
        node.workerinput["bert_image_root"] = str(build.root)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """The main process: start the build when the first worker has collected an image test."""
    build = node.config.stash.get(_IMAGE_BUILD, None)
    if build is not None and not build.started and any(i.startswith(IMAGE_TESTS) for i in ids):
        build.start()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The trained demo run starts now where a selected test needs it (_start_trained). Without
    xdist, dockerd and the image build too (minutes of network and disk, few CPU seconds) when a
    selected test needs the image, so they overlap the tests that run first."""
    config = session.config
    if not config.option.collectonly and any(map(_uses_trained, session.items)):
        _start_trained(config)
    if hasattr(config, "workerinput") or config.option.collectonly or docker_unavailable() \
            or not any(map(_uses_image, session.items)):
        return
    build = config.stash[_IMAGE_BUILD] = _image_build()
    build.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = session.config.stash.get(_TRAINED_RUN, None)
    if run is not None and run.poll() is None:  # this process started it: end it or let it end
        try:  # another worker may still wait for it, unless the session was interrupted
            run.wait(timeout=0 if exitstatus == pytest.ExitCode.INTERRUPTED else TRAINED_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    build = session.config.stash.get(_IMAGE_BUILD, None)
    if build is not None:
        build.stop()


_STARTED = pytest.StashKey[float]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    started = config.stash.get(_STARTED, None)
    if started is not None:
        wall = time.monotonic() - started
        # The machine matters: an AVX2-only CPU emulates bf16 matrix work.
        m = common.machine()
        terminalreporter.write_line(f"suite time: {wall / 60:.1f} min wall ({wall:.0f} s) on {m['cpus']} CPU(s), "
                                    f"{m.get('cpu') or 'unknown CPU'}, bf16 {m.get('bf16', 'unknown')}")
    build = config.stash.get(_IMAGE_BUILD, None)
    if build is None or not build.started:
        return
    r = build.result
    times = ", ".join(f"{step} {s:.0f} s" for step, s in r.seconds.items())
    if r.unavailable:
        state = f"not built: dockerd could not start: {r.unavailable}"
    elif r.error:
        state = f"build failed ({times})"
    else:
        state = f"built on the {'cached' if r.standin_cached else 'newly made'} stand-in ({times}, in the background)"
    terminalreporter.write_line(f"docker image (tests/integration/test_image.py): {state}")


@pytest.fixture(scope="session")
def docker_image(request) -> ImageBuild:
    """The image built on the NGC stand-in, in a private engine (tests/support/docker_engine.py)."""
    why = docker_unavailable()
    if why:
        pytest.skip(f"no Docker Engine here: {why}")
    shared = getattr(request.config, "workerinput", {}).get("bert_image_root")
    if shared is not None:  # an xdist worker: the main process builds it (pytest_configure)
        build = _image_build(Path(shared))
    else:
        build = request.config.stash.get(_IMAGE_BUILD, None)
        assert build is not None, "pytest_collection_finish did not start the image build"
    # A fresh machine: debootstrap and two rounds of pip, under 8 minutes when the machine is idle.
    result = build.wait(timeout=1200)
    if result.unavailable:
        pytest.skip(f"dockerd cannot start here: {result.unavailable}")
    if result.error:
        pytest.fail(result.error, pytrace=False)
    return build
