"""A fair queue: waiting work served in shares, not in arrival order.

Each item waits in a flow named by a path of keys, such as `(kind, client)`. At every level of
the path the next item comes from the flow that has received the least service so far, in
cost units (prompt tokens, bytes): start-time fair queueing (Goyal et al., 1996), with the tags
taken when an item leaves rather than when it arrives, so that the levels nest (kinds share
equally, then the clients within a kind). A flow that has waited for nothing starts at the
level's virtual time, the tag of the last item served: idleness earns no credit, and a flow
that took more than its share keeps its debt until the others catch up.

Why fair queueing rather than deficit round robin: costs vary by orders of magnitude (a 4-token
chat turn beside 128 inputs of 400 tokens), and a tag per flow serves a light flow's next item
at once whatever the quantum, with no round to wait for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Level(Generic[T]):
    def __init__(self) -> None:
        self.children: dict[Hashable, _Level[T]] = {}
        self.tags: dict[Hashable, float] = {}  # per child: the service it has received
        self.virtual = 0.0
        self.items: deque[tuple[T, float]] = deque()  # at the last level only
        self.waiting = 0


class FairQueue(Generic[T]):
    def __init__(self, depth: int) -> None:
        """`depth`: the number of keys in every path."""
        self.depth = depth
        self._root: _Level[T] = _Level()

    def __len__(self) -> int:
        return self._root.waiting

    def push(self, path: tuple[Hashable, ...], item: T, cost: float) -> None:
        if len(path) != self.depth:
            raise ValueError(f"a path of {self.depth} keys, got {path!r}")
        level = self._root
        for key in path:
            child = level.children.get(key)
            if child is None:
                child = level.children[key] = _Level()
            if not child.waiting:  # back from idle: no credit for the time it waited for nothing
                level.tags[key] = max(level.tags.get(key, 0.0), level.virtual)
            level.waiting += 1
            level = child
        level.waiting += 1
        level.items.append((item, max(float(cost), 0.0)))

    def pop(self) -> T:
        """The next item by fair shares; IndexError when nothing waits."""
        if not self._root.waiting:
            raise IndexError("pop from an empty FairQueue")
        trail: list[tuple[_Level[T], Hashable]] = []
        level = self._root
        while level.children:
            waiting = [k for k, child in level.children.items() if child.waiting]
            key = min(waiting, key=level.tags.__getitem__)
            level.virtual = max(level.virtual, level.tags[key])
            trail.append((level, key))
            level = level.children[key]
        item, cost = level.items.popleft()
        level.waiting -= 1
        for parent, key in trail:
            parent.waiting -= 1
            parent.tags[key] += cost
            _forget_idle(parent)
        return item

    def remove(self, path: tuple[Hashable, ...], item: T) -> bool:
        """Takes a waiting item out (its client left) without charging its flow."""
        trail: list[tuple[_Level[T], Hashable]] = []
        level = self._root
        for key in path:
            child = level.children.get(key)
            if child is None:
                return False
            trail.append((level, key))
            level = child
        for index, (waiting, _cost) in enumerate(level.items):
            if waiting is item:
                del level.items[index]
                break
        else:
            return False
        level.waiting -= 1
        for parent, _key in trail:
            parent.waiting -= 1
            _forget_idle(parent)
        return True


def _forget_idle(level: _Level) -> None:
    """Drops idle flows that owe nothing (they would come back at the virtual time anyway), so
    the queue holds only as many flows as are waiting or in debt."""
    for key in [k for k, c in level.children.items() if not c.waiting]:
        if level.tags[key] <= level.virtual:
            del level.children[key], level.tags[key]
