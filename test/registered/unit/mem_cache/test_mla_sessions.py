"""Sessions a client closed go first under mla_aware, on SGLang's real prefix caches.

Each test builds a real tree over a real CPU allocator, with SGLang's ``HookRegistry``
applying the hooks of ``mla_sessions`` (insert, release_radix_session, the session
controller's close) as a server does after loading the plugin. Requests carry their
session in ``InsertParams.session_id``, as ``cache_finished_req`` passes ``req.session_id``.
That the leaf index takes the same victims as the stock heap with sessions closing at
random is tested with the accounting invariants (``test_mla_eviction_invariants.py``).
"""

import unittest
from array import array
from unittest import mock

import torch

from sglang.srt.mem_cache import mla_sessions
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.mla_sessions import SESSION, SessionBook
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

POOL = 256
SYSTEM = list(range(1000, 1016))  # a prompt prefix the sessions share


def setUpModule():
    register()
    HookRegistry.apply_hooks()


def build(kind="unified", policy="mla_aware", **config):
    allocator = TokenToKVPoolAllocator(POOL, torch.bfloat16, "cpu", kvcache=None, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        eviction_policy=policy,
        eviction_policy_config={"model": "deepseek-v3", **config} if policy == "mla_aware" else None,
        tree_core_backend="python",
    )
    if kind == "radix":
        return RadixCache(params)
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


def insert(cache, tokens, session=None, inserted=0):
    """Cache ``tokens`` as a request of ``session`` would, its first ``inserted`` tokens
    inserted (and their hits counted) at an earlier checkpoint."""
    key = RadixKey(array("q", tokens))
    m = cache.match_prefix(MatchPrefixParams(key=key))
    prefix = m.device_prefix_len
    new = cache.token_to_kv_pool_allocator.alloc(len(tokens) - prefix)
    values = torch.cat([cache.path_device_indices(m.last_device_node)[:prefix], new])
    res = cache.insert(InsertParams(key=key, value=values, prev_prefix_len=prefix,
                                    inserted_len=inserted, session_id=session))
    if isinstance(cache, RadixCache):  # the unified tree frees its duplicates itself
        cache.token_to_kv_pool_allocator.free(values[prefix : res.prefix_len])


def cached(cache, tokens):
    """Leading tokens of ``tokens`` still cached (a match: it touches the path)."""
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len


def node_at(cache, tokens):
    """The node whose key ends where ``tokens`` do (found without a match)."""
    root = getattr(cache, "tree_core", cache).root_node
    node, i = root, 0
    while i < len(tokens):
        node = node.children[RadixKey(array("q", tokens[i:])).child_key(1)]
        i += len(node.key)
    assert i == len(tokens), "no node ends there"
    return node


def strategy(cache):
    return getattr(cache, "tree_core", cache).eviction_strategy


def evict(cache, n):
    return cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted


A1 = SYSTEM + list(range(1, 9))  # session A's first turn
A2 = A1 + list(range(9, 17))  # its second: the first turn and more
B1 = SYSTEM + list(range(101, 109))  # session B's first turn
C1 = list(range(201, 209))  # a request with no session


class TestTags(CustomTestCase):
    def test_a_session_tags_what_only_it_uses(self):
        cache = build()
        insert(cache, A1, "A")
        insert(cache, A2, "A")
        insert(cache, B1, "B")
        insert(cache, C1)
        self.assertIsNone(node_at(cache, SYSTEM).__dict__.get(SESSION))  # B branched here
        self.assertEqual(node_at(cache, A1).__dict__.get(SESSION), "A")
        self.assertEqual(node_at(cache, A2).__dict__.get(SESSION), "A")
        self.assertEqual(node_at(cache, B1).__dict__.get(SESSION), "B")
        self.assertIsNone(node_at(cache, C1).__dict__.get(SESSION))

    def test_a_next_turn_branching_off_the_last_one_keeps_the_history_tagged(self):
        # The next turn shares the history but not the last turn's tail (in a paged tree,
        # a partial last page): the split's upper half is the session's alone.
        cache = build()
        insert(cache, A1 + [7001, 7002], "A")
        insert(cache, A1 + [8001, 8002], "A")
        upper = node_at(cache, A1)
        self.assertEqual(len(upper.children), 2)
        self.assertEqual(upper.__dict__.get(SESSION), "A")

    def test_a_prefix_another_session_reuses_is_not_the_first_ones(self):
        cache = build()
        insert(cache, A1, "A")
        insert(cache, B1, "B")  # splits A's first node at the shared system prompt
        self.assertIsNone(node_at(cache, SYSTEM).__dict__.get(SESSION))
        mla_sessions.close(cache, "A")
        self.assertFalse(mla_sessions.closed(node_at(cache, SYSTEM)))

    def test_off_in_the_config_no_book_and_no_tags(self):
        cache = build(sessions=False)
        insert(cache, A1, "A")
        self.assertIsNone(strategy(cache).sessions)
        self.assertIsNone(node_at(cache, A1).__dict__.get(SESSION))

    def test_other_policies_are_untouched(self):
        cache = build(policy="lru")
        insert(cache, A1, "A")
        mla_sessions.close(cache, "A")
        self.assertIsNone(node_at(cache, A1).__dict__.get(SESSION))


class TestClosedGoFirst(CustomTestCase):
    def _two_sessions(self, kind):
        cache = build(kind)
        insert(cache, B1, "B")  # B is the older: LRU would evict it first
        insert(cache, A1, "A")
        return cache

    def test_a_closed_sessions_leaf_goes_before_older_live_ones(self):
        for kind in ("unified", "radix"):
            with self.subTest(kind=kind):
                cache = self._two_sessions(kind)
                self.assertEqual(evict(cache, 8), 8)
                self.assertEqual(cached(cache, B1), len(SYSTEM))  # B's tail, the older
                cache = self._two_sessions(kind)
                mla_sessions.close(cache, "A")
                self.assertTrue(mla_sessions.closed(node_at(cache, A1)))
                self.assertEqual(evict(cache, 8), 8)
                self.assertEqual(cached(cache, A1), len(SYSTEM))  # A's tail, closed
                self.assertEqual(cached(cache, B1), len(B1))

    def test_the_leaf_index_hears_of_a_close(self):
        # Both tails are of one score class, B's the older: the index has filed A's behind
        # B's at an earlier walk, and a close changes A's class without an access.
        cache = build()
        insert(cache, C1)
        insert(cache, B1, "B")
        insert(cache, A1, "A")
        self.assertEqual(evict(cache, 8), 8)  # C: the index has walked
        self.assertEqual(cached(cache, C1), 0)
        mla_sessions.close(cache, "A")
        self.assertEqual(evict(cache, 8), 8)
        self.assertEqual(cached(cache, A1), len(SYSTEM))
        self.assertEqual(cached(cache, B1), len(B1))

    def test_a_trimmed_closed_leaf_leaves_a_closed_head(self):
        cache = self._two_sessions("unified")
        mla_sessions.close(cache, "A")
        self.assertEqual(evict(cache, 2), 2)  # trimmed: A's tail loses its last 2 tokens
        head = node_at(cache, A1[:-2])
        self.assertEqual(head.__dict__.get(SESSION), "A")
        self.assertTrue(mla_sessions.closed(head))
        self.assertEqual(evict(cache, 6), 6)  # the head, before B's older tail
        self.assertEqual(cached(cache, A1), len(SYSTEM))
        self.assertEqual(cached(cache, B1), len(B1))

    def test_an_access_after_the_close_makes_it_live_again(self):
        cache = self._two_sessions("unified")
        mla_sessions.close(cache, "A")
        insert(cache, A1, "C")  # another request reuses A's turn
        self.assertFalse(mla_sessions.closed(node_at(cache, A1)))
        evict(cache, 8)
        self.assertEqual(cached(cache, B1), len(SYSTEM))  # B, now the oldest, went

    def test_a_request_finishing_after_its_session_closed_is_closed_too(self):
        cache = build()
        insert(cache, A1, "A")
        insert(cache, A2[:28], "A")  # the next turn's prompt, at the end of its prefill
        mla_sessions.close(cache, "A")  # while it decodes
        insert(cache, A2, "A", inserted=28)  # it finishes
        insert(cache, B1, "B")
        for tokens in (A1, A2[:28], A2):
            self.assertTrue(mla_sessions.closed(node_at(cache, tokens)))
        self.assertEqual(evict(cache, 16), 16)  # A's three closed nodes, before B's older tail
        self.assertEqual(cached(cache, B1), len(B1))
        self.assertEqual(cached(cache, A2), len(SYSTEM))

    def test_closed_victims_that_come_back_teach_nothing(self):
        cache = build()
        insert(cache, B1, "B")
        insert(cache, A1, "A")
        mla_sessions.close(cache, "A")
        learning = strategy(cache).learning
        evict(cache, 8)  # A's tail goes, closed
        insert(cache, A1, "A2")  # the same content again, under another session
        before = (learning.log_factor, learning.log_superseded, learning.weight, learning.returns)
        evict(cache, 1)  # scores the returned node: a first sight that matches the ghost
        self.assertEqual(learning.returns_closed, 1)
        self.assertEqual(
            (learning.log_factor, learning.log_superseded, learning.weight, learning.returns),
            before,
        )


class TestHooks(CustomTestCase):
    def test_the_session_controllers_close_closes(self):
        from sglang.srt.managers.io_struct import CloseSessionReqInput
        from sglang.srt.session.session_controller import SessionController

        cache = build()
        insert(cache, A1, "A")
        # A session named by its requests alone is unknown to the controller: it only
        # warns, and the hook has closed it in the tree anyway.
        SessionController(cache).close(CloseSessionReqInput(session_id="A"))
        self.assertTrue(mla_sessions.closed(node_at(cache, A1)))

    def test_release_radix_session_closes_on_both_trees(self):
        for kind in ("unified", "radix"):
            with self.subTest(kind=kind):
                cache = build(kind)
                insert(cache, A1, "A")
                cache.release_radix_session("A")
                self.assertTrue(mla_sessions.closed(node_at(cache, A1)))


class TestBook(CustomTestCase):
    def test_the_least_recent_session_is_forgotten(self):
        # An open one with its tags (its nodes become no session's and can be tagged
        # again); a closed one leaving its nodes closed (a close is final).
        cache = build()
        book = strategy(cache).sessions
        with mock.patch.object(SessionBook, "MAX_SESSIONS", 2):
            insert(cache, A1, "A")
            insert(cache, B1, "B")
            mla_sessions.close(cache, "B")
            insert(cache, C1, "C")  # a third session: A, the least recent, is forgotten
            self.assertEqual(list(book._sessions), ["B", "C"])
            insert(cache, A2, "D")  # a fourth: B goes
            self.assertEqual(list(book._sessions), ["C", "D"])
        # A's turn was untagged when A was forgotten, so D's next turn over it tags it.
        self.assertEqual(node_at(cache, A1).__dict__.get(SESSION), "D")
        self.assertFalse(mla_sessions.closed(node_at(cache, A1)))
        self.assertEqual(node_at(cache, A2).__dict__.get(SESSION), "D")
        self.assertTrue(mla_sessions.closed(node_at(cache, B1)))

    def test_a_closed_session_keeps_no_references(self):
        cache = build()
        insert(cache, A1, "A")
        book = strategy(cache).sessions
        self.assertEqual(len(book._sessions["A"].refs), 1)
        mla_sessions.close(cache, "A")
        self.assertEqual(book._sessions["A"].refs, [])

    def test_a_close_tells_the_listeners_of_the_sessions_nodes(self):
        cache = build()
        insert(cache, A1, "A")
        insert(cache, A2, "A")
        told = []
        strategy(cache).sessions.listeners.append(told.extend)
        mla_sessions.close(cache, "A")
        self.assertEqual({id(n) for n in told}, {id(node_at(cache, A1)), id(node_at(cache, A2))})


if __name__ == "__main__":
    unittest.main()
