"""The other data sources and OpenCLIP's data options: csv/tsv tables, synthetic batches, image/caption keys, the
decompression-bomb guard, parquet metadata counted and pre-filtered by a filter expression."""

import collections
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from clip_jax import data
from clip_jax.data import check, filters, make_shards, parquet_filter, synthetic, webdataset
from clip_jax.run_config import default_config
from clip_jax.text.clip_tokenizer import tokenize

MEAN_STD = dict(mean=(0.5,) * 3, std=(0.5,) * 3)


def _color(index):
    return (index % 20) * 12, (index // 20) * 12, 200


def _index_of(image):
    r, g, _ = ((image.mean(axis=(0, 1)) * 0.5 + 0.5) * 255).tolist()
    return int(round(r / 12)) + 20 * int(round(g / 12))


def _iterator(source, dataset_type, global_batch_size=4, **cfg):
    config = data.TrainDataConfig(shards=source, dataset_type=dataset_type, **cfg)
    return data.build_train_iterator(config, global_batch_size=global_batch_size, image_size=8, **MEAN_STD)


# -- csv ---------------------------------------------------------------------------------------------------------


def _write_csv(folder, rows=24, separator="\t", broken=()):
    """A table of PNG paths (relative, in a sub folder) and captions; rows in ``broken`` are missing or corrupt."""
    (folder / "images").mkdir()
    lines = [separator.join(["filepath", "title", "extra"])]
    for i in range(rows):
        name = f"images/{i}.png"
        if broken and i == broken[0]:
            name = "images/missing.png"
        elif i in broken:
            (folder / name).write_bytes(b"\x89PNG not really")
        else:
            Image.new("RGB", (10, 12), _color(i)).save(folder / name)
        lines.append(separator.join([name, f"row {i}", "x"]))
    path = folder / "train.tsv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _rows_of(batch):
    rows = [_index_of(image) for image in batch["images"]]
    np.testing.assert_array_equal(batch["tokens"], tokenize([f"row {i}" for i in rows]))
    return rows


def test_csv_rows_come_once_per_epoch_paired_with_their_captions(tmp_path):
    path = _write_csv(tmp_path, rows=24)
    it = _iterator(path, "csv", seed=1)
    first = [r for _ in range(6) for r in _rows_of(next(it))]
    second = [r for _ in range(6) for r in _rows_of(next(it))]
    assert sorted(first) == list(range(24)) and sorted(second) == list(range(24)) and first != second


def test_csv_bad_rows_are_counted_not_fatal(tmp_path):
    path = _write_csv(tmp_path, rows=13, broken=(3, 7))  # row 3: no file; row 7: not an image
    it = _iterator(path, "csv", global_batch_size=11)
    assert sorted(_rows_of(next(it))) == [i for i in range(13) if i not in (3, 7)]
    assert it.skipped_samples() == {"missing_image": 1, "corrupt_image": 1}


def test_csv_missing_column_names_it_and_the_columns_present(tmp_path):
    path = _write_csv(tmp_path, rows=3)
    with pytest.raises(ValueError, match=r"no column 'caption' \(columns: \['filepath', 'title', 'extra'\]\)"):
        data.resolve_train_shards(data.TrainDataConfig(shards=path, dataset_type="csv", csv_caption_key="caption"))
    comma = tmp_path / "c.csv"
    comma.write_text("filepath,title\nimages/0.png,row 0\n")
    with pytest.raises(ValueError, match="no column 'filepath', 'title'.*csv_separator"):
        data.resolve_train_shards(data.TrainDataConfig(shards=str(comma), dataset_type="csv"))
    config = data.TrainDataConfig(shards=str(comma), dataset_type="csv", csv_separator=",")
    assert len(data.resolve_train_shards(config)) == 1
    assert data.steps_per_epoch(config, 1) == 1


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_csv_resumes_exactly(tmp_path, workers):
    path = _write_csv(tmp_path, rows=18, broken=(5,))
    it = _iterator(path, "csv", workers=workers, seed=4)
    [next(it) for _ in range(3)]
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    skipped = it.skipped_samples()
    it.close()
    resumed = _iterator(path, "csv", workers=workers, seed=4)
    resumed.set_state(state)
    for batch, want in zip([next(resumed) for _ in range(4)], expected, strict=True):
        np.testing.assert_array_equal(batch["images"], want["images"])
        np.testing.assert_array_equal(batch["tokens"], want["tokens"])
    assert resumed.skipped_samples() == skipped and skipped["missing_image"] >= 1
    resumed.close()


def test_csv_runs_take_the_size_and_caption_filters_but_no_expression(tmp_path):
    path = _write_csv(tmp_path, rows=8)
    it = _iterator(path, "csv", global_batch_size=8, sample_filter=filters.SampleFilter(min_image_size=11))
    with pytest.raises(RuntimeError, match="no usable row"):  # every image is 10 x 12
        next(it)
    with pytest.raises(ValueError, match="only webdataset shards have"):
        data.TrainDataConfig(shards=path, dataset_type="csv", sample_filter=filters.SampleFilter("a < 1"))


# -- synthetic ---------------------------------------------------------------------------------------------------


def test_synthetic_batches_look_like_real_ones_and_resume_exactly():
    it = _iterator("", "synthetic", global_batch_size=6, seed=3, train_num_samples=60)
    batches = [next(it) for _ in range(3)]
    assert batches[0]["images"].shape == (6, 8, 8, 3) and batches[0]["images"].dtype == np.float32
    assert -1 <= batches[0]["images"].min() and batches[0]["images"].max() < 1
    tokens = batches[0]["tokens"]
    assert tokens.dtype == np.int32 and (tokens[:, 0] == synthetic.SOT).all()
    eot = np.argmax(tokens == synthetic.EOT, axis=1)
    for row, end in zip(tokens, eot):  # SOT, ids below SOT, EOT, zeros: the tokenizer's layout
        assert end >= 2 and (row[1:end] > 0).all() and (row[1:end] < synthetic.SOT).all() and not row[end + 1:].any()
    assert batches[1]["images"] is batches[0]["images"]  # drawn once: the loader costs nothing
    assert not np.array_equal(batches[0]["tokens"], batches[1]["tokens"])
    again = _iterator("", "synthetic", global_batch_size=6, seed=3)
    again.set_state(json.loads(json.dumps(it.get_state())))
    resumed, expected = next(again), next(it)
    np.testing.assert_array_equal(resumed["images"], expected["images"])
    np.testing.assert_array_equal(resumed["tokens"], expected["tokens"])
    assert not np.array_equal(resumed["tokens"], batches[0]["tokens"])
    other_seed = _iterator("", "synthetic", global_batch_size=6, seed=4)
    assert not np.array_equal(next(other_seed)["images"], batches[0]["images"])


def test_synthetic_from_the_run_config_needs_an_epoch_size():
    c = default_config()
    c.dataset_type = "synthetic"
    c.train_num_samples = 100
    cfg = data.TrainDataConfig.from_run_config(c)
    assert data.resolve_train_shards(cfg) is None
    assert data.steps_per_epoch(cfg, 10) == 12  # ceil(100 / 10) rounded up to a multiple of 4 workers
    with pytest.raises(ValueError, match="synthetic run needs train_num_samples"):
        data.steps_per_epoch(data.TrainDataConfig(shards="", dataset_type="synthetic"), 10)


@pytest.mark.slow
def test_a_synthetic_run_trains_without_shards(tmp_path, trainer_model_file):
    from trainer_run import losses, tiny_config

    from clip_jax.training import trainer as train_lib

    config = tiny_config(("", trainer_model_file), tmp_path, dataset_type="synthetic", train_num_samples=128,
                         warmup=1, save_every_steps=0)
    train_lib.train(config)
    assert sorted(losses(tmp_path / "run")) == [1, 2]


# -- image / caption keys, max pixels ----------------------------------------------------------------------------


def _image(size, color, fmt="PNG"):
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return buffer.getvalue()


def test_image_keys_choose_in_order_and_the_caption_can_come_from_the_json(tmp_path):
    group_files = {"jpg": _image((8, 8), (255, 0, 0), "JPEG"), "webp": _image((8, 8), (0, 255, 0), "WEBP"),
                   "txt": b"from txt", "json": json.dumps({"caption": "from json", "n": 3}).encode()}
    path = str(tmp_path / "00000.tar")
    with wds.TarWriter(path, encoder=False) as sink:
        sink.write({"__key__": "000000000", **group_files})
        sink.write({"__key__": "000000001", "jpg": group_files["jpg"], "json": b'{"caption": null}'})
        sink.write({"__key__": "000000002", "jpg": group_files["jpg"], "json": b'{"caption": 5}'})
    fmt = webdataset.SampleFormat.parse("webp;jpg", "json:caption")
    skipped = collections.Counter()
    samples = list(webdataset.iter_shard(path, skipped, fmt))
    assert [s.caption for s in samples] == ["from json"] and samples[0].image == group_files["webp"]
    assert skipped == {"no_caption": 1, "bad_caption": 1}
    default = list(webdataset.iter_shard(path))
    assert default[0].caption == "from txt" and default[0].image == group_files["jpg"]
    config = default_config()
    config.train_data_image_key, config.train_data_caption_key = "webp;jpg", "json:caption"
    assert data.TrainDataConfig.from_run_config(config).sample_format == fmt


def test_images_over_max_pixels_are_counted_before_decoding(tmp_path):
    path = str(tmp_path / "00000.tar")
    with wds.TarWriter(path, encoder=False) as sink:
        for i, size in enumerate([(8, 8), (40, 40), (8, 9), (30, 2), (4, 4)]):  # 64, 1600, 72, 60, 16 pixels
            sink.write({"__key__": f"{i:09d}", "png": _image(size, (9, 9, 9)), "txt": b"c"})
    it = _iterator(path, "webdataset", global_batch_size=3, shuffle_window=1, resampled=False, max_image_pixels=64)
    assert next(it)["images"].shape[0] == 3
    assert it.skipped_samples() == {"too_many_pixels": 2}


# -- parquet -----------------------------------------------------------------------------------------------------


def _write_parquet(path, rows):
    table = pa.table({"URL": [f"http://x/{i}" for i in range(rows)],
                      "punsafe": [None if i % 7 == 0 else (i % 10) / 10 for i in range(rows)],
                      "pwatermark": [(i * 3 % 10) / 10 for i in range(rows)],
                      "WIDTH": [64 + 8 * (i % 5) for i in range(rows)]})
    pq.write_table(table, path, row_group_size=17)
    return table.to_pylist()


def _plain(rows):
    """Reason per row for "punsafe < 0.5 and pwatermark < 0.8 and WIDTH >= 80", in plain Python."""
    out = []
    for r in rows:
        if r["punsafe"] is None:
            out.append("filter: punsafe < 0.5 (null punsafe)")
        elif not r["punsafe"] < 0.5:
            out.append("filter: punsafe < 0.5")
        elif not r["pwatermark"] < 0.8:
            out.append("filter: pwatermark < 0.8")
        elif not r["WIDTH"] >= 80:
            out.append("filter: WIDTH >= 80")
        else:
            out.append(None)
    return out


PARQUET_FILTER = "punsafe < 0.5 and pwatermark < 0.8 and WIDTH >= 80"


def test_parquet_counts_equal_an_independent_count(tmp_path, capsys):
    rows = _write_parquet(tmp_path / "a.parquet", 60) + _write_parquet(tmp_path / "b.parquet", 31)
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    report = parquet_filter.count(files, filters.SampleFilter(PARQUET_FILTER))
    reasons = _plain(rows)
    assert report.rows == 91 and report.kept == reasons.count(None)
    assert report.dropped == collections.Counter(r for r in reasons if r)
    out = tmp_path / "r.json"
    assert check.main(["--parquet", *files, "--filter", PARQUET_FILTER, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["dropped"] == dict(report.dropped)
    assert "WIDTH >= 80" in capsys.readouterr().out
    missing = parquet_filter.count(files[:1], filters.SampleFilter("NSFW != 'NSFW'"))
    assert missing.dropped == {"filter: NSFW != 'NSFW' (missing NSFW)": 60}


def test_make_shards_pre_filters_parquet(tmp_path):
    rows = _write_parquet(tmp_path / "a.parquet", 50)
    out = tmp_path / "kept.parquet"
    assert make_shards.main(["filter-parquet", str(tmp_path / "a.parquet"), "--filter", PARQUET_FILTER,
                             "--out", str(out)]) == 0
    kept = pq.read_table(out).to_pylist()
    assert kept == [r for r, reason in zip(rows, _plain(rows)) if reason is None] and kept
    assert make_shards.main(["filter-parquet", str(tmp_path / "a.parquet"), "--filter", "a <", "--out",
                             str(out)]) == 1


def test_data_fields_a_synthetic_or_csv_run_would_not_use_are_named():
    from clip_jax.training.config_checks import check_config

    c = default_config()
    c.dataset_type, c.train_num_samples = "synthetic", 100
    c.max_image_pixels, c.make_train_data = 10**8, "fashion-mnist"
    with pytest.raises(ValueError) as info:
        check_config(c, num_devices=8)
    assert "max_image_pixels=100000000 has no effect with dataset_type='synthetic'" in str(info.value)
    assert "make_train_data='fashion-mnist' has no effect with dataset_type='synthetic'" in str(info.value)
    c = default_config()
    c.dataset_type, c.train_data, c.max_image_pixels = "csv", "/data/train.csv", 10**8  # csv decodes: pixels apply
    c.train_data_caption_key = "json:caption"
    with pytest.raises(ValueError) as info:
        check_config(c, num_devices=8)
    assert "train_data_caption_key='json:caption' has no effect with dataset_type='csv'" in str(info.value)
    assert "max_image_pixels" not in str(info.value)
