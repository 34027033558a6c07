"""The switches behind each native path's set_enabled / switched / is_enabled."""

from __future__ import annotations

from typing import Any

import pytest

from splitphase.kernels import decode_stack, packed_linear, prefill_attention, skinny
from splitphase.kernels.switch import PhaseSwitches, Switch, switch_functions
from splitphase.model import compiled


def test_switched_restores_the_state_even_when_the_block_raises() -> None:
    s = Switch(on=False)
    with pytest.raises(RuntimeError), s.switched(True):
        assert s.on
        raise RuntimeError("inside")
    assert not s.on


def test_is_enabled_needs_the_switch_and_what_the_path_requires() -> None:
    needs = {"library": False}
    s = Switch()
    set_enabled, switched, is_enabled = switch_functions(
        s, requires=lambda: needs["library"], module=__name__,
        set_doc="set it.", switched_doc="scope it.", enabled_doc="read it.")
    assert not is_enabled()  # on, but what it requires is missing
    needs["library"] = True
    assert is_enabled()
    with switched(False):
        assert not is_enabled() and not s.on
    assert is_enabled()
    set_enabled(False)
    assert not is_enabled() and not s.on
    assert (set_enabled.__doc__, switched.__doc__, is_enabled.__doc__) == (
        "set it.", "scope it.", "read it.")
    assert is_enabled.__module__ == __name__ and is_enabled.__qualname__ == "is_enabled"


@pytest.mark.parametrize("module", [skinny, decode_stack, prefill_attention, packed_linear])
def test_each_module_exports_its_own_documented_trio(module: Any) -> None:
    for name in ("set_enabled", "switched", "is_enabled"):
        fn = getattr(module, name)
        assert fn.__module__ == module.__name__ and fn.__doc__
    before = module.is_enabled()
    with module.switched(False):
        assert not module.is_enabled()
    assert module.is_enabled() == before


def test_paths_built_on_the_skinny_kernels_are_off_with_them() -> None:
    with decode_stack.switched(True), prefill_attention.switched(True), skinny.switched(False):
        assert not decode_stack.is_enabled() and not prefill_attention.is_enabled()


def test_phase_switches_set_scope_and_check_names() -> None:
    s = PhaseSwitches("compile phases", {"prefill": False, "decode": True})
    assert s.names_on() == ["decode"]
    with s.switched(True, ["prefill"]):
        assert s.names_on() == ["prefill", "decode"]
    assert not s.is_on("prefill")
    s.set(False, ["prefill", "decode"])
    assert s.names_on() == []
    with pytest.raises(ValueError, match=r"compile phases are \('prefill', 'decode'\), got "
                                         r"\['training'\]"):
        s.set(True, ["training"])
    with pytest.raises(ValueError, match="got"):
        s.is_on("training")
    assert s.names_on() == []  # a bad name changed nothing


def test_compiled_phases_follow_their_switches() -> None:
    with compiled.switched(True, ["decode"]):
        assert compiled.enabled_phases()[-1:] == ["decode"] and compiled.is_enabled("decode")
    with compiled.switched(False):
        assert compiled.enabled_phases() == []
