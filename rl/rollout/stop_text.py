"""Stop text: strings that end a sequence once its tokens, decoded one by one, spell one of them, whichever
tokens the model split it into ("```\\n" after a code block is "``" + "`\\n" or "```" + "\\n" in Qwen2.5's
vocabulary, and "```" alone opens a block too, so no set of stop ids can end a turn there).

The strings become one automaton over characters (Aho-Corasick: a state is the longest tail of the text so far
that starts one of the strings) and the automaton one transition per token: `next[state][token]`, the state
after reading the token's text from `state`, or STOPPED when a string ends inside it. A token whose text holds
none of the strings' characters sends every state to 0, so only a few thousand columns of a vocabulary differ
from that, and `columns` keeps only those (a token that decodes to nothing, a special one, keeps the state).
The native engine advances one state per row on the device in every decode step (`table`), the exact token that
completes a string ends the row; an engine that cannot (vLLM runs without a tokenizer) is cut after the fact
(`cut`), the tokens it generated past the stop thrown away.

Tokens are decoded on their own, special tokens as nothing: a string with a character that only a sequence of
tokens spells (one split across byte-level tokens) would never match, so the strings must be ASCII.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

STOPPED = -1


@dataclass(frozen=True, eq=False)
class StopText:
    strings: tuple[str, ...]
    states: int
    columns: dict[int, tuple[int, ...]]  # token -> the state after it from each state; tokens absent: all 0

    @classmethod
    def build(cls, strings: list[str] | tuple[str, ...], token_texts: list[str]) -> StopText:
        """The automaton of `strings` over `token_texts` (token id -> its text, decoded on its own)."""
        bad = [s for s in strings if not s or not s.isascii()]
        if bad:
            raise ValueError(f"stop text must be non-empty ASCII, got {bad}")
        step, accepting = automaton(strings)
        alphabet = {c for s in strings for c in s}
        columns = {}
        for token, text in enumerate(token_texts):
            if text and alphabet.isdisjoint(text):
                continue
            column = []
            for state in range(len(accepting)):
                for c in text:
                    state = step[state].get(c, 0)
                    if accepting[state]:
                        state = STOPPED
                        break
                column.append(state)
            columns[token] = tuple(column)
        return cls(tuple(strings), len(accepting), columns)

    @classmethod
    def from_tokenizer(cls, strings: list[str] | tuple[str, ...], tokenizer) -> StopText:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
        return cls.build(strings, texts)

    def table(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(states, vocab_size) int32: the state after each token from each state (STOPPED: a string ended)."""
        table = torch.zeros(self.states, vocab_size, dtype=torch.int32)
        tokens = [t for t in self.columns if t < vocab_size]
        if tokens:
            table[:, tokens] = torch.tensor([self.columns[t] for t in tokens], dtype=torch.int32).T
        return table.to(device)

    def stopping_tokens(self) -> tuple[int, ...]:
        """The tokens that complete a stop string from any state (those whose text holds a whole one, such as
        "</tool_call>" in Qwen2.5's vocabulary): stop ids for an engine that cannot follow the automaton."""
        return tuple(t for t, column in self.columns.items() if all(state == STOPPED for state in column))

    def cut(self, tokens: list[int]) -> int | None:
        """How many of `tokens` there are up to and with the one that completes a stop string (None: none does)."""
        state = 0
        for n, token in enumerate(tokens):
            column = self.columns.get(token)
            state = 0 if column is None else column[state]
            if state == STOPPED:
                return n + 1
        return None


def automaton(strings: list[str] | tuple[str, ...]) -> tuple[list[dict[str, int]], list[bool]]:
    """Aho-Corasick over `strings`, its failure links folded into the transitions: (step[state][char] -> state,
    absent characters going to 0; accepting[state]: some string ends there)."""
    children: list[dict[str, int]] = [{}]
    accepting = [False]
    for s in strings:
        node = 0
        for c in s:
            if c not in children[node]:
                children[node][c] = len(children)
                children.append({})
                accepting.append(False)
            node = children[node][c]
        accepting[node] = True
    step: list[dict[str, int]] = [dict(children[0])] + [{} for _ in children[1:]]
    fail = [0] * len(children)
    queue = deque(children[0].values())
    while queue:  # breadth first: a node's failure state is complete before its children's
        node = queue.popleft()
        accepting[node] = accepting[node] or accepting[fail[node]]
        step[node] = dict(step[fail[node]])
        for c, child in children[node].items():
            step[node][c] = child
            fail[child] = step[fail[node]].get(c, 0) if node else 0
            queue.append(child)
    return step, accepting
