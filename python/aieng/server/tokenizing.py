"""Prompt text to token ids without letting one client's text hold up the others.

Two bounds come before the work. A text longer in UTF-8 bytes than the model's context can hold
is refused at once, untokenized: no token covers more bytes of text than the tokenizer's
longest token (plus `DECODER_MARGIN`, for the leading space a decoder drops), so a text past
`tokens * bytes_per_token` bytes has more than `tokens` tokens. The rest is tokenized in
`TokenizerPool`: threads of its own (the Rust tokenizer releases the GIL), never asyncio's
default pool, whose waiting jobs are served in fair shares of bytes between clients
(`FairQueue`), so a flood of large bodies from one client queues behind itself while another
client's short prompt is tokenized next. A batch of texts is tokenized in parts of about
`PART_BYTES`, each queued on its own, so no client holds a thread for long; a job of at most
`INLINE_COST` bytes runs on the event loop, cheaper than the two thread wake-ups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aieng._core import Tokenizer
from aieng.server.errors import ApiError, invalid
from aieng.server.fair_pool import FairPool

T = TypeVar("T")

THREADS = 2
PART_BYTES = 64 * 1024
DECODER_MARGIN = 4
# A job this small (its cost: bytes of text, or token ids) runs on the event loop: to a pool
# thread and back is two wake-ups, each waiting for a core on a busy machine (milliseconds under
# load, issue 37: most of a light chat turn's `prepared` stage) for tens of microseconds of work.
INLINE_COST = 1024


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of text one token decodes to (special tokens included)."""
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        longest = max(longest, len(tokenizer.decode([token_id], False).encode("utf-8")))
    return longest


def utf8_size(text: str) -> int:
    """The UTF-8 length of `text` (a str whose characters are all ASCII is its length)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class TokenizerPool(FairPool):
    def __init__(self, threads: int = THREADS) -> None:
        super().__init__(threads, "aieng-tokenize")
        self._bytes_per_token: dict[int, tuple[Tokenizer, asyncio.Future]] = {}

    async def run(self, client: tuple[str, str], cost: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args): on the event loop at a cost of at most `INLINE_COST`, else in a pool
        thread once the client's fair share comes (`FairPool.run`)."""
        if cost <= INLINE_COST:
            return fn(*args)
        return await super().run(client, cost, fn, *args)

    async def bytes_per_token(self, tokenizer: Tokenizer) -> int:
        """The most bytes of text one token of `tokenizer` covers (worked out once, in a
        pool thread; the tokenizer is held so that its id stays its own)."""
        known = self._bytes_per_token.get(id(tokenizer))
        if known is None:
            future = asyncio.get_running_loop().create_future()
            known = self._bytes_per_token[id(tokenizer)] = (tokenizer, future)
            try:
                longest = await asyncio.wrap_future(
                    self._executor.submit(longest_token_bytes, tokenizer)
                )
            except BaseException as error:
                del self._bytes_per_token[id(tokenizer)]
                future.set_exception(error)
                future.exception()  # retrieved: the waiters, if any, raise it
                raise
            future.set_result(longest + DECODER_MARGIN)
        return await asyncio.shield(known[1])

    async def encode(
        self,
        client: tuple[str, str],
        tokenizer: Tokenizer,
        texts: Sequence[str],
        add_special: bool,
        param: str,
        max_tokens: int,
    ) -> list[list[int]]:
        """Each text's token ids; a text that cannot have `max_tokens` or fewer is refused by
        its length (400 naming `param` and the limit) before anything is tokenized."""
        sizes = await self.check_sizes(tokenizer, texts, param, max_tokens)
        parts = [
            # each text at least a byte's work: many empty texts are not free
            self.run(
                client,
                sum(sizes[a:b]) + b - a,
                tokenizer.encode_batch,
                list(texts[a:b]),
                add_special,
            )
            for a, b in _parts(sizes)
        ]
        return [ids for part in await asyncio.gather(*parts) for ids in part]

    async def check_sizes(
        self, tokenizer: Tokenizer, texts: Sequence[str], param: str, max_tokens: int
    ) -> list[int]:
        per_token = await self.bytes_per_token(tokenizer)
        limit = max_tokens * per_token
        sizes = [utf8_size(t) for t in texts]
        for index, size in enumerate(sizes):
            if size > limit:
                raise too_long(param, index if len(texts) > 1 else None, size, limit, max_tokens)
        return sizes


def too_long(param: str, index: int | None, size: int, limit: int, max_tokens: int) -> ApiError:
    which = param if index is None else f"{param} {index}"
    return invalid(
        f"{which} is {size} bytes of text; {max_tokens} tokens, the most the model's context "
        f"takes here, hold at most {limit} bytes with this tokenizer, so it can never fit",
        param,
        "context_length_exceeded",
    )


def _parts(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive ranges of texts of about PART_BYTES each (a longer text is a part alone)."""
    parts, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > PART_BYTES:
            parts.append((start, index))
            start, total = index, 0
        total += size
    parts.append((start, len(sizes)))
    return parts
