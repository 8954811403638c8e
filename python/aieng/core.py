"""The Rust core for framework authors: embed the block allocator or the scheduler alone.

`BlockPool` is a paged KV block pool with prefix caching; `EngineCore` is the
continuous-batching scheduler that owns one and plans each step as flat numpy arrays;
`GrammarCompiler` compiles structured-output constraints into `Grammar`s that
`EngineCore.add_request(grammar=...)` enforces (masks from `StepPlan.grammar_bitmask()`).
"""

from aieng._core import (
    BlockPool,
    BlockTable,
    EngineCore,
    FinishedRequest,
    Grammar,
    GrammarCompiler,
    StepOutputs,
    StepPlan,
    Tokenizer,
)

__all__ = [
    "BlockPool",
    "BlockTable",
    "EngineCore",
    "FinishedRequest",
    "Grammar",
    "GrammarCompiler",
    "StepOutputs",
    "StepPlan",
    "Tokenizer",
]
