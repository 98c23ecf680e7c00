"""A trivial in-test engine: block allocation and chunk building for driving the Runner."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.decoder.engine.step import PlacedImages, SamplingParams, ScheduledChunk

GREEDY = SamplingParams(temperature=0.0)


class BlockAllocator:
    """Hands out block ids in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], positions: int, block_size: int) -> None:
        while len(table) * block_size < positions:
            table.append(self.free.pop())


@dataclass
class Seq:
    """One request as the engine sees it: known tokens, how many have KV, its block table."""

    rid: str
    tokens: list[int]
    sampling: SamplingParams = GREEDY
    num_prompt: int = 0
    computed: int = 0
    table: list[int] = field(default_factory=list)
    images: PlacedImages | None = None
    lora_slot: int | None = None

    def __post_init__(self):
        self.num_prompt = self.num_prompt or len(self.tokens)

    def chunk(self, n: int, alloc: BlockAllocator, block_size: int) -> ScheduledChunk:
        """The next n uncomputed tokens; marks them computed."""
        n = min(n, len(self.tokens) - self.computed)
        alloc.grow(self.table, self.computed + n, block_size)
        c = ScheduledChunk(self.rid, self.tokens[self.computed:self.computed + n], self.computed,
                           list(self.table), self.computed + n == len(self.tokens), self.sampling,
                           self.tokens[self.num_prompt:], self.num_prompt, images=self.images,
                           lora_slot=self.lora_slot)
        self.computed += n
        return c
