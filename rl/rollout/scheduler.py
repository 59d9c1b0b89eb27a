"""Host-side bookkeeping of the native engine: KV pages, shared prompts, waiting and running requests.

The KV cache is cut into pages of `page_size` tokens. Every distinct prompt of a generate() call
is prefilled once into pages of its own, and all its samples point their block tables at those
pages; only the prompt's partial last page is copied into each sample's first private page,
because the sample's response continues on that page. A request is admitted only when a row is
free and pages for its whole worst case (prompt tail + max_new_tokens) can be reserved, so a
running sequence never has to be preempted. A prompt's pages are returned when the last of its
requests finishes. Page 0 is never handed out: padding tokens and idle rows write there.

A request with a key (`keep`) leaves its KV behind when it finishes: the engine keeps the pages that hold
the sequence under that key (`Kept`) for a later call. A prompt that one of its requests' kept sequences
begins continues from those pages and prefills only the tokens after them. Kept pages are the engine's
until the call that continues them, the caller's release, or a shortage: a request that cannot be admitted
evicts kept sequences, those no waiting request continues first, and a prompt whose kept sequence is gone
is prefilled whole. A prompt's full pages may be shared by it and the sequences kept from it, so a page
counts its holders.

A partial rollout's continued samples come as prompts of their own (the original prompt and the response so far,
all prefilled again under the weights of now). Those of one original prompt share its full pages as a `base`,
prefilled once, and prefill only their own tokens over it (`share_bases`).

Sliding-window layers (Gemma 3's local ones) keep their KV in a cache of their own with its own pages (`window`, a
second `PagePool`): a token there attends to itself and the `window - 1` tokens before it, so a sequence needs only
its last `window` tokens of it. Two page tables per sequence, one per group of layers, as vLLM's hybrid allocator
keeps one per KV group, but with two physical caches rather than one pool cut into equal groups: the window cache is
small and sized by rows, not by context (rl/rollout/native.py), which a shared page size could not give. In it:
- a running request holds a ring of `cdiv(window, page_size)` private pages, position t on page
  ring[(t // page_size) % len(ring)] at its t % page_size: the token written at t overwrites t - ring tokens, already
  outside every later token's window, so decode steps recycle the ring's pages in place, the block table (entry j =
  ring[j % len(ring)]) never changes and a CUDA graph replays it;
- a prompt holds a linear table (entry j: logical page j, 0 where it holds none): while it is prefilled, a page for
  every page from the first its cached tokens' window reaches (a prefill writes all its tokens before any attends, so
  they cannot share a ring); after its prefill only those of its last window (`prefilled`), until its last request
  is done, as its other pages;
- each request copies its prompt's last `window - 1` tokens into its ring when it starts (as it copies the prompt's
  partial last page in the other cache); a prompt continued from a kept sequence or a base copies the window before
  its cached tokens from the kept ring or the base's table into its own pages before its prefill.
No window page is ever shared, so one holder frees it: a kept sequence keeps its ring, a base's pages go with the
base. Pages wholly outside every later token's window are never held past a prefill.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from rl.rollout.engine import prompt_groups


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Kept:
    """A finished sequence's KV, kept for a later call that continues it: the tokens whose KV the pages hold
    (the sequence but its last token, which was sampled and never fed back) and those pages, in order."""

    tokens: list[int]
    pages: list[int]
    experts: torch.Tensor | None = None  # a MoE model's routing of `tokens`, (MoE layers, tokens, k), set by the engine
    ring: list[int] = field(default_factory=list)  # its ring of window-cache pages (sliding-window layers)
    # its linear-attention states after `tokens` (conv, recurrent), set by the engine
    state: tuple[torch.Tensor, torch.Tensor] | None = None


class PagePool:
    """One call's pages: those no kept sequence holds (`held`: their page lists) are free; a page in use counts its
    holders."""

    def __init__(self, num_pages: int, held: Iterable[list[int]] = ()):
        self.holders = Counter(page for pages in held for page in pages)
        self.free = [p for p in range(num_pages - 1, 0, -1) if p not in self.holders]  # page 0 is the scratch page

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV cache out of pages: {n} asked, {len(self.free)} free")
        pages = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]  # in place: a copy of the rest took 0.1 s of a 2-s rollout over 67k pages
        self.holders.update(pages)
        return pages

    def in_use(self) -> int:
        """Pages held (the scratch page apart)."""
        return len(self.holders)

    def share(self, pages: list[int]) -> None:
        self.holders.update(pages)

    def give(self, pages: list[int]) -> None:
        for page in pages:
            self.holders[page] -= 1
            if not self.holders[page]:
                del self.holders[page]
                self.free.append(page)


@dataclass
class PromptKV:
    """One distinct prompt: its KV pages (empty until admitted) and the logits after its last token."""

    tokens: list[int]
    unfinished: int  # requests of this prompt that have not finished yet
    prior: int = 0  # response tokens already among `tokens` (a continued sample): they count against max_new_tokens
    keys: list[Hashable] = field(default_factory=list)  # its requests' keys: kept sequences it may continue
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # leading tokens whose KV `pages` held (a kept sequence's, or `base`'s) before the prefill
    logits: torch.Tensor | None = None  # (V,) next-token logits, set by prefill
    # A continued sample's original prompt, whose full pages it shares with the call's other samples of that
    # prompt: prefilled once (first), its pages the first of this one's.
    base: PromptKV | None = None
    # A MoE model's routing: of every token, set by prefill; and of the kept sequence it continues, if any
    experts: torch.Tensor | None = None
    kept_experts: torch.Tensor | None = None
    # Its pages of the window cache, by logical page (0: none held), and the kept ring its cached tokens' window
    # is copied from before its prefill (then given back)
    window: list[int] = field(default_factory=list)
    ring_from: list[int] = field(default_factory=list)
    # Linear-attention states (conv, recurrent): after its last token, set by prefill; and after the cached tokens of
    # the kept sequence it continues, if any
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    kept_state: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Request:
    index: int  # position in the generate() call's prompt list
    prompt: PromptKV
    pages: list[int] = field(default_factory=list)  # private: copy of the prompt's partial page, then the response
    generated: int = 0  # response tokens (prior ones included): exact at a poll, an upper bound between polls
    keep: Hashable | None = None  # the key its KV is kept under when it finishes
    ring: list[int] = field(default_factory=list)  # private window-cache pages, recycled (module docstring)


class Scheduler:
    def __init__(self, prompts: list[list[int]], max_new_tokens: int, page_size: int, pool: PagePool, max_rows: int,
                 prior: list[int] | None = None, keep: list[Hashable | None] | None = None,
                 kept: dict[Hashable, Kept] | None = None, window: int = 0, window_pool: PagePool | None = None):
        """`keep[i]`: the key request i continues a kept sequence from and keeps its own under (None: neither);
        `kept`: the engine's kept sequences, which this call continues, adds to and evicts from; `window` > 0: the
        sliding window (tokens) of the layers whose KV lives in the window cache, whose pages `window_pool` holds."""
        # Samples of one prompt wait side by side (each prompt where it first appears): a prompt's
        # pages are then held only while its samples run, and a cache with room for one prompt and
        # one sample at a time never waits on pages held for samples queued behind other prompts.
        keys = keep or [None] * len(prompts)
        prior = prior or [0] * len(prompts)
        self.waiting: deque[Request] = deque()
        distinct = {}
        for indices in prompt_groups(prompts, prior):
            first = indices[0]
            prompt = PromptKV(list(prompts[first]), len(indices), prior[first],
                              [keys[i] for i in indices if keys[i] is not None])
            distinct[tuple(prompts[first]), prior[first]] = prompt
            self.waiting.extend(Request(i, prompt, generated=prior[first], keep=keys[i]) for i in indices)
        share_bases(distinct, page_size)
        self.running: list[Request] = []  # in row order: running[i] decodes in row i
        self.max_new_tokens, self.page_size, self.pool, self.max_rows = max_new_tokens, page_size, pool, max_rows
        self.kept = kept if kept is not None else {}
        self.window, self.window_pool = window, window_pool
        self.ring = cdiv(window, page_size) if window else 0  # a running request's window-cache pages
        self.window_peak = 0  # the most window-cache pages held at once in this call

    def prompt_pages(self, prompt: PromptKV) -> int:
        return cdiv(len(prompt.tokens), self.page_size)

    def private_pages(self, prompt: PromptKV) -> int:
        return cdiv(len(prompt.tokens) % self.page_size + self.max_new_tokens - prompt.prior, self.page_size)

    def first_needed(self, position: int) -> int:
        """The logical page of the first token that a token at `position` attends to in a sliding-window layer."""
        return max(0, position - self.window + 1) // self.page_size

    def window_pages(self, prompt: PromptKV, cached: int) -> int:
        """Window-cache pages a prompt holds while it is prefilled over `cached` tokens: from the first its first new
        token's window reaches to its last (0 without a window cache)."""
        return self.prompt_pages(prompt) - self.first_needed(cached) if self.ring else 0

    def short(self, need: int, window_need: int) -> bool:
        return need > len(self.pool.free) or bool(self.ring) and window_need > len(self.window_pool.free)

    def admit(self) -> tuple[list[PromptKV], list[Request]]:
        """Moves waiting requests into free rows, in queue order, while pages last (evicting kept sequences
        when they run short).

        Returns (prompts that need a prefill, newly running requests); new requests take the rows
        after the ones already running.
        """
        to_prefill, new = [], []
        while self.waiting and len(self.running) + len(new) < self.max_rows:
            request = self.waiting[0]
            prompt = request.prompt
            base = prompt.base if not prompt.pages else None
            key = None if prompt.pages or base else self.continued(prompt)
            held = len(self.kept[key].pages) if key is not None else len(base.tokens) // self.page_size if base else 0
            cached = len(self.kept[key].tokens) if key is not None else held * self.page_size
            need = self.private_pages(prompt) + (0 if prompt.pages else self.prompt_pages(prompt) - held)
            need += self.prompt_pages(base) if base and not base.pages else 0
            window_need = self.ring + (0 if prompt.pages else self.window_pages(prompt, cached))
            window_need += self.window_pages(base, 0) if base and not base.pages else 0
            if self.short(need, window_need) and not self.short(need, 0) and (to_prefill or new or self.running):
                # Only the window cache is short, and prefills and rows give its pages back: the request waits, where
                # evicting kept sequences would cost their requests whole prefills.
                break
            if self.short(need, window_need):
                # Never the prompt's own kept sequence: dropping it frees as many pages as its prefill then needs.
                self.evict(need, window_need, spare=key)
            if self.short(need, window_need):
                break
            if not prompt.pages:
                to_prefill += self.place(prompt, key, base, held)
            request.pages = self.pool.take(self.private_pages(prompt))
            if self.ring:
                request.ring = self.window_pool.take(self.ring)
            new.append(self.waiting.popleft())
        if self.waiting and not self.running and not new:
            self.too_small(self.waiting[0].prompt)
        self.running += new
        if self.ring:
            self.window_peak = max(self.window_peak, self.window_pool.in_use())
        return to_prefill, new

    def place(self, prompt: PromptKV, key: Hashable | None, base: PromptKV | None, held: int) -> list[PromptKV]:
        """Gives an admitted prompt its pages: its kept sequence's (`key`) and new ones after them, or the first
        `held` pages of its base's (shared; the base is placed too if it has none yet) and its own after them, or
        all its own; and its window-cache pages. Returns the prompts to prefill, in order (a base before the prompts
        continued from it)."""
        to_prefill = []
        if key is not None:
            kept = self.kept.pop(key)
            prompt.pages = kept.pages + self.pool.take(self.prompt_pages(prompt) - held)
            prompt.cached, prompt.kept_experts, prompt.kept_state = len(kept.tokens), kept.experts, kept.state
            prompt.ring_from = kept.ring
        elif base is not None:
            if not base.pages:
                base.pages = self.pool.take(self.prompt_pages(base))
                self.take_window(base, 0)
                to_prefill.append(base)
            self.pool.share(base.pages[:held])
            prompt.pages = base.pages[:held] + self.pool.take(self.prompt_pages(prompt) - held)
            prompt.cached = held * self.page_size
        else:
            prompt.pages = self.pool.take(self.prompt_pages(prompt))
        self.take_window(prompt, prompt.cached)
        return to_prefill + [prompt]

    def too_small(self, prompt: PromptKV) -> None:
        """Raises the one line that says which cache cannot hold even one request of `prompt`, alone."""
        window = (f", and {self.ring + self.window_pages(prompt, 0)} of the sliding-window layers' cache, which "
                  f"has {len(self.window_pool.free)}") if self.ring else ""
        need = self.private_pages(prompt) + self.prompt_pages(prompt)
        short = "rollout.native.kv_cache_tokens" if self.short(need, 0) else "rollout.native.window_cache_tokens"
        raise RuntimeError(f"KV cache too small: one request of a {len(prompt.tokens)}-token prompt needs {need} "
                           f"pages of {self.page_size} tokens, the cache has {len(self.pool.free)}{window}; "
                           f"raise {short}")

    def take_window(self, prompt: PromptKV, cached: int) -> None:
        """The prompt's window-cache pages for its prefill over `cached` tokens (none before the first its first new
        token attends to)."""
        if self.ring:
            first = self.first_needed(cached)
            prompt.window = [0] * first + self.window_pool.take(self.prompt_pages(prompt) - first)

    def prefilled(self, prompt: PromptKV) -> None:
        """After the prompt's prefill: of its window-cache pages it keeps those that its requests (from its last
        token on) and the prompts continued from it as a base (from its last full page on) attend to; the kept ring
        its cached tokens' window was copied from goes back."""
        if not self.ring:
            return
        first = self.first_needed(len(prompt.tokens) // self.page_size * self.page_size)
        self.window_pool.give([page for page in prompt.window[:first] if page])
        prompt.window[:first] = [0] * first
        self.window_pool.give(prompt.ring_from)
        prompt.ring_from = []

    def window_copy(self, pages: list[int], ring: bool, to: list[int], to_ring: bool, end: int
                    ) -> tuple[list[int], list[int]]:
        """(source slots, destination slots) of the window before position `end` (the `window - 1` tokens a token at
        `end` attends to besides itself), from `pages` to `to`, each a ring or a linear table (module docstring)."""
        ps = self.page_size

        def slot(table: list[int], is_ring: bool, t: int) -> int:
            return table[t // ps % len(table) if is_ring else t // ps] * ps + t % ps

        span = range(max(0, end - self.window + 1), end)
        return [slot(pages, ring, t) for t in span], [slot(to, to_ring, t) for t in span]

    def prompt_window_copy(self, prompt: PromptKV) -> tuple[list[int], list[int]]:
        """Slots that copy the window before a prompt's cached tokens' end into its own pages: from the kept ring it
        continues, or from its base's pages (none for a fresh prompt)."""
        if not self.ring or not prompt.cached:
            return [], []
        source, ring = (prompt.ring_from, True) if prompt.ring_from else (prompt.base.window, False)
        return self.window_copy(source, ring, prompt.window, False, prompt.cached)

    def request_window_copy(self, request: Request) -> tuple[list[int], list[int]]:
        """Slots that copy the window before a request's first decoded token from its prompt's pages into its ring."""
        if not self.ring:
            return [], []
        return self.window_copy(request.prompt.window, False, request.ring, True, len(request.prompt.tokens))

    def ring_table(self, request: Request, width: int) -> list[int]:
        """The request's window-cache block table: entry j, logical page j, is ring[j % len(ring)]."""
        return [request.ring[j % self.ring] for j in range(width)]

    def continued(self, prompt: PromptKV) -> Hashable | None:
        """The first of the prompt's keys whose kept sequence it goes on from (the kept tokens begin it and
        leave at least one token to prefill), or None."""
        for key in prompt.keys:
            kept = self.kept.get(key)
            if kept is not None and len(kept.tokens) < len(prompt.tokens) and \
                    prompt.tokens[: len(kept.tokens)] == kept.tokens:
                return key
        return None

    def evict(self, need: int, window_need: int, spare: Hashable | None) -> None:
        """Drops kept sequences (but `spare`'s) until `need` pages (and `window_need` of the window cache) are free:
        first those no waiting request continues, oldest first, then those of waiting requests from the back of the
        queue."""
        queue = {request.keep: i for i, request in enumerate(self.waiting)}
        for key in sorted(self.kept, key=lambda k: -queue.get(k, len(self.waiting))):
            if not self.short(need, window_need):
                return
            if key != spare:
                self.release(key)

    def release(self, key: Hashable) -> None:
        kept = self.kept.pop(key, None)
        if kept is not None:
            self.pool.give(kept.pages)
            if self.ring:
                self.window_pool.give(kept.ring)

    def block_table(self, request: Request) -> list[int]:
        """Pages holding positions 0, page_size, 2 * page_size, ... of this request's sequence."""
        return request.prompt.pages[: len(request.prompt.tokens) // self.page_size] + request.pages

    def tail_copy(self, request: Request) -> tuple[list[int], list[int]]:
        """(source slots, destination slots) that copy the prompt's partial last page to the request."""
        length = len(request.prompt.tokens)
        tail = length % self.page_size
        if tail == 0:
            return [], []
        src = request.prompt.pages[length // self.page_size] * self.page_size
        dst = request.pages[0] * self.page_size
        return [src + i for i in range(tail)], [dst + i for i in range(tail)]

    def finish(self, rows: list[int], generated: list[list[int]]) -> list[Request]:
        """Removes the requests in `rows` from the running list and frees their pages, or keeps those that
        hold the sequence of a request with a key; `generated[j]`: the tokens row rows[j] generated."""
        gone = set(rows)
        finished = [self.running[i] for i in rows]
        self.running = [r for i, r in enumerate(self.running) if i not in gone]
        for request, tokens in zip(finished, generated, strict=True):
            if request.keep is not None:
                self.keep(request, request.prompt.tokens + tokens[:-1])
            else:
                self.pool.give(request.pages)
                if self.ring:
                    self.window_pool.give(request.ring)
            request.pages, request.ring = [], []
            self.unhold(request.prompt)
        return finished

    def unhold(self, prompt: PromptKV) -> None:
        """One holder of `prompt` (a request of it, or a prompt continued from it) is done: with the last one, its
        pages go back, and it lets go of its base."""
        prompt.unfinished -= 1
        if prompt.unfinished == 0:
            self.pool.give(prompt.pages)
            if self.ring:
                self.window_pool.give([page for page in prompt.window if page] + prompt.ring_from)
            prompt.pages, prompt.logits, prompt.window, prompt.ring_from = [], None, [], []
            prompt.state = prompt.kept_state = None
            if prompt.base is not None:
                self.unhold(prompt.base)

    def keep(self, request: Request, tokens: list[int]) -> None:
        """Keeps the KV of `tokens` (the request's sequence but its last token) under the request's key: the
        prompt's full pages, shared, and the request's own pages that hold the rest; its other pages go back."""
        full = request.prompt.pages[: len(request.prompt.tokens) // self.page_size]
        own = cdiv(len(tokens), self.page_size) - len(full)
        self.release(request.keep)
        self.pool.share(full)
        self.kept[request.keep] = Kept(tokens, full + request.pages[:own], ring=request.ring)
        self.pool.give(request.pages[own:])


# The shortest prompt whose full pages continued samples share. A shared prompt saves its tokens' prefill for every
# sample but one, and the samples' own tokens then attend over cached pages through a kernel slower than the flash
# kernel of a whole prefill: on an H200, a rollout's continued samples with prompts of 40-90 tokens prefilled in
# 0.445 s shared against 0.400 s alone, with prompts of 600-1,300 tokens in 0.699 s against 0.851 s
# (benchmarks/RESULTS.md, "The decode step's fixed part, and prefill over cached tokens").
SHARED_PROMPT_MIN_TOKENS = 256


def share_bases(prompts: dict[tuple[tuple[int, ...], int], PromptKV], page_size: int) -> None:
    """Links continued samples (prior > 0, no keys) of one original prompt to a base holding that prompt's full
    pages, prefilled once under the weights of now and shared, instead of each sample prefilling and holding a copy
    of its own. The base is the call's fresh prompt of those tokens where it has one (prefilled anyway), else a
    prompt of the full pages with no requests of its own, made where it serves two samples or more; prompts of
    fewer than SHARED_PROMPT_MIN_TOKENS full-page tokens are not shared."""
    users: dict[tuple[int, ...], list[PromptKV]] = {}
    for (tokens, done), prompt in prompts.items():
        full = (len(tokens) - done) // page_size * page_size
        if done and full and full >= SHARED_PROMPT_MIN_TOKENS and not prompt.keys:
            users.setdefault(tokens[: len(tokens) - done], []).append(prompt)
    for original, continued in users.items():
        base = prompts.get((original, 0))
        if base is None and len(continued) < 2 or base is not None and base.keys:
            continue
        base = base or PromptKV(list(original[: len(original) // page_size * page_size]), 0)
        for prompt in continued:
            prompt.base = base
            base.unfinished += 1
