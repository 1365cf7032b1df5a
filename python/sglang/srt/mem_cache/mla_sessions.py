"""Sessions a client has closed: what only they used goes first.

A prefix tree cannot tell a conversation that goes on from one that has ended: a session's
newest turn is a one-hit leaf either way, and on Mooncake's conversation trace only 26 %
of first turns and 33 % of later ones are ever continued (docs/advanced_features/
mla_aware_eviction.md, "Sessions the client closed"). The client knows. SGLang lets a request carry a
session id (``GenerateReqInput.session_id``, the OpenAI endpoints' ``session_id``; the
tree gets it as ``InsertParams.session_id``) and a client end a session
(``/close_session``; a session opened with a timeout is reaped when idle that long).

:class:`SessionBook` keeps what the policy needs of that:

* **Tags.** When a request of session ``s`` inserts, the nodes from the insert's last node
  up that no other session uses are tagged ``s``: the walk stops at the first node tagged
  already (by ``s``, with its ancestors, at an earlier insert; or by another session) or
  with a child not tagged ``s`` (a prefix another request branched from). The upper half
  of a split is a new, untagged node: it is tagged when the split was the session's own
  next turn branching off its last one, and stays untagged when another session
  branched there.
* **Closes.** ``close(s)`` marks each node tagged ``s`` with its ``hit_count``; it is
  *closed* while no request counts another hit on it: only a closed session used it. A
  request of another session reusing it makes it live again, and closed is never a
  state a node goes back to. Hits, not ``last_access_time``: an insert that branches off
  a node touches it, but counts its hit on the new upper half of the split. A request of
  ``s`` that finishes after the close (it ran while the client closed the session) marks
  the nodes it adds as well: a close is final.

``mla_aware`` evicts closed leaves before every other leaf, oldest first
(:meth:`MLAAwareStrategy.get_priority`), and learns nothing from closed victims that come
back. A close changes the class of a session's leaves without an access, so the book tells
its listeners (:mod:`mla_leaf_index`) of each of the session's nodes still alive.

The tree calls :func:`note_insert` after each insert and :func:`close` when a session
ends; the plugin wraps ``insert`` and ``release_radix_session`` of both trees and
``SessionController.close`` through SGLang's ``HookRegistry`` (:func:`register_hooks`);
the upstream patch calls both in place. The book keeps weak references to an open
session's nodes (a closed one's are marked) and at most ``MAX_SESSIONS`` sessions, the
least recently tagged or closed forgotten first: an open one with its tags, a closed one
leaving its nodes closed.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

SESSION = "_mla_session"  # node attribute: the session that alone uses the node
CLOSED_HITS = "_mla_closed_hits"  # node attribute: its hit_count when its session closed


class _Session:
    """What a :class:`SessionBook` keeps of one session."""

    __slots__ = ("refs", "prune_at", "closed")

    def __init__(self):
        self.refs: list = []  # weak refs to its tagged nodes, while it is open
        self.prune_at = 16  # dead refs are dropped when the list grows to this
        self.closed = False

    def nodes(self) -> list:
        """The session's tagged nodes still alive."""
        return [n for n in (ref() for ref in self.refs) if n is not None]

    def add(self, node: Any) -> None:
        self.refs.append(weakref.ref(node))
        if len(self.refs) >= self.prune_at:
            self.refs = [ref for ref in self.refs if ref() is not None]
            self.prune_at = 2 * len(self.refs) + 16


def closed(node: Any) -> bool:
    """Whether ``node`` was used only by a session that has closed since: its session
    closed and no request has counted a hit on it since (a split by another request's
    insert touches the node but counts its hit on the new upper half)."""
    hits = node.__dict__.get(CLOSED_HITS)
    return hits is not None and node.hit_count <= hits


class SessionBook:
    """Session tags of a tree's nodes, and the hit counts of closed sessions' nodes."""

    MAX_SESSIONS = 1 << 16

    def __init__(self):
        self._sessions: OrderedDict = OrderedDict()  # id -> _Session, least recent first
        self.listeners: list = []  # callables told of the nodes whose closed state changed

    def tag(self, leaf: Any, session: str) -> None:
        """A request of ``session`` inserted up to ``leaf``: tag the nodes only it uses.

        A request that finishes after its session closed (it ran while the client closed
        it) leaves its nodes closed as well.
        """
        entry = self._entry(session)
        node, tagged = leaf, []
        while node.parent is not None:
            attrs = node.__dict__
            if SESSION in attrs:
                break  # tagged with its ancestors by an earlier insert, or another's
            for child in node.children.values():
                if child.__dict__.get(SESSION) != session:
                    break  # another request branched here
            else:
                attrs[SESSION] = session
                tagged.append(node)
                node = node.parent
                continue
            break
        if entry.closed:
            self._tell(_mark_closed(tagged))
        else:
            for node in tagged:
                entry.add(node)

    def close(self, session: str) -> None:
        """``session`` has ended: its nodes are closed until a request counts a hit on
        them. Final: a later request of it leaves its nodes closed too."""
        entry = self._entry(session)
        entry.closed = True
        nodes = entry.nodes()
        entry.refs = []  # marked: nothing more to do for them
        self._tell(_mark_closed(nodes))

    def inherit(self, upper: Any, lower: Any) -> None:
        """``upper`` was split off ``lower`` to evict ``lower`` alone: it keeps the tag
        and the hit count at the close."""
        session = lower.__dict__.get(SESSION)
        if session is None:
            return
        setattr(upper, SESSION, session)
        hits = lower.__dict__.get(CLOSED_HITS)
        if hits is not None:
            setattr(upper, CLOSED_HITS, hits)
        entry = self._sessions.get(session)
        if entry is not None and not entry.closed:
            entry.add(upper)

    def _entry(self, session: str) -> _Session:
        """``session``'s entry, now the most recent; the least recent is forgotten past
        ``MAX_SESSIONS``: an open one's tags go (its nodes are then no session's), a
        closed one's nodes stay closed."""
        sessions = self._sessions
        entry = sessions.get(session)
        if entry is not None:
            sessions.move_to_end(session)
            return entry
        if len(sessions) >= self.MAX_SESSIONS:
            _, oldest = sessions.popitem(last=False)
            nodes = oldest.nodes()
            for node in nodes:  # open: none is closed, no score changes
                node.__dict__.pop(SESSION, None)
        entry = sessions[session] = _Session()
        return entry

    def _tell(self, nodes: list) -> None:
        if nodes:
            for listener in self.listeners:
                listener(nodes)


def _mark_closed(nodes: list) -> list:
    """Mark each node not marked yet with its hit count; those nodes."""
    marked = []
    for node in nodes:
        if CLOSED_HITS not in node.__dict__:
            setattr(node, CLOSED_HITS, node.hit_count)
            marked.append(node)
    return marked


def book_of(cache: Any) -> Optional[SessionBook]:
    """The session book of ``cache``'s eviction strategy (``None`` where it keeps none)."""
    owner = getattr(cache, "tree_core", cache)
    return getattr(getattr(owner, "eviction_strategy", None), "sessions", None)


def note_insert(cache: Any, params: Any, result: Any) -> None:
    """After ``cache.insert(params)`` returned ``result``: tag for ``params.session_id``."""
    session = getattr(params, "session_id", None)
    if session is None or result is None or result.last_device_node is None:
        return
    book = book_of(cache)
    if book is None:
        return
    node = result.last_device_node
    core = getattr(cache, "tree_core", None)
    if core is not None and not hasattr(node, "parent"):
        node = core.node_by_id(node)  # the unified tree hands out node ids
    book.tag(node, session)


def close(cache: Any, session: Optional[str]) -> None:
    """``session`` has ended (a close, or a timeout reaped it)."""
    book = book_of(cache)
    if book is not None and session is not None:
        book.close(session)


def _around_insert(original: Callable, cache: Any, params: Any, *args: Any, **kwargs: Any):
    result = original(cache, params, *args, **kwargs)
    note_insert(cache, params, result)
    return result


def _after_release(result: Any, cache: Any, session_id: str, *args: Any, **kwargs: Any):
    close(cache, session_id)
    return result


def _before_controller_close(controller: Any, recv_req: Any, *args: Any, **kwargs: Any):
    close(controller.tree_cache, getattr(recv_req, "session_id", None))


_MEM = "sglang.srt.mem_cache."
# SGLang method -> (hook, kind). A close request reaches the session controller (every
# close but a radix session's unknown to it), a close or timeout of a session it holds
# reaches the tree as release_radix_session, and so does a radix session's close. Closing
# twice changes nothing.
HOOKS = {
    _MEM + "radix_cache.RadixCache.insert": (_around_insert, "AROUND"),
    _MEM + "unified_radix_cache.UnifiedRadixCache.insert": (_around_insert, "AROUND"),
    _MEM + "base_prefix_cache.BasePrefixCache.release_radix_session": (_after_release, "AFTER"),
    _MEM + "unified_radix_cache.UnifiedRadixCache.release_radix_session": (
        _after_release, "AFTER"),
    "sglang.srt.session.session_controller.SessionController.close": (
        _before_controller_close, "BEFORE"),
}


def register_hooks() -> None:
    """Register the hooks with SGLang's ``HookRegistry`` (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (hook, kind) in HOOKS.items():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType[kind])
