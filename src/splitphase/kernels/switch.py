"""Process-wide on/off switches for the native and compiled paths (benchmarks measure each).

A module with one path exports the trio `set_enabled(on)`, `switched(on)` and `is_enabled()`
built by `switch_functions`; `model.compiled`, with one switch per phase, keeps its own
signatures over a `PhaseSwitches`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class Switch:
    """A process-wide on/off for one native path (benchmarks measure its effect)."""

    on: bool = True

    @contextlib.contextmanager
    def switched(self, on: bool) -> Iterator[None]:
        """On (or off) inside the block, as it was after it."""
        before, self.on = self.on, on
        try:
            yield
        finally:
            self.on = before


class SwitchFunctions(NamedTuple):
    """The public trio a module exports over its switch."""

    set_enabled: Callable[[bool], None]
    switched: Callable[[bool], contextlib.AbstractContextManager[None]]
    is_enabled: Callable[[], bool]


def switch_functions(switch: Switch, *, requires: Callable[[], bool], module: str,
                     set_doc: str, switched_doc: str, enabled_doc: str) -> SwitchFunctions:
    """`set_enabled`, `switched` and `is_enabled` over `switch` for `module` (its `__name__`),
    their docstrings saying what this switch controls.

    `is_enabled()` is the switch and `requires()`: what else the path needs at call time (its
    library loaded, the path it builds on enabled).
    """

    def set_enabled(on: bool) -> None:
        switch.on = on

    def switched(on: bool) -> contextlib.AbstractContextManager[None]:
        return switch.switched(on)

    def is_enabled() -> bool:
        return switch.on and requires()

    for fn, doc in ((set_enabled, set_doc), (switched, switched_doc), (is_enabled, enabled_doc)):
        # As if defined there: help(module) lists them, reprs name the module.
        fn.__doc__, fn.__module__, fn.__qualname__ = doc, module, fn.__name__
    return SwitchFunctions(set_enabled, switched, is_enabled)


class PhaseSwitches:
    """One `Switch` per name (a model's phases), set or scoped several at a time."""

    def __init__(self, kind: str, on: dict[str, bool]) -> None:
        self.kind = kind  # what the names are, for the error: "compile phases"
        self._switches = {name: Switch(on=value) for name, value in on.items()}

    def checked(self, names: Iterable[str]) -> list[str]:
        """`names` as a list; ValueError naming the allowed ones if any is unknown."""
        out = list(names)
        bad = [n for n in out if n not in self._switches]
        if bad:
            raise ValueError(f"{self.kind} are {tuple(self._switches)}, got {bad}")
        return out

    def set(self, on: bool, names: Iterable[str]) -> None:
        """Turn these on (or off)."""
        for name in self.checked(names):
            self._switches[name].on = on

    @contextlib.contextmanager
    def switched(self, on: bool, names: Iterable[str]) -> Iterator[None]:
        """These on (or off) inside the block, each as it was after it."""
        with contextlib.ExitStack() as stack:
            for name in self.checked(names):
                stack.enter_context(self._switches[name].switched(on))
            yield

    def is_on(self, name: str) -> bool:
        """Whether this one is on (ValueError if it is unknown)."""
        return self._switches[self.checked([name])[0]].on

    def names_on(self) -> list[str]:
        """The names switched on, in the order given."""
        return [n for n, s in self._switches.items() if s.on]
