"""A group's lifecycles: forward (``GroupState``), backward (``Reload``) and the manual
caller's (``ManualPhase``), each moved only by the group's own checked transitions."""

from __future__ import annotations

import pytest

from offload.activations._group import Group, GroupState, ManualPhase, Reload


def _group(copies: bool = True) -> Group:
    g = Group(0, None, True, None)
    if copies:
        g.copies[1] = object()  # type: ignore[assignment]
    return g


def test_forward_closes_once_and_releases_once() -> None:
    g = _group()
    assert g.state is GroupState.OPEN and not g.closed
    g.close()
    assert g.closed and not g.released
    with pytest.raises(RuntimeError, match="cannot close in state CLOSED"):
        g.close()
    assert g.release() and g.released
    assert not g.release()  # released already: nothing to do
    with pytest.raises(RuntimeError, match="cannot close in state RELEASED"):
        g.close()


def test_release_while_open_and_abort() -> None:
    g = _group()
    assert g.release() and g.closed  # the end of the forward releases an open group
    h = _group()
    h.abort()
    assert h.released and not h.device_refs


def test_backward_reload_drop_and_a_retained_graph() -> None:
    g = _group()
    assert g.backward is Reload.NONE and not g.reloaded and not g.dropped
    g.reloaded_now()
    assert g.backward is Reload.HELD and g.reloaded and not g.dropped
    assert g.drop() == (True, True)  # buffers given up, its first backward ended
    assert g.backward is Reload.DROPPED and g.dropped and not g.reloaded
    assert g.drop() == (False, False)
    g.reloaded_now()  # a retained graph's second backward
    assert g.backward is Reload.HELD_AGAIN and g.reloaded and g.dropped
    assert g.drop() == (True, False)
    assert g.backward is Reload.DROPPED


def test_drop_without_reload() -> None:
    g = _group()
    assert g.drop() == (False, True) and g.dropped
    empty = _group(copies=False)
    assert empty.drop() == (False, False) and empty.backward is Reload.NONE


def test_manual_phases_in_their_only_order() -> None:
    g = _group()
    assert g.phase is ManualPhase.SAVED and g.phase.value == "saved"
    with pytest.raises(RuntimeError, match="cannot release in manual state 'saved'"):
        g.manual("release")
    for call, after in (
        ("start", "offload_started"),
        ("release", "released"),
        ("reload", "reload_started"),
    ):
        g.manual(call)
        assert g.phase.value == after
    with pytest.raises(RuntimeError, match="needs 'saved'"):
        g.manual("start")
