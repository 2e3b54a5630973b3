"""The artifact contract, read side: what export writes and every loader (Python here, C++ in cpp_loader/) reads,
importable with no torch, trainer or quantizer (the stdlib and jsonschema only).

- ``manifest``: manifest.json typed (``Manifest`` and its parts, ``Shard`` among them), read, written and checked
  (``check_manifest``); ``ArtifactError``; file checksums.
- ``manifest.schema.json``: the one definition of the manifest and of the tables layout, validated by ``schema`` here
  and interpreted by the C++ loader; ``rules``: the few rules between fields a schema cannot state.
- ``tables``: the manifest's ``tables`` (``TablesSpec``...), the model files' pinned copy of it, and a table's names.
- ``repository``: ``<root>/<model>/<version>/``: version folders read, a new version published atomically.

Opening an artifact: every loader (Python's ``recship.export.artifact.open_artifact``, the C++ ``Model::load``) verifies
it as a unit before any of it runs, in this order, each failure an ArtifactError naming the file, in the same words:

1. manifest.json: with an allow-list, its sha256 must be listed; then the contract (``check_manifest``);
2. the torch and fbgemm_gpu it was built with must be the loader's releases;
3. which model file runs: model.pt2 where it is asked for (or, with "auto", where it runs here), else model.pt;
4. every model file the manifest lists, by sha256, whichever runs;
5. tables.bin (format 2): its size, then every table's sha256;
6. each model file's copy of the tables spec (``tables.check_pinned``);
7. the sample files: sizes, a valid request, finite outputs (with the self-check);
8. the fbgemm op libraries it names, then the model from the very bytes that were hashed, then the sample run.
"""

from recship.contract.manifest import (FORMAT, FORMAT_V1, MAX_ID_BOUND, OP_LIBRARIES, SAMPLE_DTYPES, AotiSpec, ArtifactError,
                                       Manifest, ModelFields, ModelInfo, OutputSpec, Sample, SampleTensor, Shard, Sharding,
                                       SparseFeature, Versions, check_manifest, file_sha256)
from recship.contract.tables import TablesError, TablesSpec

__all__ = ["FORMAT", "FORMAT_V1", "MAX_ID_BOUND", "OP_LIBRARIES", "SAMPLE_DTYPES", "AotiSpec", "ArtifactError", "Manifest",
           "ModelFields", "ModelInfo", "OutputSpec", "Sample", "SampleTensor", "Shard", "Sharding", "SparseFeature",
           "TablesError", "TablesSpec", "Versions", "check_manifest", "file_sha256"]
