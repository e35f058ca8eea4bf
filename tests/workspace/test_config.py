"""WorkspaceConfiguration: sizes, policies, immutability, the builder and every validation rule."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import rustws
from rustws import (
    AllocationPolicy,
    DebugMode,
    LearningPolicy,
    LocationPolicy,
    MirroringPolicy,
    ResetPolicy,
    SpillPolicy,
    WorkspaceConfiguration,
    WorkspaceMode,
)


def test_defaults_match_the_contract():
    c = WorkspaceConfiguration()
    assert (c.initial_size, c.min_size, c.max_size) == (0, 0, 0)
    assert c.overallocation_limit == 0.3
    assert c.cycles_before_initialization == 0
    assert c.policy_allocation is AllocationPolicy.OVERALLOCATE
    assert c.policy_learning is LearningPolicy.FIRST_LOOP
    assert c.policy_spill is SpillPolicy.EXTERNAL
    assert c.policy_reset is ResetPolicy.BLOCK_LEFT
    assert c.policy_mirroring is MirroringPolicy.FULL
    assert c.policy_location is LocationPolicy.RAM
    assert c.temp_file_path is None
    assert (c.temp_block_size, c.helper_min_size) == (0, 0)
    assert c.helper_allow_fallback is True
    assert c.use_cycle_detector is False
    assert c.debug_mode is DebugMode.DISABLED


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512KiB", 512 * 1024),
        ("64MiB", 64 << 20),
        ("1GB", 10**9),
        ("1.5GiB", 3 << 29),
        ("4096", 4096),
        ("2 kB", 2000),
    ],
)
def test_sizes_accept_units(text, expected):
    assert WorkspaceConfiguration(initial_size=text).initial_size == expected


def test_enum_aliases_are_the_same_member():
    assert LearningPolicy.OPTIMIZED is LearningPolicy.FIRST_LOOP
    assert LearningPolicy.TRAINING is LearningPolicy.OVER_TIME
    assert MirroringPolicy.ENABLED is MirroringPolicy.FULL
    assert WorkspaceMode.SINGLE is WorkspaceMode.ENABLED
    assert WorkspaceMode.SEPARATE is WorkspaceMode.ENABLED
    assert [m.name for m in WorkspaceMode] == ["ENABLED", "NONE"]
    assert [m.name for m in ResetPolicy] == ["BLOCK_LEFT", "ENDOFBUFFER_REACHED"]
    assert [m.name for m in DebugMode] == ["DISABLED", "SPILL_EVERYTHING", "BYPASS_EVERYTHING"]
    assert (
        WorkspaceConfiguration(policy_learning=LearningPolicy.TRAINING).policy_learning
        is LearningPolicy.OVER_TIME
    )


def test_policies_accept_their_names():
    c = WorkspaceConfiguration(policy_spill="reallocate", policy_learning="OPTIMIZED")
    assert c.policy_spill is SpillPolicy.REALLOCATE
    assert c.policy_learning is LearningPolicy.FIRST_LOOP


def test_immutable_hashable_equal_by_value():
    a = WorkspaceConfiguration(initial_size="1MiB", policy_spill=SpillPolicy.FAIL)
    b = WorkspaceConfiguration(initial_size=1 << 20, policy_spill="FAIL")
    assert a == b and hash(a) == hash(b)
    assert a != WorkspaceConfiguration()
    assert len({a, b, WorkspaceConfiguration()}) == 2
    with pytest.raises(AttributeError):
        a.initial_size = 5  # type: ignore[misc]


def test_repr_is_readable_and_shows_what_differs():
    r = repr(WorkspaceConfiguration(initial_size="64MiB", policy_spill=SpillPolicy.REALLOCATE))
    assert r == "WorkspaceConfiguration(initial_size=67108864, policy_spill=SpillPolicy.REALLOCATE)"
    assert repr(WorkspaceConfiguration()) == "WorkspaceConfiguration()"


def test_replace_and_dict_round_trip():
    a = WorkspaceConfiguration(initial_size="1MiB", policy_reset=ResetPolicy.ENDOFBUFFER_REACHED)
    b = a.replace(max_size="8MiB")
    assert b.max_size == 8 << 20 and b.initial_size == 1 << 20 and a.max_size == 0
    d = b.to_dict()
    assert d["policy_reset"] == "ENDOFBUFFER_REACHED" and d["max_size"] == 8 << 20
    assert WorkspaceConfiguration.from_dict(d) == b
    with pytest.raises(TypeError, match="bogus"):
        WorkspaceConfiguration.from_dict({"bogus": 1})
    with pytest.raises(TypeError):
        WorkspaceConfiguration.from_dict([("initial_size", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_size"):
        a.replace(max_size=10)


def test_builder_has_one_chainable_method_per_field():
    c = (
        WorkspaceConfiguration.builder()
        .initial_size("64MiB")
        .policy_spill(SpillPolicy.REALLOCATE)
        .policy_learning(LearningPolicy.OVER_TIME)
        .cycles_before_initialization(3)
        .use_cycle_detector(True)
        .build()
    )
    assert c == WorkspaceConfiguration(
        initial_size=64 << 20,
        policy_spill=SpillPolicy.REALLOCATE,
        policy_learning=LearningPolicy.OVER_TIME,
        cycles_before_initialization=3,
        use_cycle_detector=True,
    )
    b = WorkspaceConfiguration.builder()
    for f in WorkspaceConfiguration.__dataclass_fields__:
        assert callable(getattr(b, f))
    with pytest.raises(AttributeError, match="initial_sise"):
        b.initial_sise(5)
    with pytest.raises(ValueError, match="min_size"):
        WorkspaceConfiguration.builder().min_size(-1).build()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial_size": -1}, "initial_size"),
        ({"min_size": -5}, "min_size"),
        ({"max_size": float("nan")}, "max_size"),
        ({"initial_size": math.inf}, "initial_size"),
        ({"initial_size": 1.5}, "initial_size"),
        ({"helper_min_size": -1}, "helper_min_size"),
        ({"temp_block_size": "-3MiB"}, "temp_block_size"),
        ({"temp_block_size": 100}, "temp_block_size"),
        ({"temp_block_size": "1kB"}, "temp_block_size"),
        ({"temp_block_size": (1 << 20) + 1}, "temp_block_size"),
        ({"initial_size": "12 parsecs"}, "initial_size"),
        ({"initial_size": "1000000 TiB"}, "initial_size"),
        ({"initial_size": 1 << 60}, "initial_size"),
        ({"overallocation_limit": float("nan")}, "overallocation_limit"),
        ({"overallocation_limit": -0.1}, "overallocation_limit"),
        ({"cycles_before_initialization": -1}, "cycles_before_initialization"),
        ({"initial_size": "2MiB", "max_size": "1MiB"}, "max_size"),
        ({"min_size": "2MiB", "max_size": "1MiB"}, "max_size"),
        ({"policy_spill": "SIDEWAYS"}, "policy_spill"),
        (
            {"policy_location": LocationPolicy.MMAP, "initial_size": "1MiB", "policy_learning": "NONE"},
            "temp_file_path",
        ),
        (
            {"policy_location": "MMAP", "initial_size": "1MiB", "temp_file_path": "/tmp"},
            "policy_learning",
        ),
        ({"policy_location": "MMAP", "policy_learning": "NONE", "temp_file_path": "/tmp"}, "initial_size"),
        (
            {
                "policy_location": "MMAP",
                "policy_learning": "NONE",
                "initial_size": "1MiB",
                "temp_file_path": "/no/such/dir/file",
            },
            "temp_file_path",
        ),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorkspaceConfiguration(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial_size": [1]}, "initial_size"),
        ({"initial_size": True}, "initial_size"),
        ({"overallocation_limit": "0.3"}, "overallocation_limit"),
        ({"overallocation_limit": True}, "overallocation_limit"),
        ({"cycles_before_initialization": 1.0}, "cycles_before_initialization"),
        ({"cycles_before_initialization": np.True_}, "cycles_before_initialization"),
        ({"overallocation_limit": np.bool_(False)}, "overallocation_limit"),
        ({"policy_spill": 3}, "policy_spill"),
        ({"policy_spill": ResetPolicy.BLOCK_LEFT}, "policy_spill"),
        ({"helper_allow_fallback": 1}, "helper_allow_fallback"),
        ({"use_cycle_detector": "yes"}, "use_cycle_detector"),
        ({"temp_file_path": 5}, "temp_file_path"),
    ],
)
def test_wrong_types_raise_type_error_naming_the_field(kwargs, field):
    with pytest.raises(TypeError, match=field):
        WorkspaceConfiguration(**kwargs)


@pytest.mark.parametrize("n", [2**31, 2**63, 2**64, 2**200])
def test_a_count_too_large_says_the_most_it_may_be(n):
    with pytest.raises(ValueError, match=f"cycles_before_initialization: must be at most 1000000, got {n}$"):
        WorkspaceConfiguration(cycles_before_initialization=n)


def test_numpy_scalars_are_numbers_as_python_ints_and_floats_are():
    c = WorkspaceConfiguration(
        cycles_before_initialization=np.int64(3),
        overallocation_limit=np.float32(0.5),
        initial_size=np.uint32(4096),
    )
    assert (c.cycles_before_initialization, c.overallocation_limit, c.initial_size) == (3, 0.5, 4096)
    assert type(c.cycles_before_initialization) is int and type(c.overallocation_limit) is float
    same = WorkspaceConfiguration(cycles_before_initialization=3, overallocation_limit=0.5, initial_size=4096)
    assert c == same


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        WorkspaceConfiguration(1024)  # type: ignore[misc]


def test_mmap_with_a_usable_path(tmp_path):
    c = WorkspaceConfiguration(
        policy_location=LocationPolicy.MMAP,
        policy_learning="NONE",
        initial_size="1MiB",
        temp_file_path=tmp_path,
    )
    assert c.temp_file_path == os.fspath(tmp_path)


def test_core_parse_size_matches():
    assert rustws._rustws.parse_size("3MiB") == 3 << 20
    with pytest.raises(ValueError):
        rustws._rustws.parse_size("")


def test_the_builder_has_a_typed_method_per_field():
    import dataclasses
    import typing

    fields = {f.name for f in dataclasses.fields(WorkspaceConfiguration)}
    builder = WorkspaceConfiguration.builder()
    for name in fields:
        method = getattr(type(builder), name)  # a real method, not a __getattr__ fallback
        hints = typing.get_type_hints(method, vars(rustws._config))
        assert hints["return"] is rustws.WorkspaceConfigurationBuilder
    with pytest.raises(AttributeError):
        builder.no_such_field  # noqa: B018
    cfg = builder.initial_size("1MiB").policy_spill("REALLOCATE").temp_file_path(None).build()
    assert cfg.initial_size == 1 << 20 and cfg.policy_spill is rustws.SpillPolicy.REALLOCATE
