"""Suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding): guesses
from suffix trees, one over each request's own tokens (prompt and output so far) and one over the
outputs of recent requests, so text an agent or an editor repeats across requests is guessed too.

A ``SuffixTree`` holds every substring of at most ``max_depth`` tokens of the sequences put in it,
as paths from the root, each node counting the occurrences of its path. A guess matches the
longest suffix of the request's tokens that is a path (the pattern, at most ``max_depth`` less
the guess's limit), then follows the most frequent child while the child's share of its parent's count, times
the shares before it, stays at least ``min_token_prob``; its length is at most
``max_spec_factor`` times the pattern's length and the caller's limit. Of the two trees' guesses
the one whose tokens' probabilities sum higher (the expected accepted length) wins.

Bounded memory: a request's own tree lives while the request does (built on its first guess, then
extended by the tokens appended since); the global tree holds the outputs of the last
``max_cached_requests`` finished requests, and drops the oldest one's paths (counts decremented,
empty nodes removed) when another comes. A finished request's output is queued and added by the
guesses, one per guess (so a busy engine, which guesses nothing, spends nothing on the tree, and
a step after a busy spell pays for a few outputs, not for all it queued).
Invariant: a request tree holds the substrings ending before the request's last token (none of the
last token's own suffixes, whose only continuation would be the unknown next token).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

CATCH_UP_PER_GUESS = 1  # queued outputs added to the global tree per guess made


class SuffixTree:
    """Counted paths of every substring (at most ``max_depth`` tokens) of the sequences added.

    Nodes are integer ids into flat arrays (count, first and last child, next sibling, token) and
    edges one dict of ints keyed by ``parent * TOKEN_SPAN + token``: containers of plain ints only,
    which Python's cyclic garbage collector does not track. (With a Python object per node, the
    global tree's millions of nodes made every full collection walk them: 391 ms per collection
    at 800,000 nodes, ``scripts/suffix_tree_gc.py``.) Children keep their insertion order (a tie goes to the first)."""

    TOKEN_SPAN = 1 << 32  # token ids are below this
    root = 0

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._edges: dict[int, int] = {}
        self._count = array("q", [0])
        self._first = array("q", [-1])
        self._last = array("q", [-1])
        self._next = array("q", [-1])
        self._token = array("q", [-1])
        self._free = array("q")
        self.num_nodes = 0

    def count(self, node: int) -> int:
        return self._count[node]

    def children(self, node: int) -> dict[int, int]:
        """token -> child, in insertion order."""
        out, child = {}, self._first[node]
        while child != -1:
            out[self._token[child]] = child
            child = self._next[child]
        return out

    def _new_child(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node], self._first[node], self._last[node], self._next[node] = 0, -1, -1, -1
            self._token[node] = token
        else:
            node = len(self._count)
            for column, value in ((self._count, 0), (self._first, -1), (self._last, -1), (self._next, -1),
                                  (self._token, token)):
                column.append(value)
        if self._last[parent] == -1:
            self._first[parent] = node
        else:
            self._next[self._last[parent]] = node
        self._last[parent] = node
        self._edges[parent * self.TOKEN_SPAN + token] = node
        self.num_nodes += 1
        return node

    def _unlink(self, parent: int, node: int) -> None:
        prev, cur = -1, self._first[parent]
        while cur != node:
            prev, cur = cur, self._next[cur]
        following = self._next[node]
        if prev == -1:
            self._first[parent] = following
        else:
            self._next[prev] = following
        if self._last[parent] == node:
            self._last[parent] = prev
        del self._edges[parent * self.TOKEN_SPAN + self._token[node]]
        self._free.append(node)  # its own children leave in the same removal (their counts reach 0)
        self.num_nodes -= 1

    def add(self, token_ids: Sequence[int], start: int = 0, end: int | None = None,
            active: list[int] | None = None) -> list[int]:
        """Count the substrings of ``token_ids`` ending at positions ``start .. end - 1``. ``active``:
        what the call that added the tokens before ``start`` returned (the nodes of the substrings
        ending at ``start - 1``, longest first), so a sequence added in pieces counts as if added at
        once; returns the same for ``end - 1``. O(``max_depth``) per token."""
        end = len(token_ids) if end is None else end
        active = list(active or [])
        edges, count, span = self._edges, self._count, self.TOKEN_SPAN
        for p in range(start, end):
            t = token_ids[p]
            if len(active) >= self.max_depth:  # a substring may not grow past max_depth tokens
                active = active[len(active) - self.max_depth + 1:]
            grown = []
            for node in (*active, self.root):
                child = edges.get(node * span + t)
                if child is None:
                    child = self._new_child(node, t)
                count[child] += 1
                grown.append(child)
            active = grown
        return active

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo ``add(token_ids)``: each substring's count less one; a node at zero leaves its parent
        (its descendants reach zero too, and leave it, as the walk goes on)."""
        edges, count, span = self._edges, self._count, self.TOKEN_SPAN
        active: list[int] = []
        for t in token_ids:
            if len(active) >= self.max_depth:
                active = active[len(active) - self.max_depth + 1:]
            grown = []
            for node in (*active, self.root):
                child = edges[node * span + t]
                count[child] -= 1
                if count[child] == 0:
                    self._unlink(node, child)
                grown.append(child)
            active = grown

    def match(self, context: Sequence[int], longest: int) -> tuple[int | None, int]:
        """The node of the longest suffix of ``context`` of at most ``longest`` tokens that is a path,
        and its length; (None, 0) if not even the last token is."""
        longest = min(len(context), longest)
        edges, span = self._edges, self.TOKEN_SPAN
        for m in range(longest, 0, -1):
            node = self.root
            for t in context[len(context) - m:]:
                node = edges.get(node * span + t)
                if node is None:
                    break
            else:
                return node, m
        return None, 0

    def guess(self, context: Sequence[int], max_len: int, max_spec_factor: float,
              min_token_prob: float) -> tuple[list[int], float]:
        """(tokens, score): the most frequent continuation of the longest matching suffix, and the
        sum of its tokens' estimated probabilities."""
        node, m = self.match(context, max(1, self.max_depth - max_len))  # room left for the guess
        if node is None:
            return [], 0.0
        limit = min(max_len, int(max_spec_factor * m), self.max_depth - m)
        count, first, following = self._count, self._first, self._next
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and first[node] != -1:
            best, child = first[node], following[first[node]]
            while child != -1:  # the most frequent child; the first of equals
                if count[child] > count[best]:
                    best = child
                child = following[child]
            prob *= count[best] / count[node]
            if prob < min_token_prob:
                break
            out.append(self._token[best])
            score += prob
            node = best
        return out, score


class _RequestTree:
    """A live request's tree and how far it has read the request's tokens."""

    __slots__ = ("tree", "added", "active")

    def __init__(self, tree: SuffixTree) -> None:
        self.tree = tree
        self.added = 0
        self.active: list[int] = []

    def extend(self, token_ids: Sequence[int], end: int) -> None:
        if end > self.added:
            self.active = self.tree.add(token_ids, self.added, end, self.active)
            self.added = end


class SuffixProposer:
    """Guesses from each request's own suffix tree and from the global tree of recent outputs."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_depth)
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # finished request -> its output
        self._pending: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # finished, not yet in the tree
        self._trees: dict[str, _RequestTree] = {}  # live request -> its own tree

    def propose(self, request_id: str, token_ids: Sequence[int], max_len: int) -> list[int]:
        if max_len <= 0:
            return []
        own_tree = self._trees.get(request_id)
        if own_tree is None:
            own_tree = self._trees[request_id] = _RequestTree(SuffixTree(self.max_depth))
        own_tree.extend(token_ids, len(token_ids) - 1)
        tree = own_tree.tree
        context = token_ids[max(0, len(token_ids) - self.max_depth):]
        args = (max_len, self.max_spec_factor, self.min_token_prob)
        own, own_score = tree.guess(context, *args)
        self.catch_up(CATCH_UP_PER_GUESS)
        other, other_score = self.global_tree.guess(context, *args) if self._cached else ([], 0.0)
        return own if own_score >= other_score else other

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request is over: drop its tree, and queue its output for the global tree (added by
        the guesses that follow, ``catch_up``: a busy engine that guesses nothing pays nothing for
        it; the queue keeps at most ``max_cached_requests`` outputs, the newest)."""
        self._trees.pop(request_id, None)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        self._pending[request_id] = tuple(output_token_ids)
        self._pending.move_to_end(request_id)
        while len(self._pending) > self.max_cached_requests:
            self._pending.popitem(last=False)

    def catch_up(self, most: int | None = None) -> None:
        """Add the oldest ``most`` queued outputs (None: all) to the global tree, dropping the oldest
        past ``max_cached_requests``. Each guess adds ``CATCH_UP_PER_GUESS``: a step pays for a few,
        not for all that a busy spell queued."""
        while self._pending and (most is None or most > 0):
            most = None if most is None else most - 1
            request_id, output = self._pending.popitem(last=False)
            if request_id in self._cached:  # an id used again: its older output leaves first
                self.global_tree.remove(self._cached.pop(request_id))
            self.global_tree.add(output)
            self._cached[request_id] = output
            while len(self._cached) > self.max_cached_requests:
                _, old = self._cached.popitem(last=False)
                self.global_tree.remove(old)

    def __len__(self) -> int:
        return len(self._trees)
