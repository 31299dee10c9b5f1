"""Google's BERT under TensorFlow, as its own scripts build and train it: the oracle of
tests/integration/test_tf_oracle.py.

    <TF interpreter> tests/support/tf_oracle.py SPEC.json OUT_DIR

Runs in the interpreter of the TensorFlow environment that ``make venv`` builds (.venv/tf:
tensorflow-cpu and tf-keras, constraints-tf.txt), never in the main venv: it imports no torch
and nothing of this project but bench/google_bert.py's loader and the feature names of
pretraining_features.py (numpy). The code under test is
bert-tensorflow 1.0.4's (the main venv's .venv/oracle): ``modeling.py`` (BertModel, its
``gelu``), ``run_pretraining.py`` (``model_fn_builder``: the pretraining heads, the loss,
``metric_fn``) and ``optimization.py`` (``create_optimizer``: global-norm clip 1.0, linear
warmup, polynomial decay, ``AdamWeightDecayOptimizer``), loaded by file under
``tensorflow.compat.v1`` in graph mode with stand-ins for what TensorFlow 2 removed:

- ``tensorflow.contrib.layers.layer_norm``: Keras's LayerNormalization under the name
  "LayerNorm", epsilon 1e-12, which is what the MLCommons reference's modeling.py puts in
  its place (tf-keras, TF_USE_LEGACY_KERAS=1, so that ``tf.layers`` and ``tf.keras`` are
  Keras 2's);
- ``tf.estimator``: ``ModeKeys`` and a ``TPUEstimatorSpec`` that hands back what
  ``model_fn`` gives it (the loss, the train op, ``eval_metrics``);
- ``tf.flags``: definitions give defaults (bench/google_bert.py's ``Flags``).

The LAMB of the MLPerf reference (``lamb_optimizer_v1.py`` in mlcommons/training) is in no
package: ``Lamb`` below computes its formula, read from that file, as a
``tf.train.Optimizer`` of the same name, so its slots and counters are those TensorFlow
names for it (``<weight>/LAMB``, ``<weight>/LAMB_1``, ``beta1_power``, ``beta2_power``).
``create_optimizer`` builds it in place of AdamWeightDecayOptimizer (that name rebound in
this process's own copy of optimization.py), so the clip and the schedule stay Google's.

SPEC: {"oracle_dir": bert-tensorflow's folder, "cases": [{"name", "bert_config": Google's
BertConfig fields, "seed", "batches": an .npz of run_pretraining's features, each [n, ...]
(the last batch is the evaluation's, the first ``steps`` the training's), "lr",
"num_train_steps", "num_warmup_steps", "steps", "optimizers": ["adam", "lamb"]}]}.
OUT_DIR/<name>/: bert_config.json; init/model.ckpt-0 (the initial weights, with
AdamWeightDecayOptimizer's zero slots and the step, as a run saves them); <optimizer>/
model.ckpt-<steps> after the training steps; weights.npz beside each checkpoint (the model's
variables by name, as TF holds them); eval.npz (MLM and NSP logits, pooled output,
the evaluation batch's labels, metric_fn's values); train.json (per optimizer and step: the
learning rate the update ran at, the loss).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import google_bert  # noqa: E402 - stdlib only: no torch, no bert of ours
from pretraining_features import FEATURES  # noqa: E402 - numpy only

import tensorflow.compat.v1 as tf  # noqa: E402


class _TF:
    """tensorflow.compat.v1 with ``overrides`` in place of some of its names."""

    def __init__(self, **overrides) -> None:
        self._overrides = overrides

    def __getattr__(self, name: str):
        return self._overrides[name] if name in self._overrides else getattr(tf, name)


def _layer_norm(inputs, begin_norm_axis=-1, begin_params_axis=-1, scope=None):
    if (begin_norm_axis, begin_params_axis) != (-1, -1):
        raise NotImplementedError("the stand-in layer_norm normalises the last axis only, as modeling.py asks")
    return tf.keras.layers.LayerNormalization(name=scope or "LayerNorm", axis=-1, epsilon=1e-12)(inputs)


def _estimator() -> SimpleNamespace:
    return SimpleNamespace(ModeKeys=SimpleNamespace(TRAIN="train", EVAL="eval", PREDICT="infer"),
                           tpu=SimpleNamespace(TPUEstimatorSpec=lambda **spec: SimpleNamespace(**spec)))


class Lamb(tf.train.Optimizer):
    """LAMB as the MLPerf reference's lamb_optimizer_v1.py computes it, per weight w with
    gradient g at step t (b1^t, b2^t kept as ``beta1_power``, ``beta2_power``):

        m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
        u += wd w                                   unless excluded
        r = ||w|| / ||u|| (1 where either is 0)     unless excluded, else 1
        w -= r lr u

    "Excluded": the weight's name matches one of ``exclude_from_weight_decay`` (the
    reference's layer-adaptation exclusions default to those), whatever the rate. Takes
    the arguments create_optimizer gives AdamWeightDecayOptimizer."""

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None, name="LAMB"):
        super().__init__(False, "LAMB")  # the reference's name: its slots' names come from it
        del name
        self.learning_rate, self.weight_decay_rate = learning_rate, weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude = list(exclude_from_weight_decay or [])

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        # create_optimizer advances the step itself (AdamWeightDecayOptimizer does not):
        # once, not twice.
        return super().apply_gradients(grads_and_vars, None, name)

    def _create_slots(self, var_list):
        first = min(var_list, key=lambda v: v.name)
        self._create_non_slot_variable(initial_value=self.beta_1, name="beta1_power", colocate_with=first)
        self._create_non_slot_variable(initial_value=self.beta_2, name="beta2_power", colocate_with=first)
        for v in var_list:
            self._zeros_slot(v, "m", self._name)
            self._zeros_slot(v, "v", self._name)

    def _powers(self):
        graph = tf.get_default_graph()
        return (self._get_non_slot_variable("beta1_power", graph=graph),
                self._get_non_slot_variable("beta2_power", graph=graph))

    def _resource_apply_dense(self, grad, var):
        power1, power2 = self._powers()
        m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
        m_t = m.assign(self.beta_1 * m + (1.0 - self.beta_1) * grad)
        v_t = v.assign(self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad))
        update = (m_t / (1.0 - power1)) / (tf.sqrt(v_t / (1.0 - power2)) + self.epsilon)
        ratio = 1.0
        if not any(re.search(r, var.op.name) for r in self.exclude):
            update += self.weight_decay_rate * var
            w_norm, u_norm = tf.norm(var), tf.norm(update)
            ratio = tf.where(w_norm > 0, tf.where(u_norm > 0, w_norm / u_norm, 1.0), 1.0)
        return tf.group(var.assign_sub(ratio * self.learning_rate * update), m_t, v_t)

    _apply_dense = _resource_apply_dense

    def _finish(self, update_ops, name_scope):
        with tf.control_dependencies(update_ops):
            power1, power2 = self._powers()
            advance = [power1.assign(power1 * self.beta_1), power2.assign(power2 * self.beta_2)]
        return tf.group(*update_ops, *advance, name=name_scope)


def load_google(oracle_dir: Path) -> SimpleNamespace:
    """Fresh modules of modeling.py, optimization.py and run_pretraining.py; ``.models``
    collects every BertModel built (run_pretraining's own code builds it, inside model_fn);
    ``.learning_rates`` every learning-rate tensor create_optimizer hands an optimizer."""
    files = google_bert.installed(oracle_dir, ("modeling", "optimization", "run_pretraining"))
    tfp = _TF(flags=google_bert.Flags(), estimator=_estimator())
    names = {"tensorflow.compat.v1": SimpleNamespace(compat=SimpleNamespace(v1=tfp)),
             "tensorflow.contrib": SimpleNamespace(layers=SimpleNamespace(layer_norm=_layer_norm))}
    modeling = google_bert.load_module(files["modeling"], "google_bert_modeling", names)
    # Two copies of optimization.py: run_pretraining's, whose create_optimizer builds the
    # optimizer _graph puts under its AdamWeightDecayOptimizer, and a pristine one whose
    # class that is (its methods look their own name up in their own module).
    optimization = google_bert.load_module(files["optimization"], "google_bert_optimization", names)
    pristine = google_bert.load_module(files["optimization"], "google_bert_optimization_pristine", names)
    out = SimpleNamespace(modeling=modeling, optimization=optimization, models=[], learning_rates=[])

    class Recorded(modeling.BertModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            out.models.append(self)

    seen = SimpleNamespace(**{**vars(modeling), "BertModel": Recorded})
    out.run_pretraining = google_bert.load_module(
        files["run_pretraining"], "google_bert_run_pretraining",
        {**names, "bert": SimpleNamespace(modeling=seen, optimization=optimization)})
    out.optimizers = {"adam": pristine.AdamWeightDecayOptimizer, "lamb": Lamb}
    return out


def _session(graph):
    # One thread each way: the same op order on every run, and the machine's other core free.
    conf = tf.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    return tf.Session(graph=graph, config=conf)


def _graph(g: SimpleNamespace, case: dict, batches: dict, mode: str, optimizer: str = "adam"):
    """(features, spec) of run_pretraining's model_fn in ``mode`` on placeholders shaped
    like one batch; in TRAIN, create_optimizer builds ``optimizer``."""
    features = {k: tf.placeholder(tf.as_dtype(batches[k].dtype), batches[k].shape[1:], name=k) for k in FEATURES}
    chosen = g.optimizers[optimizer]

    class Recording(chosen):  # notes the learning-rate tensor create_optimizer computes
        def __init__(self, learning_rate, **kwargs):
            super().__init__(learning_rate=learning_rate, **kwargs)
            g.learning_rates.append(learning_rate)

    g.optimization.AdamWeightDecayOptimizer = Recording  # run_pretraining's copy of optimization.py
    model_fn = g.run_pretraining.model_fn_builder(
        bert_config=g.modeling.BertConfig.from_dict(case["bert_config"]), init_checkpoint=None,
        learning_rate=case["lr"], num_train_steps=case["num_train_steps"], num_warmup_steps=case["num_warmup_steps"],
        use_tpu=False, use_one_hot_embeddings=False)
    return features, model_fn(features, None, mode, {})


def _feed(features: dict, batches: dict, i: int) -> dict:
    return {features[k]: batches[k][i] for k in features}


def _restore_weights(sess, prefix: str) -> None:
    """Every variable initialised, then the model's weights read from ``prefix``."""
    sess.run(tf.global_variables_initializer())
    tf.train.Saver(var_list=tf.trainable_variables()).restore(sess, prefix)


def _save_weights(sess, path: Path) -> None:
    """The model's variables as TF holds them, by name: what the checkpoints are compared with."""
    np.savez(path, **{v.op.name: value for v, value in zip(tf.trainable_variables(),
                                                           sess.run(tf.trainable_variables()))})


def train(g: SimpleNamespace, case: dict, batches: dict, out: Path, optimizer: str, init: str | None) -> dict:
    """``case["steps"]`` updates by create_optimizer's train op on batches 0, 1, ...; the
    initial checkpoint is written (``init`` None) or read; the last one written. Beside each
    checkpoint, weights.npz."""
    with tf.Graph().as_default() as graph:
        tf.set_random_seed(case["seed"])
        features, spec = _graph(g, case, batches, "train", optimizer)
        lr = g.learning_rates[-1]
        saver = tf.train.Saver(max_to_keep=None)
        with _session(graph) as sess:
            if init is None:
                sess.run(tf.global_variables_initializer())
                init = saver.save(sess, str(out / "init" / "model.ckpt"), global_step=0, write_meta_graph=False)
                _save_weights(sess, out / "init" / "weights.npz")
            else:
                _restore_weights(sess, init)
            rates, losses = [], []
            for i in range(case["steps"]):
                _, rate, loss = sess.run([spec.train_op, lr, spec.loss], _feed(features, batches, i))
                rates.append(float(rate))
                losses.append(float(loss))
            step = int(sess.run(tf.train.get_global_step()))
            saver.save(sess, str(out / optimizer / "model.ckpt"), global_step=step, write_meta_graph=False)
            _save_weights(sess, out / optimizer / "weights.npz")
    return {"lr": rates, "loss": losses, "global_step": step, "init": init}


def evaluate(g: SimpleNamespace, case: dict, batches: dict, init: str) -> dict[str, np.ndarray]:
    """run_pretraining's EVAL model_fn on the last batch, from the initial weights: the MLM
    and NSP logits (the heads' BiasAdd), the pooled output, and metric_fn's values on labels
    made half right (every other real prediction's label set to the model's argmax, so that
    the accuracy is neither 0 nor 1)."""
    last = len(batches["input_ids"]) - 1
    batch = {k: v[last:last + 1].copy() for k, v in batches.items()}
    with tf.Graph().as_default() as graph:
        features, spec = _graph(g, case, batch, "eval")
        metric_fn, metric_inputs = spec.eval_metrics
        metrics = metric_fn(*metric_inputs)
        heads = {"mlm_logits": graph.get_tensor_by_name("cls/predictions/BiasAdd:0"),
                 "nsp_logits": graph.get_tensor_by_name("cls/seq_relationship/BiasAdd:0"),
                 "pooled": g.models[-1].get_pooled_output()}
        with _session(graph) as sess:
            _restore_weights(sess, init)
            got = sess.run(heads, _feed(features, batch, 0))
            ids, weights = batch["masked_lm_ids"][0], batch["masked_lm_weights"][0]
            argmax = got["mlm_logits"].argmax(-1).reshape(ids.shape)
            real = np.flatnonzero(weights.reshape(-1) > 0)
            ids.reshape(-1)[real[::2]] = argmax.reshape(-1)[real[::2]]
            sess.run(tf.local_variables_initializer())
            sess.run({k: update for k, (_, update) in metrics.items()}, _feed(features, batch, 0))
            values = sess.run({k: value for k, (value, _) in metrics.items()})
            loss = sess.run(spec.loss, _feed(features, batch, 0))
    return {**got, **{k: np.float64(v) for k, v in values.items()}, "loss": np.float64(loss),
            **{f"batch_{k}": v[0] for k, v in batch.items()}}


def main(argv: list[str]) -> int:
    spec_path, out_root = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    for case in spec["cases"]:
        g = load_google(Path(spec["oracle_dir"]))
        out = out_root / case["name"]
        out.mkdir(parents=True, exist_ok=True)
        (out / "bert_config.json").write_text(g.modeling.BertConfig.from_dict(case["bert_config"]).to_json_string())
        with np.load(case["batches"]) as f:
            batches = {k: f[k] for k in FEATURES}
        runs, init = {}, None
        for optimizer in case["optimizers"]:
            runs[optimizer] = train(g, case, batches, out, optimizer, init)
            init = runs[optimizer]["init"]
        np.savez(out / "eval.npz", **evaluate(g, case, batches, init))
        (out / "train.json").write_text(json.dumps({"runs": runs, "tensorflow": tf.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    tf.disable_eager_execution()
    sys.exit(main(sys.argv[1:]))
