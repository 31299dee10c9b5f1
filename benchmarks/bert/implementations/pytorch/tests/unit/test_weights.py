"""Weight import/export: the TF name map, TF import (fake reader; real TF when installed),
Hugging Face round trip checked by transformers itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bert import weights as wt
from bert.config import ModelConfig
from bert.model import BertForPreTraining

TINY = ModelConfig(vocab_size=40, hidden_size=8, num_layers=2, num_heads=2, intermediate_size=12,
                   max_position_embeddings=16, unpad=False)


def _model(seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    m = BertForPreTraining(TINY)
    with torch.no_grad():  # LayerNorm/bias inits are constants; make every tensor distinct
        for p in m.parameters():
            p.normal_()
    return m.eval()


def test_bert_large_has_398_tf_tensors_unique_and_stable():
    names = wt.tf_tensor_names(ModelConfig())
    assert len(names) == 398
    assert len(set(names)) == 398
    assert names == wt.tf_tensor_names(ModelConfig())
    assert names[0] == "bert/embeddings/word_embeddings"
    for n in ("bert/encoder/layer_0/attention/self/query/kernel", "bert/encoder/layer_23/output/LayerNorm/beta",
              "cls/predictions/output_bias", "cls/seq_relationship/output_weights",
              "bert/embeddings/LayerNorm/gamma", "bert/pooler/dense/kernel"):
        assert n in names


def test_name_map_covers_every_parameter_once():
    mine = set(BertForPreTraining(TINY).state_dict()) - set(wt.TIED)
    assert sorted(m.ours for m in wt.name_map(TINY)) == sorted(mine)


def test_tf_round_trip_is_exact_and_kernels_are_transposed():
    model = _model()
    state = model.state_dict()
    tf = wt.state_dict_to_tf(state, TINY)
    assert tf["bert/encoder/layer_1/intermediate/dense/kernel"].shape == (8, 12)  # [in, out]
    np.testing.assert_array_equal(tf["bert/encoder/layer_1/intermediate/dense/kernel"],
                                  state["bert.encoder.layer.1.intermediate.dense.weight"].numpy().T)
    # The phase-1 checkpoint also holds optimizer slots and a step counter: ignored, as are
    # the slots and counters of every optimizer the reference and Google's BERT train with.
    extra = {f"{n}/{slot}": v for n, v in tf.items()
             for slot in ("adam_m", "adam_v", "LAMB", "LAMB_1", "Adam", "Adam_1", "Momentum", "GradientAccumulator")}
    extra |= {n: np.float32(0.5) for n in ("global_step", "beta1_power", "beta2_power", "update_count",
                                           "current_loss_scale", "good_steps", "loss_scale")}
    back = wt.load_tf_checkpoint("fake.ckpt", TINY, reader=lambda _: tf | extra)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    fresh = BertForPreTraining(TINY)
    fresh.load_state_dict(back, strict=True)
    assert fresh.cls.predictions.decoder.weight.data_ptr() == fresh.bert.embeddings.word_embeddings.weight.data_ptr()


def test_tf_import_names_missing_extra_and_misshaped_tensors():
    tf = wt.state_dict_to_tf(_model().state_dict(), TINY)
    missing = dict(tf)
    del missing["bert/pooler/dense/bias"]
    with pytest.raises(wt.CheckpointError, match=r"ckpt-1: 1 missing tensors .*pooler/dense/bias"):
        wt.state_dict_from_tf(missing, TINY, "ckpt-1")
    with pytest.raises(wt.CheckpointError, match=r"ckpt-2: 1 unexpected tensors .*bert/encoder/layer_2"):
        wt.state_dict_from_tf(tf | {"bert/encoder/layer_2/output/dense/bias": np.zeros(8)}, TINY, "ckpt-2")
    # A counter or slot of some other optimizer is not guessed at: named and refused.
    for name in ("beta3_power", "bert/pooler/dense/kernel/RMSProp", "global_step_1"):
        with pytest.raises(wt.CheckpointError, match=rf"ckpt-4: 1 unexpected tensors \(e.g. \[{name!r}\]\)"):
            wt.state_dict_from_tf(tf | {name: np.zeros(1)}, TINY, "ckpt-4")
    bad = tf | {"bert/embeddings/word_embeddings": np.zeros((41, 8), np.float32)}
    with pytest.raises(wt.CheckpointError, match=r"ckpt-3: tensor 'bert/embeddings/word_embeddings' has shape"):
        wt.state_dict_from_tf(bad, TINY, "ckpt-3")


def test_tf_reader_names_the_file(tmp_path):
    with pytest.raises(wt.CheckpointError, match="model.ckpt-5.index does not exist"):
        wt.read_tf_checkpoint(tmp_path / "model.ckpt-5")


@pytest.mark.parametrize("activation, hidden_act", [("gelu_tanh", "gelu_pytorch_tanh"), ("gelu_erf", "gelu")])
def test_hf_export_loads_in_transformers_and_back_exactly(tmp_path, activation, hidden_act):
    """The export's config.json names model.activation by Hugging Face's name, so that
    transformers computes what the model computes; with the other GELU it would not."""
    import dataclasses
    import json

    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(TINY, activation=activation)
    model = BertForPreTraining(cfg).eval()
    model.load_state_dict(_model().state_dict())
    wt.export_hf(model.state_dict(), cfg, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_act"] == hidden_act
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 7))
    seg = torch.randint(0, 2, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        out = hf(input_ids=ids, token_type_ids=seg, attention_mask=mask)
        mlm, nsp = model.forward_padded(ids, seg, mask)
        other_act = ({"gelu_tanh", "gelu_erf"} - {activation}).pop()
        other = BertForPreTraining(dataclasses.replace(cfg, activation=other_act))
        other.load_state_dict(model.state_dict())
        wrong = other.eval().forward_padded(ids, seg, mask)[0]
    torch.testing.assert_close(out.prediction_logits, mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, nsp, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.prediction_logits, wrong, rtol=1e-5, atol=1e-5)  # the tolerance tells them apart
    # HF's own save -> our import: exact, tied keys filled in.
    hf.save_pretrained(tmp_path / "hf2")
    back = wt.load_hf(tmp_path / "hf2", TINY)
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    BertForPreTraining(TINY).load_state_dict(back, strict=True)


def test_hf_import_names_the_problem(tmp_path):
    with pytest.raises(wt.CheckpointError, match="neither model.safetensors"):
        wt.load_hf(tmp_path, TINY)
    state = _model().state_dict()
    del state["bert.pooler.dense.weight"]
    torch.save(state, tmp_path / "w.bin")
    with pytest.raises(wt.CheckpointError, match=r"w.bin: 1 missing tensors .*pooler"):
        wt.load_hf(tmp_path / "w.bin", TINY)
    (tmp_path / "torn.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(wt.CheckpointError, match="torn.safetensors: cannot read weights"):
        wt.load_hf(tmp_path / "torn.safetensors", TINY)


def test_load_weights_dispatches_on_format(tmp_path):
    from bert.trainer import save_weights

    model = _model(3)
    save_weights(model, str(tmp_path / "ours.pt"))
    wt.export_hf(model.state_dict(), TINY, tmp_path / "hf")
    for path in (tmp_path / "ours.pt", tmp_path / "hf", tmp_path / "hf" / wt.HF_WEIGHTS):
        back = wt.load_weights(path, TINY)
        assert all(torch.equal(back[k], v) for k, v in model.state_dict().items()), path
    (tmp_path / "model.ckpt-9.index").write_bytes(b"")
    with pytest.raises(wt.CheckpointError, match="model.ckpt-9.index: not a TensorFlow checkpoint index"):
        wt.load_weights(tmp_path / "model.ckpt-9", TINY)


def test_checkpoint_cli_converts_both_ways_with_a_bert_config(tmp_path, capsys):
    import json

    from input_preprocessing.__main__ import main

    model = _model(5)
    torch.save(model.state_dict(), tmp_path / "ours.pt")
    (tmp_path / "bert_config.json").write_text(json.dumps(
        {"vocab_size": 40, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 12,
         "max_position_embeddings": 16, "type_vocab_size": 2, "hidden_act": "gelu"}))
    cfg_args = ["--bert-config", str(tmp_path / "bert_config.json")]
    assert main(["checkpoint", "--input", str(tmp_path / "ours.pt"), "--output", str(tmp_path / "hf"), "--to", "hf",
                 *cfg_args]) == 0
    assert main(["checkpoint", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back.pt"), *cfg_args]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # Google's "gelu" (a bert_config.json) is the tanh GELU: an HF export says so in HF's words.
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"
    capsys.readouterr()
    assert main(["checkpoint", "--input", str(tmp_path / "ours.pt"), "--output", str(tmp_path / "hf_erf"), "--to",
                 "hf", "--activation", "gelu_erf", *cfg_args]) == 0
    assert json.loads(capsys.readouterr().out)["activation"] == "gelu_erf"
    assert json.loads((tmp_path / "hf_erf" / "config.json").read_text())["hidden_act"] == "gelu"
    assert main(["checkpoint", "--input", str(tmp_path / "ours.pt"), "--output", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err  # BERT-Large has 22 more layers: assumed, and said so
    assert "ours.pt: 352 missing tensors" in err and "no --bert-config: BERT-Large was assumed" in err
    # The run's own resolved config (what bert.train writes beside its log) is an architecture too.
    from bert.config import Config, dumps

    run_cfg = Config()
    run_cfg.model = TINY
    (tmp_path / "result_0_config.json").write_text(dumps(run_cfg, {"world_size": 2}))
    assert main(["checkpoint", "--input", str(tmp_path / "ours.pt"), "--output", str(tmp_path / "hf2"), "--to", "hf",
                 "--bert-config", str(tmp_path / "result_0_config.json")]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
    # A run's config written before model.activation existed comes from the erf model: exported so.
    saved = json.loads((tmp_path / "result_0_config.json").read_text())
    del saved["model"]["activation"]
    (tmp_path / "old_config.json").write_text(json.dumps(saved))
    assert main(["checkpoint", "--input", str(tmp_path / "ours.pt"), "--output", str(tmp_path / "hf3"), "--to", "hf",
                 "--bert-config", str(tmp_path / "old_config.json")]) == 0
    assert json.loads((tmp_path / "hf3" / "config.json").read_text())["hidden_act"] == "gelu"


@pytest.mark.parametrize("writer, hidden_act, activation", [
    ({}, "gelu", "gelu_tanh"),  # Google's bert_config.json: modeling.gelu is the tanh form
    ({}, None, "gelu_tanh"),  # Google's BertConfig default, "gelu"
    ({"model_type": "bert"}, "gelu", "gelu_erf"),  # Hugging Face's config.json: "gelu" is erf
    ({"model_type": "bert"}, None, "gelu_erf"),
    ({"model_type": "bert"}, "gelu_new", "gelu_tanh"),
    ({"model_type": "bert"}, "gelu_pytorch_tanh", "gelu_tanh"),
])
def test_bert_config_hidden_act_is_read_in_its_writers_meaning(tmp_path, writer, hidden_act, activation):
    import json

    arch = {"vocab_size": 40, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 12, "max_position_embeddings": 16, "type_vocab_size": 2}
    act = {} if hidden_act is None else {"hidden_act": hidden_act}
    (tmp_path / "config.json").write_text(json.dumps({**arch, **writer, **act}))
    cfg = wt.config_from_bert_json(tmp_path / "config.json")
    assert cfg.activation == activation and (cfg.num_layers, cfg.intermediate_size) == (2, 12)


@pytest.mark.parametrize("writer, hidden_act, says", [
    ({}, "relu", r"hidden_act 'relu' \(read as in Google's bert_config.json\); this model implements 'gelu' "
                 r"\(gelu_tanh\) only"),
    ({}, "gelu_new", r"hidden_act 'gelu_new' \(read as in Google's"),  # not a name Google's modeling.py knows
    ({"model_type": "bert"}, "gelu_fast", r"hidden_act 'gelu_fast' \(read as in Hugging Face's config.json\); "
                                          r"this model implements 'gelu_pytorch_tanh' \(gelu_tanh\), "
                                          r"'gelu_new' \(gelu_tanh\), 'gelu' \(gelu_erf\) only"),
])
def test_bert_config_with_another_activation_is_refused_naming_it(tmp_path, writer, hidden_act, says):
    import json

    arch = {"vocab_size": 40, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 12, "max_position_embeddings": 16, "type_vocab_size": 2}
    (tmp_path / "cfg.json").write_text(json.dumps({**arch, **writer, "hidden_act": hidden_act}))
    with pytest.raises(wt.CheckpointError, match="cfg.json: " + says):
        wt.config_from_bert_json(tmp_path / "cfg.json")


# ---------------------------------------------------------------- TF bundle reader (no TensorFlow)

TF_FIXTURE = __import__("pathlib").Path(__file__).parents[1] / "data" / "tf_tiny_ckpt"


def test_bundle_reader_reads_what_tensorflow_wrote():
    from bert.tf_bundle import read_bundle

    saved = np.load(TF_FIXTURE / "values.npz")
    got = read_bundle(TF_FIXTURE / "model.ckpt-7")
    assert sorted(got) == sorted(saved.files)
    for name in saved.files:
        np.testing.assert_array_equal(got[name], saved[name], err_msg=name)
        assert got[name].dtype == saved[name].dtype
    # the import path: optimizer slots and the step counter skipped, the weights mapped
    state = wt.load_weights(TF_FIXTURE / "model.ckpt-7", TINY)
    np.testing.assert_array_equal(state["bert.encoder.layer.1.output.dense.weight"].numpy(),
                                  saved["bert/encoder/layer_1/output/dense/kernel"].T)
    np.testing.assert_array_equal(state["cls.seq_relationship.weight"].numpy(),
                                  saved["cls/seq_relationship/output_weights"])
    BertForPreTraining(TINY).load_state_dict(state, strict=True)


def test_bundle_reader_names_broken_files(tmp_path):
    import shutil

    for f in TF_FIXTURE.glob("model.ckpt-7.*"):
        shutil.copy(f, tmp_path / f.name)
    data = tmp_path / "model.ckpt-7.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(wt.CheckpointError, match=r"model.ckpt-7: .*expected .* \(truncated data file\?\)"):
        wt.load_weights(tmp_path / "model.ckpt-7", TINY)
    (tmp_path / "model.ckpt-7.index").write_bytes(b"\x00" * 100)
    with pytest.raises(wt.CheckpointError, match=r"model.ckpt-7.index: not a TensorFlow checkpoint index"):
        wt.load_weights(tmp_path / "model.ckpt-7", TINY)
