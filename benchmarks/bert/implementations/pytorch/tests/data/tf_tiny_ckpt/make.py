"""Writes the tiny TF1 checkpoint next to this file with real TensorFlow (the oracle for
bert/tf_bundle.py, so the tests need no TensorFlow). Variables are named as Google BERT's
modeling.py names them, plus LAMB slots and global_step as in the MLPerf phase-1 checkpoint;
``values.npz`` holds what was saved. Regenerate (in an environment with tensorflow-cpu):

    python tests/data/tf_tiny_ckpt/make.py
"""

from pathlib import Path

import numpy as np
import tensorflow as tf

V, H, L, I, P, T = 40, 8, 2, 12, 16, 2  # vocab, hidden, layers, intermediate, positions, token types


def shapes() -> dict:
    s = {"bert/embeddings/word_embeddings": [V, H], "bert/embeddings/position_embeddings": [P, H],
         "bert/embeddings/token_type_embeddings": [T, H],
         "bert/embeddings/LayerNorm/gamma": [H], "bert/embeddings/LayerNorm/beta": [H]}
    for i in range(L):
        b = f"bert/encoder/layer_{i}"
        for d in ("query", "key", "value"):
            s[f"{b}/attention/self/{d}/kernel"], s[f"{b}/attention/self/{d}/bias"] = [H, H], [H]
        s[f"{b}/attention/output/dense/kernel"], s[f"{b}/attention/output/dense/bias"] = [H, H], [H]
        s[f"{b}/attention/output/LayerNorm/gamma"] = s[f"{b}/attention/output/LayerNorm/beta"] = [H]
        s[f"{b}/intermediate/dense/kernel"], s[f"{b}/intermediate/dense/bias"] = [H, I], [I]
        s[f"{b}/output/dense/kernel"], s[f"{b}/output/dense/bias"] = [I, H], [H]
        s[f"{b}/output/LayerNorm/gamma"] = s[f"{b}/output/LayerNorm/beta"] = [H]
    s["bert/pooler/dense/kernel"], s["bert/pooler/dense/bias"] = [H, H], [H]
    s["cls/predictions/transform/dense/kernel"], s["cls/predictions/transform/dense/bias"] = [H, H], [H]
    s["cls/predictions/transform/LayerNorm/gamma"] = s["cls/predictions/transform/LayerNorm/beta"] = [H]
    s["cls/predictions/output_bias"] = [V]
    s["cls/seq_relationship/output_weights"], s["cls/seq_relationship/output_bias"] = [2, H], [2]
    return s


def main() -> None:
    here = Path(__file__).resolve().parent
    rng = np.random.default_rng(0)
    values = {}
    for name, shape in shapes().items():
        values[name] = rng.standard_normal(shape).astype(np.float32)
        for slot in ("adam_m", "adam_v"):
            values[f"{name}/{slot}"] = rng.standard_normal(shape).astype(np.float32)
    tf.compat.v1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name=n) for n, v in values.items()]
        step = tf.compat.v1.Variable(np.int64(7), name="global_step")
        saver = tf.compat.v1.train.Saver(variables + [step])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(here / "model.ckpt"), global_step=7, write_meta_graph=False)
    np.savez(here / "values.npz", **values, global_step=np.int64(7))
    (here / "checkpoint").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
