"""Speculative decoding: proposers guess the next tokens of a request, one target forward
checks them all (`verify.py`), and the output is exactly what plain decoding would give.

`config.py` reads `speculative_config`; `proposer.py` is the interface every proposer meets;
`ngram.py` is prompt lookup. The Rust core schedules a decoding row's drafts after its last
token (`EngineCore.set_draft`) and counts as computed only what the verification accepts.
"""
