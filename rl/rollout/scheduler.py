"""Host-side bookkeeping of the native engine: KV pages, shared prompts, waiting and running requests.

The KV cache is cut into pages of `page_size` tokens. Every distinct prompt of a generate() call
is prefilled once into pages of its own, and all its samples point their block tables at those
pages; only the prompt's partial last page is copied into each sample's first private page,
because the sample's response continues on that page. A request is admitted only when a row is
free and pages for its whole worst case (prompt tail + max_new_tokens) can be reserved, so a
running sequence never has to be preempted. A prompt's pages are returned when the last of its
requests finishes. Page 0 is never handed out: padding tokens and idle rows write there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagePool:
    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, 0, -1))  # page 0 is the scratch page

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV cache out of pages: {n} asked, {len(self.free)} free")
        pages, self.free = self.free[len(self.free) - n :], self.free[: len(self.free) - n]
        return pages

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class PromptKV:
    """One distinct prompt: its KV pages (empty until admitted) and the logits after its last token."""

    tokens: list[int]
    unfinished: int  # requests of this prompt that have not finished yet
    prior: int = 0  # response tokens already among `tokens` (a continued sample): they count against max_new_tokens
    pages: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (V,) next-token logits, set by prefill


@dataclass
class Request:
    index: int  # position in the generate() call's prompt list
    prompt: PromptKV
    pages: list[int] = field(default_factory=list)  # private: copy of the prompt's partial page, then the response
    generated: int = 0  # response tokens (prior ones included): exact at a poll, an upper bound between polls


class Scheduler:
    def __init__(self, prompts: list[list[int]], max_new_tokens: int, page_size: int, pool: PagePool, max_rows: int,
                 prior: list[int] | None = None):
        # Samples of one prompt wait side by side (each prompt where it first appears): a prompt's
        # pages are then held only while its samples run, and a cache with room for one prompt and
        # one sample at a time never waits on pages held for samples queued behind other prompts.
        samples: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, p in enumerate(prompts):
            samples.setdefault((tuple(p), prior[i] if prior else 0), []).append(i)
        self.waiting: deque[Request] = deque()
        for (tokens, done), indices in samples.items():
            prompt = PromptKV(list(tokens), len(indices), done)
            self.waiting.extend(Request(i, prompt, generated=done) for i in indices)
        self.running: list[Request] = []  # in row order: running[i] decodes in row i
        self.max_new_tokens, self.page_size, self.pool, self.max_rows = max_new_tokens, page_size, pool, max_rows

    def prompt_pages(self, prompt: PromptKV) -> int:
        return cdiv(len(prompt.tokens), self.page_size)

    def private_pages(self, prompt: PromptKV) -> int:
        return cdiv(len(prompt.tokens) % self.page_size + self.max_new_tokens - prompt.prior, self.page_size)

    def admit(self) -> tuple[list[PromptKV], list[Request]]:
        """Moves waiting requests into free rows, in queue order, while pages last.

        Returns (prompts that need a prefill, newly running requests); new requests take the rows
        after the ones already running.
        """
        to_prefill, new = [], []
        while self.waiting and len(self.running) + len(new) < self.max_rows:
            request = self.waiting[0]
            prompt = request.prompt
            need = self.private_pages(prompt) + (0 if prompt.pages else self.prompt_pages(prompt))
            if need > len(self.pool.free):
                break
            if not prompt.pages:
                prompt.pages = self.pool.take(self.prompt_pages(prompt))
                to_prefill.append(prompt)
            request.pages = self.pool.take(self.private_pages(prompt))
            new.append(self.waiting.popleft())
        if self.waiting and not self.running and not new:
            prompt = self.waiting[0].prompt
            raise RuntimeError(f"KV cache too small: one request of a {len(prompt.tokens)}-token prompt needs "
                               f"{self.private_pages(prompt) + self.prompt_pages(prompt)} pages of {self.page_size} "
                               f"tokens, the cache has {len(self.pool.free)}; raise rollout.kv_cache_tokens")
        self.running += new
        return to_prefill, new

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

    def finish(self, rows: list[int]) -> list[Request]:
        """Removes the requests in `rows` from the running list and frees their pages."""
        gone = set(rows)
        finished = [self.running[i] for i in rows]
        self.running = [r for i, r in enumerate(self.running) if i not in gone]
        for request in finished:
            self.pool.give(request.pages)
            request.pages = []
            prompt = request.prompt
            prompt.unfinished -= 1
            if prompt.unfinished == 0:
                self.pool.give(prompt.pages)
                prompt.pages, prompt.logits = [], None
        return finished
