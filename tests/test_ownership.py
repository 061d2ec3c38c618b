"""Nothing clip_jax did not write is replaced or deleted: each writer, pointed at a folder that holds someone else's
files, refuses in one line naming them and the setting to change, or writes beside them; either way every byte and
modification time of those files is as before."""

import hashlib
import io
import json
import os
import tarfile

import jax
import numpy as np
import pytest
from PIL import Image
from trainer_run import tiny_config

from clip_jax.data import check, make_shards, write_once
from clip_jax.evaluation import benchmark, zeroshot
from clip_jax.interop import weight_files
from clip_jax.interop.export import export_open_clip
from clip_jax.models import create_model, init_params
from clip_jax.ops import report
from clip_jax.runtime import ownership, run_layout
from clip_jax.training.trainer import Trainer

SHARDS = "{00000..00005}.tar"


def snapshot(folder) -> dict[str, tuple[str, int, int]]:
    """Every file under `folder`: (sha256, size, modification time in ns)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            status = os.stat(path)
            out[os.path.relpath(path, folder)] = (digest, status.st_size, status.st_mtime_ns)
    return out


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def plain_tar_shards(folder, count=6):
    """Shards another tool made with Python's tarfile: jpg + txt per sample, no *_stats.json."""
    os.makedirs(folder)
    for shard in range(count):
        with tarfile.open(os.path.join(folder, f"{shard:05d}.tar"), "w") as tar:
            for row in range(3):
                for ext, data in (("jpg", _jpeg(shard * 10 + row)), ("txt", f"photo {shard} {row}".encode())):
                    info = tarfile.TarInfo(f"{shard:05d}{row:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def webdataset_shards(folder, count=6):
    """Shards written by webdataset's own ShardWriter."""
    import webdataset as wds

    os.makedirs(folder)
    with wds.ShardWriter(os.path.join(folder, "%05d.tar"), maxcount=2, verbose=0) as sink:
        for row in range(2 * count):
            sink.write({"__key__": f"sample{row:06d}", "jpg": _jpeg(row), "txt": f"a photo number {row}"})


def other_files(folder, count=None):
    """A folder of the user's own: photos and notes, no shards."""
    os.makedirs(os.path.join(folder, "holiday"))
    for i in range(3):
        with open(os.path.join(folder, "holiday", f"img{i}.jpg"), "wb") as f:
            f.write(_jpeg(i))
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("mine\n")


@pytest.mark.parametrize("layout, count", [(plain_tar_shards, 6), (plain_tar_shards, 5), (webdataset_shards, 6),
                                           (other_files, None)])
def test_the_demo_shard_writer_refuses_a_folder_of_someone_elses_files(tmp_path, trainer_model_file, layout, count):
    """The demo config pointed at the user's own folder (make_train_data left on): refused before anything is
    written or built; with five shards too, where Fashion-MNIST would not even fit."""
    folder = tmp_path / "my-shards"
    layout(folder, count) if count else layout(folder)
    before = snapshot(folder)
    pattern = str(folder / ("{00000..00004}.tar" if count == 5 else SHARDS))
    config = tiny_config((pattern, trainer_model_file), tmp_path / "logs", make_train_data="fashion-mnist")
    with pytest.raises(ownership.ForeignFiles) as refused:
        Trainer(config)
    message = str(refused.value)
    assert "\n" not in message and "make_train_data" in message and str(folder) in message
    assert sorted(os.listdir(folder))[0] in message  # names the files
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == sorted(before_names(before))
    assert not (tmp_path / "logs").exists()


def before_names(snap) -> set[str]:
    return {path.split(os.sep)[0] for path in snap}


def test_someone_elses_complete_shards_are_read_as_they_are(tmp_path):
    """Shards with img2dataset's *_stats.json (whoever wrote them) are the data: nothing is written."""
    folder = tmp_path / "laion"
    make_shards.write_shards(make_shards.fashion_mnist_samples("test", limit=60), str(folder), 10)
    os.remove(folder / ownership.MANIFEST)  # as if another tool had written them
    before = snapshot(folder)
    make_shards.write_missing_shards(str(folder / SHARDS), "fashion-mnist")
    assert snapshot(folder) == before


def test_the_shard_command_refuses_someone_elses_shards_and_writes_beside_other_files(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    plain_tar_shards(theirs, 2)
    before = snapshot(theirs)
    args = ["fashion-mnist", "--split", "test", "--limit", "20", "--samples-per-shard", "10"]
    assert make_shards.main([*args, "--out", str(theirs)]) == 1
    error = capsys.readouterr().err.strip()
    assert "00000.tar, 00001.tar" in error and "--out" in error and "\n" not in error
    assert snapshot(theirs) == before
    mixed = tmp_path / "mixed"
    other_files(mixed)
    before = snapshot(mixed)
    assert make_shards.main([*args, "--out", str(mixed)]) == 0
    assert {k: v for k, v in snapshot(mixed).items() if k in before} == before
    assert (mixed / "00001.tar").exists()
    assert make_shards.main([*args, "--out", str(mixed)]) == 0  # its own shards it may write again


def test_a_run_directory_of_someone_elses_is_refused_and_an_older_clip_jax_run_is_not(tmp_path, trainer_model_file):
    logs = tmp_path / "logs"
    (logs / "run" / "checkpoints").mkdir(parents=True)
    (logs / "run" / "checkpoints" / "model.pt").write_bytes(b"not ours")
    (logs / "run" / "config.json").write_text('{"lr": 0.1}')
    before = snapshot(logs)
    config = tiny_config(("unused-*.tar", trainer_model_file), logs)
    with pytest.raises(ownership.ForeignFiles, match=r"the run 'run' would write into .*checkpoints, config.json.*"
                                                     r"--config.name"):
        Trainer(config)
    assert snapshot(logs) == before
    # a run clip_jax wrote before it kept a manifest: its config.json is a clip_jax run config
    (logs / "run" / "config.json").write_text(config.to_json())
    assert ownership.foreign_names(str(logs / "run"), run_layout.RUN_ENTRIES) == []


def test_an_export_writes_beside_other_files_and_replaces_only_its_own(tmp_path, tiny_model_config):
    model = create_model(tiny_model_config)
    params = jax.tree.map(np.asarray, init_params(model, jax.random.key(0)))
    out = tmp_path / "export"
    out.mkdir()
    (out / "README.md").write_text("my model card\n")
    before = snapshot(out)
    export = lambda: export_open_clip(params, model.config, str(out), mean=(0.5,) * 3, std=(0.5,) * 3)  # noqa: E731
    export()
    export()  # an earlier export of clip_jax's is replaced
    assert {k: v for k, v in snapshot(out).items() if k in before} == before
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "open_clip_config.json").write_text("{}")
    before = snapshot(theirs)
    with pytest.raises(ownership.ForeignFiles, match="open_clip_config.json.*OUT_DIR"):
        export_open_clip(params, model.config, str(theirs), mean=(0.5,) * 3, std=(0.5,) * 3)
    assert snapshot(theirs) == before


def test_single_file_outputs_refuse_a_file_of_someone_elses(tmp_path, capsys):
    """convert, report, zeroshot, data.check, filter-parquet and the benchmark's records: each refuses before it
    does its work, with exit status 2 (1 for the data tools) or ForeignFiles."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clip_jax.data import filters, parquet_filter

    mine = tmp_path / "mine"
    mine.mkdir()
    record = {"dataset": "cifar10", "model": "m", "pretrained": "p", "task": "t", "language": "en", "metrics": {}}
    names = ["model.safetensors", "plot.png", "zeroshot.json", "counts.json", benchmark.result_filename(record)]
    for name in names:
        (mine / name).write_bytes(b"the user's own file")
    pq.write_table(pa.table({"punsafe": [0.1, 0.9]}), mine / "meta.parquet")
    before = snapshot(mine)
    src = tmp_path / "params.npz"
    weight_files.save_params(str(src), {"a": {"b": np.zeros(2)}})
    weight_files.save_params(str(src), {"a": {"b": np.ones(2)}})  # its own file it may write again
    with pytest.raises(ownership.ForeignFiles, match="model.safetensors.*output path"):
        weight_files.write_open_clip(str(mine / "model.safetensors"), {"w": np.zeros(2)})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2)))
    assert report.main([str(run), "--output", str(mine / "plot.png")]) == 2
    assert zeroshot.main(["--model", "ViT-B-32", "--demo", "--output", str(mine / "zeroshot.json")]) == 2
    assert check.main([str(tmp_path / "none-{0..1}.tar"), "--json", str(mine / "counts.json")]) == 1
    with pytest.raises(ownership.ForeignFiles, match="meta.parquet"):  # the output may not be the input
        parquet_filter.write_filtered([str(mine / "meta.parquet")], filters.SampleFilter("punsafe < 0.5"),
                                      str(mine / "meta.parquet"))
    with pytest.raises(ownership.ForeignFiles):
        benchmark.write_record(record, str(mine))
    errors = capsys.readouterr().err
    assert errors.count("clip_jax did not write") == 3, errors
    assert snapshot(mine) == before


def test_a_clean_up_deletes_only_what_clip_jax_wrote(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "theirs.txt").write_text("x")
    ownership.record(str(folder), ["ours"])
    (folder / "ours").mkdir()
    (folder / "ours" / "inside.bin").write_bytes(b"1")
    with pytest.raises(ownership.ForeignFiles, match="theirs.txt"):
        ownership.remove(str(folder), "theirs.txt")
    ownership.remove(str(folder), "ours")
    assert sorted(os.listdir(folder)) == [ownership.MANIFEST, "theirs.txt"]


def test_a_killed_writers_unfinished_set_is_removed_by_the_next_writer(tmp_path):
    folder = tmp_path / "shards"
    leftover = folder / (write_once.STAGING_PREFIX + "abc")
    leftover.mkdir(parents=True)
    (leftover / "00000.tar").write_bytes(b"half")
    written = write_once.write_once(str(folder), is_complete=lambda: (folder / "done_stats.json").exists(),
                                    write=lambda staging: open(os.path.join(staging, "done_stats.json"), "w").close(),
                                    marker_suffix="_stats.json")
    assert written and sorted(os.listdir(folder)) == sorted([ownership.MANIFEST, write_once.LOCK_FILE,
                                                              "done_stats.json"])
