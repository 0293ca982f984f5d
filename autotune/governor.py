"""Run-time CPU governor: pause or resume one sampler when the machine stays too busy or too idle.

The profile sets the sampler count once; other programs, thermal limits or a slow evaluator can change
the picture during a run. The supervisor feeds :meth:`CpuGovernor.decide` a CPU reading every few
seconds and pauses/resumes samplers as told. Pure logic: the caller measures (psutil) and acts.

Hysteresis comes from two places: a dead band (nothing happens while CPU is within ``target +- band``)
and a sustain time (the reading must stay beyond the band for ``sustain_s`` without interruption); after
a change, the next one needs another full ``sustain_s`` window of readings taken after the change.
"""
from __future__ import annotations

from autotune.decide import TARGET_CPU_PERCENT


class CpuGovernor:
    def __init__(self, target_percent: float = TARGET_CPU_PERCENT, band: float = 15.0, sustain_s: float = 15.0,
                 min_active: int = 1, max_active: int | None = None):
        if band < 0 or sustain_s < 0:
            raise ValueError("band and sustain_s must be >= 0")
        if min_active < 0 or (max_active is not None and max_active < min_active):
            raise ValueError(f"need 0 <= min_active <= max_active, got {min_active} and {max_active}")
        self.target_percent = float(target_percent)
        self.band = float(band)
        self.sustain_s = float(sustain_s)
        self.min_active = int(min_active)
        self.max_active = max_active
        self._high_since: float | None = None
        self._low_since: float | None = None
        self._last_change: float | None = None

    @property
    def high_percent(self) -> float:
        return self.target_percent + self.band

    @property
    def low_percent(self) -> float:
        return self.target_percent - self.band

    def reset(self) -> None:
        """Forget the running conditions (e.g. after samplers were paused or restarted for another reason)."""
        self._high_since = self._low_since = self._last_change = None

    def decide(self, now_s: float, cpu_percent: float, active: int) -> tuple[int, str | None]:
        """New number of active samplers and, when it differs from ``active``, why."""
        upper = self.max_active if self.max_active is not None else max(active, self.min_active)
        if active < self.min_active or active > upper:
            clamped = min(max(active, self.min_active), upper)
            self._restart(now_s)
            return clamped, f"{active} active samplers is outside [{self.min_active}, {upper}]; set to {clamped}"
        if cpu_percent != cpu_percent:  # NaN: no reading, no decision and no running condition
            self._high_since = self._low_since = None
            return active, None
        if cpu_percent > self.high_percent:
            self._low_since = None
            if self._high_since is None:
                self._high_since = now_s
        elif cpu_percent < self.low_percent:
            self._high_since = None
            if self._low_since is None:
                self._low_since = now_s
        else:
            self._high_since = self._low_since = None
            return active, None
        if self._last_change is not None and now_s - self._last_change < self.sustain_s:
            return active, None
        if self._high_since is not None and now_s - self._high_since >= self.sustain_s and active > self.min_active:
            held = now_s - self._high_since
            self._restart(now_s)
            return active - 1, (f"CPU {cpu_percent:.0f}% above {self.high_percent:.0f}% for {held:.0f} s: "
                                f"pausing one sampler ({active} -> {active - 1} active)")
        if self._low_since is not None and now_s - self._low_since >= self.sustain_s and active < upper:
            held = now_s - self._low_since
            self._restart(now_s)
            return active + 1, (f"CPU {cpu_percent:.0f}% below {self.low_percent:.0f}% for {held:.0f} s: "
                                f"resuming one sampler ({active} -> {active + 1} active)")
        return active, None

    def _restart(self, now_s: float) -> None:
        """After a change, the next one needs a whole new window of readings taken after it."""
        self._last_change = now_s
        self._high_since = self._low_since = None
