"""TorchRec's ``model_packager`` and ``state_dict_transform``: a PredictFactory class, its configs and extra files in
a ``torch.package``, and the state_dict moves that feed a packaged predict module its weights.

    class MyPackager(PredictFactoryPackager):
        @classmethod
        def set_extern_modules(cls, pe): pe.extern(["torch.**", "recship.**", "fbgemm_gpu.**", "numpy.**"])
        @classmethod
        def set_mocked_modules(cls, pe): pe.mock(["grpc.**"])

    MyPackager.save_predict_factory(MyFactory, {"model_config": config}, "model.pt", extra_files={})
    importer = torch.package.PackageImporter("model.pt")
    factory = importer.import_module(LOADER_MODULE).MODULE_FACTORY()   # inside, load_pickle_config("model_config", ...)

The package holds a loader module (``LOADER_MODULE``, binding ``LOADER_FACTORY`` to the factory class), the configs
(``CONFIG_MODULE``: strings as text, anything else pickled), the extra files (``extra_files/``) and the factory's
module (interned, with what it imports that the packager does not extern or mock). recship serves its own artifact
(``recship export``); a package is for TorchRec code that ships its predict factories this way.
"""

import abc
import inspect
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Type, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.package import Importer, PackageExporter, sys_importer

from recship.export.predict import PredictFactory

LOADER_MODULE = "__module_loader"
LOADER_FACTORY = "MODULE_FACTORY"
LOADER_CODE = f"""
import %PACKAGE%

{LOADER_FACTORY}=%PACKAGE%.%CLASS%
"""
CONFIG_MODULE = "__configs"

T = TypeVar("T")


def _importer() -> Any:
    """The PackageImporter running the calling code: ``torch_package_importer`` where this module is inside the
    package, else that of the nearest caller loaded from a package (its ``__loader__``)."""
    try:
        # lazy: torch.package's name for the running importer, which exists only inside a package
        import torch_package_importer  # type: ignore[import-not-found]

        return torch_package_importer
    except ImportError:
        pass
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__torch_package__"):
            return frame.f_globals["__loader__"]
        frame = frame.f_back
    raise RuntimeError("load_config_text / load_pickle_config read a torch.package's configs: call them from code the "
                       "package holds (a PackageImporter's module), as a packaged PredictFactory does")


def load_config_text(name: str) -> str:
    """The text config ``name`` saved by ``PredictFactoryPackager.save_predict_factory`` (from packaged code)."""
    text: str = _importer().load_text(CONFIG_MODULE, name)
    return text


def load_pickle_config(name: str, clazz: Type[T]) -> T:
    """The pickled config ``name`` (from packaged code); TypeError if it is not a ``clazz`` (TorchRec: assert)."""
    loaded = _importer().load_pickle(CONFIG_MODULE, name)
    if not isinstance(loaded, clazz):
        raise TypeError(f"The loaded config {type(loaded)} is not of type {clazz}")
    return loaded


class PredictFactoryPackager:
    """Writes a PredictFactory into a torch.package; subclasses say which modules stay outside it
    (``set_extern_modules``: loaded from the environment) and which are stubbed (``set_mocked_modules``)."""

    @classmethod
    @abc.abstractmethod
    def set_extern_modules(cls, pe: PackageExporter) -> None:
        """``pe.extern([...])`` for the modules the loading side provides (torch, fbgemm_gpu, ...)."""

    @classmethod
    @abc.abstractmethod
    def set_mocked_modules(cls, pe: PackageExporter) -> None:
        """``pe.mock([...])`` for modules imported but not used at load time."""

    @classmethod
    def save_predict_factory(
        cls,
        predict_factory: Type[PredictFactory],
        configs: Dict[str, Any],
        output: Union[str, Path, BinaryIO],
        extra_files: Dict[str, Union[str, bytes]],
        loader_code: str = LOADER_CODE,
        package_importer: Union[Importer, List[Importer]] = sys_importer,
    ) -> None:
        """Writes the package to ``output``: the factory class's module, ``configs`` (name -> str, or any picklable),
        ``extra_files`` (name -> str or bytes, under ``extra_files``) and the loader module (``loader_code`` with
        ``%PACKAGE%`` and ``%CLASS%`` replaced). ValueError for an extra file neither str nor bytes."""
        for name, value in extra_files.items():
            if not isinstance(value, (str, bytes)):
                raise ValueError(f"extra file {name!r}: unsupported type {type(value)} (str or bytes)")
        with PackageExporter(output, importer=package_importer) as pe:
            cls.set_extern_modules(pe)
            cls.set_mocked_modules(pe)
            pe.extern(["sys"])
            pe.intern("**")
            for name, value in extra_files.items():
                if isinstance(value, str):
                    pe.save_text("extra_files", name, value)
                else:
                    pe.save_binary("extra_files", name, value)
            cls._save_predict_factory(pe, predict_factory, configs, loader_code=loader_code)

    @classmethod
    def _save_predict_factory(cls, pe: PackageExporter, predict_factory: Type[PredictFactory], configs: Dict[str, Any],
                              loader_code: str = LOADER_CODE) -> None:
        # a factory loaded from a package has a "<torch_package_N>." module prefix; the package saves it without
        package = predict_factory.__module__
        if package.startswith("<torch_package_"):
            package = package.split(".", 1)[1]
        code = loader_code.replace("%PACKAGE%", package).replace("%CLASS%", predict_factory.__name__)
        pe.save_source_string(module_name=LOADER_MODULE, src=code)
        for name, config in configs.items():
            if isinstance(config, str):
                pe.save_text(CONFIG_MODULE, name, config)
            else:
                pe.save_pickle(CONFIG_MODULE, name, config)
        pe.save_module(predict_factory.__module__)


StateDict = Dict[str, Union[torch.Tensor, ShardedTensor]]


def state_dict_gather(src: StateDict, dst: Dict[str, torch.Tensor]) -> None:
    """Fills ``dst`` (a whole model's state_dict, e.g. a predict module's) from ``src`` (this rank's, sharded) for
    ``dst``'s keys: ShardedTensors are gathered onto rank 0's ``dst`` tensor (a collective: every rank calls it, in
    the same key order), plain tensors copied. ValueError for another kind of value."""
    for key, dst_tensor in dst.items():
        src_tensor = src[key]
        if isinstance(src_tensor, ShardedTensor):
            src_tensor.gather(out=dst_tensor if dist.get_rank() == 0 else None, dtype=dst_tensor.dtype)
        elif isinstance(src_tensor, torch.Tensor):
            dst_tensor.copy_(src_tensor)
        else:
            raise ValueError(f"Unsupported tensor {key} type {type(src_tensor)}")


def state_dict_all_gather_keys(state_dict: StateDict, pg: ProcessGroup) -> List[str]:
    """Every key of ``state_dict`` on any rank of ``pg``, sorted (a collective)."""
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, list(state_dict.keys()), pg)
    return sorted({name for names in gathered for name in names})


def state_dict_to_device(state_dict: StateDict, pg: ProcessGroup, device: torch.device) -> StateDict:
    """``state_dict`` on ``device``: plain tensors moved, ShardedTensors rebuilt from their local shards moved; a key
    another rank has and this one lacks (a table-wise table placed elsewhere) gets an empty ShardedTensor, so every
    rank holds every key (a collective). ValueError for another kind of value."""
    out: StateDict = {}
    for key in state_dict_all_gather_keys(state_dict, pg):
        if key not in state_dict:
            out[key] = ShardedTensor._init_from_local_shards([], [], process_group=pg)
            continue
        tensor = state_dict[key]
        if isinstance(tensor, ShardedTensor):
            shards = [Shard.from_tensor_and_offsets(tensor=s.tensor.to(device), shard_offsets=s.metadata.shard_offsets,
                                                    rank=dist.get_rank(pg)) for s in tensor.local_shards()]
            out[key] = ShardedTensor._init_from_local_shards(shards, tensor.metadata().size, process_group=pg)
        elif isinstance(tensor, torch.Tensor):
            out[key] = tensor.to(device)
        else:
            raise ValueError(f"Unsupported tensor {key} type {type(tensor)}")
    return out
