"""Sample filters on img2dataset-like .json metadata: the expression language, counts per rule against a count
written here in plain Python, exact resumption of a filtered stream, the check tool, config validation."""

import collections
import io
import json
import logging
import random
import re

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from clip_jax import data
from clip_jax.data import check, filter_expression, filters, shards, webdataset
from clip_jax.ops.writers import progress_line
from clip_jax.run_config import default_config
from clip_jax.training.config_checks import check_config

EXPRESSION = "punsafe < 0.5 and NSFW != 'NSFW' and similarity >= 0.28"


# -- the language ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression,python", [
    ("a < 1", lambda r: r["a"] < 1),
    ("a <= 1", lambda r: r["a"] <= 1),
    ("a > -2.5", lambda r: r["a"] > -2.5),
    ("a >= 1e-1", lambda r: r["a"] >= 0.1),
    ("a == 3", lambda r: r["a"] == 3),
    ("a != 3", lambda r: r["a"] != 3),
    ("s == 'x y'", lambda r: r["s"] == "x y"),
    ('s != "it\'s"', lambda r: r["s"] != "it's"),
    ("s < 'm'", lambda r: r["s"] < "m"),
    ("not a < 1", lambda r: not r["a"] < 1),
    ("a < 1 or b > 2 and s == 'x'", lambda r: r["a"] < 1 or (r["b"] > 2 and r["s"] == "x")),
    ("(a < 1 or b > 2) and s == 'x'", lambda r: (r["a"] < 1 or r["b"] > 2) and r["s"] == "x"),
    ("not (a < 1 and not b > 2)", lambda r: not (r["a"] < 1 and not r["b"] > 2)),
    ("flag == true", lambda r: r["flag"] is True),
    ("1 < a", lambda r: 1 < r["a"]),
    ("a < b", lambda r: r["a"] < r["b"]),
])
def test_expressions_agree_with_python_on_many_records(expression, python):
    rng = random.Random(0)
    sample_filter = filters.SampleFilter(expression)
    for _ in range(200):
        record = {"a": rng.choice([-3, 0, 0.5, 1, 2, 3, 7.25]), "b": rng.choice([0, 2, 2.5, 9]),
                  "s": rng.choice(["x", "x y", "it's", "zeta", "a"]), "flag": rng.choice([True, False])}
        kept = sample_filter.check_record(record) is None
        assert kept == python(record), record


def test_top_level_and_terms_are_the_rules_with_their_source_text():
    rules = filters.parse_rules("punsafe<0.5 and (a > 1 or b < 2)  and not  NSFW == 'NSFW'")
    assert [r.text for r in rules] == ["punsafe<0.5", "(a > 1 or b < 2)", "not  NSFW == 'NSFW'"]
    assert [r.text for r in filters.parse_rules("a < 1 or b < 2 and c < 3")] == ["a < 1 or b < 2 and c < 3"]
    assert filters.parse_rules("  ") == ()


@pytest.mark.parametrize("expression,column,what", [
    ("punsafe <", 10, "expected a field name"),
    ("punsafe < 0.5 and", 18, "expected a field name"),
    ("(punsafe < 0.5", 15, "expected ')'"),
    ("punsafe < 0.5 similarity > 1", 15, "expected 'and', 'or' or the end"),
    ("punsafe ~ 0.5", 9, "unexpected character '~'"),
    ("punsafe and x < 1", 9, "expected a comparison"),
    ("NSFW == 'NSFW", 9, "unexpected character"),
    ("__import__('os') == 1", 11, "expected a comparison"),
])
def test_a_bad_expression_names_the_column(expression, column, what):
    with pytest.raises(filter_expression.FilterSyntaxError, match=re.escape(f"at column {column}: {what}")):
        filters.SampleFilter(expression)


def test_missing_null_and_wrong_type_fields_are_their_own_reasons():
    f = filters.SampleFilter("punsafe < 0.5 and NSFW != 'NSFW'")
    assert f.check_record({"punsafe": 0.1, "NSFW": "UNLIKELY"}) is None
    assert f.check_record({"punsafe": 0.9, "NSFW": "UNLIKELY"}) == "filter: punsafe < 0.5"
    assert f.check_record({"NSFW": "UNLIKELY"}) == "filter: punsafe < 0.5 (missing punsafe)"
    assert f.check_record({"punsafe": None}) == "filter: punsafe < 0.5 (null punsafe)"
    assert f.check_record({"punsafe": "0.1"}) == "filter: punsafe < 0.5 (type punsafe)"
    assert f.check_record({"punsafe": 0.1, "NSFW": 1}) == "filter: NSFW != 'NSFW' (type NSFW)"
    assert f.check_record({"punsafe": True}) == "filter: punsafe < 0.5 (type punsafe)"  # a bool is no number
    assert f.check(None, b"", "c") == filters.NO_JSON
    assert f.check(b"[1]", b"", "c") == filters.BAD_JSON
    assert f.check(b"{not json", b"", "c") == filters.BAD_JSON


def test_an_unknown_field_is_counted_and_warned_about_once(caplog):
    f = filters.SampleFilter("pwatermrak < 0.8")  # a typo: no sample has it
    with caplog.at_level("WARNING", logger="clip_jax.data.filters"):
        reasons = [f.check_record({"pwatermark": 0.1}) for _ in range(5)]
    assert reasons == ["filter: pwatermrak < 0.8 (missing pwatermrak)"] * 5
    assert [r.getMessage().count("pwatermrak") for r in caplog.records] == [1]


# -- shards with img2dataset-like metadata ---------------------------------------------------------------------


def _png(width, height, value):
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def _metadata(rng, i):
    """img2dataset's fields, with LAION's columns sometimes missing, null, or strings where numbers belong."""
    width, height = rng.choice([(8, 30), (30, 30), (40, 12)])
    meta = {"url": f"http://x/{i}.png", "caption": f"c {i}", "key": f"{i:09d}", "status": "success",
            "width": width, "height": height, "original_width": width * 3, "original_height": height * 3}
    for field, values in (("punsafe", [0.01, 0.2, 0.49, 0.5, 0.93]), ("NSFW", ["UNLIKELY", "NSFW", "UNSURE"]),
                          ("similarity", [0.1, 0.28, 0.3, 0.35])):
        kind = rng.random()
        if kind < 0.08:
            continue  # missing
        if kind < 0.14:
            meta[field] = None
        elif kind < 0.2:
            meta[field] = str(rng.choice(values))  # "0.2": a string where a number belongs (or the same for NSFW)
        else:
            meta[field] = rng.choice(values)
    return meta


def _write_metadata_shards(folder, num_shards=3, per_shard=40, seed=0):
    """Shards like img2dataset's; returns the pattern and every sample's (metadata, caption) in file order."""
    rng = random.Random(seed)
    written = []
    for s in range(num_shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar"), encoder=False) as sink:
            for i in range(per_shard):
                index = s * per_shard + i
                meta = _metadata(rng, index)
                caption = rng.choice(["", "ok", f"sample {index}", f"a longer caption {index}"])
                sink.write({"__key__": f"{index:09d}", "png": _png(meta["width"], meta["height"], index % 250),
                            "txt": caption.encode(), "json": json.dumps(meta).encode()})
                written.append((meta, caption))
    return f"{folder}/{{00000..{num_shards - 1:05d}}}.tar", written


def _plain_python_reason(meta, caption, min_size, min_chars):
    """The reason a sample is dropped for, worked out here without the filter module."""
    if not caption.strip():
        return "empty_caption"  # a bad sample, counted before any filter
    rules = [("punsafe < 0.5", "punsafe", lambda v: v < 0.5, (int, float)),
             ("NSFW != 'NSFW'", "NSFW", lambda v: v != "NSFW", (str,)),
             ("similarity >= 0.28", "similarity", lambda v: v >= 0.28, (int, float))]
    for text, field, test, kinds in rules:
        if field not in meta:
            return f"filter: {text} (missing {field})"
        value = meta[field]
        if value is None:
            return f"filter: {text} (null {field})"
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"filter: {text} (type {field})"
        if not test(value):
            return f"filter: {text}"
    if min_size and min(meta["width"], meta["height"]) < min_size:
        return "filter: min_image_size"
    if min_chars and len(caption.strip()) < min_chars:
        return "filter: min_caption_chars"
    return None


def _expected_counts(written, min_size=0, min_chars=0):
    reasons = [_plain_python_reason(m, c, min_size, min_chars) for m, c in written]
    return collections.Counter(r for r in reasons if r is not None), sum(r is None for r in reasons)


def test_filter_counts_equal_an_independent_count(tmp_path):
    pattern, written = _write_metadata_shards(tmp_path)
    fmt = webdataset.SampleFormat(sample_filter=filters.SampleFilter(EXPRESSION, 20, 10))
    skipped, kept = collections.Counter(), 0
    for url in shards.resolve_shards(pattern).urls:
        kept += sum(1 for _ in webdataset.iter_shard(url, skipped, fmt))
    expected, expected_kept = _expected_counts(written, 20, 10)
    assert skipped == expected and kept == expected_kept
    # the fixture exercises every kind of reason
    assert {"missing", "null", "type"} <= {r.rsplit("(", 1)[-1].split()[0] for r in expected if "(" in r}
    assert expected["filter: min_image_size"] and expected["filter: min_caption_chars"] and expected_kept


def test_image_size_comes_from_the_header_when_the_metadata_has_none():
    f = filters.SampleFilter(min_image_size=20)
    assert f.check(b'{"width": 50, "height": 50}', _png(8, 30, 0), "c") is None  # the metadata wins
    assert f.check(b"{}", _png(8, 30, 0), "c") == filters.MIN_IMAGE_SIZE
    assert f.check(None, _png(30, 20, 0), "c") is None
    assert f.check(b'{"width": "8", "height": 30}', _png(30, 30, 0), "c") is None  # unusable metadata: header


def _iterator(pattern, sample_filter, **kwargs):
    cfg = data.TrainDataConfig(shards=pattern, sample_filter=sample_filter, **kwargs)
    return data.build_train_iterator(cfg, global_batch_size=4, image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)


@pytest.mark.slow
@pytest.mark.parametrize("resampled,workers", [(True, 0), (False, 2)])
def test_a_resumed_filtered_stream_continues_exactly(tmp_path, resampled, workers):
    pattern, _ = _write_metadata_shards(tmp_path, num_shards=4, per_shard=30)
    sample_filter = filters.SampleFilter(EXPRESSION, min_caption_chars=3)
    kwargs = dict(resampled=resampled, workers=workers, shuffle_window=5, shards_in_flight=2, seed=2)
    it = _iterator(pattern, sample_filter, **kwargs)
    [next(it) for _ in range(3)]
    state = it.get_state()
    counts_then = it.skipped_samples()
    expected = [next(it) for _ in range(3)]
    counts_after = it.skipped_samples()
    it.close()
    resumed = _iterator(pattern, sample_filter, **kwargs)
    resumed.set_state(state)
    assert resumed.skipped_samples() == counts_then
    for batch, want in zip([next(resumed) for _ in range(3)], expected, strict=True):
        np.testing.assert_array_equal(batch["images"], want["images"])
        np.testing.assert_array_equal(batch["tokens"], want["tokens"])
    assert resumed.skipped_samples() == counts_after
    assert any(k.startswith("filter: ") for k in counts_after)
    resumed.close()


def test_filtered_counts_reach_the_metrics_and_the_progress_line():
    counts = {"corrupt_image": 2, "filter: punsafe < 0.5": 5, "filter: punsafe < 0.5 (missing punsafe)": 1,
              "filter: min_image_size": 3}
    scalars = data.skip_scalars(counts)
    assert scalars == {"skipped_samples": 2, "filtered_samples": 9, "skipped/corrupt_image": 2,
                       "filtered/punsafe_0.5": 5, "filtered/punsafe_0.5_missing_punsafe": 1,
                       "filtered/min_image_size": 3}
    line = progress_line(10, 100, 0.1, dict(loss=1.0, accuracy=0.5, logit_scale=14.3, learning_rate=1e-3,
                                            grad_norm=1.0, samples_per_sec=10.0, samples_per_sec_per_device=1.0,
                                            data_wait_fraction=0.0, eta_seconds=5.0, **scalars))
    assert "skipped 2" in line and "filtered 9" in line


def test_a_filter_that_drops_everything_is_a_clear_error(tmp_path):
    pattern, _ = _write_metadata_shards(tmp_path, num_shards=2, per_shard=5)
    it = _iterator(pattern, filters.SampleFilter("punsafe > 5"), shuffle_window=1)
    with pytest.raises(RuntimeError, match="gave no usable sample"):
        next(it)


# -- the check tool and the run config -------------------------------------------------------------------------


def test_check_reports_what_each_rule_would_drop(tmp_path, capsys):
    pattern, written = _write_metadata_shards(tmp_path)
    out = tmp_path / "report.json"
    assert check.main([pattern, "--filter", EXPRESSION, "--min-image-size", "20", "--min-caption-chars", "10",
                       "--json", str(out)]) == 0
    expected, expected_kept = _expected_counts(written, 20, 10)
    report = json.loads(out.read_text())
    assert report["samples"] == expected_kept
    assert report["skipped"] == dict(expected)
    # each rule alone, whatever the others say (a sample can fail several): counted here in plain Python
    alone = collections.Counter()
    for meta, caption in written:
        if not caption.strip():
            continue
        for field, test in (("punsafe", lambda v: isinstance(v, (int, float)) and v < 0.5),
                            ("NSFW", lambda v: isinstance(v, str) and v != "NSFW"),
                            ("similarity", lambda v: isinstance(v, (int, float)) and v >= 0.28)):
            value = meta.get(field)
            if value is None or isinstance(value, bool) or not test(value):
                alone[field] += 1
    rules = dict(zip(("punsafe", "NSFW", "similarity"), filters.parse_rules(EXPRESSION)))
    for field, rule in rules.items():
        assert report["filter_rules_alone"][rule.text] == alone[field]
    printed = capsys.readouterr().out
    assert "filter: punsafe < 0.5 (null punsafe)" in printed and "alone" in printed


def test_checks_filter_warning_is_a_line_like_the_commands_own(tmp_path, monkeypatch, capsys):
    pattern, _ = _write_metadata_shards(tmp_path, num_shards=1, per_shard=4)
    monkeypatch.setattr(filters, "_warned_fields", set())
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a shell: no handler prints it but the command's
    assert check.main([pattern, "--filter", "aesthetic > 5", "--no-decode"]) == 1  # every sample dropped
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: filter field 'aesthetic' is missing from a sample's metadata; such samples are dropped "
                   "and counted", "error: no good sample found"], err
    assert logging.getLogger().handlers == []  # left as found


def test_check_refuses_a_bad_expression_with_its_column(tmp_path, capsys):
    pattern, _ = _write_metadata_shards(tmp_path, num_shards=1, per_shard=2)
    assert check.main([pattern, "--filter", "punsafe << 1"]) == 1
    assert "at column 10" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,message", [
    ({"train_data_filter": "punsafe < 0.5 and and"}, "train_data_filter: cannot parse the filter .* at column 19"),
    ({"train_data_min_image_size": -1}, "train_data_min_image_size=-1 must not be negative"),
    ({"dataset_type": "parquet"}, "dataset_type='parquet': choose one of"),
    ({"dataset_type": "csv", "train_data_filter": "a < 1"}, "only webdataset shards have"),
    ({"train_data_caption_key": "json:"}, "train_data_caption_key is empty"),
])
def test_check_config_validates_the_data_fields(overrides, message):
    c = default_config()
    c.train_data = "/data/{0..1}.tar"
    c.update(overrides)
    with pytest.raises(ValueError, match=message):
        check_config(c, num_devices=1)


def test_the_filter_comes_from_the_run_config():
    c = default_config()
    c.train_data = "/data/{0..1}.tar"
    assert data.TrainDataConfig.from_run_config(c).sample_filter is None
    c.train_data_filter, c.train_data_min_image_size, c.train_data_min_caption_chars = EXPRESSION, 64, 5
    cfg = data.TrainDataConfig.from_run_config(c)
    assert cfg.sample_filter == filters.SampleFilter(EXPRESSION, 64, 5)
    assert cfg.sample_format.sample_filter is cfg.sample_filter
    assert len(cfg.sample_filter.rules) == 3


# -- through the trainer -------------------------------------------------------------------------------------------


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_filtered_run_logs_its_drops_per_rule_and_resumes_exactly(tmp_path, trainer_model_file):
    import shutil

    from trainer_run import losses, tiny_config

    from clip_jax.data import make_shards
    from clip_jax.training import trainer as train_lib

    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=512), str(tmp_path / "s"), 128)
    config = tiny_config((make_shards.shard_pattern(paths), trainer_model_file), tmp_path, train_num_samples=256,
                         save_every_steps=2, warmup=1, resume="latest", dataset_resampled=True, shuffle_window=16,
                         train_data_filter="sha256 >= '4' and width == 28", train_data_min_caption_chars=3)
    train_lib.train(config)  # 4 steps, checkpoints at 2 and 4
    run_dir = tmp_path / "run"
    first = {r["step"]: r for r in _metrics(run_dir) if "loss" in r}
    # a quarter of the hex digests start with 0-3; captions and sizes all pass
    assert first[4]["filtered_samples"] == first[4]["filtered/sha256_4"] >= first[2]["filtered_samples"] > 0
    assert not first[4]["skipped_samples"]

    shutil.rmtree(run_dir / "checkpoints" / "4")
    (run_dir / "metrics.jsonl").unlink()
    train_lib.train(config)  # resumes at step 2 with the filtered stream's state
    again = {r["step"]: r for r in _metrics(run_dir) if "loss" in r}
    assert sorted(again) == [3, 4]
    np.testing.assert_allclose([again[s]["loss"] for s in (3, 4)], [first[s]["loss"] for s in (3, 4)], rtol=1e-5)
    assert again[4]["filtered_samples"] == first[4]["filtered_samples"]
    assert losses(run_dir)
