"""Policies, the immutable ``WorkspaceConfiguration`` with its fluent builder, and ``WorkspaceStats``.

Sizes are normalised to int bytes and policies to enum members here; every value and combination is
then validated by the Rust core, so the rules live in one place.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator
import os
from typing import Any, SupportsIndex, TypeAlias

import numpy

from . import _rustws

__all__ = [
    "AllocationPolicy",
    "ArrayType",
    "DebugMode",
    "LearningPolicy",
    "LocationPolicy",
    "MirroringPolicy",
    "ResetPolicy",
    "SpillPolicy",
    "WorkspaceConfiguration",
    "WorkspaceConfigurationBuilder",
    "WorkspaceMode",
    "WorkspaceStats",
]

Size: TypeAlias = "SupportsIndex | float | str"
"""A size: int bytes (anything with ``__index__``, or a float holding a whole number) or a string with
units (``"512KiB"``, ``"64MiB"``, ``"1GB"``)."""


class _Policy(enum.Enum):
    """Members compare by identity; ``.value`` is the canonical name the core understands."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    @classmethod
    def coerce(cls, value: Any, field: str) -> Any:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                names = ", ".join(cls.__members__)
                raise ValueError(f"invalid {field}: {value!r} is not a {cls.__name__} ({names})") from None
        raise TypeError(f"{field} must be a {cls.__name__}, got {type(value).__name__}")


class AllocationPolicy(_Policy):
    STRICT = "STRICT"
    OVERALLOCATE = "OVERALLOCATE"
    ALWAYS = "ALWAYS"


class LearningPolicy(_Policy):
    NONE = "NONE"
    FIRST_LOOP = "FIRST_LOOP"
    OPTIMIZED = "FIRST_LOOP"
    OVER_TIME = "OVER_TIME"
    TRAINING = "OVER_TIME"
    ADAPTIVE = "ADAPTIVE"


class SpillPolicy(_Policy):
    FAIL = "FAIL"
    REALLOCATE = "REALLOCATE"
    EXTERNAL = "EXTERNAL"


class ResetPolicy(_Policy):
    BLOCK_LEFT = "BLOCK_LEFT"
    ENDOFBUFFER_REACHED = "ENDOFBUFFER_REACHED"


class MirroringPolicy(_Policy):
    FULL = "FULL"
    ENABLED = "FULL"
    DISABLED = "DISABLED"
    HOST_ONLY = "HOST_ONLY"


class LocationPolicy(_Policy):
    RAM = "RAM"
    MMAP = "MMAP"


class DebugMode(_Policy):
    DISABLED = "DISABLED"
    SPILL_EVERYTHING = "SPILL_EVERYTHING"
    BYPASS_EVERYTHING = "BYPASS_EVERYTHING"


class WorkspaceMode(_Policy):
    ENABLED = "ENABLED"
    NONE = "NONE"
    SINGLE = "ENABLED"
    SEPARATE = "ENABLED"


class ArrayType(_Policy):
    INPUT = "INPUT"
    ACTIVATIONS = "ACTIVATIONS"
    ACTIVATION_GRAD = "ACTIVATION_GRAD"
    FF_WORKING_MEM = "FF_WORKING_MEM"
    BP_WORKING_MEM = "BP_WORKING_MEM"
    RNN_FF_LOOP_WORKING_MEM = "RNN_FF_LOOP_WORKING_MEM"
    RNN_BP_LOOP_WORKING_MEM = "RNN_BP_LOOP_WORKING_MEM"
    UPDATER_WORKING_MEM = "UPDATER_WORKING_MEM"
    FF_CACHE = "FF_CACHE"


_SIZE_FIELDS = ("initial_size", "min_size", "max_size", "temp_block_size", "helper_min_size")
_POLICY_FIELDS: dict[str, type[_Policy]] = {
    "policy_allocation": AllocationPolicy,
    "policy_learning": LearningPolicy,
    "policy_spill": SpillPolicy,
    "policy_reset": ResetPolicy,
    "policy_mirroring": MirroringPolicy,
    "policy_location": LocationPolicy,
    "debug_mode": DebugMode,
}


def _size(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{field} must be an int or a size string, got bool")
    if isinstance(value, str):
        try:
            return _rustws.parse_size(value)
        except ValueError as e:
            raise ValueError(f"invalid {field}: {e}") from None
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"invalid {field}: must be a finite number of bytes, got {value}")
        if not value.is_integer():
            raise ValueError(f"invalid {field}: must be a whole number of bytes, got {value}")
        value = int(value)
    try:
        n = int(value.__index__()) if not isinstance(value, int) else value
    except (AttributeError, TypeError):
        raise TypeError(f"{field} must be an int or a size string, got {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"invalid {field}: must be >= 0, got {n}")
    return n


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class WorkspaceConfiguration:
    """Every knob of a workspace. Immutable, hashable, equal by value.

    Sizes are int bytes or strings with units (``"512KiB"``, ``"64MiB"``, ``"1GB"``); ``max_size=0``
    means no limit. Policies are enum members or their names. Invalid values or combinations raise
    ``ValueError`` naming the field. The attributes hold the normalised values (int bytes, enum
    members, the path as a str).
    """

    initial_size: int = 0
    min_size: int = 0
    max_size: int = 0
    overallocation_limit: float = 0.3
    cycles_before_initialization: int = 0
    policy_allocation: AllocationPolicy = AllocationPolicy.OVERALLOCATE
    policy_learning: LearningPolicy = LearningPolicy.FIRST_LOOP
    policy_spill: SpillPolicy = SpillPolicy.EXTERNAL
    policy_reset: ResetPolicy = ResetPolicy.BLOCK_LEFT
    policy_mirroring: MirroringPolicy = MirroringPolicy.FULL
    policy_location: LocationPolicy = LocationPolicy.RAM
    temp_file_path: str | None = None
    temp_block_size: int = 0
    helper_min_size: int = 0
    helper_allow_fallback: bool = True
    use_cycle_detector: bool = False
    debug_mode: DebugMode = DebugMode.DISABLED

    def __init__(
        self,
        *,
        initial_size: Size = 0,
        min_size: Size = 0,
        max_size: Size = 0,
        overallocation_limit: float = 0.3,
        cycles_before_initialization: int = 0,
        policy_allocation: AllocationPolicy | str = AllocationPolicy.OVERALLOCATE,
        policy_learning: LearningPolicy | str = LearningPolicy.FIRST_LOOP,
        policy_spill: SpillPolicy | str = SpillPolicy.EXTERNAL,
        policy_reset: ResetPolicy | str = ResetPolicy.BLOCK_LEFT,
        policy_mirroring: MirroringPolicy | str = MirroringPolicy.FULL,
        policy_location: LocationPolicy | str = LocationPolicy.RAM,
        temp_file_path: str | os.PathLike[str] | None = None,
        temp_block_size: Size = 0,
        helper_min_size: Size = 0,
        helper_allow_fallback: bool = True,
        use_cycle_detector: bool = False,
        debug_mode: DebugMode | str = DebugMode.DISABLED,
    ) -> None:
        values = dict(locals())
        put = object.__setattr__
        for f in dataclasses.fields(self):
            put(self, f.name, values[f.name])
        self.__post_init__()

    def __post_init__(self) -> None:
        put = object.__setattr__
        for f in _SIZE_FIELDS:
            put(self, f, _size(getattr(self, f), f))
        for f, cls in _POLICY_FIELDS.items():
            put(self, f, cls.coerce(getattr(self, f), f))
        ol = self.overallocation_limit
        # Any real number, NumPy's scalars included; not a bool.
        if isinstance(ol, (bool, numpy.bool_)) or not isinstance(ol, numbers.Real):
            raise TypeError(f"overallocation_limit must be a number, got {type(ol).__name__}")
        put(self, "overallocation_limit", float(ol))
        cbi = self.cycles_before_initialization
        # Any integer (`operator.index`), NumPy's included; not a bool.
        if isinstance(cbi, (bool, numpy.bool_)) or not hasattr(type(cbi), "__index__"):
            raise TypeError(f"cycles_before_initialization must be an int, got {type(cbi).__name__}")
        put(self, "cycles_before_initialization", operator.index(cbi))
        for f in ("helper_allow_fallback", "use_cycle_detector"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{f} must be a bool, got {type(getattr(self, f)).__name__}")
        p = self.temp_file_path
        if p is not None:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"temp_file_path must be a str or os.PathLike, got {type(p).__name__}")
            put(self, "temp_file_path", os.fspath(p))
        _rustws.validate_config(self._core_dict())

    def _core_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f in _POLICY_FIELDS:
            d[f] = d[f].value
        return d

    def __repr__(self) -> str:
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"WorkspaceConfiguration({', '.join(parts)})"

    def replace(self, **changes: Any) -> WorkspaceConfiguration:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values: ints, floats, bools, policy names, the path or None."""
        return self._core_dict()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkspaceConfiguration:
        if not isinstance(d, dict):
            raise TypeError(f"from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TypeError(f"unknown configuration field(s): {', '.join(map(repr, unknown))}")
        return cls(**d)

    @classmethod
    def adaptive(cls, **changes: Any) -> WorkspaceConfiguration:
        """The profile of ``rustws.workspace(name)`` without a configuration: learning
        ``ADAPTIVE`` (every cycle informs the arena's size, which follows the largest need of the
        recent cycles, grows after a cycle that needed more and shrinks after outliers), spills
        ``REALLOCATE``, and ``helper_min_size`` 1 KiB (smaller requests are served by NumPy's own
        allocator, as fast as any arena for them); ``changes`` override any field."""
        base: dict[str, Any] = {
            "policy_learning": LearningPolicy.ADAPTIVE,
            "policy_spill": SpillPolicy.REALLOCATE,
            "helper_min_size": 1024,
        }
        return cls(**{**base, **changes})

    @classmethod
    def builder(cls) -> WorkspaceConfigurationBuilder:
        """A fluent builder: one chainable method per field, then ``.build()``."""
        return WorkspaceConfigurationBuilder()


class WorkspaceConfigurationBuilder:
    """``WorkspaceConfiguration.builder().initial_size("64MiB").policy_spill(SpillPolicy.REALLOCATE).build()``:
    one chainable method per field (each takes what the constructor takes), then ``build()``."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def _set(self, name: str, value: Any) -> WorkspaceConfigurationBuilder:
        self._values[name] = value
        return self

    def initial_size(self, value: Size) -> WorkspaceConfigurationBuilder:
        return self._set("initial_size", value)

    def min_size(self, value: Size) -> WorkspaceConfigurationBuilder:
        return self._set("min_size", value)

    def max_size(self, value: Size) -> WorkspaceConfigurationBuilder:
        return self._set("max_size", value)

    def overallocation_limit(self, value: float) -> WorkspaceConfigurationBuilder:
        return self._set("overallocation_limit", value)

    def cycles_before_initialization(self, value: int) -> WorkspaceConfigurationBuilder:
        return self._set("cycles_before_initialization", value)

    def policy_allocation(self, value: AllocationPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_allocation", value)

    def policy_learning(self, value: LearningPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_learning", value)

    def policy_spill(self, value: SpillPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_spill", value)

    def policy_reset(self, value: ResetPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_reset", value)

    def policy_mirroring(self, value: MirroringPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_mirroring", value)

    def policy_location(self, value: LocationPolicy | str) -> WorkspaceConfigurationBuilder:
        return self._set("policy_location", value)

    def temp_file_path(self, value: str | os.PathLike[str] | None) -> WorkspaceConfigurationBuilder:
        return self._set("temp_file_path", value)

    def temp_block_size(self, value: Size) -> WorkspaceConfigurationBuilder:
        return self._set("temp_block_size", value)

    def helper_min_size(self, value: Size) -> WorkspaceConfigurationBuilder:
        return self._set("helper_min_size", value)

    def helper_allow_fallback(self, value: bool) -> WorkspaceConfigurationBuilder:
        return self._set("helper_allow_fallback", value)

    def use_cycle_detector(self, value: bool) -> WorkspaceConfigurationBuilder:
        return self._set("use_cycle_detector", value)

    def debug_mode(self, value: DebugMode | str) -> WorkspaceConfigurationBuilder:
        return self._set("debug_mode", value)

    def build(self) -> WorkspaceConfiguration:
        return WorkspaceConfiguration(**self._values)


@dataclasses.dataclass(frozen=True)
class WorkspaceStats:
    """A snapshot of one workspace's memory, in bytes and counts.

    ``capacity_bytes == used_bytes + cached_bytes + overhead_bytes`` always holds: these four are
    the arena's. Outside it, ``external_bytes`` counts the live blocks; the blocks kept there for
    reuse after they died (at most a few cycles, bounded by the recent cycles' peak) are listed by
    ``rustws.memory.snapshot()`` (segments of kind ``external`` and ``huge``) and counted, with all
    else the workspace holds, in a refusal's ``footprint`` and ``cached``.
    """

    cycles: int
    capacity_bytes: int
    used_bytes: int
    peak_cycle_bytes: int
    cached_bytes: int
    external_bytes: int
    pinned_bytes: int
    overhead_bytes: int
    allocation_count: int
    spill_count: int
    failed_allocations: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
