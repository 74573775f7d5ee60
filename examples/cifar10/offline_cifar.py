"""An offline stand-in for CIFAR-10's download, to rehearse multi-process data preparation.

``RehearsalCIFAR10`` is torchvision's ``CIFAR10`` with one change: its ``download()`` writes a tiny
synthetic data set in CIFAR-10's on-disk format (``cifar-10-batches-py/`` holding ``data_batch_1``
to ``data_batch_5``, ``test_batch`` and ``batches.meta``) instead of fetching the real archive,
after a pause that stands in for the network. Its checksum table lists the md5 of these synthetic
files, so torchvision's own integrity check and file reader run unchanged on them.

Every real write leaves a marker ``download-rank<RANK>-pid<PID>`` in the root, so a test can tell
which process downloaded. The pictures are noise: a model trained on them learns nothing.

    polytrain fit -c examples/cifar10/config.yaml module.dataset_class=offline_cifar.RehearsalCIFAR10 \
        module.data_root=/tmp/cifar-rehearsal

``UnreachableCIFAR10`` is the other rehearsal: its ``download()`` fails the way torchvision's does on a
machine without network, to show what a failed download looks like on several processes.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
import urllib.error

import numpy as np
from torchvision.datasets import CIFAR10

IMAGES_PER_FILE = 8
DOWNLOAD_SECONDS = 1.0  # long enough that a rank skipping the barrier would find no files
LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _batch_file(name: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    entry = {
        "batch_label": name,
        "labels": [int(v) for v in rng.integers(0, 10, IMAGES_PER_FILE)],
        # CIFAR-10 rows: 1024 red, then 1024 green, then 1024 blue values of a 32x32 picture.
        "data": rng.integers(0, 256, (IMAGES_PER_FILE, 3 * 32 * 32), dtype=np.uint8),
        "filenames": [f"{name}_{i}.png" for i in range(IMAGES_PER_FILE)],
    }
    return pickle.dumps(entry, protocol=2)


def synthetic_files() -> dict[str, bytes]:
    """File name -> contents of the synthetic ``cifar-10-batches-py`` directory (deterministic)."""
    files = {f"data_batch_{i}": _batch_file(f"training batch {i} of 5", i) for i in range(1, 6)}
    files["test_batch"] = _batch_file("testing batch 1 of 1", 0)
    files["batches.meta"] = pickle.dumps(
        {"label_names": LABEL_NAMES, "num_cases_per_batch": IMAGES_PER_FILE, "num_vis": 3 * 32 * 32},
        protocol=2)
    return files


def write_synthetic_cifar10(root: str) -> str:
    """Write the synthetic directory under ``root``; returns its path. Files appear atomically."""
    folder = os.path.join(root, CIFAR10.base_folder)
    os.makedirs(folder, exist_ok=True)
    for name, data in synthetic_files().items():
        tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, os.path.join(folder, name))
    return folder


_MD5 = {name: hashlib.md5(data).hexdigest() for name, data in synthetic_files().items()}


class RehearsalCIFAR10(CIFAR10):
    """``torchvision.datasets.CIFAR10`` whose download writes synthetic files (see the module doc)."""

    train_list = [[f"data_batch_{i}", _MD5[f"data_batch_{i}"]] for i in range(1, 6)]
    test_list = [["test_batch", _MD5["test_batch"]]]
    meta = {"filename": "batches.meta", "key": "label_names", "md5": _MD5["batches.meta"]}

    def download(self) -> None:
        if self._check_integrity():
            return  # already there: torchvision's download does nothing in this case either
        os.makedirs(self.root, exist_ok=True)
        marker = os.path.join(self.root, f"download-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}")
        with open(marker, "w") as fh:
            fh.write(f"LOCAL_RANK={os.environ.get('LOCAL_RANK', '0')}\n")
        time.sleep(DOWNLOAD_SECONDS)
        write_synthetic_cifar10(str(self.root))


class UnreachableCIFAR10(CIFAR10):
    """``torchvision.datasets.CIFAR10`` on a machine without network: the download raises what urllib does."""

    def download(self) -> None:
        if self._check_integrity():
            return
        # as torchvision's download_and_extract_archive does, before fetching
        os.makedirs(self.root, exist_ok=True)
        raise urllib.error.URLError(f"[Errno -3] Temporary failure in name resolution (fetching {self.url})")
