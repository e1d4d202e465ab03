"""Device memory probes and the admission inequalities (SPEC §6)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from controller.model.sizes import GIB
from controller.probes.memory import (
    AmdSysfsProbe,
    FakeMemoryProbe,
    NvmlProbe,
    PsutilProbe,
    SystemMemoryProbe,
    read_meminfo,
)
from controller.scheduling.fit import DeviceMemory, check_admission

# ----------------------------------------------------------------- psutil


def test_psutil_probe_matches_virtual_memory() -> None:
    """On Linux the figures come from /proc/meminfo directly: the same as psutil's."""
    before = psutil.virtual_memory()
    sample = PsutilProbe().sample("cpu")
    after = psutil.virtual_memory()
    assert sample is not None
    assert sample.device == "cpu"
    assert sample.source == ("meminfo" if Path("/proc/meminfo").exists() else "psutil")
    assert sample.total_bytes == before.total == after.total
    tolerance = max(256 * 1024**2, before.total // 50)  # other processes allocate meanwhile
    low = min(before.available, after.available) - tolerance
    high = max(before.available, after.available) + tolerance
    assert low <= sample.free_bytes <= high
    assert 0 < sample.free_bytes <= sample.total_bytes


MEMINFO = """\
MemTotal:       24684084 kB
MemFree:        22494124 kB
MemAvailable:   23953536 kB
Buffers:          112344 kB
"""


def test_meminfo_is_read_as_psutil_reads_it(tmp_path: Path) -> None:
    """The two figures, in bytes (psutil multiplies meminfo's kB by 1024)."""
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert read_meminfo(str(path)) == (24684084 * 1024, 23953536 * 1024)
    sample = PsutilProbe(path).sample("cpu")
    assert sample == DeviceMemory("cpu", 24684084 * 1024, 23953536 * 1024, "meminfo")


def test_meminfo_without_memavailable_falls_back_to_psutil(tmp_path: Path) -> None:
    """A kernel before 3.14 has no MemAvailable (psutil estimates it); a file that
    cannot be read, or a figure that is not a number, is psutil's turn too."""
    old = tmp_path / "old"
    old.write_text(MEMINFO.replace("MemAvailable:   23953536 kB\n", ""))
    odd = tmp_path / "odd"
    odd.write_text(MEMINFO.replace("23953536", "lots"))
    inline = tmp_path / "inline"  # a key that is not at a line's start is not the key
    inline.write_text(MEMINFO.replace("MemAvailable:", "XMemAvailable:"))
    for path in (old, odd, inline, tmp_path / "missing"):
        assert read_meminfo(str(path)) is None, path.name
        sample = PsutilProbe(path).sample("cpu")
        assert sample is not None and sample.source == "psutil", path.name
        assert sample.total_bytes == psutil.virtual_memory().total


def test_psutil_probe_serves_npu_too() -> None:
    sample = PsutilProbe().sample("npu")
    assert sample is not None and sample.device == "npu"


# ----------------------------------------------------------------- AMD sysfs


def _card(root: Path, name: str, **files: int) -> Path:
    dev = root / name / "device"
    dev.mkdir(parents=True)
    for key, value in files.items():
        (dev / f"mem_info_{key}").write_text(f"{value}\n")
    return dev


def test_amd_vram_and_gtt_are_summed(tmp_path: Path) -> None:
    _card(
        tmp_path,
        "card0",
        vram_total=8 * GIB,
        vram_used=2 * GIB,
        gtt_total=16 * GIB,
        gtt_used=1 * GIB,
    )
    sample = AmdSysfsProbe(tmp_path).sample("gpu")
    assert sample == DeviceMemory("gpu", 24 * GIB, 21 * GIB, "amd-sysfs")


def test_amd_vram_only(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=3 * GIB)
    assert AmdSysfsProbe(tmp_path).sample("gpu") == DeviceMemory(
        "gpu", 8 * GIB, 5 * GIB, "amd-sysfs"
    )


def test_amd_multiple_cards_are_summed(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=8 * GIB)
    _card(tmp_path, "card1", vram_total=4 * GIB, vram_used=1 * GIB, gtt_total=GIB, gtt_used=0)
    sample = AmdSysfsProbe(tmp_path).sample("gpu")
    assert sample is not None
    assert (sample.total_bytes, sample.free_bytes) == (13 * GIB, 4 * GIB)


def test_amd_connector_and_render_nodes_are_not_counted(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=0)
    (tmp_path / "card0-DP-1" / "device").mkdir(parents=True)  # a connector: no mem_info
    (tmp_path / "renderD128" / "device").mkdir(parents=True)
    (tmp_path / "version").write_text("drm 1.1.0\n")
    sample = AmdSysfsProbe(tmp_path).sample("gpu")
    assert sample is not None and sample.total_bytes == 8 * GIB


def test_amd_missing_files_give_none(tmp_path: Path) -> None:
    (tmp_path / "card0" / "device").mkdir(parents=True)  # e.g. an NVIDIA or Intel card
    assert AmdSysfsProbe(tmp_path).sample("gpu") is None


def test_amd_total_without_used_is_ignored(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB)  # used unreadable
    assert AmdSysfsProbe(tmp_path).sample("gpu") is None


def test_amd_unparsable_file_is_ignored(tmp_path: Path) -> None:
    dev = _card(tmp_path, "card0", vram_total=8 * GIB, gtt_total=4 * GIB, gtt_used=GIB)
    (dev / "mem_info_vram_used").write_text("garbage\n")
    sample = AmdSysfsProbe(tmp_path).sample("gpu")
    assert sample is not None and (sample.total_bytes, sample.free_bytes) == (4 * GIB, 3 * GIB)


def test_amd_no_root_and_other_devices(tmp_path: Path) -> None:
    assert AmdSysfsProbe(tmp_path / "absent").sample("gpu") is None
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=0)
    assert AmdSysfsProbe(tmp_path).sample("cpu") is None
    assert AmdSysfsProbe(tmp_path).sample("npu") is None


def test_amd_used_above_total_clamps_free_at_zero(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=GIB, vram_used=2 * GIB)
    sample = AmdSysfsProbe(tmp_path).sample("gpu")
    assert sample is not None and sample.free_bytes == 0


# ----------------------------------------------------------------- NVML


class FakeNvml:
    """Just enough of pynvml: an init, a device count, handles and memory info."""

    def __init__(self, gpus: list[tuple[int, int]], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        total, free = self.gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)


class NVMLError(Exception):
    pass


def test_nvml_sums_visible_gpus() -> None:
    nvml = FakeNvml([(80 * GIB, 70 * GIB), (24 * GIB, 4 * GIB)])
    probe = NvmlProbe(nvml)
    assert probe.sample("gpu") == DeviceMemory("gpu", 104 * GIB, 74 * GIB, "nvml")
    assert probe.error is None
    probe.sample("gpu")
    assert nvml.inits == 1  # initialised once


def test_nvml_only_answers_for_gpu() -> None:
    probe = NvmlProbe(FakeNvml([(GIB, GIB)]))
    assert probe.sample("cpu") is None
    assert probe.sample("npu") is None


def test_nvml_init_failure_gives_none_with_error() -> None:
    nvml = FakeNvml([(GIB, GIB)], init_error=NVMLError("Driver Not Loaded"))
    probe = NvmlProbe(nvml)
    assert probe.sample("gpu") is None
    assert probe.error is not None and "Driver Not Loaded" in probe.error
    assert probe.sample("gpu") is None
    assert nvml.inits == 1  # not retried on every sample


def test_nvml_no_devices_gives_none() -> None:
    assert NvmlProbe(FakeNvml([])).sample("gpu") is None


def test_nvml_missing_module_gives_none_with_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> Any:
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    probe = NvmlProbe()
    assert probe.sample("gpu") is None
    assert probe.error == "nvidia-ml-py is not installed"


# ----------------------------------------------------------------- SystemMemoryProbe


@dataclass
class _Recorder:
    """Counts calls to a real probe's ``sample``."""

    inner: Any
    calls: int = 0

    def sample(self, device: str) -> DeviceMemory | None:
        self.calls += 1
        result: DeviceMemory | None = self.inner.sample(device)
        return result


def test_system_probe_prefers_nvml(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=0)
    nvml = NvmlProbe(FakeNvml([(24 * GIB, 20 * GIB)]))
    amd = _Recorder(AmdSysfsProbe(tmp_path))
    probe = SystemMemoryProbe(nvml=nvml, amd=amd)  # type: ignore[arg-type]
    sample = probe.sample("gpu")
    assert sample is not None and sample.source == "nvml"
    assert amd.calls == 0


def test_system_probe_falls_back_to_amd(tmp_path: Path) -> None:
    _card(tmp_path, "card0", vram_total=8 * GIB, vram_used=GIB)
    nvml = NvmlProbe(FakeNvml([], init_error=NVMLError("no NVIDIA driver")))
    probe = SystemMemoryProbe(nvml=nvml, amd=AmdSysfsProbe(tmp_path))
    assert probe.sample("gpu") == DeviceMemory("gpu", 8 * GIB, 7 * GIB, "amd-sysfs")


def test_system_probe_gpu_without_any_probe_is_none(tmp_path: Path) -> None:
    nvml = NvmlProbe(FakeNvml([]))
    probe = SystemMemoryProbe(nvml=nvml, amd=AmdSysfsProbe(tmp_path / "none"))
    assert probe.sample("gpu") is None  # never a silent CPU fallback


def test_system_probe_uses_psutil_for_cpu_and_npu(tmp_path: Path) -> None:
    nvml = _Recorder(NvmlProbe(FakeNvml([(GIB, GIB)])))
    amd = _Recorder(AmdSysfsProbe(tmp_path))
    probe = SystemMemoryProbe(nvml=nvml, amd=amd)  # type: ignore[arg-type]
    for device in ("cpu", "npu"):
        sample = probe.sample(device)
        assert sample is not None
        assert sample.source in ("meminfo", "psutil") and sample.device == device
        assert sample.total_bytes == psutil.virtual_memory().total
    assert nvml.calls == amd.calls == 0


def test_fake_probe() -> None:
    probe = FakeMemoryProbe({"gpu": 10 * GIB}, used_by=lambda d: 3 * GIB)
    probe.external["gpu"] = 2 * GIB
    assert probe.sample("gpu") == DeviceMemory("gpu", 10 * GIB, 5 * GIB, "fake")
    probe.external["gpu"] = 20 * GIB
    sample = probe.sample("gpu")
    assert sample is not None and sample.free_bytes == 0
    assert probe.sample("cpu") is None


# ----------------------------------------------------------------- admission


def _sample(total_gb: float, free_gb: float) -> DeviceMemory:
    return DeviceMemory("gpu", int(total_gb * GIB), int(free_gb * GIB), "fake")


def test_admission_fits() -> None:
    a = check_admission("gpu", 4 * GIB, 10 * GIB, _sample(24, 14), None, 0)
    assert a.ok and a.shortfall == 0
    assert (a.budget, a.free, a.admitted, a.source) == (24 * GIB, 14 * GIB, 10 * GIB, "fake")


def test_admission_budget_inequality() -> None:
    # Free memory says yes (the probe lags), but what slotctl promised is over budget.
    a = check_admission("gpu", 6 * GIB, 20 * GIB, _sample(24, 23), None, 0)
    assert not a.ok
    assert a.budget_room == 4 * GIB
    assert a.shortfall == 2 * GIB


def test_admission_free_inequality() -> None:
    # Within budget, but something outside slotctl holds memory.
    a = check_admission("gpu", 6 * GIB, 4 * GIB, _sample(24, 5), None, 0)
    assert not a.ok
    assert a.free_room == 5 * GIB
    assert a.shortfall == 1 * GIB


def test_admission_shortfall_is_the_larger_of_the_two() -> None:
    a = check_admission("gpu", 10 * GIB, 18 * GIB, _sample(24, 3), None, 0)
    assert a.shortfall == max(10 * GIB - 6 * GIB, 10 * GIB - 3 * GIB) == 7 * GIB


def test_admission_exact_fit_is_ok() -> None:
    assert check_admission("gpu", 4 * GIB, 20 * GIB, _sample(24, 4), None, 0).ok


def test_admission_margin_applies_to_both() -> None:
    margin = GIB // 2
    a = check_admission("gpu", 4 * GIB, 0, _sample(24, 4), None, margin)
    assert not a.ok and a.shortfall == margin
    b = check_admission("gpu", 4 * GIB, 20 * GIB, _sample(24, 24), None, margin)
    assert not b.ok and b.shortfall == margin
    c = check_admission("gpu", 4 * GIB, 0, _sample(24, 4.5), None, margin)
    assert c.ok


def test_admission_budget_overrides_probed_total() -> None:
    a = check_admission("gpu", 4 * GIB, 6 * GIB, _sample(24, 18), 8 * GIB, 0)
    assert a.budget == 8 * GIB and not a.ok and a.shortfall == 2 * GIB
    b = check_admission("gpu", 2 * GIB, 6 * GIB, _sample(24, 18), 8 * GIB, 0)
    assert b.ok


def test_admission_without_probe_uses_the_budget() -> None:
    a = check_admission("gpu", 4 * GIB, 2 * GIB, None, 8 * GIB, 0)
    assert a.ok and a.source == "budget"
    assert a.free == 6 * GIB  # budget - admitted
    b = check_admission("gpu", 7 * GIB, 2 * GIB, None, 8 * GIB, 0)
    assert not b.ok and b.shortfall == GIB


def test_admission_without_probe_or_budget_is_refused() -> None:
    a = check_admission("gpu", GIB, 0, None, None, 0)
    assert not a.ok
    assert a.source == "none"
    assert a.budget == 0 and a.free == 0
    assert a.shortfall == GIB


def test_admission_zero_budget_is_a_budget() -> None:
    a = check_admission("gpu", GIB, 0, _sample(24, 24), 0, 0)
    assert a.budget == 0 and not a.ok


# ----------------------------------------------------------------- each GPU its own device


class NamedNvml(FakeNvml):
    """FakeNvml with identities (as nvidia-ml-py answers) and GPUs that can be lost."""

    def __init__(self, gpus: list[tuple[int, int]], *, as_bytes: bool = False) -> None:
        super().__init__(gpus)
        self.as_bytes = as_bytes
        self.lost: set[int] = set()

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.lost:
            raise NVMLError("GPU is lost")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        uuid = f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd"
        return uuid.encode() if self.as_bytes else uuid

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        name = f"NVIDIA Test {handle}"
        return name.encode() if self.as_bytes else name


@pytest.mark.parametrize("as_bytes", [False, True])
def test_nvml_reports_each_gpu(as_bytes: bool) -> None:
    probe = NvmlProbe(NamedNvml([(24 * GIB, 20 * GIB), (48 * GIB, 8 * GIB)], as_bytes=as_bytes))
    gpus = probe.gpus()
    assert [(g.device, g.index, g.total_bytes, g.free_bytes) for g in gpus] == [
        ("gpu:0", 0, 24 * GIB, 20 * GIB),
        ("gpu:1", 1, 48 * GIB, 8 * GIB),
    ]
    assert gpus[1].uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"
    assert gpus[1].name == "NVIDIA Test 1" and gpus[1].vendor == "nvidia"
    assert probe.sample("gpu:1") == gpus[1]
    assert probe.sample("gpu:7") is None
    total = probe.sample("gpu")  # all GPUs as one line
    assert total is not None and (total.total_bytes, total.free_bytes) == (72 * GIB, 28 * GIB)


def test_a_lost_gpu_is_listed_with_its_error_and_counts_nowhere() -> None:
    nvml = NamedNvml([(24 * GIB, 20 * GIB), (24 * GIB, 24 * GIB)])
    probe = NvmlProbe(nvml)
    nvml.lost.add(0)
    lost, ok = probe.gpus()
    assert lost.device == "gpu:0" and lost.error is not None and "GPU is lost" in lost.error
    assert ok.error is None and ok.free_bytes == 24 * GIB
    assert probe.sample("gpu:0") is None  # cannot be read: no figures
    total = probe.sample("gpu")
    assert total is not None and total.total_bytes == 24 * GIB
    nvml.lost.clear()  # the card came back (a driver reset)
    assert probe.sample("gpu:0") is not None


def test_amd_reports_each_card_in_card_order(tmp_path: Path) -> None:
    _card(tmp_path, "card10", vram_total=16 * GIB, vram_used=GIB)
    _card(tmp_path, "card2", vram_total=8 * GIB, vram_used=2 * GIB)
    (tmp_path / "card2-DP-1" / "device").mkdir(parents=True)  # a connector
    gpus = AmdSysfsProbe(tmp_path).gpus()
    assert [(g.device, g.index, g.total_bytes, g.free_bytes, g.vendor) for g in gpus] == [
        ("gpu:0", 0, 8 * GIB, 6 * GIB, "amd"),  # card2 before card10: numbers, not text
        ("gpu:1", 1, 16 * GIB, 15 * GIB, "amd"),
    ]
    assert AmdSysfsProbe(tmp_path).sample("gpu:1") == gpus[1]


def test_gpu_inventory_is_the_probe_else_the_budgets() -> None:
    from controller.scheduling.fit import gpu_inventory

    probed = NvmlProbe(NamedNvml([(24 * GIB, 20 * GIB), (24 * GIB, 24 * GIB)])).gpus()
    inventory = gpu_inventory(probed, {"gpu": 20, "gpu:1": 10})
    assert [(g.key, g.budget, g.ref.uuid is not None) for g in inventory] == [
        ("gpu:0", 20 * GIB, True),  # `gpu` = each GPU
        ("gpu:1", 10 * GIB, True),  # `"gpu:1"` = that one
    ]
    assert [g.key for g in gpu_inventory(probed, {})] == ["gpu:0", "gpu:1"]
    assert gpu_inventory(probed, {})[0].budget is None  # the probed total rules
    # no probe: the GPUs the budgets name (a bare `gpu` budget: one GPU)
    assert [(g.key, g.budget) for g in gpu_inventory((), {"gpu": 22})] == [("gpu:0", 22 * GIB)]
    named = gpu_inventory((), {"gpu:0": 12, "gpu:2": 8})
    assert [(g.key, g.budget, g.sample) for g in named] == [
        ("gpu:0", 12 * GIB, None),
        ("gpu:2", 8 * GIB, None),
    ]
    assert gpu_inventory((), {"cpu": 32}) == ()


def test_fake_probe_with_several_gpus() -> None:
    probe = FakeMemoryProbe({"gpu:0": 24 * GIB, "gpu:1": 12 * GIB}, used_by=lambda d: GIB)
    probe.external["gpu:1"] = 2 * GIB
    assert [(g.device, g.free_bytes) for g in probe.gpus()] == [
        ("gpu:0", 23 * GIB),
        ("gpu:1", 9 * GIB),
    ]
    one = FakeMemoryProbe({"gpu": 10 * GIB})  # a one-GPU host, written the old way
    assert [g.device for g in one.gpus()] == ["gpu:0"]


def test_a_lost_gpu_keeps_its_uuid_for_a_pin_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = NamedNvml([(24 * GIB, 20 * GIB), (24 * GIB, 24 * GIB)])
    probe = NvmlProbe(nvml)
    known = probe.gpus()[1].uuid
    nvml.lost.add(1)
    lost = probe.gpus()[1]
    assert lost.error is not None and lost.uuid == known


def test_a_failed_nvml_init_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    import controller.probes.memory as memory

    clock = [1000.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: clock[0])
    nvml = FakeNvml([(GIB, GIB)], init_error=NVMLError("Driver Not Loaded"))
    probe = NvmlProbe(nvml)
    assert probe.gpus() == () and probe.gpus() == () and nvml.inits == 1
    nvml.init_error = None  # the driver is loaded
    clock[0] += memory.INIT_RETRY_S + 1
    assert [g.device for g in probe.gpus()] == ["gpu:0"] and probe.error is None


def test_a_failed_device_count_keeps_the_gpus_seen_as_lost() -> None:
    nvml = NamedNvml([(24 * GIB, 20 * GIB), (24 * GIB, 24 * GIB)])
    probe = NvmlProbe(nvml)
    assert len(probe.gpus()) == 2

    def broken() -> int:
        raise NVMLError("Unknown Error")

    nvml.nvmlDeviceGetCount = broken  # type: ignore[method-assign]
    gpus = probe.gpus()
    assert [g.device for g in gpus] == ["gpu:0", "gpu:1"]  # not a budget-only host
    assert all(g.error is not None and "Unknown Error" in g.error for g in gpus)


def test_an_amd_card_whose_memory_cannot_be_read_keeps_its_index(tmp_path: Path) -> None:
    for n in (0, 1, 2):
        dev = _card(tmp_path, f"card{n}", vram_total=(n + 1) * 8 * GIB, vram_used=0)
        (dev / "vendor").write_text("0x1002\n")
    (tmp_path / "card1" / "device" / "mem_info_vram_used").unlink()  # a driver reset
    gpus = AmdSysfsProbe(tmp_path).gpus()
    assert [(g.device, g.error is None) for g in gpus] == [
        ("gpu:0", True),
        ("gpu:1", False),
        ("gpu:2", True),
    ]
    assert gpus[2].total_bytes == 24 * GIB  # the third card is still gpu:2
