"""The ``recship`` command as a user meets it: every flag explained, names in either case, config
files in flag spelling, answers without torch for --version/--help/argument errors, one log summary
of malformed data lines, and no TorchScript noise from an export."""

import argparse
import logging
import resource
import subprocess
import sys
import warnings

import pytest

from recship.cli import _COMMANDS, build_parser, subcommand_parser

CHOICE_FLAGS = {"train": ["--optimizer", "--sharding", "--device"], "export": ["--dtype", "--sharding", "--device"], "serve": ["--device"]}


def _options(command):
    parser = subcommand_parser(build_parser(), command)
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_every_flag_says_what_it_does_and_its_default(command):
    bare = []
    for action in _options(command):
        text = (action.help or "").lower()
        if len(text.split()) < 3 or not ("default" in text or "required" in text):
            bare.append(f"{'/'.join(action.option_strings) or action.dest}: {action.help!r}")
    assert bare == []


@pytest.mark.parametrize("command,flags", list(CHOICE_FLAGS.items()))
def test_closed_sets_are_choices(command, flags):
    actions = {s: a for a in _options(command) for s in a.option_strings}
    assert {f: bool(actions[f].choices) for f in flags} == dict.fromkeys(flags, True)


# -- startup: answers that need no torch -------------------------------------------------------


def _cpu_seconds(argv):
    """The CPU time (user + system) of ``python -m recship *argv`` and its exit code: what its wall time is on a
    quiet machine, without the time it waited for a core on a busy one."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "recship", *argv], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, done.returncode


ARGUMENT_ERRORS = {
    "demo": ["demo", "--seed", "x"],
    "train": ["train", "--steps", "abc"],
    "export": ["export", "/nonexistent/checkpoint", "--out", "x"],
    "inspect": ["inspect"],
    "serve": ["serve", "--port", "x"],
    "predict": ["predict", "--model-name", "m"],
}


@pytest.mark.parametrize("argv,want", [(["--version"], 0)] + [([c, "--help"], 0) for c in _COMMANDS] + [(a, 2) for a in ARGUMENT_ERRORS.values()])
def test_answers_without_loading_torch_in_under_a_second(argv, want):
    seconds, code = _cpu_seconds(argv)
    assert code == want, argv
    assert seconds < 1.0, f"recship {' '.join(argv)} took {seconds:.2f} s of CPU"


@pytest.mark.parametrize("argv", [["--version"]] + [[c, "--help"] for c in _COMMANDS] + list(ARGUMENT_ERRORS.values()))
def test_answers_do_not_import_torch(argv):
    """What the timing above stands for, without the machine's load in it."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['recship', *{argv!r}]\n"
            "try:\n    runpy.run_module('recship', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_grpc_client_imports_without_torch():
    code = "import sys, recship.serving.client, recship.trainer.cli, recship.export.cli; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# -- train: config files, names in either case, one table size ----------------------------------


def _train_config(argv):
    from recship.flags import parse_with_config
    from recship.trainer.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parse_with_config(parser, argv))


def test_train_config_file_takes_flag_spelling_and_names_valid_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("batch-size: 16\nembedding_dim: 8\neval-every: 0\noptimizer: EXACT_SGD\nnum-embeddings-per-feature: 5000\n")
    c = _train_config(["--config", str(f), "--embedding-dim", "4"])
    assert (c.batch_size, c.embedding_dim, c.eval_every, c.optimizer) == (16, 4, 0, "exact_sgd")  # the flag wins
    assert c.num_embeddings_per_feature == [5000] * 26
    f.write_text("batch-size: 16\nbach-size: 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'bach-size'; the keys are these flags: .*batch-size.*num-embeddings-per-feature"):
        _train_config(["--config", str(f)])
    f.write_text("steps: many\n")
    with pytest.raises(ValueError, match="steps takes an integer, got 'many'"):
        _train_config(["--config", str(f)])
    f.write_text("batch-size: 16\nbatch_size: 8\n")
    with pytest.raises(ValueError, match="batch_size: --batch-size given twice"):
        _train_config(["--config", str(f)])
    f.write_text("dense-arch: [8, 4]\nmodel_args: {rows: 10, names: [a]}\nsharding: null\n")  # lists, mappings, null
    c = _train_config(["--config", str(f)])
    assert (c.dense_arch, c.model_args, c.sharding) == ([8, 4], {"rows": 10, "names": ["a"]}, None)
    f.write_text("dense-arch: [8, 1.5]\n")
    with pytest.raises(ValueError, match=r"dense-arch: --dense-arch takes an integer or a list of them, got \[8, 1.5\]"):
        _train_config(["--config", str(f)])


def test_one_table_size_is_every_features():
    from recship.trainer.train import TrainConfig

    from recship.models.dlrm import DLRMConfig

    entry, args = TrainConfig(num_embeddings_per_feature=[5000]).entry_point()
    assert entry == "recship.models.dlrm:builtin"
    tables = DLRMConfig(**args).tables()
    assert [t.num_embeddings for t in tables] == [5000] * 26 and len({t.name for t in tables}) == 26
    assert _train_config(["--num-embeddings-per-feature", "5000"]).num_embeddings_per_feature == [5000] * 26
    assert TrainConfig(num_embeddings_per_feature=[7, 8]).num_embeddings_per_feature == [7, 8]  # several: as given
    with pytest.raises(ValueError, match="positive integers"):
        TrainConfig(num_embeddings_per_feature=[0])


@pytest.mark.parametrize("name", ["EXACT_SGD", "exact_sgd", "Exact_Sgd"])
def test_optimizer_names_in_either_case(name):
    from recship.trainer import EmbOptimType
    from recship.trainer.fused_optim import fused_config
    from recship.trainer.train import TrainConfig

    assert EmbOptimType(name) is EmbOptimType.EXACT_SGD
    assert fused_config({"optimizer": name}).optimizer is EmbOptimType.EXACT_SGD
    assert TrainConfig(optimizer=name).optimizer == "exact_sgd"
    assert _train_config(["--optimizer", name, "--sharding", "ROW_WISE", "--device", "CPU"]).optimizer == "exact_sgd"
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; expected one of exact_sgd"):
        TrainConfig(optimizer="sgd")


def test_unknown_names_are_one_line_and_exit_code_2(capsys):
    from recship.cli import main

    assert main(["train", "--optimizer", "adamw"]) == 2
    assert capsys.readouterr().err == ("recship train: error: unknown optimizer 'adamw'; expected one of exact_sgd, exact_adagrad, "
                                       "exact_rowwise_adagrad, adam, partial_rowwise_adam, lamb (either case)\n")
    assert main(["export", "ckpt", "--out", "x", "--dtype", "INT3"]) == 2
    assert "unknown data type 'INT3'; expected one of int8, int4" in capsys.readouterr().err


# -- logs: malformed lines, epochs ---------------------------------------------------------------


def _criteo_lines(n, bad):
    import random

    rng = random.Random(0)
    lines = []
    for i in range(n):
        if i in bad:
            lines.append("not\ta\tcriteo\tline")
            continue
        dense = [str(rng.randrange(100)) for _ in range(13)]
        sparse = [f"{rng.randrange(1 << 20):x}" for _ in range(26)]
        lines.append("\t".join([str(rng.randrange(2)), *dense, *sparse]))
    return "\n".join(lines) + "\n"


def test_malformed_lines_are_shown_a_few_then_totalled_once_per_pass(tmp_path, caplog):
    from recship.trainer.data import CriteoTSV

    bad = {3, 10, 11, 12, 20, 21, 22, 30}  # 0-based: lines 4, 11, ... of the file
    path = tmp_path / "d.tsv"
    path.write_text(_criteo_lines(40, bad))
    reader = CriteoTSV(path, [100] * 26, batch_size=8)
    with caplog.at_level(logging.WARNING, logger="recship.trainer.data"):
        examples = sum(len(b) for b in reader)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        sum(len(b) for b in reader)  # a second pass (an epoch): the total only
        second = [r.getMessage() for r in caplog.records]
    assert examples == 40 - len(bad)
    shown = [m for m in first if "skipping malformed line" in m]
    assert [m.split(": skipping")[0] for m in shown] == [f"{path}:{i + 1}" for i in sorted(bad)[: CriteoTSV.SHOWN_MALFORMED]]
    totals = [m for m in first if "skipped" in m]
    assert totals == [f"{path}: skipped {len(bad)} malformed line(s) of the 40 read in pass 1 over the file"]
    assert second == [f"{path}: skipped {len(bad)} malformed line(s) of the 40 read in pass 2 over the file"]


def test_a_repeated_data_file_counts_epochs(tmp_path, caplog):
    from recship.trainer.train import TrainConfig, launch

    path = tmp_path / "d.tsv"
    path.write_text(_criteo_lines(40, bad={5}))  # 39 examples: 3 batches of 16 (the last one 7) per epoch
    config = TrainConfig(out=str(tmp_path / "run"), steps=7, batch_size=16, num_embeddings_per_feature=[20], embedding_dim=4,
                         dense_arch=[8], over_arch=[8], data=str(path), eval_every=0, eval_batches=1, checkpoint_every=0,
                         progress=False, optimizer="EXACT_SGD")
    with caplog.at_level(logging.INFO, logger="recship"):
        summary = launch(config)
    assert summary["epochs"] == 3
    epochs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert epochs == [f"epoch 2 of {path} begins at step 4", f"epoch 3 of {path} begins at step 7"]
    assert sum("skipped 1 malformed line(s)" in r.getMessage() for r in caplog.records) >= 2  # once per pass, not per line


# -- export: no TorchScript noise ----------------------------------------------------------------


def test_an_export_shows_no_instance_annotation_warning(tmp_path):
    import torch

    from recship.export import ExportConfig, export_model
    from recship.export.model import ExportedModule, PooledEmbeddings
    from recship.fx import symbolic_trace
    from recship.quantize.flat import flatten_collections
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)]
    ebc = EmbeddingBagCollection(tables)
    message = "instance-level annotations on empty non-base types"
    with warnings.catch_warnings(record=True) as raw:  # what torch says without the filter: the test's premise
        warnings.simplefilter("always")
        from recship.quantize import QuantConfig, quantize_embedding_bag_collection

        qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
        torch.jit.script(symbolic_trace(ExportedModule(flatten_collections(PooledEmbeddings(qebc)), ["f0", "f1"], False)))
    if not any(message in str(w.message) for w in raw):
        pytest.skip("this torch no longer warns about instance-level annotations")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_model(ebc, ExportConfig(out=str(tmp_path / "a"), progress=False, validation_batch_size=8, validation_batches=1, format="torchscript"))
    assert [str(w.message) for w in seen if message in str(w.message)] == []
