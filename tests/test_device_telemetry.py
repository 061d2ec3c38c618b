"""Device and host telemetry: fields from an NVML library handed in at the boundary (a fake one here), none without
it, JAX allocator stats where a backend keeps them, and the warning lines."""


import jax
import pytest
from fake_nvml import fake_nvml

from clip_jax.ops import device_telemetry as telemetry

GPUS = [dict(util=93, used=60e9, total=80e9, temp=61, power=350_000),
        dict(util=55, used=76e9, total=80e9, temp=70, power=410_500)]


class FakeDevice:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_fields_from_an_injected_nvml_library():
    nvml = fake_nvml(GPUS)
    t = telemetry.Telemetry(nvml=nvml, devices=(), host=False, cuda_visible_devices="")
    got = t.sample()
    assert got["gpu0_utilization"] == 0.93 and got["gpu1_utilization"] == 0.55
    assert (got["gpu0_memory_used"], got["gpu1_memory_total"]) == (60e9, 80e9)
    assert (got["gpu0_temperature_c"], got["gpu1_temperature_c"]) == (61, 70)
    assert (got["gpu0_power_w"], got["gpu1_power_w"]) == (350, 410.5)
    assert got["gpu_utilization_min"] == 0.55 and got["gpu_utilization_mean"] == pytest.approx(0.74)
    assert got["gpu_memory_fraction_max"] == pytest.approx(0.95)
    assert got["gpu_temperature_max_c"] == 70 and got["gpu_power_w_total"] == pytest.approx(760.5)
    assert t.notes == []
    t.close()
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_only_the_gpus_cuda_makes_visible_and_no_power_where_unsupported():
    t = telemetry.Telemetry(nvml=fake_nvml(GPUS, power_supported=False), host=False, cuda_visible_devices="1")
    got = t.sample()
    assert got["gpu0_utilization"] == 0.55  # NVML's GPU 1 is this process's first
    assert "gpu1_utilization" not in got
    assert not any("power" in k for k in got)


@pytest.mark.parametrize("nvml, why", [
    (None, "off"),
    (fake_nvml(GPUS, init_error="Driver Not Loaded"), "NVML did not start (Driver Not Loaded)"),
    (fake_nvml([]), "NVML sees no GPU"),
])
def test_no_nvml_no_gpu_fields_and_one_note_saying_why(nvml, why):
    t = telemetry.Telemetry(nvml=nvml, devices=jax.local_devices(), host=True)
    got = t.sample()
    assert not any(k.startswith("gpu") for k in got)
    assert not any(k.startswith("device") for k in got)  # the CPU backend keeps no allocator stats
    assert len(t.notes) == 2 and why in t.notes[0] and "cpu backend keeps none" in t.notes[1]
    assert 0 <= got["host_cpu_percent"] <= 100 * 64
    assert 0 < got["host_ram_used"] < got["host_ram_total"] and got["process_rss"] > 0


def test_the_real_library_gives_fields_or_says_why_not():
    t = telemetry.Telemetry(devices=(), host=False)  # the real pynvml, or its absence
    if t.notes:  # no driver (or no library) here
        assert t.sample() == {}
        assert len(t.notes) == 1 and t.notes[0].startswith("no GPU telemetry")
    else:
        assert 0 <= t.sample()["gpu0_utilization"] <= 1
    t.close()


def test_jax_allocator_stats():
    devices = [FakeDevice({"bytes_in_use": 10, "peak_bytes_in_use": 30, "bytes_limit": 100, "num_allocs": 5}),
               FakeDevice({"bytes_in_use": 95, "peak_bytes_in_use": 96, "bytes_limit": 100}),
               FakeDevice(None)]
    got = telemetry.jax_memory_scalars(devices)
    assert got == {"device0_bytes_in_use": 10, "device0_peak_bytes_in_use": 30, "device0_bytes_limit": 100,
                   "device1_bytes_in_use": 95, "device1_peak_bytes_in_use": 96, "device1_bytes_limit": 100,
                   "device_memory_fraction_max": 0.95}


def test_warnings_for_memory_and_sustained_low_utilisation():
    t = telemetry.Telemetry(nvml=fake_nvml(GPUS), host=False, cuda_visible_devices="")
    first = t.warnings(t.sample())
    assert len(first) == 1 and "memory at 95%" in first[0]  # GPU 1: 76 of 80 GB
    GPUS_OK = [dict(g, used=10e9) for g in GPUS]
    t = telemetry.Telemetry(nvml=fake_nvml(GPUS_OK), host=False, cuda_visible_devices="")
    lines = [t.warnings(t.sample()) for _ in range(telemetry.LOW_UTILISATION_WINDOWS + 2)]
    assert [len(x) for x in lines] == [0, 0, 1, 0, 0]  # GPU 1 at 55%: said once, when it has lasted
    assert "utilisation under 70%" in lines[2][0] and "lowest GPU now 55%" in lines[2][0]


def test_progress_parts():
    scalars = telemetry.Telemetry(nvml=fake_nvml(GPUS), host=False, cuda_visible_devices="").sample()
    assert telemetry.progress_parts(scalars) == ["GPU 74% (min 55%)", "mem 95%", "70C", "760W"]
    assert telemetry.progress_parts({}) == []
