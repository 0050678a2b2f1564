"""The digits source reads scikit-learn's file without importing scikit-learn, and gets what
scikit-learn's own `load_digits` gives, value for value."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from hpcml.data.sources import digits_arrays


def test_the_digits_are_scikit_learns_bit_for_bit() -> None:
    from sklearn.datasets import load_digits

    images, labels = digits_arrays()
    bunch = load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.float32
    np.testing.assert_array_equal(images, bunch.images.astype(np.float32))
    np.testing.assert_array_equal(labels, bunch.target)


def test_loading_the_digits_imports_no_scikit_learn() -> None:
    """What made every digits run pay seconds of imports (SciPy, pandas, pyarrow)."""
    code = (
        "import sys; from hpcml.config import DataConfig; from hpcml.data.sources import "
        "load_digits; load_digits(DataConfig()); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy', 'pandas'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
