"""A small name -> object registry, the one extension mechanism of omni_rl.

Rewards, model families, optimizers and recipes all register here under a name; a
duplicate name is an error at import time and an unknown name is an error that lists
the known ones and the closest match.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from omni_rl.errors import OmniRLError

T = TypeVar("T")


def closest(name: str, candidates: list[str] | tuple[str, ...]) -> str | None:
    """The candidate most similar to ``name``, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean X?)' suffix for error messages, or '' when nothing is close."""
    match = closest(name, candidates)
    return f" (did you mean '{match}'?)" if match else ""


class Registry(Generic[T]):
    """Maps names (and aliases) to registered objects of one kind."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator registering an object under ``name`` and its ``aliases``."""

        def decorate(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._items or key in self._aliases:
                    raise ValueError(f"duplicate {self.kind} name '{key}'")
            self._items[name] = obj
            for alias in aliases:
                self._aliases[alias] = name
            return obj

        return decorate

    def canonical(self, name: str) -> str:
        """The registered name behind ``name`` (itself or an alias); raises if unknown."""
        if name in self._items:
            return name
        if name in self._aliases:
            return self._aliases[name]
        known = ", ".join(sorted(self._items))
        raise OmniRLError(f"unknown {self.kind} '{name}'{did_you_mean(name, self.names())}; known: {known}")

    def get(self, name: str) -> T:
        """The object registered under ``name`` or one of its aliases."""
        return self._items[self.canonical(name)]

    def names(self) -> list[str]:
        """Every name and alias, sorted."""
        return sorted([*self._items, *self._aliases])

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
