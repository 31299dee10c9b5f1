"""Model weights in and out: the TensorFlow phase-1 checkpoint, Hugging Face files, ours.

Our parameter names are Hugging Face ``BertForPreTraining``'s (see ``bert/model.py``), so
the only real translation is to and from the 398 TensorFlow tensor names of Google's BERT
(``bert/encoder/layer_0/attention/self/query/kernel``, ...), which the MLPerf phase-1
checkpoint ``model.ckpt-28252`` uses and which the v1.1/v2.0 compliance rules want logged
once each (``weights_initialization``). ``name_map`` is the one table for both uses.

TensorFlow differs from us in three ways: dense kernels are stored ``[in, out]`` (torch's
``Linear.weight`` is ``[out, in]``), LayerNorm's weight/bias are ``gamma``/``beta``, and
the heads have names of their own (``cls/predictions/output_bias``,
``cls/seq_relationship/output_weights`` = our ``cls.seq_relationship.weight``, not
transposed). The MLM decoder weight is tied to the word embeddings and so has no TF name.

Training state (optimizer, loader position) for resuming is not here; this module only
moves model weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .config import ABSENT_MEANT, ModelConfig
from .model import BertForPreTraining
from .tf_bundle import BundleError, read_bundle


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not hold the tensors the model needs; names the file."""


@dataclass(frozen=True)
class NameMapEntry:
    ours: str  # our (= Hugging Face BertForPreTraining) state-dict key
    tf: str  # TensorFlow variable name
    transpose: bool  # TF stores this dense kernel [in, out]; ours is [out, in]


def _dense(ours: str, tf: str) -> list[NameMapEntry]:
    return [NameMapEntry(f"{ours}.weight", f"{tf}/kernel", True),
            NameMapEntry(f"{ours}.bias", f"{tf}/bias", False)]


def _layer_norm(ours: str, tf: str) -> list[NameMapEntry]:
    return [NameMapEntry(f"{ours}.weight", f"{tf}/gamma", False),
            NameMapEntry(f"{ours}.bias", f"{tf}/beta", False)]


def name_map(cfg: ModelConfig) -> list[NameMapEntry]:
    """Every TF tensor of the model with its key here, in the model's parameter order.

    The order is stable (embeddings, layers 0..L-1, pooler, heads) so logs built from it
    are reproducible.
    """
    e = "bert.embeddings"
    out = [NameMapEntry(f"{e}.word_embeddings.weight", "bert/embeddings/word_embeddings", False),
           NameMapEntry(f"{e}.position_embeddings.weight", "bert/embeddings/position_embeddings", False),
           NameMapEntry(f"{e}.token_type_embeddings.weight", "bert/embeddings/token_type_embeddings", False)]
    out += _layer_norm(f"{e}.LayerNorm", "bert/embeddings/LayerNorm")
    for i in range(cfg.num_layers):
        o, t = f"bert.encoder.layer.{i}", f"bert/encoder/layer_{i}"
        for proj in ("query", "key", "value"):
            out += _dense(f"{o}.attention.self.{proj}", f"{t}/attention/self/{proj}")
        out += _dense(f"{o}.attention.output.dense", f"{t}/attention/output/dense")
        out += _layer_norm(f"{o}.attention.output.LayerNorm", f"{t}/attention/output/LayerNorm")
        out += _dense(f"{o}.intermediate.dense", f"{t}/intermediate/dense")
        out += _dense(f"{o}.output.dense", f"{t}/output/dense")
        out += _layer_norm(f"{o}.output.LayerNorm", f"{t}/output/LayerNorm")
    out += _dense("bert.pooler.dense", "bert/pooler/dense")
    out += _dense("cls.predictions.transform.dense", "cls/predictions/transform/dense")
    out += _layer_norm("cls.predictions.transform.LayerNorm", "cls/predictions/transform/LayerNorm")
    out += [NameMapEntry("cls.predictions.bias", "cls/predictions/output_bias", False),
            NameMapEntry("cls.seq_relationship.weight", "cls/seq_relationship/output_weights", False),
            NameMapEntry("cls.seq_relationship.bias", "cls/seq_relationship/output_bias", False)]
    return out


def tf_tensor_names(cfg: ModelConfig) -> list[str]:
    """The TensorFlow checkpoint's model tensor names (398 for BERT-Large), stable order."""
    return [m.tf for m in name_map(cfg)]


# Keys of our state dict that are the same tensor as another key (weight tying in
# bert/model.py): filled from their source on import, never looked up in a file.
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}

# TF variables that are not model weights, written by the optimizers and training loops of
# Google's BERT and the MLCommons reference: ignored on import (and never read: the phase-1
# checkpoint is 3x the model). Any other name that is not a model tensor is refused, by name.
# Slots, one per weight ("<weight>/<slot>"): adam_m, adam_v (AdamWeightDecayOptimizer, Google's
# and the reference's; the phase-1 checkpoint holds them); LAMB, LAMB_1 (lamb_optimizer_v1.py's
# m and v: TF names a slot after its optimizer, "_1" for the second); Adam, Adam_1
# (tf.train.AdamOptimizer); Momentum; GradientAccumulator (the reference's gradient
# accumulation, deferred_grad_optimizer.py).
_TF_SLOT_SUFFIXES = ("/adam_m", "/adam_v", "/LAMB", "/LAMB_1", "/Adam", "/Adam_1", "/Momentum",
                     "/GradientAccumulator")
# Counters: the step; LAMB's and Adam's bias-correction powers b^t; gradient accumulation's
# update count; the dynamic loss scale of TF's mixed precision and its count of good steps.
_TF_COUNTERS = ("global_step", "beta1_power", "beta2_power", "update_count", "current_loss_scale", "good_steps",
                "loss_scale")


def _is_tf_model_tensor(name: str) -> bool:
    return not (name.endswith(_TF_SLOT_SUFFIXES) or name in _TF_COUNTERS
                or name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH"))


def _check_names(source: str, have: set[str], want: list[str], what: str) -> None:
    missing = [n for n in want if n not in have]
    extra = sorted(have - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing {what} (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} unexpected {what} (e.g. {extra[:3]})")
        raise CheckpointError(f"{source}: " + "; ".join(parts))


def _check_shape(source: str, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {got}; the model config wants {want}")


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only, no memory
        model = BertForPreTraining(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- TensorFlow


def state_dict_from_tf(tensors: Mapping[str, Any], cfg: ModelConfig, source: str = "TF checkpoint"
                       ) -> dict[str, torch.Tensor]:
    """Our state dict from ``{tf_name: array}`` (optimizer slots and step counters ignored).

    Raises ``CheckpointError`` naming ``source`` on a missing or unexpected model tensor or
    a shape that does not fit ``cfg``.
    """
    table = name_map(cfg)
    _check_names(source, {n for n in tensors if _is_tf_model_tensor(n)}, [m.tf for m in table], "tensors")
    shapes = _expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for m in table:
        arr = np.asarray(tensors[m.tf])
        t = torch.from_numpy(np.ascontiguousarray(arr.T if m.transpose else arr)).float()
        _check_shape(source, m.tf, tuple(t.shape), shapes[m.ours])
        out[m.ours] = t
    for tied, src in TIED.items():
        out[tied] = out[src]
    return out


def state_dict_to_tf(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{tf_name: float32 array}`` of our state dict (the inverse of ``state_dict_from_tf``)."""
    table = name_map(cfg)
    _check_names("state dict", set(state) - set(TIED), [m.ours for m in table], "keys")
    out = {}
    for m in table:
        a = state[m.ours].detach().float().cpu().numpy()
        out[m.tf] = np.ascontiguousarray(a.T if m.transpose else a)
    return out


def read_tf_checkpoint(prefix: str | Path) -> dict[str, np.ndarray]:
    """The model variables of a TF checkpoint (``model.ckpt-28252`` = the prefix of its
    ``.index``/``.data-*`` files); optimizer slots are not read.

    Read by ``bert/tf_bundle.py`` (no TensorFlow needed); a checkpoint feature it does not
    decode (compressed index, sliced tensors) falls back to TensorFlow when installed.
    """
    prefix = str(prefix)
    if not Path(prefix + ".index").is_file():
        raise CheckpointError(f"{prefix}: no TensorFlow checkpoint here ({prefix}.index does not exist; "
                              "pass the prefix, e.g. .../model.ckpt-28252)")
    try:
        return read_bundle(prefix, keep=_is_tf_model_tensor)
    except BundleError as e:
        own = str(e)
    try:
        import tensorflow as tf  # optional, large; only for checkpoints the bundle reader refuses
    except ImportError:
        raise CheckpointError(f"{own} (TensorFlow, which might read it, is not installed)") from None
    try:
        reader = tf.train.load_checkpoint(prefix)
        return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if _is_tf_model_tensor(n)}
    except Exception as e:  # TF raises its own error types; name the file and the cause
        raise CheckpointError(f"{prefix}: cannot read TensorFlow checkpoint: {e}") from None


def load_tf_checkpoint(prefix: str | Path, cfg: ModelConfig,
                       reader: Callable[[str | Path], Mapping[str, Any]] = read_tf_checkpoint
                       ) -> dict[str, torch.Tensor]:
    """Our state dict from a TF checkpoint (``reader`` is replaceable for tests)."""
    return state_dict_from_tf(reader(prefix), cfg, str(prefix))


# ---------------------------------------------------------------- Hugging Face

HF_WEIGHTS = "model.safetensors"

# ``hidden_act`` -> model.activation. One word, two functions: in Google's bert_config.json
# (the reference's) "gelu" is modeling.gelu, the tanh form; in Hugging Face's config.json
# "gelu" is the exact erf form and the tanh form is "gelu_new" (its formula written out) or
# "gelu_pytorch_tanh" (torch's kernel, the one the model runs: what an export writes).
TF_ACTIVATIONS = {"gelu": "gelu_tanh"}
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu_erf"}


def hf_activation(cfg: ModelConfig) -> str:
    """Hugging Face's ``hidden_act`` for ``cfg.activation`` (the first of its names above)."""
    return next(hf for hf, ours in HF_ACTIVATIONS.items() if ours == cfg.activation)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Hugging Face ``BertConfig`` fields of ``cfg`` (what ``config.json`` holds)."""
    return {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
            "hidden_act": hf_activation(cfg), "hidden_dropout_prob": cfg.hidden_dropout,
            "attention_probs_dropout_prob": cfg.attention_dropout,
            "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": cfg.type_vocab_size,
            "initializer_range": cfg.initializer_range, "layer_norm_eps": cfg.layer_norm_eps,
            "tie_word_embeddings": True, "pad_token_id": 0}


def export_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, directory: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``BertForPreTraining.from_pretrained``
    loads. Tied copies are written once (HF re-ties them). Files appear complete or not at all."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _check_names("state dict", set(state) - set(TIED), [m.ours for m in name_map(cfg)], "keys")
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in state.items() if k not in TIED}
    for name, write in ((HF_WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"})),
                        ("config.json", lambda p: p.write_text(json.dumps(hf_config(cfg), indent=2) + "\n"))):
        tmp = d / (name + ".tmp")
        write(tmp)
        tmp.replace(d / name)
    return d


def load_hf(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from Hugging Face weights: a directory (``model.safetensors`` or
    ``pytorch_model.bin``) or one such file. Buffers HF keeps (``position_ids``) are dropped."""
    p = Path(path)
    if p.is_dir():
        found = [p / n for n in (HF_WEIGHTS, "pytorch_model.bin") if (p / n).is_file()]
        if not found:
            raise CheckpointError(f"{p}: holds neither {HF_WEIGHTS} nor pytorch_model.bin")
        p = found[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: name it and the cause
        raise CheckpointError(f"{p}: cannot read weights: {e}") from None
    state = {k: v for k, v in state.get("model", state).items() if not k.endswith("position_ids")}
    return check_state_dict(state, cfg, str(p))


def check_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str
                     ) -> dict[str, torch.Tensor]:
    """``state`` with tied keys filled in, after checking names and shapes against ``cfg``."""
    _check_names(source, set(state) - set(TIED), [m.ours for m in name_map(cfg)], "tensors")
    shapes = _expected_shapes(cfg)
    out = dict(state)
    for tied, src in TIED.items():
        out.setdefault(tied, out[src])
    for k, v in out.items():
        _check_shape(source, k, tuple(v.shape), shapes[k])
    return out


# ---------------------------------------------------------------- any of the above


def load_weights(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from whichever format ``path`` is: a TF checkpoint prefix (``.index``
    next to it), a Hugging Face directory or ``.safetensors``/``.bin`` file, or our own
    ``torch.save`` file (a state dict, or a dict with it under ``"model"``)."""
    p = Path(path)
    if Path(str(p) + ".index").is_file():
        return load_tf_checkpoint(p, cfg)
    return load_hf(p, cfg)


def config_from_bert_json(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """``cfg`` with the architecture and activation of a Google ``bert_config.json``, a Hugging
    Face ``config.json``, or a run's own resolved config (``<log>_config.json`` beside its MLPerf
    log: its ``model`` section). ``hidden_act`` is read with the meaning of whichever wrote it
    (Hugging Face's has ``model_type``, which transformers writes into every config.json and
    Google's never holds)."""
    import dataclasses

    p = Path(path)
    try:
        j = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: cannot read the BERT config: {e}") from None
    if isinstance(j, dict) and isinstance(j.get("model"), dict):  # a run's resolved config
        fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
        model = {k: v for k, v in j["model"].items() if k in fields}
        missing = [k for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                               "max_position_embeddings", "type_vocab_size") if k not in model]
        if missing:
            raise CheckpointError(f"{p}: its model section lacks {missing}")
        for key, meant in ABSENT_MEANT.items():  # a config written before the key existed
            section, _, name = key.partition(".")
            if section == "model":
                model.setdefault(name, meant)
        return dataclasses.replace(base or ModelConfig(), **model)
    keys = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
            "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size"}
    missing = [k for k in keys if k not in j]
    if missing:
        raise CheckpointError(f"{p}: lacks {missing} (neither a bert_config.json nor a run's <log>_config.json)")
    table, whose = ((HF_ACTIVATIONS, "Hugging Face's config.json") if "model_type" in j
                    else (TF_ACTIVATIONS, "Google's bert_config.json"))
    act = j.get("hidden_act", "gelu")  # both BertConfigs default to "gelu" (each with its own meaning)
    if act not in table:
        raise CheckpointError(f"{p}: hidden_act {act!r} (read as in {whose}); this model implements "
                              + ", ".join(f"{k!r} ({v})" for k, v in table.items()) + " only")
    return dataclasses.replace(base or ModelConfig(), activation=table[act],
                               **{ours: int(j[k]) for k, ours in keys.items()})
