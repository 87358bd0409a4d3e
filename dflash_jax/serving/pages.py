"""The paged KV cache's host side: `PageAllocator`, which owns page ids, their reference counts and the
prefix cache's index, and `pages_for`. Pure Python and NumPy; the device pools and the jitted step that
reads a page table live elsewhere (issue 56).

A pool holds `num_pages` pages of `page_size` tokens each, for the target's K/V and the draft's context
K/V at once (both pools are addressed by the same page id, SGLang's design). Page 0 is the dummy page:
never handed out, it is what page-table padding points at.

Every page is in exactly one of three states:
- free: on the free list, holding nothing anyone can find;
- referenced: held by one row or more (a private page has one holder; a published one may be shared);
- evictable: published, held by nobody, still findable by `match` until `allocate` reuses it.

Prefix caching shares FULL pages only, so a shared page is never written again: a row's write cursor is
always in a page of its own, and attention needs no copy-on-write. A full page is published under a
chained hash of every token up to and including it, `h_i = blake2b(h_{i-1} || tokens of page i)` keyed by
the salt (hashlib, so the same in every process; Python's `hash()` is salted per process). A row
publishes its pages only once the target K/V AND the draft context K/V of their tokens are written
(the ordering rule of SGLang's DFlash worker: a hit on the target is then a hit on the draft, with no
recompute, the failure vLLM #47930 shows when it is not).

Not thread-safe: the engine's scheduler thread owns it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Sequence

import numpy as np

__all__ = ["PageAllocator", "WindowPages", "pages_for", "DUMMY_PAGE"]

# Page-table padding points here; the allocator never hands it out.
DUMMY_PAGE = 0

_HASH_BYTES = 32
_ROOT = bytes(_HASH_BYTES)  # the parent hash of a row's first page
_INT32 = np.iinfo(np.int32)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens (ceil division)."""
    if tokens < 0 or page_size < 1:
        raise ValueError(f"pages_for({tokens}, {page_size}): tokens must be >= 0 and page_size >= 1")
    return -(-tokens // page_size)


def _token_bytes(tokens) -> bytes:
    """Tokens as little-endian int32 bytes (the same on every host)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < _INT32.min or int(arr.max()) > _INT32.max):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()


class PageAllocator:
    """Pages of `page_size` tokens in a pool of `num_pages`; page 0 is the dummy page (never handed out:
    page-table padding points at it). Reference-counted; with prefix caching, full pages are published
    under a chained hash of (every token up to and including the page) and stay findable after release
    until evicted (LRU).

    Eviction is plain LRU by the time a page's last reference went away, and `release` drops a row's
    pages from its last page to its first, so within one row the tail ages before the head (vLLM's
    block pool frees in the same reverse order). That is nearly leaf-first without a tree: a prefix
    page shared by many rows is released last by its last holder, so it outlives the tails hanging off
    it. Where a parent is evicted before a child anyway (the child was published by a row that held a
    duplicate of the parent), the child is unreachable (`match` walks the chain from the start and stops
    at the first missing hash), costs nothing but its slot, and ages out like any evictable page. A
    radix tree's strict leaf-first order would buy little over this and cost a tree. `match` taking a
    reference is its "touch": a held page is not evictable, and its release puts it at the young end.
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True, salt: bytes = b""):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the dummy page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.prefix_cache = bool(prefix_cache)
        self.salt = bytes(salt)
        # The salt keys the hash, so two salts never share a hash (a namespace per model or tenant).
        self._key = hashlib.blake2b(self.salt, digest_size=_HASH_BYTES).digest()
        self._refs = [0] * self.num_pages
        self._used = 0
        # Popped from the end: page 1 first on a fresh pool, the most recently freed page after that.
        self._free = list(range(self.num_pages - 1, DUMMY_PAGE, -1))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._page_of: dict[bytes, int] = {}  # chain hash -> published page
        self._hash_of: dict[int, bytes] = {}  # published page -> chain hash
        self._queries = 0
        self._hits = 0
        self._evictions = 0

    # -- counts

    def available(self) -> int:
        """Pages `allocate` could hand out now: free + evictable (unreferenced published)."""
        return len(self._free) + len(self._evictable)

    def used(self) -> int:
        """Pages with a reference (the KV pages used / total metric)."""
        return self._used

    def stats(self) -> dict:
        """Prefix-cache queries and hits in tokens (vLLM's `prefix_cache_queries` / `_hits`), pages used and
        total (the dummy page left out) and evictions so far."""
        return {"prefix_queries_tokens": self._queries, "prefix_hits_tokens": self._hits,
                "pages_used": self._used, "pages_total": self.num_pages - 1, "evictions": self._evictions}

    # -- hashing

    def page_hashes(self, tokens) -> list[bytes]:
        """The chain hashes of the full pages of `tokens` (len(tokens) // page_size of them): the keys a
        row's pages are published under. The same in every process for the same salt."""
        data = _token_bytes(tokens)
        return list(self._chain(data, len(data) // (4 * self.page_size)))

    def _chain(self, data: bytes, n: int):
        """Yields the first n chain hashes of `data` (int32 token bytes) lazily, so a match that stops
        early hashes no further."""
        step = 4 * self.page_size
        parent = _ROOT
        for i in range(n):
            parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step], digest_size=_HASH_BYTES,
                                     key=self._key).digest()
            yield parent

    # -- the row's life: match, allocate, publish, release

    def match(self, tokens, *, count: bool = True) -> tuple[list[int], int]:
        """Longest cached prefix of `tokens` made of FULL pages, capped so that at least ONE token of
        `tokens` is left uncovered (the engine must run the target on >= 1 token to get logits): returns
        (page ids, tokens covered = len(pages) * page_size). Takes one reference on each returned page
        (so it stops being evictable) and counts len(tokens) queried and the covered tokens hit.
        prefix_cache=False: always ([], 0), nothing counted (vLLM counts nothing with caching off).
        count=False: nothing counted either (a caller that may give the pages back, as an admission
        that finds the pool short, counts the query itself once it holds: `count`)."""
        if not self.prefix_cache:
            return [], 0
        data = _token_bytes(tokens)
        n_tokens = len(data) // 4
        pages = []
        for h in self._chain(data, max(n_tokens - 1, 0) // self.page_size):
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        covered = len(pages) * self.page_size
        if count:
            self.count(n_tokens, covered)
        return pages, covered

    def lookup(self, hashes: Iterable[bytes]) -> list[int | None]:
        """The page published under each chain hash (None: none), taking no reference."""
        return [self._page_of.get(h) for h in hashes]

    def take(self, pages: Iterable[int]) -> None:
        """One more reference on each page (published or already referenced: what `lookup` found)."""
        pages = [int(p) for p in pages]
        for page in pages:
            self._check_id(page)
            if self._refs[page] == 0 and page not in self._evictable:
                raise ValueError(f"take: page {page} is free (neither referenced nor published)")
        for page in pages:
            self._take(page)

    def count(self, queried: int, hit: int) -> None:
        """Count one prefix-cache query of `queried` tokens of which `hit` were found."""
        if self.prefix_cache:
            self._queries += int(queried)
            self._hits += int(hit)

    def allocate(self, n: int) -> list[int] | None:
        """n private pages (refcount 1), evicting least-recently-used unreferenced published pages when the
        free list is short; all or nothing: None (and nothing changed) when n > available()."""
        if n < 0:
            raise ValueError(f"allocate({n}): n must be >= 0")
        if n > self.available():
            return None
        pages = []
        while len(pages) < n and self._free:
            pages.append(self._free.pop())
        while len(pages) < n:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self._evictions += 1
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        self._used += n
        return pages

    def publish(self, tokens, pages: Sequence[int]) -> None:
        """Register the FULL pages of a row: pages[i] holds tokens[i*P:(i+1)*P] for i < len(tokens)//P
        (pages may go on past them: the row's partial and lookahead pages, left alone). Call only after
        the target K/V AND the draft context K/V of those tokens are written. A page whose chain hash is
        already published under another page stays private (a duplicate; it frees normally). A page
        already published under the same hash: no-op; under another hash: ValueError (its row and its
        contents disagree). The row must hold a reference on each page it publishes. An entry
        DUMMY_PAGE is a logical page the row does not hold (a window row's page behind its window,
        `WindowPages`): skipped."""
        if not self.prefix_cache:
            return
        data = _token_bytes(tokens)
        n = len(data) // (4 * self.page_size)
        if len(pages) < n:
            raise ValueError(f"publish: {len(data) // 4} tokens fill {n} pages but only {len(pages)} pages given")
        full = [int(p) for p in pages[:n]]
        held = [p for p in full if p != DUMMY_PAGE]
        if len(set(held)) != len(held):
            raise ValueError(f"publish: a page appears twice among the row's full pages {full}")
        for page in held:
            self._check_id(page)
            if self._refs[page] == 0:
                raise ValueError(f"publish: page {page} has no reference (publish before release)")
        for page, h in zip(full, self._chain(data, n)):
            if page == DUMMY_PAGE:
                continue
            known = self._hash_of.get(page)
            if known is not None:
                if known != h:
                    raise ValueError(f"publish: page {page} is already published under another prefix")
                continue
            if h in self._page_of:
                continue  # a duplicate of a published page: stays private
            self._page_of[h] = page
            self._hash_of[page] = h

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page. A page reaching 0 goes to the evictable LRU (young end) if
        published, else back to the free list. Pages go from last to first, so a row's tail is evicted
        before its head. Releasing a page with no reference raises ValueError and changes nothing (a
        double free is a bug, never silent); so does a page listed more times than it is referenced."""
        pages = [int(p) for p in pages]
        for page, times in collections.Counter(pages).items():
            self._check_id(page)
            if self._refs[page] < times:
                raise ValueError(f"release: page {page} released {times} time(s) with {self._refs[page]} "
                                 f"reference(s) (double free)")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._used -= 1
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # -- invariants

    def check(self) -> None:
        """Raises AssertionError naming the page if an invariant is broken: every page but the dummy is
        exactly one of free / referenced / evictable; evictable pages are published and free ones are
        not; the hash index is a bijection; the counts agree; the dummy page is never owned."""
        free = set(self._free)
        if len(free) != len(self._free):
            dup = next(p for p, c in collections.Counter(self._free).items() if c > 1)
            raise AssertionError(f"page {dup}: on the free list twice")
        if (DUMMY_PAGE in free or DUMMY_PAGE in self._evictable or DUMMY_PAGE in self._hash_of
                or self._refs[DUMMY_PAGE] != 0):
            raise AssertionError(f"page {DUMMY_PAGE}: the dummy page is owned")
        used = 0
        for page in range(1, self.num_pages):
            ref = self._refs[page]
            if ref < 0:
                raise AssertionError(f"page {page}: negative reference count {ref}")
            states = [name for name, on in (("free", page in free), ("referenced", ref > 0),
                                            ("evictable", page in self._evictable)) if on]
            if len(states) != 1:
                raise AssertionError(f"page {page}: in states {states or ['none']}, must be in exactly one")
            published = page in self._hash_of
            if states[0] == "free" and published:
                raise AssertionError(f"page {page}: free but published")
            if states[0] == "evictable" and not published:
                raise AssertionError(f"page {page}: evictable but not published")
            if published and self._page_of.get(self._hash_of[page]) != page:
                raise AssertionError(f"page {page}: its hash points at page {self._page_of.get(self._hash_of[page])}")
            used += ref > 0
        for h, page in self._page_of.items():
            if self._hash_of.get(page) != h:
                raise AssertionError(f"page {page}: the index holds a hash the page is not published under")
        if used != self._used:
            raise AssertionError(f"pages used counted {self._used}, but {used} pages have a reference")
        if not self.prefix_cache and self._hash_of:
            raise AssertionError(f"page {next(iter(self._hash_of))}: published with prefix caching off")

    # -- helpers

    def _take(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._evictable[page]
            self._used += 1
        self._refs[page] += 1

    def _check_id(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page} is not a page of this pool (1..{self.num_pages - 1}; 0 is the dummy)")


class WindowPages:
    """The pages of a draft's sliding-window layers (issue 56): a second pool of `num_pages` pages with its
    own `PageAllocator` (free list, references, LRU) and a second page table [slots, pages_per_row]
    indexed by the same logical page (position // page_size) as the main one. A row holds window pages
    only for the logical pages its draft programs can still touch; the entries behind point at the
    dummy page, which the window mask (`k_start`) hides. Published under the SAME chain hashes as the
    main pages (the allocators share the salt), so a main page and a window page of one prefix are
    found together. SGLang's sliding-window radix cache, on pages.

    The bounds, for a draft layer of window W and block S (drafts.dflash2): a draft pass at committed
    length L attends keys >= L - W + 1 (its block rows sit at L..L+S-1, each seeing W keys back) and
    writes its pending context at >= L - S (at most a block of pending taps), so nothing run at
    length >= L touches a position below L - `behind`, behind = max(W - 1, S). The host's known length
    is a lower bound for every program not yet read (they run in dispatch order after the ones read),
    so a row at known length L keeps its logical pages from `first_kept(L)`: behind, plus a block and
    a page more, so that at release (full pages published up to L - S) the last published prefix
    still has its window present.

    A prefix hit of k full pages is usable by the window layers only if the window pages of logical
    pages [first_needed(k * page), k) are published: `match` caps the main hit at the longest k for
    which they are (pages evicted from this pool are SGLang's tombstones) and takes references on
    exactly those window pages. `admit` takes the rest of the row: the live window + reach (must),
    and the prompt's pages behind its window (best effort: written by the prefill and published with
    the prompt, so a later request sharing a prefix of it can hit; released by `trim` right after).

    Not thread-safe: the engine's scheduler thread owns it, as the main allocator.
    """

    def __init__(self, num_pages: int, page_size: int, *, window: int, block_size: int, slots: int,
                 pages_per_row: int, prefix_cache: bool = True, salt: bytes = b""):
        if window < 1 or block_size < 1:
            raise ValueError(f"window ({window}) and block_size ({block_size}) must be >= 1")
        self.alloc = PageAllocator(num_pages, page_size, prefix_cache=prefix_cache, salt=salt)
        self.page_size = int(page_size)
        self.window, self.block_size = int(window), int(block_size)
        self.behind = max(self.window - 1, self.block_size)
        self.rows: list[list[int]] = [[] for _ in range(slots)]     # per logical page: page id or DUMMY_PAGE
        self.table = np.zeros((slots, pages_per_row), np.int32)
        self.peak = 0

    @staticmethod
    def live_pages(window: int, block_size: int, page_size: int, reach: int) -> int:
        """Window pages one running row holds at most: from first_kept(L) up to L + reach (reach: the
        positions a step may write past the known length)."""
        behind = max(window - 1, block_size)
        return pages_for(block_size + behind + page_size - 1 + reach, page_size) + 1

    @staticmethod
    def default_pages(slots: int, window: int, block_size: int, page_size: int, steps: int,
                      pages_per_row: int) -> int:
        """The window pool's default size: every slot's live window at the slot engine's largest reach
        (the step in flight + the next: 2 x steps iterations of a block, + a block), + 1 (the dummy),
        + one row's every page (a whole prompt's windows written by its insert, the room the cached
        prefixes' last windows live in). A row's live window never exceeds its main pages, so more
        than slots x pages_per_row is never needed."""
        live = WindowPages.live_pages(window, block_size, page_size, (2 * steps + 1) * block_size)
        return min(slots * live + pages_per_row, slots * pages_per_row) + 1

    # -- the bounds

    def first_needed(self, length: int) -> int:
        """The first logical page a program run at length >= `length` can touch."""
        return max(0, length - self.behind) // self.page_size

    def first_kept(self, length: int) -> int:
        """The first logical page a row at known length `length` keeps (<= first_needed(length))."""
        return max(0, length - self.block_size - self.behind - self.page_size + 1) // self.page_size

    # -- counts

    def used(self) -> int:
        return self.alloc.used()

    def stats(self) -> dict:
        return {"window_pages_used": self.alloc.used(), "window_pages_total": self.alloc.num_pages - 1,
                "window_pages_peak": self.peak, "window_evictions": self.alloc.stats()["evictions"]}

    def _note(self) -> None:
        self.peak = max(self.peak, self.alloc.used())

    # -- a row's life: match, admit, start, grow / trim, publish, release

    def match(self, main: PageAllocator, tokens, main_pages: list[int], covered: int):
        """Cap a main prefix hit (`main_pages`, `covered` = len(main_pages) * page, references held by
        the caller: PageAllocator.match) at the longest k whose window pages are published. Returns
        (main pages kept, tokens covered, the row's window entries for logical pages [0, k): a page
        (one reference taken) or DUMMY_PAGE before first_needed). The main pages past k are released."""
        k = len(main_pages)
        if k == 0:
            return main_pages, covered, []
        found = self.alloc.lookup(main.page_hashes(list(tokens)[:k * self.page_size]))
        last_missing = [-1] * (k + 1)          # last_missing[i]: the largest j < i whose window page is gone
        for j in range(k):
            last_missing[j + 1] = j if found[j] is None else last_missing[j]
        while k > 0 and last_missing[k] >= self.first_needed(k * self.page_size):
            k -= 1
        main.release(main_pages[k:])
        first = self.first_needed(k * self.page_size)
        row = [DUMMY_PAGE] * first + [int(found[j]) for j in range(first, k)]
        self.alloc.take(row[first:])
        self._note()
        return main_pages[:k], k * self.page_size, row

    def admit(self, matched: list[int], length: int, pages: int) -> list[int] | None:
        """The rest of a row of `pages` logical pages (the main row's) whose first len(matched) come
        from `match`, for a prompt of `length` tokens: the pages from first_kept(length) on (must),
        then the prompt's pages behind them (best effort; DUMMY_PAGE when the pool cannot lend them).
        None (nothing taken) when the must part is short; the caller releases `matched`
        (release_row)."""
        k = len(matched)
        live = max(k, min(self.first_kept(length), pages))
        new = self.alloc.allocate(pages - live)
        if new is None:
            return None
        extra = self.alloc.allocate(live - k) if live > k else []
        self._note()
        return list(matched) + (extra if extra is not None else [DUMMY_PAGE] * (live - k)) + new

    def start(self, slot: int, row: list[int]) -> None:
        """The admitted row goes into `slot` (the slot's previous row released)."""
        self.rows[slot] = list(row)
        self.table[slot] = DUMMY_PAGE
        self.table[slot, :len(row)] = row

    def grow(self, slot: int, pages: int) -> bool:
        """`slot`'s row extended to `pages` logical pages; False (nothing taken) when short."""
        need = pages - len(self.rows[slot])
        if need <= 0:
            return True
        new = self.alloc.allocate(need)
        if new is None:
            return False
        n = len(self.rows[slot])
        self.rows[slot].extend(new)
        self.table[slot, n:n + need] = new
        self._note()
        return True

    def trim(self, slot: int, length: int) -> int:
        """Release `slot`'s pages behind first_kept(length) (known length `length`): free, or
        evictable when published. Returns how many."""
        row = self.rows[slot]
        cut = min(self.first_kept(length), len(row))
        gone = [p for p in row[:cut] if p != DUMMY_PAGE]
        if gone:
            self.alloc.release(gone)
            row[:cut] = [DUMMY_PAGE] * cut
            self.table[slot, :cut] = DUMMY_PAGE
        return len(gone)

    def publish(self, slot: int, tokens) -> None:
        """Publish `slot`'s held window pages among the full pages of `tokens` (final in the draft's
        context: the caller's rule for the main pages)."""
        self.alloc.publish(tokens, self.rows[slot])

    def release_row(self, row: list[int]) -> None:
        self.alloc.release([p for p in row if p != DUMMY_PAGE])

    def release(self, slot: int) -> None:
        """`slot`'s window pages released (publish first)."""
        self.release_row(self.rows[slot])
        self.rows[slot] = []
        self.table[slot] = DUMMY_PAGE

    def check(self) -> None:
        """The allocator's invariants, and every row's held pages referenced and in its table."""
        self.alloc.check()
        held = collections.Counter(p for row in self.rows for p in row if p != DUMMY_PAGE)
        for page, n in held.items():
            if self.alloc._refs[page] < n:
                raise AssertionError(f"window page {page}: held by {n} rows with {self.alloc._refs[page]} references")
        for slot, row in enumerate(self.rows):
            if list(self.table[slot, :len(row)]) != row or np.any(self.table[slot, len(row):] != DUMMY_PAGE):
                raise AssertionError(f"slot {slot}: the window table disagrees with its row {row}")
