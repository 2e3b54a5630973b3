"""TorchRec's Criteo preprocessing scripts (``torchrec.datasets.scripts``), each ``python -m
recship.datasets.scripts.<name> --help``: ``npy_preproc_criteo`` (TSV day files to npy), ``contiguous_preproc_criteo``
(sparse ids renumbered contiguously) and ``shuffle_preproc_criteo`` (training days shuffled together), the steps
of ``recship.datasets.criteo.BinaryCriteoUtils`` in TorchRec's order and file names."""
