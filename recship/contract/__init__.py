"""The artifact contract, read side: what export writes and every loader (Python here, C++ in cpp_loader/) reads,
importable with no torch, trainer or quantizer (the stdlib and jsonschema only).

- ``manifest``: manifest.json typed (``Manifest`` and its parts, ``Shard`` among them), read, written and checked
  (``check_manifest``); ``ArtifactError``; file checksums.
- ``manifest.schema.json``: the one definition of the manifest and of the tables layout, validated by ``schema`` here
  and interpreted by the C++ loader; ``rules``: the few rules between fields a schema cannot state.
- ``tables``: the manifest's ``tables`` (``TablesSpec``...), the model files' pinned copy of it, and a table's names.
- ``repository``: ``<root>/<model>/<version>/``: version folders read, a new version published atomically.
"""

from recship.contract.manifest import (FORMAT, FORMAT_V1, MAX_ID_BOUND, OP_LIBRARIES, SAMPLE_DTYPES, AotiSpec, ArtifactError,
                                       Manifest, ModelFields, ModelInfo, OutputSpec, Sample, SampleTensor, Shard, Sharding,
                                       SparseFeature, Versions, check_manifest, file_sha256)
from recship.contract.tables import TablesError, TablesSpec

__all__ = ["FORMAT", "FORMAT_V1", "MAX_ID_BOUND", "OP_LIBRARIES", "SAMPLE_DTYPES", "AotiSpec", "ArtifactError", "Manifest",
           "ModelFields", "ModelInfo", "OutputSpec", "Sample", "SampleTensor", "Shard", "Sharding", "SparseFeature",
           "TablesError", "TablesSpec", "Versions", "check_manifest", "file_sha256"]
