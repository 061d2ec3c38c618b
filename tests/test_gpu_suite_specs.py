"""The GPU suite's specs for the next lease, read on the CPU: the new step (bf16, no remat and dots_saveable, batches
256 and 512) with the adopted XLA:GPU flags from their one list, OpenCLIP's step in the same run, one numerics run
per adopted flag switched off, and the whole lease within its 15 minutes at the seconds earlier leases took."""

import json
import pathlib
import statistics
import types

import benchmark_scripts
import pytest

from clip_jax.runtime import xla_gpu

SPECS = benchmark_scripts.BENCHMARKS / "specs" / "h200_memory_bound.json"


@pytest.fixture(scope="module")
def gpu_suite():
    return benchmark_scripts.load("gpu_suite")


def planned(gpu_suite, specs=SPECS, phases=("matmul", "specs")) -> list[dict]:
    args = types.SimpleNamespace(specs=str(specs), tiny=False, model="ViT-L-14", steps=5, rounds=3, warmup=2,
                                 profile=True, precisions=["bf16"])
    return [run for phase in phases for run in gpu_suite.planned_runs(args, phase, pathlib.Path("out"))]


def test_the_lease_runs_the_new_step_with_the_adopted_flags_beside_open_clip_at_256_and_512(gpu_suite):
    runs = planned(gpu_suite, phases=("specs",))
    adopted = xla_gpu.ADOPTED_FLAGS
    ours = [run for run in runs if run["framework"] == "clip_jax"]
    theirs = [run for run in runs if run["framework"] == "open_clip"]
    assert {run["precision"] for run in runs} == {"bf16"}
    assert all(run["attention"] == "cudnn" for run in ours)
    for batch in (256, 512):
        assert {"none", "dots_saveable"} <= {run["remat"] for run in ours if run["batch"] == batch}
        assert [run["remat"] for run in theirs if run["batch"] == batch] == ["none"]
    timed = [run for run in ours if not run.get("flag_off")]
    assert all(xla_gpu.parse_xla_flags(run["xla_flags"]) == adopted for run in timed)
    # One run per adopted flag with it off and the others on, its first steps beside those of the run with all on.
    off = [run for run in ours if run.get("flag_off")]
    assert sorted(run["flag_off"] for run in off) == sorted(adopted)
    for run in off:
        assert xla_gpu.parse_xla_flags(run["xla_flags"]) == {**adopted, run["flag_off"]: False} and run["numerics"]
        assert any(on.get("numerics") and (on["remat"], on["batch"]) == (run["remat"], run["batch"]) for on in timed)
    assert runs[0]["keep_raw"] and not any(run.get("keep_raw") for run in runs[1:])  # one raw trace comes back


def test_each_adopted_flag_is_switched_off_in_a_run_of_its_own(gpu_suite, monkeypatch, tmp_path):
    monkeypatch.setattr(xla_gpu, "ADOPTED_FLAGS", {"xla_gpu_a": True, "xla_gpu_b": 4})
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([{"framework": "clip_jax", "precision": "bf16", "remat": "none", "batch": 8,
                                  "attention": "cudnn", "xla_flags": "adopted, each off", "numerics": True}]))
    first, second = planned(gpu_suite, specs, phases=("specs",))
    assert (first["flag_off"], first["xla_flags"]) == ("xla_gpu_a", "--xla_gpu_b=4 --xla_gpu_a=false")
    assert (second["flag_off"], second["xla_flags"]) == ("xla_gpu_b", "--xla_gpu_a=true")  # left to XLA's default


def test_the_lease_fits_in_15_minutes_at_the_seconds_earlier_leases_took(gpu_suite):
    runs = planned(gpu_suite)
    results = benchmark_scripts.BENCHMARKS / "results"
    recorded = [json.loads(line) for path in sorted(results.glob("h200-*.jsonl"))
                for line in path.read_text().splitlines()]
    recorded = [r for r in recorded if r.get("status") == "ok" and r.get("seconds")]
    lines, total = gpu_suite.estimate_lines(runs, recorded)
    # The same runs measured before, by hand: clip_jax's dots_saveable at 256 and OpenCLIP's at 512.
    dots = statistics.mean(r["seconds"] for r in recorded if (r["framework"], r["precision"], r["remat"],
                                                              r.get("attention"), r["batch"])
                           == ("clip_jax", "bf16", "dots_saveable", "cudnn", 256))
    assert gpu_suite.estimated_seconds(runs[1], recorded) == pytest.approx(dots)
    theirs = [r["seconds"] for r in recorded
              if (r["framework"], r["precision"], r["remat"], r["batch"]) == ("open_clip", "bf16", "none", 512)]
    assert gpu_suite.estimated_seconds({**runs[1], "framework": "open_clip", "remat": "none", "batch": 512},
                                       recorded) == pytest.approx(statistics.mean(theirs))
    # No clip_jax run without remat at 512 was recorded: the framework's runs at 512 stand in.
    at_512 = [r["seconds"] for r in recorded if r["framework"] == "clip_jax" and r["batch"] == 512]
    assert gpu_suite.estimated_seconds({**runs[1], "remat": "none", "batch": 512}, recorded) == pytest.approx(
        statistics.mean(at_512))
    runs_s = sum(gpu_suite.estimated_seconds(run, recorded) for run in runs)
    assert total == pytest.approx(gpu_suite.LEASE_START_S + gpu_suite.SETUP_S + runs_s)
    assert total <= 15 * 60 and lines[-1].endswith(f"({total / 60:.1f} of the lease's 15 minutes)")


def test_a_flag_switched_off_is_reported_against_the_same_step_with_it_on(gpu_suite):
    setting = {"framework": "clip_jax", "precision": "bf16", "remat": "dots_saveable", "attention": "cudnn",
               "batch": 256, "status": "ok"}
    on = {**setting, "samples_per_s": 650.0, "numerics": {"loss": [5.0, 4.0], "grad_norm": [2.0, 1.0]}}
    off = {**setting, "samples_per_s": 625.0, "flag_off": "xla_gpu_a",
           "numerics": {"loss": [5.0, 4.004], "grad_norm": [2.0, 1.00002]}}
    lines = gpu_suite.numerics_lines([on, off])
    assert lines[-1] == ("  xla_gpu_a (bf16 dots_saveable 256): off against on, first 2 steps: loss within 1.0e-03, "
                         "gradient norm within 2.0e-05 (relative); 1.040x the samples/s on")
