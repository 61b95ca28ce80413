"""A tiny name -> class registry: adding a variant is one class plus one decorator."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.what} {name!r} registered twice")
            self._items[name] = item
            return item
        return add

    def get(self, name: str) -> T:
        from archlab.config import ConfigError

        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.what} {name!r}; known: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return list(self._items)
