"""The image path without the image: the base image's pins, the reaping of a killed session's
engine, and run_with_docker.sh's checks of its input (before any docker call). The tests that
need the built image are in tests/integration/test_image.py."""

from __future__ import annotations

from tools.image_constraints import image_constraints


def test_image_constraints_keep_the_base_images_pins():
    """The base's pins win (any spelling of the name); torch always goes; the rest stays."""
    ours = "# pins\ntorch==2.13.0\nnumpy==2.4.6\nPyYAML==6.0.4\nh5py==3.16.0  # hdf5\n"
    base = ["NumPy==1.26.4\n# h5py==3.1\npyyaml @ file:///tmp/pyyaml.whl\n-c more.txt\n",
            "torch==2.9.0a0+nv25.10\n"]
    text, dropped = image_constraints(ours, base)
    assert text == "# pins\nh5py==3.16.0  # hdf5\n"
    assert dropped == ["torch==2.13.0", "numpy==2.4.6", "PyYAML==6.0.4"]
    assert image_constraints(ours, [])[0] == "# pins\nnumpy==2.4.6\nPyYAML==6.0.4\nh5py==3.16.0  # hdf5\n"
