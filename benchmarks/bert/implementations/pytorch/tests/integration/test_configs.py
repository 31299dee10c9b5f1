"""Every shipped config_*.sh sources cleanly and, through run_and_time.sh, resolves to a
valid training config: a dry run builds the model, optimizer, data and eval set (trains
nothing) and the resolved config says what the config file's header promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bert.config import CONFIG_PARAMS, CONFIG_SCRIPT, LAUNCHER_VARIABLES, launcher_variable, parse_overrides
from conftest import PKG, mllog_events, source_config
from configs_helpers import CONFIGS, GLOBAL_BATCH


# Variables that describe the job to run.sub (and the DGX facts), not training overrides.
LAUNCH_VARS = {"DGXSYSTEM", "DGXNNODES", "DGXNGPU", "WALLTIME", "DGXSOCKETCORES", "DGXNSOCKET", "DGXHT",
               "DEMO_VOCAB", "DEMO_SEQ_LEN", "DEMO_MAX_PRED", "DEMO_TRAIN_SAMPLES", "DEMO_EVAL_SAMPLES"}


@pytest.fixture(scope="module")
def large_geometry_data(tmp_path_factory):
    """A few samples in the benchmark's geometry (seq 512, 76 predictions, the BERT vocab)."""
    from bert import demo_data as gen

    root = tmp_path_factory.mktemp("seq512")
    gen.generate(root, train_samples=16, eval_samples=8, seed=1, seq_len=512, max_pred=76, vocab=30522,
                 layout="variable", shards=1)
    return root


@pytest.mark.parametrize("name", CONFIGS)
def test_config_resolves_to_valid_training_config(name, demo_data, large_geometry_data, tmp_path):
    cfg_env = source_config(name)
    header = (PKG / name).read_text().split("\nexport", 1)[0]
    for word in ("System:", "Expected:", "Launch:"):
        assert word in header, f"{name}: the header must state the system, expected result and launch command"
    # Every launch command it shows names the inputs run.sub / run_and_time.sh require.
    launch = header.split("Launch:", 1)[1]
    if "submit_pretrain.sh" in launch:  # both phases' inputs, for the two chained jobs
        assert all(f"{v}=" in launch for v in ("DATADIR1", "EVALDIR1", "DATADIR2", "EVALDIR2")), launch
    else:
        launches = [ln for ln in header.splitlines() if "run.sub" in ln or "run_and_time.sh" in ln]
        assert launches and all("DATADIR=" in ln and "EVALDIR=" in ln for ln in launches), launches
    mapped = set(LAUNCHER_VARIABLES) | {CONFIG_PARAMS, CONFIG_SCRIPT}
    unknown = set(cfg_env) - mapped - LAUNCH_VARS
    assert not unknown, f"{name} exports variables the trainer does not read: {sorted(unknown)}"
    # The config's own keys: in CONFIG_PARAMS (EXTRA_PARAMS is the user's), none that a variable
    # of the table sets (one place per key), no flags; the file names itself; a GPU system's
    # config runs on CUDA only.
    assert cfg_env[CONFIG_SCRIPT] == str(PKG / name)
    own = parse_overrides(cfg_env[CONFIG_PARAMS].split())
    assert not [k for k in own if k in LAUNCHER_VARIABLES.values()], [launcher_variable(k) for k in own
                                                                         if k in LAUNCHER_VARIABLES.values()]
    assert (own.get("run.device") == "cuda") == ("CPU" not in name), name

    data = demo_data.root if name.startswith("config_CPU_1x2.") else large_geometry_data
    env = dict(os.environ, **cfg_env)
    env.update(PATH=demo_data.path, LAUNCHER="task", DATADIR=str(data / "train"),
               EVALDIR=str(data / "eval"), LOGDIR=str(tmp_path),
               # a GPU config's dry run on this CPU: run.device=cpu, the user's, over the config's cuda
               EXTRA_PARAMS="--dry-run data.eval_samples=8 eval.batch_size=8 run.device=cpu"
               + (" data.max_seq_length=512" if "_phase1" in name else ""))  # phase 1 is seq 128; this data 512
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "MASTER_ADDR"):
        env.pop(var, None)
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "dry run: everything built, nothing trained" in r.stdout
    assert f" in {name})" in r.stdout and "(EXTRA_PARAMS)" in r.stdout  # where each setting came from
    assert "run.device=\"cpu\" (EXTRA_PARAMS)" in r.stdout or "CPU" in name

    dumped = json.loads((tmp_path / "result_0_config.json").read_text())
    ranks = int(cfg_env["DGXNNODES"]) * int(cfg_env["DGXNGPU"])
    run, optim = dumped["run"], dumped["optim"]
    assert run["local_batch_size"] * run["grad_accum_steps"] * ranks == GLOBAL_BATCH[name]
    assert run["division"] == cfg_env["DIVISION"] and optim["name"] == cfg_env["OPTIMIZER"]
    assert optim["lr"] == float(cfg_env["LR"]) and optim["total_steps"] == int(cfg_env["MAX_STEPS"])
    assert optim["warmup_steps"] == int(cfg_env["WARMUP_STEPS"])
    assert optim["start_warmup_step"] == int(cfg_env["START_WARMUP_STEP"])
    assert (optim["beta1"], optim["beta2"]) == (float(cfg_env["OPT_LAMB_BETA_1"]), float(cfg_env["OPT_LAMB_BETA_2"]))
    assert dumped["log"]["system"] == cfg_env["DGXSYSTEM"]
    if "CPU" not in name and "_base_" not in name:  # the benchmark's model
        assert dumped["model"]["hidden_size"] == 1024 and dumped["model"]["num_layers"] == 24
    if name == "config_DGXA100_128x8.sh":  # the paper's load balance: 4 strata of 128, snake deal per node
        assert dumped["sampler"]["mode"] == "stratified" and dumped["sampler"]["deal"] == "snake"
        assert (dumped["sampler"]["strata_width"], dumped["sampler"]["group_size"]) == (128, 8)
    keys = {e["key"]: e["value"] for e in mllog_events(tmp_path / "result_0.txt")}
    assert keys["submission_division"] == cfg_env["DIVISION"] and keys["opt_base_learning_rate"] == float(cfg_env["LR"])


@pytest.mark.parametrize("name", CONFIGS)
def test_config_has_a_system_description_passing_the_checker(name, tmp_path):
    system = source_config(name)["DGXSYSTEM"]
    path = PKG.parents[3] / "systems" / f"{system}.json"
    assert path.exists(), f"{name}: no systems/{system}.json"
    r = subprocess.run([sys.executable, "-m", "mlperf_logging.system_desc_checker", str(path), "training", "5.0.0",
                        "--log_output", str(tmp_path / "sdc.log")], capture_output=True, text=True)
    assert f"System description checker passed for {system}" in r.stdout + r.stderr, r.stdout + r.stderr
    desc = json.loads(path.read_text())
    assert desc["system_name"] == system and desc["number_of_nodes"] == source_config(name)["DGXNNODES"]
    assert desc["division"] == source_config(name)["DIVISION"]


@pytest.mark.parametrize("name", [c for c in CONFIGS if "CPU" not in c])
def test_a_gpu_config_without_cuda_exits_2_in_one_line_before_reading_anything(name, tmp_path):
    """run.device=cuda on this CPU-only machine: exit 2, one line naming the setting and how to
    run it, before any data is read (DATADIR does not even exist) or any process group made."""
    env = dict(os.environ, **source_config(name))
    env.update(LAUNCHER="task", DATADIR=str(tmp_path / "none"), EVALDIR=str(tmp_path / "none"), LOGDIR=str(tmp_path))
    env.pop("EXTRA_PARAMS", None)
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [r.stderr.splitlines()[0]] and "config error: run.device=cuda:" in r.stderr
    assert "CPU-only build" in r.stderr and "--gpus-per-node" in r.stderr and "run.device=cpu" in r.stderr
    assert "settings:" not in r.stdout and not list(tmp_path.iterdir())  # nothing started, nothing written
