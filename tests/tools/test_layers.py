"""LayerWorkspaceMgr: the builder, allocation by ArrayType, moving arrays, validation paths."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import rustws
from rustws import ArrayType, LayerWorkspaceMgr, WorkspaceConfiguration, WorkspaceError

CFG = WorkspaceConfiguration(initial_size="1MiB")


def mgr():
    return (
        LayerWorkspaceMgr.builder()
        .with_(ArrayType.ACTIVATIONS, "ACT", CFG)
        .with_(ArrayType.FF_WORKING_MEM, "WORK", CFG)
        .with_(ArrayType.ACTIVATION_GRAD, "GRAD", CFG)
        .no_workspace_for(ArrayType.INPUT)
        .default_no_workspace()
        .build()
    )


def test_builder_requires_every_type_or_a_default():
    with pytest.raises(ValueError, match="INPUT"):
        LayerWorkspaceMgr.builder().with_(ArrayType.ACTIVATIONS, "A", CFG).build()
    m = LayerWorkspaceMgr.builder().default_workspace("ALL", CFG).build()
    assert all(m.workspace_name(t) == "ALL" for t in ArrayType)
    assert all(LayerWorkspaceMgr.no_workspaces().is_scoped_out(t) for t in ArrayType)
    with pytest.raises(ValueError, match="ArrayType"):
        LayerWorkspaceMgr.builder().with_("NOT_A_TYPE_AT_ALL", "A", CFG)
    with pytest.raises(TypeError):
        LayerWorkspaceMgr.builder().with_(5, "A", CFG)
    # An empty name is a bad value, as for rustws.workspace(""); a name that is no str, a bad type.
    with pytest.raises(ValueError, match="must not be empty"):
        LayerWorkspaceMgr.builder().with_(ArrayType.INPUT, "", CFG)
    with pytest.raises(TypeError, match="must be a str"):
        LayerWorkspaceMgr.builder().with_(ArrayType.INPUT, 7, CFG)
    with pytest.raises(TypeError):
        LayerWorkspaceMgr.builder().with_(ArrayType.INPUT, "A", config=5)


def test_create_and_zeros_go_to_the_types_workspace():
    m = mgr()
    with m.notify_scope_entered(ArrayType.ACTIVATIONS) as act:
        a = m.create(ArrayType.ACTIVATIONS, (4, 5), np.float32)
        z = m.zeros(ArrayType.ACTIVATIONS, 7)
        plain = m.create(ArrayType.INPUT, 3)
    assert rustws.owner(a) is act and rustws.owner(z) is act and not z.any()
    assert a.dtype == np.float32 and a.shape == (4, 5)
    assert rustws.owner(plain) is None
    assert act.name == "ACT"


def test_creating_for_a_type_whose_workspace_is_not_open_names_it():
    m = mgr()
    with pytest.raises(WorkspaceError, match=r"ACTIVATIONS.*'ACT'.*not open"):
        m.create(ArrayType.ACTIVATIONS, 3)
    with pytest.raises(WorkspaceError, match="WORK"):
        m.dup(ArrayType.FF_WORKING_MEM, np.ones(3))


def test_dup_and_leverage_to_move_arrays_between_workspaces():
    m = mgr()
    with (
        m.notify_scope_entered(ArrayType.ACTIVATIONS) as act,
        m.notify_scope_entered(ArrayType.FF_WORKING_MEM) as work,
    ):
        w = m.create(ArrayType.FF_WORKING_MEM, 4)
        w[:] = [1, 2, 3, 4]
        assert rustws.owner(w) is work
        up = m.leverage_to(ArrayType.ACTIVATIONS, w)
        assert rustws.owner(up) is act
        np.testing.assert_array_equal(up, [1, 2, 3, 4])
        assert m.leverage_to(ArrayType.ACTIVATIONS, up) is up  # already there
        d = m.dup(ArrayType.ACTIVATIONS, up)
        assert d is not up and rustws.owner(d) is act
        out = m.leverage_to(ArrayType.INPUT, w)  # no workspace: a detached copy
        assert rustws.owner(out) is None
    np.testing.assert_array_equal(up, [1, 2, 3, 4])


def test_validate_array_location():
    m = mgr()
    with m.notify_scope_entered(ArrayType.ACTIVATIONS), m.notify_scope_entered(ArrayType.FF_WORKING_MEM):
        wrong = m.create(ArrayType.FF_WORKING_MEM, 3)
        with pytest.raises(WorkspaceError) as info:
            m.validate_array_location(ArrayType.ACTIVATIONS, wrong)
        assert "'WORK'" in str(info.value) and "'ACT'" in str(info.value)
        fixed = m.validate_array_location(ArrayType.ACTIVATIONS, wrong, migrate_if_invalid=True)
        assert rustws.owner(fixed).name == "ACT"
        right = m.create(ArrayType.ACTIVATIONS, 3)
        assert m.validate_array_location(ArrayType.ACTIVATIONS, right) is right
        detached = rustws.detach(np.ones(3))
        assert m.validate_array_location(ArrayType.ACTIVATIONS, detached) is detached
        with pytest.raises(WorkspaceError, match="detached"):
            m.validate_array_location(ArrayType.ACTIVATIONS, detached, exception_if_detached=True)
        with pytest.raises(WorkspaceError, match="no workspace"):
            m.validate_array_location(ArrayType.INPUT, right)
        moved = m.validate_array_location(ArrayType.INPUT, right, migrate_if_invalid=True)
        assert rustws.owner(moved) is None


def test_scope_for_a_type_without_workspace_is_out_of_workspaces():
    m = mgr()
    outer = rustws.workspace("OUTER", CFG)
    with outer:
        with m.notify_scope_entered(ArrayType.INPUT) as ws:
            assert ws is None and rustws.current_workspace() is None
            plain = np.ones(5) * 2
        assert rustws.owner(plain) is None


def test_borrowed_scope_and_helper_workspace():
    m = mgr()
    with m.notify_scope_borrowed(ArrayType.ACTIVATIONS) as act:
        assert rustws.current_workspace() is act and not act.is_open
    buf = np.zeros(16)
    m.set_helper_workspace("conv", buf)
    assert m.get_helper_workspace("conv") is buf
    assert m.get_helper_workspace("other") is None
    m.set_helper_workspace("conv", None)
    assert m.get_helper_workspace("conv") is None
    with pytest.raises(TypeError):
        m.set_helper_workspace(3, buf)


def test_stats_count_live_bytes_per_type():
    m = mgr()
    with m.notify_scope_entered(ArrayType.ACTIVATIONS), m.notify_scope_entered(ArrayType.ACTIVATION_GRAD):
        a = m.create(ArrayType.ACTIVATIONS, 100, np.float64)
        g = m.zeros(ArrayType.ACTIVATION_GRAD, 50, np.float32)
        s = m.stats()
        assert s[ArrayType.ACTIVATIONS] == 800 and s[ArrayType.ACTIVATION_GRAD] == 200
        assert s[ArrayType.INPUT] == 0
        del a, g
        gc.collect()
    assert m.stats()[ArrayType.ACTIVATIONS] == 0
    assert m.peak_stats()[ArrayType.ACTIVATIONS] == 800


def test_workspace_mode_selects_a_manager():
    enabled = LayerWorkspaceMgr.for_mode(rustws.WorkspaceMode.SEPARATE, CFG)  # deprecated alias of ENABLED
    assert enabled.workspace_name(ArrayType.ACTIVATIONS) == "LAYER_ACTIVATIONS"
    assert enabled.is_scoped_out(ArrayType.INPUT)
    none = LayerWorkspaceMgr.for_mode("NONE")
    assert all(none.is_scoped_out(t) for t in ArrayType)
    with pytest.raises(ValueError, match="mode"):
        LayerWorkspaceMgr.for_mode("SOMETIMES")
