"""TorchRec's ``torchrec.datasets``, module for module (the import map sends ``torchrec.datasets.<m>`` to
``recship.datasets.<m>``): ``criteo`` (the Criteo layout, its TSV datapipes and the binary npy pipeline),
``movielens`` (``movielens_20m`` / ``movielens_25m`` from a local folder), ``utils`` (``Batch``, datapipes,
train/validation splits) and ``random`` (``RandomRecDataset``, TorchRec's batches for the same seed).

The package itself holds the names TorchRec's examples import from it, the Criteo ones where the modules differ
(``DEFAULT_COLUMN_NAMES``, ``COLUMN_TYPE_CASTERS``: MovieLens's are in ``recship.datasets.movielens``). Not here:
TorchRec's preprocessing scripts (``torchrec.datasets.scripts``; ``BinaryCriteoUtils`` has their steps).
"""

from recship.datasets.criteo import (CAT_FEATURE_COUNT, COLUMN_TYPE_CASTERS, DAYS, DEFAULT_CAT_NAMES, DEFAULT_COLUMN_NAMES,
                                     DEFAULT_INT_NAMES, DEFAULT_LABEL_NAME, FREQUENCY_THRESHOLD, INT_FEATURE_COUNT,
                                     TOTAL_TRAINING_SAMPLES, BinaryCriteoUtils, CriteoIterDataPipe,
                                     InMemoryBinaryCriteoIterDataPipe, criteo_kaggle, criteo_terabyte)
from recship.datasets.movielens import (DEFAULT_MOVIES_COLUMN_NAMES, DEFAULT_RATINGS_COLUMN_NAMES, MOVIES_FILENAME,
                                        RATINGS_FILENAME, movielens_20m, movielens_25m)
from recship.datasets.random import RandomRecDataset
from recship.datasets.utils import (PATH_MANAGER_KEY, Batch, Limit, LoadFiles, ParallelReadConcat, Pipelineable,
                                    ReadLinesFromCSV, idx_split_train_val, rand_split_train_val, safe_cast, train_filter,
                                    val_filter)

__all__ = ["Batch", "BinaryCriteoUtils", "CAT_FEATURE_COUNT", "COLUMN_TYPE_CASTERS", "CriteoIterDataPipe", "DAYS", "DEFAULT_CAT_NAMES",
           "DEFAULT_COLUMN_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_LABEL_NAME", "DEFAULT_MOVIES_COLUMN_NAMES",
           "DEFAULT_RATINGS_COLUMN_NAMES", "FREQUENCY_THRESHOLD", "INT_FEATURE_COUNT", "InMemoryBinaryCriteoIterDataPipe", "Limit", "LoadFiles",
           "MOVIES_FILENAME", "PATH_MANAGER_KEY", "ParallelReadConcat", "Pipelineable", "RATINGS_FILENAME",
           "RandomRecDataset", "ReadLinesFromCSV", "TOTAL_TRAINING_SAMPLES", "criteo_kaggle", "criteo_terabyte",
           "idx_split_train_val", "movielens_20m", "movielens_25m", "rand_split_train_val", "safe_cast", "train_filter",
           "val_filter"]
