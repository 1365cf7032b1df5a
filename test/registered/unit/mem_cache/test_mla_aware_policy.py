"""Unit tests for the mla_aware eviction policy (mla_aware_policy.py).

The strategy is scored on hand-built nodes with a hand-made cost model whose figures
are simple enough to work out on paper:

    prefill_flops(0, n) = 2 * 50 * n + 4 * (1 + 2 + ... + n) = 100 n + 2 n (n + 1)
    prefill_seconds     = prefill_flops / 1 FLOP/s
    bytes_for_tokens(n) = 10 n             (one layer, 10 B/token, page 1)
    density(n)          = (100 + 2 (n + 1)) / 10:  n=1: 10.4, n=4: 11.0, n=10: 12.2
"""

import dataclasses
import math
import unittest
from types import SimpleNamespace

from sglang.srt.mem_cache.mla_aware_policy import (
    POLICY_NAME,
    MLAAwareStrategy,
    PolicyConfig,
    PolicyConfigError,
    create_mla_aware_strategy,
)
from sglang.srt.mem_cache.mla_cost_model import AttentionKind, KVCostModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

COST = KVCostModel(
    name="paper",
    attention=AttentionKind.MHA,
    num_layers=1,
    bytes_per_token_per_layer=10,
    active_params=50,
    attention_flops_per_position=4,
    gpu_flops_per_s=1.0,
)
DENSITY = {1: 10.4, 4: 11.0, 10: 12.2}


class Tree:
    """A hand-built radix tree: nodes with the fields a strategy reads."""

    def __init__(self, strategy=None):
        self.next_id = 0
        self.root = self.node(None, (), t=0.0)
        self.strategy = strategy

    def node(self, parent, key, t, hits=1):
        node = SimpleNamespace(
            id=self.next_id,
            parent=parent,
            key=tuple(key),
            children={},
            last_access_time=t,
            hit_count=hits,
        )
        self.next_id += 1
        if parent is not None:
            parent.children[key[0]] = node
        return node

    def detach(self, node):
        del node.parent.children[node.key[0]]

    def split(self, node, n):
        """Split ``node`` as SGLang does: a new parent holds its first ``n`` key
        elements, ``node`` keeps the rest below it."""
        self.detach(node)
        upper = self.node(node.parent, node.key[:n], t=node.last_access_time)
        node.parent, node.key = upper, node.key[n:]
        upper.children[node.key[0]] = node
        return upper

    def at(self, now):
        """Stamp the root at ``now``. The tree's strategy walks at every whole tick
        up to ``now`` (a busy tree evicts that often), so that a leaf last accessed
        at tick ``t`` is ``now - t`` walks old: ages below read as ticks."""
        if self.strategy is not None:
            first = math.floor(self.root.last_access_time) + 1
            for tick in range(first, math.floor(now) + 1):
                self.root.last_access_time = float(tick)
                self.strategy._new_walk(float(tick))
        self.root.last_access_time = now


def pair(**config):
    """A strategy and a tree it walks."""
    strategy = MLAAwareStrategy(COST, **config)
    return Tree(strategy), strategy


def walk(strategy, leaves):
    """Score ``leaves`` as one heap build does; their priorities by name."""
    return {name: strategy.get_priority(leaf) for name, leaf in leaves.items()}


class TestPriority(CustomTestCase):
    def test_density_age_and_hits(self):
        tree, s = pair()
        a = tree.node(tree.root, [1], t=10.0)  # 1 token, no reuse
        b = tree.node(tree.root, range(100, 110), t=0.0, hits=2)  # 10 tokens, reused
        tree.at(20.0)
        p = walk(s, {"a": a, "b": b})
        # -age / ((1 + hits) * density): a: -10 / (2 * 10.4), b: -20 / (3 * 12.2)
        self.assertAlmostEqual(p["a"], -10 / 20.8, delta=1e-12)
        self.assertAlmostEqual(p["b"], -20 / 36.6, delta=1e-12)
        # LRU would evict b (older) first; b is longer and reused, a goes first.
        self.assertLess(p["b"], p["a"])
        self.assertLess(p["a"], 0)

    def test_key_unit_tokens_prices_pages(self):
        tree, s = pair(key_unit_tokens=4)
        leaf = tree.node(tree.root, [7], t=0.0)
        tree.at(4.0)
        # One key element of 4 tokens: density(4) = 11.0.
        p = s.get_priority(leaf)
        self.assertAlmostEqual(p, -4 / (2 * 11.0), delta=1e-12)

    def test_a_just_matched_leaf_scores_no_lower_than_zero(self):
        tree, s = pair()
        leaf = tree.node(tree.root, [1], t=5.0)
        tree.at(4.99999)  # a match stamps the root just below the path's end
        self.assertGreaterEqual(s.get_priority(leaf), 0.0)

    def test_a_split_prices_the_shorter_key(self):
        tree, s = pair()
        leaf = tree.node(tree.root, range(10, 20), t=0.0)
        tree.at(10.0)
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (2 * 12.2), delta=1e-12)
        tree.split(leaf, 6)  # a new parent holds the first 6 tokens, the leaf keeps 4
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (2 * 11.0), delta=1e-12)

    def test_new_hits_are_seen(self):
        tree, s = pair()
        leaf = tree.node(tree.root, [1], t=0.0)
        tree.at(10.0)
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (2 * 10.4), delta=1e-12)
        leaf.hit_count = 4
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (5 * 10.4), delta=1e-12)


class TestLearning(CustomTestCase):
    """Victims that come back teach B (probation) and the value weight."""

    def setUp(self):
        self.tree, self.s = pair()

    def evict(self, leaf):
        self.s.on_evict(leaf)
        self.tree.detach(leaf)

    def test_unproven_return_lowers_nothing_below_one(self):
        tree, s = self.tree, self.s
        leaf = tree.node(tree.root, [1, 2], t=0.0)
        tree.at(10.0)
        s.get_priority(leaf)
        self.evict(leaf)
        back = tree.node(tree.root, [1, 2], t=11.0)  # the same content again
        tree.at(12.0)
        s.get_priority(back)
        tree.at(13.0)
        s.get_priority(back)  # the next walk applies the step: log B stays at 0
        self.assertEqual((s.log_factor, s.factor), (0.0, 1.0))

    def test_proven_return_raises_factor_at_the_next_walk(self):
        tree, s = self.tree, self.s
        shared = tree.node(tree.root, [1], t=0.0)
        x = tree.node(shared, [2], t=1.0)
        y = tree.node(shared, [3], t=2.0)
        tree.at(10.0)
        walk(s, {"x": x, "y": y})  # two children seen under `shared`: proven
        self.evict(x)
        self.evict(y)
        tree.at(11.0)
        s.get_priority(shared)  # now a leaf, proven by its children
        self.evict(shared)
        back = tree.node(tree.root, [1], t=12.0)
        tree.at(13.0)
        s.get_priority(back)  # first sight: a proven victim came back
        self.assertEqual(s.factor, 1.0)  # not in the walk that saw it...
        tree.at(14.0)
        s.get_priority(back)
        self.assertAlmostEqual(s.log_factor, 0.1, delta=1e-12)  # ...at the next one
        self.assertAlmostEqual(s.factor, math.exp(0.1), delta=1e-12)
        # `shared` was the oldest leaf of its walk when it went: old and proven.
        self.assertAlmostEqual(s.weight, 1 + 0.02 * 0.8, delta=1e-12)

    def test_probation_multiplies_the_age_of_unproven_leaves(self):
        tree, s = self.tree, self.s
        s.log_factor, s.factor = math.log(3.0), 3.0
        s._version += 1
        shared = tree.node(tree.root, [1], t=0.0)
        tree.node(shared, [2], t=1.0)
        tree.node(shared, [3], t=1.0)
        tail = tree.node(tree.root, [9], t=0.0)
        tree.at(10.0)
        for child in list(shared.children.values()):
            s.get_priority(child)
            self.evict(child)
        self.assertAlmostEqual(s.get_priority(shared), -10 / (2 * 10.4), delta=1e-12)
        self.assertAlmostEqual(s.get_priority(tail), -30 / (2 * 10.4), delta=1e-12)

    def test_young_unproven_return_lowers_the_weight(self):
        tree, s = self.tree, self.s
        old = tree.node(tree.root, [1], t=0.0)
        young = tree.node(tree.root, [2], t=9.0)
        tree.at(10.0)
        walk(s, {"old": old, "young": young})  # oldest age 10; young is 1 < 5
        self.evict(young)
        back = tree.node(tree.root, [2], t=11.0)
        tree.at(12.0)
        s.get_priority(back)
        tree.at(13.0)
        s.get_priority(back)
        self.assertAlmostEqual(s.weight, 1 - 0.02 * 0.2, delta=1e-12)
        self.assertEqual(s.factor, 1.0)

    def test_learning_switched_off(self):
        tree, s = pair(learn_factor=False, learn_weight=False)
        leaf = tree.node(tree.root, [1], t=0.0)
        tree.node(leaf, [2], t=0.0)
        tree.node(leaf, [3], t=0.0)
        tree.at(5.0)
        for child in list(leaf.children.values()):
            s.get_priority(child)
            s.on_evict(child)
            tree.detach(child)
        s.get_priority(leaf)
        s.on_evict(leaf)
        tree.detach(leaf)
        back = tree.node(tree.root, [1], t=6.0)
        for now in (7.0, 8.0):
            tree.at(now)
            s.get_priority(back)
        self.assertEqual((s.factor, s.weight), (1.0, 1.0))

    def test_scores_of_one_walk_do_not_depend_on_order(self):
        def scores(order):
            tree, s = pair()
            gone = tree.node(tree.root, [5], t=0.0)
            tree.node(gone, [6], t=0.0)
            tree.node(gone, [7], t=0.0)
            tree.at(1.0)
            for child in list(gone.children.values()):
                s.get_priority(child)
                s.on_evict(child)
                tree.detach(child)
            s.get_priority(gone)
            s.on_evict(gone)
            tree.detach(gone)
            leaves = {
                "back": tree.node(tree.root, [5], t=2.0),  # a proven return: teaches
                "a": tree.node(tree.root, [1], t=1.5),
                "b": tree.node(tree.root, [2], t=2.5),
            }
            tree.at(3.0)
            return {name: s.get_priority(leaves[name]) for name in order}

        self.assertEqual(scores(["back", "a", "b"]), scores(["a", "b", "back"]))


class TestBoundedState(CustomTestCase):
    def test_evicted_nodes_leave_no_state_and_ghosts_are_capped(self):
        tree, s = pair()
        s.MAX_GHOSTS = 3
        tree.at(1.0)
        for i in range(10):
            leaf = tree.node(tree.root, [i], t=0.0)
            s.get_priority(leaf)
            s.on_evict(leaf)
            tree.detach(leaf)
        self.assertEqual(len(s._seen), 0)
        self.assertEqual(list(s._children), [tree.root.id])  # the live parent only
        self.assertEqual(len(s._ghosts), 3)
        self.assertEqual([sig[1] for sig in s._ghosts], [(7,), (8,), (9,)])

    def test_a_new_tree_starts_afresh(self):
        first, s = pair()
        first.at(5.0)
        s.get_priority(first.node(first.root, [1], t=0.0))
        second = Tree()
        second.at(1.0)
        second.next_id = 100
        leaf = second.node(second.root, [1], t=0.0)
        # Its clock is behind the first tree's: ages count its own walks only.
        self.assertAlmostEqual(s.get_priority(leaf), -1 / (2 * 10.4), delta=1e-12)
        self.assertEqual(list(s._seen), [100])


class TestConfig(CustomTestCase):
    def test_defaults_and_keys(self):
        self.assertEqual(PolicyConfig.parse(None), PolicyConfig(None, True, True))
        parsed = PolicyConfig.parse({"learn_weight": False, "calibration": "h200.json"})
        self.assertEqual(parsed, PolicyConfig("h200.json", True, False))

    def test_bad_configs_name_the_key(self):
        cases = {
            "a list": (
                [1],
                "mla_aware: --radix-eviction-policy-config must be a JSON object, "
                "got list",
            ),
            "unknown key": (
                {"hit_exponent": 1},
                "mla_aware: unknown --radix-eviction-policy-config key "
                "'hit_exponent'; known keys: calibration, learn_factor, learn_weight",
            ),
            "number for a flag": (
                {"learn_factor": 1},
                "mla_aware: --radix-eviction-policy-config key 'learn_factor' must be "
                "true or false, got 1",
            ),
            "flag for a path": (
                {"calibration": True},
                "mla_aware: --radix-eviction-policy-config key 'calibration' must be "
                "a string, got True",
            ),
        }
        for name, (config, message) in cases.items():
            with self.subTest(name), self.assertRaises(PolicyConfigError) as ctx:
                PolicyConfig.parse(config)
            self.assertEqual(str(ctx.exception), message)
            self.assertIsInstance(ctx.exception, ValueError)

    def test_factory(self):
        s = create_mla_aware_strategy(COST, 64, learn_factor=False)
        self.assertIsInstance(s, MLAAwareStrategy)
        self.assertEqual(
            (s.key_unit_tokens, s.learn_factor, s.learn_weight), (64, False, True)
        )
        with self.assertRaises(PolicyConfigError):
            create_mla_aware_strategy(COST, bogus=1)
        with self.assertRaises(TypeError):
            MLAAwareStrategy({"model": "deepseek-v3"})
        for bad in (0, -1, 1.5, True):
            with self.subTest(key_unit_tokens=bad), self.assertRaises(ValueError):
                MLAAwareStrategy(COST, key_unit_tokens=bad)


def proven_leaf(tree, strategy, parent, key, t):
    """A leaf proven by two children that were scored and evicted under it."""
    leaf = tree.node(parent, key, t=t)
    kids = [tree.node(leaf, [k], t=t) for k in (900 + key[0], 950 + key[0])]
    for kid in kids:
        strategy.get_priority(kid)
    for kid in kids:
        strategy.on_evict(kid)
        tree.detach(kid)
    return leaf


class TestLearningByHand(CustomTestCase):
    """Each rule of the learning on a hand-built tree (added for the mutants the
    tests above let survive: docs/reliability.md). DENSITY(2) = (100 + 6) / 10."""

    def setUp(self):
        self.tree, self.s = pair()

    def evict(self, *leaves):
        for leaf in leaves:
            self.s.on_evict(leaf)
            self.tree.detach(leaf)

    def walks(self, *times, leaves=()):
        """One walk per time: the root stamped, ``leaves`` scored."""
        for now in times:
            self.tree.at(now)
            for leaf in leaves:
                self.s.get_priority(leaf)

    def set_factor(self, log_factor):
        self.s.log_factor, self.s.factor = log_factor, math.exp(log_factor)
        self.s._version += 1

    def test_names_messages_and_frozen_config(self):
        self.assertEqual(POLICY_NAME, "mla_aware")
        self.assertEqual(create_mla_aware_strategy(COST).key_unit_tokens, 1)
        with self.assertRaises(dataclasses.FrozenInstanceError):
            PolicyConfig().learn_factor = False
        with self.assertRaises(TypeError) as ctx:
            MLAAwareStrategy("deepseek-v3")
        self.assertEqual(
            str(ctx.exception), "cost_model must be a KVCostModel, got 'deepseek-v3'"
        )
        with self.assertRaises(ValueError) as ctx:
            MLAAwareStrategy(COST, key_unit_tokens=0)
        self.assertEqual(str(ctx.exception), "key_unit_tokens must be >= 1, got 0")

    def test_weight_is_an_exponent_of_density(self):
        leaf = self.tree.node(self.tree.root, range(10, 20), t=0.0)
        self.s.weight = 2.0
        self.s._version += 1
        self.tree.at(10.0)
        p = self.s.get_priority(leaf)
        self.assertAlmostEqual(p, -10 / (2 * 12.2**2), delta=1e-12)

    def test_one_child_scored_twice_does_not_prove_its_parent(self):
        tree, s = self.tree, self.s
        self.set_factor(math.log(3.0))
        parent = tree.node(tree.root, [1], t=0.0)
        child = tree.node(parent, [2], t=0.0)
        self.walks(10.0, 11.0, leaves=[child])
        self.evict(child)
        tree.at(12.0)  # unproven: factor 3
        self.assertAlmostEqual(s.get_priority(parent), -36 / 20.8, delta=1e-12)

    def test_a_leaf_that_gets_two_children_is_proven_and_rescored(self):
        tree, s = self.tree, self.s
        s._steps = [1, 0.0]
        s._apply()  # factor e^0.1, version 1
        parent = tree.node(tree.root, [1], t=0.0)
        self.walks(5.0, leaves=[parent])  # scored as an unproven leaf
        kids = [tree.node(parent, [k], t=5.0) for k in (2, 3)]
        self.walks(6.0, leaves=kids)
        self.evict(*kids)
        tree.at(7.0)  # proven now: factor 1, its cached rate stale
        self.assertAlmostEqual(s.get_priority(parent), -7 / 20.8, delta=1e-12)

    def test_two_children_present_prove_a_parent_when_one_is_scored(self):
        # A parent with two children of which one is scored has seen two children:
        # proven, whether it was scored before (marked) or not (at first sight).
        for scored_before in (True, False):
            with self.subTest(scored_before=scored_before):
                tree, s = pair()
                s.log_factor, s.factor = math.log(3.0), 3.0
                s._version += 1
                parent = tree.node(tree.root, [1], t=0.0)
                tree.at(5.0)
                if scored_before:
                    s.get_priority(parent)
                kids = [tree.node(parent, [k], t=5.0) for k in (2, 3)]
                tree.at(6.0)
                s.get_priority(kids[0])
                for kid in kids:
                    s.on_evict(kid)
                    tree.detach(kid)
                tree.at(7.0)  # proven: factor 1, not 3
                self.assertAlmostEqual(s.get_priority(parent), -7 / 20.8, delta=1e-12)

    def _proven_victims_return(self, keys, strategy=None):
        """Proven leaves, all as old as their walk's oldest, evicted at 11; the same
        content comes back at 12 and is scored at 13 (first sight) and 14."""
        tree = self.tree
        s = self.s = strategy or self.s
        tree.strategy = s
        tree.at(10.0)
        leaves = [proven_leaf(tree, s, tree.root, [k], t=0.0) for k in keys]
        self.walks(11.0, leaves=leaves)
        self.evict(*leaves)
        back = [tree.node(tree.root, [k], t=12.0) for k in keys]
        self.walks(13.0, 14.0, leaves=back)
        return back

    def test_two_returns_in_one_walk_count_twice(self):
        self._proven_victims_return([1, 4])
        self.assertAlmostEqual(self.s.log_factor, 0.2, delta=1e-12)
        self.assertAlmostEqual(self.s.weight, 1 + 2 * 0.02 * 0.8, delta=1e-12)
        self.walks(15.0, 16.0)  # nothing more came back: nothing moves
        self.assertAlmostEqual(self.s.log_factor, 0.2, delta=1e-12)
        self.assertAlmostEqual(self.s.weight, 1.032, delta=1e-12)

    def test_factor_or_weight_learnt_alone(self):
        self._proven_victims_return([1], MLAAwareStrategy(COST, learn_factor=False))
        self.assertEqual((self.s.log_factor, self.s.factor), (0.0, 1.0))
        self.assertAlmostEqual(self.s.weight, 1.016, delta=1e-12)
        self.setUp()
        self._proven_victims_return([1], MLAAwareStrategy(COST, learn_weight=False))
        self.assertAlmostEqual(self.s.factor, math.exp(0.1), delta=1e-12)
        self.assertEqual(self.s.weight, 1.0)

    def test_every_step_refreshes_cached_rates(self):
        tree, s = self.tree, self.s
        tail = tree.node(tree.root, [77], t=0.0)  # unproven, scored in every walk
        for rnd, key in enumerate((1, 4)):
            t = 20.0 * rnd
            tree.at(t + 10.0)
            leaf = proven_leaf(tree, s, tree.root, [key], t=t)
            self.walks(t + 11.0, leaves=[leaf, tail])
            self.evict(leaf)
            back = tree.node(tree.root, [key], t=t + 12.0)
            self.walks(t + 13.0, t + 14.0, leaves=[back, tail])
            self.evict(back)
        self.assertAlmostEqual(s.log_factor, 0.2, delta=1e-12)
        # tail: age 34, factor e^0.2, hits 1, density 10.4, weight 1.016 (the second
        # victim, age 11 beside the tail's 31, was young and proven: no weight step)
        expected = -34 * math.exp(0.2) / (2 * 10.4**1.016)
        self.assertAlmostEqual(s.get_priority(tail), expected, delta=1e-12)

    def test_an_unscored_victim_is_unproven_and_lowers_the_factor_one_step(self):
        tree, s = self.tree, self.s
        self.set_factor(0.5)
        other = tree.node(tree.root, [5], t=0.0)
        never = tree.node(tree.root, [6], t=1.0)
        self.walks(2.0, leaves=[other])
        self.evict(never)
        back = tree.node(tree.root, [6], t=3.0)
        self.walks(4.0, 5.0, leaves=[back])
        self.assertAlmostEqual(s.log_factor, 0.4, delta=1e-12)

    def test_old_is_half_the_oldest_age_of_the_walk(self):
        # (ages in the walk, victim's age): the victim is old, unproven, so the
        # weight does not move; it is young just below half the oldest age.
        for ages, victim_age, weight in (
            ((0.4,), 0.3, 1.0),  # fractions of a second, as the legacy tree's clock
            ((10.0,), 5.0, 1.0),  # exactly half: old
            ((10.0,), 4.0, 1 - 0.02 * 0.2),  # young
        ):
            for first_tree in (True, False):
                with self.subTest(ages=ages, victim_age=victim_age, first=first_tree):
                    self._old_or_young(ages, victim_age, weight, first_tree)

    def _old_or_young(self, ages, victim_age, weight, first_tree):
        """As above; ``first_tree`` False: the strategy scored another tree before
        (whose clock ran further), and starts afresh at its first score of this one."""
        tree, s = pair()
        if not first_tree:
            other = Tree()
            other.next_id = 1000
            other.at(100.0)
            s.get_priority(other.node(other.root, [1], t=0.0))
            s.get_priority(tree.node(tree.root, [99], t=0.0))  # this tree at 0
        now = max(ages)
        leaves = [tree.node(tree.root, [i], t=now - a) for i, a in enumerate(ages)]
        victim = tree.node(tree.root, [50], t=now - victim_age)
        tree.at(now)
        for leaf in leaves + [victim]:
            s.get_priority(leaf)
        s.on_evict(victim)
        tree.detach(victim)
        back = tree.node(tree.root, [50], t=now + 1)
        for later in (now + 2, now + 3):
            tree.at(later)
            s.get_priority(back)
        self.assertAlmostEqual(s.weight, weight, delta=1e-12)

    def test_a_walk_of_fresh_leaves_has_no_young_victim(self):
        # Every leaf of the walk is age 0, so the oldest age is 0 and nothing is
        # younger than half of it: the proven victim was old, and its return raises
        # the weight by 0.02 * (1 - 0.2) (and log B by 0.1).
        tree, s = self.tree, self.s
        tree.at(5.0)
        victim = proven_leaf(tree, s, tree.root, [7], t=5.0)
        s.get_priority(victim)
        self.evict(victim)
        back = tree.node(tree.root, [7], t=6.0)
        self.walks(6.0, 7.0, leaves=[back])
        self.assertAlmostEqual(s.weight, 1 + 0.02 * 0.8, delta=1e-12)
        self.assertAlmostEqual(s.log_factor, 0.1, delta=1e-12)

    def test_ages_past_the_kept_walks_count_from_the_oldest_kept(self):
        # With 4 walks kept, walks 1..8 keep the clock of walks 5..8 (the list is
        # halved when a fifth is added: after walks 5 and 7). An access at tick t
        # within them is 8 - t walks old; one before them is as old as walk 5's
        # predecessor: 8 - 4 = 4 walks. Density 10.4, one hit: rate 1 / 20.8.
        tree, s = self.tree, self.s
        s.MAX_WALKS = 4
        leaves = {
            t: tree.node(tree.root, [int(10 * t)], t=t) for t in (2.0, 4.5, 5.0, 6.0)
        }
        tree.at(8.0)
        got = walk(s, leaves)
        for t, age in ((2.0, 4), (4.5, 4), (5.0, 3), (6.0, 2)):
            self.assertAlmostEqual(got[t], -age / 20.8, delta=1e-12, msg=t)
        self.assertLessEqual(len(s._stamps), 4)

    def test_a_split_after_a_step_reprices(self):
        tree, s = self.tree, self.s
        s._steps = [1, 0.0]
        s._apply()  # version 1
        self.set_factor(0.0)  # version 2: B back at 1 for simple figures
        s._version = 1
        leaf = tree.node(tree.root, range(10, 20), t=0.0)
        tree.at(10.0)
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (2 * 12.2), delta=1e-12)
        tree.split(leaf, 6)
        self.assertAlmostEqual(s.get_priority(leaf), -10 / (2 * 11.0), delta=1e-12)

    def test_the_seen_table_is_cleared_at_its_bound(self):
        self.tree.at(1.0)
        for i in range(10):
            self.s.get_priority(self.tree.node(self.tree.root, [i], t=0.0))
        self.assertEqual(len(self.s._seen), 10)
        s = MLAAwareStrategy(COST)
        s.MAX_SEEN = 3
        for i in range(10, 14):
            s.get_priority(self.tree.node(self.tree.root, [i], t=0.0))
        self.assertEqual(len(s._seen), 1)  # cleared on the fourth

    def test_a_ghost_is_where_content_starts_and_its_first_eight_tokens(self):
        tree, s = self.tree, self.s
        tree.at(10.0)
        top = tree.node(tree.root, [9, 9], t=0.0)
        other = tree.node(tree.root, [8], t=0.0)
        deep = proven_leaf(tree, s, top, list(range(1, 11)), t=0.0)
        self.walks(11.0, leaves=[deep, other])
        self.evict(deep)
        at_root = tree.node(tree.root, list(range(1, 11)), t=12.0)  # starts at 0
        self.walks(13.0, 14.0, leaves=[at_root])
        self.assertEqual(s.log_factor, 0.0)
        # Back where it started (after 2 tokens), the same first 8 tokens: learnt.
        back = tree.node(top, [*range(1, 9), 99], t=15.0)
        self.walks(16.0, 17.0, leaves=[back])
        self.assertAlmostEqual(s.log_factor, 0.1, delta=1e-12)

    def test_bounds(self):
        s = self.s
        s._steps = [1000, 10.0]
        s._apply()
        self.assertAlmostEqual(s.factor, 1000.0, delta=1e-9)
        self.assertEqual(s.weight, 3.0)
        s._steps = [-5000, -10.0]
        s._apply()
        self.assertEqual((s.factor, s.weight), (1.0, 0.25))
        tree = self.tree
        tree.at(1.0)
        s.get_priority(tree.node(tree.root, [0], t=0.0))  # the tree it evicts from
        for i in range(65_537):
            s.on_evict(
                SimpleNamespace(id=-1, parent=tree.root, key=(i,), last_access_time=0.0)
            )
        self.assertEqual(len(s._ghosts), 65_536)  # the oldest forgotten
        self.assertEqual(next(iter(s._ghosts)), (0, (1,)))


if __name__ == "__main__":
    unittest.main()
