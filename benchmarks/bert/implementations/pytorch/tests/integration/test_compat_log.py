"""log.compat: the same run's log also passes the older MLCommons rulesets (1.0.0-4.1.0),
which add submission_status, opt_epsilon and, in 1.1.0-2.1.0, one weights_initialization
event per TensorFlow checkpoint tensor name (the checker's own list is the oracle)."""

from __future__ import annotations

from bert import train
from bert.weights import tf_tensor_names
from bert.config import ModelConfig
from conftest import mllog_events, run_checker
from compat_log_helpers import RULESETS_WITH_NAMES


RULESETS_WITHOUT_NAMES = ("1.0.0", "3.0.0", "3.1.0", "4.0.0", "4.1.0", "5.0.0")


def _run(demo_data, trained, out, *extra):
    return train.main([*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
                       f"data.eval_dir={demo_data.eval}", "data.eval_samples=300", f"log.output_dir={out}",
                       "run.local_batch_size=32", "optim.lr=1e-4", "eval.interval_samples=32",
                       "run.max_samples=320", *extra])


def test_compat_log_passes_every_ruleset_from_1_0_to_5_0(trained, demo_data, tmp_path):
    assert trained.returncode == 0, trained.stdout[-3000:]
    assert _run(demo_data, trained, tmp_path, f"run.init_checkpoint={trained.checkpoint}", "log.compat=true") == 0
    log = tmp_path / "result_0.txt"
    events = mllog_events(log)
    keys = {e["key"]: e["value"] for e in events}
    assert keys["opt_epsilon"] == keys["opt_lamb_epsilon"] and keys["submission_status"] == "research"
    logged = [e["metadata"]["tensor"] for e in events if e["key"] == "weights_initialization"]
    # The demo model has 2 layers: its 5 + 2*16 + 9 tensors (the TF name map's), each once.
    assert logged == tf_tensor_names(ModelConfig(num_layers=2)) and len(logged) == 5 + 2 * 16 + 9
    for ruleset in RULESETS_WITHOUT_NAMES:
        ok, out = run_checker(log, ruleset)
        assert ok, f"{ruleset}: {out}"
    for ruleset in RULESETS_WITH_NAMES:
        # These rulesets hard-code BERT-Large's 398 names: a 2-layer model's log can pass all
        # of their checks but that list (BERT-Large's own names are checked above).
        ok, out = run_checker(log, ruleset)
        assert not ok
        names_check = "failed test: sorted(s['initialized_tensors'])"
        failures = [ln for ln in out.splitlines() if ln.startswith(("WARNING", "ERROR"))
                    and "FAILED" not in ln and names_check not in ln]
        assert names_check in out and not failures, f"{ruleset}: {failures}"


def test_without_compat_the_old_rulesets_fail(trained):
    """The oracle can fail: the spine's log (no compat) lacks the weights_initialization
    events 1.1.0 wants (opt_epsilon and submission_status are logged always now)."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    ok, out = run_checker(trained.log, "1.1.0")
    assert not ok and "weights_initialization" in out
    assert run_checker(trained.log, "5.0.0")[0]
