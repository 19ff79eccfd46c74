"""GPU clocks, power and temperature via nvidia-ml-py, sampled in a background thread during a run.
A measurement without clocks cannot tell a throttled GPU from a slow engine. "n/a" without a GPU."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ClockSamples:
    sm_mhz: list[int] = field(default_factory=list)
    mem_mhz: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    temp_c: list[int] = field(default_factory=list)
    gpu_name: str = "n/a"

    def summary(self) -> dict[str, object]:
        def med(xs):
            return round(statistics.median(xs), 1) if xs else "n/a"

        return {
            "gpu": self.gpu_name,
            "sm_clock_mhz_median": med(self.sm_mhz),
            "sm_clock_mhz_min": min(self.sm_mhz) if self.sm_mhz else "n/a",
            "mem_clock_mhz_median": med(self.mem_mhz),
            "power_w_median": med(self.power_w),
            "temp_c_max": max(self.temp_c) if self.temp_c else "n/a",
        }


class ClockSampler:
    """with ClockSampler(device_index) as s: ...; s.samples.summary()"""

    def __init__(self, device_index: int = 0, interval_s: float = 0.25, enabled: bool = True) -> None:
        """enabled=False: report n/a (a remote server's GPU is not this machine's)."""
        self.device_index = device_index
        self.interval_s = interval_s
        self.samples = ClockSamples()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.samples.gpu_name = name.decode() if isinstance(name, bytes) else name
        except Exception:  # no GPU, no driver, or no nvidia-ml-py: report n/a
            self._handle = None

    def _read(self) -> None:
        nv, h = self._nvml, self._handle
        self.samples.sm_mhz.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        self.samples.mem_mhz.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
        self.samples.power_w.append(nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        self.samples.temp_c.append(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
            except Exception:
                return
            time.sleep(self.interval_s)

    def __enter__(self) -> ClockSampler:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def sm_clock_now() -> str:
    """One reading of the SM clock and its maximum ("1980 MHz, 1980 MHz"), for the kernel benches'
    headers; "n/a" without nvidia-smi."""
    import subprocess

    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return res.stdout.strip() or "n/a"
    except Exception:
        return "n/a"
