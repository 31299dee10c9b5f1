"""Google's own BERT data scripts, run without TensorFlow: the oracle the tests compare
``python -m input_preprocessing create`` with, and the baseline of ``bench/preprocessing.py``.

``bert-tensorflow`` 1.0.4 (PyPI, pure Python) ships ``bert/create_pretraining_data.py`` and
``bert/tokenization.py``: the algorithm of MLCommons' copies in
``retired_benchmarks/bert/cleanup_scripts/`` (the two differ in their imports and docstrings
only). The Makefile installs it ``--no-deps`` into ``.venv/oracle``, off ``sys.path``: its
top-level package is named ``bert``, like ours. This module loads the two files by path under
other names and hands them stand-ins for the few names they import besides the standard
library (``tensorflow.compat.v1``, ``absl.flags``, ``six``), through an ``__import__`` of their
own, so nothing in ``sys.modules`` changes:

- ``tf.gfile.GFile(path, "r")``: ``open(path, encoding="utf-8", newline="\\n")``, what GFile
  is: UTF-8, strict, a line ends at "\\n" only, nothing translated;
- flags: each ``DEFINE_*`` sets its default on ``FLAGS`` (``preserve_unused_tokens`` stays
  False, as the reference runs); ``tf.logging``: does nothing;
- ``six``: Python 3;
- ``tf.train`` (``Example``, ``Features``, ``Feature``, ``Int64List``, ``FloatList``) and
  ``tf.python_io.TFRecordWriter``: the example a TFRecord would hold is kept, not serialized:
  ``SerializeToString()`` returns the ``Example`` itself and the writer appends what it is given
  to ``written[path]`` (``load().written``), so ``write_instance_to_example_files`` runs as it is,
  its padding and id conversion included, and what it wrote can be compared with our files.

A use of any other TensorFlow name fails loudly.
"""

from __future__ import annotations

import builtins
import glob
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

ORACLE_DIR = Path(sys.prefix) / "oracle"  # where `make venv` puts it
VERSION = "1.0.4"
HOW = f"make venv (pip install --no-deps --target .venv/oracle bert-tensorflow=={VERSION})"


class Flags:
    """absl.flags / tf.flags as Google's scripts use them: definitions give defaults."""

    def __init__(self) -> None:
        self.FLAGS = SimpleNamespace()

    def _define(self, name: str, default, *_args, **_kwargs) -> None:
        setattr(self.FLAGS, name, default)

    DEFINE_string = DEFINE_bool = DEFINE_integer = DEFINE_float = _define

    def mark_flag_as_required(self, _name: str) -> None:
        pass


def _gfile(path: str, mode: str = "r"):
    if mode != "r":
        raise ValueError(f"the stand-in GFile reads text only, not mode {mode!r}")
    return open(path, encoding="utf-8", newline="\n")


def _quiet(*_args, **_kwargs) -> None:
    pass


class _Values:
    def __init__(self, value=()) -> None:
        self.value = list(value)


class _Feature:
    def __init__(self, int64_list: _Values | None = None, float_list: _Values | None = None) -> None:
        self.int64_list, self.float_list = int64_list or _Values(), float_list or _Values()


class _Features:
    def __init__(self, feature: dict) -> None:
        self.feature = feature


class _Example:
    def __init__(self, features: _Features) -> None:
        self.features = features

    def SerializeToString(self) -> _Example:  # noqa: N802 (protobuf's name)
        return self

    def values(self) -> dict[str, list]:
        """{feature name: its values}, as TensorFlow would parse them back."""
        return {k: f.int64_list.value or f.float_list.value for k, f in self.features.feature.items()}


def _stand_ins(flags: Flags, written: dict[str, list]) -> dict[str, object]:
    class Writer:
        def __init__(self, path: str) -> None:
            self.records = written.setdefault(path, [])

        def write(self, record: _Example) -> None:
            self.records.append(record)

        def close(self) -> None:
            pass

    tf = SimpleNamespace(gfile=SimpleNamespace(GFile=_gfile, Glob=glob.glob), flags=flags,
                         logging=SimpleNamespace(info=_quiet, set_verbosity=_quiet, INFO=20),
                         train=SimpleNamespace(Example=_Example, Features=_Features, Feature=_Feature,
                                               Int64List=_Values, FloatList=_Values),
                         python_io=SimpleNamespace(TFRecordWriter=Writer))
    # `import tensorflow.compat.v1 as tf` asks for the top package, then walks .compat.v1
    return {"tensorflow.compat.v1": SimpleNamespace(compat=SimpleNamespace(v1=tf)),
            "absl": SimpleNamespace(flags=flags), "six": SimpleNamespace(PY2=False, PY3=True)}


def load_module(path: Path, name: str, names: dict[str, object]) -> ModuleType:
    """The module of file ``path`` under ``name``, its top-level ``import``s of the names in
    ``names`` answered from there; nothing is added to ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)

    def imp(what, globals_=None, locals_=None, fromlist=(), level=0):
        if level == 0 and what in names:
            return names[what]
        return builtins.__import__(what, globals_, locals_, fromlist, level)

    module.__builtins__ = {**vars(builtins), "__import__": imp}
    spec.loader.exec_module(module)
    return module


def load(directory: Path = ORACLE_DIR) -> SimpleNamespace:
    """``.tokenization``, ``.create_pretraining_data`` (fresh modules on every call) and
    ``.written`` (what their TFRecord writers were given, by path); ``FileNotFoundError`` naming
    how to install them when they are not there."""
    files = installed(directory, ("tokenization", "create_pretraining_data"))
    written: dict[str, list] = {}
    names = _stand_ins(Flags(), written)
    tok = load_module(files["tokenization"], "google_bert_tokenization", names)
    cpd = load_module(files["create_pretraining_data"], "google_bert_create_pretraining_data",
                      {**names, "bert": SimpleNamespace(tokenization=tok)})
    return SimpleNamespace(tokenization=tok, create_pretraining_data=cpd, written=written)


def installed(directory: Path, modules: tuple[str, ...]) -> dict[str, Path]:
    """{module: its file} of bert-tensorflow's ``bert/<module>.py`` in ``directory``;
    ``FileNotFoundError`` naming how to install them when a file or the version is not there."""
    root = Path(directory) / "bert"
    files = {m: root / f"{m}.py" for m in modules}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Google's bert-tensorflow is not installed ({', '.join(missing)}): {HOW}")
    meta = Path(directory) / f"bert_tensorflow-{VERSION}.dist-info"
    if not meta.is_dir():
        raise FileNotFoundError(f"{directory}: not bert-tensorflow {VERSION}: {HOW}")
    return files
