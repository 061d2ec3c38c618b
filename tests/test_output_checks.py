"""Every command that writes an output checks it before the work: a folder that cannot be written, a file path that is
a folder, a bucket that is not there, or a URL given to a command that writes local files only is one line naming
the path, exit status 2, and nothing of the work done (the model not loaded, no dataset evaluated)."""

import json
import os
import re

import jax
import pytest
from test_clip_benchmark import classification_samples, write_dataset

import clip_jax
from clip_jax.evaluation import benchmark_cli, embed, zeroshot
from clip_jax.interop import export as export_lib
from clip_jax.interop.export import export_open_clip
from clip_jax.ops import report

TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """What the commands read: a tiny export, a folder of captioned images, a CLIP_benchmark dataset, a run's
    metrics."""
    from PIL import Image

    root = tmp_path_factory.mktemp("inputs")
    model = clip_jax.create_model(TINY)
    export_open_clip(clip_jax.init_params(model, jax.random.key(0)), model.config, str(root / "exported"),
                     mean=(0.5,) * 3, std=(0.5,) * 3)
    (root / "photos").mkdir()
    Image.new("RGB", (12, 10), "red").save(root / "photos" / "0.jpg")
    (root / "photos" / "0.txt").write_text("a red square")
    write_dataset(root / "datasets" / "shapes", classification_samples(4),
                  class_names=["red", "green", "blue"], templates=["a {c} square."])
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    return root


def the_work_must_not_start(monkeypatch):
    """Loading the model, evaluating, drawing: each fails the test when it is reached."""
    def began(*args, **kwargs):
        raise AssertionError("the work began before the output was checked")

    monkeypatch.setattr(embed, "load_model", began)
    monkeypatch.setattr(zeroshot, "run", began)
    monkeypatch.setattr(benchmark_cli, "load_model", began)
    monkeypatch.setattr(report, "write_png", began)
    monkeypatch.setattr(export_lib, "export_open_clip", began)


def command(name: str, inputs, output: str) -> int:
    """Runs command `name` (in this process) with its output at `output`; returns its exit status."""
    if name == "export":
        return export_lib.main([str(inputs / "exported"), output])
    if name == "embed":
        return embed.main(["--input_dataset", str(inputs / "photos"), "--output_folder", output,
                           "--clip_model", str(inputs / "exported")])
    if name == "zeroshot":
        return zeroshot.main(["--checkpoint", str(inputs / "exported"), "--demo", "--output", output])
    if name == "benchmark eval":
        return benchmark_cli.main(["eval", "--dataset", "wds/shapes", "--dataset_root", str(inputs / "datasets"),
                                   "--pretrained", str(inputs / "exported"), "--output", output])
    if name == "benchmark build":
        return benchmark_cli.main(["build", str(inputs / "no-record.json"), "--output", output])
    assert name == "report"
    return report.main([str(inputs / "run"), "--output", output])


# (command, the output's name under the folder it is written in, what the error calls it, the flag to change)
OUTPUTS = [("export", "exported", "the export", "give OUT_DIR a folder you can write to"),
           ("embed", "embeddings", "the embeddings", "give --output_folder a folder you can write to"),
           ("zeroshot", "metrics.json", "the metrics", "give --output a path you can write to"),
           ("benchmark eval", "result.json", "the result", "give --output a path you can write to"),
           ("benchmark build", "benchmark.csv", "the result", "give --output a path you can write to"),
           ("report", "report.png", "the report", "give --output a path you can write to")]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.mark.parametrize("name, output, what, change", OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_an_output_that_cannot_be_written_is_one_line_naming_it_before_the_work(
        name, output, what, change, inputs, unwritable_folder, monkeypatch, capsys):
    the_work_must_not_start(monkeypatch)
    path = os.path.join(unwritable_folder, "out", output)
    assert command(name, inputs, path) == 2
    error = one_error_line(capsys)
    assert error.startswith(f"error: cannot write {what} {path}: {unwritable_folder} is not writable (")
    assert error.endswith(f"; {change}")


FILES = [o for o in OUTPUTS if o[0] in ("zeroshot", "benchmark eval", "report")]


@pytest.mark.parametrize("name, output, what, change", FILES, ids=[o[0] for o in FILES])
def test_an_output_file_that_is_a_folder_is_named(name, output, what, change, inputs, tmp_path, monkeypatch, capsys):
    the_work_must_not_start(monkeypatch)
    assert command(name, inputs, str(tmp_path)) == 2
    assert one_error_line(capsys) == f"error: cannot write {what} {tmp_path}: {tmp_path} is a folder; {change}"


@pytest.mark.parametrize("name, output, what, change", [o for o in OUTPUTS if o[0] not in ("embed", "report")],
                         ids=[o[0] for o in OUTPUTS if o[0] not in ("embed", "report")])
def test_a_bucket_given_to_a_command_that_writes_local_files_is_refused_in_one_line(
        name, output, what, change, inputs, monkeypatch, capsys):
    the_work_must_not_start(monkeypatch)
    assert command(name, inputs, f"s3://bucket/out/{output}") == 2
    assert one_error_line(capsys) == (f"error: cannot write {what} to s3://bucket/out/{output}: it is written to a "
                                      f"local path only (copy it to the bucket afterwards); {change}")


def test_a_bucket_that_does_not_exist_is_one_line_before_the_work_and_one_that_does_passes(inputs, monkeypatch,
                                                                                          capsys):
    import local_s3

    the_work_must_not_start(monkeypatch)
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, "outputs"):
        for name in ("embed", "report"):
            assert command(name, inputs, "s3://no-such-bucket/out/x") == 2
            assert one_error_line(capsys).startswith("error: bucket s3://no-such-bucket (of s3://no-such-bucket/out")
            with pytest.raises(AssertionError, match="the work began"):
                command(name, inputs, "s3://outputs/out/x")


def test_benchmark_eval_writes_its_record_under_clip_benchmarks_name_and_nothing_beside_it(inputs, tmp_path,
                                                                                          monkeypatch, capsys):
    """Without --output the record lands in the working folder under CLIP_benchmark's default name, alone: no
    manifest beside it. Run again, the same result replaces it; another file of that name is refused, untouched."""
    write_dataset(tmp_path / "datasets" / "shapes", classification_samples(4),
                  class_names=["red", "green", "blue", "grey"], templates=["a {c} square."])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = ["eval", "--dataset", "wds/shapes", "--dataset_root", str(tmp_path / "datasets"),
            "--pretrained", str(inputs / "exported"), "--batch_size", "4"]
    assert benchmark_cli.main(argv) == 0
    (name,) = os.listdir(work)
    assert re.fullmatch(r"shapes_exported_.+_en_zeroshot_classification\.json", name), name
    assert json.loads((work / name).read_text())["dataset"] == "wds/shapes"
    assert benchmark_cli.main(argv) == 0
    assert os.listdir(work) == [name]
    (work / name).write_text('{"dataset": "wds/shapes", "model": "another"}\n')
    assert benchmark_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the result would replace {name}, which") and err.count("\n") == 1, err
    assert (work / name).read_text() == '{"dataset": "wds/shapes", "model": "another"}\n'
